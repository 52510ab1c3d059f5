"""Tool calling through the chat template: tool schemas, the call formats of the common model
families and their parsers, and tool-result messages.

    schemas = tool_schemas([lookup, {"type": "function", "function": {...}}])   # functions -> JSON schemas
    fmt = call_format("auto", tokenizer)                  # picked from the chat template
    text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    calls = fmt.parse(assistant_text)                     # [ToolCall(name, arguments, id, error)]
    messages.append(tool_message(call, "weight=31 price=12"))   # role "tool", rendered by the template

Tools take JSON arguments (a dict). A function's schema comes from its typed signature and its
Google-style docstring (transformers' ``get_json_schema``); a dict is taken as a schema as is.

Formats (what the assistant writes; :data:`FORMATS`):

========  ==================================================================  ==========================================
name      a call in the assistant's text                                      templates it is picked for ("auto")
========  ==================================================================  ==========================================
hermes    ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``, any      Hermes 2/3, Qwen2.5, Qwen3 (template
          number of them                                                      mentions ``<tool_call>``)
llama3    the whole turn is ``{"name": N, "parameters": {...}}`` (or           Llama 3.1 / 3.2 / 3.3 (template mentions
          ``"arguments"``), optionally after ``<|python_tag|>``; several       ``<|python_tag|>`` or ``<|eom_id|>``)
          separated by ``;``
mistral   ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`` (v3), or      Mistral 7B v0.3, Nemo, Small (template
          ``[TOOL_CALLS]N[ARGS]{...}`` (v11+)                                   mentions ``[TOOL_CALLS]``)
tags      ``<tool>N: ARGUMENT</tool>``; ARGUMENT a JSON object, or a plain     any template without tools, and text
          string given to the tool's only parameter                           prompts
========  ==================================================================  ==========================================

A turn with no call is the final answer. A malformed call (broken JSON, no name, an opening tag
without its closing tag, arguments that are not an object) is a :class:`ToolCall` with ``error``
set: the environment answers it with an error message the policy sees, and it is counted
(``agents/malformed_calls``); it never raises and never passes silently.

:func:`parsed_turn` and :func:`parsed_reply` write a turn and a tool reply as TRL's GRPOTrainer hands
them to reward functions (its ``parse_response`` of the turn, its tool message).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ToolCall", "CallFormat", "call_id", "HERMES", "LLAMA3", "MISTRAL", "TAGS", "FORMATS", "call_format", "tool_schemas", "typed_arguments", "tool_message", "format_of_template",
    "call_free_text", "parsed_turn", "parsed_reply",
]

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its JSON arguments, an id (for the tool message), or the parse ``error``.
    ``arguments`` is a dict, or a string (tag format) for the tool's only parameter."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str = ""
    error: str | None = None


def _bad(error: str, name: str = "") -> ToolCall:
    return ToolCall(name, {}, "", f"malformed tool call: {error}")


def _call_of(obj: Any, argument_keys: Sequence[str] = ("arguments",)) -> ToolCall:
    """A ToolCall from a decoded JSON call ``{"name": ..., <argument key>: {...}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return _bad('expected a JSON object {"name": ..., "arguments": {...}}')
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return _bad(f"the arguments of {obj['name']!r} are not JSON", obj["name"])
    if not isinstance(arguments, dict):
        return _bad(f"the arguments of {obj['name']!r} must be a JSON object, got {type(arguments).__name__}", obj["name"])
    return ToolCall(obj["name"], arguments, str(obj.get("id", "")))


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except ValueError as err:
        return None, f"not JSON ({err})"


@dataclass(frozen=True)
class CallFormat:
    """A family's call syntax: ``parse(text)`` gives the calls of an assistant turn (special tokens kept
    in ``text``); ``open`` marks a call's start, ``result_open`` / ``result_close`` write a tool result
    into a text prompt (for conversations without a chat template)."""

    name: str
    open: str
    close: str  # "" when the call runs to the end of the turn
    result_open: str
    result_close: str
    parser: Callable[[str], list[ToolCall]]

    def parse(self, text: str) -> list[ToolCall]:
        return self.parser(text)

    def render_result(self, content: str) -> str:
        return f"{self.result_open}{content}{self.result_close}"


def _between_tags(text: str, open_: str, close: str, body: Callable[[str], ToolCall]) -> list[ToolCall]:
    calls, start = [], 0
    while (i := text.find(open_, start)) != -1:
        j = text.find(close, i + len(open_))
        if j == -1:
            calls.append(_bad(f"{open_} without {close}"))
            break
        calls.append(body(text[i + len(open_) : j]))
        start = j + len(close)
    return calls


def _hermes_body(body: str) -> ToolCall:
    obj, error = _loads(body.strip())
    return _bad(error) if error else _call_of(obj)


def _parse_hermes(text: str) -> list[ToolCall]:
    return _between_tags(text, "<tool_call>", "</tool_call>", _hermes_body)


def _parse_llama3(text: str) -> list[ToolCall]:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    for end in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(end).strip()
    if not tagged and not body.startswith("{"):
        return []  # plain text: the final answer
    obj, error = _loads(body)
    if error is None:
        return [_call_of(obj, ("parameters", "arguments"))]
    parts = [p for p in body.split(";") if p.strip()]
    if len(parts) > 1:  # several calls, "; "-separated
        calls = []
        for part in parts:
            obj, error = _loads(part.strip())
            calls.append(_bad(error) if error else _call_of(obj, ("parameters", "arguments")))
        return calls
    return [_bad(error)]


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")


def _parse_mistral(text: str) -> list[ToolCall]:
    if "[TOOL_CALLS]" not in text:
        return []
    calls: list[ToolCall] = []
    for chunk in text.split("[TOOL_CALLS]")[1:]:
        chunk = chunk.strip().removesuffix("</s>").strip()
        named = _MISTRAL_NAMED.match(chunk)
        if named:  # v11+: NAME[ARGS]{...}
            obj, error = _loads(chunk[named.end() :].strip())
            calls.append(_bad(error, named.group(1)) if error else _call_of({"name": named.group(1), "arguments": obj}))
            continue
        obj, error = _loads(chunk)
        if error:
            calls.append(_bad(error))
        elif isinstance(obj, list) and obj:
            calls.extend(_call_of(o) for o in obj)
        else:
            calls.append(_call_of(obj))
    return calls


def _tag_body(body: str) -> ToolCall:
    name, sep, argument = body.partition(":")
    if not sep or not name.strip():
        return _bad(f"{body[:80]!r}: expected NAME: ARGUMENT")
    argument = argument.strip()
    if argument.startswith("{"):
        obj, error = _loads(argument)
        if error:
            return _bad(f"the arguments of {name.strip()!r} are {error}", name.strip())
        return ToolCall(name.strip(), obj) if isinstance(obj, dict) else _bad("arguments must be a JSON object", name.strip())
    return ToolCall(name.strip(), argument)


def _parse_tags(text: str) -> list[ToolCall]:
    return _between_tags(text, "<tool>", "</tool>", _tag_body)


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", _parse_hermes)
LLAMA3 = CallFormat("llama3", "<|python_tag|>", "", "", "", _parse_llama3)
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", "", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", _parse_mistral)
TAGS = CallFormat("tags", "<tool>", "</tool>", "<result>", "</result>", _parse_tags)
FORMATS: dict[str, CallFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, TAGS)}


