"""A position a mask leaves out (padding, an environment's tokens in a multi-turn rollout) may hold
any log-prob: after updates at a low temperature the policy's and the reference's log-probs of an
environment's token drift apart by more than 88 nats, where e^x overflows float32. Every quantity
that exponentiates a log-ratio before the mask weighs it (k3, the PPO / CISPO / SAPO ratio, the
sampler's importance weights, PPO's KL-shaped rewards) must give on such input exactly what it gives
with 0 there: a finite loss, the same statistics, and no gradient at the left-out positions (inf x 0
was NaN, in the value or the gradient, and the run stopped)."""

from __future__ import annotations

import pytest
import torch

from rlalign.core.importance import importance_weights
from rlalign.core.losses import clipped_surrogate_loss, kl_penalty_loss
from rlalign.core.masks import counted_only
from rlalign.core.policy_losses import cispo_loss, sapo_loss
from rlalign.train import ppo

MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])  # (2, 4): an environment's token at [1, 1], padding at the ends
COUNTED_LOGP = torch.tensor([[-0.5, -1.2, 0.0, 0.0], [-2.0, 0.0, -0.3, 0.0]])
COUNTED_OLD = torch.tensor([[-0.7, -1.0, 0.0, 0.0], [-1.9, 0.0, -0.6, 0.0]])
ADVANTAGES = torch.tensor([1.0, -0.5])


def with_garbage(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(MASK > 0, x, value)


def test_counted_only_keeps_counted_values_zeroes_the_rest_and_passes_no_gradient_there():
    x = torch.tensor([[3.0, -500.0], [float("inf"), 2.0]], requires_grad=True)
    out = counted_only(x, torch.tensor([[1.0, 0.0], [0.0, 0.5]]))
    assert out.tolist() == [[3.0, 0.0], [0.0, 2.0]]
    out.exp().sum().backward()
    assert x.grad.tolist() == [[pytest.approx(20.0855, rel=1e-4), 0.0], [0.0, pytest.approx(7.3891, rel=1e-4)]]
    assert counted_only(x, None) is x
    assert counted_only(x, torch.tensor([1.0, 0.0])).tolist() == [[3.0, 0.0], [float("inf"), 0.0]]  # a broadcast mask: by column


def policy_losses():
    return {
        "k3": lambda logp, old, mask: kl_penalty_loss(logp, old, mask, "k3"),
        "k2": lambda logp, old, mask: kl_penalty_loss(logp, old, mask, "k2"),
        "clipped": lambda logp, old, mask: clipped_surrogate_loss(logp, old, ADVANTAGES, mask, 0.2, 0.28),
        "gspo": lambda logp, old, mask: clipped_surrogate_loss(logp, old, ADVANTAGES, mask, 0.2, mode="seq-mean-token-mean", importance_sampling="sequence"),
        "cispo": lambda logp, old, mask: cispo_loss(logp, old, ADVANTAGES, mask, eps_high=0.5),
        "sapo": lambda logp, old, mask: sapo_loss(logp, old, ADVANTAGES, mask),
    }


@pytest.mark.parametrize("name", list(policy_losses()))
@pytest.mark.parametrize("garbage", [(-200.0, 0.0), (0.0, -200.0), (-150.0, 150.0)], ids=["policy-low", "other-low", "both"])
def test_a_loss_reads_nothing_but_counted_tokens_however_extreme_the_rest(name, garbage):
    loss_of = policy_losses()[name]
    clean = COUNTED_LOGP.clone().requires_grad_(True)
    reference_loss, reference_stats = loss_of(clean, COUNTED_OLD, MASK)
    reference_loss.backward()
    dirty = with_garbage(COUNTED_LOGP, garbage[0]).requires_grad_(True)
    loss, stats = loss_of(dirty, with_garbage(COUNTED_OLD, garbage[1]), MASK)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(reference_loss.item(), abs=1e-7)
    for got, expected in zip(stats, reference_stats, strict=True):
        assert float(got) == pytest.approx(float(expected), abs=1e-7)
    assert torch.isfinite(dirty.grad).all() and not dirty.grad[MASK == 0].any()
    torch.testing.assert_close(dirty.grad, clean.grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_read_nothing_but_counted_tokens(level):
    # pi_old by the trainer's forward is real on an environment's token, the sampler's log-prob is 0 there
    expected, expected_stats = importance_weights(COUNTED_OLD, COUNTED_LOGP, MASK, high=2.0, level=level)
    weights, stats = importance_weights(with_garbage(COUNTED_OLD, 200.0), with_garbage(COUNTED_LOGP, 0.0), MASK, high=2.0, level=level)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights[MASK > 0], expected[MASK > 0], rtol=0, atol=0)
    for got, want in zip(stats, expected_stats, strict=True):
        assert float(got) == pytest.approx(float(want), abs=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_ppo_kl_shaped_rewards_skip_an_environments_tokens_however_far_apart_the_log_probs(estimator):
    # the recomputed pi_old and the reference disagree by 150 nats on the environment's token [1, 1]
    # (sampled 0, completion mask 1): its KL is 0 by definition (no KL on the environment's move), not inf x 0
    completion = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    scores, values = torch.tensor([1.0, 0.0]), torch.zeros(2, 4)
    args = (values, completion, 0.1, estimator, 1.0, 1.0, False)
    expected = ppo.ppo_advantages(scores, COUNTED_OLD, COUNTED_OLD - 0.25, *args, sampled=MASK)
    got = ppo.ppo_advantages(scores, with_garbage(COUNTED_OLD, -150.0), torch.where(MASK > 0, COUNTED_OLD - 0.25, 0.0), *args, sampled=MASK)
    for g, e in zip(got, expected, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    assert got[3][1, 1] == 0.0 and got[3][0, 0].item() == pytest.approx({"k1": 0.25, "k3": 0.25 + torch.expm1(torch.tensor(-0.25)).item()}[estimator], rel=1e-6)


def test_masked_token_kl_is_the_estimator_times_the_mask_on_counted_tokens_and_0_elsewhere():
    # k3 at x = log pi_ref - log pi = -0.5 on [0, 0]: e^-0.5 + 0.5 - 1 = 0.1065307; weight 0.5 on [1, 0]: half of k3 at x = 0.2
    from rlalign.core.kl import kl_k3, masked_token_kl

    logp = torch.tensor([[-1.0, -150.0], [-2.0, 0.0]])
    ref = torch.tensor([[-1.5, 0.0], [-1.8, -300.0]])
    kl = masked_token_kl(kl_k3, logp, ref, torch.tensor([[1.0, 0.0], [0.5, 0.0]]))
    assert kl.tolist() == [[pytest.approx(0.1065307, rel=1e-6), 0.0], [pytest.approx(0.5 * (torch.e ** 0.2 - 1.2), rel=1e-5), 0.0]]
