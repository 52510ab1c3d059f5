"""Asynchronous rollouts: a producer process samples and scores while the learner learns.

    source = open_source(cfg, run, updater, state, tools)   # AsyncSource when async_rollouts.enabled
    batch = source.next(state)                  # the rollout of step s, sampled by version max(0, s - k)
    ...updates...
    source.publish(updater.module, s + 1)       # the learner's weights after step s: version s + 1

The producer is a child process forked from the learner when the run starts, so it holds a copy of
everything the learner built (the policy, the tokenizer, the reward terms, the prompts, the in-process
source of :mod:`rlalign.train.sources`) without pickling any of it. It runs the in-process source on
its own copy of the policy, step after step, and puts each scored batch on a queue the learner reads.

The schedule is deterministic. The rollout of step s is sampled by exactly the weights of version
max(0, s - k) (``max_staleness`` k: the number of updates behind the learner), with step s's own
sampling generator (:func:`rlalign.train.sources.sampling_generator`), so a run, its resumed twin
and its synchronous twin (k = 0, which samples step s with the weights after s updates, as the
synchronous loop does) draw the same tokens. The producer runs at most k steps ahead, and waits when
it needs weights the learner has not published yet.

Weights travel through shared memory: k + 1 slots, each a copy of the policy's trainable tensors;
version v goes to slot v mod (k + 1) and its number to a queue. The learner never overwrites a slot
the producer still needs: when it writes version v it has consumed the rollout of step v - 1, which
the producer sampled after loading version v - 1 - k, the slot's previous occupant, so that is done.
(On GPUs the same schedule would carry the weights by NCCL broadcast, or by CUDA IPC handles to the
learner's tensors, from a producer started with ``spawn``; this module runs on CPU, where a fork is safe.)

Off-policy correction for k > 0 is the decoupled objective (Hilton et al. 2022; AReaL, Fu et al.
2025): the learner recomputes pi_old as its own policy before the update (the proximal policy), the
clipped ratio is taken against it, and each token's loss is weighted by the behaviour policy's
importance weight pi_prox / pi_behaviour, truncated at ``tis_cap`` or masked above it (``tis_mode``).
The trainers do this through ``recompute_old_logprobs`` and their importance weights; the config
requires ``tis_cap`` when k > 0.

Faults. A producer that raises stops the run with the producer's error, naming the step and what it
was doing; one that dies (killed, out of memory) stops it with its exit code and what it was doing.
Either way the learner has written nothing for that step, so its last checkpoint stays whole.
SIGINT reaches only the learner (the producer ignores it), which stops at the end of its step,
checkpoints and closes the producer. A checkpoint holds the rollouts in flight (those of steps
s..s + k - 1, already sampled by older weights), so a resumed run trains on exactly what the
uninterrupted one would have.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp
from torch import nn

from rlalign.config import ConfigError
from rlalign.train import distributed, seeding
from rlalign.train.batches import RolloutProducerError, StepState, batch_from_state, batch_state, check_in_flight, to_bytes, trainable
from rlalign.train.sources import RolloutSource, ScoredBatch, StepSeeded, make_source

__all__ = ["AsyncSource", "RolloutProducerError", "open_source", "source_builder", "check_one_process"]

_STATUS_BYTES = 240


def check_one_process(cfg, world: distributed.World) -> None:
    """Sources that need one process: dynamic sampling (the ranks would keep unequal numbers of groups),
    and an asynchronous producer process beside a torchrun rank (there, producers are ranks)."""
    if not world.distributed and world.producer is None:
        return
    if cfg.dynamic_sampling:
        raise ConfigError("dynamic_sampling runs in one process: under torchrun the ranks would keep unequal numbers of groups")
    if cfg.async_rollouts.enabled and not world.producers:
        raise ConfigError(
            "async_rollouts under torchrun makes some ranks producers: set async_rollouts.producers (e.g. 1) and launch that many more "
            "processes, or run synchronously (async_rollouts.enabled: false)"
        )


def open_source(cfg, run, updater, state, tools=None, build: Callable[[distributed.World], RolloutSource] | None = None, environment=None) -> RolloutSource:
    """The run's rollout source: ``build(world)``, by default the in-process source the config asks for
    (:func:`source_builder`), run by a producer process when ``cfg.async_rollouts.enabled``, or by
    producer ranks when ``cfg.async_rollouts.producers`` (:mod:`rlalign.train.rank_source`)."""
    restored = (run.checkpoint.extra.get("async_rollouts") if run.checkpoint else None) or []  # the rollouts in flight at the checkpoint
    # the producer's source goes on after them (dynamic sampling's data position), not after the last step trained
    position = next((b["data_position"] for b in reversed(restored) if b.get("data_position") is not None), state.data_position)
    build = build or source_builder(cfg, run, updater, state, tools, environment, position)
    if not cfg.async_rollouts.enabled:
        return StepSeeded(build(run.world), cfg.seed, run.world)  # the global RNGs seeded per step, as a producer's
    if run.world.producers:
        from rlalign.train.rank_source import open_rank_source

        return open_rank_source(cfg, run, updater, state, build)
    if run.device != "cpu":
        raise ConfigError(
            f"a producer process beside the learner runs on the CPU (model.device={run.device}); on GPUs make producers ranks: "
            "torchrun --nproc-per-node 2 ... async_rollouts.producers=1"
        )
    check_in_flight(len(restored), cfg.async_rollouts.max_staleness, state.step, cfg.steps, run.checkpoint)
    return AsyncSource(build(run.world), updater, cfg.async_rollouts, state.step, cfg.steps, [batch_from_state(b) for b in restored], cfg.seed)



def source_builder(cfg, run, updater, state, tools=None, environment=None, data_position: int | None = None) -> Callable[[distributed.World], RolloutSource]:
    """``build(world)``: the in-process source of the config (agent, environment, or
    :func:`rlalign.train.sources.make_source`) making ``world``'s share of each step; ``data_position``: where
    dynamic sampling goes on (None: ``state.data_position``)."""

    def build(world: distributed.World) -> RolloutSource:
        if getattr(cfg, "agent", None) is not None:  # agent code behind the OpenAI-compatible endpoint
            from rlalign.agents.agent_source import make_agent_source

            return make_agent_source(cfg, updater, run.tokenizer, run.rewards, run.prompts, world)
        if getattr(cfg, "environment", None) is not None:  # episodes against a Python environment
            from rlalign.train.env_source import make_environment_source

            return make_environment_source(cfg, updater, run.tokenizer, run.rewards, run.prompts, world, environment)
        return make_source(cfg, updater, run.tokenizer, run.rewards, run.prompts, world, tools, state.data_position if data_position is None else data_position)

    return build


@dataclass
class _Producer:
    """The child's side: the in-process source, its policy copy, and where it reads and writes."""

    inner: object
    holder: object  # the Updater whose module (the child's copy of the policy) the inner source samples with
    slots: list[dict[str, torch.Tensor]]
    versions: object  # queue of published version numbers (None: stop)
    out: object  # queue of ("batch", step, state) / ("error", step, message)
    status: object  # shared bytes: what the producer is doing now
    k: int
    threads: int
    activity: str = "starting"
    scoring: set = field(default_factory=set)  # steps being scored on worker threads
    seed: int = 0  # the run's: the global RNGs are seeded from it and the step before a step is sampled or scored
    scoring_lock: object = field(default_factory=threading.Lock)

    def say(self, text: str | None = None) -> None:
        """Write what the producer is doing (``text``: the main thread's activity) and the steps being scored."""
        self.activity = self.activity if text is None else text
        scoring = sorted(self.scoring)
        line = self.activity + (f"; scoring step {', '.join(map(str, scoring))} on a worker thread" if scoring else "")
        data = line.encode()[: _STATUS_BYTES - 1]
        self.status[: len(data) + 1] = data + b"\0"

    def score(self, sampled):
        """The inner source's scoring of one step, on a worker thread, named in the status while it runs."""
        self.scoring.add(sampled.step)
        self.say()
        try:
            with self.scoring_lock:  # one step scored at a time on the global RNGs seeded for it: a reward drawing from them draws alike after a resume
                seeding.reseed_for_step(self.seed, sampled.step)
                return self.inner.score(sampled)
        finally:
            self.scoring.discard(sampled.step)
            self.say()

    def run(self, first_step: int, total_steps: int, version: int) -> None:
        """Sample the steps from ``first_step`` on, each with the weights of version max(0, step - k); a
        sender thread hands each over as soon as it is scored (scoring runs on worker threads, so one
        step's rewards are computed while the next step samples)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's to handle: it stops at a safe point and closes us
        _die_with_parent()
        torch.set_num_threads(self.threads)
        from rlalign.lm import reward_calls

        reward_calls.reset_event_loop()  # the learner's loop thread did not come with the fork
        scoring = concurrent.futures.ThreadPoolExecutor(self.k + 1, thread_name_prefix="rlalign-scoring")
        pending: queue.Queue = queue.Queue()  # (step, version, seconds idle before it, future of the scored batch), in step order; None: no more
        sender = threading.Thread(target=self.send, args=(pending,), name="rlalign-sender", daemon=True)
        sender.start()
        step = first_step
        try:
            for step in range(first_step, total_steps):
                need = max(0, step - self.k)
                idle_from = time.perf_counter()
                while version < need:
                    self.say(f"waiting for the weights of version {need} (has {version}) to sample step {step}")
                    published = self.versions.get()
                    if published is None:
                        return
                    if published == need:
                        self.load(published)
                    version = published
                idle = time.perf_counter() - idle_from  # waiting for the learner's weights
                self.say(f"sampling step {step} with the weights of version {version}")
                if getattr(self.inner, "pipelined", False):  # scored on a worker thread while the next step samples (seeded there)
                    future = scoring.submit(self.score, self.inner.sample(StepState(step)))
                else:
                    seeding.reseed_for_step(self.seed, step)
                    future = concurrent.futures.Future()
                    future.set_result(self.inner.next(StepState(step)))
                pending.put((step, version, idle, future))
            self.say("done sampling")
            pending.put(None)
            sender.join()
        except BaseException:  # noqa: BLE001 - every failure goes to the learner, named
            self.out.put(("error", step, traceback.format_exc(limit=8)))
        finally:
            scoring.shutdown(wait=False, cancel_futures=True)

    def send(self, pending: queue.Queue) -> None:
        """The sender thread: each scored batch to the learner's queue, in step order."""
        while (item := pending.get()) is not None:
            step, version, idle, future = item
            try:
                batch = future.result()
            except BaseException:  # noqa: BLE001 - the scoring's failure goes to the learner, named
                self.out.put(("error", step, traceback.format_exc(limit=8)))
                return
            batch.version = version
            batch.metrics["time/producer_idle"] = idle
            self.out.put(("batch", step, to_bytes(batch_state(batch))))

    def load(self, version: int) -> None:
        with torch.no_grad():
            for name, param in trainable(self.holder.module):
                param.copy_(self.slots[version % len(self.slots)][name])
        self.holder.updates += 1  # a sampling copy in another dtype refreshes from the new weights


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the learner dies, even by SIGKILL (no orphan producer)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the learner died before the call
        os._exit(1)


