"""GRPO trainer: the gradient is REINFORCE with a group baseline, resume equals a straight run,
the reward rises on an easy task (and falls with the sign flipped), bad inputs are clear errors.

Tiny Llama (hidden 64, 2 layers, character tokenizer), one torch thread.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlalign.config import ConfigError, load_config
from rlalign.core.kl import entropy_from_logits
from rlalign.core.masks import masked_mean
from rlalign.lm.data import DataError, PromptExample
from rlalign.lm.encoding import encode_prompts
from rlalign.lm.models import cast_copy, load_policy, load_tokenizer
from rlalign.lm.packed import PackedLinear, can_pack_linear
from rlalign.lm.rewards import RewardFunctionError
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, loop, passes, rollouts
from rlalign.train.checkpoints import CheckpointError
from rlalign.train.seeding import set_seed
from rlalign.train.sources import make_source, sampling_generator

torch.set_num_threads(1)

VOLATILE = ("time/", "tokens_per_s", "memory/budget_mb")  # wall-clock metrics and the free memory differ between runs


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


def digit_share(prompts: list[str], completions: list[str]) -> list[float]:
    """Share of digits among the completion's characters: ~0.1 for the random tiny model, 1 at best."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def char_code_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """A deterministic, varied score of the text (so no group ties)."""
    return [float(sum(ord(ch) for ch in c) % 11) for c in completions]


def make_cfg(tiny_path, tmp_path, **overrides) -> grpo.GRPOConfig:
    base = {
        "model.path": str(tiny_path),
        "output_dir": str(tmp_path / "run"),
        "data.task": "arithmetic",
        "data.num_prompts": 64,
        "steps": 3,
        "prompts_per_step": 2,
        "group_size": 4,
        "sampling.max_new_tokens": 6,
        "optim.lr": 3e-3,
        "progress": False,
        "overwrite": True,  # several tests run twice in one directory
        "plots": False,
    }
    base.update(overrides)
    return load_config(grpo.GRPOConfig, None, base)


def test_gradient_is_reinforce_with_group_mean_baseline_over_group_std(tiny_path, tmp_path):
    # beta = 0, mu = 1, seq-mean-token-mean: the GRPO loss at ratio 1 is
    #   L = -1/B sum_i 1/|o_i| sum_t A_i log pi(o_it),  A_i = (R_i - mean_group) / std_group
    # so its gradient is REINFORCE's with the group mean as baseline, scaled by 1 / group std.
    cfg = make_cfg(tiny_path, tmp_path, beta=0.0, mu=1, steps=1, **{"optim.grad_clip": None, "sampling.temperature": 0.8})
    assert cfg.aggregation == "seq-mean-token-mean"  # the default
    set_seed(0)
    tokenizer = load_tokenizer(tiny_path)
    policy = load_policy(tiny_path)
    updater = grpo.Updater(policy, torch.optim.SGD(policy.parameters(), lr=0.0), None, None)
    updater.scheduler = torch.optim.lr_scheduler.LambdaLR(updater.optimizer, lambda s: 1.0)
    prompts = rollouts.load_prompt_set(cfg.data)
    state = grpo.TrainState(step=0, generator=torch.Generator().manual_seed(7))
    twin = sampling_generator(cfg.seed, 0)  # the generator the source draws step 0's uniforms from
    rewards = [grpo.RewardTerm("code", 1.0, char_code_reward)]

    grpo.grpo_step(updater, None, make_source(cfg, updater, tokenizer, rewards, prompts), state, cfg)  # leaves the gradient in .grad (lr = 0)
    trainer_grads = {n: p.grad.clone() for n, p in policy.named_parameters()}

    # the same rollout, drawn again with the twin generator
    batch = [ex.prompt for ex in rollouts.prompt_batch(prompts, 0, cfg.prompts_per_step, cfg.seed)]
    rollout = sample(policy, encode_prompts(tokenizer, batch), cfg.sampling.params(), tokenizer.pad_token_id, [tokenizer.eos_token_id], 4, twin)
    scores = char_code_reward([], rollout.decode_completions(tokenizer))
    advantages = []
    for g in range(0, len(scores), 4):
        group = scores[g : g + 4]
        assert statistics.stdev(group) > 0  # no tied group, so every row carries signal
        advantages += [(r - statistics.mean(group)) / statistics.stdev(group) for r in group]

    # hand REINFORCE with a plain full-vocabulary log-softmax (not the trainer's code path)
    policy.zero_grad()
    logits = policy(input_ids=rollout.input_ids(), attention_mask=rollout.attention_mask(), position_ids=rollout.position_ids()).logits
    p = rollout.prompt_ids.shape[1]
    logp_all = torch.log_softmax(logits[:, p - 1 : -1].float() / 0.8, dim=-1)  # (B, C, V)
    logp = logp_all.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)  # (B, C)
    mask = rollout.completion_mask.float()
    objective = sum(advantages[i] * (logp[i] * mask[i]).sum() / mask[i].sum() for i in range(len(advantages))) / len(advantages)
    (-objective).backward()

    for name, param in policy.named_parameters():
        torch.testing.assert_close(trainer_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert max(g.abs().max().item() for g in trainer_grads.values()) > 1e-2  # a real gradient, not zeros


def test_first_minibatch_ratio_is_one_and_metrics_are_logged(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path, steps=2, mu=2, num_minibatches=2, beta=0.1)
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])
    mismatch_bound = 1e-2 if can_pack_linear(torch.nn.Linear(2, 2).bfloat16()) else 5e-2
    for row in result.history:
        assert row["ratio_dev/first"] <= 1e-5  # sampler log-probs = training log-probs before any update (float round-off)
        assert row["ratio_dev"] > 1e-4  # later minibatches see a moved policy (the check above can fail)
        for key in ("reward/mean", "reward/std", "reward/digits/mean", "reward/digits/std", "kl", "clip_frac", "clip_frac/low",
                    "clip_frac/high", "entropy", "completion_len/mean", "completion_len/max", "completion_len/clipped_frac",
                    "frac_zero_std_groups", "time/generate", "time/score", "time/train", "tokens_per_s"):
            assert key in row, key
    assert result.history[1]["kl"] > 0  # the policy has left the reference
    assert (result.output_dir / "final" / "model.safetensors").is_file()


