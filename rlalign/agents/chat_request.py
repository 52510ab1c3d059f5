"""The body of a ``/chat/completions`` request to the policy endpoint (:mod:`rlalign.agents.openai_server`),
checked field by field.

    request = parse_chat_request(body)     # ChatRequest, or RequestError naming the field (HTTP 400)

Every field of a body falls in one of four classes, and the class decides what happens to it (an
option that cannot act is an error, never ignored; a field whose value is null counts as left out):

- honoured: ``model`` (any name, echoed), ``messages``, ``tools``, ``tool_choice`` (``"auto"``, the
  default, and ``"none"``: the reply is not parsed for calls), ``n``, ``temperature`` / ``top_p`` /
  ``top_k`` (at the run's values: the server checks them), ``max_tokens`` (or ``max_completion_tokens``),
  ``stop``, ``logprobs`` (the sampled tokens' log-probs, where the server has the model's own: the
  server checks) and ``chat_template_kwargs`` (variables of the chat template: the server checks);
- taken at a neutral value only, any other value refused (:data:`NEUTRAL_ONLY`, with the reason):
  ``stream`` false, ``parallel_tool_calls`` true, ``response_format`` ``{"type": "text"}``,
  ``top_logprobs`` 0, ``frequency_penalty`` / ``presence_penalty`` / ``min_p`` 0,
  ``repetition_penalty`` 1, ``logit_bias`` ``{}``, vLLM's ``min_tokens`` 0, ``ignore_eos`` false and
  ``stop_token_ids`` ``[]``, ``store`` false;
- accepted without effect (:data:`WITHOUT_EFFECT`): ``user``, ``metadata``, ``safety_identifier``,
  ``prompt_cache_key``: they label a request or hint a cache and never change its completion;
- anything else is refused, ``seed``, ``functions`` and ``function_call`` among them
  (:data:`REFUSED` gives their reasons).

``tool_choice`` ``"required"`` or a named function, ``parallel_tool_calls: false`` and a JSON
``response_format`` are constraints OpenAI keeps while decoding; the sampler does not constrain its
draws, so it cannot keep them, and serving such a request as if it had would be a silent wrong result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestError", "ChatRequest", "parse_chat_request", "check_template_kwargs", "HONOURED", "NEUTRAL_ONLY", "WITHOUT_EFFECT", "REFUSED", "LENIENT"]


class RequestError(ValueError):
    """A request the endpoint cannot serve; ``param`` names the field, ``status`` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class ChatRequest:
    """A parsed ``/chat/completions`` body."""

    messages: list[dict]
    tools: list[dict] | None
    n: int
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: list[str]
    model: str
    top_k: int | None = None  # -1 and 0: off
    tool_choice: str = "auto"  # "none": the reply is content, never parsed for calls
    logprobs: bool = False  # return the sampled tokens' log-probs
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs: extra variables of the chat template


HONOURED = (
    "model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop", "logprobs",
    "chat_template_kwargs",
)
WITHOUT_EFFECT = ("user", "metadata", "safety_identifier", "prompt_cache_key")  # labels and cache hints: never change a completion

_SAMPLED_AS_TRAINED = "the sampler does not have it (the policy is sampled as it is trained)"
_UNCONSTRAINED = "the sampler does not constrain its draws"
NEUTRAL_ONLY: dict[str, tuple[Any, str]] = {  # field: (its neutral value, why no other is served)
    "stream": (False, "replies are sent whole, never streamed"),
    "parallel_tool_calls": (True, f"{_UNCONSTRAINED}, so it cannot promise at most one call, and keeping the first of several would drop the "
                                  "others unseen; leave it out and have the agent run the calls it wants (message.tool_calls[:1])"),
    "response_format": ({"type": "text"}, f"{_UNCONSTRAINED}, so the reply cannot be promised to be JSON"),
    "top_logprobs": (0, "the sampler keeps the log-prob of the sampled token only"),
    "frequency_penalty": (0, _SAMPLED_AS_TRAINED), "presence_penalty": (0, _SAMPLED_AS_TRAINED), "min_p": (0, _SAMPLED_AS_TRAINED),
    "repetition_penalty": (1, _SAMPLED_AS_TRAINED), "logit_bias": ({}, _SAMPLED_AS_TRAINED),
    "min_tokens": (0, "the sampler cannot hold back the end of a turn"), "ignore_eos": (False, "the sampler cannot hold back the end of a turn"),
    "stop_token_ids": ([], "the sampler stops at the model's own end-of-turn tokens only; give stop strings in stop"),
    "store": (False, "the endpoint keeps no completions to be fetched later"),
}
REFUSED: dict[str, str] = {  # fields a client may well send, and why they are refused
    "seed": "a call's draws are the server's (from the run's seed, the episode and the call's index; on the unrecorded /v1, fresh ones), "
            "so a request's seed cannot act; leave it out",
    "functions": "the legacy function-calling fields are not served; give the functions as tools=[{type: function, function: ...}]",
    "function_call": "the legacy function-calling fields are not served; give tools, and leave tool_choice out",
}
_TEMPLATE_OWN = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message"})  # the renderer sets them


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, text parts joined, or "" for null."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise RequestError(f"{where}: expected text or a list of text parts, got {str(value)[:80]!r}", where)


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise RequestError(f"{where}: expected an object with a role in {', '.join(_ROLES)}, got {str(m)[:80]!r}", f"{where}.role")
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": _content(m.get("content"), f"{where}.content")}
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = []
        for j, call in enumerate(m["tool_calls"]):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where}.tool_calls[{j}]: expected {{type: function, function: {{name, arguments}}}}", f"{where}.tool_calls")
            arguments = fn.get("arguments", "{}")
            try:  # templates render the arguments as an object
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass
            calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{key}: expected a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{key}: expected an integer in [{low}, {high}], got {value!r}", key)
    return value


