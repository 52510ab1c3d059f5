"""Calling an environment's or agent's own code from an episode's event loop, and checking the reward it gives.

    value = await call_on_loop(env.get_reward)          # awaited when async, else run in the loop's thread pool
    reward = checked_reward(value, "environment Counter.get_reward", prompt)   # a float, or None for no reward

Shared by :mod:`rlalign.agents.environment` (rlalign's protocol), :mod:`rlalign.agents.trl_environment` (TRL's)
and :mod:`rlalign.agents.agent_source`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import torch

from rlalign.lm.reward_calls import RewardFunctionError, _as_number, check_finite

__all__ = ["call_on_loop", "checked_reward"]


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
