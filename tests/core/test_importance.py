"""The sampler's importance weights (rlalign.core.importance): truncated or masked, per token or per
sequence, one- or two-sided (IcePop), against hand-derived numbers and TRL's definitions."""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.core.importance import importance_weights, masked_is_weights, truncated_is_weights

# token ratios rho = pi_old / pi_sampler [0.3, 1.5, 3.0]; band [0.5, 2.0]
SAMPLER = torch.zeros(1, 3)
OLD = torch.log(torch.tensor([[0.3, 1.5, 3.0]]))


def test_token_truncation_into_a_band():
    # clip(rho, 0.5, 2) = [0.5, 1.5, 2]: one below, one above, none masked
    weights, stats = importance_weights(OLD, SAMPLER, high=2.0, low=0.5)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.5, 2.0]]))
    assert stats.weight_mean.item() == pytest.approx(4 / 3) and stats.weight_min.item() == pytest.approx(0.5)
    assert stats.truncated_frac.item() == pytest.approx(2 / 3) and stats.masked_frac.item() == 0.0
    assert stats.low_frac.item() == pytest.approx(1 / 3) and stats.high_frac.item() == pytest.approx(1 / 3)


def test_token_masking_outside_a_band_is_icepop():
    # rho * 1[0.5 <= rho <= 2] = [0, 1.5, 0]: the ratio is kept inside the band (not 1), both tails leave the loss
    weights, stats = importance_weights(OLD, SAMPLER, high=2.0, low=0.5, mode="mask")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.5, 0.0]]))
    assert stats.masked_frac.item() == pytest.approx(2 / 3) and stats.truncated_frac.item() == pytest.approx(2 / 3)
    assert stats.weight_mean.item() == pytest.approx(0.5) and stats.weight_min.item() == 0.0


def test_one_sided_bounds():
    # cap only: [0.3, 1.5, 0] masked / [0.3, 1.5, 2] truncated; floor only: [0, 1.5, 3] masked / [0.5, 1.5, 3] truncated
    torch.testing.assert_close(importance_weights(OLD, SAMPLER, high=2.0, mode="mask")[0], torch.tensor([[0.3, 1.5, 0.0]]))
    torch.testing.assert_close(importance_weights(OLD, SAMPLER, high=2.0)[0], torch.tensor([[0.3, 1.5, 2.0]]))
    torch.testing.assert_close(importance_weights(OLD, SAMPLER, low=0.5, mode="mask")[0], torch.tensor([[0.0, 1.5, 3.0]]))
    torch.testing.assert_close(importance_weights(OLD, SAMPLER, low=0.5)[0], torch.tensor([[0.5, 1.5, 3.0]]))
    # the named wrappers are the token-level cap
    torch.testing.assert_close(truncated_is_weights(OLD, SAMPLER, 2.0)[0], torch.tensor([[0.3, 1.5, 2.0]]))
    torch.testing.assert_close(masked_is_weights(OLD, SAMPLER, 2.0)[0], torch.tensor([[0.3, 1.5, 0.0]]))


def test_sequence_ratio_is_the_product_of_the_counted_token_ratios():
    # TRL's sequence_* modes: rho_i = exp(sum_t m_t (log pi_old - log pi_sampler)), one weight for every token of row i.
    # row 0: log-ratios [0.4, 0.5] -> rho_0 = e^0.9 = 2.4596 > 2;  row 1: [-0.1, 9 (masked)] -> rho_1 = e^-0.1 = 0.9048
    old = torch.tensor([[0.4, 0.5], [-0.1, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    truncated, stats = importance_weights(old, torch.zeros(2, 2), mask, high=2.0, level="sequence")
    rho_1 = math.exp(-0.1)
    torch.testing.assert_close(truncated, torch.tensor([[2.0, 2.0], [rho_1, rho_1]]))
    assert stats.truncated_frac.item() == pytest.approx(1 / 2)  # one weight a row: over the rows, as TRL logs them (row 0 of two)
    masked, stats = importance_weights(old, torch.zeros(2, 2), mask, high=2.0, level="sequence", mode="mask")
    torch.testing.assert_close(masked, torch.tensor([[0.0, 0.0], [rho_1, rho_1]]))
    assert stats.masked_frac.item() == pytest.approx(1 / 2) and stats.weight_min.item() == 0.0
    assert stats.weight_mean.item() == pytest.approx(rho_1 / 2)  # over counted tokens it was rho_1 / 3
    # the product, not GSPO's geometric mean: e^0.9 is over the cap, e^0.45 = 1.57 would not be
    assert math.exp(0.9) > 2.0 > math.exp(0.45)


def test_one_token_sequences_make_both_levels_agree():
    torch.manual_seed(0)
    old, sampler = torch.randn(6, 1) * 0.5, torch.randn(6, 1) * 0.5
    for mode in ("truncate", "mask"):
        a, _ = importance_weights(old, sampler, high=1.3, low=0.8, mode=mode, level="token")
        b, _ = importance_weights(old, sampler, high=1.3, low=0.8, mode=mode, level="sequence")
        torch.testing.assert_close(a, b)


def test_weights_are_detached():
    old = torch.zeros(1, 2, requires_grad=True)
    weights, _ = importance_weights(old, torch.zeros(1, 2), high=2.0)
    assert not weights.requires_grad


@pytest.mark.parametrize(
    "kwargs, message",
    [({}, "need a bound"), ({"high": 0.0}, "cap"), ({"low": -1.0}, "floor"), ({"high": 1.0, "low": 1.0}, "below the cap"),
     ({"high": 2.0, "mode": "clip"}, "mode"), ({"high": 2.0, "level": "batch"}, "level")],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        importance_weights(OLD, SAMPLER, **kwargs)


def test_the_band_is_closed():
    # TRL masks ratio < C_min or ratio > C_max: a ratio exactly at a bound (here exp(0) = 1) keeps its weight
    same = torch.zeros(1, 2)
    for kwargs in ({"low": 1.0, "high": 2.0}, {"low": 0.5, "high": 1.0}):
        weights, stats = importance_weights(same, same, mode="mask", **kwargs)
        assert (weights == 1.0).all() and stats.truncated_frac.item() == 0.0 and stats.masked_frac.item() == 0.0


@pytest.mark.parametrize("row_weight", [1.0, 0.5, 1 / 3])
def test_a_weighted_rows_sequence_ratio_is_its_own_whatever_the_rows_weight(row_weight):
    # log pi_old - log pi_sampler = 0.3 on each of 3 tokens: the sequence ratio is e^0.9 = 2.459603; an agent's
    # row weight (1/k of an episode's k calls) weighs the row's loss, not its ratio (it gave e^(0.9 w))
    old, sampler = torch.tensor([[-1.0, -1.2, -0.8, 0.0]]), torch.tensor([[-1.3, -1.5, -1.1, 0.0]])
    mask = torch.tensor([[row_weight] * 3 + [0.0]])
    weights, stats = importance_weights(old, sampler, mask, high=5.0, level="sequence")
    assert weights[0, :3].tolist() == pytest.approx([2.459603] * 3, rel=1e-6)
    assert float(stats.weight_mean) == pytest.approx(2.459603, rel=1e-6)
