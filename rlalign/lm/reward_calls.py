"""Calling reward functions: the one place where a reward function runs, is checked, and fails loudly.

    length, judged = score_terms([CallPolicy("len", reward_len), CallPolicy("judge", judge, on_error="skip", timeout_s=30)],
                                 prompts, completions, columns, context)
    length.values    # (B,) float32, NaN where the term does not apply (None) or failed
    judged.failed    # (B,) bool: the call failed for these rows and the term is left out

A reward function is called TRL's way when it takes ``completions`` by name (keywords ``prompts``,
``completions``, the rows' columns and the context entries it names, all of them for ``**kwargs``),
else as ``fn(prompts, completions)``. It returns one score per completion: a finite number (a
float, an int, a bool, a NumPy scalar or a one-element tensor, as TRL takes them), or None
where it does not apply (the term is then left out of that completion's sum, TRL's nansum), or
:data:`UNSCORED` where it could not score it (a code run that never finished): that completion is
counted in ``failed`` and left out of training, whatever ``on_error`` says.

``async def`` functions (and objects whose ``__call__`` is async, TRL's ``is_async_callable``, or
that have an ``async def acall``, as rlalign's remote reward and judge) are started first, all together on one event loop that lives in a daemon thread for the whole process
(so a client an async function keeps, e.g. an ``httpx.AsyncClient``, stays on one loop); the
synchronous functions run meanwhile in the calling thread, then the async results are collected.
Their waiting overlaps: two functions that each wait 1 s cost 1 s, not 2.

Failures. A call that raises, exceeds ``timeout_s``, returns the wrong number of scores, or returns a
value that is not a finite number is, by default (``on_error="raise"``), a :class:`RewardFunctionError`
naming the function and the prompt (a batch that raises is re-run one row at a time to find the
prompt that does: ``RERUN_CONCURRENCY`` rows at once for an async function, in turn for a
synchronous one). With ``on_error="skip"`` the term is left out for the rows concerned (the whole
batch for a timeout or a wrong count, else the rows that raise or give a bad value) and they are
counted in ``failed``, which the trainers log as ``reward/<term>/failed`` and leave out of
training (no advantage, no loss: :func:`rlalign.train.rollouts.trusted_rows`). Never a silent 0.

A batch that fails with :class:`EndpointUnavailable` (a server that did not answer after its
retries, or refuses every request: :func:`rlalign.lm.remote_reward.post_json`) is not re-run row by
row, which would only ask the server again once per row: the whole batch fails. When a row's re-run
fails that way, the rows not yet re-run fail with it.

A synchronous function that times out cannot be stopped from outside: its thread runs on until it
returns, and its result is dropped. An async one is cancelled.

What a call logs through the context's ``log_metric`` and ``log_extra`` (TRL's callbacks) is held back
until its scores are kept (:class:`_CallLog`): a call that fails logs nothing, and a batch re-run row by
row logs what each row's call logged, in row order, once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlalign.errors import RLAlignError

__all__ = [
    "RewardFunctionError",
    "CallPolicy",
    "TermScores",
    "reward_fn_name",
    "is_async_reward",
    "async_entry",
    "import_reward_function",
    "call_reward",
    "score_terms",
    "score_completions",
    "check_finite",
    "reset_event_loop",
    "UNSCORED",
    "EndpointUnavailable",
    "RERUN_CONCURRENCY",
]


class _Unscored:
    """A reward function's answer for a completion it could not score (:data:`UNSCORED`)."""

    def __repr__(self) -> str:
        return "UNSCORED"


UNSCORED = _Unscored()  # the score of a completion that could not be scored: not 0, not "does not apply"

OnError = Literal["raise", "skip"]


class RewardFunctionError(RLAlignError, RuntimeError):
    """A reward function raised, timed out, returned the wrong number of scores, or returned NaN/inf."""


