"""Episodes against a Python environment as a rollout source (the ``environment:`` config section).

    source = EnvironmentSource(updater, scorer, prompts, n, seed, sampling, model_cfg, env=LookupEnvironment, env_cfg=cfg.environment)
    batch = source.next(state)   # ScoredBatch: token mask 0 on the environment's tokens; metrics agents/*

Each step's ``n`` prompt records each get ``group_size`` episodes (:func:`rlalign.agents.episodes.run_episodes`),
sampled by the policy (or its sampling copy). Rewards: the reward terms score each episode, and the
environment's own reward, where it gives one, is the term "environment" (:class:`rlalign.train.sources.Scorer`);
either or both. A reward function gets, for a conversational prompt, the episode after the prompt as TRL
gives it (``Episodes.completions``: assistant turns with their tool calls, tool replies, the final turn),
in training and in :func:`evaluate_episodes` alike; the built-in terms score the final answer (the last
assistant turn). An episode that ran past
``environment.timeout_s`` is left out of training (its unfinished turn is no answer to score): marked failed
as :data:`TIMED_OUT` (``reward/environment_timeout/failed``: how many), so its advantage is 0 and its
tokens are out of the loss. GRPO and PPO take it like any
source, and :class:`rlalign.train.async_source.AsyncSource` runs it in a producer process (the
environment must then be importable: a class or ``module:Class``, not a lambda).

:func:`evaluate_episodes` is the multi-turn evaluation: success rate (total reward >=
``pass_threshold``), pass@k over ``num_samples`` episodes a prompt, turns and calls, and a samples
table of whole episodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlalign.agents.env_config import EnvironmentConfig
from rlalign.agents.environment import EnvRunner, FunctionTools, environment_factory, load_object
from rlalign.agents.trl_environment import TRLEnvironment, protocol, trl_tools, with_standalone_tools
from rlalign.agents.tool_calls import tool_schemas
from rlalign.config import ConfigError
from rlalign.agents.episodes import Episodes, episode_metrics, episode_sums, metrics_of_sums, run_episodes
from rlalign.lm.data import PromptExample
from rlalign.lm.decode import SamplingParams
from rlalign.lm.model_modes import attention_kernel, evaluating
from rlalign.train import distributed
from rlalign.train.common import forward_precision
from rlalign.train.rl_eval import pass_at_ks
from rlalign.train.rollouts import EpisodeRows, RewardTerm, prompt_batch, score_shard
from rlalign.train.sources import Sampled, SampledSource, make_scorer, sampling_generator

__all__ = [
    "TIMED_OUT", "EnvironmentSource", "make_environment_source", "sample_episodes", "global_episode_metrics", "evaluate_episodes", "episode_evaluator",
    "train_tools", "check_environment",
]

TIMED_OUT = "environment_timeout"  # the failed rows' entry of episodes past environment.timeout_s (reward/environment_timeout/failed)


def _records(examples: Sequence[PromptExample]) -> list[dict[str, Any]]:
    return [{**ex.metadata, "prompt": ex.prompt} for ex in examples]


def sample_episodes(updater, tokenizer, records, env: Callable[[], Any], env_cfg: EnvironmentConfig, params: SamplingParams, model_cfg,
                    attn_implementation, group_size: int, generator: torch.Generator, world: distributed.World = distributed.World()) -> Episodes:
    """:func:`run_episodes` of this rank's share of a step's ``records`` by ``updater``'s policy (or its
    sampling copy), in eval mode; the rows' tokens do not depend on the world size."""
    share = world.shard(len(records), "prompts_per_step")
    records, rows = list(records[share]), slice(share.start * group_size, share.stop * group_size)
    policy, sampler = updater.module, updater.sampler()
    precision = forward_precision(model_cfg, policy) if sampler is policy else contextlib.nullcontext()
    with distributed.gathered(policy), precision, evaluating(sampler), attention_kernel(sampler, attn_implementation):
        return run_episodes(
            sampler, tokenizer, records, env, params, group_size=group_size, max_turns=env_cfg.max_turns, fmt=env_cfg.tool_format, generator=generator,
            timeout_s=env_cfg.timeout_s, max_result_chars=env_cfg.max_result_chars, shard=(rows, len(records) * group_size * world.size),
        )


