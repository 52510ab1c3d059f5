"""Producers and learners as ranks of one torch.distributed process group.

    torchrun --nproc-per-node 4 -m rlalign grpo --config configs/grpo_arithmetic.yaml \\
        async_rollouts.enabled=true async_rollouts.producers=2 async_rollouts.max_staleness=1 tis_cap=2

Of the N ranks, the first L = N - P learn (DDP or FSDP2 among themselves, in a process group of
their own, exactly as N = L processes would) and the last P only sample and score. Each step's global
batch is split into L learner shards as a synchronous run of L processes splits it; shard l of step s
is made by producer (s * L + l) mod P, with step s's sampling generator and the weights of version
max(0, s - k), so the tokens do not depend on which rank drew them: L learners and P producers train
as L synchronous processes would at k = 0, and as one asynchronous process would at k >= 1.

What travels, and how (torch.distributed only; no sockets or queues of our own):

- Weights (:mod:`rlalign.train.weight_sync`): learner rank 0 writes each version to one of k + 1
  slots, so it never waits for a producer that is still sampling, only before reusing a slot, whose
  version every producer is done with by then. Producers on its host map the slots (shared memory;
  CUDA IPC on a GPU); others get each version by an asynchronous broadcast (NCCL on GPUs).
- Rollouts: a producer sends each scored shard, serialised, by point-to-point send to the learner
  that trains it, in a gloo group of every rank (CPU tensors, as rollouts leave the sampler).
- Control: the run's c10d store (the one torchrun rendezvoused on) carries the small things: "shard
  (s, l) is ready", "version v is out", each producer's heartbeat and what it is doing, its error,
  and "stop". Every wait on it polls, has a time limit (``async_rollouts.timeout_s``), and five
  times a second the learner checks the producers' errors, heartbeats and (on its host) processes,
  so no rank hangs and the error names the rank, the step and what it was doing.

The scores a producer computes are its shard's; the learner that receives the shard gathers every
learner's (:func:`rlalign.train.rollouts.gather_scores`), so advantages and metrics are global.
A checkpoint holds each learner's rollouts in flight (gathered to rank 0), so a resumed run with
the same learner count trains on exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import datetime
import io
import itertools
import json
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from rlalign.config import ConfigError
from rlalign.train import distributed, seeding
from rlalign.train.batches import RolloutProducerError, StepState, batch_from_state, batch_state, check_in_flight, to_bytes
from rlalign.train.rollouts import gather_scores
from rlalign.train.sources import RolloutSource, ScoredBatch
from rlalign.train.weight_sync import open_weights

__all__ = ["RankSource", "RankProducer", "producer_of", "open_rank_source"]

_CHECK_S = 0.2  # seconds between checks of the producers while a learner waits
_HEARTBEAT_S = 1.0
_SILENT_S = 60.0  # a producer on another host silent this long has stopped answering (on this host its process is checked)


def producer_of(step: int, shard: int, learners: int, producers: int) -> int:
    """The producer (index among the producers) that makes learner ``shard``'s share of ``step``."""
    return (step * learners + shard) % producers


_RUNS = itertools.count()  # runs of this process group so far: every rank opens its sources in the same order