def test_mask_truncated_leaves_truncated_completions_out(tiny_path, tmp_path):
    # with 3 new tokens and this seed the random model emits no EOS (the first assertion checks
    # that premise; EOS has probability ~1/40 per token): every completion is truncated, so the
    # loss has no token left and the update is zero
    cfg = make_cfg(tiny_path, tmp_path, steps=1, mask_truncated=True, beta=0.0, seed=1, **{"sampling.max_new_tokens": 3})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("code", 1.0, char_code_reward)])
    row = result.history[0]
    assert row["completion_len/clipped_frac"] == 1.0
    assert row["grad_norm"] == 0.0
    cfg = make_cfg(tiny_path, tmp_path, steps=1, mask_truncated=False, beta=0.0, seed=1, **{"sampling.max_new_tokens": 3})
    assert grpo.train(cfg, reward_functions=[grpo.RewardTerm("code", 1.0, char_code_reward)]).history[0]["grad_norm"] > 0


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}, {"r": 4, "alpha": 8, "dropout": 0.3}], ids=["full", "lora", "lora_dropout"])
def test_resume_equals_straight_run(tiny_path, tmp_path, lora):
    # a cosine schedule with warm-up, a reference model (LoRA: the base), mu = 2 and two minibatches:
    # everything a checkpoint must carry (weights, AdamW moments, schedule, sampling generator, data position;
    # the adapters' dropout too, which a reloaded adapter would otherwise lose)
    overrides = {"steps": 4, "save_every": 2, "beta": 0.05, "mu": 2, "num_minibatches": 2, "optim.warmup_steps": 2, "optim.min_lr_ratio": 0.1,
                 "model.lora": lora}
    rewards = [grpo.RewardTerm("digits", 1.0, digit_share)]
    straight = grpo.train(make_cfg(tiny_path, tmp_path / "a", **overrides), reward_functions=rewards)
    checkpoint = tmp_path / "a" / "run" / "checkpoints" / "step_00000002"
    assert checkpoint.is_dir()
    resumed = grpo.train(make_cfg(tiny_path, tmp_path / "b", **overrides), resume=checkpoint, reward_functions=rewards)

    assert [r["step"] for r in resumed.history] == [2, 3]
    for a, b in zip(straight.history[2:], resumed.history):
        assert {k: v for k, v in a.items() if not k.startswith(VOLATILE)} == {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
    for (name, p), q in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(p, q), name
    # and the run really moved between the checkpoint and the end
    assert straight.history[3]["reward/mean"] != straight.history[1]["reward/mean"]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_reward_rises_and_falls_with_the_advantage_sign(tiny_path, tmp_path, sign):
    # negating the reward negates every group advantage: the same run must then push the digit share down
    cfg = make_cfg(tiny_path, tmp_path, steps=30, prompts_per_step=4, group_size=8, beta=0.0, **{"sampling.max_new_tokens": 8})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("digits", sign, digit_share)])
    share = [row["reward/digits/mean"] for row in result.history]
    start, end = sum(share[:5]) / 5, sum(share[-5:]) / 5
    if sign > 0:
        assert end > start + 0.25, share
    else:
        assert end < start - 0.04, share


