"""Distillation losses (rlalign.core.distillation): hand-derived values and gradients, the expected
reverse-KL policy gradient equal to the exact reverse KL's gradient, and GKD's generalised JSD pinned
against TRL's own ``GKDTrainer.generalized_jsd_loss`` on the same logits (when TRL is installed).

The two-token example used throughout: the student's logits (0, 0) give pi_s = (1/2, 1/2); the
teacher's logits (log 1/4, log 3/4) give pi_t = (1/4, 3/4).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.core.distillation import full_reverse_kl, generalized_jsd, generalized_jsd_loss, reverse_kl_advantages, reverse_kl_loss

STUDENT = [0.0, 0.0]  # pi_s = (1/2, 1/2)
TEACHER = [math.log(0.25), math.log(0.75)]  # pi_t = (1/4, 3/4)
# KL(pi_s || pi_t) = 1/2 ln(1/2 / 1/4) + 1/2 ln(1/2 / 3/4) = 1/2 ln 2 + 1/2 ln 2/3 = 1/2 ln 4/3
REVERSE_KL = 0.5 * math.log(4 / 3)
# KL(pi_t || pi_s) = 1/4 ln(1/4 / 1/2) + 3/4 ln(3/4 / 1/2) = 1/4 ln 1/2 + 3/4 ln 3/2
FORWARD_KL = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)


def logits(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor([[values]], dtype=torch.float64, requires_grad=grad)  # (B=1, C=1, V=2)


# ----------------------------------------------------------------------------------------------
# Reverse KL in policy-gradient form
# ----------------------------------------------------------------------------------------------


def test_reverse_kl_advantages_are_the_negative_log_ratio():
    # A_t = -(log pi_s - log pi_t): row 0 (-1 + 1.5, -2 + 1) -> (-0.5, 1); row 1 (0, padding)
    student = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]])
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    torch.testing.assert_close(reverse_kl_advantages(student, teacher, mask), torch.tensor([[-0.5, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(reverse_kl_advantages(student, teacher), torch.tensor([[-0.5, 1.0], [0.0, 6.0]]))


def test_reverse_kl_loss_value_gradient_and_stats_by_hand():
    # counted tokens: (logp, A) = (-1, -0.5), (-2, 1), (-0.5, 0);  l = -A logp = (-0.5, 2, 0)
    # token-mean: (-0.5 + 2 + 0) / 3 = 0.5;  dL/dlogp = -A / 3 = (0.5/3, -1/3, 0), padding 0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = reverse_kl_loss(logp, teacher, mask, "token-mean")
    loss.backward()
    assert float(loss) == pytest.approx(0.5, abs=1e-7)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5 / 3, -1 / 3], [0.0, 0.0]]))
    # reverse_kl = mean(log pi_s - log pi_t) = (0.5 - 1 + 0) / 3; the advantages' extremes over counted tokens
    assert float(stats.reverse_kl) == pytest.approx(-1 / 6, abs=1e-7)
    assert (float(stats.advantage_min), float(stats.advantage_max)) == (-0.5, 1.0)


def test_reverse_kl_loss_with_sequence_mean_and_token_weights():
    # l = -A w logp with w = (2, 1) on row 0: -(-0.5)(2)(-1) = -1 and -(1)(1)(-2) = 2;
    # seq-mean-token-mean: row 0 (-1 + 2) / 2 = 0.5, row 1 (A = 0) 0; L = (0.5 + 0) / 2 rows = 0.25
    # dL/dlogp on row 0 = -A w / (2 tokens * 2 rows) = (0.5 * 2 / 4, -1 * 1 / 4) = (0.25, -0.25); row 1: -0 * 3 / 2 = 0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights = torch.tensor([[2.0, 1.0], [3.0, 5.0]])
    loss, _ = reverse_kl_loss(logp, teacher, mask, "seq-mean-token-mean", token_weights=weights)
    loss.backward()
    assert float(loss) == pytest.approx(0.25, abs=1e-7)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.25, -0.25], [0.0, 0.0]]))


def test_expected_reverse_kl_policy_gradient_is_the_exact_reverse_kl_gradient():
    # sum_y pi_s(y) grad l(y) with l(y) = -sg(A(y)) log pi_s(y) equals grad KL(pi_s || pi_t) (module docstring),
    # and at the two-token example that gradient is dKL/dz_k = pi_k (log pi_k - log t_k - KL):
    # z_0: 1/2 (ln 2 - 1/2 ln 4/3);  z_1: 1/2 (ln 2/3 - 1/2 ln 4/3) = -(z_0's)
    z = logits(STUDENT, grad=True)
    log_s = torch.log_softmax(z, -1)
    log_t = torch.log_softmax(logits(TEACHER), -1)
    expected_loss = 0
    for y in range(2):
        loss, _ = reverse_kl_loss(log_s[..., y], log_t[..., y])  # the sampled token y at the one position
        expected_loss = expected_loss + log_s[..., y].exp().detach() * loss  # weighted by pi_s(y), not differentiated
    (policy_gradient,) = torch.autograd.grad(expected_loss, z)
    by_hand = torch.tensor([[[0.5 * (math.log(2) - REVERSE_KL), 0.5 * (math.log(2 / 3) - REVERSE_KL)]]], dtype=torch.float64)
    torch.testing.assert_close(policy_gradient, by_hand, rtol=1e-12, atol=1e-12)
    (exact,) = torch.autograd.grad(full_reverse_kl(z, logits(TEACHER)).sum(), z)
    torch.testing.assert_close(exact, by_hand, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Full-vocabulary reverse KL and GKD's generalised JSD
# ----------------------------------------------------------------------------------------------


def test_full_reverse_kl_by_hand_and_with_temperature():
    assert float(full_reverse_kl(logits(STUDENT), logits(TEACHER))) == pytest.approx(REVERSE_KL, abs=1e-12)
    # tau = 2 on doubled logits: softmax(2z / 2) is the same distribution
    doubled = full_reverse_kl(logits([2 * v for v in STUDENT]), logits([2 * v for v in TEACHER]), temperature=2.0)
    assert float(doubled) == pytest.approx(REVERSE_KL, abs=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        full_reverse_kl(logits(STUDENT), logits(TEACHER), temperature=0.0)


@pytest.mark.parametrize(
    "beta, expected",
    [
        (0.0, FORWARD_KL),  # KL(pi_t || pi_s)
        (1.0, REVERSE_KL),  # KL(pi_s || pi_t)
        # M = 1/2 pi_t + 1/2 pi_s = (3/8, 5/8); KL(pi_t || M) = 1/4 ln(2/3) + 3/4 ln(6/5); KL(pi_s || M) = 1/2 ln(4/3) + 1/2 ln(4/5)
        (0.5, 0.5 * (0.25 * math.log(2 / 3) + 0.75 * math.log(6 / 5)) + 0.5 * (0.5 * math.log(4 / 3) + 0.5 * math.log(4 / 5))),
        # M = 0.9 pi_t + 0.1 pi_s = (0.275, 0.725); 0.9 KL(pi_t || M) + 0.1 KL(pi_s || M)
        (0.9, 0.9 * (0.25 * math.log(0.25 / 0.275) + 0.75 * math.log(0.75 / 0.725)) + 0.1 * (0.5 * math.log(0.5 / 0.275) + 0.5 * math.log(0.5 / 0.725))),
    ],
)
def test_generalized_jsd_by_hand(beta, expected):
    assert float(generalized_jsd(logits(STUDENT), logits(TEACHER), beta)) == pytest.approx(expected, abs=1e-12)


def test_generalized_jsd_gradients_by_hand_at_the_endpoints():
    # forward KL(t || s) = sum t log t - sum t log s:  d/dz_k = s_k - t_k = (1/2 - 1/4, 1/2 - 3/4) = (1/4, -1/4)
    z = logits(STUDENT, grad=True)
    (forward,) = torch.autograd.grad(generalized_jsd(z, logits(TEACHER), 0.0).sum(), z)
    torch.testing.assert_close(forward, torch.tensor([[[0.25, -0.25]]], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # reverse KL: as in the policy-gradient test above
    (reverse,) = torch.autograd.grad(generalized_jsd(z, logits(TEACHER), 1.0).sum(), z)
    by_hand = torch.tensor([[[0.5 * (math.log(2) - REVERSE_KL), 0.5 * (math.log(2 / 3) - REVERSE_KL)]]], dtype=torch.float64)
    torch.testing.assert_close(reverse, by_hand, rtol=1e-12, atol=1e-12)


def plain_jsd(student: list[float], teacher: list[float], beta: float) -> torch.Tensor:
    """JSD_beta written out over the vocabulary with explicit probabilities (no logsumexp, no special cases inside 0 < beta < 1)."""
    s = torch.softmax(torch.stack(student), 0)
    t = torch.softmax(torch.tensor(teacher, dtype=torch.float64), 0)
    m = beta * t + (1 - beta) * s
    return beta * sum(t[v] * torch.log(t[v] / m[v]) for v in range(len(t))) + (1 - beta) * sum(s[v] * torch.log(s[v] / m[v]) for v in range(len(s)))


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_gradient_matches_the_formula_written_out(beta):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, generator=g, dtype=torch.float64).tolist(), torch.randn(5, generator=g, dtype=torch.float64).tolist()
    z = logits(student, grad=True)
    (trainer,) = torch.autograd.grad(generalized_jsd(z, logits(teacher), beta).sum(), z)
    zs = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in student]
    hand = plain_jsd(zs, teacher, beta)
    hand_grad = torch.autograd.grad(hand, zs)
    assert float(generalized_jsd(logits(student), logits(teacher), beta)) == pytest.approx(float(hand), abs=1e-12)
    torch.testing.assert_close(trainer[0, 0], torch.stack(hand_grad), rtol=1e-10, atol=1e-12)


def test_generalized_jsd_properties():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    for beta in (0.0, 0.3, 1.0):
        assert (generalized_jsd(s, t, beta) >= -1e-7).all()
        assert generalized_jsd(s, s.clone(), beta).abs().max() < 1e-6  # no divergence from itself
    # swapping the two distributions swaps beta and 1 - beta (inside (0, 1)); the teacher is a constant
    torch.testing.assert_close(generalized_jsd(s, t, 0.3), generalized_jsd(t, s, 0.7))
    student, teacher = s.clone().requires_grad_(), t.clone().requires_grad_()
    generalized_jsd(student, teacher, 0.5).sum().backward()
    assert student.grad is not None and teacher.grad is None
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, 1.5)


def test_generalized_jsd_loss_aggregates_over_counted_positions_with_stats():
    # two positions counted of three: token-mean is the mean of their JSDs; the stats' reverse_kl is the exact KL
    s = torch.tensor([[STUDENT, STUDENT, [5.0, -5.0]]], dtype=torch.float64)  # (1, 3, 2)
    t = torch.tensor([[TEACHER, TEACHER, [-5.0, 5.0]]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = generalized_jsd_loss(s, t, mask, beta=1.0)
    assert float(loss) == pytest.approx(REVERSE_KL, abs=1e-12) and float(stats.jsd) == pytest.approx(REVERSE_KL, abs=1e-12)
    loss, stats = generalized_jsd_loss(s, t, mask, beta=0.0)
    assert float(loss) == pytest.approx(FORWARD_KL, abs=1e-12) and float(stats.reverse_kl) == pytest.approx(REVERSE_KL, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# TRL's GKDTrainer.generalized_jsd_loss on the same logits
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_loss_equals_trls(beta, temperature, monkeypatch):
    # TRL's reduction "batchmean" over the labelled positions (padding -100) is rlalign's token-mean
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer", reason="TRL is not installed (pip install 'rlalign[bench]')")
    g = torch.Generator().manual_seed(0)
    s, t = 2 * torch.randn(3, 5, 11, generator=g), 2 * torch.randn(3, 5, 11, generator=g)  # (B, C, V)
    mask = torch.ones(3, 5)
    mask[0, 3:], mask[2, 1:] = 0, 0
    labels = torch.where(mask > 0, 1, -100)
    ours_s, trl_s = s.clone().requires_grad_(), s.clone().requires_grad_()
    ours, _ = generalized_jsd_loss(ours_s, t, mask, beta, temperature, "token-mean")
    theirs = gkd.GKDTrainer.generalized_jsd_loss(trl_s, t, labels=labels, beta=beta, temperature=temperature)
    ours.backward()
    theirs.backward()
    assert (ours - theirs).abs().item() < 1e-6  # measured: at most 2.4e-7 (float32)
    assert (ours_s.grad - trl_s.grad).abs().max().item() < 1e-7
