"""``rlalign serve-reward``: a tiny reward model and Python functions served on 127.0.0.1 score what
they score locally; malformed requests get 400 naming the field; a raising function a 500 naming it."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytest.importorskip("starlette", reason="rlalign serve-reward needs the explore extra (starlette, uvicorn)")
pytest.importorskip("uvicorn", reason="rlalign serve-reward needs the explore extra (starlette, uvicorn)")

from rlalign.lm.heads import load_reward_model
from rlalign.lm.models import load_tokenizer
from rlalign.lm.remote_reward import RemoteReward
from rlalign.lm.rewards import RewardModelReward, reward_input_of
from rlalign.serve_reward import create_app, load_model_reward, running
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
    ],
)
def test_a_malformed_request_is_a_400_naming_the_field(served, body, message):
    response = served.post("/score", content=body) if isinstance(body, bytes) else served.post("/score", json=body)
    assert response.status_code == 400 and message in response.json()["error"]


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