def test_group_size_one_is_a_config_error(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        make_cfg(tiny_path, tmp_path, group_size=1)


def test_config_typo_names_the_key(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="grop_size.*Did you mean 'group_size'"):
        make_cfg(tiny_path, tmp_path, grop_size=4)


def test_minibatches_must_divide_the_rollout(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="num_minibatches=3 must divide"):
        make_cfg(tiny_path, tmp_path, num_minibatches=3)


def test_reward_function_that_raises_names_the_prompt(tiny_path, tmp_path):
    def picky(prompts, completions):
        return [1 / 0 if "=" in p else 0.0 for p in prompts]

    with pytest.raises(RewardFunctionError, match=r"picky.*ZeroDivisionError.*prompt '\d"):
        grpo.train(make_cfg(tiny_path, tmp_path), reward_functions=[grpo.RewardTerm("picky", 1.0, picky)])


def test_reward_function_returning_nan_names_the_prompt(tiny_path, tmp_path):
    def nan_reward(prompts, completions):
        return [float("nan")] * len(prompts)

    with pytest.raises(RewardFunctionError, match=r"nan.*prompt '\d+[+-]"):
        grpo.train(make_cfg(tiny_path, tmp_path), reward_functions=[grpo.RewardTerm("nan", 1.0, nan_reward)])


def test_empty_dataset_is_an_error(tiny_path, tmp_path):
    with pytest.raises(DataError, match="empty"):
        grpo.train(make_cfg(tiny_path, tmp_path), prompts=[], reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])


def test_resume_from_a_directory_that_is_not_a_checkpoint(tiny_path, tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        grpo.train(make_cfg(tiny_path, tmp_path), resume=tmp_path / "nothing", reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])


def test_no_reward_and_unknown_reward_are_config_errors(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="no reward"):
        grpo.train(make_cfg(tiny_path, tmp_path))
    with pytest.raises(ConfigError, match="neither a built-in"):
        make_cfg(tiny_path, tmp_path, rewards=[{"function": "accuracy"}])


def test_cli_runs_the_recipe_with_overrides_and_resumes(tiny_path, tmp_path, capsys):
    from rlalign.cli import main

    args = ["grpo", "--config", "configs/grpo_arithmetic.yaml", f"model.path={tiny_path}", f"output_dir={tmp_path / 'cli'}",
            "steps=2", "prompts_per_step=2", "group_size=2", "sampling.max_new_tokens=4", "progress=false", "plots=true"]
    assert main(args) == 0
    assert '"steps_run": 2' in capsys.readouterr().out
    assert (tmp_path / "cli" / "curves.png").is_file()
    # --resume with a run directory continues from its latest checkpoint
    assert main(args[:-2] + ["steps=3", "progress=false", "--resume", str(tmp_path / "cli")]) == 0
    assert '"steps_run": 1' in capsys.readouterr().out
    assert main(["grpo", "--config", "configs/grpo_arithmetic.yaml", "group_sise=2"]) == 2
    assert "group_size" in capsys.readouterr().err


def test_beta_zero_loads_no_reference(tiny_path, tmp_path, monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("beta = 0 must not load a reference model")

    monkeypatch.setattr(loop, "load_reference", no_reference)
    result = grpo.train(make_cfg(tiny_path, tmp_path, steps=1, beta=0.0), reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])
    assert "kl" not in result.history[0]  # no KL term, no KL metric


