"""GRPO's options (entropy bonus, KL estimator and KL in the reward, GSPO's sequence ratio, dual clip,
truncated importance sampling, DAPO's overlong punishment) and PPO's dual clip and TIS: each term
composed into the loss as stated, and wired through a run.

Tiny Llama (hidden 64, 2 layers), one torch thread.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlalign.config import load_config
from rlalign.core.kl import entropy_from_logits
from rlalign.core.logprobs import token_logprobs
from rlalign.core.masks import masked_mean
from rlalign.lm.encoding import encode_prompts
from rlalign.lm.logprobs import completion_logits
from rlalign.lm.models import load_policy, load_tokenizer
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, ppo


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


def char_code_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(sum(ord(ch) for ch in c) % 11) for c in completions]


REWARDS = [grpo.RewardTerm("code", 1.0, char_code_reward)]


def make_cfg(tiny_path, out, cls=grpo.GRPOConfig, **overrides):
    base = {
        "model.path": str(tiny_path), "output_dir": str(out), "data.task": "arithmetic", "data.num_prompts": 64, "steps": 2,
        "prompts_per_step": 2, "sampling.max_new_tokens": 6, "optim.lr": 3e-3, "progress": False, "plots": False, "eval.enabled": False,
    }
    base.update({"group_size": 4} if cls is grpo.GRPOConfig else {"prompts_per_step": 4, "critic.optim.lr": 3e-3})
    base.update(overrides)
    return load_config(cls, None, base)


@pytest.fixture(scope="module")
def minibatch(tiny_path):
    """A sampled rollout of 4 rows, the policy, and advantages."""
    tokenizer, policy = load_tokenizer(tiny_path), load_policy(tiny_path)
    ids = encode_prompts(tokenizer, ["12+3=", "7-40="])
    rollout = sample(policy, ids, SamplingParams(max_new_tokens=5, temperature=1.0), tokenizer.pad_token_id, [tokenizer.eos_token_id], 2,
                     generator=torch.Generator().manual_seed(0))
    return policy, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5])


def test_entropy_bonus_adds_minus_coef_times_the_mean_entropy_and_its_gradient(tiny_path, tmp_path, minibatch):
    # token-mean aggregation: L(coef) - L(0) = -coef * mean_t H_t, and the gradient differs by -coef * grad mean_t H_t
    policy, rollout, adv = minibatch
    mask = rollout.completion_mask.float()
    losses, grads = [], []
    for coef in (0.0, 0.1):
        cfg = make_cfg(tiny_path, tmp_path, entropy_coef=coef, aggregation="token-mean", beta=0.0)
        policy.zero_grad()
        loss, stats = grpo.grpo_loss(policy, rollout, adv, mask, None, cfg, on_policy=True)
        loss.backward()
        losses.append((loss.item(), stats["entropy"].item()))
        grads.append([p.grad.clone() for p in policy.parameters()])
    assert losses[1][0] - losses[0][0] == pytest.approx(-0.1 * losses[0][1], rel=1e-5)
    policy.zero_grad()
    logits = completion_logits(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    (-0.1 * masked_mean(entropy_from_logits(logits), mask)).backward()
    for g0, g1, p in zip(grads[0], grads[1], policy.parameters()):
        torch.testing.assert_close(g1 - g0, p.grad, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_term_in_the_loss_uses_the_chosen_estimator(tiny_path, tmp_path, minibatch, estimator):
    # with ref_logp = logp - 0.1 on every token: x = log pi_ref - log pi = -0.1, so
    # k1 = 0.1, k2 = 0.005, k3 = e^-0.1 + 0.1 - 1 = 0.0048374; L(beta) - L(0) = beta * k (token-mean)
    policy, rollout, adv = minibatch
    mask = rollout.completion_mask.float()
    with torch.no_grad():
        logits = completion_logits(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
        ref_logp = token_logprobs(logits, rollout.completion_ids) - 0.1
    cfg = make_cfg(tiny_path, tmp_path, beta=0.5, kl_estimator=estimator, aggregation="token-mean")
    with_kl, stats = grpo.grpo_loss(policy, rollout, adv, mask, ref_logp, cfg, on_policy=True)
    without, _ = grpo.grpo_loss(policy, rollout, adv, mask, None, cfg, on_policy=True)
    expected = {"k1": 0.1, "k2": 0.005, "k3": 0.0048374180}[estimator]
    assert stats["kl"].item() == pytest.approx(expected, rel=1e-4)
    assert (with_kl - without).item() == pytest.approx(0.5 * expected, rel=1e-4)


def test_kl_in_the_reward_is_a_score_term_and_leaves_the_loss(tiny_path, tmp_path):
    out = tmp_path / "run"
    result = grpo.train(make_cfg(tiny_path, out, beta=0.5, kl_in="reward", kl_estimator="k3", num_samples_logged=8, sample_every=1), reward_functions=REWARDS)
    for row in result.history:
        assert row["reward/mean"] == pytest.approx(row["reward/code/mean"] + row["reward/kl_penalty/mean"], abs=1e-5)
        assert row["reward/kl_penalty/mean"] <= 0.0  # k3 >= 0
    assert abs(result.history[0]["reward/kl_penalty/mean"]) < 1e-5  # the policy is the reference at step 0
    assert result.history[1]["reward/kl_penalty/mean"] < -1e-6 and result.history[1]["kl"] > 0


def test_kl_in_the_reward_with_one_update_is_at_the_learners_pi_old_not_the_samplers(tiny_path, tmp_path):
    """mu = 1: pi_old is the learner's policy. A bfloat16 sampling copy (or an older policy, k > 0) samples with other
    log-probs; the KL penalty must read the learner's, which at step 0 are the reference's exactly: KL 0, not the
    bfloat16 copy's round-off (nor the staleness of an asynchronous run)."""
    cfg = make_cfg(tiny_path, tmp_path / "run", beta=0.5, kl_in="reward", kl_estimator="k1", steps=1, **{"sampling.dtype": "bfloat16"})
    row = grpo.train(cfg, reward_functions=REWARDS).history[0]
    assert row["kl"] == 0.0 and row["reward/kl_penalty/mean"] == 0.0  # the learner is the reference at step 0


