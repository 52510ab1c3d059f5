"""GSPO's sequence-level ratio, truncated importance-sampling weights and DAPO's overlong
punishment: values and gradients against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.core.advantages import overlong_penalty
from rlalign.core.losses import clipped_surrogate_loss, truncated_is_weights


def test_sequence_ratio_is_the_geometric_mean_clipped_per_sequence():
    # seq 0: token log-ratios [0.2, 0.0] -> s0 = exp(0.1) = 1.10517, A = +1, inside the clip: l0 = -s0
    # seq 1: token log-ratio [0.3] (second token masked) -> s1 = exp(0.3) = 1.34986, A = -1:
    #        min(s1 * -1, clip(s1, 0.8, 1.2) * -1) = min(-1.34986, -1.2) = -1.34986 -> l1 = +s1 (unclipped side)
    # seq-mean-token-mean: L = (l0 + l1) / 2
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.2, 0.0], [0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = clipped_surrogate_loss(logp, old, torch.tensor([1.0, -1.0]), mask, 0.2, mode="seq-mean-token-mean", importance_sampling="sequence")
    s0, s1 = math.exp(0.1), math.exp(0.3)
    assert loss.item() == pytest.approx((-s0 + s1) / 2, rel=1e-6)
    loss.backward()
    # dL/dlogp_{0,t} = 1/2 * d(-s0)/dlogp_{0,t} = -s0 * (1/2) / 2 for each of its 2 tokens; dL/dlogp_{1,0} = s1 * 1 / 2; masked token 0
    expected = torch.tensor([[-s0 / 4, -s0 / 4], [s1 / 2, 0.0]])
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=1e-6)
    assert stats.ratio_mean.item() == pytest.approx((2 * s0 + s1) / 3, rel=1e-6)  # over counted tokens


def test_sequence_ratio_is_clipped_as_a_whole():
    # s = exp(mean(0.5, 0.3)) = exp(0.4) = 1.4918 > 1.2 with A = +1: clipped, no gradient at all
    logp = torch.tensor([[0.5, 0.3]], requires_grad=True)
    loss, stats = clipped_surrogate_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), None, 0.2, importance_sampling="sequence")
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0 and stats.clip_frac.item() == 1.0


def test_one_token_sequences_make_the_sequence_ratio_the_token_ratio():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(5, 1), torch.randn(5, 1), torch.randn(5)
    a, _ = clipped_surrogate_loss(logp, old, adv, None, 0.2, importance_sampling="sequence")
    b, _ = clipped_surrogate_loss(logp, old, adv, None, 0.2)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_truncated_importance_weights_hand_values():
    # pi_old / pi_sampler = [1.5, 3, 0.5] with C = 2 -> w = [1.5, 2, 0.5]; one of three truncated
    sampler = torch.zeros(1, 3)
    old = torch.log(torch.tensor([[1.5, 3.0, 0.5]]))
    weights, stats = truncated_is_weights(old, sampler, 2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 2.0, 0.5]]))
    assert stats.weight_mean.item() == pytest.approx(4 / 3) and stats.weight_min.item() == pytest.approx(0.5)
    assert stats.truncated_frac.item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, sampler, 0.0)


def test_token_weights_scale_each_tokens_loss_and_gradient():
    # at r = 1 the surrogate's per-token loss is -A and its gradient -A; weights w scale both:
    # token-mean L = -(1.5 * 2 + 0.5 * 2) / 2 = -2, dL/dlogp_t = -w_t A / 2 = [-1.5, -0.5]
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = clipped_surrogate_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), None, 0.2, token_weights=torch.tensor([[1.5, 0.5]]))
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -0.5]]))


def test_overlong_penalty_hand_values():
    # L_max = 10, L_buf = 4: free up to 6 tokens, then (6 - |y|) / 4 down to -1 at 10, -1 beyond
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 10, 11)
    with pytest.raises(ValueError, match="overlong buffer"):  # an empty buffer: the ramp would divide by 0
        overlong_penalty(lengths, 10, 0)
    torch.testing.assert_close(overlong_penalty(lengths, 10, 10), torch.tensor([-0.3, -0.6, -0.7, -0.8, -1.0, -1.0]))  # the whole budget
