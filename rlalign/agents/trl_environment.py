"""TRL's environment classes (``GRPOTrainer(environment_factory=...)``, TRL 1.16) on rlalign's episodes.

A TRL environment exposes every public method as a tool, starts an episode with ``reset(**row)`` (the
dataset row as keywords) returning None or text that TRL appends to the prompt's last message, and may
own the reward through ``get_reward()`` (no arguments, read once the episode is over):

    class Counter:
        def reset(self, **row) -> str | None: ...
        def increment(self, step: int) -> int:
            '''Add to the counter.

            Args:
                step: How much to add.
            '''
        def get_reward(self) -> float: ...

:func:`adapt` tells the two protocols apart on an instance (:func:`protocol`) and wraps a TRL one in
:class:`TRLEnvironment`, which speaks rlalign's (``reset(record)`` -> the prompt, ``tool_functions``,
``tool_schemas()``, ``reward(answer)``). What maps to what, as TRL's ``GRPOTrainer`` does it:

- tools: the functions of the environment's class (inherited ones too, in name order) except ``reset``,
  ``get_reward`` and names starting with ``_`` (``inspect.getmembers(type(env), inspect.isfunction)``:
  static methods count, class methods and properties do not), called by their ``__name__``, shown by
  ``transformers.utils.get_json_schema``;
- the prompt: the record's ``prompt`` with ``reset``'s text appended to the last message's content
  (a list content gets it as a text part); None leaves it unchanged. A text prompt gets the text
  appended (TRL's code fails on a text prompt with an observation);
- the reward: ``get_reward()`` (``async`` too) when the class defines it, else none; None is no
  reward. It is the term ``environment`` (TRL logs it under the class's name, weight 1 in both).

A dict ``{name: factory}`` is TRL's multi-environment form: each record's ``environment`` column picks
its factory (the column is not passed to ``reset``), and only that environment's tools are shown in
its prompt. One instance per episode (TRL keeps a pool of instances it resets again: an environment
whose ``reset`` leaves no state behind behaves the same).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlalign.agents.env_calls import called_reward
from rlalign.agents.tool_calls import tool_schemas

__all__ = ["TRLEnvironment", "protocol", "adapt", "trl_tools", "with_standalone_tools"]

RESERVED = ("reset", "get_reward")  # functions of a TRL environment that are not tools


def trl_tools(env: Any) -> list[Callable]:
    """TRL 1.16's tools of ``env``: its class's public functions but ``reset`` and ``get_reward``, bound, in name order."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def _has_function(env: Any, name: str) -> bool:
    """Whether ``env``'s class defines ``name`` as a function (static methods too), as TRL finds ``reset`` and ``get_reward``."""
    return inspect.isfunction(getattr(type(env), name, None))


def _reset_takes(reset: Callable) -> tuple[bool, bool]:
    """(takes a positional argument, takes any keyword): rlalign calls ``reset(record)``, TRL ``reset(**row)``."""
    try:
        params = inspect.signature(reset).parameters.values()
    except (TypeError, ValueError):
        return True, False
    positional = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    return positional, any(p.kind is p.VAR_KEYWORD for p in params)


def protocol(env: Any) -> str:
    """``"rlalign"`` or ``"trl"``: the protocol ``env`` speaks.

    A ``tools`` attribute is rlalign's; a ``get_reward`` method is TRL's. Without either, ``reset``
    decides: one taking a positional argument and no ``**kwargs`` (``reset(self, record)``) is rlalign's,
    one taking ``**kwargs`` or no positional argument (``reset(self, **row)``, ``reset(self)``) is TRL's.
    An object without ``reset`` is left to rlalign's checks.

    Raises:
        ValueError: both ``tools`` and ``get_reward``, or a ``reset`` taking both ``record`` and ``**kwargs``
            without either (names the class).
    """
    name = type(env).__name__
    has_tools, has_reward = hasattr(env, "tools"), _has_function(env, "get_reward")
    if has_tools and has_reward:
        raise ValueError(f"environment {name} has both a tools list (rlalign's protocol) and get_reward (TRL's environment_factory): "
                         "drop tools to run it as TRL's (every public method a tool), or rename get_reward to reward(answer) for rlalign's")
    if has_tools or has_reward:
        return "rlalign" if has_tools else "trl"
    reset = getattr(env, "reset", None)
    if not callable(reset):
        return "rlalign"
    positional, keywords = _reset_takes(reset)
    if positional and keywords:
        raise ValueError(f"environment {name}: reset takes both a record (rlalign's reset(record)) and **kwargs (TRL's reset(**row)), so its "
                         "protocol is ambiguous: give it a tools list of method names (rlalign's), or make reset's parameters keyword-only (TRL's)")
    return "trl" if keywords or not positional else "rlalign"


def adapt(env: Any) -> Any:
    """``env`` as rlalign runs it: unchanged when it speaks rlalign's protocol (a :class:`TRLEnvironment` does), wrapped when TRL's."""
    return TRLEnvironment(env) if protocol(env) == "trl" else env