def test_lora_policy_uses_its_base_as_reference(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "load_reference", lambda *a, **k: (_ for _ in ()).throw(AssertionError("LoRA needs no second copy")))
    cfg = make_cfg(tiny_path, tmp_path, steps=2, beta=0.1, **{"model.lora": {"r": 4, "alpha": 8}, "optim.lr": 1e-2})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])
    assert result.history[0]["kl"] < 1e-6  # adapters start at zero: policy = base
    assert result.history[1]["kl"] > 1e-6  # after one update the adapters moved away from the base
    base = load_policy(tiny_path)
    trained = {n.replace(".base_layer", ""): p for n, p in result.policy.get_base_model().named_parameters() if "lora_" not in n}
    assert set(trained) == {n for n, _ in base.named_parameters()}
    for name, p in base.named_parameters():  # the base weights themselves never change
        assert torch.equal(p, trained[name].cpu()), name


def test_builtin_reward_terms_from_the_config(tiny_path, tmp_path):
    # exact match and math-verify against the prompts' 'answer' column, a format check, a task reward
    # and an imported function, each logged under its own name; the total is their weighted sum
    rewards = [
        {"function": "exact_match"},
        {"function": "math_answer", "weight": 0.5},
        {"function": "format", "pattern": r"-?\d+", "weight": 0.25},
        {"function": "rlalign.tasks.arithmetic:reward", "name": "imported"},
    ]
    cfg = make_cfg(tiny_path, tmp_path, steps=1, beta=0.0, rewards=rewards)
    row = grpo.train(cfg).history[0]
    expected = row["reward/exact_match/mean"] + 0.5 * row["reward/math_answer/mean"] + 0.25 * row["reward/format/mean"] + row["reward/imported/mean"]
    assert row["reward/mean"] == pytest.approx(expected, abs=1e-6)
    # the score functions themselves, on known answers
    terms = rollouts.build_rewards(cfg.rewards, [PromptExample("2+3=", {"answer": "5"})], load_tokenizer(tiny_path), cfg.model)
    total, per_term, _ = rollouts.score_rollout(terms, ["2+3=", "2+3="], ["5", "five"])
    assert {k: v.tolist() for k, v in per_term.items()} == {"exact_match": [1.0, 0.0], "math_answer": [1.0, 0.0], "format": [1.0, 0.0], "imported": [1.0, 0.0]}
    assert total.tolist() == [2.75, 0.0]
    with pytest.raises(ConfigError, match="'pattern' goes with function: format"):
        make_cfg(tiny_path, tmp_path, rewards=[{"function": "format"}])


@pytest.mark.parametrize("advantage", ["group", "batch", "none", "rloo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_every_advantage_and_aggregation_mode_trains(tiny_path, tmp_path, advantage, aggregation):
    cfg = make_cfg(tiny_path, tmp_path, steps=1, advantage=advantage, aggregation=aggregation, beta=0.1)
    row = grpo.train(cfg, reward_functions=[grpo.RewardTerm("code", 1.0, char_code_reward)]).history[0]
    assert row["grad_norm"] > 0 and math.isfinite(row["loss/policy"])


def test_dr_grpo_normalises_by_the_fixed_max_length(tiny_path, tmp_path):
    # seq-mean-token-sum-norm at ratio 1: L = -1/(B * L_max) sum_i A_i |o_i|, with L_max = sampling.max_new_tokens = 10
    # even though this rollout is only 4 tokens long
    cfg = make_cfg(tiny_path, tmp_path, aggregation="seq-mean-token-sum-norm", beta=0.0, **{"sampling.max_new_tokens": 10})
    tokenizer, policy = load_tokenizer(tiny_path), load_policy(tiny_path)
    rollout = sample(policy, encode_prompts(tokenizer, ["1+2=", "30-4="]), SamplingParams(4), tokenizer.pad_token_id, [tokenizer.eos_token_id], 4,
                     torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.0])
    loss, stats = grpo.grpo_loss(policy, rollout, advantages, rollout.completion_mask.float(), None, cfg)
    expected = -(advantages * rollout.completion_lengths()).sum() / (8 * 10)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # the entropy statistic (computed in the log-probs' pass) is the token mean of H(softmax(z / tau))
    with torch.no_grad():
        entropy = entropy_from_logits(passes.completion_logits(policy, rollout) / cfg.sampling.temperature)  # (B, C)
    torch.testing.assert_close(stats["entropy"], masked_mean(entropy, rollout.completion_mask.float()), rtol=1e-5, atol=1e-6)


def test_code_execution_reward_from_the_config(tiny_path, tmp_path):
    # the prompts' 'tests' column is run against each completion's program in the sandbox
    from rlalign.lm.sandbox import isolation_available

    cfg = make_cfg(tiny_path, tmp_path, steps=1, beta=0.0, rewards=[{"function": "code_execution", "allow_weak_sandbox": isolation_available() is not None}])
    prompts = [PromptExample("2+3=", {"tests": "assert f() == 5"})]
    terms = rollouts.build_rewards(cfg.rewards, prompts, load_tokenizer(tiny_path), cfg.model)
    total, _, _ = rollouts.score_rollout(terms, ["2+3=", "2+3="], ["def f():\n    return 5", "def f():\n    return 6"])
    assert total.tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError, match="'tests' column"):
        rollouts.build_rewards(cfg.rewards, [PromptExample("2+3=", {})], load_tokenizer(tiny_path), cfg.model)


