"""A trainable model with its AdamW, schedule and gradient clipping: one call, one update.

    updater = Updater.create(policy, cfg.optim, total_updates, world, sharding)
    grad_norm = updater.step(loss)          # zero_grad, backward, clip, AdamW, schedule
    updater.sampler()                       # the model the decode loop runs on (maybe a bfloat16 copy)

Every trainer (SFT, reward model, GRPO, PPO's policy and critic) updates its models through one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from rlalign.config import ConfigError
from rlalign.errors import RLAlignError
from rlalign.lm.models import cast_copy, copy_weights
from rlalign.train import distributed
from rlalign.train.common import OptimConfig, make_optimizer

__all__ = ["Updater", "NonFiniteError"]


class NonFiniteError(RLAlignError, FloatingPointError):
    """A loss or gradient norm that is NaN or infinite: the update is not applied."""


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

    @classmethod
    def create(
        cls, model: nn.Module, cfg: OptimConfig, total_updates: int, world: distributed.World = distributed.World(), sharding: str = "ddp",
        sampling_dtype: str | None = None, pack_sampler: bool = False,
    ) -> Updater:
        """``model`` under torchrun in DDP or sharded by FSDP2 (gradients averaged over ranks), with its AdamW."""
        if sampling_dtype is not None and sharding == "fsdp":
            raise ConfigError("sampling.dtype needs whole weights on every rank; with model.sharding=fsdp leave it null")
        model = distributed.wrap(model, world, sharding)
        optimizer, scheduler = make_optimizer(model.parameters(), cfg, total_updates)
        return cls(model, optimizer, scheduler, cfg.grad_clip, sampling_dtype, pack_sampler)

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
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or float("inf")) if params else torch.zeros(())
        loss_value, norm_value = float(loss.detach()), float(norm)
        if not math.isfinite(norm_value) or not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"update {self.updates + 1}: the loss is {loss_value} and the gradient norm {norm_value}")
        self.optimizer.step()
        self.scheduler.step()
        self.updates += 1
        return float(norm)

    def state_dict(self) -> dict:
        """Optimiser (full, gathered from every rank under FSDP2: call it on every rank) and schedule."""
        return {"optimizer": distributed.optimizer_state(self.model, self.optimizer), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
