"""DPO, conservative DPO, IPO and SimPO: values and gradients worked out by hand in the comments.

Inputs are sequence log-probs (summed over a response's tokens); every case has two pairs, so the
loss is the mean of two per-pair losses and each gradient carries a factor 1/2.
"""

import math

import pytest
import torch

from rlalign.core.preference import dpo_loss, ipo_loss, simpo_loss

LN3 = math.log(3.0)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-12, atol=1e-12)


def test_dpo_hand_values_and_gradients():
    # beta = ln3 / 2.  pair 0: rho_c = -1 - (-2) = 1, rho_r = -3 - (-2) = -1, h = 2, beta h = ln 3,
    # sigmoid(ln 3) = 3/4, loss -ln(3/4) = ln(4/3).  pair 1: policy == reference, h = 0, loss ln 2.
    beta = LN3 / 2
    pc, pr, rc, rr = t(-1.0, -5.0), t(-3.0, -6.0), t(-2.0, -5.0), t(-2.0, -6.0)
    loss, stats = dpo_loss(pc, pr, rc, rr, beta)
    close(loss, (math.log(4 / 3) + math.log(2)) / 2)
    loss.backward()
    # dL/d(beta h) = -(1 - sigmoid(beta h)) = -1/4 and -1/2; d(beta h)/d logp_c = beta; mean over 2 pairs
    close(pc.grad, [-beta / 4 / 2, -beta / 2 / 2])
    close(pr.grad, [beta / 4 / 2, beta / 2 / 2])
    assert rc.grad is None and rr.grad is None  # the reference is a constant
    # rewards beta * rho: chosen (beta, 0), rejected (-beta, 0); margins (2 beta, 0): one of two is > 0
    close(stats.chosen_reward, beta / 2)
    close(stats.rejected_reward, -beta / 2)
    close(stats.margin, beta)
    close(stats.accuracy, 0.5)


def test_dpo_at_the_start_is_ln2_with_gradient_minus_beta_over_2():
    # policy == reference: every h = 0, loss ln 2; dL/dlogp_c = -beta * sigmoid(0) / B = -0.1 * 0.5 / 2
    logps = t(-4.0, -9.0)
    loss, _ = dpo_loss(logps, t(-2.0, -1.0), logps.detach(), torch.tensor([-2.0, -1.0], dtype=torch.float64), beta=0.1)
    close(loss, math.log(2))
    loss.backward()
    close(logps.grad, [-0.025, -0.025])


def test_conservative_dpo_hand_values_and_its_zero_gradient_at_sigmoid_one_minus_eps():
    # eps = 1/4, beta = ln3 / 2, pairs as in the DPO test: beta h = ln 3 and 0.
    # pair 0: 3/4 * -ln(3/4) + 1/4 * -ln(sigmoid(-ln 3) = 1/4) = 3/4 ln(4/3) + 1/4 ln 4
    # pair 1: 3/4 ln 2 + 1/4 ln 2 = ln 2
    beta, eps = LN3 / 2, 0.25
    pc, pr, rc, rr = t(-1.0, -5.0), t(-3.0, -6.0), t(-2.0, -5.0), t(-2.0, -6.0)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    close(loss, (0.75 * math.log(4 / 3) + 0.25 * math.log(4) + math.log(2)) / 2)
    loss.backward()
    # dL/dx = -(1 - eps)(1 - sigmoid(x)) + eps sigmoid(x): x = ln 3: -3/4 * 1/4 + 1/4 * 3/4 = 0 (cDPO's optimum,
    # sigmoid(beta h) = 1 - eps); x = 0: -3/4 * 1/2 + 1/4 * 1/2 = -1/4, times beta, over 2 pairs
    close(pc.grad, [0.0, -0.25 * beta / 2])
    close(pr.grad, [0.0, 0.25 * beta / 2])


def test_conservative_dpo_with_eps_0_is_dpo_and_eps_out_of_range_is_an_error():
    args = (t(-1.0, -2.0), t(-3.0, -1.0), t(-2.0, -2.0), t(-2.0, -2.5))
    close(dpo_loss(*args, beta=0.3, label_smoothing=0.0)[0], dpo_loss(*args, beta=0.3)[0])
    for eps in (-0.1, 0.5):
        with pytest.raises(ValueError, match="label_smoothing"):
            dpo_loss(*args, label_smoothing=eps)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*args, beta=0.0)