def global_episode_metrics(episodes: Episodes, world: distributed.World = distributed.World()) -> dict[str, float]:
    """:func:`rlalign.agents.episodes.episode_metrics` over every rank's rows."""
    sums = episode_sums(episodes)
    totals = dict(zip(sums, distributed.all_sum(torch.tensor(list(sums.values()), dtype=torch.float64), world).tolist()))
    return metrics_of_sums(totals) | ({"weight/agents/env_tokens_frac": totals["tokens"]} if world.view else {})  # a view: weighed by the learner


def _turn_params(sampling, env_cfg: EnvironmentConfig) -> SamplingParams:
    params = sampling.params()
    return params if env_cfg.max_new_tokens is None else dataclasses.replace(params, max_new_tokens=env_cfg.max_new_tokens)


def episode_rows(episodes: Episodes) -> EpisodeRows:
    """What the reward functions get of ``episodes`` in place of the records' own: TRL's prompts, completions and environments."""
    return EpisodeRows(episodes.prompts, episodes.completions, episodes.environments)


@dataclass
class EnvironmentSource(SampledSource):
    """Multi-turn episodes against ``env`` (a class or zero-argument maker; ``env_cfg.cls`` when None)."""

    env: Any = None
    env_cfg: EnvironmentConfig | None = None

    def __post_init__(self) -> None:
        self.env_cfg = self.env_cfg or EnvironmentConfig()
        if self.env is None:
            if self.env_cfg.cls is None:
                raise ValueError("environment: set environment.class (module:Class) or pass the environment to train(environment=...)")
            self.env = self.env_cfg.cls  # resolved when sampling (a producer process imports it itself)

    def sample(self, state) -> Sampled:
        t0 = time.perf_counter()
        examples = prompt_batch(self.prompts, state.step, self.n, self.seed)
        episodes = sample_episodes(
            self.sampler, self.scorer.tokenizer, _records(examples), environment_factory(self.env), self.env_cfg, _turn_params(self.sampling, self.env_cfg),
            self.model_cfg, self.sampling.attn_implementation, self.scorer.group_size, sampling_generator(self.seed, state.step), self.scorer.world,
        )
        return Sampled(
            state.step, examples, episodes.rollout, episodes.final_texts, episodes.assistant_mask.clone(), time.perf_counter() - t0, episodes.env_rewards,
            global_episode_metrics(episodes, self.scorer.world), failed={TIMED_OUT: episodes.timed_out.clone()},  # every step, so every rank has the entry
            episodes=episode_rows(episodes),
        )