class EndpointUnavailable(RewardFunctionError):
    """The service a reward function asks did not answer (connection error, timeout, 429 or 5xx after the
    retries) or refuses every request (401, 403, 404, 405): asking it again row by row would only fail again."""


RERUN_CONCURRENCY = 8  # rows of a failed batch re-run at once, for an async function
LOG_CALLBACKS = ("log_metric", "log_extra")  # TRL's logging callbacks in a call's context


class _CallLog:
    """One call's logging, held back: ``context`` is the call's context with each of :data:`LOG_CALLBACKS`
    recording instead of logging; :meth:`keep` passes what was recorded on to the real callbacks, once.
    A call whose scores are not kept (it raised, timed out, or its batch is re-run row by row) is never kept,
    so a re-run batch does not log twice, and a synchronous call still running past its limit logs nowhere."""

    def __init__(self, context: dict) -> None:
        self._real, self._calls = context, []
        self.context = {**context, **{key: functools.partial(self._record, key) for key in LOG_CALLBACKS if key in context}}

    def _record(self, key: str, *args, **kwargs) -> None:
        self._calls.append((key, args, kwargs))

    def keep(self) -> None:
        calls, self._calls = self._calls, []
        for key, args, kwargs in calls:
            self._real[key](*args, **kwargs)


def reward_fn_name(fn: Callable) -> str:
    """A function's ``name`` attribute, else its ``__name__``, else its type's name (a callable object)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def is_async_reward(fn: Callable) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, a ``functools.partial`` of
    one, or an object whose ``__call__`` is ``async def`` (TRL's ``is_async_callable``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def async_entry(fn: Callable) -> Callable | None:
    """What to await for ``fn``: itself when it is async, its ``acall`` when it has an ``async def acall``
    beside a synchronous ``__call__`` (rlalign's remote reward and judge), else None (a synchronous function)."""
    if is_async_reward(fn):
        return fn
    acall = getattr(fn, "acall", None)
    return acall if inspect.iscoroutinefunction(acall) else None


@dataclass(frozen=True)
class CallPolicy:
    """One reward function to call: its metric ``name``, what a failed call does, and its time limit (None: none)."""

    name: str
    fn: Callable
    on_error: OnError = "raise"
    timeout_s: float | None = None


@dataclass
class TermScores:
    """One term's scores for a batch."""

    values: Tensor  # (B,) float32; NaN where the function returned None or the call failed
    failed: Tensor  # (B,) bool: rows whose call failed (only with on_error="skip"; else it raised)


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


def import_reward_function(spec: str) -> Callable:
    """``package.module:function`` imported, the current directory importable (as ``python -m`` makes it).

    Raises:
        ConfigError: naming ``spec`` when it is malformed, cannot be imported, or is not callable.
    """
    from rlalign.config import ConfigError

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward function {spec!r}: expected package.module:function")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the `rlalign` script, unlike `python -m`, lacks the current directory
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward function {spec!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r} is not callable")
    return fn


def call_reward(fn: Callable, prompts: list, completions: list, columns: Mapping[str, Sequence], context: Mapping[str, object]):
    """TRL's convention where ``fn`` takes it: keywords ``prompts``, ``completions``, every other
    column and every ``context`` entry by name (all of them for ``**kwargs``, else those it names);
    else ``fn(prompts, completions)``. Returns what ``fn`` returns (a coroutine for an async one)."""
    names = _keyword_names(fn)
    if names is not None and not names:
        return fn(prompts, completions)
    kwargs = {**columns, **context, "prompts": prompts, "completions": completions}  # a column of either name never replaces them
    return fn(**(kwargs if names is None else {key: value for key, value in kwargs.items() if key in names}))


# ----------------------------------------------------------------------------------------------
# The event loop of async reward functions
# ----------------------------------------------------------------------------------------------


@functools.cache
def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop per process, running in a daemon thread, started on first use."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="rlalign-async-rewards", daemon=True).start()
    return loop


def reset_event_loop() -> None:
    """Forget the loop (a process forked from one that ran it has no thread behind it): the next async call starts a new one."""
    _event_loop.cache_clear()


async def _await_with_limit(coroutine, timeout_s: float | None):
    return await (asyncio.wait_for(coroutine, timeout_s) if timeout_s is not None else coroutine)


def _start_async(policy: CallPolicy, prompts: list, completions: list, columns: dict, context: dict) -> concurrent.futures.Future:
    """Schedule one async call on the loop; its future holds the scores or the exception."""
    coroutine = call_reward(async_entry(policy.fn), prompts, completions, columns, context)
    return asyncio.run_coroutine_threadsafe(_await_with_limit(coroutine, policy.timeout_s), _event_loop())


def _run_sync(policy: CallPolicy, prompts: list, completions: list, columns: dict, context: dict):
    """One synchronous call, in a worker thread when it has a time limit."""
    if policy.timeout_s is None:
        return call_reward(policy.fn, prompts, completions, columns, context)
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"reward-{policy.name}")
    future = worker.submit(call_reward, policy.fn, prompts, completions, columns, context)
    worker.shutdown(wait=False)  # a call past its limit keeps its thread until it returns
    return future.result(timeout=policy.timeout_s)


