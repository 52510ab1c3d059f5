"""Fault injection: GRPO and PPO runs killed with SIGKILL (while writing a checkpoint, while saving
the final model, at a random moment) and resumed until done end bit-identical to an uninterrupted
run, with exactly one metrics line per step and no temporary directory left; SIGTERM stops a run at
a step boundary with a checkpoint and a non-zero exit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from rlalign.cli import main
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train.checkpoints import list_checkpoints
from rlalign.train.metrics import read_metrics

STEPS = 4
# Runs the CLI in a child process that SIGKILLs itself at the n-th atomic rename of a checkpoint
# ("checkpoint") or of the final model ("final"): its files are written, the rename is not.
CHILD = """
import json, os, sys
import rlalign.train.checkpoints as checkpoints
import rlalign.train.loop as loop
mode, n, args = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
calls = [0]
def killing(original):
    def replace(tmp, final):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), 9)
        return original(tmp, final)
    return replace
if mode == "checkpoint":
    checkpoints.replace_dir = killing(checkpoints.replace_dir)
elif mode == "final":
    loop.replace_dir = killing(loop.replace_dir)
from rlalign.cli import main
sys.exit(main(args))
"""


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)


def command(trainer: str, tiny_path, out) -> list[str]:
    common = [f"model.path={tiny_path}", f"output_dir={out}", f"steps={STEPS}", "save_every=1", "keep_last=2", "progress=false", "plots=false",
              "data.task=arithmetic", "data.num_prompts=32", "sampling.max_new_tokens=4", "optim.lr=3e-3", "rewards=[{function: arithmetic}]"]
    if trainer.startswith("grpo"):
        asynchronous = ["async_rollouts.enabled=true", "async_rollouts.max_staleness=1", "tis_cap=2.0"] if trainer == "grpo-async" else []
        return ["grpo", *common, "prompts_per_step=2", "group_size=4", *asynchronous]
    return ["ppo", *common, "prompts_per_step=4", "ppo_epochs=1", "num_minibatches=2", "critic.optim.lr=3e-3"]


def child(mode: str, n: int, args: list[str], kill_after: float | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(n), json.dumps(args)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if kill_after is not None:
        try:
            proc.wait(kill_after)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(300)
    return proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "ppo", "grpo-async"])  # grpo-async: its checkpoints hold the rollout in flight
def test_killed_runs_resume_to_the_uninterrupted_runs_weights(trainer, tiny_path, tmp_path):
    assert main(command(trainer, tiny_path, tmp_path / "straight")) == 0
    out = tmp_path / "killed"
    args = command(trainer, tiny_path, out)
    rng = random.Random(trainer)
    kills = [("checkpoint", 2, None), ("final", 1, None), ("none", 0, rng.uniform(4.0, 8.0))]  # mid-checkpoint, mid-final, at random
    codes = []
    for attempt in range(12):
        resume = ["--resume", str(out)] if list_checkpoints(out) else ["overwrite=true"]
        mode, n, after = kills[attempt] if attempt < len(kills) else ("none", 0, None)
        codes.append(child(mode, n, args + resume, after))
        if codes[-1] == 0 and attempt >= len(kills) - 1:
            break
    assert codes[-1] == 0 and -signal.SIGKILL in codes[:2], codes
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [-1, *range(STEPS)]  # the evaluation before the first step, then one line a step
    assert not list(out.rglob(".tmp_*")) and not list(out.rglob(".old_*"))
    straight, resumed = (load_file(str(path / "final" / "model.safetensors")) for path in (tmp_path / "straight", out))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "grpo-async"])
def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(trainer, tiny_path, tmp_path):
    out = tmp_path / "run"
    args = command(trainer, tiny_path, out)
    args = [a for a in args if not a.startswith(("steps=", "save_every="))] + ["steps=200", "save_every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "rlalign", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 3):  # the evaluation and two steps
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "no step logged"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step" in err and "Traceback" not in err, err
    steps_done = len([r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 0])
    assert [int(p.name[5:]) for p in list_checkpoints(out)] == [steps_done]  # saved at the boundary it stopped at
    assert not (out / "final").exists() and not list(out.rglob(".tmp_*"))