def test_ipo_hand_values_and_gradients():
    # beta = 1/2: target 1 / (2 beta) = 1.
    # pair 0: rho_c / |y_c| = (-2 - (-4)) / 2 = 1, rho_r / |y_r| = (-3 - (-3)) / 3 = 0, h = 1: loss (1 - 1)^2 = 0
    # pair 1: rho_c / |y_c| = (-1 - (-7)) / 2 = 3, rho_r / |y_r| = 0 / 4, h = 3: loss (3 - 1)^2 = 4
    pc, pr, rc, rr = t(-2.0, -1.0), t(-3.0, -4.0), t(-4.0, -7.0), t(-3.0, -4.0)
    lc, lr = torch.tensor([2.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 4.0], dtype=torch.float64)
    loss, stats = ipo_loss(pc, pr, rc, rr, lc, lr, beta=0.5)
    close(loss, (0 + 4) / 2)
    loss.backward()
    # dL/dh = 2 (h - 1) = 0 and 4; dh/dlogp_c = 1/|y_c| = 1/2, dh/dlogp_r = -1/|y_r| = -1/4; over 2 pairs
    close(pc.grad, [0.0, 4 * 0.5 / 2])
    close(pr.grad, [0.0, -4 * 0.25 / 2])
    # rewards are beta * summed rho, as DPO's: chosen (1, 3), rejected (0, 0)
    close(stats.chosen_reward, 2.0)
    close(stats.rejected_reward, 0.0)
    close(stats.accuracy, 1.0)


def test_ipo_averages_the_log_ratios_per_token():
    # the same summed log-ratios over twice the tokens halve h: pair 1's h = 3 becomes 1.5, loss (1.5 - 1)^2
    pc, pr, rc, rr = t(-2.0, -1.0), t(-3.0, -4.0), t(-4.0, -7.0), t(-3.0, -4.0)
    lc, lr = torch.tensor([4.0, 4.0], dtype=torch.float64), torch.tensor([6.0, 8.0], dtype=torch.float64)
    loss, _ = ipo_loss(pc, pr, rc, rr, lc, lr, beta=0.5)
    close(loss, ((0.5 - 1) ** 2 + (1.5 - 1) ** 2) / 2)


def test_simpo_hand_values_and_gradients():
    # beta = 2, gamma = 1.  pair 0: beta/|y_c| log pi(y_c) = 2 * -2 / 4 = -1, beta/|y_r| log pi(y_r) = 2 * -6 / 3 = -4,
    # x = -1 - (-4) - 1 = 2: loss -ln sigmoid(2) = ln(1 + e^-2).
    # pair 1: 2 * -3 / 3 = -2 and 2 * -4 / 8 = -1: x = -2 + 1 - 1 = -2: loss ln(1 + e^2)
    pc, pr = t(-2.0, -3.0), t(-6.0, -4.0)
    lc, lr = torch.tensor([4.0, 3.0], dtype=torch.float64), torch.tensor([3.0, 8.0], dtype=torch.float64)
    loss, stats = simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=1.0)
    close(loss, (math.log1p(math.exp(-2)) + math.log1p(math.exp(2))) / 2)
    loss.backward()
    # dL/dx = -(1 - sigmoid(x)) = -sigmoid(-x); dx/dlogp_c = beta / |y_c|, dx/dlogp_r = -beta / |y_r|; over 2 pairs
    s0, s1 = 1 / (1 + math.exp(2)), 1 / (1 + math.exp(-2))  # sigmoid(-2), sigmoid(2)
    close(pc.grad, [-s0 * 2 / 4 / 2, -s1 * 2 / 3 / 2])
    close(pr.grad, [s0 * 2 / 3 / 2, s1 * 2 / 8 / 2])
    # rewards beta / |y| log pi: chosen (-1, -2), rejected (-4, -1); margins (3, -1): gamma does not enter the accuracy
    close(stats.chosen_reward, -1.5)
    close(stats.rejected_reward, -2.5)
    close(stats.margin, 1.0)
    close(stats.accuracy, 0.5)


def test_simpo_with_equal_average_log_probs_and_no_margin_is_ln2():
    # -1 per token on both sides (|y| = 2 and 5), gamma = 0: x = 0
    loss, _ = simpo_loss(t(-2.0), t(-5.0), torch.tensor([2.0]), torch.tensor([5.0]), beta=2.5, gamma=0.0)
    close(loss, math.log(2))
