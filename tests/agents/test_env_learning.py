"""GRPO and PPO through the environment source: the config wiring, the environment's reward, the
episode evaluation, and an asynchronous producer. (Learning on the look-up task: benchmarks/agent_learning.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.config import ConfigError, load_config
from rlalign.tasks import lookup as L
from rlalign.tasks.tiny_model import TinyModelSpec
from rlalign.train import grpo, ppo

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from rlalign.tasks.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)


CORRECT = grpo.RewardTerm("correct", 1.0, L.reward)


class Scripted(L.LookupEnvironment):
    """The look-up environment whose reward also counts the look-ups (so the term is visibly the environment's)."""

    def reward(self, answer: str) -> float:
        return 10.0 * self.lookups + super().reward(answer)


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_trainers_take_the_environment_source(trainer, tiny_path, tmp_path, monkeypatch):
    from rlalign.agents import episodes as ep

    seen = []
    real = ep.run_episodes

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr("rlalign.train.env_source.run_episodes", spy)
    records = L.prompt_records("train", 8)
    common = {"model.path": str(tiny_path), "output_dir": str(tmp_path / trainer), "data.task": "arithmetic", "rewards": [], "steps": 1,
              "prompts_per_step": 2, "sampling.max_new_tokens": 8, "progress": False, "plots": False, "overwrite": True, "environment.max_turns": 2}
    if trainer == "grpo":  # the environment's reward alone; the environment given as an object, evaluated too
        eval_cfg = {"eval.data.task": "lookup", "eval.num_prompts": 2}
        result = grpo.train(load_config(grpo.GRPOConfig, None, {**common, "group_size": 2, "beta": 0.0, **eval_cfg}), prompts=records, environment=Scripted)
        evals = [h for h in result.history if "eval/success" in h]  # after the last step
        assert len(evals) == 1 and evals[0]["eval/turns"] >= 1.0 and "eval/pass@1" in evals[0]
    else:
        eval_cfg = {"eval.data.task": "lookup", "eval.num_prompts": 3, "eval.num_samples": 2, "eval.temperature": 1.0, "eval.num_samples_logged": 2}
        result = ppo.train(load_config(ppo.PPOConfig, None, {**common, "environment.class": "tests.agents.test_env_learning:Scripted", **eval_cfg}),
                           reward_functions=[CORRECT], prompts=records)
        evals = [h for h in result.history if "eval/success" in h]  # after the last step
        assert len(evals) == 1 and {"eval/pass@1", "eval/pass@2", "eval/turns", "eval/tool_calls", "eval/reward/mean"} <= set(evals[0])
        import json

        rows = [json.loads(line) for line in (tmp_path / trainer / "eval_samples.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and rows[0]["episode"].startswith("user: Which is") and set(rows[0]) == {"step", "episode", "final", "reward"}
    history = result.history[0]
    assert {"agents/turns", "agents/tool_calls", "agents/malformed_calls", "agents/timed_out", "agents/env_tokens_frac"} <= set(history)
    assert history["agents/turns"] == seen[0].turns.float().mean().item()
    env = torch.tensor([r or 0.0 for r in seen[0].env_rewards])
    assert history["reward/environment/mean"] == pytest.approx(env.mean().item())
    assert ("reward/correct/mean" in history) == (trainer == "ppo")


def test_trls_list_of_typed_tools_runs_as_episodes_of_those_functions(tiny_path, tmp_path, monkeypatch):
    # GRPOTrainer(tools=[lookup]) in TRL: here grpo.train(cfg, tools=[lookup]) with an environment: section (it was
    # an AttributeError: 'list' object has no attribute 'items')
    from rlalign.agents import episodes as ep
    from rlalign.agents.environment import FunctionTools

    made = []
    real = ep.run_episodes
    monkeypatch.setattr("rlalign.train.env_source.run_episodes", lambda m, t, r, make_env, *a, **k: made.append(make_env()) or real(m, t, r, make_env, *a, **k))
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tiny_path), "output_dir": str(tmp_path), "data.task": "arithmetic", "rewards": [], "steps": 1, "prompts_per_step": 2,
        "group_size": 2, "sampling.max_new_tokens": 8, "beta": 0.0, "progress": False, "plots": False, "eval.enabled": False, "environment.max_turns": 2,
    })
    history = grpo.train(cfg, reward_functions=[CORRECT], prompts=L.prompt_records("train", 8), tools=[L.lookup]).history[0]
    assert isinstance(made[0], FunctionTools) and made[0].tools == ["lookup"] and made[0].lookup is L.lookup
    assert "agents/turns" in history and "reward/correct/mean" in history


def test_trls_list_of_tools_needs_the_environment_section_and_describable_functions():
    from rlalign.train.env_source import train_tools

    with_env = load_config(grpo.GRPOConfig, None, {"environment.max_turns": 2})
    _, make = train_tools(with_env, [L.lookup], None)
    assert make().tools == ["lookup"] and train_tools(with_env, None, Scripted) == (None, Scripted)
    with pytest.raises(ConfigError, match="max_tool_calling_iterations"):
        train_tools(load_config(grpo.GRPOConfig, None, {}), [L.lookup], None)
    with pytest.raises(ConfigError, match="beside environment Scripted: only TRL's environment classes take tools given apart"):
        train_tools(with_env, [L.lookup], Scripted)  # an rlalign environment lists its tools itself (a TRL one: test_trl_environment)
    with pytest.raises(ConfigError, match="needs type hints and a docstring"):
        train_tools(with_env, [lambda name: name], None)
    with pytest.raises(ConfigError, match="cfg.tools is null"):
        train_tools(with_env, {"lookup": L.lookup}, None)


