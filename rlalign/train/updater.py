"""A trainable model with its AdamW, schedule and gradient clipping: one call, one update.

    updater = Updater.create(policy, cfg.optim, total_updates, world, sharding)
    grad_norm = updater.step(loss)          # zero_grad, backward, clip, AdamW, schedule
    grad_norm, _ = updater.accumulated_step([lambda: (loss_k, count_k), ...], loss_scale, loss_share)   # the same update from micro-batches
    updater.sampler()                       # the model the decode loop runs on (maybe a bfloat16 copy)

Every trainer (SFT, reward model, GRPO, PPO's policy and critic) updates its models through one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from rlalign.config import ConfigError
from rlalign.errors import NonFiniteError
from rlalign.lm.logprobs import lm_head_of
from rlalign.lm.models import cast_copy, copy_weights
from rlalign.train import distributed
from rlalign.train.bf16_adamw import check_bfloat16_steps
from rlalign.train.common import make_optimizer, memory_named
from rlalign.train.run_config import OptimConfig

__all__ = ["Updater", "NonFiniteError", "minibatch_step"]


@dataclass
class Updater:
    """A trainable model with its AdamW, schedule and gradient clipping: one call, one update."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float | None
    sampling_dtype: str | None = None  # sampler() runs on a copy in this dtype (SamplingConfig.dtype)
    pack_sampler: bool = False  # that copy's linear layers read packed weights (SamplingConfig.pack_weights)
    updates: int = 0
    _sampling_copy: nn.Module | None = field(default=None, repr=False)
    _copy_at: int = -1  # the value of ``updates`` when the copy was last refreshed
    row_costs: dict = field(default_factory=dict, repr=False)  # micro_batch_size auto: what a row of each probed shape keeps (rlalign.train.memory_plan)
    world: distributed.World = field(default_factory=distributed.World, repr=False)  # the ranks that update this model together

    @classmethod
    def create(
        cls, model: nn.Module, cfg: OptimConfig, total_updates: int, world: distributed.World = distributed.World(), sharding: str = "ddp",
        sampling_dtype: str | None = None, pack_sampler: bool = False,
    ) -> Updater:
        """``model`` under torchrun in DDP or sharded by FSDP2 (gradients averaged over ranks), with its AdamW."""
        if sampling_dtype is not None and sharding == "fsdp":
            raise ConfigError("sampling.dtype needs whole weights on every rank; with model.sharding=fsdp leave it null")
        if cfg.bf16_rounding == "nearest":
            check_bfloat16_steps([p for p in model.parameters() if p.requires_grad], cfg.lr)  # every rank holds the whole model here: all raise alike
        model = distributed.wrap(model, world, sharding)
        optimizer, scheduler = make_optimizer(model.parameters(), cfg, total_updates)
        return cls(model, optimizer, scheduler, cfg.grad_clip, sampling_dtype, pack_sampler, world=world)

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper: for sampling, reference passes, evaluation, saving."""
        return distributed.unwrap(self.model)

    @property
    def lr(self) -> float:
        """The learning rate of the next update."""
        return float(self.scheduler.get_last_lr()[0])

    def sampler(self) -> nn.Module:
        """The model the decode loop runs on: :attr:`module`, or its copy held in ``sampling_dtype``
        (:func:`rlalign.lm.models.cast_copy`), whose weights are refreshed when an update moved them;
        with ``pack_sampler`` on a CPU its linear layers read their weights in oneDNN's blocked layout
        (:mod:`rlalign.lm.packed`: the same values, faster)."""
        if self.sampling_dtype is None:
            return self.module
        if self._sampling_copy is None:
            self._sampling_copy = cast_copy(self.module, self.sampling_dtype)
            if self.pack_sampler:
                from rlalign.lm.packed import can_pack_linear, pack_linear_layers  # the packing machinery, only when asked for

                if can_pack_linear(self._sampling_copy):
                    pack_linear_layers(self._sampling_copy)
        elif self._copy_at != self.updates:
            copy_weights(self._sampling_copy, self.module)
            if self.pack_sampler:
                from rlalign.lm.packed import repack_linear_layers

                repack_linear_layers(self._sampling_copy)  # a no-op when nothing is packed
        self._copy_at = self.updates
        return self._sampling_copy

    def step(self, loss: Tensor) -> float:
        """zero_grad, backward, clip, step; returns the gradient norm before clipping.

        Raises:
            NonFiniteError: when the gradient norm (the same on every rank under torchrun) or the
                loss is NaN or infinite; the parameters, AdamW's moments and the schedule are left
                as they were.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return self._apply(float(loss.detach()))

    def accumulated_step(self, micro_losses: Iterable[Callable[[], tuple[Tensor, float]]], scale: Callable[[float], float],
                         share: Callable[[float], float]) -> tuple[float, float]:
        """One update from micro-batches: each ``micro_losses`` call runs one micro-batch's forward and
        returns (its mean loss, the count the mean is over); its backward adds ``loss * count`` to the
        gradients (under DDP the ranks sync on the last one only), then the summed gradient is
        multiplied by ``share(total count)``, the same on every rank, which makes it the gradient of
        the loss of the whole batch (:func:`rlalign.train.distributed.loss_share`: 1 / total in one
        process, W / the total over ranks under torchrun). One micro-batch is the plain update
        ``step(loss * scale(count))`` (:func:`rlalign.train.distributed.loss_scale`, 1 in one process).
        Under torchrun every rank must make as many calls. Returns (the gradient norm before
        clipping, as :meth:`step`; this rank's scale, ``share(total) * total``).

        Raises:
            NonFiniteError: as :meth:`step`.
        """
        calls = list(micro_losses)
        if len(calls) == 1:  # no accumulation: the plain update
            loss, count = calls[0]()
            factor = scale(count)
            return self.step(loss * factor), factor
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, total = 0.0, 0.0
        for i, call in enumerate(calls):
            syncing = i == len(calls) - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if syncing else self.model.no_sync():
                loss, count = call()
                (loss * count).backward()
            loss_sum, total = loss_sum + float(loss.detach()) * count, total + count
        multiplier = share(total)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(multiplier)
        return self._apply(loss_sum / total if total > 0 else 0.0), multiplier * total

    def _apply(self, loss_value: float) -> float:
        """Clip the gradients in place and step, or raise :class:`NonFiniteError` and leave everything as it was."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or float("inf")) if params else torch.zeros(())
        norm_value = float(norm)
        if not math.isfinite(norm_value) or not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"update {self.updates + 1}: the loss is {loss_value} and the gradient norm {norm_value}")
        self.optimizer.step()
        if not self.finite_weights():  # a finite gradient can still step the weights past float range (a learning rate of 1e38)
            raise NonFiniteError(f"update {self.updates + 1}: the weights are not finite after it (the loss was {loss_value:g}, the gradient norm "
                                 f"{norm_value:g}, the learning rate {self.lr:g})")
        self.scheduler.step()
        self.updates += 1
        return norm_value

    def finite_weights(self) -> bool:
        """Whether every trained parameter is finite, on every rank of :attr:`world` (each checks its own shards under FSDP2)."""
        tensors = [p.detach() for p in self.model.parameters() if p.requires_grad]  # a frozen weight (a LoRA base) cannot move
        tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2: this rank's shard
        tensors = [t for t in tensors if t.numel()]
        norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)]) if tensors else torch.zeros(1)  # (P,) one fused pass (a CPU max-|w| is ~100x slower)
        bad = not bool(torch.isfinite(norms).all()) and any(  # a NaN or inf weight makes its norm so; an inf norm may be overflow: look exactly
            not bool(torch.isfinite(torch.stack(torch.aminmax(t.flatten()))).all()) for t, n in zip(tensors, norms) if not torch.isfinite(n))
        return distributed.all_max(float(bad), self.world) == 0

    def state_dict(self) -> dict:
        """Optimiser (full, gathered from every rank under FSDP2: call it on every rank) and schedule."""
        return {"optimizer": distributed.optimizer_state(self.model, self.optimizer), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates = self.scheduler.last_epoch  # the schedule steps once an update: a resumed run counts on from the checkpoint's


def minibatch_step(
    updater: Updater, loss_of: Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]], micro_rows: Sequence[Tensor], mask: Tensor, aggregation: str,
    world: distributed.World, present: float = 1.0,
) -> tuple[dict[str, float], float]:
    """One optimiser step of an RL loss on one minibatch, its gradient accumulated over ``micro_rows``.

    Args:
        loss_of: rows -> (the loss aggregated over those rows' ``mask`` tokens, its statistics).
        micro_rows: the minibatch's row indices (this rank's), cut into micro-batches.
        mask: 1 on the tokens the loss counts, for every row of the rollout. Shape: (B, C).
        aggregation: the loss's reduction (:func:`rlalign.train.distributed.aggregation_count`).
        present: 0 when this rank has no row of the minibatch under torchrun (it trains on one row weighted 0).
    Returns:
        (the minibatch's statistics, global under torchrun; the gradient norm before clipping).
    """
    parts: list[tuple[dict[str, float], float, float]] = []  # (stats, counted tokens, loss count) per micro-batch

    def micro_loss(rows: Tensor, weight: float, padding: bool = False) -> Callable[[], tuple[Tensor, float]]:
        def run() -> tuple[Tensor, float]:
            loss, stats = loss_of(rows)
            count = float(distributed.aggregation_count(mask[rows], aggregation)) * weight
            if not padding:  # a padding row's statistics (its ratio's max, its weight's min) are not the minibatch's
                parts.append(({key: float(v) for key, v in stats.items()}, float(mask[rows].sum()) * weight, count))
            return loss, count

        return run

    # every rank runs as many forwards and backwards (DDP's and FSDP2's collectives pair up), a rank with
    # fewer micro-batches (fewer rows: PPO's shuffled minibatches, an agent's calls) one more row weighted 0
    calls = [micro_loss(rows, present) for rows in micro_rows]
    calls += [micro_loss(micro_rows[0][:1], 0.0, padding=True)] * (int(distributed.all_max(len(calls), world)) - len(calls))
    with memory_named("the update's forward and backward", max(len(rows) for rows in micro_rows), mask.shape[1], lm_head_of(updater.model) is not None):
        grad_norm, scale = updater.accumulated_step(calls, partial(distributed.loss_scale, world=world), partial(distributed.loss_share, world=world))
    stats = distributed.reduce_stats(distributed.merge_micro_stats(parts), sum(tokens for _, tokens, _ in parts), scale, world)
    return stats, grad_norm
