"""The trainers under ``torchrun``: process group, shards of the global batch, DDP, global reductions.

    torchrun --nproc-per-node 2 -m rlalign grpo --config configs/grpo_arithmetic.yaml

Without torchrun (no ``WORLD_SIZE`` in the environment) :func:`init` returns the one-process
:class:`World` and every function here is the identity, so a one-process run does exactly what it
did before any of this existed.

With N processes every trainer keeps the *global* batch of its config and gives each rank an
equal, contiguous share of it (``World.shard``): in GRPO whole prompt groups, so group statistics
need no communication. The rules that make N processes compute what one process computes:

- Randomness that decides data is drawn for the global batch on every rank from generators that
  stay in step (same seed, same number of draws): the prompt order, the sampling uniforms
  (``rlalign.lm.sampling.sample(noise=...)``, each rank taking its own rows' columns), PPO's
  minibatch permutation.
- Gradients are averaged by DistributedDataParallel (gloo on CPU, NCCL on GPU). A loss whose
  normaliser depends on the batch (token counts, sequences with tokens) is rescaled by
  :func:`loss_scale` so that the average over ranks equals the one-process loss of the global batch.
- Per-row numbers (rewards, lengths, per-sequence KL) are all-gathered, so advantages and metrics
  are computed on the global batch; per-token statistics are token-weighted means over ranks.
- Rank 0 alone writes: metrics, samples, checkpoints, plots; the others wait for a checkpoint
  (:meth:`World.main_first`), and stop with one message of their own if rank 0 failed to write it.

Models that fit on one device are wrapped in DDP (``model.sharding: ddp``, the default). Models
that do not fit are sharded with FSDP2 (``model.sharding: fsdp``): ``fully_shard`` on every
decoder layer (the model's ``_no_split_modules``) and on the root, the frozen reference and reward
models too. Then every forward is a collective, so every rank runs the evaluations (the same
numbers; rank 0 logs them), parameters are gathered once around a sampling loop
(:func:`gathered`), and checkpoints hold full (unsharded) weights and optimiser state gathered
from every rank (:func:`model_state`, :func:`optimizer_state`), resumable on the same world size
and sharding.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import inspect
import io
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from rlalign.config import ConfigError
from rlalign.core.losses import norm_rows, row_weights
from rlalign.core.masks import masked_mean, masked_var
from rlalign.errors import RLAlignError

__all__ = [
    "World", "MainRankError", "init", "exit_process", "wrap", "shard_frozen", "unwrap", "gathered", "model_state", "optimizer_state", "load_optimizer_state",
    "gather_rows", "all_sum", "all_max", "any_rank", "aggregation_count", "loss_scale", "loss_share", "reduce_stats", "merge_micro_stats", "global_mean_var", "rows_of",
]


@dataclass(frozen=True)
class World:
    """This process's place among the learners of the run (one process: rank 0 of 1).

    With producer ranks (``async_rollouts.producers: P`` under torchrun) the first N - P ranks learn
    and the last P only sample and score (:mod:`rlalign.train.rank_source`): a learner's World is its
    rank among the learners, their number and their process group; a producer's is a one-process
    World (its forwards are its own) that names its index among the producers. A *view*
    (:meth:`view_of`) is learner ``rank``'s share of a step as a producer makes it: shards as that
    learner's, and no collective (the learner gathers the scores when the batch arrives)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    group: Any = None  # the learners' process group; None: the default group (every process)
    learners: int = 1  # learner ranks in the run
    producers: int = 0  # producer ranks in the run (async_rollouts.producers)
    producer: int | None = None  # this process's index among the producers; None: a learner
    view: bool = False  # a producer's view of a learner's share: no collective

    @property
    def is_main(self) -> bool:
        """Rank 0 of the learners: the one that writes."""
        return self.rank == 0 and self.producer is None and not self.view

    @property
    def distributed(self) -> bool:
        """Whether collectives reach other processes (learners under torchrun; never a producer or a view)."""
        return self.size > 1 and not self.view

    @property
    def global_rank(self) -> int:
        return self.rank if self.producer is None else self.learners + self.producer

    def view_of(self, rank: int) -> World:
        """Learner ``rank``'s share of a step, as a producer samples and scores it without the learners."""
        return World(rank=rank, size=self.learners, local_rank=self.local_rank, learners=self.learners, producers=self.producers, view=True)

    def shard(self, n: int, what: str = "rows") -> slice:
        """This rank's contiguous share of ``n`` items (``n`` must divide evenly)."""
        if n % self.size:
            raise ValueError(f"{what}: {n} cannot be split evenly across {self.size} processes; make it a multiple of the world size")
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def split(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items that need not divide evenly: the first ``n % size`` ranks one more."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    @contextlib.contextmanager
    def main_first(self, learners_only: bool = False) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. builds the tiny model on disk, writes a checkpoint: its
        work inside ``if world.is_main:``), then every other process, producers included
        (``learners_only``: the learners alone). When rank 0's block raises, the others do not run
        theirs: they raise :class:`MainRankError`, one message each, where they would otherwise
        wait for a peer that is gone and end on the transport's traceback."""
        group = self.group if learners_only else None
        together = dist.is_available() and dist.is_initialized() and not self.view and (self.distributed or not learners_only)
        if together and not self.is_main and _outcome_of_main(group, failed=False):
            raise MainRankError("stopped because learner rank 0 failed (its message is above)")
        try:
            yield
        except BaseException:
            if together and self.is_main:
                with contextlib.suppress(RuntimeError, ValueError):  # peers already gone: rank 0's own error is the one to show
                    _outcome_of_main(group, failed=True)
            raise
        if together and self.is_main:
            _outcome_of_main(group, failed=False)

    def device(self, requested: str) -> str:
        """The device of this rank: ``cuda`` becomes ``cuda:<local_rank>`` under torchrun (mod the GPUs: producer ranks may share them)."""
        if dist.is_available() and dist.is_initialized() and requested == "cuda":
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"  # producer ranks past the GPUs share them
        return requested


