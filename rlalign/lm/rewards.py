"""Reward functions: ``fn(prompts: list[str], completions: list[str]) -> list[float]``, one score a pair.

Rule-based (verifiable) rewards and a wrapper that turns a reward model into a reward function:

    reward_fns = [math_answer({"What is 2+2?": "4"}), format_check(r"\\d+")]
    scores = score_completions(reward_fns, prompts, completions, weights=[1.0, 0.1])   # (B,)

:func:`score_completions` is the one place where reward functions are called: it checks that a
function returns one finite float per completion, and turns an exception or a NaN into a
:class:`RewardFunctionError` naming the function and the prompt concerned (a batch that raises is
re-run one pair at a time to find the prompt that triggers it).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlalign.errors import RLAlignError
from rlalign.lm.data import PreferenceExample, collate_preferences

__all__ = [
    "RewardFn",
    "RewardFunctionError",
    "exact_match",
    "math_answer",
    "format_check",
    "RewardModelReward",
    "reward_fn_name",
    "score_completions",
    "call_reward",
]


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]: ...


class RewardFunctionError(RLAlignError, RuntimeError):
    """A reward function raised, returned the wrong number of scores, or returned NaN/inf."""


def reward_fn_name(fn: Callable) -> str:
    """A function's ``name`` attribute, else its qualified name, else its type's name."""
    return getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or type(fn).__name__


def row_references(references: Mapping[str, str] | None, prompts: list[str], columns: Mapping[str, Sequence], column: str, name: str) -> list[str]:
    """Each row's reference: its own ``column`` value when the rows' columns are passed (as keywords),
    else the ``references`` value of its prompt text (None there: the prompt has several)."""
    if column in columns:
        return [str(value) for value in columns[column]]
    if references is None:
        raise KeyError(f"{name}: no {column!r} column for these prompts")
    for p in prompts:
        if references.get(p) is None:
            raise KeyError(f"{name}: no {column!r} for prompt {p!r}" if p not in references else f"{name}: prompt {p!r} has several {column!r} values; pass the rows' {column!r} column")
    return [references[p] for p in prompts]


def exact_match(references: Mapping[str, str] | None = None, strip: bool = True) -> RewardFn:
    """1.0 when the completion equals its reference (whitespace-stripped), else 0.0. The reference is
    the row's ``answer`` column (``references`` None), or the ``references`` value of its prompt."""

    def exact_match_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
        refs = row_references(references, prompts, columns, "answer", "exact_match")
        return [float(c.strip() == r.strip()) if strip else float(c == r) for c, r in zip(completions, refs, strict=True)]

    return exact_match_reward


def math_answer(references: Mapping[str, str] | None = None) -> RewardFn:
    """1.0 when ``math_verify`` finds the completion's answer equal to its reference (e.g. "1/2" vs
    "0.5", "\\boxed{4}" vs "4"), else 0.0; the reference as in :func:`exact_match`. An unparsable
    completion scores 0."""
    from math_verify import parse, verify

    def math_answer_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
        out = []
        for c, r in zip(completions, row_references(references, prompts, columns, "answer", "math_answer"), strict=True):
            gold, answer = parse(r), parse(c)
            out.append(1.0 if gold and answer and verify(gold, answer) else 0.0)
        return out

    return math_answer_reward


def format_check(pattern: str, full_match: bool = True) -> RewardFn:
    """1.0 when the completion matches the regular expression ``pattern`` (whole string by default)."""
    regex = re.compile(pattern, re.DOTALL)
    match = regex.fullmatch if full_match else regex.search

    def format_reward(prompts: list[str], completions: list[str]) -> list[float]:
        return [1.0 if match(c) else 0.0 for c in completions]

    return format_reward


class RewardModelReward:
    """A reward model as a reward function: r(x, y) read at the EOS of prompt + completion.

    Scores are computed without gradients in batches of ``batch_size`` pairs.
    """

    def __init__(self, model, tokenizer: PreTrainedTokenizerBase, batch_size: int = 32, max_length: int = 1024):
        self.model, self.tokenizer, self.batch_size, self.max_length = model, tokenizer, batch_size, max_length
        self.name = f"RewardModelReward({getattr(model.config, 'name_or_path', '') or type(model).__name__})"

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            pairs = [PreferenceExample(p, c, c) for p, c in zip(prompts[start : start + self.batch_size], completions[start : start + self.batch_size], strict=True)]
            batch = collate_preferences(self.tokenizer, pairs, self.max_length)
            n = batch.num_pairs
            ids, mask = batch.input_ids[:n].to(device), batch.attention_mask[:n].to(device)  # (n, T): the "chosen" half
            scores.extend(self.model.sequence_scores(ids, mask).tolist())
        return scores


