"""The learner's weights to the producer ranks (:mod:`rlalign.train.rank_source`), version by version.

Two ways, one schedule. The producers sample step s with the weights of version max(0, s - k), so
learner rank 0 keeps k + 1 slots: version v goes to slot v mod (k + 1), and before it overwrites the
slot it waits until every producer is done with version v - k - 1 (each producer is, by the time it
needs version v - k or later: it takes the versions in order).

- ``broadcast``: each version is broadcast asynchronously from learner rank 0 to every producer in a
  group of their own (NCCL on GPUs, gloo on CPU); every producer receives every version in order.
  Works across nodes.
- ``shared``: producers on learner rank 0's host read the slots where they lie: CPU slots are files
  of shared memory (``/dev/shm``) every process maps, CUDA slots are device tensors opened by their
  CUDA IPC handles, so a producer sharing the learner's GPU copies the new weights device to device,
  never through the host. A producer loads only the version its next step needs and says so in the
  store ("read/v"), which is what the learner waits for before reusing a slot.

``auto`` picks ``shared`` when every producer runs on learner rank 0's host, else ``broadcast``. The
slots hold the trainable tensors flattened, one buffer per dtype (under FSDP2 every learner gathers
the full tensors first: a collective).
"""

from __future__ import annotations

import datetime
import os
import pickle
import secrets
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rlalign.config import ConfigError
from rlalign.train import distributed
from rlalign.train.batches import RolloutProducerError, trainable

__all__ = ["Flat", "BroadcastWeights", "SharedWeights", "open_weights", "WEIGHT_TRANSPORTS"]

WEIGHT_TRANSPORTS = ("auto", "broadcast", "shared")


class Flat:
    """A module's trainable tensors as one flat buffer per dtype."""

    def __init__(self, module: nn.Module):
        self.params = [p for _, p in trainable(module)]
        self.dtypes = sorted({p.dtype for p in self.params}, key=str)
        self.sharded = any(hasattr(p, "full_tensor") for p in self.params)  # FSDP2's DTensors

    def full(self) -> list[Tensor]:
        """The full tensors, by dtype, flattened (under FSDP2 a collective of every learner)."""
        values = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.params]
        return [_flatten_dense_tensors([v.detach() for v in values if v.dtype == dtype]) for dtype in self.dtypes]

    def sizes(self) -> list[tuple[int, torch.dtype]]:
        return [(sum(p.numel() for p in self.params if p.dtype == dtype), dtype) for dtype in self.dtypes]

    def load(self, flats: list[Tensor]) -> None:
        with torch.no_grad():
            for dtype, flat in zip(self.dtypes, flats):
                params = [p for p in self.params if p.dtype == dtype]
                for p, value in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.copy_(value)


class _Weights:
    """What both ways share: the versions the producers sample with, and the learner's side of a publish."""

    def __init__(self, world: distributed.World, module: nn.Module, k: int, first: int, last: int, control):
        self.world, self.k, self.first, self.last, self.control = world, k, first, last, control
        self.flat = Flat(module)
        self.version = first - 1  # a producer's: the version its module holds

    def publish(self, version: int, check: Callable[[], None]) -> float:
        """Learner side, every learner: hand out the weights of ``version`` (learner rank 0 sends)."""
        start = time.perf_counter()
        if not self.first <= version <= self.last:
            return 0.0
        if not self.world.is_main:
            if self.flat.sharded:
                self.flat.full()  # under FSDP2 every learner takes part in gathering the full tensors
            return time.perf_counter() - start
        self._send(version, self.flat.full(), check)
        self.control.store.set(f"weights/{version}", "1")
        return time.perf_counter() - start

    def _wait_for(self, version: int, what: str) -> bool:
        return self.control.wait(f"weights/{version}", what, lambda: None)


