"""Tools for multi-turn rollouts: the tool-call formats, their parser, a registry, two built-in
tools and the environment protocol the GRPO rollout drives (:mod:`rlalign.train.tool_rollout`).

    registry = ToolRegistry.builtin(["calculator"])
    registry.register_tool("upper", lambda text: text.upper())     # any Python function of one string
    env = ToolEnvironment(registry, TAG, max_turns=3)
    prompt = env.reset({"prompt": "37*48="})                       # the first messages (here the text)
    messages, done, reward = env.step("<tool>calculator: 37*48</tool>")
    # -> [{"role": "tool", "name": "calculator", "content": "1776"}], False, None

Formats. A call sits between an opening and a closing tag in the assistant's text; text around it
is kept as is. A turn ends at EOS (the final answer) or right after a closing tag (the tool runs,
its result is appended, sampling continues).

- ``tag`` (:data:`TAG`): ``<tool>NAME: ARGUMENT</tool>``, the argument a plain string handed to the
  tool (``<tool>calculator: 12*(3+4)</tool>``); a result comes back as ``<result>TEXT</result>``.
  Short enough for a character-level model.
- ``hermes`` (:data:`HERMES`): the JSON call of the Hermes / Qwen2.5 chat templates,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>``; the argument
  is the single value of ``arguments`` (or ``arguments`` itself when it is a string), and a result
  comes back as ``<tool_response>TEXT</tool_response>`` (what those templates write for a tool message).
  :func:`format_for` picks it when the tokenizer's chat template mentions ``<tool_call>``.

Deliberate simplifications: a tool takes one string argument; tool messages are rendered by the
format's result tags as text inside the completion, not by re-rendering the chat template; a
malformed call is not raised but answered with an error message (the policy sees its mistake).

Tools never raise into the trainer: an exception, a bad expression or a timeout becomes the text of
the tool message (``error: ...``).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlalign.lm.sandbox import Sandbox, SandboxLimits

__all__ = [
    "ToolFormat", "TAG", "HERMES", "FORMATS", "format_for", "ToolCall", "parse_tool_calls", "ToolRegistry", "calculator", "python_tool",
    "Environment", "ToolEnvironment", "render_observation",
]

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolFormat:
    """Where a call starts and ends in the assistant's text, and how a tool result is written back."""

    name: str
    open: str  # e.g. "<tool>"
    close: str  # e.g. "</tool>"; a turn stops right after it
    result_open: str
    result_close: str
    json_body: bool  # the call's body is JSON {"name", "arguments"} rather than "NAME: ARGUMENT"

    def render_result(self, content: str) -> str:
        return f"{self.result_open}{content}{self.result_close}"


TAG = ToolFormat("tag", "<tool>", "</tool>", "<result>", "</result>", json_body=False)
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", json_body=True)
FORMATS = {f.name: f for f in (TAG, HERMES)}


def format_for(name: str, tokenizer=None) -> ToolFormat:
    """The format ``name`` ("tag", "hermes"), or with "auto" the chat template's own (hermes when the
    tokenizer's chat template mentions ``<tool_call>``, else tag)."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None) or ""
        return HERMES if HERMES.open in str(template) else TAG
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {sorted(FORMATS)} or 'auto'")
    return FORMATS[name]


@dataclass(frozen=True)
class ToolCall:
    """One call found in the text: a tool name and its string argument, or the parse ``error``."""

    name: str
    argument: str
    error: str | None = None


def _parse_body(body: str, fmt: ToolFormat) -> ToolCall:
    if not fmt.json_body:
        name, sep, argument = body.partition(":")
        if not sep or not name.strip():
            return ToolCall(name.strip(), "", f"malformed tool call {body[:80]!r}: expected NAME: ARGUMENT")
        return ToolCall(name.strip(), argument.strip())
    try:
        call = json.loads(body)
    except ValueError as err:
        return ToolCall("", "", f"malformed tool call: not JSON ({err})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", "", 'malformed tool call: expected {"name": ..., "arguments": ...}')
    arguments = call.get("arguments", "")
    if isinstance(arguments, dict):
        if len(arguments) != 1:
            return ToolCall(call["name"], "", f"malformed tool call: a tool takes one argument, got {len(arguments)}")
        arguments = next(iter(arguments.values()))
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def parse_tool_calls(text: str, fmt: ToolFormat = TAG) -> list[ToolCall]:
    """Every call in ``text``, in order. An opening tag without its closing tag is one malformed call
    (its ``error`` set); text outside the tags is ignored."""
    calls, start = [], 0
    while (i := text.find(fmt.open, start)) != -1:
        j = text.find(fmt.close, i + len(fmt.open))
        if j == -1:
            calls.append(ToolCall("", "", f"malformed tool call: {fmt.open} without {fmt.close}"))
            break
        calls.append(_parse_body(text[i + len(fmt.open) : j], fmt))
        start = j + len(fmt.close)
    return calls


# ----------------------------------------------------------------------------------------------
# Built-in tools
# ----------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000  # the calculator's largest number, in decimal digits


def _log10(x: int | float) -> float:
    return math.log10(abs(x)) if x else 0.0


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and _log10(left) * abs(right) >= MAX_DIGITS:  # checked before computing
            raise ValueError(f"result too large (over {MAX_DIGITS} digits)")
        if isinstance(node.op, ast.Mult) and _log10(left) + _log10(right) >= MAX_DIGITS:
            raise ValueError(f"result too large (over {MAX_DIGITS} digits)")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("complex result")
        return value
    raise ValueError(f"unsupported expression: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Arithmetic on integer and decimal literals: + - * / // % ** and parentheses, evaluated on the
    syntax tree (no name, call or attribute is ever evaluated); numbers above :data:`MAX_DIGITS`
    digits are refused before they are computed. Integers stay exact ("123456789*987654321" ->
    "121932631112635269"). Errors come back as "error: ..."."""
    if len(expression) > 10 * MAX_DIGITS:
        return "error: expression too long"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError) as err:
        return f"error: {err.msg if isinstance(err, SyntaxError) else err}"
    return str(value)


