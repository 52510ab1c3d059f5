"""``rlalign serve-reward``: a reward model or a Python reward function served over HTTP.

    rlalign serve-reward --reward-model runs/rm/final --port 5000
    rlalign serve-reward --function my_rewards:length_penalty --port 5000

Routes (the JSON protocol of docs/reward_protocol.md, which :class:`rlalign.lm.remote_reward.RemoteReward` speaks):

- ``POST /score`` and ``POST /get_reward`` (OpenRLHF ``serve_rm``'s route; the same handler):
  ``{"prompts": [...], "completions": [...], "columns": {name: [one value per row]}, "global_step": n}``
  -> ``{"rewards": [float | null, ...], "scores": [the same], "unscored": [row, ...]}`` (``scores`` as
  OpenRLHF's server sends it; ``unscored``, only when there are any: the rows the function answered
  :data:`rlalign.lm.reward_calls.UNSCORED` for, null in ``rewards``).
  OpenRLHF's ``query`` (prompt + response text) with ``prompts`` stands for ``completions``: each
  completion is its query with the prompt cut off the front; its ``labels`` become the
  ``--label-column`` column (``answer`` by default) when ``columns`` has none.
- ``GET /health`` -> ``{"status": "ok", "reward": name}`` (never needs the token).

A function is called as the trainer calls one (:func:`rlalign.lm.rewards.call_reward`, TRL's
keywords: ``prompts``, ``completions``, the columns it names, ``trainer_state`` with ``global_step``)
and its scores are taken as the trainer takes them (a float, an int, a bool, a NumPy scalar, a
one-element tensor, None, or UNSCORED); a reward model scores with
:class:`rlalign.lm.rewards.RewardModelReward`, loaded as the trainers load one. A request that is not
the protocol gets 400 ``{"error": ...}`` naming the field; a reward function that raises or returns
something other than one of those per row gets 500 ``{"error": ..., "retryable": false}`` naming the
function and the prompt, never a traceback.

One batch at a time: requests are scored in a worker thread (the server keeps answering ``/health``)
under one lock, since a model's forward already uses every core it is given and a user's function
need not be thread-safe. Concurrent clients queue, at most ``max_queue`` requests waiting or being
scored; past that a request gets 503 with ``Retry-After`` at once. Run more servers for more throughput.

Safety: binds to the loopback address unless told otherwise. With a token (``--token``, or better the
environment variable ``RLALIGN_REWARD_TOKEN``: a command line shows in ``ps``) every route but
``GET /health`` needs ``Authorization: Bearer <token>``, compared in constant time; a missing or wrong
one gets 401. On any address other than loopback (127.0.0.0/8, ::1, localhost) the command refuses to
start without a token, unless ``--no-auth`` says to serve unauthenticated (with a warning). The token
travels in clear over plain HTTP: across an untrusted network put a TLS proxy or an SSH tunnel in front.
A body over ``max_body_bytes`` (Content-Length, or the bytes of a chunked body as they arrive) gets
413. It takes no file paths from requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from rlalign.errors import RLAlignError
from rlalign.listen import base_url, bound_socket, is_loopback
from rlalign.lm.remote_reward import check_rewards
from rlalign.lm.reward_calls import UNSCORED, _as_number, import_reward_function
from rlalign.lm.rewards import RewardFunctionError, call_reward, reward_fn_name

__all__ = [
    "LOOPBACK", "TOKEN_ENV", "RequestError", "server_token", "parse_request", "score_rows", "load_function", "load_model_reward",
    "create_app", "running", "add_arguments", "run",
]

LOOPBACK = "127.0.0.1"
TOKEN_ENV = "RLALIGN_REWARD_TOKEN"  # the variable the server (and, by default, a reward_url term) reads its token from
MAX_BODY_BYTES = 16 * 2**20
MAX_QUEUE = 8


class RequestError(ValueError):
    """A request that is not the protocol: the message names the field."""


def server_token(host: str, token: str | None, no_auth: bool) -> str | None:
    """The token a server on ``host`` enforces: ``token`` (None or "": none), or None with ``no_auth``.

    Raises:
        RLAlignError: when ``host`` is not loopback and there is neither a token nor ``no_auth``, or when
            the token is not one a header can carry (the message never shows it).
    """
    if no_auth:
        return None
    if not token and not is_loopback(host):
        raise RLAlignError(
            f"refusing to listen on {host} without a token: set the environment variable {TOKEN_ENV} (or pass --token), "
            "or pass --no-auth to serve anyone who can reach this address"
        )
    if token and not (token.isascii() and token.isprintable() and token == token.strip()):
        raise RLAlignError(f"the token (from --token or {TOKEN_ENV}) must be printable ASCII without surrounding spaces, as an HTTP header carries it")
    return token or None


def _check_text_or_messages(value: Any, field: str) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        return
    raise RequestError(f"{field}: expected text or a list of {{role, content}} messages, got {str(value)[:80]!r}")


def parse_request(body: Any, label_column: str | None = "answer") -> tuple[list, list, dict[str, list], dict[str, Any]]:
    """(prompts, completions, columns, context) of a request body (docs/reward_protocol.md).

    Raises:
        RequestError: naming the field that is missing or malformed.
    """
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object with 'prompts' and 'completions'")
    prompts, completions, queries = body.get("prompts"), body.get("completions"), body.get("query")
    if not isinstance(prompts, list):
        raise RequestError("prompts: missing, or not a list" + ("; OpenRLHF's 'query' alone cannot be split into prompt and completion" if queries is not None else ""))
    for i, p in enumerate(prompts):
        _check_text_or_messages(p, f"prompts[{i}]")
    if completions is None and queries is not None:  # OpenRLHF: query = prompt + response
        if not isinstance(queries, list) or len(queries) != len(prompts):
            raise RequestError(f"query: expected a list of {len(prompts)} texts, one per prompt")
        completions = []
        for i, (p, q) in enumerate(zip(prompts, queries)):
            if not isinstance(p, str) or not isinstance(q, str) or not q.startswith(p):
                raise RequestError(f"query[{i}]: does not start with prompts[{i}], so the completion cannot be cut from it; send 'completions'")
            completions.append(q[len(p):])
    if not isinstance(completions, list):
        raise RequestError("completions: missing, or not a list")
    if len(completions) != len(prompts):
        raise RequestError(f"completions: {len(completions)} values for {len(prompts)} prompts")
    for i, c in enumerate(completions):
        _check_text_or_messages(c, f"completions[{i}]")
    columns = body.get("columns")
    columns = {} if columns is None else columns
    if not isinstance(columns, dict):
        raise RequestError("columns: expected an object {name: [one value per row]}")
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != len(prompts):
            raise RequestError(f"columns.{name}: expected a list of {len(prompts)} values, one per row")
        if name in ("prompts", "completions"):
            raise RequestError(f"columns.{name}: the name of an argument every reward function takes; rename the column")
    columns = dict(columns)
    labels = body.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != len(prompts):
            raise RequestError(f"labels: expected a list of {len(prompts)} values, one per row")
        if label_column is not None and label_column not in columns:
            columns[label_column] = labels
    context: dict[str, Any] = {}
    step = body.get("global_step")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise RequestError(f"global_step: expected an integer, got {step!r}")
        context["trainer_state"] = SimpleNamespace(global_step=step)
    return prompts, completions, columns, context


def _call(fn: Callable, prompts: list, completions: list, columns: dict[str, list], context: dict[str, Any]) -> Any:
    values = call_reward(fn, prompts, completions, columns, context)
    if inspect.isawaitable(values):  # an async function (this runs on a worker thread, with no loop of its own)
        values = asyncio.run(values)
    return values.tolist() if hasattr(values, "tolist") else list(values)


def score_rows(fn: Callable, prompts: list, completions: list, columns: dict[str, list], context: dict[str, Any], name: str | None = None) -> list:
    """``fn``'s rewards for the rows, checked: one finite float, None or :data:`UNSCORED` each (a bool,
    a NumPy scalar or a one-element tensor read as a float, as the trainer reads them).

    Raises:
        RewardFunctionError: naming the function and the prompt (a batch that raises is re-run one row
            at a time to find the prompt that makes it raise).
    """
    name = name or reward_fn_name(fn)
    if not prompts:
        return []
    try:
        values = _call(fn, prompts, completions, columns, context)
    except Exception as err:
        culprit = 0
        if len(prompts) > 1:
            for i in range(len(prompts)):
                try:
                    _call(fn, prompts[i : i + 1], completions[i : i + 1], {k: v[i : i + 1] for k, v in columns.items()}, context)
                except Exception:
                    culprit = i
                    break
        raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {str(err)[:300]} (prompt {prompts[culprit]!r:.200})") from err
    values = [_as_number(v) for v in values]
    unscored = {i for i, v in enumerate(values) if v is UNSCORED}
    values = [None if i in unscored else float(v) if isinstance(v, bool) else v for i, v in enumerate(values)]
    checked = check_rewards(values, len(prompts), f"reward function {name}", prompts)
    return [UNSCORED if i in unscored else v for i, v in enumerate(checked)]


def load_function(spec: str) -> Callable:
    """``package.module:function`` imported (the current directory importable, as the trainers do)."""
    return import_reward_function(spec)


def load_model_reward(
    path: str, dtype: str = "float32", device: str = "cpu", batch_size: int = 32, max_length: int | None = None,
    attn_implementation: str | None = None, input_format: str = "auto",
):
    """A reward-model directory as a :class:`RewardModelReward`, loaded as the trainers load one: frozen,
    with its trained head and its own tokenizer; ``input_format`` "auto" reads how it was trained to
    score (:func:`rlalign.lm.rewards.reward_input_of`), as a trainer's reward term does."""
    from rlalign.lm.heads import load_reward_model
    from rlalign.lm.models import load_tokenizer
    from rlalign.lm.rewards import RewardModelReward, reward_input_of

    model = load_reward_model(path, dtype, device, attn_implementation=attn_implementation)
    fmt = reward_input_of(path) if input_format == "auto" else input_format
    return RewardModelReward(model, load_tokenizer(path), fmt, batch_size=batch_size, max_length=max_length)


