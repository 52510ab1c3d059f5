"""The policy behind an OpenAI-compatible endpoint, recording every call token-exactly.

    server = PolicyServer(tokenizer, model_generate(model, tokenizer), max_new_tokens=64)
    with server:                                   # uvicorn on a background thread, 127.0.0.1, a free port
        server.open_episode("e0")
        client = openai.OpenAI(base_url=server.url("e0"), api_key="unused")
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        calls = server.close_episode("e0")         # [CallRecord]: prompt ids, completion ids, log-probs, per choice

Routes: ``POST {base}/chat/completions`` and ``GET {base}/models``, where ``{base}`` is ``/v1`` (calls
served, not recorded) or ``/episodes/{id}/v1`` (calls recorded under episode ``id``: the agent needs
no change beyond the base URL it is given).

A request takes ``messages`` (system / user / assistant, with ``tool_calls``, / tool; content as text
or text parts), ``tools`` (function JSON schemas), ``tool_choice`` (``"auto"``, or ``"none"``: the reply
is content, never parsed for calls), ``n``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` (or
``max_completion_tokens``), ``stop``, ``logprobs`` and ``chat_template_kwargs`` (variables the chat
template reads, such as ``enable_thinking``; any other key is refused); ``model`` is any name. Every
other field is refused with a 400 naming it, except those taken at a neutral value (``stream`` false,
``parallel_tool_calls`` true, ``response_format`` text, ``top_logprobs`` 0, the sampling options the
sampler lacks at their neutral values) and those without effect on a completion (``user``,
``metadata``, ``safety_identifier``, ``prompt_cache_key``): :mod:`rlalign.agents.chat_request` lists
them with the reason for each (``seed`` is refused: a call's draws are the server's, below). Its
prompt is the chat template's rendering of the messages with the tools (``add_generation_prompt``),
tokenised once; its completion is sampled by :func:`rlalign.lm.sampling.sample`. ``max_tokens`` is
capped at ``max_new_tokens`` (the run's ``sampling.max_new_tokens``); without it, that cap.

Sampling settings: the calls' log-probs are trained as the log-probs of the run's policy at the
run's ``sampling.temperature`` / ``top_p`` / ``top_k`` (log pi_old, the behaviour policy of the
importance weights), so the server samples at those (``temperature``, ``top_p``, ``top_k``) and a
request that asks for other values gets a 400 naming the field and the run's value; one that leaves
them out, or gives the run's values, is served (the ``openai`` client sends none unless asked). With
``sampling_from_requests`` (the evaluation's endpoint: nothing is trained) a request's values are
used and the server's are the defaults.

The reply is OpenAI's ``chat.completion`` object: a choice per sample with its message (content, and
``tool_calls`` parsed from the text when the request gave tools), ``finish_reason`` (``tool_calls``
when calls were parsed, ``stop`` at EOS or a stop string, ``length`` at ``max_tokens``), ``logprobs``
and ``usage``. With ``logprobs: true`` a choice's ``logprobs.content`` has one entry per completion
token (those of ``usage``: through the token that completed a stop string, the EOS included) with its
``token`` text, ``bytes`` (its UTF-8; null for a token whose text is not whole characters) and ``logprob``,
the sampler's log-prob of it: log softmax(z / tau)[y], which is the model's own log-prob (what OpenAI
and vLLM return) at temperature 1, and at 0 (greedy, recorded with tau = 1); at any other temperature
the server has only the tempered one, so ``logprobs`` is refused there. A malformed request gets HTTP
400 with OpenAI's error object, ``{"error": {"message", "type": "invalid_request_error", "param",
"code"}}``, the message naming the field; an episode that is not open gets 404, one past its
``max_calls`` 400 (param ``max_calls``).

Safety: it listens on a loopback address only (another host is refused), since anyone who can reach
it can sample the policy; there is no authentication.

Tool calls are parsed from the reply with its special tokens kept (Mistral's ``[TOOL_CALLS]`` is one),
as :mod:`rlalign.agents.episodes` parses them; the content returned has them removed. As vLLM's
parsers, a reply with a malformed call is plain content (no call of it is returned), and a final call
left open by a stop string (``stop="</tool_call>"``) or EOS is a call (:func:`parse_calls`). A call's id is
9 alphanumeric characters (Mistral v0.3 / Nemo / Small templates refuse any other when the agent sends
it back), a hash of (seed, episode, call index, choice, position): the prompts that render it again are
reproducible (on the unrecorded ``/v1``, a random one).

Recording: each choice of each call is a :class:`CallRecord` of the episode: the prompt ids as
rendered, the completion ids exactly as sampled (never decoded and encoded again; cut after the token
that completes a stop string, EOS kept), the sampler's log-probs of those ids, and whether it hit
``max_tokens``. A call's uniforms come from a generator seeded by (seed, episode, call index):
which requests a batch happens to hold does not change a call's draws. A call whose client has gone
(it timed out, and the ``openai`` client retried) is not recorded, since its reply reached no one: the
handler watches for the client's disconnect while the call waits, and checks once more before
recording (``abandoned`` counts them; a request abandoned before it was sampled is not sampled, and
does not count against ``max_calls``). A client that leaves after that check, while the reply is
being sent, still has its call recorded.

Batching: handlers put requests on a queue; one worker thread (the only one to run the policy) takes
the first, waits up to ``batch_wait_s`` for more (at most ``max_batch_rows`` rows), and samples each
set of requests with equal sampling parameters as one batch.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlalign.agents.chat_request import ChatRequest, RequestError, check_template_kwargs, parse_chat_request
from rlalign.lm.decode import SamplingParams
from rlalign.lm.rollout import Rollout
from rlalign.lm.models import stop_token_ids

__all__ = [
    "RequestError", "ChatRequest", "CallRecord", "parse_chat_request", "parse_calls", "calls_as_text", "render_chat", "model_generate", "PolicyServer",
]

Generate = Callable[[list[list[int]], SamplingParams, Tensor | None], Rollout]  # (prompts, params, noise (N, B) or None) -> Rollout


@dataclass
class CallRecord:
    """One sampled choice of one call, as trained on (lists of ints and floats, no padding)."""

    prompt_ids: list[int]
    completion_ids: list[int]  # as sampled: EOS kept, cut after the token completing a stop string
    logprobs: list[float]  # the sampler's log pi(y_t), one per completion id
    truncated: bool  # hit max_tokens without EOS or a stop string
    text: str  # the returned content (tool calls and the stop string removed)
    finish_reason: str


def parse_calls(fmt, text: str, tools: list[dict], ended: bool = True) -> tuple[str | None, list[dict]]:
    """(content, calls) of a reply, as vLLM's tool parsers: ``fmt.parse`` (a :class:`rlalign.agents.tool_calls.CallFormat`)
    gives the calls, which become ``{name, arguments (JSON text)}``, and the content is the text before the first
    call (None when empty). All or nothing: a reply with a malformed call is plain content, its well-formed calls
    with it. A final call left open (no closing tag: the reply stopped there, at a stop string such as
    ``</tool_call>`` or at EOS) is a call, as vLLM's Hermes parser reads ``<tool_call>(.*)`` at the end; a reply
    cut at ``max_tokens`` (``ended`` false) only where the call is JSON, which shows where it ends (Hermes), since
    a tag-format argument cut short would still parse. A tag-format argument that is a plain string goes to the
    tool's only parameter."""
    if fmt.close and fmt.open in text and text.rfind(fmt.open) > text.rfind(fmt.close) and (ended or fmt.name == "hermes"):
        text = text + fmt.close
    calls = fmt.parse(text)
    if not calls or any(c.error is not None for c in calls):
        return text, []
    out = []
    for call in calls:
        arguments = call.arguments
        if isinstance(arguments, str):
            schema = next((t["function"] for t in tools if t["function"].get("name") == call.name), {})
            names = list((schema.get("parameters") or {}).get("properties") or {})
            arguments = {names[0] if len(names) == 1 else "input": arguments}
        out.append({"name": call.name, "arguments": json.dumps(arguments)})
    content = text[: text.find(fmt.open)].strip() if fmt.open and fmt.open in text else ""
    return content or None, out