LENIENT = ("seed", "tool_choice")  # fields a run may choose to serve without their effect (AgentConfig.serve_without_effect)


def _check_fields(body: dict, lenient: frozenset[str]) -> None:
    """Every field with a value is honoured, neutral, or without effect (module docstring; ``lenient``: the run
    serves these without their effect too); else RequestError naming it."""
    for key, value in body.items():
        if value is None or key in HONOURED or key in WITHOUT_EFFECT or key in lenient:
            continue
        if key in NEUTRAL_ONLY:
            neutral, why = NEUTRAL_ONLY[key]
            if value != neutral:
                raise RequestError(f"{key}: not supported by this endpoint: {why}; leave it out or give {json.dumps(neutral)}, got {json.dumps(value)[:80]}", key)
            continue
        reason = REFUSED.get(key, "not a field this endpoint takes; it would be ignored, and a field that cannot act is refused")
        taken = ", ".join(HONOURED + WITHOUT_EFFECT) + " and " + ", ".join(NEUTRAL_ONLY) + " at their neutral values"
        raise RequestError(f"{key}: {reason} (the fields taken: {taken})", key)


def _tool_choice(body: dict, lenient: frozenset[str]) -> str:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if "tool_choice" in lenient:  # the run asked for it (agent.serve_without_effect): served as "auto"
        return "auto"
    raise RequestError(f'tool_choice: only "auto" (the default) and "none" are served: {_UNCONSTRAINED}, so it cannot promise that the reply calls '
                       f"a tool (\"required\") or a given one; got {json.dumps(choice)[:80]} (agent frameworks that always send it, such as "
                       "smolagents' ToolCallingAgent: set agent.serve_without_effect: [tool_choice] to serve it as \"auto\")", "tool_choice")


def _template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError(f"chat_template_kwargs: expected an object of template variables, got {json.dumps(kwargs)[:80]}", "chat_template_kwargs")
    return kwargs


def parse_chat_request(body: Any, lenient: frozenset[str] = frozenset()) -> ChatRequest:
    """The fields of a chat-completions body, checked (module docstring); ``lenient`` (of :data:`LENIENT`): fields
    the run serves without their effect, ``seed`` ignored and ``tool_choice`` "required" or named served as "auto".

    Raises:
        RequestError: naming the field that is missing, malformed, or not served.
    """
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object with 'model' and 'messages'")
    _check_fields(body, lenient)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: missing, or not a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"] for t in tools):
            raise RequestError("tools: expected a list of {type: function, function: {name, description, parameters}}", "tools")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop: expected a string or a list of up to 4 non-empty strings, got {body.get('stop')!r}", "stop")
    max_tokens, max_completion = _integer(body, "max_tokens", 1, 1 << 30), _integer(body, "max_completion_tokens", 1, 1 << 30)
    if None not in (max_tokens, max_completion) and max_tokens != max_completion:
        raise RequestError(f"max_completion_tokens: {max_completion} while max_tokens is {max_tokens}; give one of them", "max_completion_tokens")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(f"logprobs: expected true or false, got {json.dumps(logprobs)[:80]}", "logprobs")
    return ChatRequest(
        [_message(m, i) for i, m in enumerate(messages)], tools or None, _integer(body, "n", 1, 128) or 1,
        _number(body, "temperature", 0.0, 2.0), _number(body, "top_p", 0.0, 1.0), max_tokens or max_completion, stop, str(body.get("model") or "policy"),
        _integer(body, "top_k", -1, 1 << 30), _tool_choice(body, lenient), bool(logprobs), _template_kwargs(body),
    )


def check_template_kwargs(tokenizer, kwargs: dict[str, Any], tools: list[dict] | None) -> None:
    """Raises RequestError unless every key of ``chat_template_kwargs`` is a variable the chat template (the one
    ``apply_chat_template`` picks for ``tools``) reads, other than those the renderer sets itself: a key the
    template never reads could not act."""
    if not kwargs:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("chat_template_kwargs: the model has no chat template to pass them to", "chat_template_kwargs")
    import jinja2
    from jinja2 import meta

    read = meta.find_undeclared_variables(jinja2.Environment().parse(tokenizer.get_chat_template(None, tools)))
    for key in kwargs:
        if key in _TEMPLATE_OWN or key not in read:
            why = "set by the endpoint itself" if key in _TEMPLATE_OWN else "not a variable the chat template reads, so it could not act"
            raise RequestError(f"chat_template_kwargs: {key!r} is {why}; the template reads {', '.join(sorted(read - _TEMPLATE_OWN)) or 'none'}",
                               "chat_template_kwargs")