def with_standalone_tools(make_env: Callable[[], Any], tools: Sequence[Callable]) -> Any:
    """An environment from ``make_env`` with TRL's standalone ``tools`` (``GRPOTrainer(tools=..., environment_factory=...)``)
    shown before its own methods, as TRL lists them.

    Raises:
        ValueError: the environment speaks rlalign's protocol, whose tools are its own ``tools`` list (names the class).
    """
    env = make_env()
    if isinstance(env, TRLEnvironment):  # TRL's dict of factories
        env.standalone = list(tools)
        env._bind()
        return env
    if protocol(env) != "trl":
        raise ValueError(f"tools=[...] beside environment {type(env).__name__}: only TRL's environment classes take tools given apart "
                         "(TRL's GRPOTrainer(tools=..., environment_factory=...)); list them in its tools instead")
    return TRLEnvironment(env, standalone=tools)


def with_observation(prompt: Any, observation: Any) -> Any:
    """``prompt`` with ``reset``'s ``observation`` appended to its last message, as TRL's ``_generate_and_score_completions`` builds it."""
    if observation is None:
        return prompt
    if not isinstance(observation, (str, list)):
        raise ValueError(f"reset returned {observation!r:.80}; expected text or a list of content parts to append to the prompt, or None")
    if isinstance(prompt, str):
        if not isinstance(observation, str):
            raise ValueError(f"reset returned {observation!r:.80} for a text prompt; expected text or None")
        return prompt + observation
    last = prompt[-1]
    content = last["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return list(prompt[:-1]) + [{**last, "content": content + observation}]  # a new message: the record's is left as it was


class TRLEnvironment:
    """One episode of a TRL-style environment in rlalign's protocol (:mod:`rlalign.agents.environment`).

    ``TRLEnvironment(env)`` wraps one instance; ``TRLEnvironment(factories={name: factory})`` makes its
    instance at ``reset`` from the factory the record's ``environment`` column names. Other attributes
    are read from the wrapped instance (a reward function may read its state).
    """

    done = False  # TRL ends an episode at an answer without calls, never on the environment's word

    def __init__(self, env: Any = None, factories: Mapping[Any, Callable[[], Any]] | None = None, standalone: Sequence[Callable] = ()):
        if (env is None) == (factories is None):
            raise ValueError("TRLEnvironment takes an environment or a dict of factories, not both")
        self.env, self.factories, self.prompt = env, factories, None
        self.standalone = list(standalone)  # TRL's GRPOTrainer(tools=...) beside an environment: shown first, in every environment
        self._bind()

    def _bind(self) -> None:
        self.methods = self.standalone + (trl_tools(self.env) if self.env is not None else [])  # TRL's tools + methods
        self.tool_functions = {fn.__name__: fn for fn in self.methods}  # TRL calls them by __name__

    def reset(self, record: Mapping[str, Any]) -> Any:
        row = dict(record)
        if self.factories is not None:
            self.env = None  # until the record's is made: an error names the dict, not the last episode's class
            name = row.pop("environment", None)  # a control column: not passed to reset (TRL)
            if name not in self.factories:
                raise ValueError(f"record has environment={name!r}, which is not among the environments given: expected one of {list(self.factories)}")
            self.env = self.factories[name]()
            self._bind()
        if not _has_function(self.env, "reset"):
            raise ValueError(f"environment {type(self.env).__name__} must define a callable reset (TRL's environment_factory)")
        if "prompt" not in row:
            raise ValueError(f"environment {type(self.env).__name__}: the record has no prompt (rlalign's prompts all have one)")
        self.prompt = row["prompt"]
        observation = self.env.reset(**row)
        if inspect.isawaitable(observation):
            if inspect.iscoroutine(observation):
                observation.close()  # never to be awaited: no "coroutine was never awaited" warning
            raise ValueError(f"environment {type(self.env).__name__}.reset is async; TRL calls reset synchronously")
        return with_observation(row["prompt"], observation)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (``get_json_schema``, as TRL's chat template call makes them), in TRL's order."""
        return tool_schemas(self.methods)

    async def reward(self, answer: str) -> float | None:
        """``get_reward()`` of the episode's environment (awaited when async; run in the loop's thread pool when not); None without one.

        Raises:
            RewardFunctionError: it raised, or gave neither a finite number nor None (names the environment's class and the prompt).
        """
        if not _has_function(self.env, "get_reward"):
            return None
        return await called_reward(self.env.get_reward, f"environment {type(self.env).__name__}.get_reward", self.prompt)

    def __getattr__(self, name: str) -> Any:
        env = self.__dict__.get("env")
        if env is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(env, name)

    def __repr__(self) -> str:
        return f"TRLEnvironment({type(self.env).__name__ if self.env is not None else list(self.factories)})"
