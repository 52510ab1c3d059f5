"""A reward function served over HTTP: ``RemoteReward(url)`` is called like any other reward function.

    reward = RemoteReward("http://127.0.0.1:5000/score", batch_size=64, timeout=30.0)
    scores = reward(prompts=prompts, completions=completions, answer=answers)   # list[float | None]
    scores = await reward.acall(prompts, completions, answer=answers)           # batches sent concurrently

Each batch of ``batch_size`` rows is one POST of JSON (the protocol: docs/reward_protocol.md)::

    {"prompts": [...], "completions": [...], "columns": {"answer": [...], ...},
     "query": [prompt + completion, ...], "labels": [...], "global_step": 12}

and the server answers ``{"rewards": [float | null, ...], "unscored": [row, ...]}``, one reward per
row: null where the reward does not apply to that row (a local function's None), or where it could
not be scored, when ``unscored`` (optional, row indices in the request) lists the row (a local
function's :data:`rlalign.lm.reward_calls.UNSCORED`, which the call then returns for that row, and
the trainers leave out of training). ``query``, ``labels`` and the ``rewards`` key are
OpenRLHF's (``openrlhf.cli.serve_rm`` reads ``query``; its agent posts ``query``, ``prompts`` and
``labels``), so an OpenRLHF reward server answers these requests too. ``query`` is sent when every
prompt and completion of the batch is text; ``labels`` when the rows have a ``label_column`` column.
Prompts and completions go as they are: text, or chat messages (lists of {role, content}).

Failures are errors, never a silent 0 (:class:`RewardFunctionError`, naming the URL, the HTTP status,
the server's message and the batch's first prompt): a connection error, a timeout, HTTP 429 or a 5xx
answer is retried ``max_retries`` times, waiting ``backoff * 2**attempt`` seconds between tries; a 4xx,
a 500 whose body says ``"retryable": false`` (``rlalign serve-reward``'s answer when the reward function
raised, which a retry would only repeat), a body that is not JSON, a missing ``rewards`` list, the wrong
number of rewards or a value that is not a finite number or null fail at once.

Authentication: with a ``token`` (or one read from the environment variable ``token_env``) each request
carries ``Authorization: Bearer <token>``. A 401 answer is an error saying whether no token was sent or
the token was refused, naming the variable; the token itself is never in a message or the repr.

One code path: the synchronous call runs :meth:`RemoteReward.acall` on an event loop of its own (on a
worker thread when the caller is already inside one); ``max_concurrency`` batches are in flight at once.
As a reward term, the trainers await its ``acall`` on their event loop beside the other async terms
(:func:`rlalign.lm.reward_calls.async_entry`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rlalign.lm.reward_calls import UNSCORED, EndpointUnavailable
from rlalign.lm.rewards import RewardFunctionError

__all__ = ["RemoteReward", "RETRY_STATUSES", "post_json", "check_rewards", "run_sync"]

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
REFUSED_STATUSES = frozenset({401, 403, 404, 405})  # the endpoint refuses every request, whatever its rows


def run_sync(coroutine):
    """Run ``coroutine`` to completion from synchronous code: on a new event loop, or on a worker
    thread's loop when this thread is already running one (a synchronous call from async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _server_message(response: httpx.Response) -> tuple[str, bool]:
    """(the server's message, whether the body allows a retry): a JSON body's ``error`` (or ``detail``,
    FastAPI's key), else the start of the body text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500].strip() or response.reason_phrase, True
    if isinstance(body, dict):
        message = body.get("error", body.get("detail", body))
        return str(message)[:500], body.get("retryable", True) is not False
    return str(body)[:500], True


async def post_json(
    client: httpx.AsyncClient, url: str, body: bytes, *, max_retries: int, backoff: float, what: str,
    timeout: float | None = None, retry_statuses: Iterable[int] = RETRY_STATUSES, on_retry=None, unauthorized: str | None = None,
) -> Any:
    """POST ``body`` (JSON bytes) to ``url`` and return the decoded JSON answer, retrying connection
    errors, timeouts and ``retry_statuses`` up to ``max_retries`` times (waits backoff, 2 backoff, ...).
    ``timeout``: seconds for the whole of one try (the client's own limits apply to each phase of it).
    ``on_retry()`` runs before each retry. ``what`` ends the error message (e.g. the batch's first prompt).
    ``unauthorized``: the message of a 401 answer, in place of the server's (which may quote a token back).

    Raises:
        EndpointUnavailable: naming ``url``, the HTTP status and the server's message (or the transport
            error), and ``what``, when the endpoint failed whatever the request held: the tries spent on
            connection errors, timeouts or ``retry_statuses``, or a 401, 403, 404 or 405 answer.
        RewardFunctionError: the same, for any other answer that is not retried (a 400, a 500 saying
            ``"retryable": false``, a body that is not JSON), which may be about the request's rows.
    """
    retry_statuses = frozenset(retry_statuses)
    for attempt in range(max_retries + 1):
        refused, status = False, None
        try:
            async with asyncio.timeout(timeout):
                response = await client.post(url, content=body, headers={"content-type": "application/json"})
        except (httpx.TimeoutException, TimeoutError) as err:
            limit = f" of {timeout:g} s" if timeout is not None else ""
            problem, retryable = f"no answer within the time limit{limit} ({type(err).__name__})", True
        except httpx.TransportError as err:
            problem, retryable = f"{type(err).__name__}: {err}", True
        else:
            status = response.status_code
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError:
                    raise RewardFunctionError(f"POST {url}: HTTP {response.status_code} with a body that is not JSON: {response.text[:200]!r} ({what})") from None
            message, allowed = _server_message(response)
            if response.status_code == 401 and unauthorized is not None:
                message = unauthorized
            problem = f"HTTP {response.status_code}: {message}"
            retryable = allowed and response.status_code in retry_statuses
            refused = response.status_code in REFUSED_STATUSES
        if not retryable or attempt == max_retries:
            tries = f" after {attempt + 1} tries" if attempt else ""
            endpoint = (retryable and status != 500) or refused  # the endpoint failed, whatever this request's rows (a 500 may be a row's: OpenRLHF's serve_rm)
            raise (EndpointUnavailable if endpoint else RewardFunctionError)(f"POST {url} failed{tries}: {problem} ({what})")
        if on_retry is not None:
            on_retry()
        await asyncio.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def check_rewards(values: Any, n: int, who: str, prompts: Sequence) -> list[float | None]:
    """``values`` as n floats or None, else a :class:`RewardFunctionError` from ``who`` naming the
    first bad value's prompt: a list of the right length of finite numbers (bool is not one) or None."""
    if not isinstance(values, list):
        raise RewardFunctionError(f"{who} returned {type(values).__name__} {str(values)[:100]}, not a list of rewards (prompt {prompts[0]!r:.200})")
    if len(values) != n:
        raise RewardFunctionError(f"{who} returned {len(values)} rewards for {n} completions (first prompt {prompts[0]!r:.200})")
    for p, v in zip(prompts, values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite_float(v)):
            raise RewardFunctionError(f"{who} returned {v!r:.100} (expected a finite number, or null where the reward does not apply) for prompt {p!r:.200}")
    return [None if v is None else float(v) for v in values]


def _finite_float(v: int | float) -> bool:
    """Whether ``v`` is a finite float: a JSON int too large for a float is not (math.isfinite raises OverflowError on it)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _is_row_column(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n


class RemoteReward:
    """A reward function whose scores come from an HTTP server (``rlalign serve-reward``, an OpenRLHF
    ``serve_rm``, or any server speaking docs/reward_protocol.md).

    Args:
        url: the full endpoint, e.g. ``http://127.0.0.1:5000/score`` (OpenRLHF: ``.../get_reward``).
        name: the reward's name in logs and errors (default ``RemoteReward(<url>)``).
        batch_size: rows per request.
        timeout: seconds one request may take (connecting, sending, waiting, reading).
        max_retries: further tries of a request after a connection error, timeout, 429 or 5xx.
        backoff: seconds before the first retry; doubled for each next one.
        max_concurrency: requests in flight at once.
        columns: the row columns to send (None: every column the caller passes whose value has one entry per row).
        label_column: the column also sent as OpenRLHF's ``labels`` when the rows have it (None: never).
        headers: extra HTTP headers.
        retry_statuses: the HTTP statuses retried.
        token: sent as ``Authorization: Bearer <token>`` (None: read from ``token_env``).
        token_env: the environment variable read for the token when ``token`` is None (unset or empty: no
            token), and named by the error of a 401 answer.

    Counters: ``requests`` (batches answered) and ``retries`` (requests tried again) since construction;
    :meth:`pop_stats` returns the retries since its last call, for a trainer to log.
    """

    def __init__(
        self,
        url: str,
        name: str | None = None,
        batch_size: int = 64,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_concurrency: int = 4,
        columns: Sequence[str] | None = None,
        label_column: str | None = "answer",
        headers: Mapping[str, str] | None = None,
        retry_statuses: Iterable[int] = RETRY_STATUSES,
        token: str | None = None,
        token_env: str | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward_url must start with http:// or https://, got {url!r}")
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError(f"RemoteReward({url!r}): batch_size and max_concurrency must be >= 1, max_retries and backoff >= 0, timeout > 0")
        self.url, self.name = url, name or f"RemoteReward({url})"
        self.batch_size, self.timeout, self.max_retries, self.backoff, self.max_concurrency = batch_size, timeout, max_retries, backoff, max_concurrency
        self.columns = None if columns is None else list(columns)
        self.label_column, self.headers, self.retry_statuses = label_column, dict(headers or {}), frozenset(retry_statuses)
        self.requests = self.retries = 0
        self._retries_logged = 0
        self.token_env = token_env
        self._token_source = "passed as RemoteReward(token=...)"
        if token is None and token_env:
            token, self._token_source = os.environ.get(token_env), f"from the environment variable {token_env}"
        if token and not (token.isascii() and token.isprintable() and token == token.strip()):
            raise ValueError(f"{self.name}: the bearer token {self._token_source} must be printable ASCII without surrounding spaces")
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}  # kept out of ``headers``, which callers may print

    def __call__(self, prompts: list, completions: list, trainer_state: Any = None, environments: Sequence | None = None, **columns: Sequence) -> list:
        """One reward per completion: a float, None where the server says the reward does not apply,
        :data:`rlalign.lm.reward_calls.UNSCORED` where it says the row could not be scored."""
        return run_sync(self.acall(prompts, completions, trainer_state=trainer_state, environments=environments, **columns))

    async def acall(self, prompts: list, completions: list, trainer_state: Any = None, environments: Sequence | None = None, **columns: Sequence) -> list:
        """As the call, with up to ``max_concurrency`` batches in flight; rewards in the rows' order.
        ``trainer_state.global_step`` (when given) goes as ``global_step``; keywords that are not one
        value per row are not sent, nor ``environments`` (the episodes' environment objects, TRL's keyword: objects
        of this process, not data)."""
        n = len(prompts)
        if len(completions) != n:
            raise ValueError(f"{self.name}: {n} prompts but {len(completions)} completions")
        if n == 0:
            return []
        columns = {k: list(v) for k, v in columns.items() if _is_row_column(v, n) and (self.columns is None or k in self.columns)}
        if self.columns is not None and (missing := [k for k in self.columns if k not in columns]):
            raise RewardFunctionError(f"{self.name}: the rows have no column {missing[0]!r} to send (prompt {prompts[0]!r:.200})")
        step = getattr(trainer_state, "global_step", None)
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, headers={**self.headers, **self._auth}) as client:

            async def batch(start: int) -> list:
                rows = slice(start, start + self.batch_size)
                body = self._body(prompts[rows], completions[rows], {k: v[rows] for k, v in columns.items()}, step)
                async with limit:
                    answer = await post_json(
                        client, self.url, body, max_retries=self.max_retries, backoff=self.backoff, timeout=self.timeout, retry_statuses=self.retry_statuses,
                        what=f"{self.name}, batch of {len(prompts[rows])} from prompt {prompts[start]!r:.200}", on_retry=self._count_retry,
                        unauthorized=self._unauthorized(),
                    )
                self.requests += 1
                return self._rewards(answer, prompts[rows])

            try:
                async with asyncio.TaskGroup() as group:  # one batch failing cancels the others
                    tasks = [group.create_task(batch(start)) for start in range(0, n, self.batch_size)]
            except ExceptionGroup as errors:
                raise errors.exceptions[0] from None
        return [r for task in tasks for r in task.result()]

    def pop_stats(self) -> dict[str, float]:
        """{"retries": requests retried since the last call}."""
        retries, self._retries_logged = self.retries - self._retries_logged, self.retries
        return {"retries": float(retries)}

    def _count_retry(self) -> None:
        self.retries += 1

    def _unauthorized(self) -> str:
        """What a 401 answer means for this client: no token sent, or its token refused; naming ``token_env``."""
        if self._auth:
            return f"the server refused the bearer token {self._token_source}"
        if self.token_env:
            return f"the server needs a bearer token and none was sent: the environment variable {self.token_env} is not set"
        return "the server needs a bearer token and none was sent: set token_env to the environment variable holding it"

    def _body(self, prompts: list, completions: list, columns: dict[str, list], step: int | None) -> bytes:
        payload: dict[str, Any] = {"prompts": prompts, "completions": completions, "columns": columns}
        if all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions):
            payload["query"] = [p + c for p, c in zip(prompts, completions)]  # OpenRLHF's prompt + response text
        if self.label_column is not None and self.label_column in columns:
            payload["labels"] = columns[self.label_column]
        if step is not None:
            payload["global_step"] = int(step)
        try:
            return json.dumps(payload, allow_nan=False).encode()
        except (TypeError, ValueError) as err:
            field = next((f"columns.{k}" for k, v in columns.items() if not _jsonable(v)), None) or next((k for k in ("prompts", "completions") if not _jsonable(payload[k])), "the request")
            raise RewardFunctionError(f"{self.name}: {field} cannot be sent as JSON ({err}) (prompt {prompts[0]!r:.200})") from None

    def _rewards(self, answer: Any, prompts: list) -> list:
        """The batch's rewards: floats, None, and :data:`UNSCORED` for the rows ``unscored`` lists."""
        who = f"{self.name} (POST {self.url})"
        if not isinstance(answer, dict) or "rewards" not in answer:
            keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise RewardFunctionError(f"{who} answered without a 'rewards' list (got {keys}) for the batch from prompt {prompts[0]!r:.200}")
        rewards: list = check_rewards(answer["rewards"], len(prompts), who, prompts)
        unscored = answer.get("unscored", [])
        if not isinstance(unscored, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(prompts) or rewards[i] is not None for i in unscored):
            raise RewardFunctionError(
                f"{who} answered 'unscored': {str(unscored)[:100]}, not a list of indices of rows whose reward is null "
                f"(batch of {len(prompts)} from prompt {prompts[0]!r:.200})"
            )
        for i in unscored:
            rewards[i] = UNSCORED
        return rewards


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