@torch.no_grad()
def evaluate_episodes(
    policy, tokenizer, prompts: Sequence[PromptExample], rewards: Sequence[RewardTerm], env: Any, env_cfg: EnvironmentConfig, params: SamplingParams,
    model_cfg, num_samples: int = 1, pass_threshold: float = 1.0, seed: int = 0, batch_size: int = 32, rows_logged: int = 8, step: int = 0,
    max_steps: int = 0,
) -> tuple[dict[str, float], list[dict]]:
    """Episodes of every prompt (``num_samples`` each) by ``policy`` (unwrapped): ``eval/success`` (the
    share whose total reward, the environment's included, reaches ``pass_threshold``), ``eval/pass@k``
    (k = 1, 2, 4, ... <= num_samples, unbiased), ``eval/reward/mean``, ``eval/turns``, ``eval/tool_calls``,
    ``eval/malformed_calls``, ``eval/timed_out``; and a table of the first episodes (the conversation
    as "role: content" lines, the final answer, the reward). One process; uniforms from a generator seeded by ``seed``;
    ``step`` and ``max_steps`` are the reward functions' ``trainer_state``."""
    make_env = environment_factory(env if env is not None else env_cfg.cls)
    generator = torch.Generator().manual_seed(seed)
    totals, parts, table = [], [], []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        with distributed.gathered(policy), forward_precision(model_cfg, policy), evaluating(policy):
            episodes = run_episodes(
                policy, tokenizer, _records(batch), make_env, params, group_size=num_samples, max_turns=env_cfg.max_turns, fmt=env_cfg.tool_format,
                generator=generator, timeout_s=env_cfg.timeout_s, max_result_chars=env_cfg.max_result_chars,
            )
        scored = score_shard(rewards, tokenizer, batch, episodes.rollout, episodes.final_texts, num_samples, distributed.World(), step=step + 1,
                             max_steps=max_steps, episodes=episode_rows(episodes))
        total = scored.scores + torch.tensor([0.0 if r is None else r for r in episodes.env_rewards])  # (B,) rewards checked by EnvRunner.reward
        totals.append(total)
        parts.append(episodes)
        for r in range(min(rows_logged - len(table), len(total))):
            episode = "\n".join(f"{m['role']}: {m['content']}" for m in episodes.conversations[r])
            table.append({"step": step, "episode": episode, "final": episodes.final_texts[r], "reward": float(total[r])})
    total = torch.cat(totals)  # (prompts x n,)
    passed = (total >= pass_threshold).view(-1, num_samples)  # (prompts, n)
    metrics = {"eval/success": passed.float().mean().item(), "eval/reward/mean": total.mean().item(), **pass_at_ks(passed)}
    for key in ("turns", "tool_calls", "malformed_calls", "timed_out"):
        metrics[f"eval/{key}"] = sum(episode_metrics(e)[f"agents/{key}"] * e.turns.numel() for e in parts) / total.numel()
    return metrics, table


def episode_evaluator(cfg, policy, tokenizer, prompts: Sequence[PromptExample], rewards: Sequence[RewardTerm], env: Any = None) -> Callable[[int], tuple[dict, list]]:
    """``evaluate(step)`` of a run with an ``environment:`` section (:func:`evaluate_episodes` with the run's eval settings);
    ``env``: the environment given to ``train`` (None: ``environment.class``)."""
    env_cfg, eval_cfg = cfg.environment, cfg.eval
    params = SamplingParams(eval_cfg.max_new_tokens or env_cfg.max_new_tokens or cfg.sampling.max_new_tokens, eval_cfg.temperature)
    return lambda step: evaluate_episodes(
        policy, tokenizer, prompts, rewards, env, env_cfg, params, cfg.model, eval_cfg.num_samples, eval_cfg.pass_threshold, cfg.seed,
        eval_cfg.batch_size, eval_cfg.num_samples_logged, step, cfg.steps,
    )

def make_environment_source(cfg, sampler, tokenizer, rewards: Sequence[RewardTerm], prompts: Sequence[PromptExample], world: distributed.World,
                            environment: Any = None) -> EnvironmentSource:
    """The source of a GRPO or PPO config with an ``environment:`` section; ``environment``: the object given to ``train`` (else the config's class)."""
    scorer = make_scorer(cfg, tokenizer, rewards, world)
    return EnvironmentSource(sampler, scorer, prompts, cfg.prompts_per_step, cfg.seed, cfg.sampling, cfg.model, env=environment, env_cfg=cfg.environment)