class MainRankError(RLAlignError, RuntimeError):
    """Learner rank 0 failed in a block the other ranks waited on (:meth:`World.main_first`); its own error says why."""


def _outcome_of_main(group: Any, failed: bool) -> bool:
    """Whether rank 0's block raised: rank 0 sends ``failed``, every other rank of ``group`` (None:
    every process) receives it. A CPU tensor (gloo; both of :func:`init`'s backends have it), a CUDA
    one on a group that is NCCL alone (a process group the caller made)."""
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([int(failed)], device=device)
    dist.broadcast(flag, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return bool(flag.item())


_WORLDS: dict[tuple[int, int], World] = {}  # (global rank, producers) -> this process's World, once the groups exist


def init(device: str = "cpu", producers: int = 0, timeout_s: float = 1800.0) -> World:
    """The World of this process; joins the process group when launched by torchrun (WORLD_SIZE > 1).

    Backend: gloo for CPU tensors and NCCL for CUDA tensors when ``device`` is CUDA, gloo otherwise. ``producers``: the last ``producers``
    ranks sample for the others (the learners, who get a process group of their own). With more
    ranks on a node than GPUs (a producer rank sharing a learner's GPU) the default group is gloo and
    the learners' group NCCL, since NCCL takes one rank a GPU. Idempotent.

    Raises:
        ConfigError: producers without torchrun, or with no rank left to learn.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        if producers:
            raise ConfigError(f"async_rollouts.producers={producers} makes ranks of torchrun producers: launch with torchrun "
                              f"(--nproc-per-node {producers + 1} or more), or set producers: 0 for a producer process beside this one")
        return World()
    if producers >= size:
        raise ConfigError(f"async_rollouts.producers={producers} leaves no learner among the {size} processes: at most {size - 1}")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if (rank, producers) in _WORLDS:
        return _WORLDS[rank, producers]
    learners, cuda = size - producers, device.startswith("cuda")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"  # CPU tensors (scores, counts) by gloo, CUDA tensors by NCCL
    if cuda:  # a rank per GPU; producer ranks past the GPUs share them (local rank mod GPUs)
        gpus = torch.cuda.device_count()
        if rank < learners and local_rank >= gpus:
            raise ConfigError(f"learner rank {rank} has no GPU of its own ({gpus} on this node): launch at most {gpus} learners a node")
        torch.cuda.set_device(local_rank % gpus)
        if int(os.environ.get("LOCAL_WORLD_SIZE", size)) > gpus:
            backend = "gloo"  # NCCL takes one rank a GPU: the default group is gloo, the learners get a group of their own with NCCL
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if not producers:
        world = World(rank=rank, size=size, local_rank=local_rank, learners=size)
    else:  # every rank takes part in making the learners' group
        group = dist.new_group(list(range(learners)), timeout=datetime.timedelta(seconds=timeout_s), backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
        if rank < learners:
            world = World(rank=rank, size=learners, local_rank=local_rank, group=group, learners=learners, producers=producers)
        else:
            world = World(local_rank=local_rank, learners=learners, producers=producers, producer=rank - learners)
    _WORLDS[rank, producers] = world
    return world


def exit_process(code: int) -> None:
    """End a process whose process group is up, with exit status ``code``, once its command returned;
    without one (a one-process run) return. What the interpreter's exit does that a program can
    see runs first: its threads are shut down as the interpreter does it (executors' idle workers
    woken, non-daemon threads joined), ``atexit`` handlers run (logging, temporary folders, child
    processes), files still open are flushed, standard output and error too. Then ``os._exit``,
    skipping the interpreter's finalization: there a Gloo worker thread that still holds a
    collective's tensors needs the GIL of an interpreter being torn down, and the process aborts
    (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489) after its
    last checkpoint was written. Destroying the groups first instead can deadlock: the destructor
    joins that thread while holding the GIL the thread waits for."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    threading._shutdown()  # as Py_Finalize starts: threading's exit hooks (concurrent.futures wakes idle workers), then the joins
    atexit._run_exitfuncs()
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated ones (torch.distributed.reduce_op warns)
        warnings.simplefilter("ignore")
        streams = [obj for obj in gc.get_objects() if isinstance(obj, io.IOBase)]
    for stream in streams + [sys.stdout, sys.stderr]:
        with contextlib.suppress(OSError, ValueError):  # closed, not writable, a broken pipe: nothing to keep
            if not stream.closed and stream.writable():
                stream.flush()  # what finalization would write of a file nobody closed
    os._exit(code)


SHARDINGS = ("ddp", "fsdp")


def _fully_shard(model: nn.Module, world: World) -> nn.Module:
    """FSDP2 in place over the learners: each decoder layer (the classes a transformers model lists in
    ``_no_split_modules``), then the root (embeddings, final norm, heads)."""
    mesh = None
    if world.group is not None:
        device_type = next(model.parameters()).device.type
        mesh = DeviceMesh.from_group(world.group, device_type)
    layer_classes = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    for module in list(model.modules()):
        if type(module).__name__ in layer_classes and module is not model:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wrap(model: nn.Module, world: World, sharding: str = "ddp") -> nn.Module:
    """A trainable model for torchrun: in DistributedDataParallel (``ddp``) or sharded in place
    with FSDP2 (``fsdp``); ``model`` itself in one process. Build the optimiser after this call.

    DDP does not re-broadcast buffers at every forward (they are identical on every rank: rotary
    frequencies, and nothing trains them).
    """
    if not world.distributed:
        return model
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if sharding == "fsdp":
        return _fully_shard(model, world)
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel
    no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters else {"broadcast_buffers": False}
    return ddp(model, device_ids=device_ids, process_group=world.group, **no_buffer_sync)


def shard_frozen(model: nn.Module | None, world: World, sharding: str = "ddp") -> nn.Module | None:
    """A frozen model (reference, reward model): sharded with FSDP2 under ``fsdp``, else as it is
    (under DDP every rank holds a full copy; it needs no gradient sync)."""
    if model is None or not world.distributed or sharding != "fsdp":
        return model
    return _fully_shard(model, world)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (for sampling, evaluation and saving, which need no gradient
    sync); an FSDP2 model is its own module."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _fsdp_modules(model: nn.Module | None) -> list[FSDPModule]:
    if model is None or not torch.distributed.is_initialized():  # FSDP2 needs a process group: skip the module walk
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(*models: nn.Module | None) -> Iterator[None]:
    """FSDP2 models hold their full parameters for the block (one all-gather per layer, not one per
    forward: a sampling loop runs a forward per token). No-op for any other model. Collective."""
    modules = [m for model in models for m in _fsdp_modules(model)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model: nn.Module) -> dict[str, Tensor] | None:
    """The full weights of an FSDP2 model, gathered from every rank (collective; rank 0 receives
    them, on CPU), to hand to ``save_pretrained(state_dict=...)``. None for any other model: it
    saves its own parameters."""
    if not _fsdp_modules(model):
        return None
    state = get_model_state_dict(model, options=_FULL)
    # tied parameters (e.g. lm_head = embeddings) come back as two copies that transformers can no
    # longer recognise as one; keep the first name, as save_pretrained does for a live model
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            state.pop(name, None)
        seen.add(id(param))
    return state


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()``, or for an FSDP2 model the full state keyed by parameter name
    (collective; rank 0 receives it)."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL) if _fsdp_modules(model) else optimizer.state_dict()


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of :func:`optimizer_state`; every rank passes the full state it read from the checkpoint."""
    if _fsdp_modules(model):
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)


def gather_rows(x: Tensor, world: World, uneven: bool = False) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0, in rank order: equal shapes on every rank, or with
    ``uneven`` any number of rows (their counts are gathered first: one more collective)."""
    if not world.distributed:
        return x
    if uneven:
        counts = gather_rows(torch.tensor([x.shape[0]]), world).tolist()
        padded = torch.zeros((max(counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        return torch.cat([part[:n] for part, n in zip(gather_rows(padded, world).split(max(counts)), counts)])
    parts = [torch.empty_like(x) for _ in range(world.size)]
    dist.all_gather(parts, x.contiguous(), group=world.group)
    return torch.cat(parts)


def minibatch_rows(local_rows: int, minibatches: int, world: World) -> list[slice]:
    """This rank's rows of each of ``minibatches`` minibatches: minibatch k holds the rows whose place among every
    rank's rows (in rank order) is k, k + m, k + 2m, ..., as one process holding them all cuts them, also where the
    ranks hold different numbers of rows (an agent's calls). E.g. rank 1 after rank 0's 5 rows, m = 2: its rows
    1, 3, ... are in minibatch 0 (places 6, 8, ...). One all-gather of the counts under torchrun."""
    offset = int(gather_rows(torch.tensor([local_rows]), world)[: world.rank].sum()) if world.distributed else 0
    return [slice((k - offset) % minibatches, None, minibatches) for k in range(minibatches)]


def all_sum(x: Tensor, world: World) -> Tensor:
    """Sum of ``x`` over ranks (a new tensor; ``x`` is left alone)."""
    if not world.distributed:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, group=world.group)
    return out


def aggregation_count(mask: Tensor, mode: str) -> Tensor:
    """What ``rlalign.core.losses.aggregate`` divides by for this minibatch: tokens (token-mean),
    sequences with at least one token (seq-mean-token-mean / -sum), rows (seq-mean-token-sum-norm);
    a weighted mask's rows count their weight.

    Args:
        mask: 1 on counted tokens. Shape: (B, C).
    """
    if mode == "token-mean":
        return mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return norm_rows(mask).float()
    return row_weights(mask).sum()  # weighted rows count their weight (rlalign.core.losses, row weights)


def gather_objects(items: list, world: World) -> list:
    """Every rank's ``items`` (picklable: sample rows), concatenated in rank order, which is the global
    batch's order (each rank's share is contiguous); ``items`` itself in one process."""
    if not world.distributed:
        return items
    parts: list = [None] * world.size
    dist.all_gather_object(parts, items, group=world.group)
    return [item for part in parts for item in part]


def all_max(value: float, world: World) -> float:
    """Largest ``value`` over ranks."""
    if not world.distributed:
        return value
    out = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=world.group)
    return float(out)


def any_rank(flag: bool, world: World) -> bool:
    """Whether ``flag`` holds on any rank (every rank then takes the same branch: e.g. adds the same score term)."""
    return all_max(float(flag), world) > 0


def loss_scale(local_count: Tensor | float, world: World) -> float:
    """Factor that turns this rank's aggregated loss into its share of the global one.

    Rank r's loss is S_r / n_r (``n_r`` from :func:`aggregation_count`) and DDP averages the
    gradients of the W ranks. Multiplying rank r's loss by W * n_r / sum_s n_s makes that average
    the gradient of sum_r S_r / sum_s n_s, the loss of the global minibatch. One process: exactly 1.
    """
    if not world.distributed:
        return 1.0
    local = torch.as_tensor(local_count).detach().double().cpu()
    total = all_sum(local, world)
    return 0.0 if total <= 0 else float(local * world.size / total)


def loss_share(local_count: Tensor | float, world: World) -> float:
    """W / sum_s n_s, the same on every rank: the factor that turns a rank's gradient of its summed,
    count-weighted micro-batch losses (sum_k n_k * mean_k) into its share of the global loss's after
    DDP or FSDP2 average the ranks' gradients; 0 when no rank counts anything. One process: 1 / n.
    (``loss_scale`` of n is this times n, which is 0 on a rank that counts nothing: a factor that
    must be the same on every rank, for gradients already averaged, cannot come from it.)"""
    local = torch.as_tensor(local_count).detach().double().cpu()
    total = all_sum(local, world) if world.distributed else local
    return 0.0 if total <= 0 else float(world.size / total) if world.distributed else float(1.0 / total)


MAX_STATS = ("ratio_dev", "logprob_mismatch", "adv/max")  # reduced with max; loss/* are summed shares; the rest are token-weighted means
MIN_STATS = ("tis/weight_min", "adv/min")  # reduced with min
# A max or min is over the micro-batches and ranks that count tokens: one without (a rank with no row of a
# PPO minibatch, a row weighted 0) reports a placeholder (0, or a weight of 1) that is nobody's value.


def reduce_stats(stats: Mapping[str, float], weight: float, scale: float, world: World) -> dict[str, float]:
    """Global values of one minibatch's statistics (identity in one process).

    Args:
        stats: this rank's values: per-token means (clip fractions, KL, entropy, ...), ``loss/*``
            aggregated losses, ``ratio_dev`` (a max) and ``tis/weight_min`` (a min).
        weight: this rank's count of counted tokens (the weight of its means).
        scale: this rank's :func:`loss_scale` (the share of a ``loss/*`` value in the global loss).
    """
    if not world.distributed:
        return dict(stats)
    names = sorted(stats)
    summed = [n for n in names if n not in MAX_STATS + MIN_STATS]
    values = torch.tensor(
        [stats[n] * scale / world.size if n.startswith("loss/") else stats[n] * weight for n in summed] + [weight], dtype=torch.float64
    )
    values = all_sum(values, world)
    total_weight = float(values[-1])
    out = {n: float(v) if n.startswith("loss/") else (float(v) / total_weight if total_weight > 0 else 0.0) for n, v in zip(summed, values[:-1])}
    for n in names:
        if n in MAX_STATS + MIN_STATS:
            sign = 1.0 if n in MAX_STATS else -1.0  # a min is minus the max of minus the values
            extreme = sign * all_max(sign * stats[n] if weight > 0 else -math.inf, world)  # ranks that count tokens
            out[n] = extreme if math.isfinite(extreme) else stats[n]  # no rank counts any: every rank's placeholder
    return out


def merge_micro_stats(parts: Sequence[tuple[Mapping[str, float], float, float]]) -> dict[str, float]:
    """One minibatch's statistics from those of its micro-batches (gradient accumulation).

    Args:
        parts: per micro-batch (stats, weight, count): ``loss/*`` values are means over ``count``
            (so the minibatch's is sum(loss_k count_k) / sum(count_k)), ``MAX_STATS`` are maxima, ``MIN_STATS`` minima,
            the rest are means weighted by ``weight`` (counted tokens).
    """
    if len(parts) == 1:
        return dict(parts[0][0])
    total_weight, total_count = sum(w for _, w, _ in parts), sum(c for _, _, c in parts)
    out: dict[str, float] = {}
    counting = [part for part in parts if part[1] > 0] or parts  # a max or min over the micro-batches that count tokens
    for name in parts[0][0]:
        if name in MAX_STATS:
            out[name] = max(stats[name] for stats, _, _ in counting)
        elif name in MIN_STATS:
            out[name] = min(stats[name] for stats, _, _ in counting)
        elif name.startswith("loss/"):
            out[name] = sum(stats[name] * c for stats, _, c in parts) / total_count if total_count > 0 else 0.0
        else:
            out[name] = sum(stats[name] * w for stats, w, _ in parts) / total_weight if total_weight > 0 else 0.0
    return out


def global_mean_var(x: Tensor, mask: Tensor, world: World) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance of the counted entries of ``x`` over every rank (two all-reduces,
    the same two-pass formula as :func:`rlalign.core.masks.masked_var`). Shapes: any -> (), ()."""
    if not world.distributed:
        return masked_mean(x, mask), masked_var(x, mask)
    weight = mask.to(x.dtype)
    sums = all_sum(torch.stack([(x * weight).sum(), weight.sum()]).double(), world)
    n = sums[1]
    mean = (sums[0] / n.clamp(min=1.0)).to(x.dtype)
    sq = all_sum(((x - mean) ** 2 * weight).sum().double(), world)
    var = torch.where(n > 1, sq / (n - 1).clamp(min=1.0), torch.zeros_like(sq)).to(x.dtype)
    return mean, var


def rows_of(index: Tensor, shard: slice) -> Tensor:
    """The entries of global row ``index`` that fall in ``shard``, as local row numbers. Shape: (k,)."""
    inside = (index >= shard.start) & (index < shard.stop)
    return index[inside] - shard.start
