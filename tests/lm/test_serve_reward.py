"""``rlalign serve-reward``: a tiny reward model and Python functions served on 127.0.0.1 score what
they score locally; malformed requests get 400 naming the field; a raising function a 500 naming it.
Facing a network: a token guards every route but /health (401 without it, compared in constant time),
the command refuses a non-loopback address without one (before loading or binding anything), bodies
over the limit get 413, and requests past the queue limit get 503 at once."""

from __future__ import annotations

import argparse
import hmac
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch

pytest.importorskip("starlette", reason="rlalign serve-reward needs the explore extra (starlette, uvicorn)")
pytest.importorskip("uvicorn", reason="rlalign serve-reward needs the explore extra (starlette, uvicorn)")

from rlalign.lm.heads import load_reward_model
from rlalign.lm.models import load_tokenizer
from rlalign.lm.remote_reward import RemoteReward
from rlalign.lm.rewards import RewardModelReward, reward_input_of
from rlalign import serve_reward
from rlalign.errors import RLAlignError
from rlalign.listen import is_loopback
from rlalign.serve_reward import add_arguments, create_app, load_model_reward, running, server_token
from rlalign.tasks.preference import hidden_reward

from .conftest import make_llama


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama reward model (a random head made larger so scores differ), saved as `rlalign rm` saves one."""
    path = tmp_path_factory.mktemp("rm")
    base = path / "base"
    make_llama(vocab=len(tokenizer), seed=3).save_pretrained(base)
    rm = load_reward_model(base, trainable=True).eval()
    with torch.no_grad():
        rm.head.weight.mul_(5.0)
    rm.save_pretrained(path / "rm")
    tokenizer.save_pretrained(path / "rm")
    return path / "rm"


def test_a_served_reward_model_scores_what_it_scores_locally(reward_model_dir):
    prompts = ["word: sun\n", "word: a longer topic here\n", [{"role": "user", "content": "rate me"}], "x"]
    completions = ["aeiou", "zzz", [{"role": "assistant", "content": "okay then"}], "a much longer completion than the rest"]
    path = str(reward_model_dir)
    local_fn = RewardModelReward(load_reward_model(path), load_tokenizer(path), reward_input_of(path))
    # the same batches of 2 (as the client sends them) on both sides: padding to another length changes
    # float32 sums in the last bits (about 1e-6 relative), which is not what this test is about
    local = local_fn(prompts[:2], completions[:2]) + local_fn(prompts[2:], completions[2:])
    with running(create_app(load_model_reward(path, batch_size=3))) as url:
        remote = RemoteReward(f"{url}/score", batch_size=2)(prompts, completions)
    assert max(local) - min(local) > 0.1  # the scores differ, so matching them means something
    torch.testing.assert_close(torch.tensor(remote, dtype=torch.float64), torch.tensor(local, dtype=torch.float64), rtol=0, atol=1e-6)


def test_the_command_serves_a_python_function_on_a_free_port():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlalign", "serve-reward", "--function", "rlalign.tasks.preference:hidden_reward", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = _first_line(proc, deadline=time.monotonic() + 120)
        assert line.startswith("rlalign serve-reward: hidden_reward at http://127.0.0.1:") and line.endswith("/score (Ctrl-C to stop)")
        url = line.split(" at ")[1].split(" ")[0]
        _wait_healthy(url.removesuffix("/score"), deadline=time.monotonic() + 30)
        prompts, completions = ["word: sun\n"] * 3, ["aeiou", "bcd", "banana"]
        assert RemoteReward(url, batch_size=2)(prompts, completions) == hidden_reward(prompts, completions)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _first_line(proc: subprocess.Popen, deadline: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                return proc.stdout.readline().strip()
            if proc.poll() is not None:
                raise AssertionError(f"serve-reward exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError("serve-reward printed no address in time")


def _wait_healthy(base: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2.0).json()["status"] == "ok":
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("serve-reward did not become healthy")


def with_answer(prompts, completions, answer, trainer_state=None):
    """1 where the completion is the answer, else 0; the step added when a trainer state comes with it."""
    step = trainer_state.global_step if trainer_state is not None else 0
    return [float(c == a) + step for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def served():
    with running(create_app(with_answer)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def test_health_names_the_reward(served):
    assert served.get("/health").json() == {"status": "ok", "reward": "with_answer"}


def test_the_protocol_and_openrlhfs_shape_give_the_same_rewards(served):
    ours = served.post("/score", json={"prompts": ["1+1=", "2+2="], "completions": ["2", "5"], "columns": {"answer": ["2", "4"]}, "global_step": 3})
    assert ours.status_code == 200 and ours.json() == {"rewards": [4.0, 3.0], "scores": [4.0, 3.0]}
    # OpenRLHF: query = prompt + response, labels -> the answer column; the /get_reward route
    theirs = served.post("/get_reward", json={"query": ["1+1=2", "2+2=5"], "prompts": ["1+1=", "2+2="], "labels": ["2", "4"], "global_step": 3})
    assert theirs.status_code == 200 and theirs.json() == ours.json()
    assert served.post("/score", json={"prompts": [], "completions": []}).json() == {"rewards": [], "scores": []}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "request body: not JSON"),
        ([1, 2], "request body: expected a JSON object"),
        ({"completions": ["a"]}, "prompts: missing, or not a list"),
        ({"query": ["ab"]}, "prompts: missing, or not a list; OpenRLHF's 'query' alone cannot be split"),
        ({"prompts": ["p", 3], "completions": ["a", "b"]}, "prompts[1]: expected text or a list of {role, content} messages"),
        ({"prompts": [[{"role": "user"}]], "completions": ["a"]}, "prompts[0]: expected text or a list of {role, content} messages"),
        ({"prompts": ["p", "q"], "completions": ["a"]}, "completions: 1 values for 2 prompts"),
        ({"prompts": ["p"], "completions": [None]}, "completions[0]: expected text"),
        ({"prompts": ["p"], "query": ["xpa"]}, "query[0]: does not start with prompts[0]"),
        ({"prompts": ["p"], "completions": ["a"], "columns": {"answer": ["1", "2"]}}, "columns.answer: expected a list of 1 values"),
        ({"prompts": ["p"], "completions": ["a"], "columns": ["answer"]}, "columns: expected an object"),
        ({"prompts": ["p"], "completions": ["a"], "labels": "a"}, "labels: expected a list of 1 values"),
        ({"prompts": ["p"], "completions": ["a"], "columns": {"answer": ["a"]}, "global_step": "3"}, "global_step: expected an integer"),
        (b'{"prompts": ["p"], "completions": [', "request body: not JSON"),  # cut short
        (b"\xff\xfe{}", "request body: not JSON"),  # not UTF-8
        (b"[" * 100_000, "request body: not JSON"),  # nested past the parser's recursion limit
        ("a string", "request body: expected a JSON object"),
        (None, "request body: expected a JSON object"),
        ({"prompts": "p", "completions": ["a"]}, "prompts: missing, or not a list"),
        ({"prompts": ["p"], "completions": "a"}, "completions: missing, or not a list"),
        ({"prompts": [{"role": "user", "content": "hi"}], "completions": ["a"]}, "prompts[0]: expected text"),  # a message, not a list of them
        ({"prompts": ["p"], "completions": ["a"], "columns": {"answer": "a"}}, "columns.answer: expected a list of 1 values"),
        ({"prompts": ["p"], "completions": ["a"], "columns": []}, "columns: expected an object"),  # empty, so falsy: still the wrong type
        ({"prompts": ["p"], "completions": ["a"], "columns": 0}, "columns: expected an object"),
        ({"prompts": ["p"], "completions": ["a"], "global_step": 1.5}, "global_step: expected an integer"),
        ({"prompts": ["p"], "completions": ["a"], "global_step": True}, "global_step: expected an integer"),
    ],
)
def test_a_malformed_request_is_a_400_naming_the_field(served, body, message):
    response = served.post("/score", content=body) if isinstance(body, bytes) else served.post("/score", content=json.dumps(body))
    assert response.status_code == 400 and message in response.json()["error"], response.text


def test_a_function_failure_is_a_500_naming_the_function_and_prompt_without_a_traceback():
    def picky(prompts, completions):
        if any("bad" in c for c in completions):
            raise KeyError("no score for bad")
        return [1.0] * len(prompts)

    def short(prompts, completions):
        return [1.0]

    def not_finite(prompts, completions):
        return [float("inf")] * len(prompts)

    for fn, message in [
        (picky, "reward function picky raised KeyError: 'no score for bad' (prompt 'q')"),
        (short, "reward function short returned 1 rewards for 2 completions (first prompt 'p')"),
        (not_finite, "reward function not_finite returned inf (expected a finite number"),
    ]:
        with running(create_app(fn)) as url:
            response = httpx.post(f"{url}/score", json={"prompts": ["p", "q"], "completions": ["ok", "bad"]}, timeout=30)
        body = response.json()
        assert response.status_code == 500 and body["retryable"] is False and message in body["error"], body
        assert "Traceback" not in response.text


def test_async_functions_none_and_tensors_are_served():
    async def later(prompts, completions):
        return [None if c == "" else 2.0 for c in completions]

    def as_tensor(prompts, completions):
        return torch.tensor([0.5] * len(prompts))

    with running(create_app(later)) as url:
        assert RemoteReward(f"{url}/score")(["p", "q"], ["", "x"]) == [None, 2.0]
    with running(create_app(as_tensor)) as url:
        assert RemoteReward(f"{url}/score")(["p", "q"], ["", "x"]) == [0.5, 0.5]


def test_scores_the_trainer_takes_are_served_and_unscored_rows_stay_unscored():
    import numpy as np

    from rlalign.lm.reward_calls import UNSCORED, CallPolicy, score_terms

    def mixed(prompts, completions):
        kinds = {"f32": np.float32(0.25), "bool": True, "npbool": np.bool_(False), "i64": np.int64(3), "0d": torch.tensor(1.5),
                 "1el": torch.tensor([2.5]), "none": None, "timeout": UNSCORED}
        return [kinds[c] for c in completions]

    rows = ["f32", "bool", "npbool", "i64", "0d", "1el", "none", "timeout"]
    local = score_terms([CallPolicy("mixed", mixed)], ["p"] * 8, rows)[0]
    with running(create_app(mixed)) as url:
        answer = httpx.post(f"{url}/score", json={"prompts": ["p"] * 8, "completions": rows}, timeout=30)
        remote = RemoteReward(f"{url}/score", batch_size=3)  # the unscored row is row 1 of the third request
        served = remote(["p"] * 8, rows)
        through = score_terms([CallPolicy("remote", remote)], ["p"] * 8, rows)[0]
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"rewards": [0.25, 1.0, 0.0, 3.0, 1.5, 2.5, None, None], "scores": [0.25, 1.0, 0.0, 3.0, 1.5, 2.5, None, None], "unscored": [7]}
    assert served == [0.25, 1.0, 0.0, 3.0, 1.5, 2.5, None, UNSCORED]
    assert torch.equal(through.values.isnan(), local.values.isnan()) and torch.equal(through.failed, local.failed)
    assert through.failed.tolist() == [False] * 7 + [True] and through.values.nan_to_num(-1).tolist() == [0.25, 1.0, 0.0, 3.0, 1.5, 2.5, -1, -1]


def test_after_a_function_raises_the_server_goes_on_scoring():
    def picky(prompts, completions):
        if "bad" in completions:
            raise ValueError("cannot score bad")
        return [1.0] * len(prompts)

    with running(create_app(picky)) as url:
        failed = httpx.post(f"{url}/score", json={"prompts": ["p"], "completions": ["bad"]}, timeout=30)
        scored = httpx.post(f"{url}/score", json={"prompts": ["p"], "completions": ["good"]}, timeout=30)
    assert failed.status_code == 500 and "reward function picky raised ValueError: cannot score bad" in failed.json()["error"]
    assert scored.status_code == 200 and scored.json()["rewards"] == [1.0]


# -- authentication ---------------------------------------------------------------------------------

TOKEN = "s3cret-token-for-tests"
GOOD_ROW = {"prompts": ["1+1="], "completions": ["2"], "columns": {"answer": ["2"]}}


@pytest.fixture(scope="module")
def guarded():
    with running(create_app(with_answer, token=TOKEN)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def test_with_a_token_every_route_but_health_needs_it(guarded):
    assert guarded.get("/health").json() == {"status": "ok", "reward": "with_answer"}  # no header needed
    for route in ("/score", "/get_reward"):
        missing = guarded.post(route, json=GOOD_ROW)
        assert missing.status_code == 401 and "needs the header 'Authorization: Bearer <token>'" in missing.json()["error"]
        assert missing.headers["www-authenticate"].startswith("Bearer")
    assert guarded.get("/no-such-route").status_code == 401  # refused before routing, so nothing behind it is reachable
    assert guarded.post("/score", json=GOOD_ROW, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401  # the wrong scheme
    answer = guarded.post("/score", json=GOOD_ROW, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200 and answer.json()["rewards"] == [1.0]
    assert guarded.post("/get_reward", json=GOOD_ROW, headers={"authorization": f"bearer {TOKEN}"}).status_code == 200  # case-insensitive scheme


@pytest.mark.parametrize("wrong", ["nope", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "é" + TOKEN[1:]])
def test_a_wrong_token_is_refused_with_401_and_compared_in_constant_time(guarded, monkeypatch, wrong):
    compared, real = [], hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    response = guarded.post("/score", json=GOOD_ROW, headers={"Authorization": f"Bearer {wrong}".encode()})
    assert response.status_code == 401 and response.json() == {"error": "the bearer token was refused"}
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert compared == [(wrong.encode(), TOKEN.encode())]  # bytes: the header as sent against the token
    assert TOKEN not in response.text


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("reward.example.com", False), ("::ffff:127.0.0.1", False),
])
def test_which_hosts_need_a_token(host, loopback):
    assert is_loopback(host) is loopback
    assert server_token(host, "t", no_auth=False) == "t" and server_token(host, None, no_auth=True) is None
    if loopback:
        assert server_token(host, None, no_auth=False) is None and server_token(host, "", no_auth=False) is None
    else:
        for token in (None, ""):
            with pytest.raises(RLAlignError, match=f"refusing to listen on {host} without a token: set the environment variable RLALIGN_REWARD_TOKEN"):
                server_token(host, token, no_auth=False)


def test_bad_tokens_and_limits_are_refused_without_showing_the_token(capsys):
    for bad in (" padded", "tab\there", "ünïcode"):
        with pytest.raises(RLAlignError, match="must be printable ASCII without surrounding spaces") as err:
            server_token("0.0.0.0", bad, no_auth=False)
        assert bad not in str(err.value)
    with pytest.raises(ValueError, match="token is empty"):
        create_app(with_answer, token="")
    with pytest.raises(ValueError, match="max_body_bytes and max_queue must be >= 1, got 16 and 0"):
        create_app(with_answer, max_body_bytes=16, max_queue=0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for limits in (["--max-queue", "0"], ["--max-body-mb", "0"]):
        assert serve_reward.run(parser.parse_args(["--function", "no_such_module:f", *limits])) == 2
        assert "--max-body-mb must be > 0 and --max-queue >= 1" in capsys.readouterr().err


def test_the_command_refuses_a_network_address_without_a_token_before_loading_anything():
    env = {k: v for k, v in os.environ.items() if k != "RLALIGN_REWARD_TOKEN"}
    # the function does not exist: refusing before loading it (so before binding) is the only way to get this message
    done = subprocess.run(
        [sys.executable, "-m", "rlalign", "serve-reward", "--function", "no_such_module:no_such_function", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "rlalign serve-reward: refusing to listen on 0.0.0.0 without a token: set the environment variable RLALIGN_REWARD_TOKEN "
        "(or pass --token), or pass --no-auth to serve anyone who can reach this address"
    ]


@pytest.mark.parametrize(
    ("argv", "env_token", "enforced", "warned"),
    [
        (["--host", "0.0.0.0"], TOKEN, TOKEN, False),  # the token from the environment
        (["--host", "0.0.0.0", "--token", "from-argv"], TOKEN, "from-argv", False),  # --token wins over the environment
        (["--host", "0.0.0.0", "--no-auth"], None, None, True),
        (["--host", "0.0.0.0", "--no-auth"], TOKEN, None, True),  # --no-auth means no token
        ([], None, None, False),  # loopback: a token is optional
        ([], TOKEN, TOKEN, False),  # ... and enforced when given
    ],
)
def test_the_command_serves_with_the_token_it_was_given(monkeypatch, capsys, argv, env_token, enforced, warned):
    """run() as the CLI calls it, with uvicorn's server replaced so nothing listens on 0.0.0.0; the app it
    would have served is then served on 127.0.0.1 to check which token it enforces."""
    built = {}

    def fake_server(app, host, port):
        built["app"], built["sock"] = app, socket.socket()
        built["sock"].bind(("127.0.0.1", 0))
        return SimpleNamespace(run=lambda sockets: None), built["sock"]

    if env_token is None:
        monkeypatch.delenv("RLALIGN_REWARD_TOKEN", raising=False)
    else:
        monkeypatch.setenv("RLALIGN_REWARD_TOKEN", env_token)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--function", f"{__name__}:with_answer", "--port", "0", *argv])
    with monkeypatch.context() as patch:
        patch.setattr(serve_reward, "_server", fake_server)
        assert serve_reward.run(args) == 0
    built["sock"].close()
    err = capsys.readouterr().err
    assert ("warning: listening on 0.0.0.0 without authentication (--no-auth)" in err) is warned
    with running(built["app"]) as url:
        bare = httpx.post(f"{url}/score", json=GOOD_ROW, timeout=30)
        assert bare.status_code == (200 if enforced is None else 401)
        if enforced is not None:
            assert httpx.post(f"{url}/score", json=GOOD_ROW, headers={"Authorization": f"Bearer {enforced}"}, timeout=30).status_code == 200


# -- limits -------------------------------------------------------------------------------------------

def reading(app, on_first_read):
    """``app``, calling ``on_first_read()`` when a request first reads its body (the server has admitted it by then)."""
    async def wrapped(scope, receive, send):
        first = [True]

        async def receive_and_tell():
            if first[0]:
                first[0] = False
                on_first_read()
            return await receive()

        await app(scope, receive_and_tell if scope["type"] == "http" else receive, send)

    return wrapped


def padded(limit: int) -> bytes:
    """A request body of exactly ``limit`` bytes (JSON allows trailing spaces)."""
    body = json.dumps(GOOD_ROW).encode()
    return body + b" " * (limit - len(body))


def test_a_body_over_the_limit_is_a_413_by_its_length_or_as_it_arrives_in_chunks():
    limit, reads = 200, []
    app = reading(create_app(with_answer, max_body_bytes=limit), lambda: reads.append(1))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        at_limit = client.post("/score", content=padded(limit))
        assert at_limit.status_code == 200 and at_limit.json()["rewards"] == [1.0]
        declared = client.post("/score", content=padded(limit + 1))
        assert declared.request.headers["content-length"] == str(limit + 1)
        assert declared.status_code == 413 and "request body: more than the server's limit of 200 bytes" in declared.json()["error"]
        assert len(reads) == 1  # refused on its Content-Length, before reading a byte of it
        # chunked: no Content-Length, so the server counts the bytes as they come
        body = padded(limit + 1)
        chunked = client.post("/score", content=iter([body[:150], body[150:]]))
        assert "content-length" not in chunked.request.headers and chunked.request.headers["transfer-encoding"] == "chunked"
        assert chunked.status_code == 413 and "more than the server's limit" in chunked.json()["error"]
        body = padded(limit)
        under = client.post("/score", content=iter([body[:150], body[150:]]))  # the same two chunks, at the limit: read whole
        assert under.status_code == 200 and under.json()["rewards"] == [1.0]


def test_requests_past_the_queue_limit_get_503_at_once_and_later_ones_are_served():
    """max_queue 2: one request being scored (blocked on an event) and one waiting for it fill the queue;
    a third gets 503 with Retry-After without waiting, and after the two finish a fourth is served."""
    entered, release = threading.Event(), threading.Event()
    calls = []

    def gated(prompts, completions):
        calls.append(completions[0])
        entered.set()
        assert release.wait(60), "the test never released the reward function"
        return [1.0] * len(prompts)

    bodies_read = threading.Semaphore(0)

    def post(client, completion):
        return client.post("/score", json={"prompts": ["p"], "completions": [completion]})

    with running(reading(create_app(gated, max_queue=2), bodies_read.release)) as url, httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(post, client, "first")
            assert entered.wait(60)  # being scored
            second = pool.submit(post, client, "second")
            assert bodies_read.acquire(timeout=60) and bodies_read.acquire(timeout=60)  # the first's body and the second's: both admitted
            refused = post(client, "third")
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "the server is busy: 2 scoring requests are already queued" in refused.json()["error"]
        finally:
            release.set()
        assert first.result(timeout=60).status_code == 200 and second.result(timeout=60).status_code == 200
        assert post(client, "fourth").json()["rewards"] == [1.0]
    assert calls == ["first", "second", "fourth"]  # the refused request never reached the function
