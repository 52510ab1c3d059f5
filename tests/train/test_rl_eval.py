"""Evaluation during GRPO and PPO: when it runs, what it logs, that it equals an independent greedy
decode of the held-out prompts, and that it leaves the training untouched.

Tiny Llama (hidden 64, 2 layers), one torch thread.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlalign.config import ConfigError, load_config
from rlalign.lm.models import load_policy, load_tokenizer
from rlalign.tasks import TASKS
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, ppo
from rlalign.train.common import generation_eval
from rlalign.train.metrics import read_metrics


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


def char_code_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """A deterministic, varied score of the text (0..10)."""
    return [float(sum(ord(ch) for ch in c) % 11) for c in completions]


REWARDS = [grpo.RewardTerm("code", 1.0, char_code_reward)]


def make_cfg(tiny_path, out, cls=grpo.GRPOConfig, **overrides):
    base = {
        "model.path": str(tiny_path), "output_dir": str(out), "data.task": "arithmetic", "data.num_prompts": 64, "steps": 3,
        "prompts_per_step": 2, "sampling.max_new_tokens": 6, "optim.lr": 3e-3, "progress": False, "plots": False,
        "eval.num_prompts": 6, "eval.batch_size": 4,  # batches of 4 and 2 prompts
    }
    base.update({"group_size": 4} if cls is grpo.GRPOConfig else {"prompts_per_step": 4, "critic.optim.lr": 3e-3})
    base.update(overrides)
    return load_config(cls, None, base)


def eval_records(out) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "eval/reward/mean" in r]


def test_grpo_evaluates_before_the_first_step_every_n_steps_and_after_the_last(tiny_path, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(tiny_path, out, **{"eval.every": 2, "eval.num_samples": 4, "eval.temperature": 1.0, "eval.pass_threshold": 5.0,
                                      "eval.num_samples_logged": 3})
    grpo.train(cfg, reward_functions=REWARDS)
    records = eval_records(out)
    assert [r["step"] for r in records] == [-1, 1, 2]  # before step 0, after step 1 (every 2), after the last
    for r in records:
        for key in ("eval/reward/std", "eval/reward/code/mean", "eval/completion_len/mean", "eval/completion_len/max", "eval/completion_len/clipped_frac"):
            assert key in r, key
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= r["eval/pass@4"] <= 1
        assert r["eval/reward/mean"] == pytest.approx(r["eval/reward/code/mean"])  # one term of weight 1
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [-1] * 3 + [1] * 3 + [2] * 3
    for s in samples:
        assert s["reward"] == char_code_reward([s["prompt"]], [s["completion"]])[0] == s["code"]


def test_pass_at_1_is_the_share_of_passing_samples(tiny_path, tmp_path):
    # with every sample logged, pass@1 is the share of logged rows whose reward reaches the threshold
    out = tmp_path / "run"
    cfg = make_cfg(tiny_path, out, steps=1, **{"eval.num_samples": 2, "eval.temperature": 1.0, "eval.pass_threshold": 5.0, "eval.num_samples_logged": 12})
    grpo.train(cfg, reward_functions=REWARDS)
    first = eval_records(out)[0]
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines() if json.loads(line)["step"] == -1]
    assert len(rows) == 12  # 6 prompts x 2 samples
    assert first["eval/pass@1"] == pytest.approx(sum(r["reward"] >= 5.0 for r in rows) / 12)
    assert first["eval/reward/mean"] == pytest.approx(sum(r["reward"] for r in rows) / 12)


def test_greedy_evaluation_equals_an_independent_greedy_decode_of_the_held_out_prompts(tiny_path, tmp_path):
    out = tmp_path / "run"
    grpo.train(make_cfg(tiny_path, out, steps=1, **{"eval.num_samples_logged": 6}), reward_functions=REWARDS)
    prompts = [r["prompt"] for r in TASKS["arithmetic"].prompt_records("eval", 6, 0)]  # the task's eval split, not its training prompts
    mean, completions = generation_eval(load_policy(tiny_path), load_tokenizer(tiny_path), prompts, char_code_reward, max_new_tokens=6)
    first = eval_records(out)[0]
    assert first["step"] == -1 and first["eval/reward/mean"] == pytest.approx(mean)
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()][:6]
    assert [r["prompt"] for r in rows] == prompts and [r["completion"] for r in rows] == completions


def test_evaluation_leaves_the_training_untouched(tiny_path, tmp_path):
    # the evaluation draws from a generator of its own and restores the policy's mode: the same updates with or without it
    runs = {}
    for name, enabled in (("with", True), ("without", False)):
        cfg = make_cfg(tiny_path, tmp_path / name, **{"eval.enabled": enabled, "eval.num_samples": 2, "eval.temperature": 1.0, "eval.every": 1})
        runs[name] = grpo.train(cfg, reward_functions=REWARDS)
    assert not eval_records(tmp_path / "without") and len(eval_records(tmp_path / "with")) == 4
    for a, b in zip(runs["with"].history, runs["without"].history):
        assert {k: v for k, v in a.items() if not k.startswith(("eval/", "time/", "tokens_per_s", "memory/budget_mb"))} == {
            k: v for k, v in b.items() if not k.startswith(("time/", "tokens_per_s", "memory/budget_mb"))}
    with_eval, without = (load_file(str(tmp_path / name / "final" / "model.safetensors")) for name in ("with", "without"))
    assert all(torch.equal(with_eval[k], without[k]) for k in with_eval)


def test_held_out_prompts_from_a_file_and_none_for_file_training_data(tiny_path, tmp_path):
    records = TASKS["arithmetic"].prompt_records("train", 16, 3)
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    data = {"data.task": None, "data.path": str(train_file)}
    grpo.train(make_cfg(tiny_path, tmp_path / "none", steps=1, **data), reward_functions=REWARDS)
    assert not eval_records(tmp_path / "none")  # a file's training prompts have no held-out split of their own
    grpo.train(make_cfg(tiny_path, tmp_path / "file", steps=1, **data, **{"eval.data.path": str(eval_file)}), reward_functions=REWARDS)
    logged = [json.loads(line)["prompt"] for line in (tmp_path / "file" / "eval_samples.jsonl").read_text().splitlines()]
    assert logged[:5] == [r["prompt"] for r in records[:5]] and len(eval_records(tmp_path / "file")) == 2


def test_ppo_evaluates_too(tiny_path, tmp_path):
    out = tmp_path / "run"
    ppo.train(make_cfg(tiny_path, out, ppo.PPOConfig, steps=2, num_minibatches=1, ppo_epochs=1), reward_functions=REWARDS)
    assert [r["step"] for r in eval_records(out)] == [-1, 1]


def test_several_greedy_samples_are_a_clear_error():
    with pytest.raises(ConfigError, match="eval.temperature"):
        load_config(grpo.GRPOConfig, None, {"eval.num_samples": 4})


def test_eval_batches_hold_every_prompt_at_most_batch_size_a_rank_and_one_at_least():
    from rlalign.train.rl_eval import eval_batches

    assert eval_batches(6, 4, 1) == [(0, 3), (3, 6)]  # two batches: 3 and 3 prompts
    assert eval_batches(9, 4, 2) == [(0, 4), (4, 9)]  # 2 + 2, then 3 + 2 a rank: none left out (8 were evaluated)
    assert eval_batches(20, 4, 2) == [(0, 6), (6, 13), (13, 20)]
    assert eval_batches(7, 64, 2) == [(0, 7)]  # one batch, 4 + 3 (a batch past the prompts raised)
    assert eval_batches(5, 1, 4) == [(0, 5)]  # batch_size 1 on 4 ranks: 2 + 1 + 1 + 1, no rank without a prompt
    from rlalign.train.distributed import World

    assert [World(rank=r, size=3).split(7) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert [World(rank=r, size=2).split(4) for r in range(2)] == [slice(0, 2), slice(2, 4)]


def test_a_sampled_evaluation_does_not_depend_on_its_batch_size(tiny_path):
    # every row's uniforms are drawn up front by its place among all rows, so batches of 2 or 8 prompts (as 1 or 4 ranks
    # of batch_size 2 would make) sample the same completions; fewer prompts than processes is a clear error
    from rlalign.lm.data import load_prompts
    from rlalign.train.distributed import World
    from rlalign.train.rl_config import EvalConfig
    from rlalign.train.rl_eval import evaluate_policy
    from rlalign.train.run_config import ModelConfig

    tokenizer, policy = load_tokenizer(tiny_path), load_policy(tiny_path)
    prompts = load_prompts(TASKS["arithmetic"].prompt_records("eval", 7, 0))
    runs = [evaluate_policy(policy, tokenizer, prompts, REWARDS, EvalConfig(batch_size=b, temperature=1.0, num_samples=2), 6, ModelConfig(), seed=3)
            for b in (2, 8)]
    assert runs[0][0] == pytest.approx(runs[1][0], abs=1e-6) and runs[0][0]["eval/reward/mean"] > 0
    assert [row["completion"] for row in runs[0][1]] == [row["completion"] for row in runs[1][1]]
    with pytest.raises(ValueError, match="7 prompts, fewer than the 8 processes"):
        evaluate_policy(policy, tokenizer, prompts, REWARDS, EvalConfig(), 6, ModelConfig(), seed=3, world=World(rank=0, size=8))