def test_bfloat16_autocast_recomputes_old_logprobs_and_learns(tiny_path, tmp_path):
    # under autocast pi_old is recomputed by the training forward on the same minibatches, so the first
    # ratio is 1; how far the sampler's bfloat16 log-probs were is logged (~5e-7 with oneDNN's bfloat16
    # GEMMs, which accumulate in float32 so these shapes round alike; ~1.5e-2 on a CPU without them,
    # where the sampler's one-token products and the training forward's round differently); and the
    # digit share still rises
    cfg = make_cfg(tiny_path, tmp_path, steps=30, prompts_per_step=4, group_size=8, beta=0.0, num_minibatches=2,
                   **{"sampling.max_new_tokens": 8, "model.autocast": "bfloat16"})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])
    mismatch_bound = 1e-2 if can_pack_linear(torch.nn.Linear(2, 2).bfloat16()) else 5e-2
    for row in result.history:
        assert row["ratio_dev/first"] <= 1e-5
        assert 0 <= row["logprob_mismatch"] < mismatch_bound
    share = [row["reward/digits/mean"] for row in result.history]
    assert sum(share[-5:]) / 5 > sum(share[:5]) / 5 + 0.25, share


def test_one_update_per_rollout_takes_pi_old_from_the_update_itself(tiny_path, tmp_path, monkeypatch):
    # mu = 1, one minibatch: pi_old is the policy being updated, so no pass recomputes it even under
    # autocast (log pi_old = logp.detach(), r = 1 exactly) and the sampler's distance is still logged
    def no_recompute(*args, **kwargs):
        raise AssertionError("pi_old recomputed although the rollout gets one update")

    monkeypatch.setattr(grpo, "training_logprobs", no_recompute)
    cfg = make_cfg(tiny_path, tmp_path, steps=2, beta=0.1, **{"model.autocast": "bfloat16"})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("code", 1.0, char_code_reward)])
    for row in result.history:
        assert row["ratio_dev/first"] == 0.0 and row["clip_frac"] == 0.0
        assert 0 <= row["logprob_mismatch"] < 1e-2
        assert row["time/old_logp"] < 1e-3 and row["time/reference"] > 0
        assert row["time/train"] == pytest.approx(row["time/reference"] + row["time/old_logp"] + row["time/update"])
        assert row["grad_norm"] > 0
    # the reference holds its matmul weights in bfloat16, the values autocast casts the policy's to:
    # before the first update the two forwards agree bit for bit, so the KL starts at exactly 0
    assert result.history[0]["kl"] == 0.0 and result.history[1]["kl"] > 0
    assert result.policy.dtype == torch.float32  # master weights
    reference = loop.start_rl_run(cfg, None, None, [grpo.RewardTerm("code", 1.0, char_code_reward)], 8, 1).load_reference(cfg.model, None)
    assert reference.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16 and reference.model.norm.weight.dtype == torch.float32


