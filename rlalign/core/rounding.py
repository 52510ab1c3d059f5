"""Stochastic rounding of float32 to bfloat16, for weights held in bfloat16.

A bfloat16 number keeps float32's 8 exponent bits and the top 7 of its 23 mantissa bits, so
between two neighbours a and b = a + ulp(a), ulp(a) = 2^(e - 7) for |a| in [2^e, 2^(e + 1)).
Round to nearest (what ``.to(torch.bfloat16)`` does) maps a + d to a whenever |d| < ulp(a) / 2: an
AdamW step of about lr on a weight w is lost when lr < |w| 2^-9 or so (lr 1e-6 against weights of
0.02, whose ulp is 1.2e-4: nearly every step of an RL fine-tune). Stochastic rounding instead
rounds x in [a, b] up with probability (x - a) / (b - a):

    R(x) = b  with probability (x - a) / ulp(a),   a otherwise,     so   E[R(x)] = x

and a small step moves the weight in expectation (Gupta et al. 2015, "Deep Learning with Limited
Numerical Precision"; Zamirai et al. 2020, "Revisiting BFloat16 Training": bfloat16 weights with
stochastic rounding train as float32 weights do). On the bit pattern this is: add a uniform
16-bit integer to the float32's low 16 bits and truncate them; a carry into bit 16 is a round up,
which happens with probability (low bits) / 2^16 = (x - a) / ulp(a). Sign and magnitude are
separate in IEEE floats, so a negative x rounds away from zero with that probability, as it must.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["stochastic_round_to_bfloat16", "bfloat16_spacing"]


def stochastic_round_to_bfloat16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """R(x): ``x`` (float32) rounded to one of its two bfloat16 neighbours, up with probability
    (x - a) / ulp(a) (module docstring); exact where x is a bfloat16 number, and infinities and
    NaN pass through. ``generator``: the source of the 16 random bits per element (on x's device).
    Shape: (...) -> (...), bfloat16."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bfloat16 takes float32, got {x.dtype}")
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)  # (...) uniform low bits
    rounded = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)  # carry into bit 16 = round up; low bits cleared: exact in bfloat16
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)  # rounded may round the largest finite values up to inf, as rounding does


def bfloat16_spacing(x: Tensor) -> Tensor:
    """ulp(x): the distance from |x| (as bfloat16) to the next larger bfloat16 number, 2^(e - 7)
    for |x| in [2^e, 2^(e + 1)) (the subnormal spacing 2^-133 near 0). Shape: (...) -> (...), float32."""
    magnitude = x.detach().to(torch.bfloat16).abs()
    return (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).float()
