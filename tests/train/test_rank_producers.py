"""Producers and learners as ranks (rlalign.train.rank_source), four processes under torchrun (gloo, CPU).

Two learners (DDP, and FSDP2) and two producers (``async_rollouts.producers=2``), and one learner and
three producers, run GRPO (and PPO) through the real CLI, the weights through shared slots (the
default on one host) and by broadcast. At k = 0 they end with the weights of a one-process
synchronous run of the same global batch and seed, to float32 round-off; at k = 1 they log the
metrics of a one-process asynchronous run (a producer process beside the learner) and end with its
weights; a run resumed from their step-1 checkpoint (rollouts in flight included) ends
bit-identical to the uninterrupted one. A producer rank that raises, or dies, stops every rank with
a message naming it, the step and what it was doing, within the time limits, and the learners'
last checkpoint stays whole.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlalign.config import ConfigError
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import distributed
from rlalign.train.checkpoints import load_checkpoint
from rlalign.train.rank_source import producer_of
from tests.train.run_records import compared_metrics, load_script

RUNS = Path(__file__).with_name("rank_runs.py")
NOT_COMPARED = ("time", "tokens_per_s", "memory/")  # wall-clock metrics; rows per forward (a process's own)
ROOT = Path(__file__).resolve().parents[2]


def _load_runs():
    return load_script(RUNS)


def _weights(final: Path) -> dict[str, torch.Tensor]:
    return load_file(str(final / "model.safetensors"))


def _metrics(run: Path) -> list[dict[str, float]]:
    return compared_metrics(run, NOT_COMPARED)


def _torchrun(root: Path, tiny: Path, *runs: str, producers: int = 2, out: str = "ranks") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RLALIGN_RANK_RUNS_PRODUCERS": str(producers)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(RUNS), str(root / out), str(tiny), *runs]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    tiny = build_tiny_checkpoint(root / "tiny", TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)
    done = _torchrun(root, tiny, "k0", "k0_broadcast", "k0_fsdp", "k1", "k1_broadcast", "k1_resumed", "ppo_k1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("weights to the 2 producer rank(s)")]
    shared, broadcast = (f"weights to the 2 producer rank(s): {how}" for how in ("shared slots on this host (weight_transport: shared)",
                                                                                "broadcast (weight_transport: broadcast)"))
    assert said == [shared, broadcast, shared, shared, broadcast, shared, shared]  # auto picks shared on one host
    assert not list(Path("/dev/shm").glob("rlalign-*"))  # the shared slots are gone with their runs
    # 1 learner + 3 producers: more producers than steps in flight, so some wait while others sample
    done = _torchrun(root, tiny, "k0", "k1", "k1_broadcast", producers=3, out="ranks3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(s["steps_run"] > 0, s["final"] is not None) for s in summaries] == [(True, True)] * 3  # the learner's line, once a run
    from rlalign.cli import main

    for name, argv in _load_runs().commands(str(root / "one"), str(tiny), 0).items():
        if name in ("k0", "k1", "ppo_k1"):
            assert main(argv) == 0, argv
    return root, tiny


@pytest.mark.parametrize("run, one", [
    ("k0", "k0"), ("k0_broadcast", "k0"), ("k0_fsdp", "k0"), ("k1", "k1"), ("k1_broadcast", "k1"), ("ppo_k1", "ppo_k1"),
    ("3/k0", "k0"), ("3/k1", "k1"), ("3/k1_broadcast", "k1"),
])
def test_learners_and_producers_train_as_one_process(runs, run, one):
    root, tiny = runs
    where, run = ("ranks3", run[2:]) if run.startswith("3/") else ("ranks", run)
    ref, got = _weights(root / "one" / one / "final"), _weights(root / where / run / "final")
    assert ref.keys() == got.keys() and ref
    for name in ref:
        # measured: largest difference ~2e-7 (round-off of sums split across two learners, through a few Adam steps)
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{run} {name}: {m}")
    start = _weights(tiny)
    assert max((ref[k] - v).abs().max().item() for k, v in start.items()) > 1e-3  # it trained
    m1, m2 = _metrics(root / "one" / one), _metrics(root / where / run)
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [-1, 0, 1, 2]
    for r1, r2 in zip(m1, m2):
        for key in set(r1) - {"time/producer_idle"}:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-5), (run, r1["step"], key)
    if run in ("k1", "ppo_k1"):  # the schedule: step s sampled by version max(0, s - 1)
        assert [r.get("staleness/mean") for r in m2[1:]] == [0.0, 1.0, 1.0]


def test_a_resumed_run_ends_bit_identical_with_the_rollouts_in_flight(runs):
    root, _ = runs
    ckpt = load_checkpoint(root / "ranks" / "k1" / "checkpoints" / "step_00000001")
    in_flight = ckpt.extra["async_rollouts_by_learner"]
    assert len(in_flight) == 2 and [len(b) for b in in_flight] == [1, 1]  # step 1's shard of each learner
    straight, resumed = _weights(root / "ranks" / "k1" / "final"), _weights(root / "ranks" / "k1_resumed" / "final")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    after = _metrics(root / "ranks" / "k1_resumed")
    assert [r["step"] for r in after] == [1, 2]
    assert after == [r for r in _metrics(root / "ranks" / "k1") if r["step"] in (1, 2)]


@pytest.mark.parametrize("fault, says", [
    ("raises", r"producer rank [23] failed at step 2 while sampling and scoring step 2 for learner rank [01] with the weights of version 1.*the reward service is down"),
    ("raises_broadcast", r"producer rank [23] failed at step 2 while sampling and scoring step 2 for learner rank [01] with the weights of version 1.*the reward service is down"),
    ("dies", r"producer rank [23] died \(its process is gone\); its last word: sampling and scoring step 2"),
])
def test_a_producer_rank_that_fails_stops_every_rank_with_one_named_message(runs, fault, says):
    root, tiny = runs
    done = _torchrun(root, tiny, fault)
    assert done.returncode != 0
    assert any(re.search(says, message, re.S) for message in done.stderr.split("rlalign grpo: ")), done.stderr[-5000:]
    # step 2's checkpoint needs step 2's rollout in flight (k = 1); step 1's may be lost too when the producer dies
    # with step 1's rollout still unsent. What was written is whole: it loads.
    written = sorted((root / "ranks" / fault / "checkpoints").glob("step_*"))
    assert [c.name for c in written] in (["step_00000001"], []) and (written or fault == "dies")
    assert all(load_checkpoint(c).step == 1 for c in written)


def test_each_learner_shard_of_each_step_has_one_producer_in_turn():
    # 2 learners, 2 producers: producer 0 makes learner 0's shards; 1 learner, 3 producers: the steps in turn
    assert [producer_of(s, r, 2, 2) for s in range(2) for r in range(2)] == [0, 1, 0, 1]
    assert [producer_of(s, 0, 1, 3) for s in range(4)] == [0, 1, 2, 0]
    assert [producer_of(s, r, 3, 2) for s in range(2) for r in range(3)] == [0, 1, 0, 1, 0, 1]


def test_producer_ranks_need_torchrun_and_a_learner(monkeypatch):
    with pytest.raises(ConfigError, match="launch with torchrun"):
        distributed.init("cpu", producers=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="leaves no learner among the 2 processes: at most 1"):
        distributed.init("cpu", producers=2)


def test_a_producers_view_shards_as_its_learner_and_never_communicates():
    learner = distributed.World(rank=1, size=2, learners=2, producers=2)
    producer = distributed.World(learners=2, producers=2, producer=1)
    view = producer.view_of(1)
    assert view.shard(8) == learner.shard(8) == slice(4, 8)
    assert not view.distributed and not view.is_main and not producer.is_main and learner.distributed
    assert producer.global_rank == 3 and learner.global_rank == 1
    x = torch.arange(3.0)
    assert distributed.gather_rows(x, view) is x and distributed.all_sum(x, view) is x


class _DictStore:
    """A stand-in for the job's store: a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


