"""Stochastic rounding to bfloat16 (rlalign.core.rounding), by hand: the two neighbours, how often
each is taken, exact values, signs, infinities; and the spacing of bfloat16 numbers."""

from __future__ import annotations

import pytest
import torch

from rlalign.core.rounding import bfloat16_spacing, stochastic_round_to_bfloat16


def test_the_spacing_of_bfloat16_numbers_by_hand():
    # 8 significant bits: 2^(e - 7) for |x| in [2^e, 2^(e + 1)); 0.02 is in [2^-6, 2^-5)
    x = torch.tensor([1.0, 1.5, -1.0, 0.02, 2.0**-6, 3.0, 0.0])
    expected = torch.tensor([2.0**-7, 2.0**-7, 2.0**-7, 2.0**-13, 2.0**-13, 2.0**-6, 2.0**-133])
    assert torch.equal(bfloat16_spacing(x), expected)


@pytest.mark.parametrize("base,fraction", [(1.0, 0.25), (1.0, 0.75), (-1.0, 0.25), (0.02, 0.5), (3.0, 1 / 128)])
def test_a_value_between_two_neighbours_rounds_up_as_often_as_it_is_close_to_the_upper(base, fraction):
    # x = a + f ulp(a) (away from zero for a < 0): R(x) is a or a + ulp, the latter with probability f
    a = torch.tensor(base).bfloat16().float()
    ulp = bfloat16_spacing(a)
    x = torch.full((100_000,), float(a + torch.sign(a) * fraction * ulp))
    rounded = stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(0)).float()
    up = (rounded.abs() > a.abs()).float()
    assert set(rounded.unique().tolist()) <= {float(a), float(a + torch.sign(a) * ulp)}
    n = x.numel()
    assert abs(up.mean().item() - fraction) < 5 * (fraction * (1 - fraction) / n) ** 0.5 + 1 / n  # 5 binomial standard deviations
    assert abs(rounded.mean().item() - x[0].item()) < 5 * ulp.item() * (fraction * (1 - fraction) / n) ** 0.5 + 1e-12  # E[R(x)] = x


def test_bfloat16_numbers_infinities_and_nan_are_kept():
    x = torch.tensor([1.0, -0.5, 0.0, -0.0, 2.0**-130, float("inf"), float("-inf"), float("nan"), float(torch.tensor(0.02).bfloat16())])
    for seed in range(20):
        out = stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(seed))
        assert out.dtype == torch.bfloat16
        assert torch.equal(out[:7].float(), x[:7]) and out[7].isnan() and out[8].float() == x[8]


def test_the_same_generator_state_gives_the_same_rounding_and_float32_only():
    x = torch.randn(1000) * 0.02
    first = stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(3))
    assert torch.equal(first, stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(3)))
    assert not torch.equal(first, stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(4)))
    with pytest.raises(TypeError, match="float32"):
        stochastic_round_to_bfloat16(x.double())
