"""Rollout sources: the one seam between making rollouts and learning on them.

A source hands the trainer one scored batch a step, for step ``state.step``:

    source = make_source(cfg, updater, tokenizer, rewards, prompts, world, tools)
    batch = source.next(state)          # ScoredBatch: records, Rollout, scores per term, metrics, policy version
    ... reference / pi_old passes, advantages, updates ...
    source.publish(updater.module, state.step + 1)   # the weights after the update (a no-op in process)

Every way of making a rollout is a source, and GRPO and PPO take any of them:

- :class:`SampledSource`: the step's prompts, ``group_size`` completions each, sampled by the policy and scored;
- :class:`DynamicSource`: DAPO's dynamic sampling (draws until the step holds ``prompts_per_step`` groups
  whose rewards do not all tie);
- :class:`ToolSource`: multi-turn tool use (tool results between turns, left out of the loss);
- :class:`OfflineSource`: the data's own completions, no sampling (GKD's off-policy share);
- :class:`MixedSource`: the steps :func:`on_policy_step` picks from one source, the others from another
  (GKD's lambda: the student's samples on a share of the steps, the data's completions on the rest);
- :class:`rlalign.train.async_source.AsyncSource`: any of these run in a producer process, ahead of the
  learner by at most ``async.max_staleness`` updates.

Rewards are scored inside the source (:class:`Scorer`: the weighted reward terms, then the shaping a
trainer asks for: DAPO's overlong punishment, PPO's missing-EOS penalty), so that a producer process
scores while the learner learns. Rows a source could not finish (an environment episode past its time
limit) are marked failed under a name of their own (``ScoredRollout.failed``, logged as
``reward/<name>/failed``) and left out of training as a failed reward call's rows are.

The sampling uniforms of step s come from a generator of their own, seeded by the run's seed and s
(:func:`sampling_generator`): whichever process samples step s, and whenever, it draws the same tokens
from the same weights, so an asynchronous run, its resumed twin and its synchronous twin agree.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor, nn

from rlalign.core.advantages import overlong_penalty, tied_groups
from rlalign.lm.data import DataError, PromptExample
from rlalign.lm.encoding import example_tokens
from rlalign.lm.reward_calls import check_finite
from rlalign.lm.rollout import Rollout
from rlalign.lm.tools import ToolRegistry
from rlalign.train import distributed
from rlalign.train.rollouts import (
    NO_TERM_APPLIES, EpisodeRows, RewardTerm, ScoredRollout, add_score_term, concat_scored, prompt_batch, sample_shard, score_shard, select_rows,
    trusted_rows,
)
from rlalign.train.seeding import batch_order, reseed_for_step, restore_rng_state, rng_state
from rlalign.train.tool_rollout import ToolRollout, sample_tool_shard, tool_registry

__all__ = [
    "ScoredBatch", "Sampled", "RolloutSource", "Scorer", "SampledSource", "DynamicSource", "ToolSource", "OfflineSource", "MixedSource",
    "sampling_generator", "on_policy_step", "data_completions", "tokenized_rollout", "make_source", "make_scorer", "mark_failed",
]


def sampling_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step ``step``'s sampling uniforms: a function of (seed, step) alone."""
    digest = hashlib.sha256(f"rlalign sampling {seed} {step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@dataclass
class ScoredBatch:
    """One step's scored rollout, as a source hands it to the trainer."""

    examples: list[PromptExample]  # the step's global prompt records (their columns go to the rewards)
    rollout: Rollout  # this rank's rows, groups adjacent; logprobs: the sampler's
    scored: ScoredRollout  # total and per-term rewards (this rank's rows and every rank's)
    token_mask: Tensor  # (B, C) 1 on tokens the policy sampled (0 on tool tokens and padding)
    metrics: dict[str, float] = field(default_factory=dict)  # the source's own: dynamic/*, tools/*, staleness, time/queue_wait, ...
    version: int = 0  # the policy version that sampled it: the number of learner steps behind those weights
    generate_s: float = 0.0  # seconds spent sampling
    score_s: float = 0.0  # seconds spent scoring
    data_position: int | None = None  # prompts drawn so far after this batch (dynamic sampling); None: step * prompts_per_step
    row_episode: Tensor | None = None  # (B,) the scored row (episode) each rollout row belongs to, when an episode is several rows (agent calls); None: the same
    row_weight: Tensor | None = None  # (B,) each row's weight in the loss (rlalign.core.losses, row weights); None: 1

    def row_values(self, values: Tensor) -> Tensor:
        """Values of the scored rows (episodes), shape (E,), spread to the rollout's rows, shape (B,)."""
        return values if self.row_episode is None else values[self.row_episode]

    def weighted(self, mask: Tensor) -> Tensor:
        """``mask`` (B, C) times each row's weight."""
        return mask if self.row_weight is None else mask * self.row_weight[:, None].to(mask.dtype)


class RolloutSource(Protocol):
    """What a trainer reads rollouts from (see the module docstring)."""

    def next(self, state) -> ScoredBatch: ...

    def publish(self, policy: nn.Module, version: int) -> float:
        """Hand over the learner's weights after ``version`` steps; returns the seconds it took."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume the source exactly (rollouts in flight)."""
        ...

    def close(self) -> None:
        """Stop whatever the source runs (a producer process)."""
        ...


# ----------------------------------------------------------------------------------------------
# Scoring: the reward terms, then the trainer's shaping
# ----------------------------------------------------------------------------------------------


@dataclass
class Scorer:
    """Scores a sampled batch: the weighted reward terms (``score_shard``), then DAPO's overlong
    punishment (``overlong``: (buffer, penalty, max_new_tokens)) and PPO's ``missing_eos_penalty``."""

    rewards: Sequence[RewardTerm]
    tokenizer: object
    group_size: int
    world: distributed.World = field(default_factory=distributed.World)
    missing_eos_penalty: float | None = None
    overlong: tuple[int, float, int] | None = None
    max_steps: int = 0  # the run's steps, the reward functions' trainer_state.max_steps

    def __call__(self, examples: list[PromptExample], rollout: Rollout, completions: list[str], step: int, env_rewards: Sequence[float | None] | None = None,
                 failed: dict[str, Tensor] | None = None, episodes: EpisodeRows | None = None) -> ScoredRollout:
        """``env_rewards``: this rank's rows' environment rewards (None: none given); ``failed``: name -> this rank's rows
        (B,) bool that the source could not finish, left out of training (:func:`mark_failed`; every rank passes the same names);
        ``episodes``: this rank's rows as episodes, what the reward functions get of them (:func:`rlalign.train.rollouts.score_shard`)."""
        scored = score_shard(self.rewards, self.tokenizer, examples, rollout, completions, self.group_size, self.world, self.missing_eos_penalty, step=step,
                             max_steps=self.max_steps, episodes=episodes)
        if env_rewards is not None and NO_TERM_APPLIES not in scored.failed:  # no reward terms: a row the environment gives no reward has none
            scored = replace(scored, failed={**scored.failed, NO_TERM_APPLIES: torch.ones(len(scored.scores), dtype=torch.bool)})
        if env_rewards is not None and distributed.any_rank(any(r is not None for r in env_rewards), self.world):  # an environment's own reward
            values = torch.tensor([0.0 if r is None else r for r in env_rewards], dtype=torch.float32)  # (B,)
            check_finite(values, "the environment's reward is", scored.prompts, "not a finite number in float32")
            scored = add_score_term(scored, "environment", values, self.world, torch.tensor([r is not None for r in env_rewards]))
        for name, rows in (failed or {}).items():
            scored = mark_failed(scored, name, rows, self.world)
        if self.overlong is not None:
            buffer, penalty, max_new_tokens = self.overlong
            scored = add_score_term(scored, "overlong", penalty * overlong_penalty(rollout.completion_lengths(), max_new_tokens, buffer), self.world)
        return scored


def mark_failed(scored: ScoredRollout, name: str, local_rows: Tensor, world: distributed.World) -> ScoredRollout:
    """``scored`` with this rank's rows ``local_rows`` (B,) bool marked failed under ``name`` (every rank's gathered):
    :func:`rlalign.train.rollouts.trusted_rows` leaves them out of training, ``reward/<name>/failed`` counts them,
    and they no longer count under ``no_term_applies``."""
    rows = distributed.gather_rows(local_rows.float(), world).bool()  # (B global,)
    failed = {**scored.failed, name: rows}
    if NO_TERM_APPLIES in failed:
        failed[NO_TERM_APPLIES] = failed[NO_TERM_APPLIES] & ~rows
    return replace(scored, failed=failed)


def make_scorer(cfg, tokenizer, rewards: Sequence[RewardTerm], world: distributed.World) -> Scorer:
    """The scorer of a GRPO or PPO config (``group_size`` 1 for PPO)."""
    overlong_buffer = getattr(cfg, "overlong_buffer", None)
    overlong = (overlong_buffer, cfg.overlong_penalty, cfg.sampling.max_new_tokens) if overlong_buffer is not None else None
    return Scorer(rewards, tokenizer, getattr(cfg, "group_size", 1), world, getattr(cfg, "missing_eos_penalty", None), overlong, cfg.steps)


# ----------------------------------------------------------------------------------------------
# The sources
# ----------------------------------------------------------------------------------------------


@dataclass
class SampledSource:
    """The step's ``n`` prompts (a per-epoch permutation of the data), ``group_size`` completions each,
    sampled by ``sampler``'s policy (an :class:`rlalign.train.updater.Updater`, or a producer's copy) and scored."""

    sampler: object
    scorer: Scorer
    prompts: Sequence[PromptExample]
    n: int
    seed: int
    sampling: object  # SamplingConfig
    model_cfg: object  # ModelConfig

    pipelined = True  # sample() and score() may run apart: a producer scores one step while it samples the next

    def next(self, state) -> ScoredBatch:
        return self.score(self.sample(state))

    def sample(self, state) -> Sampled:
        """The step's prompt records and their completions, not yet scored."""
        t0 = time.perf_counter()
        examples = prompt_batch(self.prompts, state.step, self.n, self.seed)
        rollout = sample_shard(
            self.sampler, self.scorer.tokenizer, [ex.prompt for ex in examples], self.sampling, self.model_cfg, self.scorer.group_size,
            sampling_generator(self.seed, state.step), self.scorer.world,
        )
        return Sampled(state.step, examples, rollout, rollout.decode_completions(self.scorer.tokenizer), rollout.completion_mask.clone(), time.perf_counter() - t0)

    def score(self, sampled: Sampled) -> ScoredBatch:
        """The sampled step, scored by the reward terms (and the trainer's shaping)."""
        t0 = time.perf_counter()
        scored = self.scorer(sampled.examples, sampled.rollout, sampled.completions, sampled.step, sampled.env_rewards, sampled.failed, sampled.episodes)
        return ScoredBatch(
            sampled.examples, sampled.rollout, scored, sampled.token_mask, dict(sampled.metrics), sampled.step, sampled.generate_s, time.perf_counter() - t0,
        )

    def publish(self, policy: nn.Module, version: int) -> float:
        return 0.0  # it samples from the live policy

    def state_dict(self) -> dict:
        return {}  # nothing in flight

    def close(self) -> None:
        pass


class StepSeeded:
    """A synchronous source whose steps run on Python's, NumPy's and torch's global RNGs seeded from (seed, step), as a
    producer seeds them before it samples and scores (:mod:`rlalign.train.async_source`, rank ``shard`` of the learners:
    :mod:`rlalign.train.rank_source`): a reward drawing from them draws the same numbers synchronously and with k = 0.
    The trainer's own RNG state is put back after the step (its draws, LoRA's dropout, are as without the source)."""

    def __init__(self, inner: RolloutSource, seed: int, world: distributed.World):
        self.inner, self.seed, self.world = inner, seed, world

    def next(self, state) -> ScoredBatch:
        trainer_state = rng_state()
        reseed_for_step(self.seed, state.step * self.world.learners + self.world.rank)
        try:
            return self.inner.next(state)
        finally:
            restore_rng_state(trainer_state)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # publish, state_dict, close, pipelined, ...


@dataclass
class Sampled:
    """A sampled step before scoring (what :meth:`SampledSource.sample` returns)."""

    step: int
    examples: list[PromptExample]
    rollout: Rollout
    completions: list[str]  # the completions' texts (multi-turn: each row's last assistant turn, what the built-in terms score)
    token_mask: Tensor  # (B, C)
    generate_s: float
    env_rewards: Sequence[float | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    failed: dict[str, Tensor] | None = None  # name -> (B,) bool: rows the source could not finish (left out of training)
    episodes: EpisodeRows | None = None  # multi-turn rows: what reward functions get of them (TRL's prompts, completions, environments)


@dataclass
class DynamicSource(SampledSource):
    """DAPO dynamic sampling (Yu et al. 2025, section 3.2): a group whose G rewards all tie (over the
    completions that count: :func:`rlalign.core.advantages.tied_groups`; the total reward, shaping such as
    the overlong punishment included) has zero advantages and carries no gradient, so it is dropped, and ``n`` more prompts are drawn (the next
    data positions) until the step holds ``n`` informative groups, at most ``max_rounds`` draws; past
    that, tied groups fill the step in draw order (they add nothing to the gradient, and keep the
    step's shape). ``position``: prompts drawn so far (the checkpoint's data position on resume)."""

    max_rounds: int = 4
    position: int | None = None
    pipelined = False  # whether to draw again depends on the scores

    def next(self, state) -> ScoredBatch:
        n, G = self.n, self.scorer.group_size
        position = state.step * n if self.position is None else self.position
        generator = sampling_generator(self.seed, state.step)  # every draw of the step from one stream
        draws: list[tuple[list[PromptExample], Rollout, ScoredRollout, Tensor]] = []  # (records, rollout, scores, informative (n,)) per draw
        generate_s = score_s = 0.0
        while len(draws) < self.max_rounds and sum(int(d[3].sum()) for d in draws) < n:
            t0 = time.perf_counter()
            examples = [self.prompts[i] for i in batch_order(len(self.prompts), position, n, self.seed)]
            position += n
            rollout = sample_shard(self.sampler, self.scorer.tokenizer, [ex.prompt for ex in examples], self.sampling, self.model_cfg, G, generator, self.scorer.world)
            t1 = time.perf_counter()
            scored = self.scorer(examples, rollout, rollout.decode_completions(self.scorer.tokenizer), state.step)
            generate_s, score_s = generate_s + t1 - t0, score_s + time.perf_counter() - t1
            draws.append((examples, rollout, scored, ~tied_groups(scored.scores, G, trusted_rows(scored))))  # over the rows that count
        self.position = position
        # informative groups in draw order, then tied ones to fill: (draw, group) pairs
        order = [(d, g) for want in (True, False) for d, draw in enumerate(draws) for g in range(n) if bool(draw[3][g]) == want][:n]
        kept_examples, kept_rollouts, kept_scored = [], [], []
        for d, (examples, rollout, scored, _) in enumerate(draws):
            groups = [g for dd, g in order if dd == d]
            if groups:
                rows = torch.tensor([g * G + j for g in groups for j in range(G)])
                kept_examples.extend(examples[g] for g in groups)
                kept_rollouts.append(rollout.select(rows))
                kept_scored.append(select_rows(scored, rows))
        informative = sum(int(d[3].sum()) for d in draws)
        metrics = {
            "dynamic/draws": float(len(draws)),
            "dynamic/prompts_drawn": float(len(draws) * n),
            "dynamic/tied_groups": float(len(draws) * n - informative),  # dropped, bar those filling the step
            "dynamic/filled_groups": float(max(n - informative, 0)),
        }
        rollout = Rollout.concat(kept_rollouts, self.scorer.tokenizer.pad_token_id)
        return ScoredBatch(
            kept_examples, rollout, concat_scored(kept_scored), rollout.completion_mask.clone(), metrics, state.step, generate_s, score_s, position,
        )


@dataclass
class ToolSource(SampledSource):
    """Multi-turn tool use (:func:`rlalign.train.tool_rollout.tool_rollout`): the reward terms score
    each row's last assistant turn, the environment's rewards (where it gave any) are the term
    "environment", and the token mask is 0 on tool tokens (they get no gradient)."""

    tools: object = None  # ToolsConfig
    registry: ToolRegistry | None = None

    def sample(self, state) -> Sampled:
        t0 = time.perf_counter()
        examples = prompt_batch(self.prompts, state.step, self.n, self.seed)
        records = [{**ex.metadata, "prompt": ex.prompt} for ex in examples]
        episodes = sample_tool_shard(
            self.sampler, self.scorer.tokenizer, records, self.sampling, self.model_cfg, self.scorer.group_size, sampling_generator(self.seed, state.step),
            self.tools, self.registry, self.scorer.world,
        )
        return Sampled(
            state.step, examples, episodes.rollout, episodes.final_texts, episodes.assistant_mask.clone(), time.perf_counter() - t0, episodes.env_rewards,
            tool_metrics(episodes, self.scorer.world),
        )


def tool_metrics(episodes: ToolRollout, world: distributed.World = distributed.World()) -> dict[str, float]:
    """tools/turns (assistant turns per completion), tools/messages (tool results per completion), tools/tokens_frac (share of tool
    tokens), over every rank's rows."""
    sums = torch.stack([
        episodes.turns.sum(), episodes.tool_messages.sum(), torch.tensor(episodes.turns.numel()), episodes.assistant_mask.sum(), episodes.rollout.completion_mask.sum(),
    ]).double()  # (5,)
    turns, messages, rows, assistant, tokens = distributed.all_sum(sums, world).tolist()
    metrics = {"tools/turns": turns / rows, "tools/messages": messages / rows, "tools/tokens_frac": 1.0 - assistant / max(tokens, 1.0)}
    return metrics | ({"weight/tools/tokens_frac": tokens} if world.view else {})  # a producer's view: the learner weighs the shards' ratios


def data_completions(examples: Sequence[PromptExample], where: str) -> list:
    """Each record's own completion: its ``completion`` column, else ``chosen`` (a preference pair's
    preferred response), text or messages.

    Raises:
        DataError: naming the first record with neither.
    """
    out = []
    for i, ex in enumerate(examples):
        completion = ex.metadata.get("completion", ex.metadata.get("chosen"))
        if not completion:
            raise DataError(f"{where}: record {i} has no 'completion' (or 'chosen') column to train on off-policy; columns: {sorted(ex.metadata)}")
        out.append(completion)
    return out


def tokenized_rollout(tokenizer, prompts: Sequence, completions: Sequence, max_new_tokens: int) -> Rollout:
    """Prompt + completion pairs as a Rollout, tokenised as SFT tokenises them (the completion closed
    by EOS) and the completion cut at ``max_new_tokens`` (then ``truncated``); log-probs 0, one row per
    group."""
    rows = []
    for prompt, completion in zip(prompts, completions):
        ids, is_target = example_tokens(tokenizer, prompt, completion)
        start = is_target.index(1)
        rows.append((ids[:start], ids[start:][:max_new_tokens], len(ids) - start > max_new_tokens))
    pad, width_p, width_c = tokenizer.pad_token_id, max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return Rollout(
        torch.tensor([[pad] * (width_p - len(p)) + p for p, _, _ in rows]),  # (B, P) left-padded
        torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p, _, _ in rows]),
        torch.tensor([c + [pad] * (width_c - len(c)) for _, c, _ in rows]),  # (B, C) right-padded
        torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c, _ in rows]),
        torch.zeros(len(rows), width_c),
        torch.arange(len(rows)),
        torch.tensor([cut for _, _, cut in rows]),
    )


