import math

import pytest
import torch

from rlalign.core.losses import (
    aggregate,
    bradley_terry_loss,
    clipped_surrogate_loss,
    entropy_loss,
    explained_variance,
    kl_penalty_loss,
    policy_gradient_loss,
    sft_loss,
    value_loss,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 50.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_aggregation_modes_hand_values():
    assert aggregate(VALUES, MASK, "token-mean").item() == 2.5  # (1+2+3+4) / 4
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == 3.0  # (6/3 + 4/1) / 2
    assert aggregate(VALUES, MASK, "seq-mean-token-sum").item() == 5.0  # (6 + 4) / 2
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 6)  # 10 / (2 * 3)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_len=5).item() == 1.0  # 10 / (2 * 5)
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(VALUES, MASK, "sum")


def test_seq_mean_token_mean_skips_empty_sequences():
    # the empty second row neither adds a zero nor counts as a sequence
    assert aggregate(VALUES, torch.tensor([[1, 1, 1], [0, 0, 0]]), "seq-mean-token-mean").item() == 2.0


def test_policy_gradient_loss_gradient_is_minus_advantage_times_score():
    # L = -(2*logp0 - 1*logp1) / 2  ->  dL/dlogp = (-1, 0.5)
    logp = torch.tensor([-0.3, -1.2], requires_grad=True)
    loss, stats = policy_gradient_loss(logp, torch.tensor([2.0, -1.0]))
    assert loss.item() == pytest.approx(-(2 * -0.3 - 1 * -1.2) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1.0, 0.5]))
    assert stats.advantage_mean.item() == 0.5


def _surrogate(delta, advantage, **kw):
    logp = torch.tensor([delta], requires_grad=True)
    loss, stats = clipped_surrogate_loss(logp, torch.tensor([0.0]), torch.tensor([advantage]), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_clipped_surrogate_hand_values():
    # logp - old_logp = 1 -> ratio e; A = 1: min(e, 1.2) = 1.2, loss -1.2, clipped so no gradient
    loss, grad, stats = _surrogate(1.0, 1.0, eps_low=0.2)
    assert loss == pytest.approx(-1.2) and grad == 0.0
    assert stats.clip_frac_high.item() == 1.0 and stats.clip_frac_low.item() == 0.0
    # A = -1, ratio e: min(-e, -1.2) = -e, loss e, not clipped: dL/dlogp = -A * ratio = e
    loss, grad, stats = _surrogate(1.0, -1.0, eps_low=0.2)
    assert loss == pytest.approx(math.e) and grad == pytest.approx(math.e)
    assert stats.clip_frac.item() == 0.0
    # A = -1, ratio 1/e = 0.368 < 0.8: min(-0.368, -0.8) = -0.8, loss 0.8, no gradient
    loss, grad, stats = _surrogate(-1.0, -1.0, eps_low=0.2)
    assert loss == pytest.approx(0.8) and grad == 0.0 and stats.clip_frac_low.item() == 1.0
    # A = 1, ratio 1/e: min(0.368, 0.8) = 0.368, loss -0.368, gradient -ratio = -0.368
    loss, grad, _ = _surrogate(-1.0, 1.0, eps_low=0.2)
    assert loss == pytest.approx(-1 / math.e) and grad == pytest.approx(-1 / math.e)


def test_clip_higher_uses_eps_high_on_the_upper_side():
    # ratio e, A = 1, eps_high = 0.28 -> loss -1.28
    assert _surrogate(1.0, 1.0, eps_low=0.2, eps_high=0.28)[0] == pytest.approx(-1.28)
    # ratio 1/e, A = -1, eps_low = 0.2 -> loss 0.8 (eps_high does not matter)
    assert _surrogate(-1.0, -1.0, eps_low=0.2, eps_high=0.28)[0] == pytest.approx(0.8)


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 = 7.389, A = -1: standard loss 7.389, dual clip c = 3 caps it at -c*A = 3, no gradient
    loss, grad, stats = _surrogate(2.0, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and stats.dual_clip_frac.item() == 1.0
    # below the cap nothing changes: ratio e, loss e < 3
    assert _surrogate(1.0, -1.0, dual_clip=3.0)[0] == pytest.approx(math.e)
    with pytest.raises(ValueError, match="dual_clip"):
        _surrogate(0.0, 1.0, dual_clip=0.5)


def test_gradient_is_zero_exactly_where_the_seeds_say():
    eps = 0.2
    deltas = torch.linspace(-1.0, 1.0, 41)
    ratios = deltas.exp()
    for advantage in (1.0, -1.0):
        logp = deltas.clone().requires_grad_()
        loss, _ = clipped_surrogate_loss(logp, torch.zeros(41), torch.full((41,), advantage), eps_low=eps)
        loss.backward()
        if advantage > 0:
            zero = ratios > 1 + eps
        else:
            zero = ratios < 1 - eps
        assert (logp.grad[zero] == 0).all()
        assert (logp.grad[~zero] != 0).all()


def test_ratio_is_exactly_one_when_old_equals_new():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g).requires_grad_()
    advantages = torch.randn(4, generator=g)
    mask = torch.ones(4, 6)
    loss, stats = clipped_surrogate_loss(logp, logp.detach().clone(), advantages, mask, mode="seq-mean-token-mean")
    assert stats.ratio_mean.item() == 1.0
    assert stats.approx_kl.item() == 0.0 and stats.clip_frac.item() == 0.0
    # with ratio 1 the loss is -mean(A) and its gradient equals the policy-gradient loss's
    assert loss.item() == pytest.approx(-advantages.mean().item(), abs=1e-7)
    loss.backward()
    clip_grad = logp.grad.clone()
    logp.grad = None
    policy_gradient_loss(logp, advantages, mask, mode="seq-mean-token-mean")[0].backward()
    torch.testing.assert_close(clip_grad, logp.grad)


def test_approx_kl_statistic_hand_value():
    # log r = 0.5: (r - 1) - log r = e^0.5 - 1.5 = 0.148721
    _, _, stats = _surrogate(0.5, 1.0, eps_low=10.0)
    assert stats.approx_kl.item() == pytest.approx(math.exp(0.5) - 1.5, abs=1e-6)


def test_value_loss_hand_values():
    # 0.5 * mean((1-0)^2, (2-0)^2) = 0.5 * 2.5 = 1.25
    loss, _ = value_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    assert loss.item() == 1.25
    # clipped: V = 1, V_old = 0.5, R = 1, c = 0.2 -> V_clip = 0.7; max(0, 0.09) / 2 = 0.045
    values = torch.tensor([1.0], requires_grad=True)
    loss, stats = value_loss(values, torch.tensor([1.0]), old_values=torch.tensor([0.5]), clip_range=0.2)
    assert loss.item() == pytest.approx(0.045) and stats.clip_frac.item() == 1.0
    loss.backward()
    assert values.grad.item() == 0.0  # the clipped branch is flat in V
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, torch.tensor([1.0]), clip_range=0.2)