def calls_as_text(fmt, message: dict) -> dict:
    """An assistant message's ``tool_calls`` written into its content in ``fmt``'s syntax (the tag format:
    ``<tool>NAME: ARGUMENT</tool>``), for chat templates that cannot render tool calls."""
    parts = []
    for call in message.pop("tool_calls"):
        arguments = call["function"]["arguments"]
        only = list(arguments.values())[0] if isinstance(arguments, dict) and len(arguments) == 1 else None
        parts.append(f"{fmt.open}{call['function']['name']}: {only if isinstance(only, str) else json.dumps(arguments)}{fmt.close}")
    message["content"] = (message["content"] + "".join(parts)) if message["content"] else "".join(parts)
    return message


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, fmt=None, template_kwargs: dict | None = None) -> list[int]:
    """The prompt ids of ``messages``: the chat template with ``tools``, ``template_kwargs`` (its own variables:
    :func:`rlalign.agents.chat_request.check_template_kwargs`) and the generation prompt, tokenised once (the
    template writes its own special tokens); "role: content" lines without a template. With the tag format
    ``fmt`` (a template without tool calls), assistants' calls are written into their content."""
    check_template_kwargs(tokenizer, template_kwargs or {}, tools)
    if fmt is not None and fmt.name == "tags":
        messages = [calls_as_text(fmt, dict(m)) if m.get("tool_calls") else m for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if tools:
        raise RequestError("tools: the model has no chat template to describe tools with", "tools")
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer(text)["input_ids"]


def model_generate(model, tokenizer) -> Generate:
    """A :data:`Generate` sampling ``model`` as it is (eval mode is the caller's), EOS = the tokenizer's."""
    from rlalign.lm.sampling import sample

    def generate(prompts: list[list[int]], params: SamplingParams, noise: Tensor | None) -> Rollout:
        return sample(model, prompts, params, tokenizer.pad_token_id, stop_token_ids(model, tokenizer), noise=noise).to("cpu")

    return generate


def _stop_cut(tokenizer, ids: list[int], text: str, stop: Sequence[str]) -> tuple[int, int, str] | None:
    """(tokens to keep, characters of content, the stop string) when a stop string occurs in ``text``, as vLLM stops:
    after each token it checks the stop strings in the order listed, so the stop is the one completed by the earliest
    token (of those that token completes, the first listed, even one ending later in its text); the tokens kept are
    that shortest prefix of ``ids``, the content the text before the stop string. None when none occurs."""
    found = [(_tokens_holding(tokenizer, ids, s), order, s) for order, s in enumerate(stop) if s in text]
    if not found:
        return None
    kept, _, s = min(found)
    return kept, text.find(s), s


def _tokens_holding(tokenizer, ids: list[int], s: str) -> int:
    """The fewest leading tokens of ``ids`` whose text holds ``s`` (containment grows with the prefix: bisected)."""
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if s in tokenizer.decode(ids[:mid], skip_special_tokens=True):
            high = mid
        else:
            low = mid + 1
    return low


def _without_special(tokenizer, text: str | None) -> str | None:
    """``text`` without the tokenizer's special tokens (what ``skip_special_tokens`` drops); None when nothing is left."""
    for token in sorted(tokenizer.all_special_tokens, key=len, reverse=True):
        text = (text or "").replace(token, "")
    return (text or "").strip() or None


_ALPHANUMERIC = "0123456789abcdefghijklmnopqrstuvwxyz"


def _call_id(key: str) -> str:
    """A tool call's id: 9 alphanumeric characters (the ids Mistral v0.3 / Nemo / Small templates require, as
    :func:`rlalign.agents.tool_calls.call_id`'s), from sha256 of ``key`` (36^9 ~ 1e14 of them)."""
    number = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return "".join(_ALPHANUMERIC[number // 36**i % 36] for i in range(9))


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingParams
    noise: Tensor | None  # (N, n)
    n: int
    key: str = ""  # names the call (episode, index) for its tool-call ids; "" on the unrecorded /v1
    future: Future = field(default_factory=Future)
    abandoned: bool = False  # its client left before it was sampled: the worker skips it


@dataclass
class _Episode:
    calls: list[CallRecord] = field(default_factory=list)
    requests: int = 0  # call indices handed out
    abandoned: int = 0  # calls whose client left before the reply (not recorded, not counted against max_calls)


class PolicyServer:
    """The endpoint (module docstring): serves ``generate`` on ``host`` while open, records episodes' calls.

    Args:
        tokenizer: renders the messages and decodes the replies.
        generate: samples a batch (:data:`Generate`); called on the worker thread only.
        max_new_tokens: the cap (and default) of ``max_tokens``.
        temperature, top_p, top_k: the run's sampling settings: the calls are sampled at them (module docstring),
            and a request asking for others gets 400.
        sampling_from_requests: serve a request's own temperature / top_p / top_k, the above being the defaults
            (an endpoint whose calls are not trained: the evaluation's).
        call_format: the tool-call syntax of the model's replies (:mod:`rlalign.agents.tool_calls`); None: the
            one its chat template writes (tags without one).
        max_calls: requests one episode may make; past that, 400.
        max_context: prompt + max_tokens limit (None: unchecked).
        host: a loopback address (127.0.0.0/8, ::1, localhost); the endpoint has no authentication, so
            any other is refused.
    """

    def __init__(
        self, tokenizer, generate: Generate, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
        call_format=None, max_calls: int = 16, max_context: int | None = None,
        batch_wait_s: float = 0.005, max_batch_rows: int = 256, seed: int = 0, host: str = "127.0.0.1", model_name: str = "policy",
        sampling_from_requests: bool = False, serve_without_effect: tuple[str, ...] = (),
    ):
        from rlalign.agents.episodes import end_of_turn_ids
        from rlalign.agents.tool_calls import call_format as format_named
        from rlalign.listen import is_loopback

        if not is_loopback(host):
            raise ValueError(f"PolicyServer: host must be a loopback address (the endpoint has no authentication), got {host!r}")
        self.tokenizer, self.generate = tokenizer, generate
        self.call_format = call_format or format_named("auto", tokenizer)
        self.end_ids = set(end_of_turn_ids(tokenizer))  # a reply's last token that ends the turn, dropped before its calls are parsed
        self.max_new_tokens, self.defaults, self.top_k = max_new_tokens, (temperature, top_p), top_k
        self.sampling_from_requests, self.lenient = sampling_from_requests, frozenset(serve_without_effect)  # chat_request.LENIENT
        self.max_calls, self.max_context, self.batch_wait_s, self.max_batch_rows = max_calls, max_context, batch_wait_s, max_batch_rows
        self.seed, self.host, self.model_name = seed, host, model_name
        self.base = ""
        self.batches = 0  # sampling batches run (requests gathered together count once)
        self.abandoned = 0  # calls whose client left before their reply: not recorded
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._stack = None

    # -- lifetime -------------------------------------------------------------------------------

    def __enter__(self) -> PolicyServer:
        import contextlib

        from rlalign.serve_reward import running

        self._stack = contextlib.ExitStack()
        worker = threading.Thread(target=self._work, daemon=True, name="rlalign-policy-server")
        worker.start()
        self._stack.callback(lambda: (self._jobs.put(None), worker.join(timeout=30)))
        self.base = self._stack.enter_context(running(self.app(), self.host))
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def url(self, episode: str | None = None) -> str:
        """The base URL an ``openai`` client takes: the episode's, or the unrecorded ``/v1``."""
        return f"{self.base}/v1" if episode is None else f"{self.base}/episodes/{episode}/v1"

    def open_episode(self, episode: str) -> None:
        with self._lock:
            self._episodes[episode] = _Episode()

    def close_episode(self, episode: str) -> list[CallRecord]:
        """The episode's recorded calls, in the order they were answered; later calls of it get 404."""
        with self._lock:
            record = self._episodes.pop(episode, None)
        return [] if record is None else record.calls

    # -- the worker: gather, batch by parameters, sample ----------------------------------------

    def _work(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs, rows, deadline = [first], first.n, time.monotonic() + self.batch_wait_s
            while rows < self.max_batch_rows:
                try:
                    job = self._jobs.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                jobs.append(job)
                rows += job.n
            by_params: dict[SamplingParams, list[_Job]] = {}
            for job in jobs:
                if job.abandoned:
                    job.future.cancel()
                    continue
                by_params.setdefault(job.params, []).append(job)
            for params, group in by_params.items():
                self._run(params, group)

    def _run(self, params: SamplingParams, group: list[_Job]) -> None:
        try:
            prompts = [job.prompt for job in group for _ in range(job.n)]
            noise = None if params.greedy else torch.cat([job.noise for job in group], dim=1)  # (N, B)
            rollout = self.generate(prompts, params, noise)
            self.batches += 1
        except Exception as err:  # the handlers answer 500 with it
            for job in group:
                job.future.set_exception(err)
            return
        row = 0
        for job in group:
            out = []
            for _ in range(job.n):
                keep = rollout.completion_mask[row].bool()
                out.append((rollout.completion_ids[row][keep].tolist(), rollout.logprobs[row][keep].tolist(), bool(rollout.truncated[row])))
                row += 1
            job.future.set_result(out)

    # -- requests -------------------------------------------------------------------------------

    def _reserve(self, episode: str | None) -> int:
        """The call's index in its episode (its uniforms' seed), counting it against ``max_calls``."""
        if episode is None:
            return -1
        with self._lock:
            record = self._episodes.get(episode)
            if record is None:
                raise RequestError(f"episode {episode!r} is not open (finished, timed out, or never started)", None, 404)
            if record.requests - record.abandoned >= self.max_calls:
                raise RequestError(f"episode {episode!r}: more than max_calls={self.max_calls} calls", "max_calls")
            record.requests += 1
            return record.requests - 1

    def _noise(self, episode: str | None, index: int, steps: int, n: int) -> Tensor:
        key = f"rlalign agent call {self.seed} {episode} {index}" if episode is not None else f"rlalign call {uuid.uuid4()}"
        digest = hashlib.sha256(key.encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return torch.rand((steps, n), generator=generator)  # (N, n)

    def _sampling(self, request: ChatRequest) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) of a request: the run's (module docstring), or with ``sampling_from_requests``
        the request's where it gives them (top_p 0 and top_k -1: unset and off).

        Raises:
            RequestError: a value other than the run's, naming the field, the run's value and the config key.
        """
        run = {"temperature": self.defaults[0], "top_p": self.defaults[1], "top_k": self.top_k}
        asked = {"temperature": request.temperature, "top_p": request.top_p, "top_k": None if request.top_k is None else max(request.top_k, 0)}
        if self.sampling_from_requests:
            asked["top_p"] = asked["top_p"] or None
            return tuple(run[k] if asked[k] is None else asked[k] for k in run)
        for key, value in asked.items():
            if value is not None and value != run[key]:
                raise RequestError(
                    f"{key}: this endpoint samples at the run's sampling.{key}={run[key]:g}, since the calls are trained as the policy's samples "
                    f"at it; leave {key} out of the request or give {run[key]:g}, got {value:g} (to sample at {value:g}, set sampling.{key}={value:g} "
                    "in the run's config)", key)
        return run["temperature"], run["top_p"], run["top_k"]

    def prepare(self, body: Any, episode: str | None) -> tuple[ChatRequest, _Job]:
        """The request parsed, rendered and reserved against its episode, as a job for the worker.

        Raises:
            RequestError: naming the field.
        """
        request = parse_chat_request(body, self.lenient)
        try:
            prompt = render_chat(self.tokenizer, request.messages, request.tools, self.call_format, request.template_kwargs)
        except RequestError:
            raise
        except Exception as err:  # the template's own checks (roles out of order, a missing field)
            raise RequestError(f"messages: the chat template cannot render them: {type(err).__name__}: {str(err)[:200]}", "messages") from err
        steps = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens)
        if self.max_context is not None and len(prompt) + steps > self.max_context:
            raise RequestError(f"messages: the prompt has {len(prompt)} tokens, which with max_tokens={steps} exceeds the context of {self.max_context}", "messages")
        temperature, top_p, top_k = self._sampling(request)
        if request.logprobs and temperature not in (0.0, 1.0):
            raise RequestError(f"logprobs: calls are sampled at temperature {temperature:g}, where the server has the log-probs of the tempered "
                               "distribution, log softmax(z / temperature), not the model's own (which OpenAI and vLLM return); leave logprobs out, "
                               "or sample at temperature 1", "logprobs")
        params = SamplingParams(steps, temperature, top_k if temperature > 0 else 0, top_p)
        index = self._reserve(episode)
        noise = None if params.greedy else self._noise(episode, index, steps, request.n)
        return request, _Job(prompt, params, noise, request.n, "" if episode is None else f"{self.seed} {episode} {index}")

    def _reply_calls(self, ids: list[int], text: str, stop: str | None, tools: list[dict], ended: bool) -> tuple[str | None, list[dict]]:
        """(content, calls) of a reply to a request with tools: the calls parsed from the reply with its special tokens
        kept (a format's marker may be one: Mistral's ``[TOOL_CALLS]``) and its ending token dropped, as
        :mod:`rlalign.agents.episodes` parses them; the content without special tokens (``text`` when there is no call)."""
        body = ids[:-1] if ids and ids[-1] in self.end_ids else ids
        raw = self.tokenizer.decode(body, skip_special_tokens=False)
        if stop is not None and stop in raw:
            raw = raw[: raw.rfind(stop)]
        content, calls = parse_calls(self.call_format, raw, tools, ended)
        return (text, []) if not calls else (_without_special(self.tokenizer, content), calls)

    def _logprobs(self, ids: list[int], logps: list[float]) -> dict:
        """OpenAI's ``choice.logprobs`` of a completion: per token its text (vLLM's: the token as a string), UTF-8 bytes
        (None when the text is not whole characters) and log-prob; no alternatives (``top_logprobs`` is 0)."""
        texts = [self.tokenizer.convert_tokens_to_string([token]) for token in self.tokenizer.convert_ids_to_tokens(ids)]
        return {"content": [{"token": t, "logprob": lp, "bytes": None if "\ufffd" in t else list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(texts, logps)], "refusal": None}

    def finish(self, request: ChatRequest, job: _Job, samples: list[tuple[list[int], list[float], bool]], episode: str | None) -> dict:
        """The OpenAI reply of a sampled job; its choices recorded under ``episode``."""
        choices, records = [], []
        for index, (ids, logps, truncated) in enumerate(samples):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut = _stop_cut(self.tokenizer, ids, text, request.stop)
            if cut is not None:
                ids, logps, truncated, text = ids[: cut[0]], logps[: cut[0]], False, text[: cut[1]]
            parse = request.tools and request.tool_choice != "none"  # "none": the reply is content
            content, calls = self._reply_calls(ids, text, cut[2] if cut else None, request.tools, not truncated) if parse else (text, [])
            reason = "tool_calls" if calls else "length" if truncated else "stop"
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [
                    {"id": _call_id(f"{job.key or uuid.uuid4()} {index} {position}"), "type": "function",
                     "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for position, c in enumerate(calls)
                ]
            choices.append({"index": index, "message": message, "finish_reason": reason, "logprobs": self._logprobs(ids, logps) if request.logprobs else None})
            records.append(CallRecord(job.prompt, ids, logps, truncated, content or "", reason))
        if episode is not None:
            with self._lock:
                if episode in self._episodes:
                    self._episodes[episode].calls.extend(records)
        completion_tokens = sum(len(r.completion_ids) for r in records)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": request.model,
            "choices": choices, "usage": {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens, "total_tokens": len(job.prompt) + completion_tokens},
        }

    def app(self):
        """The Starlette app of the routes (module docstring)."""
        import asyncio
        import contextlib

        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def disconnect(request: Request) -> None:
            """Returns when the client has closed the connection (the body is read by then)."""
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def completions(request: Request) -> JSONResponse:
            episode = request.path_params.get("episode")
            try:
                try:
                    body = await request.json()
                except ValueError:
                    raise RequestError("request body: not JSON") from None
                chat, job = self.prepare(body, episode)
            except RequestError as err:
                return JSONResponse(err.body(), status_code=err.status)
            self._jobs.put(job)
            sampled, gone = asyncio.wrap_future(job.future), asyncio.ensure_future(disconnect(request))
            await asyncio.wait({sampled, gone}, return_when=asyncio.FIRST_COMPLETED)
            left = gone.done()
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # an error reading the connection: as good as gone
                await gone
            if left or await request.is_disconnected():  # nobody reads the reply: not recorded (module docstring)
                job.abandoned = True
                with self._lock:
                    self.abandoned += 1
                    if episode in self._episodes:
                        self._episodes[episode].abandoned += 1
                return JSONResponse({"error": {"message": "the client closed the request", "type": "client_closed", "param": None, "code": None}}, status_code=499)
            try:
                samples = sampled.result()
            except Exception as err:
                return JSONResponse({"error": {"message": f"sampling failed: {type(err).__name__}: {str(err)[:300]}", "type": "server_error", "param": None, "code": None}}, status_code=500)
            return JSONResponse(self.finish(chat, job, samples, episode))

        async def models(request: Request) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlalign"}]})

        routes = []
        for base in ("/v1", "/episodes/{episode}/v1"):
            routes += [Route(f"{base}/chat/completions", completions, methods=["POST"]), Route(f"{base}/models", models, methods=["GET"])]
        return Starlette(routes=routes)

