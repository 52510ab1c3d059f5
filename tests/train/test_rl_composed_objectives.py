"""GRPO's and PPO's policy objectives pinned where the trainers compose them: CISPO, SAPO, the sampler's
importance weights at token and sequence level (truncated, masked, IcePop's band), REINFORCE++,
PPO's and GRPO's dual clip, and GRPO's KL in the reward (then the loss holds no KL term).

Same method as tests/train/test_rl_composed.py, whose fixed rollout and plain-loop hand side these
tests reuse: the trainer's own loss (or whole step) on the fixed rollout against the paper's formula
written out token by token here, value and gradient. The hand side never calls rlalign.core.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.config import ConfigError
from rlalign.lm.models import load_policy
from rlalign.train import grpo, ppo
from rlalign.train.sources import make_source
from tests.train.test_rl_composed import (  # noqa: F401 (tiny_path, ref_path, tokenizer are fixtures)
    BUDGET,
    RATIOS,
    SCORES,
    TOKEN_ADVANTAGES,
    all_counted,
    assert_same_grads,
    assert_update,
    at_params,
    clipped_term,
    detached,
    fixed_sampler,
    fixed_scores,
    grads,
    grpo_cfg,
    hand_aggregate,
    hand_forward,
    hand_grpo_loss,
    hand_group_advantages,
    k3,
    padded,
    ppo_cfg,
    prompt_examples,
    recording,
    ref_path,
    sgd_updater,
    shifted_rollout,
    tiny_path,
    tokenizer,
)

torch.set_num_threads(1)

ADVANTAGES = [1.0, -0.5, 0.8, -1.2]  # one per completion of the fixed rollout (GRPO's loss tests)


def trainer_and_hand(policy, tokenizer, trainer_loss, hand_loss):
    """Run the trainer's loss and the hand loss on ``policy``; assert equal values and gradients. Returns the trainer's stats."""
    loss, stats = trainer_loss()
    loss.backward()
    trainer_grads = grads(policy)
    policy.zero_grad()
    expected = hand_loss(hand_forward(policy, tokenizer))
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(trainer_grads, grads(policy))
    return stats, float(expected.detach())


def per_token(logp, rows, term):
    """[[term(i, t, log pi_it) for each token] for each of ``rows``]."""
    return [[term(i, t, lp) for t, lp in enumerate(logp[i])] for i in rows]


# ----------------------------------------------------------------------------------------------
# CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi
# ----------------------------------------------------------------------------------------------


def cispo_term(logp, old, advantage, eps_low, eps_high):
    ratio = math.exp(float(logp.detach()) - old)
    weight = min(max(ratio, 1.0 - eps_low) if eps_low is not None else ratio, 1.0 + eps_high)  # a number: no gradient through it
    return -weight * advantage * logp


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.32), (None, 4.0)], ids=["band", "paper"])
def test_grpo_cispo_loss_by_hand(tiny_path, tmp_path, tokenizer, mode, eps_low, eps_high):
    # band: clip(r, 0.8, 1.32) caps 1.35 and 1.5 and floors 0.7, 0.75, 0.78, 0.6 (RATIOS; 1.3 stays); paper: no floor, cap 5 (nothing clipped)
    cfg = grpo_cfg(tiny_path, tmp_path, loss_type="cispo", cispo_eps_low=eps_low, cispo_eps_high=eps_high, aggregation=mode, beta=0.1,
                   **{"sampling.max_new_tokens": BUDGET})
    policy = load_policy(tiny_path)
    rollout, _, old, ref = shifted_rollout(policy, tokenizer)

    def hand(logp):
        surrogate = per_token(logp, range(4), lambda i, t, lp: cispo_term(lp, old[i][t], ADVANTAGES[i], eps_low, eps_high))
        kl = per_token(logp, range(4), lambda i, t, lp: k3(lp, ref[i][t]))
        return hand_aggregate(surrogate, mode, BUDGET) + 0.1 * hand_aggregate(kl, mode, BUDGET)

    stats, _ = trainer_and_hand(policy, tokenizer, lambda: grpo.grpo_loss(policy, rollout, torch.tensor(ADVANTAGES), rollout.completion_mask.float(), padded(ref), cfg), hand)
    ratios = [r for row in RATIOS for r in row]
    low = sum(eps_low is not None and r < 1 - eps_low for r in ratios) / len(ratios)
    high = sum(r > 1 + eps_high for r in ratios) / len(ratios)
    assert float(stats["clip_frac/low"]) == pytest.approx(low, abs=1e-6) and float(stats["clip_frac/high"]) == pytest.approx(high, abs=1e-6)
    assert (low + high > 0) == (eps_low is not None)


def test_ppo_cispo_loss_by_hand(tiny_path, tmp_path, tokenizer):
    # PPO's per-token GAE advantages, the same CISPO term; the entropy bonus beside it
    cfg = ppo_cfg(tiny_path, tmp_path, loss_type="cispo", cispo_eps_low=0.2, cispo_eps_high=0.3, entropy_coef=0.05)
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    loss, _ = ppo.policy_loss(policy, rollout, padded(TOKEN_ADVANTAGES), rollout.completion_mask.float(), cfg)
    loss.backward()
    trainer_grads = grads(policy)
    policy.zero_grad()
    logp, entropy = hand_forward(policy, tokenizer, with_entropy=True)
    surrogate = per_token(logp, range(4), lambda i, t, lp: cispo_term(lp, old[i][t], TOKEN_ADVANTAGES[i][t], 0.2, 0.3))
    expected = hand_aggregate(surrogate, "token-mean") - 0.05 * hand_aggregate(entropy, "token-mean")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(trainer_grads, grads(policy))


# ----------------------------------------------------------------------------------------------
# SAPO: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A
# ----------------------------------------------------------------------------------------------


def sapo_term(logp, old, advantage, tau_pos, tau_neg):
    tau = tau_pos if advantage > 0 else tau_neg
    ratio = torch.exp(logp - old)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantage


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_grpo_sapo_loss_by_hand(tiny_path, tmp_path, tokenizer, mode, tau_pos, tau_neg):
    cfg = grpo_cfg(tiny_path, tmp_path, loss_type="sapo", sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg, aggregation=mode, beta=0.0)
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)

    def hand(logp):
        return hand_aggregate(per_token(logp, range(4), lambda i, t, lp: sapo_term(lp, old[i][t], ADVANTAGES[i], tau_pos, tau_neg)), mode)

    stats, expected = trainer_and_hand(policy, tokenizer, lambda: grpo.grpo_loss(policy, rollout, torch.tensor(ADVANTAGES), rollout.completion_mask.float(), None, cfg), hand)
    assert float(stats["loss/policy"]) == pytest.approx(expected, rel=1e-5)
    gates = [4 * s * (1 - s) for i, row in enumerate(RATIOS) for r in row for s in [1 / (1 + math.exp(-(tau_pos if ADVANTAGES[i] > 0 else tau_neg) * (r - 1)))]]
    assert float(stats["sapo/gate_mean"]) == pytest.approx(sum(gates) / len(gates), rel=1e-4)
    assert "clip_frac" not in stats


def test_ppo_sapo_loss_by_hand(tiny_path, tmp_path, tokenizer):
    cfg = ppo_cfg(tiny_path, tmp_path, loss_type="sapo", sapo_temperature_neg=2.0, aggregation="seq-mean-token-mean")
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)

    def hand(logp):
        return hand_aggregate(per_token(logp, range(4), lambda i, t, lp: sapo_term(lp, old[i][t], TOKEN_ADVANTAGES[i][t], 1.0, 2.0)), "seq-mean-token-mean")

    trainer_and_hand(policy, tokenizer, lambda: ppo.policy_loss(policy, rollout, padded(TOKEN_ADVANTAGES), rollout.completion_mask.float(), cfg), hand)


# ----------------------------------------------------------------------------------------------
# The sampler's importance weights: token or sequence level, truncated or masked, one- or two-sided
# ----------------------------------------------------------------------------------------------

# pi_old / pi_sampler per token: 2.5 above and 0.4 below the band [0.5, 2.0]; the row products are
# 1.188 (inside), 2.75 (above), 0.2736 (below) and 1.3377 (inside)
SAMPLER_RATIOS = [[1.1, 1.2, 0.9, 1.0], [2.5, 1.1], [0.8, 0.4, 0.9, 0.95], [1.05, 0.98, 1.3]]


def hand_weights(mode: str, level: str, low: float | None, high: float) -> list[list[float]]:
    """TRL's definitions: rho per token, or the row's product on each of its tokens; truncate clips into
    [low, high], mask keeps rho inside and 0 outside."""
    rows = SAMPLER_RATIOS if level == "token" else [[math.prod(row)] * len(row) for row in SAMPLER_RATIOS]
    lo = 0.0 if low is None else low
    if mode == "truncate":
        return [[min(max(r, lo), high) for r in row] for row in rows]
    return [[r if lo <= r <= high else 0.0 for r in row] for row in rows]


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("low", [None, 0.5], ids=["cap", "band"])
def test_grpo_loss_with_sampler_weights_by_hand(tiny_path, tmp_path, tokenizer, mode, level, low):
    # pi_old (the rollout's log-probs) is the recomputed proximal policy; the sampler drew with log pi_old - log SAMPLER_RATIOS.
    # Each token's clipped surrogate is weighted by w (hand_weights); mask + band + token level is IcePop.
    cfg = grpo_cfg(tiny_path, tmp_path, beta=0.0, mu=2, tis_cap=2.0, tis_min=low, tis_mode=mode, tis_level=level, aggregation="token-mean")
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    sampler = padded([[o - math.log(SAMPLER_RATIOS[i][t]) for t, o in enumerate(row)] for i, row in enumerate(old)])
    weights = hand_weights(mode, level, low, 2.0)

    def hand(logp):
        return hand_grpo_loss(logp, old, None, ADVANTAGES, all_counted(logp), 0.2, 0.2, 0.0, "token-mean", weights=weights)

    stats, _ = trainer_and_hand(
        policy, tokenizer, lambda: grpo.grpo_loss(policy, rollout, torch.tensor(ADVANTAGES), rollout.completion_mask.float(), None, cfg, sampler_logp=sampler), hand
    )
    # the statistics are over the tokens, or with one weight a row (sequence) over the rows, as TRL logs them
    counted = (lambda rows: [x for row in rows for x in row]) if level == "token" else (lambda rows: [row[0] for row in rows])
    flat = counted(weights)
    outside = [(r < (low or 0.0), r > 2.0) for r in counted(SAMPLER_RATIOS if level == "token" else [[math.prod(r)] * len(r) for r in SAMPLER_RATIOS])]
    assert float(stats["tis/weight_mean"]) == pytest.approx(sum(flat) / len(flat), rel=1e-4)
    assert float(stats["tis/masked_frac"]) == pytest.approx(sum(w == 0 for w in flat) / len(flat), abs=1e-6)
    assert float(stats["tis/low_frac"]) == pytest.approx(sum(lo for lo, _ in outside) / len(flat), abs=1e-6)
    assert float(stats["tis/high_frac"]) == pytest.approx(sum(hi for _, hi in outside) / len(flat), abs=1e-6)
    assert float(stats["tis/truncated_frac"]) == pytest.approx(sum(lo or hi for lo, hi in outside) / len(flat), abs=1e-6)
    assert (float(stats["tis/masked_frac"]) > 0) == (mode == "mask")


def test_ppo_policy_loss_with_sequence_masked_sampler_weights_by_hand(tiny_path, tmp_path, tokenizer):
    cfg = ppo_cfg(tiny_path, tmp_path, tis_cap=2.0, tis_min=0.5, tis_mode="mask", tis_level="sequence")
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    sampler = padded([[o - math.log(SAMPLER_RATIOS[i][t]) for t, o in enumerate(row)] for i, row in enumerate(old)])
    weights = hand_weights("mask", "sequence", 0.5, 2.0)  # rows 1 and 2 leave the loss

    def hand(logp):
        return hand_aggregate(per_token(logp, range(4), lambda i, t, lp: clipped_term(torch.exp(lp - old[i][t]), TOKEN_ADVANTAGES[i][t], 0.2, 0.2) * weights[i][t]), "token-mean")

    trainer_and_hand(policy, tokenizer, lambda: ppo.policy_loss(policy, rollout, padded(TOKEN_ADVANTAGES), rollout.completion_mask.float(), cfg, sampler), hand)


@pytest.mark.parametrize("loss_type, mode, level", [("cispo", "mask", "token"), ("sapo", "truncate", "sequence")])
def test_grpo_cispo_and_sapo_take_the_sampler_weights_by_hand(tiny_path, tmp_path, tokenizer, loss_type, mode, level):
    # the weights multiply whichever per-token objective loss_type picks
    own = {"cispo_eps_low": 0.2, "cispo_eps_high": 0.32} if loss_type == "cispo" else {"sapo_temperature_neg": 2.0}
    cfg = grpo_cfg(tiny_path, tmp_path, beta=0.0, mu=2, loss_type=loss_type, tis_cap=2.0, tis_min=0.5, tis_mode=mode, tis_level=level,
                   aggregation="token-mean", **own)
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    sampler = padded([[o - math.log(SAMPLER_RATIOS[i][t]) for t, o in enumerate(row)] for i, row in enumerate(old)])
    weights = hand_weights(mode, level, 0.5, 2.0)

    def term(i, t, lp):
        if loss_type == "cispo":
            return cispo_term(lp, old[i][t], ADVANTAGES[i], 0.2, 0.32) * weights[i][t]
        return sapo_term(lp, old[i][t], ADVANTAGES[i], 1.0, 2.0) * weights[i][t]

    trainer_and_hand(
        policy, tokenizer, lambda: grpo.grpo_loss(policy, rollout, torch.tensor(ADVANTAGES), rollout.completion_mask.float(), None, cfg, sampler_logp=sampler),
        lambda logp: hand_aggregate(per_token(logp, range(4), term), "token-mean"),
    )


# ----------------------------------------------------------------------------------------------
# Dual clip: a negative-advantage token's loss capped at -c A (PPO and GRPO)
# ----------------------------------------------------------------------------------------------


def dual_clipped(term, advantage: float, c: float):
    return torch.minimum(term, torch.tensor(-c * advantage)) if advantage < 0 else term


def test_ppo_policy_loss_changes_with_dual_clip(tiny_path, tmp_path, tokenizer):
    # row 0 token 1: r = 1.35 > c = 1.3 with A = -0.4, so its loss r |A| = 0.54 is capped at c |A| = 0.52; 1 token of 13
    cfg = ppo_cfg(tiny_path, tmp_path, dual_clip=1.3)
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    without = []

    def hand(logp):
        plain = per_token(logp, range(4), lambda i, t, lp: clipped_term(torch.exp(lp - old[i][t]), TOKEN_ADVANTAGES[i][t], 0.2, 0.2))
        without.append(float(hand_aggregate(plain, "token-mean").detach()))
        capped = [[dual_clipped(x, TOKEN_ADVANTAGES[i][t], 1.3) for t, x in enumerate(row)] for i, row in enumerate(plain)]
        return hand_aggregate(capped, "token-mean")

    stats, expected = trainer_and_hand(policy, tokenizer, lambda: ppo.policy_loss(policy, rollout, padded(TOKEN_ADVANTAGES), rollout.completion_mask.float(), cfg), hand)
    assert without[0] - expected == pytest.approx((1.35 - 1.3) * 0.4 / 13, rel=1e-3)  # the cap moved the loss
    assert float(stats["clip_frac/dual"]) == pytest.approx(1 / 13, abs=1e-6)


def test_grpo_loss_changes_with_dual_clip(tiny_path, tmp_path, tokenizer):
    # row 3 token 0: r = 1.5 > c = 1.3 with A = -1.2: loss 1.8 capped at 1.56
    cfg = grpo_cfg(tiny_path, tmp_path, dual_clip=1.3, beta=0.0, aggregation="token-mean")
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)

    def hand(logp):
        terms = per_token(logp, range(4), lambda i, t, lp: dual_clipped(clipped_term(torch.exp(lp - old[i][t]), ADVANTAGES[i], 0.2, 0.2), ADVANTAGES[i], 1.3))
        return hand_aggregate(terms, "token-mean")

    stats, expected = trainer_and_hand(policy, tokenizer, lambda: grpo.grpo_loss(policy, rollout, torch.tensor(ADVANTAGES), rollout.completion_mask.float(), None, cfg), hand)
    plain = grpo.grpo_loss(policy, rollout, torch.tensor(ADVANTAGES), rollout.completion_mask.float(), None, grpo_cfg(tiny_path, tmp_path, beta=0.0, aggregation="token-mean"))[0]
    assert float(plain.detach()) - expected == pytest.approx((1.5 - 1.3) * 1.2 / 13, rel=1e-3)
    assert float(stats["clip_frac/dual"]) == pytest.approx(1 / 13, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# GRPO steps: KL in the reward (and not in the loss), REINFORCE++ advantages
# ----------------------------------------------------------------------------------------------


def one_update_step(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, **overrides):
    """One GRPO step with one update (mu = 1, pi_old = pi): the recorded update, the sampler's log-probs, and the metrics."""
    cfg = grpo_cfg(tiny_path, tmp_path, **overrides)
    policy, reference = load_policy(tiny_path), load_policy(ref_path)
    rollout, _, sampler_logp, _ = shifted_rollout(policy, tokenizer)
    fixed_sampler(monkeypatch, grpo, rollout)
    updater = sgd_updater(policy, lr=0.0)
    updates = recording(updater)
    state = grpo.TrainState(step=0, generator=torch.Generator().manual_seed(0))
    metrics, _ = grpo.grpo_step(updater, reference if cfg.beta > 0 else None, make_source(cfg, updater, tokenizer, [fixed_scores(SCORES)], prompt_examples()), state, cfg)
    assert len(updates) == 1
    return cfg, policy, reference, updates[0], sampler_logp, metrics


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_grpo_step_with_kl_in_the_reward_has_no_kl_in_the_loss(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, estimator):
    # R_i <- R_i - beta sum_t KL_t(pi_old, pi_ref), pi_old being the sampler's log-probs; A = group z-score of those;
    # the loss is the clipped surrogate alone (r = 1): counting the KL in the loss as well changes both its value and gradient
    cfg, policy, reference, update, sampler_logp, metrics = one_update_step(
        tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, beta=0.5, kl_in="reward", kl_estimator=estimator
    )
    ref = detached(hand_forward(reference, tokenizer))
    kl = [[(o - r) if estimator == "k1" else float(k3(torch.tensor(o), r)) for o, r in zip(sampler_logp[i], ref[i])] for i in range(4)]
    shaped = [s - 0.5 * sum(row) for s, row in zip(SCORES, kl)]
    advantages = hand_group_advantages(shaped, 2, "group")
    twin = at_params(policy, update.params)
    logp = hand_forward(twin, tokenizer)
    loss = hand_grpo_loss(logp, detached(logp), None, advantages, all_counted(logp), cfg.eps_low, cfg.eps_high, 0.0, cfg.aggregation)
    assert_update(update, twin, loss, 0.0)
    assert metrics["kl"] == pytest.approx(sum(map(sum, kl)) / 13, rel=1e-4, abs=1e-6)
    assert metrics["reward/kl_penalty/mean"] == pytest.approx(-0.5 * sum(map(sum, kl)) / 4, rel=1e-4, abs=1e-6)
    # the premise: the KL term would move the loss (by beta * the mean k3 of pi against pi_ref, ~0.009 here) far past the tolerance
    twin.zero_grad()
    logp = hand_forward(twin, tokenizer)
    with_kl = hand_grpo_loss(logp, detached(logp), ref, advantages, all_counted(logp), cfg.eps_low, cfg.eps_high, 0.5, cfg.aggregation)
    assert abs(float(with_kl) - float(update.loss)) > 1e-3


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_grpo_step_with_reinforce_plus_plus_advantages_by_hand(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, estimator):
    # REINFORCE++: A = (R - mean_batch) / std_batch; -baseline: R - mean_group, then / std_batch of that (unbiased stds)
    cfg, policy, _, update, _, metrics = one_update_step(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, beta=0.0, advantage=estimator)
    if estimator == "reinforce_plus_plus":
        centred = [s - sum(SCORES) / 4 for s in SCORES]  # [0.875, -0.625, -2.125, 1.875]
    else:
        centred = hand_group_advantages(SCORES, 2, "none")  # [0.75, -0.75, -2, 2]
    std = math.sqrt(sum(c * c for c in centred) / 3)
    advantages = [c / std for c in centred]
    twin = at_params(policy, update.params)
    logp = hand_forward(twin, tokenizer)
    loss = hand_grpo_loss(logp, detached(logp), None, advantages, all_counted(logp), cfg.eps_low, cfg.eps_high, 0.0, cfg.aggregation)
    assert_update(update, twin, loss, 0.0)
    assert metrics["adv/std"] == pytest.approx(1.0, rel=1e-5)
    assert advantages != pytest.approx(hand_group_advantages(SCORES, 2, "group"))  # not GRPO's z-score


