"""Python environments: the protocol an episode is run against, and the runner that drives one.

An environment is any object with these members (each method may be ``async def``):

    class Lookup:
        tools = ["lookup"]                        # names of methods that are tools (typed, with docstrings)

        def reset(self, record) -> str | list[dict]:
            '''A new episode for the row's record; returns the prompt: text or chat messages.'''

        def lookup(self, name: str) -> str:      # a tool: JSON arguments as keywords, the result as text
            '''Look up an item.

            Args:
                name: The item's name.
            '''

        def reward(self, answer: str) -> float | None:   # optional: the episode's reward, from the final answer
        done: bool                                         # optional: True ends the episode after this turn

Instead of tool methods an environment may define ``step(calls: list[ToolCall]) -> list[dict] | str``
(the tool messages of a turn's calls, or one text message) and ``tool_schemas`` (the JSON schemas
the chat template shows). Instead of a ``tools`` list it may give ``tool_functions`` (name -> callable),
read again after ``reset`` (the environment may pick its tools there). One object serves one episode:
the trainer makes one per row (a class is instantiated with no arguments; :func:`environment_factory`
takes ``module:Class``, a class or a zero-argument callable).

TRL's environment classes (``GRPOTrainer(environment_factory=...)``: every public method a tool,
``reset(**row)``, ``get_reward()``) run unchanged, and so does TRL's dict of them selected by the
``environment`` column: :class:`EnvRunner` tells the protocols apart on each object and wraps TRL's
(:mod:`rlalign.agents.trl_environment`).

A reward that is not a number (None: no reward; a bool, a NumPy scalar or a one-element tensor counts as
its value, as for reward terms) or not finite is a :class:`rlalign.lm.reward_calls.RewardFunctionError`
naming the environment and the prompt (:func:`rlalign.agents.env_calls.checked_reward`), never a NaN in the
scores; so is an exception the reward method raises. An environment that cannot be made (its ``__init__`` raised)
or cannot start an episode (``reset`` raised or returned no prompt) stops the run with a
:class:`rlalign.agents.env_calls.EnvironmentFailed` naming the class, the method and the prompt.

Tool errors never reach the trainer: an unknown tool, arguments that do not fit the signature, an
exception in the tool become the text of the tool message ("error: ..."), which the policy reads.
A string argument of a parameter typed otherwise in the tool's schema is cast first (``"3"`` for
``a: int`` is 3), as transformers' response parser types the calls TRL's GRPOTrainer runs.

:class:`EnvRunner` runs the methods of one environment on an event loop shared by a batch of
episodes: ``async`` methods as coroutines, plain ones in the loop's thread pool, so the episodes of a
batch wait for their tools together. A time limit is the caller's (:mod:`.episodes`); a plain method
that runs past it keeps running in its thread (Python cannot stop a thread) while its episode ends.

Tools as plain functions (no environment object): :class:`FunctionTools` (``reset`` returns the
record's ``prompt``; the episode ends at the final answer; rewards come from the reward functions).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from rlalign.agents.env_calls import call_on_loop, called_reward, failure
from rlalign.agents.tool_calls import ToolCall, call_id, tool_message, tool_schemas, typed_arguments

__all__ = ["FunctionTools", "EnvRunner", "environment_factory", "load_object", "new_runner"]

Message = dict[str, Any]


def load_object(spec: str) -> Any:
    """The object ``module:attribute`` names, the current directory importable (as ``python -m`` makes it).

    Raises:
        ValueError: a spec without ":", or one that cannot be imported (the cause in the message).
    """
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected module:attribute, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the `rlalign` script, unlike `python -m`, lacks the current directory
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{spec!r} cannot be imported: {err}") from None
    return obj


def environment_factory(env: str | type | Callable[[], Any] | Mapping[str, Callable[[], Any]]) -> Callable[[], Any]:
    """A maker of fresh environments from ``module:Class``, a class, or a zero-argument callable (what it makes
    may speak TRL's protocol: :class:`EnvRunner` wraps it). A dict ``{name: factory}`` (or ``module:attribute``
    naming one) is TRL's multi-environment form: the record's ``environment`` column picks the factory."""
    from rlalign.agents.trl_environment import TRLEnvironment  # it builds on this module

    obj = load_object(env) if isinstance(env, str) else env
    if isinstance(obj, Mapping):
        bad = [name for name, factory in obj.items() if not callable(factory)]
        if not obj or bad:
            raise ValueError(f"environment dict {env!r:.80}: expected {{name: class or zero-argument callable}}" + (f"; {bad[0]!r} is not callable" if bad else ""))
        return functools.partial(TRLEnvironment, factories=dict(obj))
    if not callable(obj):
        raise ValueError(f"environment {env!r} is not a class or a callable")
    return obj


def new_runner(make_env: Callable[[], Any], max_result_chars: int = 1000) -> EnvRunner:
    """An :class:`EnvRunner` of a fresh environment from ``make_env``.

    Raises:
        EnvironmentFailed: ``make_env`` raised, or what it made is no environment (names the maker).
    """
    try:
        return EnvRunner(make_env(), max_result_chars)
    except Exception as err:
        raise failure(err, f"environment {_maker_name(make_env):.120}") from err


def _maker_name(make_env: Any) -> str:
    """What made the environments: a class's or function's name (through a ``functools.partial`` of it)."""
    while isinstance(make_env, functools.partial):
        make_env = make_env.args[0] if make_env.args and callable(make_env.args[0]) else make_env.func
    return getattr(make_env, "__qualname__", None) or repr(make_env)


class FunctionTools:
    """An environment of plain tool functions (typed, with docstrings): ``reset`` gives the record's
    ``prompt``; no reward of its own."""

    def __init__(self, functions: Sequence[Callable]):
        self.functions = {f.__name__: f for f in functions}
        self.tools = list(self.functions)

    def reset(self, record: Mapping[str, Any]) -> str | list[Message]:
        return record["prompt"]

    def __getattr__(self, name: str):
        functions = self.__dict__.get("functions", {})
        if name in functions:
            return functions[name]
        raise AttributeError(name)


class EnvRunner:
    """Drives one environment object through an episode (all methods are coroutines); a TRL-style one is wrapped
    (:func:`rlalign.agents.trl_environment.adapt`: ``env`` is then the wrapper, its ``env`` the object given)."""

    def __init__(self, env: Any, max_result_chars: int = 1000):
        from rlalign.agents.trl_environment import adapt  # it builds on this module

        self.env, self.max_result_chars = adapt(env), max_result_chars
        self.prompt: Any = None  # the record's prompt (what a reward error names)
        self.has_step = callable(getattr(env, "step", None))
        self._bind_tools()

    @property
    def given(self) -> Any:
        """The environment object as given (a TRL-style one unwrapped): what TRL's reward functions get in ``environments``."""
        from rlalign.agents.trl_environment import TRLEnvironment

        return self.env.env if isinstance(self.env, TRLEnvironment) else self.env

    def _bind_tools(self) -> None:
        """The tools: the environment's ``tool_functions``, or its methods its ``tools`` list names."""
        env = self.env
        self._typed: dict[str, Mapping[str, Any]] = {}  # each tool's schema, read once to type its string arguments
        self.tools: dict[str, Callable] = {}
        given = getattr(env, "tool_functions", None)
        if given is not None:
            self.tools = dict(given)
            return
        for name in list(getattr(env, "tools", []) or []):
            fn = getattr(env, name, None)
            if not callable(fn):
                raise ValueError(f"environment {type(env).__name__}: tool {name!r} is not a method")
            self.tools[name] = fn
        if not self.tools and not self.has_step:
            raise ValueError(f"environment {type(env).__name__} has neither tools (a 'tools' list of method names) nor a step(calls) method "
                             "(nor TRL's reset(**row), whose public methods are the tools)")

    @property
    def schema_key(self) -> tuple:
        """What the tools' schemas depend on (runners with equal keys show the same schemas): the class and the tools' functions."""
        return type(self.env), tuple((name, getattr(fn, "__func__", fn)) for name, fn in self.tools.items())

    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas of the tools (the environment's ``tool_schemas`` when it has a step function)."""
        given = getattr(self.env, "tool_schemas", None)
        if given is not None:
            return list(given() if callable(given) else given)
        return tool_schemas(list(self.tools.values()))

    def _schema(self, name: str, fn: Callable) -> Mapping[str, Any]:
        """Tool ``name``'s JSON schema, {} when it has none to give (its string arguments are then passed as written)."""
        if name not in self._typed:
            try:
                self._typed[name] = tool_schemas([fn])[0]
            except ValueError:
                self._typed[name] = {}
        return self._typed[name]

    @property
    def name(self) -> str:
        """The environment's class as its messages name it (the given one's; a dict of factories before its first reset: their names)."""
        given = self.given
        return repr(self.env) if given is None else type(given).__name__

    async def reset(self, record: Mapping[str, Any]) -> str | list[Message]:
        """The episode's prompt.

        Raises:
            EnvironmentFailed: ``reset`` raised, or returned no prompt (names the class and the record's prompt).
        """
        self.prompt = record.get("prompt") if isinstance(record, Mapping) else None
        try:
            prompt = await call_on_loop(self.env.reset, record)
            if getattr(self.env, "tool_functions", None) is not None:
                self._bind_tools()  # chosen at reset (TRL's environments by the record's environment column)
        except Exception as err:
            raise failure(err, f"environment {self.name}.reset", self.prompt) from err
        self.prompt = record.get("prompt", prompt) if isinstance(record, Mapping) else prompt
        if not isinstance(prompt, (str, list)) or not prompt:
            raise failure(ValueError(f"returned {prompt!r:.80}; expected a non-empty text or list of messages"), f"environment {self.name}.reset", self.prompt)
        return prompt

    async def respond(self, calls: Sequence[ToolCall], row: int = 0, turn: int = 0) -> list[Message]:
        """The tool messages answering ``calls`` (ids given to calls without one), in order."""
        calls = [c if c.id else replace(c, id=call_id(row, turn, i)) for i, c in enumerate(calls)]
        if self.has_step and not self.tools:
            try:
                out = await call_on_loop(self.env.step, list(calls))
            except Exception as err:  # as a tool's: the policy's observation
                out = f"error: {type(err).__name__}: {err}"
            messages = [{"role": "tool", "content": out}] if isinstance(out, str) else list(out)
            cut = self.max_result_chars  # as a tool's result is cut
            return [{**m, "content": m["content"][:cut]} if isinstance(m, Mapping) and isinstance(m.get("content"), str) else m for m in messages]
        return [tool_message(c, await self._run(c)) for c in calls]

    async def _run(self, call: ToolCall) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"
        arguments = call.arguments
        if isinstance(arguments, str):  # tag format: a plain string for the tool's only parameter
            params = list(inspect.signature(fn).parameters)
            if len(params) != 1:
                return f"error: {call.name} takes {len(params)} arguments; write them as a JSON object"
            arguments = {params[0]: arguments}
        if any(isinstance(value, str) for value in arguments.values()):  # "3" for an int parameter is 3, as TRL's calls are typed
            arguments = typed_arguments(arguments, self._schema(call.name, fn))
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as err:
            return f"error: bad arguments for {call.name}: {err}"
        try:
            result = await call_on_loop(fn, **arguments)
        except Exception as err:  # a tool failing is the policy's observation, not the trainer's crash
            return f"error: {type(err).__name__}: {err}"
        text = result if isinstance(result, str) else str(result)
        return text[: self.max_result_chars]

    async def reward(self, answer: str) -> float | None:
        fn = getattr(self.env, "reward", None)
        if not callable(fn):
            return None
        return await called_reward(fn, f"environment {type(self.env).__name__}.reward", self.prompt, answer)

    @property
    def done(self) -> bool:
        return bool(getattr(self.env, "done", False))