class _Store:
    """The job's c10d store, under a prefix of this attempt (a torchrun restart starts clean) and this run
    (a script may train several times in one launch), one call at a time (a producer's heartbeat thread
    shares the client with its main thread)."""

    def __init__(self, run: int):
        from torch.distributed.distributed_c10d import _get_default_store

        self._store = dist.PrefixStore(f"rlalign/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{run}/", _get_default_store())
        self._lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._store.get(key)

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return self._store.add(key, amount)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (not gone, not a zombie waiting for torchrun to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # no /proc to read: trust the heartbeat


class _Control:
    """The store's keys of one run, and waits on them with a time limit and a check five times a second."""

    def __init__(self, world: distributed.World, timeout_s: float):
        self.run = next(_RUNS)
        self.store, self.world, self.timeout_s = _Store(self.run), world, timeout_s
        self.beats = 0  # a producer's heartbeats so far
        self.heard: dict[int, tuple[int, float]] = {}  # a learner's: producer -> (its last beat seen, when, on this clock)

    def timed_out(self, what: str) -> RolloutProducerError:
        return RolloutProducerError(f"{what}: not done in {self.timeout_s:.0f} s (async_rollouts.timeout_s)")

    def producer_rank(self, producer: int) -> int:
        return self.world.learners + producer

    def say(self, producer: int, text: str) -> None:
        self.beats += 1
        self.store.set(f"status/{producer}", json.dumps({"beat": self.beats, "doing": text, "host": socket.gethostname(), "pid": os.getpid()}))

    def doing(self, producer: int) -> tuple[str, float, bool]:
        """What producer ``producer`` last said it was doing, for how many seconds of this process's clock nothing new
        came from it (no clock is compared across hosts), and whether its process is known to be gone (on this host:
        no such process, or a zombie)."""
        now = time.monotonic()
        if not self.store.check([f"status/{producer}"]):
            return "starting", 0.0, False
        said = json.loads(self.store.get(f"status/{producer}"))
        beat, since = self.heard.get(producer, (-1, now))
        if said["beat"] != beat:
            beat, since = said["beat"], now
        self.heard[producer] = (beat, since)
        return said["doing"], now - since, said["host"] == socket.gethostname() and not _alive(said["pid"])

    def fail(self, producer: int, step: int, doing: str, error: str) -> None:
        self.store.set(f"error/{producer}", json.dumps({"step": step, "doing": doing, "error": error}))

    def check_producers(self, producers: range) -> None:
        """Raise the first producer error, or name a producer whose heartbeat stopped."""
        for p in producers:
            if self.store.check([f"error/{p}"]):
                e = json.loads(self.store.get(f"error/{p}"))
                raise RolloutProducerError(
                    f"producer rank {self.producer_rank(p)} failed at step {e['step']} while {e['doing']}; the learners wrote nothing for "
                    f"that step, so their last checkpoint is whole:\n{e['error']}"
                )
            doing, ago, gone = self.doing(p)
            if gone:
                raise RolloutProducerError(
                    f"producer rank {self.producer_rank(p)} died (its process is gone); its last word: {doing}. "
                    "The learners' last checkpoint is whole"
                )
            if ago > _SILENT_S:
                raise RolloutProducerError(
                    f"producer rank {self.producer_rank(p)} stopped answering: no heartbeat for {ago:.0f} s; its last word: {doing}. "
                    "The learners' last checkpoint is whole"
                )

    def poll(self, done: Callable[[], bool], what: str, check: Callable[[], None], stoppable: bool = True) -> bool:
        """Wait until ``done()`` (``what``: the wait's name in the error), calling ``check`` five times a second,
        within ``timeout_s``. Returns False when ``stoppable`` and the learners asked to stop first."""
        start = last_check = time.monotonic()
        pause = 0.0005
        while not done():
            now = time.monotonic()
            if now - last_check >= _CHECK_S:
                check()  # first: a learner that stopped the run for a producer's fault set "stop" too
                if stoppable and self.store.check(["stop"]):
                    return False
                last_check = now
            if now - start > self.timeout_s:
                raise self.timed_out(what)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True

    def wait(self, key: str, what: str, check: Callable[[], None]) -> bool:
        """:meth:`poll` until ``key`` is in the store."""
        return self.poll(lambda: self.store.check([key]), what, check)


def _over_learners(metrics: dict[str, float], world: distributed.World) -> dict[str, float]:
    """A source's metrics of each learner's shard -> of the step: maxima (``*_max``, ``*/max``) the largest; a ratio
    that comes with its denominator (``weight/<name>``, from a producer's view) the mean weighted by it (the
    ratio of the sums); the rest (means over rows of equal shards) their mean."""
    names = sorted(n for n in metrics if not n.startswith("weight/"))
    out = {n: distributed.all_max(metrics[n], world) for n in names if n.endswith(("_max", "/max"))}
    means = [n for n in names if n not in out]
    weights = [metrics.get(f"weight/{n}", 1.0) for n in means]
    sums = distributed.all_sum(torch.tensor([metrics[n] * w for n, w in zip(means, weights)] + weights, dtype=torch.float64), world).tolist()
    return {**out, **{n: total / max(weight, 1e-12) for n, total, weight in zip(means, sums[: len(means)], sums[len(means):])}}


class RankSource:
    """A learner's side: its shard of each step from the producer that makes it (module docstring)."""

    def __init__(self, world: distributed.World, updater, cfg, first_step: int, total_steps: int, restored: list[ScoredBatch] = ()):
        self.world, self.k, self.total_steps = world, cfg.max_staleness, total_steps
        self.control = _Control(world, cfg.timeout_s)
        self.rollout_group = dist.new_group(list(range(world.learners + world.producers)), backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        self.weights = open_weights(world, updater.module, self.k, first_step, total_steps - 1 - self.k, self.control, cfg.weight_transport, cfg.timeout_s,
                                    self.rollout_group)  # the versions the producers sample with: first_step .. total - 1 - k
        self.buffer: dict[int, ScoredBatch] = {first_step + i: batch for i, batch in enumerate(restored)}  # step -> this learner's shard
        self.next_step = first_step
        self.publish(updater.module, first_step)  # the producers start from the learner's weights, whatever they loaded

    def _check(self) -> None:
        self.control.check_producers(range(self.world.producers))

    def _receive(self, step: int) -> None:
        """Shard ``world.rank`` of ``step`` from its producer, scores gathered from every learner."""
        w = self.world
        p = producer_of(step, w.rank, w.learners, w.producers)
        key = f"batch/{step}/{w.rank}"
        if not self.control.wait(key, f"learner rank {w.rank} waiting for step {step} from producer rank {self.control.producer_rank(p)}", self._check):
            raise RolloutProducerError(f"the run was stopped while learner rank {w.rank} waited for step {step}")
        payload = torch.empty(int(self.control.store.get(key)), dtype=torch.uint8)
        try:
            dist.recv(payload, src=self.control.producer_rank(p), group=self.rollout_group)
        except RuntimeError as err:  # the producer went away with the rollout still unsent: say which and why, if it can be told
            self._check()
            raise RolloutProducerError(
                f"learner rank {w.rank} lost step {step}'s rollout from producer rank {self.control.producer_rank(p)} in transfer: {err}"
            ) from None
        batch = batch_from_state(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True))
        self.buffer[step] = batch

    def next(self, state) -> ScoredBatch:
        start = time.perf_counter()
        if state.step not in self.buffer:
            self._receive(state.step)
        batch = self.buffer.pop(state.step)
        self.next_step = state.step + 1
        batch.scored = gather_scores(batch.scored, self.world)
        staleness = float(state.step - batch.version)
        batch.metrics.update({"staleness/mean": staleness, "staleness/max": staleness, "time/queue_wait": time.perf_counter() - start})
        batch.metrics = _over_learners(batch.metrics, self.world)
        return batch

    def publish(self, policy: nn.Module, version: int) -> float:
        """The weights of ``version`` to every producer (:mod:`rlalign.train.weight_sync`)."""
        return self.weights.publish(version, self._check)

    def state_dict(self) -> dict:
        """Every learner's rollouts in flight (steps next..next + k - 1), gathered for rank 0's checkpoint."""
        last = min(self.next_step + self.k, self.total_steps)
        for step in range(self.next_step, last):
            if step not in self.buffer:
                self._receive(step)
        mine = [batch_state(self.buffer[step]) for step in range(self.next_step, last)]
        everyone: list = [None] * self.world.size
        if self.world.distributed:
            dist.all_gather_object(everyone, mine, group=self.world.group)
        else:
            everyone = [mine]
        return {"async_rollouts_by_learner": everyone}

    def close(self) -> None:
        """Tell the producers to stop (a normal end, or an error on this side) and let them go."""
        self.control.store.set("stop", "1")
        if hasattr(self.weights, "close"):
            self.weights.close()


class RankProducer:
    """A producer rank: its tasks (step, learner shard) in step order, each sampled with the weights of
    version max(0, step - k) and sent to the learner that trains it."""

    def __init__(self, world: distributed.World, updater, build: Callable[[distributed.World], RolloutSource], cfg, first_step: int, total_steps: int,
                 restored_steps: int, seed: int = 0):
        self.world, self.updater, self.k, self.total_steps, self.seed = world, updater, cfg.max_staleness, total_steps, seed
        self.control = _Control(world, cfg.timeout_s)
        self.rollout_group = dist.new_group(list(range(world.learners + world.producers)), backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        self.weights = open_weights(world, updater.module, self.k, first_step, total_steps - 1 - self.k, self.control, cfg.weight_transport, cfg.timeout_s,
                                    self.rollout_group)
        try:
            self.sources = [build(world.view_of(rank)) for rank in range(world.learners)]  # each learner shard's source
        except BaseException:
            self.control.fail(world.producer, first_step, "building its rollout sources", traceback.format_exc(limit=8))
            raise
        self.first_version = first_step
        first_to_make = first_step + restored_steps
        self.tasks = [(s, r) for s in range(first_to_make, total_steps) for r in range(world.learners) if producer_of(s, r, world.learners, world.producers) == world.producer]
        self.activity, self.sends = "starting", []
        self.step = first_to_make

    def say(self, text: str) -> None:
        self.activity = text
        self.control.say(self.world.producer, text)

    def _heartbeat(self, done: threading.Event) -> None:
        while not done.wait(_HEARTBEAT_S):
            self.control.say(self.world.producer, self.activity)

    def _load(self, need: int) -> bool:
        """The weights of version ``need`` in this producer's policy; False when the learners stopped the run."""
        before = self.weights.version
        self.say(f"waiting for the weights of version {need} to sample step {self.step}")
        if not self.weights.bring_to(need, f"producer rank {self.world.global_rank}"):
            return False
        if self.weights.version != before:
            self.updater.updates += 1  # a sampling copy in another dtype refreshes from the new weights
        return True

    def produce(self) -> None:
        """Make every task, then receive the versions left (every producer takes part in every broadcast)."""
        done = threading.Event()
        heartbeat = threading.Thread(target=self._heartbeat, args=(done,), name="rlalign-heartbeat", daemon=True)
        heartbeat.start()
        # SIGINT and SIGTERM are the learners' to act on: they stop at the end of a step and checkpoint, which needs the
        # rollouts in flight from us, then say stop
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for step, shard in self.tasks:
                self.step = step
                idle_from = time.perf_counter()
                if not self._load(max(0, step - self.k, self.first_version)):
                    self.weights.release()  # the learners stopped the run
                    return
                idle = time.perf_counter() - idle_from
                self.say(f"sampling and scoring step {step} for learner rank {shard} with the weights of version {self.weights.version}")
                seeding.reseed_for_step(self.seed, step * self.world.learners + shard)  # a reward drawing from them draws alike after a resume
                batch = self.sources[shard].next(StepState(step))
                batch.version = self.weights.version
                batch.metrics["time/producer_idle"] = idle
                payload = torch.frombuffer(bytearray(to_bytes(batch_state(batch))), dtype=torch.uint8)
                self.sends.append(dist.isend(payload, dst=shard, group=self.rollout_group))
                self.control.store.set(f"batch/{step}/{shard}", str(payload.numel()))
            self.step = self.total_steps
            if not self.weights.drain(f"producer rank {self.world.global_rank} after its last step"):
                self.weights.release()
                return
            self.say("done: waiting for the learners to receive the last rollouts")
            for work in self.sends:
                work.wait()
        except BaseException as err:  # noqa: BLE001 - named for the learners, then raised here too
            self.control.fail(self.world.producer, self.step, self.activity, traceback.format_exc(limit=8))
            try:  # let the learners say it first: they stop the run when they read the error
                self.control.wait("stop", "the learners reading this producer's error", lambda: None)
                self.weights.release()
            except (RolloutProducerError, RuntimeError):
                pass
            raise RolloutProducerError(f"producer rank {self.world.global_rank} failed at step {self.step} while {self.activity}") from err
        finally:
            done.set()
            heartbeat.join(timeout=5.0)  # not inside a store call when the process ends
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    # a producer rank hands out nothing to train on: the lifecycle runs produce() instead of the steps
    def next(self, state) -> ScoredBatch:
        raise RuntimeError("a producer rank does not train")

    def publish(self, policy: nn.Module, version: int) -> float:
        return 0.0

    def state_dict(self) -> dict:
        return {}

    def close(self) -> None:
        for source in self.sources:
            source.close()


def open_rank_source(cfg, run, updater, state, build: Callable[[distributed.World], RolloutSource]) -> RankSource | RankProducer:
    """This rank's side of the producer ranks: a :class:`RankProducer` on a producer, else a
    :class:`RankSource` holding the checkpoint's rollouts in flight for this learner."""
    world, async_cfg = run.world, cfg.async_rollouts
    restored = (run.checkpoint.extra.get("async_rollouts_by_learner") if run.checkpoint else None) or []
    if restored and len(restored) != world.learners:
        raise ConfigError(
            f"the checkpoint holds the rollouts in flight of {len(restored)} learner ranks, and this run has {world.learners}: "
            "resume with the same number of learners (processes minus async_rollouts.producers)"
        )
    check_in_flight(len(restored[0]) if restored else 0, async_cfg.max_staleness, state.step, cfg.steps, run.checkpoint)
    if world.producer is not None:
        return RankProducer(world, updater, build, async_cfg, state.step, cfg.steps, len(restored[0]) if restored else 0, cfg.seed)
    mine = [batch_from_state(b) for b in restored[world.rank]] if restored else []
    return RankSource(world, updater, async_cfg, state.step, cfg.steps, mine)
