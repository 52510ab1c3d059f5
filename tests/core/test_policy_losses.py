"""CISPO and SAPO: values and gradients against hand-derived numbers (rlalign.core.policy_losses)."""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.core.losses import clipped_surrogate_loss
from rlalign.core.policy_losses import cispo_loss, sapo_loss


def shifted(logp: list[float], ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with grad, old_logp = logp - log r): the ratios pi / pi_old are ``ratios`` exactly at these log-probs."""
    lp = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[x - math.log(r) for x, r in zip(logp, ratios)]], dtype=torch.float64)
    return lp, old


# ----------------------------------------------------------------------------------------------
# CISPO: l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi
# ----------------------------------------------------------------------------------------------


def test_cispo_hand_values_without_a_lower_bound():
    # r = [1.5, 6, 0.5], eps_high = 4 (cap 5), no lower bound: weights [1.5, 5, 0.5]; A = 2, log pi = [-1, -2, -0.5]
    # token-mean: L = -(1.5*2*(-1) + 5*2*(-2) + 0.5*2*(-0.5)) / 3 = 23.5 / 3
    # dL/dlog pi_t = -w_t A / 3 = [-1, -10/3, -1/3]: the capped token still carries gradient
    logp, old = shifted([-1.0, -2.0, -0.5], [1.5, 6.0, 0.5])
    loss, stats = cispo_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), eps_high=4.0)
    assert loss.item() == pytest.approx(23.5 / 3, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -10 / 3, -1 / 3]], dtype=torch.float64))
    assert stats.clip_frac.item() == pytest.approx(1 / 3) and stats.clip_frac_high.item() == pytest.approx(1 / 3) and stats.clip_frac_low.item() == 0.0
    assert stats.ratio_mean.item() == pytest.approx((1.5 + 6 + 0.5) / 3)
    # approx_kl = mean((r - 1) - log r)
    assert stats.approx_kl.item() == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 6.0, 0.5)) / 3)


def test_cispo_lower_bound_and_mask():
    # eps_low = 0.2, eps_high = 0.3: weights clip(r, 0.8, 1.3): r = [0.5, 1.1, 2.0] -> [0.8, 1.1, 1.3]; the fourth token is masked
    # A = -1, seq-mean-token-sum of the one row: l = -w A log pi = w log pi, so L = 0.8*(-1) + 1.1*(-3) + 1.3*(-0.2) = -4.36
    # dL/dlog pi_t = -w_t A = w_t = [0.8, 1.1, 1.3], masked 0
    logp, old = shifted([-1.0, -3.0, -0.2, -7.0], [0.5, 1.1, 2.0, 9.0])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = cispo_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask, eps_low=0.2, eps_high=0.3, mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-4.36, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.8, 1.1, 1.3, 0.0]], dtype=torch.float64))
    assert stats.clip_frac_low.item() == pytest.approx(1 / 3) and stats.clip_frac_high.item() == pytest.approx(1 / 3)
    assert stats.clip_frac.item() == pytest.approx(2 / 3)


def test_cispo_keeps_the_gradient_the_clipped_surrogate_drops():
    # A = 1, r = 2 > 1.2: the clipped surrogate's gradient is 0; CISPO's is -min(2, 1 + eps_high) * A = -1.3 (eps_high 0.3)
    logp, old = shifted([-1.0], [2.0])
    clip_loss, _ = clipped_surrogate_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), eps_low=0.2)
    clip_loss.backward()
    assert logp.grad.item() == 0.0
    logp.grad = None
    loss, _ = cispo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), eps_high=0.3)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.3)


def test_cispo_at_ratio_one_is_reinforce():
    # r = 1 everywhere: the weight is 1 and the gradient is REINFORCE's -A / n per token
    torch.manual_seed(0)
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.randn(3, dtype=torch.float64)
    loss, _ = cispo_loss(logp, logp.detach(), adv)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv[:, None].expand(3, 4) / 12)


def test_cispo_token_weights_scale_each_token():
    # r = 1, A = 2, weights [1.5, 0]: token-mean L = -(1.5 * 2 * logp_0 + 0) / 2; dL/dlogp = [-1.5, 0]
    logp = torch.tensor([[-0.4, -0.9]], dtype=torch.float64, requires_grad=True)
    loss, _ = cispo_loss(logp, logp.detach(), torch.tensor([2.0], dtype=torch.float64), token_weights=torch.tensor([[1.5, 0.0]], dtype=torch.float64))
    assert loss.item() == pytest.approx(-(1.5 * 2 * -0.4) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("eps_low, eps_high", [(0.0, 0.2), (1.0, 0.2), (0.2, 0.0)])
def test_cispo_rejects_bad_bounds(eps_low, eps_high):
    with pytest.raises(ValueError, match="CISPO"):
        cispo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), eps_low=eps_low, eps_high=eps_high)


# ----------------------------------------------------------------------------------------------
# SAPO: l_t = -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg
# ----------------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_on_policy_is_the_policy_gradient_with_value_minus_two_a_over_tau():
    # r = 1: sigmoid(0) = 1/2, so l = -(4 / tau) (1/2) A = -2 A / tau; the gate 4 s (1 - s) = 1, gradient -A r = -A
    # A = [1, -1] with tau_pos = 1, tau_neg = 1.05, token-mean over 2: L = (-2 + 2 / 1.05) / 2
    logp = torch.tensor([[-0.7], [-1.1]], dtype=torch.float64, requires_grad=True)
    loss, stats = sapo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0], dtype=torch.float64), temperature_pos=1.0, temperature_neg=1.05)
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5], [0.5]], dtype=torch.float64))
    assert stats.gate_mean.item() == pytest.approx(1.0) and stats.ratio_mean.item() == 1.0 and stats.approx_kl.item() == 0.0


def test_sapo_off_policy_hand_values():
    # token 0: r = 2, A = 1, tau_pos = 1:     s0 = sigmoid(1),          l0 = -4 s0,             dl0/dlog pi = -4 s0 (1 - s0) * 2
    # token 1: r = 0.5, A = -1, tau_neg = 1.05: s1 = sigmoid(-0.525),  l1 = (4 / 1.05) s1,     dl1/dlog pi = +4 s1 (1 - s1) * 0.5
    # token-mean over the two tokens (one row): L = (l0 + l1) / 2, gradients halved
    logp, old = shifted([-1.0, -2.0], [2.0, 0.5])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, stats = sapo_loss(logp, old, adv, temperature_pos=1.0, temperature_neg=1.05)
    s0, s1 = sigmoid(1.0), sigmoid(1.05 * -0.5)
    assert loss.item() == pytest.approx((-4 * s0 + 4 / 1.05 * s1) / 2, rel=1e-12)
    loss.backward()
    expected = torch.tensor([[-4 * s0 * (1 - s0) * 2 / 2, 4 * s1 * (1 - s1) * 0.5 / 2]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)
    assert stats.gate_mean.item() == pytest.approx((4 * s0 * (1 - s0) + 4 * s1 * (1 - s1)) / 2, rel=1e-12)
    # where the clip would drop token 0 (r = 2 > 1.2, A > 0), SAPO only attenuates it: 4 s0 (1 - s0) = 0.786
    assert 0.7 < 4 * s0 * (1 - s0) < 0.8


def test_sapo_negative_temperature_damps_more():
    # the same |r - 1| = 0.5 on both sides of 1: a larger tau (the negative side's) shrinks the gate 4 s (1 - s) more
    logp, old = shifted([-1.0, -1.0], [1.5, 1.5])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = sapo_loss(logp, old, adv, temperature_pos=1.0, temperature_neg=3.0, mode="seq-mean-token-sum")
    loss.backward()
    s_pos, s_neg = sigmoid(0.5), sigmoid(1.5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-4 * s_pos * (1 - s_pos) * 1.5, 4 * s_neg * (1 - s_neg) * 1.5]], dtype=torch.float64))
    assert abs(logp.grad[0, 1]) < abs(logp.grad[0, 0])


def test_sapo_gradient_matches_its_closed_form_on_random_inputs():
    # dL/dlog pi_t = -A_t 4 s_t (1 - s_t) r_t m_t / sum m  (token-mean), s_t = sigmoid(tau_t (r_t - 1))
    torch.manual_seed(1)
    logp = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(4, 5, dtype=torch.float64)
    adv = torch.randn(4, dtype=torch.float64)
    mask = (torch.rand(4, 5) > 0.3).double()
    weights = torch.rand(4, 5, dtype=torch.float64)
    loss, _ = sapo_loss(logp, old, adv, mask, 0.7, 1.4, token_weights=weights)
    loss.backward()
    r = torch.exp(logp.detach() - old)
    a = adv[:, None].expand(4, 5)
    tau = torch.where(a > 0, torch.full_like(a, 0.7), torch.full_like(a, 1.4))
    s = torch.sigmoid(tau * (r - 1))
    torch.testing.assert_close(logp.grad, -a * 4 * s * (1 - s) * r * weights * mask / mask.sum(), rtol=1e-12, atol=1e-15)


def test_sapo_rejects_non_positive_temperatures():
    with pytest.raises(ValueError, match="SAPO"):
        sapo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), temperature_pos=0.0)


def test_sapo_zero_advantage_takes_the_negative_temperature():
    # TRL's convention: tau_pos only where A > 0; a token with A = 0 has no loss, and its gate statistic uses tau_neg
    # r = 2: gate 4 s (1 - s) with s = sigmoid(3 * 1) under tau_neg = 3 (not sigmoid(1 * 1))
    logp, old = shifted([-1.0], [2.0])
    loss, stats = sapo_loss(logp, old, torch.tensor([0.0], dtype=torch.float64), temperature_pos=1.0, temperature_neg=3.0)
    s = sigmoid(3.0)
    assert loss.item() == 0.0 and stats.gate_mean.item() == pytest.approx(4 * s * (1 - s), rel=1e-12)