def python_tool(timeout_s: float = 5.0, memory_mb: int = 256, allow_weak_sandbox: bool = False, max_output: int = 2000) -> Callable[[str], str]:
    """A tool that runs its argument as a Python program in :class:`rlalign.lm.sandbox.Sandbox` and
    returns its stdout (the last ``max_output`` characters), or its stderr's last line when it fails.

    Raises:
        SandboxUnavailable: at construction, when the machine cannot isolate and the weak mode is not allowed.
    """
    sandbox = Sandbox(SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb), allow_weak=allow_weak_sandbox)

    def python(code: str) -> str:
        result = sandbox.run({"main.py": code}, ["main.py"])
        if result.timed_out:
            return f"error: timed out after {timeout_s:g} s"
        stdout = result.stdout.decode(errors="replace")[-max_output:]
        if result.exit_code != 0:
            lines = result.stderr.decode(errors="replace").strip().splitlines()
            return f"error: {lines[-1] if lines else f'exit code {result.exit_code}'}"
        return stdout.rstrip("\n")

    return python


@dataclass
class ToolRegistry:
    """Named tools, each a function of one string returning a string (anything else is ``str()``-ed)."""

    tools: dict[str, Callable[[str], Any]] = field(default_factory=dict)

    def register_tool(self, name: str, fn: Callable[[str], Any]) -> ToolRegistry:
        if not callable(fn):
            raise TypeError(f"tool {name!r} is not callable")
        self.tools[name] = fn
        return self

    @classmethod
    def builtin(cls, names: Sequence[str], allow_weak_sandbox: bool = False) -> ToolRegistry:
        """The built-in tools ``names`` ("calculator", "python")."""
        makers: Mapping[str, Callable[[], Callable[[str], Any]]] = {
            "calculator": lambda: calculator, "python": lambda: python_tool(allow_weak_sandbox=allow_weak_sandbox)}
        registry = cls()
        for name in names:
            if name not in makers:
                raise ValueError(f"unknown built-in tool {name!r}; expected one of {sorted(makers)}")
            registry.register_tool(name, makers[name]())
        return registry

    def call(self, call: ToolCall, max_chars: int = 500) -> str:
        """The result text of ``call``, at most ``max_chars`` characters; never raises."""
        if call.error is not None:
            return f"error: {call.error}"
        if call.name not in self.tools:
            return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"
        try:
            text = str(self.tools[call.name](call.argument))
        except Exception as err:  # a user's tool failing is the policy's observation, not the trainer's crash
            text = f"error: {type(err).__name__}: {err}"
        return text[:max_chars]


# ----------------------------------------------------------------------------------------------
# Environments
# ----------------------------------------------------------------------------------------------


class Environment(Protocol):
    """One episode per row. ``reset`` gives the first messages: the record's prompt, a text or a list
    of chat messages; ``step`` takes the assistant's turn and returns (new messages: tool or
    observation messages, done, reward or None when the reward functions score the final answer)."""

    def reset(self, record: Mapping[str, Any]) -> str | list[Message]: ...

    def step(self, assistant_text: str) -> tuple[list[Message], bool, float | None]: ...


class ToolEnvironment:
    """Runs the tool calls of each assistant turn; the episode ends when a turn has no call (the final
    answer) or after ``max_turns`` assistant turns (the last turn's calls are not run)."""

    def __init__(self, registry: ToolRegistry, fmt: ToolFormat = TAG, max_turns: int = 3, max_result_chars: int = 500):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.registry, self.fmt, self.max_turns, self.max_result_chars = registry, fmt, max_turns, max_result_chars
        self.turns = 0

    def reset(self, record: Mapping[str, Any]) -> str | list[Message]:
        self.turns = 0
        return record["prompt"]

    def step(self, assistant_text: str) -> tuple[list[Message], bool, float | None]:
        self.turns += 1
        calls = parse_tool_calls(assistant_text, self.fmt)
        if not calls or self.turns >= self.max_turns:
            return [], True, None
        return [{"role": "tool", "name": c.name, "content": self.registry.call(c, self.max_result_chars)} for c in calls], False, None


def render_observation(messages: Sequence[Message], fmt: ToolFormat) -> str:
    """The text appended to the completion for an environment's messages: a tool message in the
    format's result tags, any other message's content as is."""
    return "".join(fmt.render_result(m["content"]) if m.get("role") == "tool" else str(m["content"]) for m in messages)