class BroadcastWeights(_Weights):
    """Every version broadcast from learner rank 0 to every producer, in a group of their own."""

    def __init__(self, world, module, k, first, last, control, timeout_s: float):
        super().__init__(world, module, k, first, last, control)
        self.group = dist.new_group([0, *range(world.learners, world.learners + world.producers)], timeout=datetime.timedelta(seconds=timeout_s))
        self.slots: list[list[Tensor] | None] = [None] * (k + 1)
        self.works: list[list] = [[] for _ in range(k + 1)]
        self.buffers: list[Tensor] | None = None

    def _send(self, version: int, flats: list[Tensor], check: Callable[[], None]) -> None:
        slot = version % (self.k + 1)
        self.control.poll(lambda: all(work.is_completed() for work in self.works[slot]),  # every producer has version - k - 1
                          f"learner rank 0 waiting for every producer to receive the weights of version {version - self.k - 1}", check, stoppable=False)
        for work in self.works[slot]:
            work.wait()
        if self.slots[slot] is None:
            self.slots[slot] = [torch.empty_like(f) for f in flats]
        for buffer, flat in zip(self.slots[slot], flats):
            buffer.copy_(flat)
        self.works[slot] = [dist.broadcast(buffer, src=0, group=self.group, async_op=True) for buffer in self.slots[slot]]

    def bring_to(self, need: int, what: str) -> bool:
        """Producer side: receive every version up to ``need``, in order; False when the learners stopped the run."""
        while self.version < need:
            v = self.version + 1
            if not self._wait_for(v, f"{what}: waiting for the weights of version {v}"):
                return False
            self.buffers = self.buffers or [torch.empty_like(f) for f in self.flat.full()]
            for buffer in self.buffers:
                dist.broadcast(buffer, src=0, group=self.group)
            self.flat.load(self.buffers)
            self.version = v
        return True

    def drain(self, what: str) -> bool:
        """Producer side, after its last step: take part in the broadcasts left (they are collectives)."""
        return self.last < self.first or self.bring_to(self.last, what)

    def release(self) -> None:
        """Producer side, when the run stopped early: receive the versions already sent, so that no broadcast of
        learner rank 0 is left waiting for this producer (its process could not end before it times out)."""
        while self.control.store.check([f"weights/{self.version + 1}"]):
            self.buffers = self.buffers or [torch.empty_like(f) for f in self.flat.full()]
            for buffer in self.buffers:
                dist.broadcast(buffer, src=0, group=self.group)
            self.version += 1