class Sometimes(L.LookupEnvironment):
    """The look-up environment that gives no reward (None) to an answer of odd length, 1.0 to the others."""

    def reward(self, answer: str) -> float | None:
        return None if len(answer) % 2 else 1.0


class Never(L.LookupEnvironment):
    def reward(self, answer: str) -> float | None:
        return None


@pytest.mark.parametrize("environment", [Sometimes, Never])
def test_an_environment_that_gives_a_row_no_reward_leaves_it_out_when_no_term_scores_it(environment, tiny_path, tmp_path, monkeypatch):
    # the environment's reward alone: a row it gave None (no reward) was scored 0 and entered its group's baseline
    from rlalign.agents import episodes as ep

    seen = []
    real = ep.run_episodes
    monkeypatch.setattr("rlalign.train.env_source.run_episodes", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tiny_path), "output_dir": str(tmp_path), "data.task": "arithmetic", "rewards": [], "steps": 1, "prompts_per_step": 2,
        "group_size": 4, "sampling.max_new_tokens": 8, "beta": 0.0, "progress": False, "plots": False, "environment.max_turns": 2,
    })
    history = grpo.train(cfg, prompts=L.prompt_records("train", 8), environment=environment).history[0]
    missing = sum(r is None for r in seen[0].env_rewards)
    assert missing > 0 and history["reward/no_term_applies/failed"] == missing
    assert all(math.isfinite(v) for v in history.values() if isinstance(v, float))


def test_the_environment_source_runs_in_an_async_producer(tiny_path, tmp_path):
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "async"), "data.task": "arithmetic", "rewards": [], "steps": 2, "prompts_per_step": 2,
        "group_size": 2, "sampling.max_new_tokens": 8, "beta": 0.0, "progress": False, "plots": False, "overwrite": True, "environment.max_turns": 2,
        "environment.class": "tests.agents.test_env_learning:Scripted", "async_rollouts.enabled": True, "async_rollouts.max_staleness": 0,
    })
    result = grpo.train(cfg, reward_functions=[CORRECT], prompts=L.prompt_records("train", 8))
    assert len(result.history) == 2 and all("agents/turns" in h and "reward/environment/mean" in h for h in result.history)


def test_environment_config_checks():
    with pytest.raises(ConfigError, match="cannot be combined with tools"):
        load_config(grpo.GRPOConfig, None, {"model.path": "x", "data.task": "arithmetic", "environment.max_turns": 2, "tools.max_turns": 2})
    cfg = load_config(grpo.GRPOConfig, None, {"model.path": "x", "data.task": "arithmetic", "environment.class": "a:B", "environment.tool_format": "hermes"})
    assert cfg.environment.cls == "a:B" and cfg.environment.tool_format == "hermes"
    # DAPO's overlong penalty measured an episode's turns and tool results together against one turn's limit
    with pytest.raises(ConfigError, match="environment: overlong_buffer is not supported with multi-turn rollouts"):
        load_config(grpo.GRPOConfig, None, {"model.path": "x", "environment.class": "a:B", "overlong_buffer": 4, "sampling.max_new_tokens": 8})


class Quarter(L.LookupEnvironment):
    """The look-up environment whose own reward is always 0.25."""

    def reward(self, answer: str) -> float:
        return 0.25


def test_the_episode_evaluation_adds_the_environments_reward_to_the_terms(tiny_path):
    # a term giving 0.5 on every answer plus the environment's 0.25: every episode's total is 0.75 by hand
    from rlalign.agents.env_config import EnvironmentConfig
    from rlalign.lm.data import load_prompts
    from rlalign.lm.decode import SamplingParams
    from rlalign.lm.models import load_policy, load_tokenizer
    from rlalign.train.env_source import evaluate_episodes

    half = grpo.RewardTerm("half", 1.0, lambda prompts, completions, **kw: [0.5] * len(completions))
    prompts = load_prompts(L.prompt_records("eval", 3))
    model_cfg = type("ModelCfg", (), {"autocast": "none"})()  # float32 forwards
    args = (load_policy(tiny_path), load_tokenizer(tiny_path), prompts, [half], Quarter, EnvironmentConfig(max_turns=2), SamplingParams(8, 1.0), model_cfg)
    metrics, table = evaluate_episodes(*args, num_samples=2, pass_threshold=0.75, rows_logged=6)
    assert metrics["eval/reward/mean"] == pytest.approx(0.75) and [row["reward"] for row in table] == pytest.approx([0.75] * 6)
    assert metrics["eval/success"] == 1.0 and metrics["eval/pass@2"] == 1.0
    assert evaluate_episodes(*args, num_samples=2, pass_threshold=0.8)[0]["eval/success"] == 0.0


@pytest.mark.parametrize("eval_tokens, env_tokens, expected", [(None, None, 12), (None, 7, 7), (5, 7, 5)])
def test_episode_evaluation_tokens_per_turn_come_from_eval_then_environment_then_sampling(eval_tokens, env_tokens, expected, monkeypatch, tmp_path):
    from rlalign.train import env_source

    seen = []
    monkeypatch.setattr(env_source, "evaluate_episodes", lambda *args, **kwargs: seen.append(args[6]) or ({}, []))
    cfg = load_config(grpo.GRPOConfig, None, {
        "output_dir": str(tmp_path), "sampling.max_new_tokens": 12, "eval.max_new_tokens": eval_tokens, "eval.temperature": 0.5,
        "environment.class": "tests.agents.test_env_learning:Quarter", "environment.max_new_tokens": env_tokens,
    })
    env_source.episode_evaluator(cfg, None, None, [], [])(0)
    assert [(p.max_new_tokens, p.temperature) for p in seen] == [(expected, 0.5)]
