"""Asynchronous rollouts: a producer process samples ahead of the learner by at most k updates.

Pinned: k = 0 is the synchronous run (same weights, same metrics); for k = 1 and 2 the rollout of
step s was sampled by exactly the weights after max(0, s - k) updates (its sampler log-probs are
those weights' log-probs of its tokens, not the learner's); a resumed asynchronous run ends with
the uninterrupted run's weights; a producer that raises or dies stops the run naming what it was
doing; under torchrun the producers must be ranks (tests/train/test_rank_producers.py). The decoupled objective's value and gradient are pinned in
tests/train/test_rl_composed.py."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from rlalign.config import ConfigError, load_config
from rlalign.lm.models import load_policy, load_tokenizer
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import async_source, distributed, grpo, ppo
from rlalign.train.async_source import RolloutProducerError, check_one_process
from rlalign.train.passes import training_logprobs


@pytest.fixture(autouse=True)
def _on_the_cpu(request):
    """The producer process runs on the CPU only (with model.device cuda the config is refused), so under --model-device=cuda these skip."""
    if request.config.getoption("--model-device") != "cpu":
        pytest.skip("asynchronous rollouts run on the CPU")

VOLATILE = ("time/", "tokens_per_s", "staleness/", "memory/budget_mb")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)


def make_cfg(trainer, tiny_path, out, **overrides):
    base = {
        "model.path": str(tiny_path), "output_dir": str(out), "data.task": "arithmetic", "data.num_prompts": 32, "steps": 4, "prompts_per_step": 2,
        "sampling.max_new_tokens": 4, "optim.lr": 1e-2, "progress": False, "overwrite": True, "plots": False, "rewards": [],
        "eval.every": 0, "save_every": 0,
    }
    base.update({"group_size": 4} if trainer is grpo else {"ppo_epochs": 1, "num_minibatches": 2, "prompts_per_step": 4, "critic.optim.lr": 1e-2})
    base.update(overrides)
    return load_config(grpo.GRPOConfig if trainer is grpo else ppo.PPOConfig, None, base)


def char_code(completions, **kwargs):
    """A deterministic, varied score of the text (so groups rarely tie and every step learns)."""
    return [float(sum(ord(ch) for ch in c) % 11) for c in completions]


def final_weights(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.policy.state_dict().items()}


def char_code_and_noise(completions, **kwargs):
    import random

    return [c + random.random() + float(torch.rand(())) for c in char_code(completions)]


def stable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in history]


@pytest.mark.parametrize("trainer", [grpo, ppo], ids=["grpo", "ppo"])
def test_k0_is_the_synchronous_run(trainer, tiny_path, tmp_path):
    # the reward also draws from Python's and torch's global RNGs: both paths seed them from (seed, step) before a step
    torch.set_num_threads(1)
    sync = trainer.train(make_cfg(trainer, tiny_path, tmp_path / "sync"), reward_functions=[char_code_and_noise])
    options = {"async_rollouts.enabled": True, "async_rollouts.max_staleness": 0}
    started = time.perf_counter()
    asynchronous = trainer.train(make_cfg(trainer, tiny_path, tmp_path / "async", **options), reward_functions=[char_code_and_noise])
    wall = time.perf_counter() - started
    assert stable(asynchronous.history) == stable(sync.history)
    # the waits are parts of the run: between 0 and its wall time
    assert all(row["staleness/max"] == 0.0 and 0 <= row["time/producer_idle"] <= wall and 0 <= row["time/queue_wait"] <= wall for row in asynchronous.history)
    a, b = final_weights(sync), final_weights(asynchronous)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], load_policy(tiny_path).state_dict()[k]) for k in a)  # it learnt something: the equality means something


@pytest.mark.parametrize("k", [1, 2])
def test_the_rollout_of_step_s_is_sampled_by_the_weights_of_version_s_minus_k(k, tiny_path, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    versions: dict[int, dict[str, torch.Tensor]] = {0: {n: p.clone() for n, p in load_policy(tiny_path).state_dict().items()}}
    batches = {}
    publish, next_batch = async_source.AsyncSource.publish, async_source.AsyncSource.next

    def recording_publish(self, policy, version):
        versions[version] = {n: p.detach().clone() for n, p in policy.state_dict().items()}
        return publish(self, policy, version)

    def recording_next(self, state):
        batches[state.step] = batch = next_batch(self, state)
        return batch

    monkeypatch.setattr(async_source.AsyncSource, "publish", recording_publish)
    monkeypatch.setattr(async_source.AsyncSource, "next", recording_next)
    cfg = make_cfg(grpo, tiny_path, tmp_path / "run", steps=5, tis_cap=2.0, **{"async_rollouts.enabled": True, "async_rollouts.max_staleness": k})
    history = grpo.train(cfg, reward_functions=[char_code]).history
    assert [row["staleness/mean"] for row in history] == [float(min(s, k)) for s in range(5)]
    policy = load_policy(tiny_path)
    for step, batch in batches.items():
        assert batch.version == max(0, step - k)
        rollout, rows = batch.rollout, [torch.arange(batch.rollout.batch_size)]
        mask = rollout.completion_mask.bool()
        policy.load_state_dict(versions[batch.version])
        behaviour = training_logprobs(policy, rollout, cfg.sampling.temperature, rows)  # (B, C) the version that sampled it
        torch.testing.assert_close(rollout.logprobs[mask], behaviour[mask], rtol=0, atol=2e-5)
        if step >= k + 1:  # the learner's own weights of that step give other log-probs: the rollout really is stale
            policy.load_state_dict(versions[step])
            assert (training_logprobs(policy, rollout, cfg.sampling.temperature, rows)[mask] - rollout.logprobs[mask]).abs().max() > 1e-3


def straight_and_resumed_at_step_2(tiny_path, tmp_path, options: dict, reward) -> tuple:
    """A run of ``options`` (4 steps, a checkpoint every 2), and the same run resumed from its step-2 checkpoint."""
    straight = grpo.train(make_cfg(grpo, tiny_path, tmp_path / "straight", **options), reward_functions=[reward])
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "final")
    for ckpt in (tmp_path / "resumed" / "checkpoints").iterdir():
        if not ckpt.name.endswith("2"):
            shutil.rmtree(ckpt)
    resumed = grpo.train(make_cfg(grpo, tiny_path, tmp_path / "resumed", **{**options, "overwrite": False}), resume=tmp_path / "resumed",
                         reward_functions=[reward])
    assert stable(resumed.history) == stable(straight.history[2:])
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    return straight, resumed


def test_a_resumed_asynchronous_run_ends_with_the_uninterrupted_runs_weights(tiny_path, tmp_path):
    torch.set_num_threads(1)
    options = {"steps": 4, "save_every": 2, "keep_last": 3, "tis_cap": 2.0, "async_rollouts.enabled": True, "async_rollouts.max_staleness": 2}
    # stopped after its checkpoint at step 2: rollouts 2 and 3 were in flight (sampled by versions 0 and 1)
    _, resumed = straight_and_resumed_at_step_2(tiny_path, tmp_path, options, char_code)
    assert [row["staleness/mean"] for row in resumed.history] == [2.0, 2.0]
    # extending the finished run: its last checkpoint holds nothing in flight, and steps 5 and 6 were to be sampled by
    # the weights of steps 3 and 4, which it does not hold: a clear error, not rollouts of newer weights
    with pytest.raises(ConfigError, match="holds 0 of those 2 rollouts in flight .*made for steps=4"):
        grpo.train(make_cfg(grpo, tiny_path, tmp_path / "straight", **{**options, "steps": 6, "overwrite": False}), resume=tmp_path / "straight",
                   reward_functions=[char_code])


def test_a_resumed_asynchronous_run_with_dynamic_sampling_draws_after_the_rollouts_in_flight(tiny_path, tmp_path):
    # the producer's source goes on from the data position after the checkpoint's rollout in flight (k = 1), not after
    # the last step trained: it drew that rollout's prompts again, and the run diverged
    torch.set_num_threads(1)
    options = {"steps": 4, "save_every": 2, "keep_last": 3, "tis_cap": 2.0, "dynamic_sampling": True, "async_rollouts.enabled": True,
               "async_rollouts.max_staleness": 1}
    straight_and_resumed_at_step_2(tiny_path, tmp_path, options, char_code)


def noisy_length(completions, **kwargs):
    import random

    return [float(len(c)) + random.random() for c in completions]  # Python's global RNG, in the producer process


def test_a_resumed_asynchronous_run_draws_a_rewards_global_random_numbers_as_the_uninterrupted_one(tiny_path, tmp_path):
    # the producer seeds the global RNGs from the run's seed and the step before it samples or scores one: a resumed
    # run's producer (forked anew, its RNG state in no checkpoint) drew other numbers and the run diverged
    torch.set_num_threads(1)
    options = {"steps": 4, "save_every": 2, "keep_last": 3, "async_rollouts.enabled": True, "async_rollouts.max_staleness": 0}
    straight_and_resumed_at_step_2(tiny_path, tmp_path, options, noisy_length)


def raises_at_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 2:
        raise ValueError("the grader's database is gone")
    return [0.0] * len(completions)


def dies_at_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 2:
        os._exit(7)
    return [float(len(c)) for c in completions]


def test_a_producer_that_raises_stops_the_run_naming_the_step_and_the_error(tiny_path, tmp_path):
    cfg = make_cfg(grpo, tiny_path, tmp_path / "run", rewards=[], save_every=1, tis_cap=2.0, **{"async_rollouts.enabled": True})
    with pytest.raises(RolloutProducerError, match=r"(?s)failed at step 2.*raises_at_step_2 raised ValueError: the grader's database is gone"):
        grpo.train(cfg, reward_functions=[raises_at_step_2])


def test_a_producer_that_dies_stops_the_run_and_the_last_checkpoint_stays_whole(tiny_path, tmp_path):
    cfg = make_cfg(grpo, tiny_path, tmp_path / "run", rewards=[], save_every=1, tis_cap=2.0, **{"async_rollouts.enabled": True})
    with pytest.raises(RolloutProducerError, match=r"died with exit code 7 while .*scoring step 2"):
        grpo.train(cfg, reward_functions=[dies_at_step_2])
    # the producer died one step ahead: the learner finished step 1 but could not checkpoint it without rollout 2 (in flight),
    # so the last checkpoint is the one after step 0, whole, holding rollout 1; the run resumes from there
    cfg = make_cfg(grpo, tiny_path, tmp_path / "run", rewards=[], save_every=1, tis_cap=2.0, overwrite=False, **{"async_rollouts.enabled": True})
    resumed = grpo.train(cfg, resume=tmp_path / "run", reward_functions=[grpo.RewardTerm("len", 1.0, lambda prompts, completions: [0.0] * len(completions))])
    assert resumed.history[0]["step"] == 1


def test_stale_rollouts_need_an_importance_weight_and_one_process(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="set tis_cap"):
        make_cfg(grpo, tiny_path, tmp_path, **{"async_rollouts.enabled": True, "async_rollouts.max_staleness": 1})
    cfg = make_cfg(grpo, tiny_path, tmp_path, tis_cap=2.0, **{"async_rollouts.enabled": True})
    with pytest.raises(ConfigError, match="async_rollouts under torchrun makes some ranks producers: set async_rollouts.producers"):
        check_one_process(cfg, distributed.World(rank=0, size=2))
    check_one_process(cfg, distributed.World())
    check_one_process(cfg, distributed.World(rank=0, size=2, learners=2, producers=1))  # producer ranks


@pytest.mark.parametrize("k", [0, 1])
def test_multi_turn_tool_rollouts_run_in_the_producer(k, tiny_path, tmp_path, monkeypatch):
    # the tool source (a call, its result fed back, then the answer) made in the producer process:
    # at k = 0 the run equals the synchronous one; at k = 1 it runs with its tool metrics and staleness
    from rlalign.train import tool_rollout as tr

    from .test_tool_use import scripted_sampler

    tokenizer = load_tokenizer(tiny_path)

    def script(model, prompts, params, pad, stop, group_size, generator=None, noise=None):  # a call first, then the result's answer
        texts = ["42<eos>" if "<result>" in tokenizer.decode(p) else "<tool>calculator: 6*7</tool>" for p in prompts]
        return scripted_sampler(tokenizer, [texts])(model, prompts, params, pad, stop, group_size, generator)

    monkeypatch.setattr(tr, "sample", script)  # the forked producer inherits the patched module
    tools = {"tools.max_turns": 3, "tools.format": "tag", "sampling.max_new_tokens": 32}
    prompts = [{"prompt": f"6*7= ({i})"} for i in range(8)]
    runs = {}
    for name, options in (("sync", {}), ("async", {"async_rollouts.enabled": True, "async_rollouts.max_staleness": k, "tis_cap": 2.0 if k else None})):
        cfg = make_cfg(grpo, tiny_path, tmp_path / name, **tools, **options)
        runs[name] = grpo.train(cfg, reward_functions=[char_code], prompts=prompts)
    rows = runs["async"].history
    assert all(row["tools/turns"] == 2.0 and row["tools/messages"] == 1.0 for row in rows)
    assert [row["staleness/max"] for row in rows] == [0.0] + [float(k)] * (len(rows) - 1)
    if k == 0:
        assert stable(rows) == stable(runs["sync"].history)
        a, b = final_weights(runs["sync"]), final_weights(runs["async"])
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_long_status_is_cut_to_the_shared_buffer_with_its_end_mark():
    # the learner reads the producer's status from 240 shared bytes: 239 of a longer text, then the NUL that ends it
    import multiprocessing as mp

    status = mp.get_context("fork").Array("c", 240, lock=False)
    producer = async_source._Producer(None, None, [], None, None, status, 0, 1)
    producer.say("x" * 300)
    assert bytes(status[:]) == b"x" * 239 + b"\0"
    producer.say("sampling step 3")  # a shorter text later: read up to its own NUL
    assert bytes(status[:]).split(b"\0")[0] == b"sampling step 3"