def test_the_learner_names_a_producer_that_failed_died_or_went_silent(monkeypatch):
    import socket
    import subprocess as sp

    from rlalign.train import rank_source

    monkeypatch.setattr(rank_source, "_Store", lambda run: _DictStore())
    control = rank_source._Control(distributed.World(learners=1, producers=2), timeout_s=5.0)
    producer = rank_source._Control(distributed.World(learners=1, producers=2, producer=0), timeout_s=5.0)
    producer.store = control.store
    producer.say(0, "sampling and scoring step 3")  # alive, on this host
    control.check_producers(range(1))
    # a process of this host that is gone: named as dead, with its last word
    gone = sp.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    control.store.set("status/1", json.dumps({"beat": 1, "doing": "waiting for the weights of version 2", "host": socket.gethostname(), "pid": gone.pid}))
    with pytest.raises(rank_source.RolloutProducerError, match=r"producer rank 2 died \(its process is gone\); its last word: waiting for the weights of version 2"):
        control.check_producers(range(2))
    # on another host: silent past the limit on the learner's own clock (no clock compared across hosts)
    control.store.set("status/1", json.dumps({"beat": 7, "doing": "sampling step 4", "host": "elsewhere", "pid": 1}))
    clock = iter([100.0, 100.0 + rank_source._SILENT_S + 1])
    monkeypatch.setattr(rank_source.time, "monotonic", lambda: next(clock))
    control.heard.clear()
    control.check_producers(range(1, 2))  # first heard at t = 100
    with pytest.raises(rank_source.RolloutProducerError, match=r"producer rank 2 stopped answering: no heartbeat for 61 s; its last word: sampling step 4"):
        control.check_producers(range(1, 2))
    # an error it reported: named with its step and what it was doing
    producer.fail(0, 5, "scoring step 5", "ValueError: boom")
    with pytest.raises(rank_source.RolloutProducerError, match=r"(?s)producer rank 1 failed at step 5 while scoring step 5.*ValueError: boom"):
        control.check_producers(range(2))
