"""RemoteReward against real servers on 127.0.0.1: ``rlalign serve-reward``'s app serving a Python
function (scores equal the local call's), and scripted servers that fail, stall, or answer wrongly."""

from __future__ import annotations

import asyncio
import socket

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlalign.lm.remote_reward import RemoteReward
from rlalign.lm.reward_calls import UNSCORED, CallPolicy, async_entry, is_async_reward, score_terms
from rlalign.lm.rewards import RewardFunctionError, call_reward, score_completions
from rlalign.serve_reward import create_app, running


def scripted_app(*answers):
    """A server whose n-th POST /score gets ``answers[n]`` (the last one repeats): (delay s, status,
    JSON payload or raw bytes), or a function of the request body giving that. Returns (app, bodies seen)."""
    seen: list[dict] = []

    async def score(request: Request) -> Response:
        body = await request.json()
        seen.append(body)
        answer = answers[min(len(seen), len(answers)) - 1]
        delay, status, payload = answer(body) if callable(answer) else answer
        if delay:
            await asyncio.sleep(delay)
        if isinstance(payload, bytes):
            return Response(payload, status_code=status, media_type="application/json")
        return JSONResponse(payload, status_code=status)

    return Starlette(routes=[Route("/score", score, methods=["POST"])]), seen


def ok(body: dict) -> tuple[float, int, dict]:
    return 0.0, 200, {"rewards": [float(len(c)) for c in body["completions"]]}