def test_value_clip_fraction_ignores_round_off_inside_the_range():
    # |V - V_old| < c everywhere: nothing is clipped, although V_old + (V - V_old) != V in float32 for
    # some entries (here ~0.2%: V_old near 0, V near 0.1); there the clipped error differs from the
    # error in the last bits, and comparing the two alone counted ~0.03% of the entries as clipped
    generator = torch.Generator().manual_seed(0)
    old_values = 1e-3 * torch.rand(100_000, generator=generator)
    values = 0.1 + 0.05 * torch.rand(100_000, generator=generator)
    assert not torch.equal(old_values + (values - old_values), values)
    _, stats = value_loss(values, torch.randn(100_000, generator=generator), old_values=old_values, clip_range=0.2)
    assert stats.clip_frac.item() == 0.0
    # and past the range on one side only: V - V_old = 0.3 > c, with V farther from R than V_clip
    _, stats = value_loss(torch.tensor([1.3, 1.3]), torch.tensor([0.0, 2.0]), old_values=torch.tensor([1.0, 1.0]), clip_range=0.2)
    assert stats.clip_frac.item() == 0.5  # R = 0: V_clip = 1.2 is nearer, the max keeps V's error; R = 2: V_clip's error is larger


def test_explained_variance():
    target = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(target, target).item() == 1.0
    assert explained_variance(torch.full((4,), 2.5), target).item() == 0.0
    # residual (1, -1, 1, -1): var 4/3 vs var(target) 5/3 -> 1 - 0.8 = 0.2
    assert explained_variance(target - torch.tensor([1.0, -1, 1, -1]), target).item() == pytest.approx(0.2, abs=1e-6)
    assert explained_variance(target, torch.ones(4)).item() == 0.0


def test_entropy_loss_is_minus_mean_entropy():
    loss, stats = entropy_loss(torch.tensor([[1.0, 3.0], [2.0, 9.0]]), torch.tensor([[1, 1], [1, 0]]))
    assert loss.item() == -2.0 and stats.entropy.item() == 2.0


def test_kl_penalty_loss_uses_k3_by_default():
    # pi = 0.5, pi_ref = 0.25 on one token: k3 = 0.193147, k1 = 0.693147
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty_loss(logp, ref)[0].item() == pytest.approx(0.1931472, abs=1e-6)
    assert kl_penalty_loss(logp, ref, estimator="k1")[1].kl.item() == pytest.approx(0.6931472, abs=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty_loss(logp, ref, estimator="k4")


def test_sft_loss_counts_completion_tokens_only():
    logp = torch.tensor([[-9.0, -1.0, -3.0], [-9.0, -2.0, -7.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    loss, stats = sft_loss(logp, mask)
    assert loss.item() == 2.0 and stats.tokens.item() == 3  # (1 + 3 + 2) / 3


def test_bradley_terry_hand_values():
    # r_c - r_r = 1: -log sigmoid(1) = log(1 + e^-1) = 0.313262
    loss, stats = bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-6)
    assert stats.accuracy.item() == 1.0 and stats.margin_mean.item() == 1.0
    # margin 1 shifts the difference to 0: ln 2
    loss, _ = bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), margin=torch.tensor([1.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    # centring adds c * mean((r_c + r_r)^2) = 0.1 * 9
    loss, _ = bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), center_coef=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)) + 0.9, abs=1e-6)
    # the gradient pushes chosen up and rejected down
    chosen, rejected = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


@pytest.mark.parametrize("row_weight", [1.0, 1 / 3])
def test_gspo_sequence_ratio_is_the_mean_token_log_ratio_whatever_the_rows_weight(row_weight):
    # token log-ratios 0.2 and 0.4 (a third column of padding): s = exp(0.3) = 1.349859 for a row weighted 1 or 1/3
    # (the weight divided the sum by max(2/3, 1) = 1: exp(0.2) before); A = 1, eps 0.2: the loss is -1.2 (clipped)
    logp = torch.tensor([[0.2, 0.4, 0.0]], requires_grad=True)
    mask = torch.tensor([[row_weight, row_weight, 0.0]])
    loss, stats = clipped_surrogate_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.2, mode="seq-mean-token-mean", importance_sampling="sequence")
    assert float(stats.ratio_mean) == pytest.approx(1.349859, rel=1e-6)
    assert loss.item() == pytest.approx(-1.2, rel=1e-6) and float(stats.clip_frac) == 1.0