@dataclass
class OfflineSource:
    """The data's own completions (:func:`data_completions`), no sampling: the step's ``n`` records,
    drawn as :class:`SampledSource` draws its prompts, tokenised by :func:`tokenized_rollout`. Not
    scored: the reward terms judge the policy's samples, and these are not its samples."""

    examples: Sequence[PromptExample]
    tokenizer: object
    n: int
    seed: int
    max_new_tokens: int
    world: distributed.World = field(default_factory=distributed.World)
    pipelined = False

    def __post_init__(self) -> None:
        self.completions = data_completions(self.examples, "off-policy data")

    def next(self, state) -> ScoredBatch:
        t0 = time.perf_counter()
        index = batch_order(len(self.examples), state.step * self.n, self.n, self.seed)
        examples = [self.examples[i] for i in index]
        local = index[self.world.shard(self.n, "prompts_per_step")]
        rollout = tokenized_rollout(self.tokenizer, [self.examples[i].prompt for i in local], [self.completions[i] for i in local], self.max_new_tokens)
        scored = score_shard((), self.tokenizer, examples, rollout, rollout.decode_completions(self.tokenizer), 1, self.world, step=state.step,
                             max_steps=0)  # no terms: scores 0, and no function to see the steps
        return ScoredBatch(examples, rollout, scored, rollout.completion_mask.clone(), {}, state.step, 0.0, time.perf_counter() - t0)

    def publish(self, policy: nn.Module, version: int) -> float:
        return 0.0

    def state_dict(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def on_policy_step(seed: int, step: int, fraction: float) -> bool:
    """Whether step ``step`` takes the policy's own samples: u < ``fraction`` for a uniform u drawn from
    (seed, step) alone, so every process, a resumed run and a producer process agree on the schedule."""
    if fraction >= 1.0:
        return True
    digest = hashlib.sha256(f"rlalign on-policy {seed} {step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


@dataclass
class MixedSource:
    """GKD's mixture (Agarwal et al. 2024, algorithm 1): step s reads ``on_policy`` when
    :func:`on_policy_step` (``fraction`` = lambda), else ``offline``; the batch's metric ``on_policy``
    says which (1 or 0). The weights go to ``on_policy``, whose sampler they move."""

    on_policy: RolloutSource
    offline: RolloutSource
    fraction: float
    seed: int
    pipelined = False

    def next(self, state) -> ScoredBatch:
        on = on_policy_step(self.seed, state.step, self.fraction)
        batch = (self.on_policy if on else self.offline).next(state)
        batch.metrics["on_policy"] = float(on)
        return batch

    def publish(self, policy: nn.Module, version: int) -> float:
        return self.on_policy.publish(policy, version)

    def state_dict(self) -> dict:
        return self.on_policy.state_dict()

    def close(self) -> None:
        self.on_policy.close()


def make_source(
    cfg, sampler, tokenizer, rewards: Sequence[RewardTerm], prompts: Sequence[PromptExample], world: distributed.World = distributed.World(),
    tools: dict[str, Callable] | None = None, data_position: int | None = None,
) -> RolloutSource:
    """The in-process source a GRPO or PPO config asks for: tools, dynamic sampling, or plain sampling.
    ``data_position``: the checkpoint's (dynamic sampling resumes from it)."""
    if getattr(cfg, "agent", None) is not None:
        raise ValueError("an agent: config's source is rlalign.agents.agent_source.make_agent_source (open_source builds it)")
    scorer = make_scorer(cfg, tokenizer, rewards, world)
    base = (sampler, scorer, prompts, cfg.prompts_per_step, cfg.seed, cfg.sampling, cfg.model)
    if cfg.tools is not None:
        return ToolSource(*base, tools=cfg.tools, registry=tool_registry(cfg.tools, tools))
    if cfg.dynamic_sampling:
        return DynamicSource(*base, max_rounds=cfg.max_sampling_rounds, position=data_position)
    return SampledSource(*base)