# ----------------------------------------------------------------------------------------------
# Bad combinations are config errors that name the fields
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss_type": "cispo", "dual_clip": 3.0}, "dual_clip"),
        ({"loss_type": "sapo", "importance_sampling": "sequence"}, "importance_sampling"),
        ({"sapo_temperature_neg": 2.0}, "only for loss_type: sapo"),
        ({"loss_type": "sapo", "cispo_eps_high": 1.0}, "only for loss_type: cispo"),
        ({"loss_type": "dapo"}, "aggregation: token-mean"),
        ({"tis_mode": "mask"}, "set tis_cap"),
        ({"tis_level": "sequence"}, "set tis_cap"),
        ({"tis_cap": 2.0, "tis_min": 2.0}, "below tis_cap"),
        ({"cispo_eps_low": 1.0, "loss_type": "cispo"}, "cispo_eps_low"),
    ],
)
def test_bad_objective_combinations_are_config_errors(tiny_path, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        grpo_cfg(tiny_path, tmp_path, **overrides)


def test_cispo_without_an_aggregation_normalises_by_the_batchs_tokens_as_trl_does(tiny_path, tmp_path):
    # TRL's loss_type: cispo (and MiniMax-M1, eq. 4) divides by the batch's tokens; GRPO's own default averages per sequence
    assert grpo_cfg(tiny_path, tmp_path, loss_type="cispo").aggregation == "token-mean"
    assert grpo_cfg(tiny_path, tmp_path, loss_type="cispo", aggregation="seq-mean-token-mean").aggregation == "seq-mean-token-mean"  # given: kept
    assert grpo_cfg(tiny_path, tmp_path).aggregation == "seq-mean-token-mean"  # the clipped surrogate keeps GRPO's default
    assert ppo_cfg(tiny_path, tmp_path, loss_type="cispo").aggregation == "token-mean"


def test_ppo_shares_the_objective_checks(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="dual_clip"):
        ppo_cfg(tiny_path, tmp_path, loss_type="sapo", dual_clip=2.0)
    assert ppo_cfg(tiny_path, tmp_path, tis_min=0.5).sampler_correction  # a floor alone turns the weights on


# ----------------------------------------------------------------------------------------------
# Wired through a run: two steps each, the options' metrics logged
# ----------------------------------------------------------------------------------------------


def code_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(sum(ord(ch) for ch in c) % 7) for c in completions]