@pytest.mark.parametrize("compile_sampling", [False, True], ids=["eager-sampler", "compiled-sampler"])
def test_sampling_from_a_bfloat16_copy_recomputes_pi_old_and_refreshes_the_copy(tiny_path, tmp_path, monkeypatch, compile_sampling, compiled_sampling_calls):
    # sampling.dtype: the decode loop runs on a bfloat16 copy of the float32 policy (its decode step
    # compiled or not); with two updates per rollout pi_old is recomputed (first ratio 1) and the copy
    # follows every update
    recomputed = []
    original = grpo.training_logprobs
    monkeypatch.setattr(grpo, "training_logprobs", lambda *a, **k: recomputed.append(1) or original(*a, **k))
    seen = {}
    original_sample = rollouts.sample
    monkeypatch.setattr(rollouts, "sample", lambda model, *a, **k: seen.setdefault("model", model) and original_sample(model, *a, **k))
    cfg = make_cfg(tiny_path, tmp_path, steps=2, mu=2, beta=0.1, **{"sampling.dtype": "bfloat16", "sampling.compile": compile_sampling})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("code", 1.0, char_code_reward)])
    assert len(recomputed) == 2
    assert (compiled_sampling_calls["decode"] > 0) == compile_sampling
    for row in result.history:
        assert row["ratio_dev/first"] <= 1e-5 and row["ratio_dev"] > 1e-4
        assert row["logprob_mismatch"] > 0  # bfloat16 weights: the sampler's log-probs are not the training pass's
    copy = seen["model"]
    assert copy is not result.policy and next(copy.parameters()).dtype == torch.bfloat16
    assert any(isinstance(m, PackedLinear) for m in copy.modules()) == can_pack_linear(copy)  # sampling.pack_weights, on by default
    assert next(result.policy.parameters()).dtype == torch.float32
    # refreshed before step 2's sampling: it holds the weights after step 1's updates, not the start's
    start = load_policy(tiny_path)
    assert any(not torch.equal(c.cpu(), p.to(torch.bfloat16)) for c, p in zip(copy.parameters(), start.parameters()))
    with pytest.raises(ConfigError, match="sampling.dtype"):
        grpo.Updater.create(start, cfg.optim, 1, sharding="fsdp", sampling_dtype="bfloat16")


@pytest.mark.parametrize("packed", [False, True])
def test_the_sampling_copy_is_refreshed_after_each_update_and_only_then(tiny_path, tmp_path, packed):
    cfg = make_cfg(tiny_path, tmp_path)
    policy = load_policy(tiny_path)
    updater = grpo.Updater.create(policy, cfg.optim, 10, sampling_dtype="bfloat16", pack_sampler=packed)
    as_bf16 = lambda: [p.detach().to(torch.bfloat16) for p in policy.parameters()]  # noqa: E731
    copy = updater.sampler()
    assert all(torch.equal(c, p) for c, p in zip(copy.parameters(), as_bf16()))
    with torch.no_grad():
        next(copy.parameters()).add_(1.0)  # a marker: a refresh without an update would erase it
    assert updater.sampler() is copy and not torch.equal(next(copy.parameters()), as_bf16()[0])
    updater.step(sum(p.pow(2).sum() for p in policy.parameters()))  # an update moves every weight
    assert not all(torch.equal(c, p) for c, p in zip(copy.parameters(), as_bf16()))  # stale until asked for
    assert updater.sampler() is copy and all(torch.equal(c, p) for c, p in zip(copy.parameters(), as_bf16()))
    packed_layers = [m for m in copy.modules() if isinstance(m, PackedLinear)]
    assert bool(packed_layers) == (packed and can_pack_linear(copy))
    # the packed layers were refreshed too: the copy computes what a fresh bfloat16 copy computes
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, cast_copy(policy, "bfloat16")(ids).logits)


def test_sampling_may_use_another_attention_kernel_than_training(tiny_path, tmp_path):
    # eager attention for the training forwards, SDPA for the decode loop: the kernels agree to
    # float32 round-off, so the sampler's log-probs are still pi_old (ratio 1 on the first minibatch)
    cfg = make_cfg(tiny_path, tmp_path, steps=2, **{"model.attn_implementation": "eager", "sampling.attn_implementation": "sdpa"})
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)])
    assert all(row["ratio_dev/first"] <= 1e-5 for row in result.history)
    assert result.policy.config._attn_implementation == "eager"  # set back after each decode loop


