"""Rollout collection for GRPO and PPO: the prompt set and each step's batch, the reward terms,
sampling this rank's share of the batch, and scoring it.

    prompts = load_prompt_set(cfg.data)                              # validated PromptExamples
    examples = prompt_batch(prompts, step, n, seed)  # the step's global batch
    batch = [ex.prompt for ex in examples]
    rollout = sample_shard(updater, tokenizer, batch, cfg.sampling, cfg.model, G, generator, world)
    scored = score_shard(rewards, tokenizer, examples, rollout, rollout.decode_completions(tokenizer), G, world, step=step, max_steps=cfg.steps)
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from rlalign.config import ConfigError
from rlalign.lm.code_execution import CODE_COLUMNS, TestsError, code_execution, code_tests
from rlalign.lm.data import DataError, PromptExample, load_prompts
from rlalign.lm.encoding import encode_prompts, final_answer, render_prompt
from rlalign.lm.heads import load_reward_model
from rlalign.lm.model_modes import attention_kernel, evaluating
from rlalign.lm.models import load_tokenizer, stop_token_ids
from rlalign.lm.reward_calls import CallPolicy, import_reward_function, score_terms
from rlalign.lm.rewards import REWARD_INPUT_TEXT, RewardModelReward, call_reward, check_finite, exact_match, format_check, math_answer, reward_fn_name, reward_input_of
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import sample
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.common import forward_precision
from rlalign.train.rl_config import DataConfig, RewardConfig, SamplingConfig
from rlalign.train.run_config import ModelConfig
from rlalign.train.seeding import batch_order

__all__ = [
    "load_prompt_set",
    "check_prompt_lengths",
    "prompt_batch",
    "RewardTerm",
    "NO_TERM_APPLIES",
    "RewardLog",
    "add_score_term",
    "gather_scores",
    "select_rows",
    "concat_scored",
    "build_rewards",
    "score_rollout",
    "sample_shard",
    "ScoredRollout",
    "reward_completion",
    "score_shard",
    "reward_stats",
    "scored_stats",
    "completion_stats",
    "sample_rows",
]


def load_prompt_set(data: DataConfig, records: Sequence[dict] | None = None) -> list[PromptExample]:
    """Validated prompt examples from ``records`` when given, else the embedded task or the file."""
    if records is not None:
        return load_prompts(list(records))
    if data.task is not None:
        return load_prompts(TASKS[data.task].prompt_records("train", data.num_prompts, data.seed))
    return load_prompts(data.path, data.split, data.subset, data.columns)


def check_prompt_lengths(prompts: Sequence[PromptExample], tokenizer, context: int | None, max_new_tokens: int) -> None:
    """Every prompt plus ``max_new_tokens`` fits the model's ``context`` positions (None: unknown, unchecked).

    Raises:
        DataError: naming the longest prompt record and the lengths.
    """
    if context is None or not prompts:
        return
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [ex.prompt for ex in prompts])]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_new_tokens > context:
        raise DataError(
            f"{_named(prompts, longest)}: the prompt is {lengths[longest]} tokens, and with "
            f"sampling.max_new_tokens={max_new_tokens} it exceeds "
            f"the model's {context} positions; shorten the prompts or lower max_new_tokens"
        )


def _named(prompts: Sequence[PromptExample], i: int) -> str:
    """Where prompt record ``i`` comes from ("FILE, line N"), or its place among the records (0-based) when not from a source that says."""
    return prompts[i].where or f"prompt record {i}"


def prompt_batch(prompts: Sequence[PromptExample], step: int, batch_size: int, seed: int) -> list[PromptExample]:
    """The prompts of RL step ``step`` (0-based): data positions [step * n, (step + 1) * n) of a
    per-epoch permutation, so a resumed run draws exactly the prompts of the uninterrupted one."""
    return [prompts[i] for i in batch_order(len(prompts), step * batch_size, batch_size, seed)]


# ----------------------------------------------------------------------------------------------
# Reward terms
# ----------------------------------------------------------------------------------------------


@dataclass
class RewardTerm:
    """One weighted reward term, ``fn(prompts, completions, **columns) -> list[float | None]`` (the
    :mod:`rlalign.lm.reward_calls` convention, ``async def`` allowed), with what a failed call does
    (``on_error``: "raise" or "skip") and its time limit per call (None: none)."""

    name: str
    weight: float
    fn: Callable[..., Sequence[float]]
    on_error: str = "raise"
    timeout_s: float | None = None


def as_reward_term(term) -> RewardTerm:
    """A :class:`RewardTerm` as it is; a plain callable (a TRL user's ``reward_len(completions, **kwargs)``)
    as a term named by its function name, weight 1."""
    if isinstance(term, RewardTerm):
        return term
    model = isinstance(term, torch.nn.Module) and hasattr(term, "config")  # a transformers model, bare, compiled or wrapped by peft
    if isinstance(term, str) or model:  # TRL takes a reward model (or its id) among its reward functions
        raise ConfigError(f"a reward model ({term if isinstance(term, str) else type(term).__name__}) is not a reward function here: give its "
                          "directory as a term of the config, rewards: [{reward_model: PATH}] (it is scored as TRL scores it)")
    if not callable(term):
        raise ConfigError(f"a reward term must be a RewardTerm or a callable, got {type(term).__name__}")
    return RewardTerm(reward_fn_name(term), 1.0, term)


def _references(prompts: Sequence[PromptExample], tokenizer, function: str, column: str = "answer") -> dict[str, str | None]:
    """Every prompt record has ``column`` (each row is scored against its own value, passed with the
    rows); the returned {prompt text: value} serves calls without the rows' columns, None where one
    prompt text has several values."""
    missing = [i for i, ex in enumerate(prompts) if column not in ex.metadata]
    if missing:
        raise ConfigError(f"reward function {function!r} needs a {column!r} column in the prompts; {_named(prompts, missing[0])} has none")
    references: dict[str, str | None] = {}
    for ex in prompts:
        text, value = render_prompt(tokenizer, ex.prompt), str(ex.metadata[column])
        references[text] = value if references.get(text, value) == value else None
    return references


def _on_text(fn: Callable, tokenizer) -> Callable:
    """A built-in reward called on texts whatever the data's type: each prompt rendered as the policy
    saw it, each completion's final answer (:func:`rlalign.lm.encoding.final_answer`: an episode's last
    assistant turn; a user's function gets TRL's values: messages for conversational rows, an episode's all)."""

    def on_text(prompts: list, completions: list, **columns) -> Sequence[float]:
        return call_reward(fn, [render_prompt(tokenizer, p) for p in prompts], [final_answer(c) for c in completions], columns, {})

    on_text.name = reward_fn_name(fn)
    return on_text


def _builtin_reward(spec: RewardConfig, prompts: Sequence[PromptExample], tokenizer) -> Callable | None:
    name = spec.function
    if name in TASKS:
        return TASKS[name].reward
    if name in ("exact_match", "math_answer"):
        references = _references(prompts, tokenizer, name)
        return exact_match(references) if name == "exact_match" else math_answer(references)
    if name == "format":
        return format_check(spec.pattern)
    if name == "code_execution":
        return code_execution(
            _code_rows(prompts, tokenizer, spec.code_format), partial_credit=spec.partial_credit, allow_weak_sandbox=spec.allow_weak_sandbox,
            code_format=spec.code_format, case_timeout_s=spec.case_timeout_s, wall_factor=spec.wall_factor, on_timeout=spec.on_timeout,
        )
    return None


def _code_rows(prompts: Sequence[PromptExample], tokenizer, code_format: str) -> dict[str, dict | None]:
    """Each prompt record's code-test columns (rlalign.lm.code_execution.CODE_COLUMNS), every row's
    tests checked now, before training; {prompt text: columns} for calls without the rows' columns
    (None where one prompt text has several)."""
    if not any(ex.metadata.get(column) is not None for ex in prompts for column in CODE_COLUMNS):
        raise ConfigError("reward function 'code_execution' needs a 'tests' column in the prompts (or test + entry_point, test_list, "
                          "input_output, ...); prompt record 0 has none")
    rows: dict[str, dict | None] = {}
    for i, ex in enumerate(prompts):
        row = {column: ex.metadata[column] for column in CODE_COLUMNS if ex.metadata.get(column) is not None}
        try:
            code_tests(row, code_format)
        except TestsError as err:
            raise DataError(f"{_named(prompts, i)}: {err}") from None
        text = render_prompt(tokenizer, ex.prompt)
        rows[text] = row if rows.get(text, row) == row else None
    return rows


def _reward_function(spec: RewardConfig, prompts: Sequence[PromptExample], tokenizer) -> Callable[[list[str], list[str]], Sequence[float]]:
    builtin = _builtin_reward(spec, prompts, tokenizer)
    if builtin is not None:
        return _on_text(builtin, tokenizer)
    return import_reward_function(spec.function)


def _reward_model(spec: RewardConfig, model_cfg: ModelConfig, world: distributed.World) -> RewardModelReward:
    model = load_reward_model(spec.reward_model, model_cfg.dtype, world.device(model_cfg.device), attn_implementation=model_cfg.attn_implementation)
    model = distributed.shard_frozen(model, world, model_cfg.sharding)
    rm_tokenizer = load_tokenizer(spec.reward_model)  # its own, as TRL loads it; never the policy's, which would give it other ids
    input_format = reward_input_of(spec.reward_model) if spec.input_format == "auto" else spec.input_format
    if world.is_main:  # which convention scores the run, said once
        source = "recorded in its config" if spec.input_format == "auto" and input_format == "eos" else f"input_format: {spec.input_format}"
        print(f"reward {spec.label}: {spec.reward_model} scores {REWARD_INPUT_TEXT[input_format]} ({input_format}, {source})")
    return RewardModelReward(model, rm_tokenizer, input_format)


def _remote_reward(spec: RewardConfig) -> Callable:
    from rlalign.lm.remote_reward import RemoteReward

    r = spec.remote
    return RemoteReward(
        spec.reward_url, name=spec.label, batch_size=r.batch_size, timeout=r.request_timeout_s, max_retries=r.max_retries,
        max_concurrency=r.max_concurrency, label_column=r.label_column, token_env=r.token_env,
    )


def _judge_reward(spec: RewardConfig, model_cfg: ModelConfig, world: distributed.World) -> Callable:
    from rlalign.lm.judge import JudgeReward

    judge = spec.judge
    options = {"template": judge.template, "pattern": judge.pattern, "system_prompt": judge.system_prompt}
    kwargs = {key: value for key, value in options.items() if value is not None}  # None: the judge's own default
    kwargs.update(min_score=judge.min_score, max_score=judge.max_score, max_failure_fraction=judge.max_failure_fraction, name=spec.label)
    if judge.base_url is not None:
        return JudgeReward.remote(judge.base_url, judge.model_name, max_new_tokens=judge.max_new_tokens, **kwargs)
    return JudgeReward.from_pretrained(
        judge.model, model_cfg.dtype, world.device(model_cfg.device), judge.max_new_tokens, attn_implementation=model_cfg.attn_implementation, **kwargs
    )


def _term_fn(spec: RewardConfig, prompts: Sequence[PromptExample], tokenizer, model_cfg: ModelConfig, world: distributed.World) -> Callable:
    """The reward function of one config term, by its source."""
    if spec.reward_model is not None:
        return _reward_model(spec, model_cfg, world)
    if spec.reward_url is not None:
        return _remote_reward(spec)
    if spec.judge is not None:
        return _judge_reward(spec, model_cfg, world)
    return _reward_function(spec, prompts, tokenizer)


def build_rewards(
    specs: Sequence[RewardConfig],
    prompts: Sequence[PromptExample],
    tokenizer,
    model_cfg: ModelConfig,
    extra: Sequence[RewardTerm | Callable] = (),
    world: distributed.World = distributed.World(),
) -> list[RewardTerm]:
    """Reward terms of the config (functions resolved, reward models and judges loaded frozen, remote rewards' clients) plus ``extra``
    (terms, or plain callables: see :func:`as_reward_term`)."""
    terms = [RewardTerm(spec.label, spec.weight, _term_fn(spec, prompts, tokenizer, model_cfg, world), spec.on_error, spec.timeout_s) for spec in specs]
    terms.extend(as_reward_term(term) for term in extra)
    if not terms:
        raise ConfigError("no reward: add at least one term under 'rewards' (a function or a reward_model)")
    names = [t.name for t in terms]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward names must be unique (set 'name' on a reward term), got {names}")
    return terms


NO_TERM_APPLIES = "no_term_applies"  # the failed rows' entry of completions every term returned None for (reward/no_term_applies/failed)


def score_rollout(
    terms: Sequence[RewardTerm], prompts: list, completions: list, columns: dict[str, list] | None = None, context: dict | None = None
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """Total reward sum_k w_k R_k per completion (B,), each term's unweighted values (B,) (NaN where the
    term does not apply or its call failed, as in TRL's rewards_per_func; out of the sum) and each term's failed
    rows (B,) bool; ``columns``: the rows' other dataset columns, for the terms that take them. A
    completion no term applies to (every one returned None) has no reward, not 0: it is counted under
    :data:`NO_TERM_APPLIES` in the failed rows and left out of training (TRL leaves its NaN reward out of the baseline).

    Every call goes through :func:`rlalign.lm.reward_calls.score_terms`: async terms run
    concurrently, and a failed call is an error naming the term and the prompt unless the term's
    ``on_error`` is "skip".
    """
    results = score_terms([CallPolicy(t.name, t.fn, t.on_error, t.timeout_s) for t in terms], prompts, completions, columns, context)
    per_term, failed = {}, {}
    total = torch.zeros(len(prompts))  # (B,)
    scored_by_any = torch.zeros(len(prompts), dtype=torch.bool)  # (B,)
    for t, result in zip(terms, results):
        applies = ~torch.isnan(result.values)
        scored_by_any |= applies
        check_finite(result.values[applies], f"reward term {t.name!r} returned", [p for p, a in zip(prompts, applies.tolist()) if a], "not finite in float32, the dtype rewards are trained in")
        per_term[t.name], failed[t.name] = result.values, result.failed
        total = total + t.weight * result.values.nan_to_num(0.0)
        check_finite(total, f"the total reward after term {t.name!r} (weight {t.weight}) is", prompts, "not finite in float32")
    if terms:
        failed[NO_TERM_APPLIES] = ~scored_by_any & ~torch.stack([f.bool() for f in failed.values()]).any(0)  # not already a failed call
    return total, per_term, failed


# ----------------------------------------------------------------------------------------------
# Sampling and scoring this rank's share of a step
# ----------------------------------------------------------------------------------------------


def sample_shard(
    updater, tokenizer, prompts: Sequence, sampling: SamplingConfig, model_cfg: ModelConfig, group_size: int, generator: torch.Generator,
    world: distributed.World = distributed.World(),
) -> Rollout:
    """This rank's rollout of the step's global prompt batch: its share of the prompts, G completions
    each, with the uniforms drawn from ``generator`` for the global batch (so the rows do not depend on
    the world size). Drawn by ``updater``'s policy (under ``model_cfg.autocast`` if set), or by its copy
    in ``sampling.dtype`` (:meth:`rlalign.train.updater.Updater.sampler`)."""
    shard = world.shard(len(prompts), "prompts_per_step")
    noise = torch.rand((sampling.max_new_tokens, len(prompts) * group_size), generator=generator)  # (N, B global)
    rows = slice(shard.start * group_size, shard.stop * group_size)
    ids = encode_prompts(tokenizer, list(prompts[shard]))
    policy, sampler = updater.module, updater.sampler()
    precision = forward_precision(model_cfg, policy) if sampler is policy else contextlib.nullcontext()  # a copy is already low-precision
    with distributed.gathered(policy), precision, evaluating(sampler), attention_kernel(sampler, sampling.attn_implementation):
        rollout = sample(sampler, ids, sampling.params(), tokenizer.pad_token_id, stop_token_ids(policy, tokenizer), group_size, noise=noise[:, rows], compile=sampling.compile,
                         cuda_graphs=sampling.cuda_graphs)
    return rollout.to("cpu")


@dataclass
class ScoredRollout:
    """A rollout's texts and rewards: this rank's rows, and the scores gathered from every rank."""

    prompts: list[str]  # (B,) this rank's rendered prompts, one per row (groups adjacent)
    completions: list[str]  # (B,)
    local_scores: Tensor  # (B,) total reward of this rank's rows
    local_per_term: dict[str, Tensor]  # name -> (B,), unweighted
    scores: Tensor  # (B global,)
    per_term: dict[str, Tensor]  # name -> (B global,)
    failed: dict[str, Tensor] = field(default_factory=dict)  # name -> (B global,) bool: the term's call failed there (on_error: skip)
    term_stats: dict[str, float] = field(default_factory=dict)  # reward/<name>/<key>: counters a term keeps (term_stats())
    extra: dict[str, list] = field(default_factory=dict)  # column -> (B,) this rank's rows: log_extra's columns of the samples table
    logged: dict[str, list[float]] = field(default_factory=dict)  # name -> the values log_metric was given (logged: their mean)


class RewardLog:
    """TRL's ``log_metric(name, value)`` and ``log_extra(column, values)`` for reward functions: a metric is the mean
    of the values logged for it in a batch (logged as ``name``, as TRL does), a column one value per row of the batch
    (in the samples table)."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.columns.setdefault(column, []).extend(_plain(v) for v in values)


def _plain(value):
    """A logged table value as JSON can write it: a tensor's or NumPy value's Python value (a scalar, or a list), else
    the value when JSON takes it, else its text."""
    if hasattr(value, "tolist") and type(value).__module__.split(".")[0] in ("torch", "numpy"):
        value = value.tolist()
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def logged_means(logged: dict[str, list[float]]) -> dict[str, float]:
    """log_metric's metrics: each name's mean over the values logged (a batch, or an evaluation's batches)."""
    return {name: sum(values) / len(values) for name, values in logged.items() if values}


@dataclass
class EpisodeRows:
    """This rank's rows as multi-turn episodes: what reward functions get in place of the records' own, as TRL's
    ``GRPOTrainer`` gives them (:class:`rlalign.agents.episodes.Episodes`)."""

    prompts: list  # (B,) each episode's prompt as its environment's reset made it (what the policy saw: TRL adds reset's text)
    messages: list[list[dict] | None]  # (B,) the episode after the prompt as messages (TRL's completions); None for a text prompt
    environments: list  # (B,) each episode's environment object, TRL's ``environments`` keyword


def reward_completion(prompt, text: str, messages: list[dict] | None = None):
    """What reward functions get as one row's completion, as TRL gives it: the text for a text prompt; for a
    conversational one the episode's messages after the prompt where the row is an episode (``messages``:
    :attr:`rlalign.agents.episodes.Episodes.completions`), else ``[{"role": "assistant", "content": text}]``."""
    if isinstance(prompt, str):
        return text
    return messages if messages is not None else [{"role": "assistant", "content": text}]


def score_shard(
    rewards: Sequence[RewardTerm], tokenizer, batch: Sequence[PromptExample], rollout: Rollout, completions: list[str], group_size: int,
    world: distributed.World, missing_eos_penalty: float | None = None, *, step: int, max_steps: int, uneven: bool = False,
    episodes: EpisodeRows | None = None,
) -> ScoredRollout:
    """Score this rank's rows of the global prompt ``batch`` (their decoded ``completions``): the weighted
    reward terms, each row with its own record's columns, minus ``missing_eos_penalty`` for completions
    without EOS; gather the scores of every rank. Rewards taking TRL's keywords also get
    ``completion_ids`` (each row's tokens, no padding), ``trainer_state`` (a transformers ``TrainerState``:
    ``global_step`` = ``step``, the steps done (an evaluation after step s gives s + 1, as TRL's), ``max_steps`` = ``max_steps``,
    the run's steps: every caller gives both) and TRL's
    ``log_metric`` and ``log_extra`` (:class:`RewardLog`).
    ``uneven``: this rank's prompts are ``world.split(len(batch))``, not an even ``world.shard``. ``episodes``: this rank's rows
    as multi-turn episodes (None: single turns): the reward functions get each episode's prompt as its reset made it, its
    messages (:func:`reward_completion`) and TRL's ``environments``; ``completions`` are then each episode's final answer."""
    rows = [ex for ex in batch[world.split(len(batch)) if uneven else world.shard(len(batch))] for _ in range(group_size)]  # (B,) groups adjacent
    prompts = [ex.prompt for ex in rows] if episodes is None else list(episodes.prompts)  # text or messages (TRL's convention)
    messages = [None] * len(rows) if episodes is None else episodes.messages
    as_messages = [reward_completion(p, text, episode) for p, text, episode in zip(prompts, completions, messages, strict=True)]
    columns = {key: [ex.metadata.get(key) for ex in rows] for key in sorted({key for ex in rows for key in ex.metadata})}
    columns["completion_ids"] = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    from transformers import TrainerState  # imports peft: only where a batch is scored

    log = RewardLog()
    state = TrainerState(global_step=step, max_steps=max_steps, epoch=None)  # TRL hands its TrainerState; counted in rlalign's steps
    context = {"trainer_state": state, "log_metric": log.log_metric, "log_extra": log.log_extra}
    if episodes is not None:
        context["environments"] = list(episodes.environments)  # (B,) TRL's, when an environment runs the episodes
    local_scores, local_per_term, local_failed = score_rollout(rewards, prompts, as_messages, columns, context)  # (B,)
    if missing_eos_penalty is not None:
        local_scores = local_scores - missing_eos_penalty * rollout.truncated.float()
    scores = distributed.gather_rows(local_scores, world, uneven)  # (B global,)
    per_term = {name: distributed.gather_rows(values, world, uneven) for name, values in local_per_term.items()}
    failed = {name: distributed.gather_rows(rows_failed.float(), world, uneven).bool() for name, rows_failed in local_failed.items()}
    extra = {column: values for column, values in log.columns.items() if len(values) == len(rows)}  # a column of another length: not this batch's rows
    return ScoredRollout([render_prompt(tokenizer, p) for p in prompts], completions, local_scores, local_per_term, scores, per_term, failed,
                         term_stats(rewards), extra, log.metrics)


def gather_scores(scored: ScoredRollout, world: distributed.World) -> ScoredRollout:
    """``scored`` of this rank's rows, scored without the other ranks (a producer rank's view, its
    ``scores``, ``per_term`` and ``failed`` this rank's rows only), with those of every rank gathered.
    A term some shards lack (an environment's reward that only some shards' episodes gave) is NaN on them (not given)."""
    names = sorted(scored.local_per_term)
    if world.distributed:
        everyone: list = [None] * world.size
        dist.all_gather_object(everyone, names, group=world.group)
        names = sorted(set().union(*everyone))
    local = {name: scored.local_per_term.get(name, torch.full_like(scored.local_scores, math.nan)) for name in names}
    failed_names = sorted(scored.failed)
    return ScoredRollout(
        scored.prompts, scored.completions, scored.local_scores, local, distributed.gather_rows(scored.local_scores, world),
        {name: distributed.gather_rows(values, world) for name, values in local.items()},
        {name: distributed.gather_rows(scored.failed[name].float(), world).bool() for name in failed_names}, scored.term_stats, scored.extra, scored.logged,
    )


def term_stats(terms: Sequence[RewardTerm]) -> dict[str, float]:
    """Counters that terms keep about their calls since the last read (a judge's unparsable answers,
    a remote reward's retries): ``reward/<name>/<key>`` for each ``fn.pop_stats()`` entry. Under
    torchrun these are the counts of this process's rows."""
    return {f"reward/{t.name}/{key}": float(value) for t in terms if callable(getattr(t.fn, "pop_stats", None)) for key, value in t.fn.pop_stats().items()}


def add_score_term(scored: ScoredRollout, name: str, local_values: Tensor, world: distributed.World, applies: Tensor | None = None) -> ScoredRollout:
    """``scored`` with ``local_values`` (this rank's rows, (B,)) added to every row's score and logged as
    the term ``name`` (e.g. an overlong or KL penalty the trainer adds after the reward terms); ``applies``
    (this rank's rows, (B,) bool): where it is a reward of its own (an environment's, an agent's), so a row
    no reward function scored is scored after all (no longer under :data:`NO_TERM_APPLIES`)."""
    local_values = local_values.to(scored.local_scores.dtype)
    logged = local_values if applies is None else local_values.masked_fill(~applies.bool(), math.nan)  # (B,) NaN: not given there
    failed = scored.failed
    if applies is not None and NO_TERM_APPLIES in failed:
        failed = {**failed, NO_TERM_APPLIES: failed[NO_TERM_APPLIES] & ~distributed.gather_rows(applies.float(), world).bool()}
    return ScoredRollout(
        scored.prompts, scored.completions, scored.local_scores + local_values, {**scored.local_per_term, name: logged},
        scored.scores + distributed.gather_rows(local_values, world), {**scored.per_term, name: distributed.gather_rows(logged, world)}, failed,
        scored.term_stats, scored.extra, scored.logged,
    )


def select_rows(scored: ScoredRollout, rows: Tensor) -> ScoredRollout:
    """The rows ``rows`` of a one-process ``scored`` (local rows are the global ones)."""
    index = rows.tolist()
    return ScoredRollout(
        [scored.prompts[i] for i in index], [scored.completions[i] for i in index], scored.local_scores[rows],
        {k: v[rows] for k, v in scored.local_per_term.items()}, scored.scores[rows], {k: v[rows] for k, v in scored.per_term.items()},
        {k: v[rows] for k, v in scored.failed.items()}, scored.term_stats, {k: [v[i] for i in index] for k, v in scored.extra.items()}, scored.logged,
    )


def concat_scored(parts: Sequence[ScoredRollout]) -> ScoredRollout:
    """The rows of ``parts`` in order (one process)."""
    return ScoredRollout(
        [p for part in parts for p in part.prompts], [c for part in parts for c in part.completions], torch.cat([part.local_scores for part in parts]),
        {k: torch.cat([part.local_per_term[k] for part in parts]) for k in parts[0].local_per_term}, torch.cat([part.scores for part in parts]),
        {k: torch.cat([part.per_term[k] for part in parts]) for k in parts[0].per_term}, {k: torch.cat([part.failed[k] for part in parts]) for k in parts[0].failed},
        {k: sum(part.term_stats.get(k, 0.0) for part in parts) for k in {k for part in parts for k in part.term_stats}},
        {k: [v for part in parts for v in part.extra.get(k, [None] * len(part.prompts))] for k in {k for part in parts for k in part.extra}},
        {k: [v for part in parts for v in part.logged.get(k, [])] for k in {k for part in parts for k in part.logged}},
    )


def reward_stats(total: Tensor, per_term: dict[str, Tensor], failed: dict[str, Tensor] | None = None) -> dict[str, float]:
    """reward/mean and reward/std over the rows every term could score (the rows trained on: a row in
    ``failed`` has no total reward), reward/<name>/mean|std of each term over the rows it gave a value
    (NaN in ``per_term``: not given; TRL's nanmean and nanstd, and no entry where it gave none);
    reward/<name>/failed, the number of completions whose call of the term failed, for each term in
    ``failed`` that had any."""
    std = lambda x: x.std().item() if x.numel() > 1 else 0.0  # noqa: E731
    scored = total[_trusted(total, failed or {})]  # (n,)
    stats = {"reward/mean": scored.mean().item(), "reward/std": std(scored)} if scored.numel() else {}
    for name, values in per_term.items():
        given = values[~values.isnan()]  # (n,)
        if given.numel():
            stats[f"reward/{name}/mean"] = given.mean().item()
            stats[f"reward/{name}/std"] = std(given)
    for name, rows in (failed or {}).items():
        if rows.any():
            stats[f"reward/{name}/failed"] = float(rows.sum())
    return stats


def trusted_rows(scored: ScoredRollout) -> Tensor:
    """The rows every term could score (no call failed there, none answered UNSCORED): the others are
    left out of training, their advantage 0 and their tokens out of the loss. Shape: (B global,) bool."""
    return _trusted(scored.scores, scored.failed)


def _trusted(scores: Tensor, failed: dict[str, Tensor]) -> Tensor:
    untrusted = torch.zeros_like(scores, dtype=torch.bool)  # (B,)
    for rows in failed.values():
        untrusted |= rows.bool()
    return ~untrusted


def scored_stats(scored: ScoredRollout) -> dict[str, float]:
    """What a trainer logs of a scored batch: :func:`reward_stats` over every rank's rows, and the terms' own counters."""
    return {**reward_stats(scored.scores, scored.per_term, scored.failed), **scored.term_stats, **logged_means(scored.logged)}


def completion_stats(rollout: Rollout, world: distributed.World = distributed.World()) -> dict[str, float]:
    """completion_len/mean, completion_len/max, completion_len/clipped_frac (share without EOS), over every rank's rows."""
    lengths = distributed.gather_rows(rollout.completion_lengths().float(), world, uneven=True)  # (B global,); an agent's ranks hold unequal rows
    truncated = distributed.gather_rows(rollout.truncated.float(), world, uneven=True)  # (B global,)
    return {
        "completion_len/mean": lengths.mean().item(),
        "completion_len/max": lengths.max().item(),
        "completion_len/clipped_frac": truncated.mean().item(),
        "tokens": lengths.sum().item(),
    }


def sample_rows(step: int, scored: ScoredRollout, n: int) -> list[dict]:
    """The first ``n`` completions with their rewards (seed 003: watch the outputs, not only the reward)."""
    return [
        {"step": step, "prompt": scored.prompts[i], "completion": scored.completions[i], "reward": scored.local_scores[i].item(),
         **{k: _given(v[i].item()) for k, v in scored.local_per_term.items()}, **{k: v[i] for k, v in scored.extra.items()}}
        for i in range(min(n, len(scored.prompts)))
    ]


def _given(value: float) -> float | None:
    """A term's value in the samples table: None where the term gave none (NaN), which JSON cannot write."""
    return None if math.isnan(value) else value