def length_and_answer(prompts, completions, answer, **columns):
    """len(completion text) + 10 where it equals the answer; None for an empty completion."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else "".join(m["content"] for m in c)
        out.append(None if not text else len(text) + 10.0 * (text == a))
    return out


PROMPTS = ["1+1=", "2+2=", [{"role": "user", "content": "say hi"}], "x", "long prompt"]
COMPLETIONS = ["2", "five", [{"role": "assistant", "content": "hi"}], "", "abc"]
ANSWERS = ["2", "4", "hi", "", "abd"]


def test_remote_rewards_equal_the_local_functions_rewards():
    received = []

    def recording(prompts, completions, answer, **columns):
        received.append((prompts, completions, answer))
        return length_and_answer(prompts, completions, answer)

    recording.name = "length_and_answer"
    local = call_reward(length_and_answer, PROMPTS, COMPLETIONS, {"answer": ANSWERS}, {})
    assert local == [11.0, 4.0, 12.0, None, 3.0]  # "2" == "2": 1 + 10; "hi" == "hi": 2 + 10; "" -> None
    with running(create_app(recording)) as url:
        remote = RemoteReward(f"{url}/score", batch_size=2)
        assert remote(prompts=PROMPTS, completions=COMPLETIONS, answer=ANSWERS) == local
        assert asyncio.run(remote.acall(PROMPTS, COMPLETIONS, answer=ANSWERS)) == local
    # 3 batches of at most 2 rows each call, in flight together (so in any order); the messages arrive as they were sent
    batches = sorted(received[:3], key=lambda batch: PROMPTS.index(batch[0][0]))
    assert [len(p) for p, _, _ in batches] == [2, 2, 1]
    assert [x for p, _, _ in batches for x in p] == PROMPTS and [x for _, c, _ in batches for x in c] == COMPLETIONS
    assert [x for _, _, a in batches for x in a] == ANSWERS
    assert remote.requests == 6


def test_the_request_body_is_the_documented_protocol():
    app, seen = scripted_app(ok)
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", batch_size=8)
        state = type("State", (), {"global_step": 7})()
        remote(["a", "b"], ["xy", "z"], trainer_state=state, answer=["1", "2"], completion_ids=[[5, 6], [7]], not_per_row="ignored")
        remote(PROMPTS[2:3], COMPLETIONS[2:3])
    assert seen[0] == {
        "prompts": ["a", "b"], "completions": ["xy", "z"], "columns": {"answer": ["1", "2"], "completion_ids": [[5, 6], [7]]},
        "query": ["axy", "bz"], "labels": ["1", "2"], "global_step": 7,  # OpenRLHF's keys, from the texts and the answer column
    }
    assert seen[1] == {"prompts": PROMPTS[2:3], "completions": COMPLETIONS[2:3], "columns": {}}  # messages: no query


def test_the_episodes_environment_objects_are_not_sent():
    # score_shard hands every reward function TRL's `environments` keyword (one object per row) in an environment run;
    # they are objects of this process, not data: sending them was "columns.environments cannot be sent as JSON"
    app, seen = scripted_app(ok)
    with running(app) as url:
        remote = RemoteReward(f"{url}/score")
        assert remote(["a"], ["bc"], environments=[object()], answer=["1"]) == [2.0]
        assert asyncio.run(remote.acall(["a"], ["bc"], environments=[object()])) == [2.0]
    assert seen[0]["columns"] == {"answer": ["1"]} and seen[1]["columns"] == {}


def test_only_the_chosen_columns_are_sent_and_a_missing_or_unserialisable_one_is_an_error():
    app, seen = scripted_app(ok)
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", columns=["answer"], label_column=None)
        remote(["a"], ["b"], answer=["1"], completion_ids=[[1, 2]])
        assert seen[-1]["columns"] == {"answer": ["1"]} and "labels" not in seen[-1]
        with pytest.raises(RewardFunctionError, match="the rows have no column 'answer' to send .prompt 'a'"):
            remote(["a"], ["b"])
        with pytest.raises(RewardFunctionError, match=r"columns.answer cannot be sent as JSON .* \(prompt 'a'\)"):
            remote(["a"], ["b"], answer=[object()])
    assert len(seen) == 1


def test_batches_are_in_flight_together_and_come_back_in_row_order():
    inflight, most = 0, 0
    everyone = asyncio.Event()

    async def gather_then_answer(request: Request) -> JSONResponse:
        nonlocal inflight, most
        body = await request.json()
        inflight += 1
        most = max(most, inflight)
        if inflight == 4:
            everyone.set()
        try:
            await asyncio.wait_for(everyone.wait(), 2.0)  # a client sending one at a time leaves most == 1
        except TimeoutError:
            pass
        inflight -= 1
        return JSONResponse({"rewards": [float(i) for i in body["columns"]["i"]]})

    app = Starlette(routes=[Route("/score", gather_then_answer, methods=["POST"])])
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", batch_size=1, max_concurrency=4)
        assert remote(["p"] * 4, ["c"] * 4, i=[0, 1, 2, 3]) == [0.0, 1.0, 2.0, 3.0]
    assert most == 4


def test_a_server_that_fails_twice_then_answers_is_retried():
    app, seen = scripted_app((0, 503, {"error": "warming up"}), (0, 502, "bad gateway".encode()), ok)
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", max_retries=2, backoff=0.01)
        assert remote(["p", "q"], ["abc", "de"]) == [3.0, 2.0]
    assert len(seen) == 3 and remote.retries == 2
    assert remote.pop_stats() == {"retries": 2.0} and remote.pop_stats() == {"retries": 0.0}


def test_retries_run_out_with_an_error_naming_the_url_status_message_and_prompt():
    app, seen = scripted_app((0, 503, {"error": "overloaded, try later"}))
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", max_retries=2, backoff=0.01)
        with pytest.raises(RewardFunctionError) as err:
            remote(["first prompt", "second"], ["a", "b"])
    message = str(err.value)
    assert f"POST {url}/score failed after 3 tries: HTTP 503: overloaded, try later" in message and "'first prompt'" in message
    assert len(seen) == 3


def test_a_server_slower_than_the_time_limit_is_an_error_naming_the_url():
    app, seen = scripted_app((1.0, 200, {"rewards": [1.0]}))
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", timeout=0.2, max_retries=1, backoff=0.0)
        with pytest.raises(RewardFunctionError, match=rf"POST {url}/score failed after 2 tries: no answer within the time limit of 0.2 s .*'slow prompt'"):
            remote(["slow prompt"], ["c"])
    assert len(seen) == 2


def test_the_time_limit_is_for_the_whole_request_not_each_read():
    async def trickle(request: Request) -> StreamingResponse:
        async def chunks():
            yield b'{"rewards": [1.0'
            for _ in range(10):  # each piece comes well within 0.3 s, the whole answer in about 1 s
                await asyncio.sleep(0.1)
                yield b" "
            yield b"]}"

        return StreamingResponse(chunks(), media_type="application/json")

    app = Starlette(routes=[Route("/score", trickle, methods=["POST"])])
    with running(app) as url:
        with pytest.raises(RewardFunctionError, match=r"no answer within the time limit of 0.3 s"):
            RemoteReward(f"{url}/score", timeout=0.3, max_retries=0)(["p"], ["c"])
        assert RemoteReward(f"{url}/score", timeout=5.0, max_retries=0)(["p"], ["c"]) == [1.0]


def test_nothing_listening_is_an_error_after_the_retries():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    remote = RemoteReward(f"http://127.0.0.1:{port}/score", max_retries=1, backoff=0.0)
    with pytest.raises(RewardFunctionError, match=rf"POST http://127.0.0.1:{port}/score failed after 2 tries: ConnectError"):
        remote(["p"], ["c"])
    assert remote.retries == 1


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"rewards": [1.0]}, r"returned 1 rewards for 2 completions \(first prompt 'p0'\)"),
        ({"rewards": [1.0, "0.5"]}, r"returned '0.5' \(expected a finite number, or null .*\) for prompt 'p1'"),
        ({"rewards": [True, 1.0]}, r"returned True \(expected a finite number"),
        (b'{"rewards": [1.0, NaN]}', r"returned nan \(expected a finite number"),
        (b'{"rewards": [1.0, 1' + b"0" * 400 + b"]}", r"returned 10{99} \(expected a finite number"),  # past a float: was a bare OverflowError
        ({"scores": [1.0, 2.0]}, r"answered without a 'rewards' list \(got \['scores'\]\)"),
        ({"rewards": {"a": 1}}, r"returned dict .* not a list of rewards"),
        (b"<html>oops</html>", r"HTTP 200 with a body that is not JSON"),
        ({"rewards": [1.0, 2.0], "unscored": [1]}, r"answered 'unscored': \[1\], not a list of indices of rows whose reward is null"),
        ({"rewards": [1.0, None], "unscored": [2]}, r"answered 'unscored': \[2\], not a list of indices"),
        ({"rewards": [1.0, None], "unscored": 1}, r"answered 'unscored': 1, not a list of indices"),
    ],
)
def test_a_wrong_answer_is_an_error_at_once_never_a_zero(payload, error):
    app, seen = scripted_app((0, 200, payload))
    with running(app) as url:
        with pytest.raises(RewardFunctionError, match=error):
            RemoteReward(f"{url}/score", max_retries=3, backoff=0.01)(["p0", "p1"], ["a", "b"])
    assert len(seen) == 1  # not retried


def test_a_client_error_is_not_retried_and_its_message_is_shown():
    app, seen = scripted_app((0, 400, {"error": "completions: 1 values for 2 prompts"}))
    with running(app) as url:
        with pytest.raises(RewardFunctionError, match=r"HTTP 400: completions: 1 values for 2 prompts \(.*'p'"):
            RemoteReward(f"{url}/score", max_retries=3, backoff=0.01)(["p"], ["c"])
    assert len(seen) == 1


def test_a_raising_served_function_is_a_500_with_its_message_and_is_not_retried():
    calls = []

    def boom(prompts, completions):
        calls.append(list(prompts))
        if "bad row" in prompts:
            raise ValueError("cannot score this")
        return [1.0] * len(prompts)

    with running(create_app(boom)) as url:
        remote = RemoteReward(f"{url}/score", max_retries=3, backoff=0.01)
        with pytest.raises(RewardFunctionError) as err:
            remote(["fine", "bad row"], ["a", "b"])
    assert "HTTP 500: reward function boom raised ValueError: cannot score this (prompt 'bad row')" in str(err.value)
    assert calls == [["fine", "bad row"], ["fine"], ["bad row"]]  # one request; the server re-ran the rows to find the prompt
    assert remote.retries == 0


def test_a_sync_call_from_inside_an_event_loop_works():
    app, _ = scripted_app(ok)
    with running(app) as url:
        remote = RemoteReward(f"{url}/score")

        async def inside_a_loop():
            return remote(["p"], ["abcd"])  # a synchronous caller running on an event loop

        assert asyncio.run(inside_a_loop()) == [4.0]


def test_as_an_async_term_it_scores_the_same_and_keeps_its_name_and_counters():
    app, _ = scripted_app((0, 503, {"error": "busy"}), ok)
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", name="remote_len", batch_size=1, backoff=0.01)
        term = remote
        assert async_entry(term) == remote.acall and not is_async_reward(remote) and term.name == "remote_len"
        total = score_completions([term, lambda p, c: [1.0] * len(c)], ["p", "q"], ["abc", "de"], weights=[2.0, 1.0])
    assert total.tolist() == [7.0, 5.0]  # 2 len + 1
    assert term.pop_stats() == {"retries": 1.0}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must start with http"):
        RemoteReward("127.0.0.1:5000/score")
    with pytest.raises(ValueError, match="batch_size"):
        RemoteReward("http://127.0.0.1:5000/score", batch_size=0)


# -- authentication ---------------------------------------------------------------------------------

TOKEN = "client-side-s3cret"


def test_the_token_is_sent_as_a_bearer_header_to_a_guarded_server(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", TOKEN)
    with running(create_app(length_and_answer, token=TOKEN)) as url:
        assert RemoteReward(f"{url}/score", token=TOKEN)(["p", "q"], ["ab", "c"], answer=["ab", "x"]) == [12.0, 1.0]
        assert RemoteReward(f"{url}/score", token_env="REWARD_TOKEN_FOR_TEST")(["p"], ["ab"], answer=["ab"]) == [12.0]


def test_a_reward_url_term_reads_its_token_from_the_variable_its_config_names(monkeypatch):
    from rlalign.train.rl_config import RewardConfig
    from rlalign.train.rollouts import _remote_reward

    monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", TOKEN)
    monkeypatch.delenv("RLALIGN_REWARD_TOKEN", raising=False)
    with running(create_app(length_and_answer, token=TOKEN)) as url:
        named = _remote_reward(RewardConfig(reward_url=f"{url}/score", remote={"token_env": "REWARD_TOKEN_FOR_TEST"}))
        assert named(["p"], ["ab"], answer=["ab"]) == [12.0]
        default = RewardConfig(reward_url=f"{url}/score")
        assert default.remote.token_env == "RLALIGN_REWARD_TOKEN" and TOKEN not in default.model_dump_json()
        with pytest.raises(RewardFunctionError, match="none was sent: the environment variable RLALIGN_REWARD_TOKEN is not set"):
            _remote_reward(default)(["p"], ["ab"], answer=["ab"])
        monkeypatch.setenv("RLALIGN_REWARD_TOKEN", TOKEN)  # read when the term is built
        assert _remote_reward(default)(["p"], ["ab"], answer=["ab"]) == [12.0]


@pytest.mark.parametrize(
    ("env_token", "message"),
    [
        (None, "HTTP 401: the server needs a bearer token and none was sent: the environment variable REWARD_TOKEN_FOR_TEST is not set"),
        ("not-the-token", "HTTP 401: the server refused the bearer token from the environment variable REWARD_TOKEN_FOR_TEST"),
    ],
)
def test_a_401_says_the_token_was_missing_or_refused_names_the_variable_and_is_not_retried(monkeypatch, env_token, message):
    if env_token is None:
        monkeypatch.delenv("REWARD_TOKEN_FOR_TEST", raising=False)
    else:
        monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", env_token)
    with running(create_app(length_and_answer, token=TOKEN)) as url:
        remote = RemoteReward(f"{url}/score", token_env="REWARD_TOKEN_FOR_TEST", max_retries=3, backoff=0.01)
        with pytest.raises(RewardFunctionError) as err:
            remote(["first prompt"], ["a"], answer=["a"])
    assert f"POST {url}/score failed: {message}" in str(err.value) and "'first prompt'" in str(err.value)
    assert remote.retries == 0
    if env_token is not None:
        assert env_token not in str(err.value) and env_token not in repr(remote) and env_token not in str(remote.headers)


def test_a_server_quoting_the_token_back_in_its_401_does_not_put_it_in_the_error():
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"error": f"bad token {request.headers.get('authorization')}"}, status_code=401)

    app = Starlette(routes=[Route("/score", echo, methods=["POST"])])
    with running(app) as url:
        with pytest.raises(RewardFunctionError, match=r"HTTP 401: the server refused the bearer token passed as RemoteReward\(token=...\)") as err:
            RemoteReward(f"{url}/score", token=TOKEN)(["p"], ["c"])
    assert TOKEN not in str(err.value)


def test_a_token_a_header_cannot_carry_is_refused_without_showing_it():
    for bad in (" padded", "line\nbreak", "tab\there", "ünïcode"):
        with pytest.raises(ValueError, match=r"the bearer token passed as RemoteReward\(token=\.\.\.\) must be printable ASCII") as err:
            RemoteReward("http://127.0.0.1:5000/score", token=bad)
        assert bad not in str(err.value)


def test_unscored_rows_come_back_as_unscored_and_leave_training():
    app, _ = scripted_app((0, 200, {"rewards": [1.0, None, None], "unscored": [2]}))
    with running(app) as url:
        remote = RemoteReward(f"{url}/score")
        assert remote(["p"] * 3, ["a", "b", "c"]) == [1.0, None, UNSCORED]  # null alone: does not apply; listed: could not be scored
        result = score_terms([CallPolicy("remote", remote)], ["p"] * 3, ["a", "b", "c"])[0]
    assert result.values[0].item() == 1.0 and result.values[1:].isnan().all() and result.failed.tolist() == [False, False, True]


# -- a failed batch: the rows are asked again only when a row can be at fault ------------------------


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_server_that_is_down_is_asked_once_per_batch_not_once_per_row(on_error):
    app, seen = scripted_app((0, 503, {"error": "down"}))
    with running(app) as url:
        remote = RemoteReward(f"{url}/score", batch_size=64, max_retries=1, backoff=0.0)
        policy = CallPolicy("remote", remote, on_error=on_error)
        if on_error == "skip":
            result = score_terms([policy], ["p"] * 8, ["c"] * 8)[0]
            assert result.failed.all() and result.values.isnan().all()
        else:
            with pytest.raises(RewardFunctionError, match=r"remote raised EndpointUnavailable: POST .* failed after 2 tries: HTTP 503: down"):
                score_terms([policy], ["p"] * 8, ["c"] * 8)
    assert len(seen) == 2  # the batch and its 1 retry; re-running the 8 rows alone asked 2 + 8 x 2 = 18 times


def test_a_plain_500_may_be_a_rows_and_its_rows_are_asked_again():
    # OpenRLHF's serve_rm answers a row's exception with a plain 500 (no "retryable": false): only a down endpoint
    # (503, a timeout, refused connections) fails the batch as a whole; a 500 that keeps coming re-runs the rows
    app, seen = scripted_app((0, 500, {"error": "row 3 broke"}))
    with running(app) as url:
        result = score_terms([CallPolicy("remote", RemoteReward(f"{url}/score", max_retries=1, backoff=0.0), on_error="skip")], ["p"] * 3, ["c"] * 3)[0]
    assert result.failed.all() and len(seen) == 2 + 3 * 2  # the batch (and its retry), then each row (and its retry)


def test_a_server_refusing_the_token_is_asked_once():
    app, seen = scripted_app((0, 401, {"error": "no"}))
    with running(app) as url:
        result = score_terms([CallPolicy("remote", RemoteReward(f"{url}/score", max_retries=3), on_error="skip")], ["p"] * 5, ["c"] * 5)[0]
    assert result.failed.all() and len(seen) == 1  # a 401 is not retried, nor asked again per row (1 + 5 before)


def test_one_raising_row_in_a_batch_fails_alone_and_the_others_are_scored():
    calls = []

    def boom(prompts, completions):
        calls.append(list(completions))
        if "bad" in completions:
            raise ValueError("cannot score this")
        return [float(len(c)) for c in completions]

    with running(create_app(boom)) as url:
        policy = CallPolicy("remote", RemoteReward(f"{url}/score", max_retries=3, backoff=0.01), on_error="skip")
        result = score_terms([policy], ["p", "q", "r"], ["ab", "bad", "abcd"])[0]
    assert result.values[0].item() == 2.0 and result.values[1].isnan() and result.values[2].item() == 4.0
    assert result.failed.tolist() == [False, True, False]
    # the server got the batch (and re-ran it row by row itself to name the prompt), then each row alone, in any order
    assert calls[:3] == [["ab", "bad", "abcd"], ["ab"], ["bad"]] and sorted(map(tuple, calls[3:])) == [("ab",), ("abcd",), ("bad",)]