def test_compiled_training_forward_matches_the_eager_one(tiny_path, tmp_path):
    # compile: the policy's training forward + backward through torch.compile (dynamic shapes): the
    # same loss and gradient as the eager forward, on two batches of different shapes (one compile)
    cfg = make_cfg(tiny_path, tmp_path, beta=0.0)
    policy, reference = load_policy(tiny_path), load_policy(tiny_path)
    tokenizer = load_tokenizer(tiny_path)
    for prompts, new_tokens in ((["12+3=", "4-1="], 6), (["1+1=", "45+17=", "9-8="], 4)):
        rollout = sample(policy, encode_prompts(tokenizer, prompts), SamplingParams(new_tokens), tokenizer.pad_token_id, [tokenizer.eos_token_id],
                         2, torch.Generator().manual_seed(0))
        grads, losses = [], []
        for compiled in (False, True):
            policy.zero_grad()
            logits = passes.completion_logits(policy, rollout, compiled)  # (B, C, V)
            loss = (torch.log_softmax(logits.float(), -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1) * rollout.completion_mask).sum()
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in policy.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for compiled_grad, eager_grad in zip(grads[1], grads[0]):
            torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-5)
        # the reference pass goes through the same compiled forward (its own graph: another model, no grad)
        ref_logp = [grpo.reference_logprobs(policy, reference, rollout, 1.0, rollout.batch_size, compiled=c) for c in (False, True)]
        torch.testing.assert_close(ref_logp[1], ref_logp[0], rtol=0, atol=1e-5)
        assert ref_logp[0][rollout.completion_mask.bool()].lt(0).all()
    assert grpo.load_config(grpo.GRPOConfig, None, {"compile": True}).compile
    with pytest.raises(ConfigError, match="attn_implementation"):  # inductor fails on eager attention with dynamic shapes
        grpo.load_config(grpo.GRPOConfig, None, {"compile": True, "model.attn_implementation": "eager"})


def test_compiled_sampling_trains_as_eager_sampling_does(tiny_path, tmp_path, compiled_sampling_calls):
    # sampling.compile: the decode step through torch.compile. Same uniforms, same completions (float32
    # round-off apart), so the same rewards and, after two steps, the same weights
    runs = []
    for compiled in (False, True):
        cfg = make_cfg(tiny_path, tmp_path / str(compiled), steps=2, **{"sampling.compile": compiled})
        runs.append(grpo.train(cfg, reward_functions=[grpo.RewardTerm("digits", 1.0, digit_share)]))
    eager, compiled = runs
    assert compiled_sampling_calls["decode"] > 0  # the compiled run's sampler went through the compiled step
    assert [row["reward/mean"] for row in compiled.history] == [row["reward/mean"] for row in eager.history]
    for compiled_param, eager_param in zip(compiled.policy.parameters(), eager.policy.parameters()):
        torch.testing.assert_close(compiled_param, eager_param, rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="sampling.dtype"):  # autocast rules out the StaticCache
        grpo.load_config(grpo.GRPOConfig, None, {"sampling.compile": True, "model.autocast": "bfloat16"})
    assert grpo.load_config(grpo.GRPOConfig, None, {"sampling.compile": True, "model.autocast": "bfloat16", "sampling.dtype": "bfloat16"}).sampling.compile
    with pytest.raises(ConfigError, match="fsdp"):
        grpo.load_config(grpo.GRPOConfig, None, {"sampling.compile": True, "model.sharding": "fsdp"})


def test_prompts_come_from_exactly_one_source(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="exactly one of data.task or data.path"):
        make_cfg(tiny_path, tmp_path, **{"data.task": None})
    with pytest.raises(ConfigError, match="exactly one of data.task or data.path"):
        make_cfg(tiny_path, tmp_path, **{"data.path": str(tmp_path / "prompts.jsonl")})


def test_a_reward_that_needs_a_column_names_the_first_record_without_it(tiny_path, tmp_path):
    records = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}, {"prompt": "3+3=", "answer": "6"}, {"prompt": "4+4="}]
    cfg = make_cfg(tiny_path, tmp_path, rewards=[{"function": "exact_match"}])
    with pytest.raises(ConfigError, match="needs a 'answer' column in the prompts; <in-memory records>, row 2 has none"):
        grpo.train(cfg, prompts=records)