def test_overlong_punishment_is_a_score_term_within_its_range(tiny_path, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(tiny_path, out, overlong_buffer=3, overlong_penalty=0.5, num_samples_logged=8, sample_every=1, beta=0.0)
    result = grpo.train(cfg, reward_functions=REWARDS)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for step, row in enumerate(result.history):
        assert -0.5 <= row["reward/overlong/mean"] <= 0.0
        logged = [r["overlong"] for r in rows if r["step"] == step]  # every row of the step
        assert row["reward/overlong/mean"] == pytest.approx(sum(logged) / len(logged))
        assert all(min(abs(v - level) for level in (0.0, -0.5 / 3, -1.0 / 3, -0.5)) < 1e-6 for v in logged)  # lengths <= 3 (free), 4, 5, 6
    assert min(r["overlong"] for r in rows) == -0.5  # the random model mostly runs to the budget


def test_sequence_ratio_gspo_runs_with_ratio_one_at_the_first_minibatch(tiny_path, tmp_path):
    result = grpo.train(make_cfg(tiny_path, tmp_path / "run", importance_sampling="sequence", mu=2, dual_clip=3.0), reward_functions=REWARDS)
    for row in result.history:
        assert row["ratio_dev/first"] <= 1e-5 and "clip_frac/dual" in row and row["grad_norm"] > 0


def test_truncated_importance_sampling_with_the_exact_sampler_changes_nothing(tiny_path, tmp_path):
    # float32 sampling and several updates: pi_old is the sampler's log-probs, so every weight is exactly 1
    runs = {name: grpo.train(make_cfg(tiny_path, tmp_path / name, mu=2, **extra), reward_functions=REWARDS)
            for name, extra in (("plain", {}), ("tis", {"tis_cap": 2.0}))}
    for row in runs["tis"].history:
        assert row["tis/weight_mean"] == 1.0 and row["tis/truncated_frac"] == 0.0
    a, b = (load_file(str(r.final_dir / "model.safetensors")) for r in runs.values())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_truncated_importance_sampling_weighs_a_bfloat16_sampler(tiny_path, tmp_path):
    # a bfloat16 sampling copy: pi_old is recomputed in float32, and the weights min(pi_old / pi_sampler, C) move off 1
    # (measured: log-prob gaps up to ~0.004 on the tiny model, so a cap of 1.001 truncates some tokens)
    result = grpo.train(make_cfg(tiny_path, tmp_path / "run", mu=2, tis_cap=1.001, **{"sampling.dtype": "bfloat16"}), reward_functions=REWARDS)
    for row in result.history:
        assert 0 < row["tis/weight_min"] < 1.0 and row["tis/weight_mean"] <= 1.001
        assert 0.0 < row["tis/truncated_frac"] < 1.0 and row["logprob_mismatch"] > 1e-3


def test_ppo_dual_clip_and_truncated_importance_sampling(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path / "run", ppo.PPOConfig, dual_clip=3.0, tis_cap=2.0, ppo_epochs=2, num_minibatches=2,
                   **{"sampling.dtype": "bfloat16"})
    result = ppo.train(cfg, reward_functions=REWARDS)
    for row in result.history:
        assert "clip_frac/dual" in row and 0 < row["tis/weight_mean"] <= 2.0 and row["tis/weight_min"] > 0


def first_char_parity(prompts: list[str], completions: list[str]) -> list[float]:
    """0/1 by the completion's first character: groups of 2 often tie."""
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


def test_dynamic_sampling_keeps_only_informative_groups_and_resumes_exactly(tiny_path, tmp_path):
    overrides = {"dynamic_sampling": True, "group_size": 2, "prompts_per_step": 4, "steps": 3, "save_every": 1, "beta": 0.0}
    rewards = [grpo.RewardTerm("parity", 1.0, first_char_parity)]
    straight = grpo.train(make_cfg(tiny_path, tmp_path / "straight", **overrides), reward_functions=rewards)
    for row in straight.history:
        assert row["frac_zero_std_groups"] == 0.0 and row["dynamic/filled_groups"] == 0.0
        assert row["dynamic/prompts_drawn"] == 4 * row["dynamic/draws"]
        assert row["dynamic/tied_groups"] >= 4 * (row["dynamic/draws"] - 1) - 3  # a draw follows only when the earlier ones held < 4 informative groups
    assert sum(r["dynamic/draws"] for r in straight.history) > 3 and sum(r["dynamic/tied_groups"] for r in straight.history) > 0  # ties happen with G = 2
    # the data position (prompts drawn so far) is in the checkpoint: a resumed run draws the straight run's prompts
    resumed_dir = tmp_path / "resumed"
    grpo.train(make_cfg(tiny_path, resumed_dir, **{**overrides, "steps": 1}), reward_functions=rewards)
    resumed = grpo.train(make_cfg(tiny_path, resumed_dir, **overrides), resume=resumed_dir, reward_functions=rewards)
    assert resumed.history[-1]["dynamic/draws"] == straight.history[-1]["dynamic/draws"]
    a, b = (load_file(str(r.final_dir / "model.safetensors")) for r in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dynamic_sampling_fills_the_step_with_tied_groups_after_its_last_draw(tiny_path, tmp_path):
    constant = [grpo.RewardTerm("constant", 1.0, lambda prompts, completions: [1.0] * len(completions))]
    result = grpo.train(make_cfg(tiny_path, tmp_path / "run", dynamic_sampling=True, max_sampling_rounds=3, steps=1), reward_functions=constant)
    row = result.history[0]
    assert row["dynamic/draws"] == 3 and row["dynamic/filled_groups"] == 2 and row["dynamic/tied_groups"] == 6 and row["frac_zero_std_groups"] == 1.0


def test_dynamic_sampling_judges_a_group_on_the_completions_that_count(tiny_path, tmp_path):
    # each group's first completion cannot be scored (None: no reward, left out) and the others all score 1: [-, 1, 1]
    # ties, though its totals [0, 1, 1] differ (one draw was kept as informative before, with every advantage 0)
    first_unscored = [grpo.RewardTerm("ones", 1.0, lambda prompts, completions: [None if i % 3 == 0 else 1.0 for i in range(len(completions))])]
    cfg = make_cfg(tiny_path, tmp_path / "run", dynamic_sampling=True, max_sampling_rounds=2, steps=1, group_size=3, prompts_per_step=2)
    row = grpo.train(cfg, reward_functions=first_unscored).history[0]
    assert row["dynamic/draws"] == 2 and row["dynamic/tied_groups"] == 4 and row["dynamic/filled_groups"] == 2
    assert row["frac_zero_std_groups"] == 1.0 and row["reward/no_term_applies/failed"] == 2


def test_rollouts_concatenate_with_their_padding_and_groups(minibatch):
    # the second part made wider (one more prompt pad on the left, two more completion pads on the right)
    _, rollout, _ = minibatch  # 2 prompts x 2 samples
    a, b = rollout.select(slice(0, 2)), rollout.select(slice(2, 4))
    pad = torch.nn.functional.pad
    wide = grpo.Rollout(pad(b.prompt_ids, (1, 0)), pad(b.prompt_mask, (1, 0)), pad(b.completion_ids, (0, 2)), pad(b.completion_mask, (0, 2)),
                        pad(b.logprobs, (0, 2)), b.group_index - 1, b.truncated)
    joined = grpo.Rollout.concat([a, wide], pad_token_id=0)
    assert joined.batch_size == 4 and joined.group_index.tolist() == [0, 0, 1, 1]
    assert joined.prompt_ids.shape[1] == wide.prompt_ids.shape[1] and joined.completion_ids.shape[1] == wide.completion_ids.shape[1]
    for i, part in ((0, a), (2, wide)):
        for j in range(2):
            assert joined.prompt_ids[i + j][joined.prompt_mask[i + j].bool()].tolist() == part.prompt_ids[j][part.prompt_mask[j].bool()].tolist()
            assert joined.completion_ids[i + j][joined.completion_mask[i + j].bool()].tolist() == part.completion_ids[j][part.completion_mask[j].bool()].tolist()
            assert joined.logprobs[i + j].sum().item() == pytest.approx(part.logprobs[j].sum().item())
