"""AdamW for weights held in bfloat16: the step computed in float32, the new weights rounded to
bfloat16 stochastically (``optim.bf16_rounding: stochastic``), and the guard that refuses the
round-to-nearest update where it would round most steps away (``nearest``).

    optimizer = StochasticRoundingAdamW(params, lr=1e-6, fused=True)
    check_bfloat16_steps(params, lr=1e-6)   # nearest: a clear error where most steps would be lost

With ``model.dtype: bfloat16`` the weights, their gradients and, for torch's AdamW, its moments are
bfloat16, and each updated weight is rounded to nearest: a step smaller than half the spacing of
bfloat16 numbers around the weight (:func:`rlalign.core.rounding.bfloat16_spacing`) is lost, and
at an RL fine-tune's learning rates that is nearly every step (lr 1e-6, weights near 0.02). With
float32 weights (``model.dtype: float32``, ``model.autocast: bfloat16`` for bfloat16 forwards) the
update is exact: 16 bytes a weight (weight, gradient, two moments). Stochastic rounding keeps
every step in expectation (:mod:`rlalign.core.rounding`) at 12 bytes a weight: bfloat16 weight and
gradient, float32 moments; each step is torch's own AdamW (fused where it can be) on a float32 copy
of one tensor at a time, then rounded into the bfloat16 weight in place. Its random bits come from a generator seeded by the step
number, so replicas under DDP round alike and a resumed run rounds as the straight one. Under FSDP2 each rank steps its own shard
(torch's AdamW takes DTensors) and rounds it with bits of its own (the seed adds the shard's place in the mesh).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlalign.config import ConfigError
from rlalign.core.rounding import bfloat16_spacing, stochastic_round_to_bfloat16

__all__ = ["StochasticRoundingAdamW", "check_bfloat16_steps", "LOST_STEP_LIMIT"]

LOST_STEP_LIMIT = 0.5  # the share of bfloat16 weights that may not move on a step of lr before nearest rounding is refused
_SEED = 0x5EED  # the rounding's seed is this plus terms of the step, the weight and the shard: the same bits on every replica


class StochasticRoundingAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose bfloat16 parameters are stepped in float32 and rounded stochastically
    (module docstring); a float32 parameter is stepped as AdamW steps it. The moments of a bfloat16
    parameter are float32 (loading a state dict keeps them so). torch's step runs once a tensor, so
    step hooks registered on the optimizer run once a tensor too, each seeing that tensor alone."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in self.param_groups]
        try:
            index = 0  # each parameter's place among all of them: its own stream of random bits
            for params in groups:
                for param in params:
                    index += 1
                    if param.grad is None:
                        continue
                    stepped = param if param.dtype != torch.bfloat16 else _float32_stand_in(param)
                    for other, group in zip(groups, self.param_groups, strict=True):
                        group["params"] = [stepped] if other is params else []  # torch's step over this one tensor
                    if stepped is param:
                        super().step()
                    else:
                        self._step_in_float32(param, stepped, index)
        finally:
            for params, group in zip(groups, self.param_groups, strict=True):
                group["params"] = params
        return loss

    def _step_in_float32(self, param: nn.Parameter, stand_in: nn.Parameter, index: int) -> None:
        """torch's step of ``stand_in`` (``param`` in float32) with ``param``'s state, then ``param`` = the
        result rounded stochastically, written in place: ``param`` keeps its dtype, storage and autograd
        node, so DDP's gradient hooks on it keep firing (setting ``.data`` to another dtype would drop them)."""
        if param in self.state:
            self.state[stand_in] = self.state.pop(param)
        try:
            super().step()
        finally:
            if stand_in in self.state:
                self.state[param] = self.state.pop(stand_in)
        step = int(self.state[param]["step"])
        shard = param.device_mesh.get_local_rank() if isinstance(param, DTensor) else 0  # FSDP2: each rank rounds its own shard
        generator = torch.Generator(device=param.device).manual_seed(_SEED + 1_000_003 * step + index + 65_537 * shard)
        _local(param).copy_(stochastic_round_to_bfloat16(_local(stand_in.detach()), generator))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts a loaded state to its parameter's dtype: a bfloat16 parameter's moments are then
        set again from ``state_dict`` in float32 (as saved, or widened from a plain AdamW's bfloat16)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for param, saved_id in zip(params, saved_ids, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            if param.dtype != torch.bfloat16:
                continue
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in saved:
                    self.state[param][key] = saved[key].to(param.device, torch.float32, copy=True)


def _local(t: Tensor) -> Tensor:
    """``t``'s values on this process: an FSDP2 DTensor's local shard (its storage), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _float32_stand_in(param: nn.Parameter) -> nn.Parameter:
    """A float32 copy of ``param`` with a float32 copy of its gradient: what torch's AdamW steps in its place."""
    stand_in = nn.Parameter(param.detach().float())
    stand_in.grad = param.grad.float()
    return stand_in


def check_bfloat16_steps(params: Iterable[Tensor], lr: float) -> None:
    """Raise a :class:`~rlalign.config.ConfigError` when round-to-nearest bfloat16 weights would lose an
    AdamW step of ``lr`` (about lr a weight, early on, Adam's step being lr m / sqrt(v)) on more than
    :data:`LOST_STEP_LIMIT` of their entries: where lr < ulp(w) / 2 the step rounds back to w, and
    the run would train nothing while it seemed to. Float32 parameters pass."""
    lost = total = 0
    for p in params:
        if p.dtype != torch.bfloat16:
            continue
        lost += int((bfloat16_spacing(p) > 2 * lr).sum())
        total += p.numel()
    if total and lost > LOST_STEP_LIMIT * total:
        raise ConfigError(
            f"optim.lr {lr:g} with model.dtype: bfloat16: an AdamW step of that size is below half the spacing of bfloat16 numbers on "
            f"{lost / total:.0%} of the trainable weights, so round-to-nearest would undo it (the weights would not move). Set "
            "optim.bf16_rounding: stochastic (bfloat16 weights, every step kept in expectation), or model.dtype: float32 with "
            "model.autocast: bfloat16 (float32 master weights), or a larger optim.lr"
        )