def format_of_template(template: str | None) -> CallFormat:
    """The format a chat template writes calls in (see the module's table); tags when it has none."""
    template = str(template or "")
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return LLAMA3
    return TAGS


def call_format(name: str, tokenizer=None) -> CallFormat:
    """The format ``name``, or with "auto" the one of ``tokenizer``'s chat template.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return format_of_template(getattr(tokenizer, "chat_template", None))
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; expected auto or one of {sorted(FORMATS)}")
    return FORMATS[name]


def tool_schemas(tools: Sequence[Callable | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """JSON schemas (OpenAI's ``{"type": "function", "function": {...}}``) of ``tools``: a function's
    from its type hints and docstring (``transformers.utils.get_json_schema``), a dict as is.

    Raises:
        ValueError: a function whose signature or docstring cannot be described (names the function).
    """
    from transformers.utils import get_json_schema

    out = []
    for tool in tools:
        if isinstance(tool, Mapping):
            out.append(dict(tool))
            continue
        try:
            out.append(get_json_schema(tool))
        except Exception as err:  # transformers raises its own TypeHintParsingException / DocstringParsingException
            raise ValueError(f"tool {getattr(tool, '__name__', tool)!r} needs type hints and a docstring with an Args section: {err}") from None
    return out


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, ``anyOf`` / ``oneOf``, ``nullable``)."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    types += [t for key in ("anyOf", "oneOf") for choice in schema.get(key) or [] for t in _schema_types(choice)]
    return types + ["null"] if schema.get("nullable") and "null" not in types else types


def _cast(raw: str, types: Sequence[str]) -> Any:
    for name in types:
        try:
            if name == "integer":
                try:
                    return int(raw)
                except ValueError:  # a whole number written as a float ("3.0") is an integer too
                    number = float(raw)
                    if number.is_integer():
                        return int(number)
            elif name == "number":
                number = float(raw)
                if math.isfinite(number):
                    return int(number) if number.is_integer() and "." not in raw else number
            elif name == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif name == "null" and raw.strip() in ("null", "None"):
                return None
            elif name in ("object", "array"):
                value = json.loads(raw)
                if isinstance(value, dict if name == "object" else list):
                    return value
        except (ValueError, OverflowError):
            continue
    return raw


def typed_arguments(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` with each string cast to its parameter's type in the tool's JSON ``schema`` (integer,
    number, boolean, null, object, array), as transformers' response parser types the calls TRL's
    GRPOTrainer runs (``{"a": "3"}`` -> ``{"a": 3}`` for ``a: int``); a string parameter, a parameter the
    schema does not list and a cast that fails keep the text."""
    properties = schema.get("function", schema).get("parameters", {}).get("properties", {})
    return {key: _cast(value, _schema_types(properties.get(key))) if isinstance(value, str) else value for key, value in arguments.items()}


def call_id(row: int, turn: int, index: int) -> str:
    """A 9-character alphanumeric id (the length Mistral's templates require)."""
    return f"c{row:04d}{turn:02d}{index:02d}"[:9].ljust(9, "0")


def tool_message(call: ToolCall, content: str) -> Message:
    """The ``role: tool`` message answering ``call`` (name and id included: templates that show them read them)."""
    message: Message = {"role": "tool", "name": call.name or "unknown", "content": content}
    if call.id:
        message["tool_call_id"] = call.id
    return message


def call_free_text(fmt: CallFormat, text: str) -> str:
    """``text`` (an assistant turn with calls) without the calls' markup: the text around ``open ... close``
    blocks; in the formats whose calls run to the end of the turn, the text before the first call."""
    if fmt.close:
        return re.sub(re.escape(fmt.open) + ".*?" + re.escape(fmt.close), "", text, flags=re.DOTALL)
    return text.partition(fmt.open)[0] if fmt.open in text else ""  # llama3 without <|python_tag|>: the whole turn is the call


def parsed_turn(text: str, plain: str, calls: Sequence[ToolCall], fmt: CallFormat, schemas: Sequence[Mapping[str, Any]] | None = None,
                special_tokens: Sequence[str] = ()) -> Message:
    """An assistant turn as TRL's ``parse_response`` gives it: ``{"role": "assistant", "content": ..., "tool_calls":
    [{"type": "function", "function": {"name": N, "arguments": {...}}}]}``, no ``tool_calls`` key without calls.

    Args:
        text: the turn as sampled, special tokens kept (what ``calls`` were parsed from).
        plain: the turn's text with special tokens dropped: the content of a turn without calls, or with a
            malformed one (parse_response's fallback, its markup kept; its well-formed calls are still listed).
        calls: ``fmt.parse(text)``; the arguments typed by the tool's schema in ``schemas`` (as the environment ran them).
        special_tokens: dropped from the text outside the calls (``tokenizer.all_special_tokens``).
    """
    good = [c for c in calls if c.error is None]
    content = plain
    if good and len(good) == len(calls):  # the text outside the markup, trimmed, as parse_response gives it
        content = call_free_text(fmt, text)
        for token in special_tokens:
            content = content.replace(token, "")
        content = content.strip()
    message: Message = {"role": "assistant", "content": content}
    if good:
        by_name = {s.get("function", s).get("name"): s for s in schemas or []}

        def arguments(call: ToolCall) -> dict[str, Any] | str:
            typed = isinstance(call.arguments, dict) and call.name in by_name
            return typed_arguments(call.arguments, by_name[call.name]) if typed else call.arguments

        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": arguments(c)}} for c in good]
    return message


def parsed_reply(message: Message) -> Message:
    """A tool reply as TRL gives it to reward functions, ``{"role": "tool", "name": N, "content": ...}`` (no call id);
    a message of another role (an environment's ``step`` may answer with any) as it is."""
    if message.get("role") != "tool":
        return dict(message)
    return {"role": "tool", **({"name": message["name"]} if "name" in message else {}), "content": message.get("content")}