def _call(policy: CallPolicy, prompts: list, completions: list, columns: dict, context: dict):
    """One call of either kind, waited for (the per-row re-runs after a failure)."""
    if async_entry(policy.fn) is not None:
        return _start_async(policy, prompts, completions, columns, context).result()
    return _run_sync(policy, prompts, completions, columns, context)


# ----------------------------------------------------------------------------------------------
# Checking what came back
# ----------------------------------------------------------------------------------------------


def _as_number(score):
    """A score TRL takes as a number (a float, an int, a bool, a NumPy scalar, a one-element tensor: it builds a float32
    tensor of them) as a Python value, else ``score`` as it is."""
    if isinstance(score, torch.Tensor) and score.numel() == 1 and not score.is_complex():
        return score.item()
    if type(score).__module__ == "numpy" and hasattr(score, "item") and getattr(score, "shape", None) == ():  # np.float32, np.int64, np.bool_
        return score.item()
    return score


def _bad_value(score) -> bool:
    return score is not None and score is not UNSCORED and (not isinstance(score, (int, float)) or not math.isfinite(score))


def _checked(policy: CallPolicy, outcome, log: _CallLog, prompts: list, completions: list, columns: dict, context: dict) -> TermScores:
    """Scores from a call's ``outcome`` (its return value or its exception), by ``policy.on_error``; what the call
    logged (``log``) is kept where its scores are."""
    n, name, skip = len(prompts), policy.name, policy.on_error == "skip"
    if isinstance(outcome, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        if skip:
            return _all_failed(n)
        raise RewardFunctionError(f"reward function {name} took longer than its timeout_s={policy.timeout_s} (batch of {n}, first prompt {prompts[0]!r})") from outcome
    if isinstance(outcome, BaseException):
        if n > 1 and not isinstance(outcome, EndpointUnavailable):  # find the rows that raise: alone, each succeeds or fails on its own
            outcomes, logs = _rerun_rows(policy, prompts, completions, columns, context)
            if not any(isinstance(o, BaseException) for o in outcomes):  # the batch failed, no row does alone: scores alone are not the batch's
                if skip:
                    return _all_failed(n)
                raise RewardFunctionError(
                    f"reward function {name} raised {type(outcome).__name__}: {outcome} on its batch of {n} completions (first prompt "
                    f"{prompts[0]!r}), though each alone returned: a function whose scores depend on its batch cannot be scored row by row "
                    "(where the batch's size is the cause, e.g. out of memory, let the function score in smaller batches)"
                ) from outcome
            rows = [_checked(policy, o, row_log, [p], [c], _row(columns, i), context)
                    for i, (o, row_log, p, c) in enumerate(zip(outcomes, logs, prompts, completions))]
            return TermScores(torch.cat([r.values for r in rows]), torch.cat([r.failed for r in rows]))
        if skip:
            return _all_failed(n)
        raise RewardFunctionError(f"reward function {name} raised {type(outcome).__name__}: {outcome} (prompt {prompts[0]!r})") from outcome
    try:
        scores = list(outcome)
    except TypeError:
        scores = None
    if scores is None or len(scores) != n:
        if skip:
            return _all_failed(n)
        got = f"{len(scores)} scores" if scores is not None else f"a {type(outcome).__name__}"
        raise RewardFunctionError(f"reward function {name} returned {got} for {n} completions (first prompt {prompts[0]!r})")
    scores = [_as_number(s) for s in scores]
    failed = [_bad_value(s) for s in scores]
    if any(failed) and not skip:
        i = failed.index(True)
        raise RewardFunctionError(
            f"reward function {name} returned {scores[i]!r} (expected a finite float) for prompt {prompts[i]!r} "
            "(None marks a completion the function does not apply to)"
        )
    values = [math.nan if s is None or s is UNSCORED or bad else float(s) for s, bad in zip(scores, failed)]
    unscored = [bad or s is UNSCORED for s, bad in zip(scores, failed)]
    log.keep()
    return TermScores(torch.tensor(values, dtype=torch.float32), torch.tensor(unscored, dtype=torch.bool))


def _outcome(policy: CallPolicy, prompts: list, completions: list, columns: dict, context: dict):
    try:
        return _call(policy, prompts, completions, columns, context)
    except Exception as err:  # noqa: BLE001 - every failure of user code is judged by the policy
        return err


def _rerun_rows(policy: CallPolicy, prompts: list, completions: list, columns: dict, context: dict) -> tuple[list, list[_CallLog]]:
    """Each row's outcome alone (its scores or its exception) and its call's log: an async function's rows
    ``RERUN_CONCURRENCY`` at a time, a synchronous one's in turn. Once a row fails with
    :class:`EndpointUnavailable`, the rows not yet started get that outcome without a call."""
    logs = [_CallLog(context) for _ in prompts]
    if async_entry(policy.fn) is None:
        outcomes: list = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            down = next((o for o in outcomes if isinstance(o, EndpointUnavailable)), None)
            outcomes.append(down or _outcome(policy, [p], [c], _row(columns, i), logs[i].context))
        return outcomes, logs
    rerun = _rerun_rows_async(policy, prompts, completions, columns, [log.context for log in logs])
    return asyncio.run_coroutine_threadsafe(rerun, _event_loop()).result(), logs


async def _rerun_rows_async(policy: CallPolicy, prompts: list, completions: list, columns: dict, contexts: list[dict]) -> list:
    limit, down = asyncio.Semaphore(RERUN_CONCURRENCY), []

    async def one(i: int):
        async with limit:
            if down:
                return down[0]
            try:
                coroutine = call_reward(async_entry(policy.fn), [prompts[i]], [completions[i]], _row(columns, i), contexts[i])
                return await _await_with_limit(coroutine, policy.timeout_s)
            except Exception as err:  # noqa: BLE001 - judged by the policy, as _outcome does
                if isinstance(err, EndpointUnavailable):
                    down.append(err)
                return err

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _row(columns: dict, i: int) -> dict:
    return {key: [values[i]] for key, values in columns.items()}


def _all_failed(n: int) -> TermScores:
    return TermScores(torch.full((n,), math.nan), torch.ones(n, dtype=torch.bool))


def score_terms(
    policies: Sequence[CallPolicy], prompts: list, completions: list, columns: Mapping[str, Sequence] | None = None,
    context: Mapping[str, object] | None = None,
) -> list[TermScores]:
    """Call every function on the batch (async ones concurrently, see the module docstring) and
    check what each returns. Returns one :class:`TermScores` per policy, in their order.

    Raises:
        RewardFunctionError: a failed call of a function whose ``on_error`` is "raise".
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    columns, context = dict(columns or {}), dict(context or {})
    pending: dict[int, concurrent.futures.Future] = {}
    logs = [_CallLog(context) for _ in policies]
    for k, policy in enumerate(policies):  # start every async call before the first synchronous one
        if async_entry(policy.fn) is not None:
            try:
                pending[k] = _start_async(policy, prompts, completions, columns, logs[k].context)
            except Exception as err:  # noqa: BLE001 - raised before its first await
                pending[k] = _done(err)
    results: dict[int, TermScores] = {}
    for k, policy in enumerate(policies):
        if k not in pending:
            outcome = _outcome(policy, prompts, completions, columns, logs[k].context)
            results[k] = _checked(policy, outcome, logs[k], prompts, completions, columns, context)
    for k, future in pending.items():
        outcome = future.exception() or future.result()
        results[k] = _checked(policies[k], outcome, logs[k], prompts, completions, columns, context)
    return [results[k] for k in range(len(policies))]


def _done(err: BaseException) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(err)
    return future


def score_completions(
    reward_fns: Sequence[Callable], prompts: list, completions: list, weights: Sequence[float] | None = None,
    columns: Mapping[str, Sequence] | None = None,
    context: Mapping[str, object] | None = None,
) -> Tensor:
    """sum_k w_k fn_k(prompts, completions), checked. Returns (B,) float32, NaN for a completion that
    has no reward: every function returned None for it, or one returned :data:`UNSCORED` (as the
    trainers leave such a completion out of training). A function returning None for a completion
    others score is left out of that completion's sum. Average over the scored completions
    (``total.nanmean()``), never with a NaN read as 0.

    ``columns``: the rows' other dataset columns (``answer``, ``tests``, ...), one value per row each;
    ``context``: keywords that are not per row (a trainer passes ``trainer_state``, with ``global_step``).
    How functions are called and checked: the module docstring.

    Raises:
        RewardFunctionError: naming the function and the prompt, when one raises or returns
        something other than one finite number, None or UNSCORED per completion.
    """
    if not reward_fns:
        raise ValueError("no reward functions")
    weights = [1.0] * len(reward_fns) if weights is None else list(weights)
    if len(weights) != len(reward_fns):
        raise ValueError(f"{len(weights)} weights for {len(reward_fns)} reward functions")
    policies = [CallPolicy(reward_fn_name(fn), fn) for fn in reward_fns]
    results = score_terms(policies, list(prompts), list(completions), columns, context)
    total = torch.zeros(len(prompts), dtype=torch.float32)  # (B,)
    scored = torch.zeros(len(prompts), dtype=torch.bool)  # (B,) some function gave a number
    unscored = torch.zeros(len(prompts), dtype=torch.bool)  # (B,) some function answered UNSCORED
    for policy, weight, result in zip(policies, weights, results):
        name, scores = policy.name, result.values
        applies = ~torch.isnan(scores)
        check_finite(scores[applies], f"reward function {name} returned", [p for p, a in zip(prompts, applies.tolist()) if a], "not finite in float32, the dtype rewards are trained in")
        total += weight * scores.nan_to_num(0.0)
        check_finite(total, f"the reward total after reward function {name} (weight {weight}) is", prompts, "not finite in float32")
        scored |= applies
        unscored |= result.failed  # on_error is "raise" here, so only UNSCORED marks a row failed
    return total.masked_fill(~scored | unscored, math.nan)


def check_finite(values: Tensor, what: str, prompts: Sequence, why: str) -> None:
    """Raise :class:`RewardFunctionError` naming the first prompt whose value in ``values`` (B,) is not finite."""
    bad = (~torch.isfinite(values)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RewardFunctionError(f"{what} {values[i].item()} for prompt {prompts[i]!r}: {why}")
