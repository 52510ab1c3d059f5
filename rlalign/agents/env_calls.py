"""Calling an environment's or agent's own code from an episode's event loop, and checking the reward it gives.

    value = await call_on_loop(env.get_reward)          # awaited when async, else run in the loop's thread pool
    reward = checked_reward(value, "environment Counter.get_reward", prompt)   # a float, or None for no reward
    reward = await called_reward(env.get_reward, "environment Counter.get_reward", prompt)   # both, its exception named too

Shared by :mod:`rlalign.agents.environment` (rlalign's protocol), :mod:`rlalign.agents.trl_environment` (TRL's)
and :mod:`rlalign.agents.agent_source`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import torch

from rlalign.errors import RLAlignError
from rlalign.lm.reward_calls import RewardFunctionError, _as_number, check_finite

__all__ = ["EnvironmentFailed", "call_on_loop", "checked_reward", "called_reward", "failure"]


class EnvironmentFailed(RLAlignError, ValueError):
    """An environment could not be made or could not start an episode (its own exception, or what it returned, named
    with the class, the method and the prompt): bad input, so the run stops before the step's update."""


def failure(err: Exception, where: str, prompt: Any = None) -> RLAlignError:
    """``err`` raised by an environment's ``where`` (e.g. ``"environment Counter.reset"``) as one message naming it and
    ``prompt``; an rlalign error is kept as it is."""
    if isinstance(err, RLAlignError):
        return err
    on = "" if prompt is None else f" for prompt {prompt!r:.200}"
    return EnvironmentFailed(f"{where} failed{on}: {type(err).__name__}: {err}")


async def call_on_loop(fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``: awaited when it is a coroutine function, else run in the loop's thread pool."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))
    return await result if inspect.isawaitable(result) else result


def checked_reward(value: Any, who: str, prompt: Any) -> float | None:
    """An environment's or agent's own reward as a float (None: it gave none), by the reward terms' convention
    (:mod:`rlalign.lm.reward_calls`: a number, a bool, a NumPy scalar or a one-element tensor).

    Raises:
        RewardFunctionError: naming ``who`` and ``prompt`` when it is not a number, or not finite in float32.
    """
    value = _as_number(value)
    if value is None:
        return None
    if not isinstance(value, (int, float)):
        raise RewardFunctionError(f"{who} returned {value!r:.80} for prompt {prompt!r}: expected a finite number, or None for no reward")
    check_finite(torch.tensor([float(value)]), f"{who} returned", [prompt], "expected a finite number in float32, the dtype rewards are trained in")
    return float(value)


async def called_reward(fn: Callable, who: str, prompt: Any, *args) -> float | None:
    """:func:`checked_reward` of ``fn(*args)`` (:func:`call_on_loop`).

    Raises:
        RewardFunctionError: ``fn`` raised, or gave no finite number (naming ``who`` and ``prompt``).
    """
    try:
        value = await call_on_loop(fn, *args)
    except RLAlignError:
        raise
    except Exception as err:
        raise RewardFunctionError(f"{who} raised {type(err).__name__}: {err} (prompt {prompt!r:.200})") from err
    return checked_reward(value, who, prompt)