class SharedWeights(_Weights):
    """Slots every producer on learner rank 0's host maps: shared memory on CPU, CUDA IPC on GPUs."""

    def __init__(self, world, module, k, first, last, control, job: str):
        super().__init__(world, module, k, first, last, control)
        sizes = self.flat.sizes()
        device = next(module.parameters()).device
        if world.is_main:
            self.slots, self.files = [], []
            for slot in range(k + 1):
                buffers, handles = [], []
                for i, (numel, dtype) in enumerate(sizes):
                    if device.type == "cuda":
                        buffer = torch.empty(numel, dtype=dtype, device=device)
                        handles.append(("cuda", torch.multiprocessing.reductions.reduce_tensor(buffer)))
                    else:
                        path = f"/dev/shm/rlalign-{job}-{slot}-{i}"
                        buffer = torch.from_file(path, shared=True, size=numel, dtype=dtype)
                        self.files.append(path)
                        handles.append(("file", (path, numel, dtype)))
                    buffers.append(buffer)
                self.slots.append(buffers)
                control.store.set(f"slot/{slot}", pickle.dumps(handles))
            if device.type != "cuda":  # a producer checks it sees these very files (a host name may be shared by containers)
                token = secrets.token_hex(16)
                path = f"/dev/shm/rlalign-{job}-token"
                with open(path, "w") as f:
                    f.write(token)
                self.files.append(path)
                control.store.set("shm_token", f"{path} {token}")
        else:
            self.slots, self.files = None, []
        self.marked = first - 1  # a producer's: the versions up to this one are said done with

    def _open(self) -> list[list[Tensor]]:
        """Producer side: the learner's slots, mapped (files) or opened (CUDA IPC handles). The store is the job's own: its
        bytes come from learner rank 0 of this launch.

        Raises:
            RolloutProducerError: this producer does not see learner rank 0's shared-memory files (another machine or
                container under the same host name).
        """
        slots = []
        for slot in range(self.k + 1):
            self.control.wait(f"slot/{slot}", "a producer waiting for learner rank 0's weight slots", lambda: None)
            buffers = []
            for kind, handle in pickle.loads(self.control.store.get(f"slot/{slot}")):
                if kind == "cuda":
                    rebuild, args = handle
                    buffers.append(rebuild(*args))
                else:
                    path, numel, dtype = handle
                    self._check_sees(path)
                    buffers.append(torch.from_file(path, shared=True, size=numel, dtype=dtype))
            slots.append(buffers)
        self.control.store.add("opened", 1)
        return slots

    def _check_sees(self, path: str) -> None:
        token_path, token = self.control.store.get("shm_token").decode().split(" ")
        try:
            with open(token_path) as f:
                seen = f.read()
        except FileNotFoundError:
            seen = None
        if seen != token or not os.path.exists(path):
            raise RolloutProducerError(
                f"producer rank {self.world.global_rank} does not see learner rank 0's shared memory ({path}): it runs on another machine "
                "or container under the same host name; set async_rollouts.weight_transport: broadcast"
            )

    def _send(self, version: int, flats: list[Tensor], check: Callable[[], None]) -> None:
        if self.files and self.control.store.add("opened", 0) >= self.world.producers:
            self.close()  # every producer has mapped the files: their names can go (the mappings stay), so nothing is left behind
        if version - self.k - 1 >= self.first:  # the slot's previous version: every producer said it is done with it
            key = f"read/{version - self.k - 1}"
            self.control.poll(lambda: self.control.store.add(key, 0) >= self.world.producers,
                              f"learner rank 0 waiting for every producer to be done with the weights of version {version - self.k - 1}", check, stoppable=False)
        for buffer, flat in zip(self.slots[version % (self.k + 1)], flats):
            buffer.copy_(flat)
        if flats and flats[0].is_cuda:
            torch.cuda.current_stream(flats[0].device).synchronize()  # the copy is done before a producer reads the slot

    def _done_with(self, last: int) -> None:
        """Say this producer is done with every version up to ``last`` (each counted once): the learner reuses a slot
        when every producer is done with its version, read or skipped."""
        for v in range(max(self.marked + 1, self.first), last + 1):
            self.control.store.add(f"read/{v}", 1)
        self.marked = max(self.marked, last)

    def bring_to(self, need: int, what: str) -> bool:
        """Producer side: load version ``need`` from its slot. The versions before it are skipped, and said so before the
        wait (the learner may need their slots to publish ``need``); ``need`` itself once it is loaded."""
        if self.version >= need:
            return True
        self._done_with(need - 1)
        if not self._wait_for(need, f"{what}: waiting for the weights of version {need}"):
            return False
        self.slots = self.slots or self._open()
        self.flat.load(self.slots[need % (self.k + 1)])
        if self.slots[0] and self.slots[0][0].is_cuda:
            torch.cuda.current_stream(self.slots[0][0].device).synchronize()  # read before saying so
        self._done_with(need)
        self.version = need
        return True

    def drain(self, what: str) -> bool:
        self._done_with(self.last)  # no collective; the learner may still wait for these versions to reuse their slots
        return True

    def release(self) -> None:
        """Producer side, when the run stopped early: nothing waits on a producer here."""

    def close(self) -> None:
        for path in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.files = []


def open_weights(world: distributed.World, module: nn.Module, k: int, first: int, last: int, control, mode: str, timeout_s: float,
                 rollout_group) -> _Weights:
    """The way of ``mode`` (``auto``: ``shared`` when every producer runs on learner rank 0's host). Every rank calls
    this at the same point (it gathers the hosts, and ``broadcast`` makes a group)."""
    hosts: list = [None] * (world.learners + world.producers)
    dist.all_gather_object(hosts, socket.gethostname(), group=rollout_group)
    if mode == "auto":
        mode = "shared" if all(host == hosts[0] for host in hosts[world.learners:]) else "broadcast"
    if mode == "shared" and any(host != hosts[0] for host in hosts[world.learners:]):
        raise ConfigError("async_rollouts.weight_transport: shared needs every producer rank on learner rank 0's host; use broadcast (or auto)")
    if world.is_main:  # how the weights travel, said once
        print(f"weights to the {world.producers} producer rank(s): {'shared slots on this host' if mode == 'shared' else 'broadcast'} (weight_transport: {mode})")
    if mode == "shared":
        return SharedWeights(world, module, k, first, last, control, _job_name(control, world))
    return BroadcastWeights(world, module, k, first, last, control, timeout_s)


def _job_name(control, world: distributed.World) -> str:
    """A name for this run's shared-memory files, unique on the host: learner rank 0's pid and a run counter, told to every rank."""
    if world.is_main:
        control.store.set("job", f"{os.getpid()}-{control.run}")
    control.wait("job", "waiting for learner rank 0 to name the shared weight slots", lambda: None)
    return control.store.get("job").decode()