def _error(status: int, message: str, headers: dict[str, str] | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status, headers=headers)


class _BearerToken:
    """ASGI middleware: every request but ``GET /health`` needs ``Authorization: Bearer <token>`` (else 401)."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode()

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import Request

        if scope["type"] != "http" or (scope["method"] in ("GET", "HEAD") and scope["path"] == "/health"):
            return await self.app(scope, receive, send)
        scheme, _, given = Request(scope).headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            refusal = _error(401, "this server needs the header 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"})
        elif not hmac.compare_digest(given.strip().encode("latin-1"), self.token):  # latin-1: the header's bytes as sent
            refusal = _error(401, "the bearer token was refused", {"WWW-Authenticate": 'Bearer error="invalid_token"'})
        else:
            return await self.app(scope, receive, send)
        await refusal(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _read_body(request, limit: int) -> bytes:
    """The request's body.

    Raises:
        _TooLarge: as soon as its Content-Length or the bytes read pass ``limit``.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused unread; any other form ("5, 5") is left to the count
        raise _TooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(
    fn: Callable, name: str | None = None, label_column: str | None = "answer", *,
    token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, max_queue: int = MAX_QUEUE,
):
    """The Starlette app serving ``fn`` (a reward function or a :class:`RewardModelReward`).

    Args:
        token: when set, every route but ``GET /health`` needs ``Authorization: Bearer <token>``.
        max_body_bytes: the largest request body; a larger one gets 413.
        max_queue: scoring requests waiting or being scored at once; one more gets 503 with ``Retry-After``.
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if token == "":
        raise ValueError("create_app: token is empty; pass None to serve without one")
    if max_body_bytes < 1 or max_queue < 1:
        raise ValueError(f"create_app: max_body_bytes and max_queue must be >= 1, got {max_body_bytes} and {max_queue}")
    name = name or reward_fn_name(fn)
    lock = threading.Lock()  # one batch at a time (module docstring)
    queued = 0  # scoring requests admitted and not yet answered; only the event loop's thread changes it

    def scored(prompts, completions, columns, context):
        with lock:
            return score_rows(fn, prompts, completions, columns, context, name)

    async def score(request: Request) -> JSONResponse:
        nonlocal queued
        if queued >= max_queue:
            return _error(503, f"the server is busy: {max_queue} scoring requests are already queued; retry later", {"Retry-After": "1"})
        queued += 1
        try:
            return await score_admitted(request)
        finally:
            queued -= 1

    async def score_admitted(request: Request) -> JSONResponse:
        try:
            body = json.loads(await _read_body(request, max_body_bytes))
        except _TooLarge:
            return _error(413, f"request body: more than the server's limit of {max_body_bytes} bytes; send smaller batches")
        except ClientDisconnect:
            return _error(400, "request body: the client disconnected before sending all of it")
        except (ValueError, RecursionError):
            return _error(400, "request body: not JSON")
        try:
            prompts, completions, columns, context = parse_request(body, label_column)
        except RequestError as err:
            return _error(400, str(err))
        try:
            rewards = await run_in_threadpool(scored, prompts, completions, columns, context)
        except RewardFunctionError as err:
            return JSONResponse({"error": str(err), "retryable": False}, status_code=500)
        unscored = [i for i, v in enumerate(rewards) if v is UNSCORED]
        rewards = [None if v is UNSCORED else v for v in rewards]
        return JSONResponse({"rewards": rewards, "scores": rewards, **({"unscored": unscored} if unscored else {})})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "reward": name})

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")

    routes = [Route("/score", score, methods=["POST"]), Route("/get_reward", score, methods=["POST"]), Route("/health", health, methods=["GET"])]
    middleware = [] if token is None else [Middleware(_BearerToken, token=token)]
    return Starlette(routes=routes, middleware=middleware, exception_handlers={Exception: internal_error})


def _server(app, host: str, port: int):
    try:
        import uvicorn
    except ImportError as err:
        raise RLAlignError(f"rlalign serve-reward needs starlette and uvicorn ({err.name} is missing): pip install 'rlalign[explore]'") from err
    sock = bound_socket(host, port)
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)), sock


@contextlib.contextmanager
def running(app, host: str = LOOPBACK, port: int = 0) -> Iterator[str]:
    """Serve ``app`` on a background thread while the block runs (port 0: a free one); yields the base URL."""
    server, sock = _server(app, host, port)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the reward server did not start")
            time.sleep(0.01)
        yield base_url(host, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--reward-model", metavar="DIR", help="a reward-model checkpoint (from `rlalign rm`, or a Hugging Face sequence classifier with one label)")
    what.add_argument("--function", metavar="MODULE:FUNCTION", help="a Python reward function, e.g. my_rewards:length_penalty (the current directory is importable)")
    parser.add_argument("--host", default=LOOPBACK, help="address to listen on (default: 127.0.0.1, this machine only); any other address needs a token or --no-auth")
    parser.add_argument("--port", type=int, default=5000, help="port (default: 5000, OpenRLHF serve_rm's; 0 picks a free one)")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--token", default=None, help=f"bearer token every request but GET /health must send (default: ${TOKEN_ENV}; prefer the variable, since a command line shows in ps)")
    auth.add_argument("--no-auth", action="store_true", help="serve without a token even on an address other than loopback: anyone who can reach it can call the reward")
    parser.add_argument("--max-body-mb", type=float, metavar="MIB", default=MAX_BODY_BYTES / 2**20, help="largest request body in MiB; a larger one gets 413 (default: 16)")
    parser.add_argument("--max-queue", type=int, metavar="N", default=MAX_QUEUE, help="scoring requests waiting or being scored at once; more get 503 with Retry-After (default: 8)")
    parser.add_argument("--name", default=None, help="the reward's name in /health and errors (default: the function's or model's)")
    parser.add_argument("--label-column", default="answer", help="the column OpenRLHF's 'labels' fill when a request has no such column (default: answer)")
    model = parser.add_argument_group("with --reward-model")
    model.add_argument("--device", default="cpu", help="device of the model (default: cpu)")
    model.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype of the model (default: float32)")
    model.add_argument("--batch-size", type=int, default=32, help="rows per forward pass (default: 32)")
    model.add_argument("--max-length", type=int, default=None, help="eos format: tokens read per prompt + completion, the last ones kept (default: the "
                       "model's positions); the text format reads the whole text, an error past the model's positions")
    model.add_argument("--input-format", default="auto", choices=["auto", "text", "eos"],
                       help="how prompt + completion reach the model: auto (what the checkpoint records), text (Hugging Face's), eos (rlalign rm's)")
    model.add_argument("--attn-implementation", default=None, help="transformers' attention kernel, e.g. eager or sdpa (default: its own choice)")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        print(f"rlalign serve-reward: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.max_body_mb <= 0 or args.max_queue < 1:
        print(f"rlalign serve-reward: --max-body-mb must be > 0 and --max-queue >= 1, got {args.max_body_mb:g} and {args.max_queue}", file=sys.stderr)
        return 2
    token = server_token(args.host, args.token or os.environ.get(TOKEN_ENV), args.no_auth)  # before loading or binding anything
    if args.no_auth and not is_loopback(args.host):
        print(f"rlalign serve-reward: warning: listening on {args.host} without authentication (--no-auth): anyone who can reach it can call the reward", file=sys.stderr)
    if args.reward_model:
        fn = load_model_reward(args.reward_model, args.dtype, args.device, args.batch_size, args.max_length, args.attn_implementation, args.input_format)
    else:
        fn = load_function(args.function)
    name = args.name or reward_fn_name(fn)
    app = create_app(fn, name, args.label_column, token=token, max_body_bytes=max(1, int(args.max_body_mb * 2**20)), max_queue=args.max_queue)
    server, sock = _server(app, args.host, args.port)
    print(f"rlalign serve-reward: {name} at {base_url(args.host, sock.getsockname()[1])}/score (Ctrl-C to stop)", flush=True)
    server.run(sockets=[sock])
    return 0
