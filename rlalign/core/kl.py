"""KL divergence estimators, exact categorical KL and entropy, and KL-coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from samples o_t ~ pi (Schulman, "Approximating KL
divergence", 2020), with x = log pi_ref(o_t) - log pi(o_t):
    k1 = -x                      unbiased, can be negative
    k2 = x^2 / 2                 biased, low variance, >= 0
    k3 = e^x - x - 1             unbiased, >= 0  (the GRPO estimator; Shao et al. 2024, eq. 4;
                                  seed 002: pi_ref/pi - log(pi_ref/pi) - 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlalign.core.masks import counted_only

__all__ = [
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_token_kl",
    "categorical_kl",
    "entropy_from_logits",
    "adaptive_kl_coef",
    "FixedKLController",
    "AdaptiveKLController",
]


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi(o) - log pi_ref(o). Shapes: (B, C) -> (B, C)."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log pi(o) - log pi_ref(o))^2 / 2. Shapes: (B, C) -> (B, C)."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1 = expm1(x) - x with x = log pi_ref - log pi; always >= 0.

    Shapes: (B, C) -> (B, C).
    """
    log_ratio = ref_logp - logp
    return torch.expm1(log_ratio) - log_ratio


def masked_token_kl(estimator: Callable[[Tensor, Tensor], Tensor], logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """``estimator``(log pi, log pi_ref) times ``mask`` on the tokens where ``mask`` > 0, and 0 elsewhere,
    with both log-probs zeroed off the mask first (:func:`rlalign.core.masks.counted_only`): k3's
    e^x of a left-out token's log-probs (an environment's, 100 nats apart after updates at a low
    temperature) would be inf, and inf x 0 NaN. The KL-shaped rewards' per-token KL. Shapes: (B, C) -> (B, C)."""
    return estimator(counted_only(logp, mask), counted_only(ref_logp, mask)) * mask


def categorical_kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """Exact KL(p || q) = sum_v p_v (log p_v - log q_v) between categoricals given by logits.

    Computed in float32, or float64 when an input is float64. Shapes: (..., V), (..., V) -> (...).
    """
    dtype = torch.promote_types(torch.promote_types(p_logits.dtype, q_logits.dtype), torch.float32)
    p_logp = F.log_softmax(p_logits.to(dtype), dim=-1)
    q_logp = F.log_softmax(q_logits.to(dtype), dim=-1)
    return (p_logp.exp() * (p_logp - q_logp)).sum(-1)


def entropy_from_logits(logits: Tensor, chunk_rows: int = 1024, temperature: float = 1.0) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v with z = logits / temperature, computed ``chunk_rows`` rows at a time.

    Chunking keeps the float32 softmax of at most ``chunk_rows`` rows alive at once instead of
    several (B, T, V) copies; gradients flow through. The temperature divides each chunk after its
    float32 cast, so bfloat16 logits lose no precision to a bfloat16 division (as ``token_logprobs``).

    Args:
        logits: Shape: (..., V), any float dtype.
    Returns:
        entropy in nats, float32 (float64 for float64 logits). Shape: (...).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    pieces = []
    for start in range(0, flat.shape[0], chunk_rows):
        compute_dtype = torch.promote_types(flat.dtype, torch.float32)
        chunk = flat[start : start + chunk_rows].to(compute_dtype)
        chunk = chunk / temperature if temperature != 1.0 else chunk
        masked_out = torch.isneginf(chunk)
        if masked_out.any():  # p = 0 there and must add 0 * z = 0, not 0 * -inf = NaN (only then a copy, saving a bool mask)
            chunk = chunk.masked_fill(masked_out, torch.finfo(compute_dtype).min)
        probs = torch.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(-1))
    entropy = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)
    return entropy.view(logits.shape[:-1])


def adaptive_kl_coef(beta: float, current_kl: float, target_kl: float, horizon: float, n_steps: int) -> float:
    """beta <- beta * (1 + K_beta * e * n / horizon), e = clip(KL / KL_target - 1, -0.2, 0.2).

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2 (K_beta = 1
    absorbed into the horizon); seed 003, "adaptive KL".

    Raises:
        ValueError: when n / horizon >= 5, where one update at e = -0.2 takes beta to 0 or below (a KL bonus).
    """
    if n_steps >= 5 * horizon:
        raise ValueError(f"the adaptive KL controller's horizon ({horizon:g}) must exceed a fifth of the {n_steps} sequences an update counts: "
                         "one update below the target would take beta to 0 or below; raise kl_horizon")
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target`` (Ziegler et al. 2019).

    The update multiplies beta, so beta = 0 would stay 0 whatever the KL: the initial ``value`` must be > 0."""

    value: float
    target: float
    horizon: float = 10000.0

    def __post_init__(self) -> None:
        if not (self.value > 0 and self.target > 0 and self.horizon > 0):
            raise ValueError(f"the adaptive KL controller needs beta, target and horizon > 0 (beta = 0 is a fixed point), got {self}")

    def update(self, current_kl: float, n_steps: int) -> float:
        self.value = adaptive_kl_coef(self.value, current_kl, self.target, self.horizon, n_steps)
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