class AsyncSource:
    """The learner's side of an asynchronous source (module docstring)."""

    def __init__(self, inner, updater, cfg, first_step: int, total_steps: int, restored: list[ScoredBatch] = (), seed: int = 0):
        self.k, self.timeout_s, self.total_steps = cfg.max_staleness, cfg.timeout_s, total_steps
        self.buffer: dict[int, ScoredBatch] = {first_step + i: batch for i, batch in enumerate(restored)}  # step -> batch, in hand
        torch.set_num_threads(cfg.learner_threads)
        module = updater.module
        self.slots = [{name: p.detach().clone().share_memory_() for name, p in trainable(module)} for _ in range(self.k + 1)]
        ctx = mp.get_context("fork")
        self.versions, self.out = ctx.Queue(), ctx.Queue(maxsize=self.k + 1)
        self.status = ctx.Array("c", _STATUS_BYTES, lock=False)
        producer = _Producer(inner, updater, self.slots, self.versions, self.out, self.status, self.k, cfg.producer_threads, seed=seed)
        first_to_make = first_step + len(self.buffer)
        self.process = ctx.Process(target=producer.run, args=(first_to_make, total_steps, first_step), name="rlalign-rollout-producer", daemon=True)
        self.process.start()
        self.next_step = first_step

    def next(self, state) -> ScoredBatch:
        """The rollout of ``state.step``: from the checkpoint's in-flight ones, or the producer's queue."""
        start = time.perf_counter()
        while state.step not in self.buffer:
            self._receive()
        batch = self.buffer.pop(state.step)
        self.next_step = state.step + 1
        wait = time.perf_counter() - start
        staleness = float(state.step - batch.version)
        batch.metrics.update({"staleness/mean": staleness, "staleness/max": staleness, "time/queue_wait": wait})
        return batch

    def _receive(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                kind, step, payload = self.out.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RolloutProducerError(
                        f"the rollout producer (pid {self.process.pid}) died with exit code {self.process.exitcode} while {self._doing()}; "
                        "the learner wrote nothing for this step: its last checkpoint is whole"
                    ) from None
                if time.monotonic() > deadline:
                    raise RolloutProducerError(f"no rollout from the producer in {self.timeout_s:.0f} s (async_rollouts.timeout_s); it is {self._doing()}") from None
        if kind == "error":
            raise RolloutProducerError(f"the rollout producer failed at step {step}:\n{payload}")
        self.buffer[step] = batch_from_state(torch.load(io.BytesIO(payload), weights_only=True))

    def _doing(self) -> str:
        return bytes(self.status[:]).split(b"\0")[0].decode(errors="replace") or "starting"

    def publish(self, policy: nn.Module, version: int) -> float:
        """Copy the learner's weights after ``version`` steps into their slot and tell the producer."""
        start = time.perf_counter()
        if version < self.total_steps:  # the last weights sample nothing
            with torch.no_grad():
                slot = self.slots[version % len(self.slots)]
                for name, p in trainable(policy):
                    slot[name].copy_(p)
            self.versions.put(version)
        return time.perf_counter() - start

    def state_dict(self) -> dict:
        """The rollouts in flight (steps next..next + k - 1, sampled by older weights), for a checkpoint."""
        return {"async_rollouts": self._collect(self.next_step)}

    def _collect(self, first: int) -> list[dict]:
        last = min(first + self.k, self.total_steps)  # exclusive: steps first..first + k - 1 that exist
        for step in range(first, last):
            while step not in self.buffer:
                self._receive()
        return [batch_state(self.buffer[step]) for step in range(first, last)]

    def close(self) -> None:
        """Stop the producer (now, whatever it was doing) and release its queues."""
        if self.process.is_alive():
            self.versions.put(None)
            self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5.0)
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join()
        for q in (self.versions, self.out):
            q.cancel_join_thread()
            q.close()