@pytest.mark.parametrize(
    "trainer, overrides, keys",
    [
        ("grpo", {"loss_type": "sapo", "advantage": "reinforce_plus_plus", "tis_cap": 2.0, "tis_min": 0.5, "tis_mode": "mask",
                  "tis_level": "sequence", "sampling.dtype": "bfloat16"}, ("sapo/gate_mean", "tis/masked_frac", "tis/low_frac")),
        ("ppo", {"loss_type": "cispo", "cispo_eps_low": 0.2, "ppo_epochs": 2, "tis_cap": 2.0, "sampling.dtype": "bfloat16"}, ("clip_frac/high", "tis/weight_mean")),
    ],
)
def test_the_objectives_run_and_log_their_metrics(tiny_path, tmp_path, trainer, overrides, keys):
    base = {"steps": 2, "eval.enabled": False, "optim.lr": 3e-3, "sampling.max_new_tokens": 5, "data.num_prompts": 16, "beta": 0.0}
    if trainer == "grpo":
        result = grpo.train(grpo_cfg(tiny_path, tmp_path, mu=2, **base, **overrides), reward_functions=[grpo.RewardTerm("code", 1.0, code_reward)])
    else:
        base.pop("beta")
        result = ppo.train(ppo_cfg(tiny_path, tmp_path, **base, **overrides), reward_functions=[grpo.RewardTerm("code", 1.0, code_reward)])
    for row in result.history:
        assert all(math.isfinite(row[k]) for k in keys) and row["grad_norm" if trainer == "grpo" else "grad_norm/policy"] > 0