def _keyword_names(fn: Callable) -> set[str] | None:
    """The keyword arguments ``fn`` takes: None for ``**kwargs`` (all of them), an empty set when it
    cannot take ``prompts`` and ``completions`` by name (then it is called positionally)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    named = {p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return named if "completions" in named else set()


def call_reward(fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, Sequence], context: Mapping[str, object]) -> Sequence:
    """TRL's convention where ``fn`` takes it: keywords ``prompts``, ``completions``, every other
    column and every ``context`` entry by name (all of them for ``**kwargs``, else those it names);
    else ``fn(prompts, completions)``."""
    names = _keyword_names(fn)
    if names is not None and not names:
        return fn(prompts, completions)
    kwargs = {**columns, **context, "prompts": prompts, "completions": completions}  # a column of either name never replaces them
    return fn(**(kwargs if names is None else {key: value for key, value in kwargs.items() if key in names}))


def _call_one(
    fn: RewardFn, name: str, prompts: list[str], completions: list[str], columns: dict[str, Sequence], context: Mapping[str, object] | None = None
) -> list[float]:
    """``fn``'s scores, checked: one finite number per completion, or None where it does not apply (read as NaN)."""
    try:
        scores = list(call_reward(fn, prompts, completions, columns, context or {}))
    except Exception as err:  # find which prompt makes it raise
        if len(prompts) > 1:
            for i, (p, c) in enumerate(zip(prompts, completions)):
                _call_one(fn, name, [p], [c], {key: [values[i]] for key, values in columns.items()}, context)
        raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {err} (prompt {prompts[0]!r})") from err
    if len(scores) != len(prompts):
        raise RewardFunctionError(f"reward function {name} returned {len(scores)} scores for {len(prompts)} completions")
    for p, s in zip(prompts, scores):
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)):
            raise RewardFunctionError(f"reward function {name} returned {s!r} (expected a finite float) for prompt {p!r} (None marks a completion the function does not apply to)")
    return [math.nan if s is None else float(s) for s in scores]


def score_completions(
    reward_fns: Sequence[RewardFn], prompts: list[str], completions: list[str], weights: Sequence[float] | None = None,
    columns: Mapping[str, Sequence] | None = None,
    context: Mapping[str, object] | None = None,
) -> Tensor:
    """sum_k w_k fn_k(prompts, completions), checked. Returns (B,) float32. A function may return
    None for a completion it does not apply to: its term is left out of that completion's sum.

    ``columns``: the rows' other dataset columns (``answer``, ``tests``, ...), one value per row each.
    A function that takes ``completions`` by name is called TRL's way, with keywords: ``prompts``,
    ``completions`` and the columns it names (every one for ``**kwargs``), so a reference is the row's
    own, not looked up by prompt text; any other function is called ``fn(prompts, completions)``.
    ``context``: keywords that are not per row (a trainer passes ``trainer_state``, with ``global_step``).

    Raises:
        RewardFunctionError: naming the function and the prompt, when one raises or returns
        something other than one finite number per completion.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not reward_fns:
        raise ValueError("no reward functions")
    weights = [1.0] * len(reward_fns) if weights is None else list(weights)
    if len(weights) != len(reward_fns):
        raise ValueError(f"{len(weights)} weights for {len(reward_fns)} reward functions")
    total = torch.zeros(len(prompts), dtype=torch.float32)  # (B,)
    for fn, weight in zip(reward_fns, weights):
        name = reward_fn_name(fn)
        scores = torch.tensor(_call_one(fn, name, list(prompts), list(completions), dict(columns or {}), dict(context or {})), dtype=torch.float32)  # (B,), NaN: None
        applies = ~torch.isnan(scores)  # a None score leaves the term out of that completion's sum (TRL's nansum)
        check_finite(scores[applies], f"reward function {name} returned", [p for p, a in zip(prompts, applies.tolist()) if a], "not finite in float32, the dtype rewards are trained in")
        total += weight * scores.nan_to_num(0.0)
        check_finite(total, f"the reward total after reward function {name} (weight {weight}) is", prompts, "not finite in float32")
    return total


def check_finite(values: Tensor, what: str, prompts: Sequence[str], why: str) -> None:
    """Raise :class:`RewardFunctionError` naming the first prompt whose value in ``values`` (B,) is not finite."""
    bad = (~torch.isfinite(values)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RewardFunctionError(f"{what} {values[i].item()} for prompt {prompts[i]!r}: {why}")