def train_tools(cfg, tools: Mapping[str, Callable] | Sequence[Callable] | None, environment: Any) -> tuple[Mapping[str, Callable] | None, Any]:
    """``(tools, environment)`` for ``train``: a mapping of one-string functions is the ``tools:`` section's; a
    list of typed functions with docstrings (TRL's ``GRPOTrainer(tools=[fn])``) runs as the environment
    :class:`FunctionTools` of an ``environment:`` section (``environment.max_turns`` = TRL's
    ``max_tool_calling_iterations`` + 1), its calls and tool replies written by the chat template, as TRL's. Beside a
    TRL environment class (``environment`` or ``environment.class``: TRL's ``tools=`` with ``environment_factory=``) the
    list is shown before the environment's methods, in every environment
    (:func:`rlalign.agents.trl_environment.with_standalone_tools`; one instance is made to check it, as TRL's trainer does,
    except for a dict of factories, each of which is made at its first episode).

    Raises:
        ConfigError: tools without the section they need, a list beside an rlalign environment (whose tools are
            its own list), a function the chat template cannot be shown (no type hints or no docstring with an Args section),
            or an environment :func:`check_environment` refuses.
    """
    if not tools or isinstance(tools, Mapping):
        if tools and cfg.tools is None:
            raise ConfigError("tools were given but cfg.tools is null: set tools (e.g. tools.max_turns=3) to use them")
        if cfg.environment is not None:
            check_environment(environment if environment is not None else cfg.environment.cls)
        return tools, environment
    tools = list(tools)
    if cfg.environment is None:
        raise ConfigError("tools=[...] (typed functions, TRL's GRPOTrainer(tools=...)) run in episodes of the environment section: set "
                          "environment.max_turns (TRL's max_tool_calling_iterations + 1); a {name: function of one string} mapping goes with tools:")
    try:
        tool_schemas(tools)  # each must be describable to the chat template: fail before the run starts
    except ValueError as err:
        raise ConfigError(str(err)) from None
    given = environment if environment is not None else cfg.environment.cls
    if given is not None:  # TRL's tools=... beside environment_factory=...: shown first, in every environment
        check_environment(given, tools)  # its one probe instance also refuses the list where it is an rlalign environment
        return None, functools.partial(with_standalone_tools, environment_factory(given), tools)
    return None, functools.partial(FunctionTools, tools)


def check_environment(given: Any, tools: Sequence[Callable] = ()) -> None:
    """Make one instance of the environment ``given`` (``module:Class``, a class, a maker, or a dict of them: one of
    each) and check it before the run starts, as TRL's trainer probes one: it can be made, its protocol is told
    apart, and a TRL environment's ``reset`` is synchronous and its methods can be shown to the chat template;
    with ``tools`` (TRL's standalone tools), that it takes them (:func:`with_standalone_tools`).

    Raises:
        ConfigError: no environment given, one that cannot be imported or made, or one that cannot run (names the class).
    """
    if given is None:
        raise ConfigError("environment: set environment.class (module:Class) or pass the environment to train(environment=...)")
    try:
        obj = load_object(given) if isinstance(given, str) else given
        environment_factory(obj)  # a dict's factories, or one, callable
    except ValueError as err:
        raise ConfigError(f"environment.class: {err}" if isinstance(given, str) else str(err)) from None
    for factory in obj.values() if isinstance(obj, Mapping) else [obj]:
        name = getattr(factory, "__qualname__", None) or repr(factory)
        try:
            env = factory()
        except Exception as err:
            raise ConfigError(f"environment {name:.120} could not be made: {type(err).__name__}: {err}") from err
        if isinstance(env, TRLEnvironment):
            continue
        name = type(env).__name__
        try:
            if protocol(env) == "trl":
                if inspect.iscoroutinefunction(getattr(type(env), "reset", None)):
                    raise ValueError(f"environment {name}.reset is async; TRL calls reset synchronously: make it a plain def")
                tool_schemas(trl_tools(env))  # TRL's chat template shows each public method
            EnvRunner(env)  # its tools (rlalign's), or the wrapper's checks (TRL's)
            if tools:
                with_standalone_tools(lambda: env, tools)  # an rlalign environment lists its tools itself
        except ValueError as err:
            raise ConfigError(f"environment {name}: {err}" if name not in str(err) else str(err)) from None
