"""Rows per forward from a memory budget: ``micro_batch_size: auto``.

    plan = plan_rows([Pass(policy, optimizer)], rollout, "auto", minibatch_rows, model_cfg, world, cache)
    plan.update      # rows per forward + backward of an update (its gradient accumulated over them)
    plan.no_grad     # rows per reference / pi_old / value pass

The budget is what the device has left for one pass:

    CUDA:  budget = min(free + (reserved - allocated), cap - allocated) - (1 - memory_fraction) * cap
           (torch.cuda.mem_get_info: the card's free memory, the caching allocator's own free blocks
           counted as free, other processes' use not; cap: the card's total times this process's
           torch.cuda.set_per_process_memory_fraction)
    CPU:   budget = memory_fraction * MemAvailable                                    (/proc/meminfo)

minus what the update will add to it: the gradients of trainable weights that have none yet, and
AdamW's two moments before its first step (each the trainable weights' bytes).

What a row costs is measured, not guessed per architecture: a probe runs the training forward of 1
and then 2 rows of the rollout's (P, C) shape (each rounded up to a multiple of 32 tokens) under
``torch.autograd.graph.saved_tensors_hooks`` and sums the bytes of the tensors autograd keeps for
backward (parameters left out, each storage once):

    saved(n) = fixed + n * per_row          (fixed: the autocast copies of the weights; linear in n)
    per_row  = saved(2) - saved(1)

A run probes again only when its rows grow longer than the longest probed; a shorter row costs
per_row * T / T_probed (activations grow with tokens, attention's scores faster: scaled down
linearly, an upper bound).

The probe runs in eval mode (no activation checkpointing; dropout is 0 either way) and with every
row running its prompt (no shared prompts), an upper bound of what a pass keeps. Then, with L
layers of width H and T = P + C tokens a row:

    update row  = SLACK * (per_row + head_row)                       no checkpointing
                = SLACK * (per_row / L + L * T * H * 4 + head_row)   checkpointing: each layer keeps its input (T x H
                                                                     float32) and one layer is recomputed at a time
    no-grad row = per_row * min(1, 4 / L) + head_row / 2             a pass without grad frees each layer's activations:
                                                                     about two layers' in flight, and the KV cache
                                                                     (also a frozen model run in each micro-batch: GKD's teacher)
    head_row    = 2 * C * V * 4        a policy whose LM head cannot be split off (the probe ran it): the log-softmax and
                                       the gradient of its float32 logits; else 0 and the head is a fixed cost:
    fixed      += 3 * min(logits_limit_mb, the minibatch's float32 logits), or 16 bytes x one chunk of
                  rlalign.core.linear_logprobs, the larger (a pass keeps the logits while they fit the limit)
    rows        = floor((budget - fixed) / row), at least 1, at most the minibatch (the rollout: no-grad passes)

SLACK = 1.25 covers backward's transient activation gradients. Under torchrun the learners agree on
the probe's shape (the largest) and on the rows (the fewest), so every rank runs the same forwards
(FSDP2 gathers weights in each). Micro-batches change only memory and round-off, never the update
(:func:`rlalign.train.updater.Updater.accumulated_step`); an out-of-memory anyway names the rows
chosen and the setting to lower (:func:`rlalign.train.common.memory_named`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlalign.lm.logprobs import completion_hidden, completion_logits, lm_head_of
from rlalign.lm.model_modes import evaluating
from rlalign.lm.rollout import Rollout
from rlalign.train import distributed
from rlalign.train.common import autocast_context
from rlalign.train.run_config import ModelConfig

__all__ = ["RowPlan", "Pass", "plan_rows", "policy_forward", "probe_rollout", "device_budget", "saved_bytes", "RowCost", "row_cost", "rows_within", "SLACK", "PROBE_ROUND"]

SLACK = 1.25  # backward's transient activation gradients, on top of what the forward keeps
PROBE_ROUND = 32  # probe shapes: prompt and completion widths rounded up to this many tokens
HEAD_CHUNK_ELEMENTS = 1 << 24  # rlalign.core.linear_logprobs's chunk: logits made at once by the chunked head


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Rows per update micro-batch (None: the whole minibatch) and per no-grad pass."""

    update: int | None
    no_grad: int
    budget_mb: float | None = None  # the budget they were planned for (auto only)

    def metrics(self) -> dict[str, float]:
        """memory/micro_rows and memory/pass_rows, when planned (auto)."""
        if self.budget_mb is None:
            return {}
        return {"memory/micro_rows": float(self.update or 0), "memory/pass_rows": float(self.no_grad)}


@dataclasses.dataclass(frozen=True)
class RowCost:
    """What one forward of a model keeps for backward: ``fixed + rows * per_row`` bytes at a (P, C) shape."""

    fixed: int
    per_row: int


def _storage(t: Tensor) -> torch.UntypedStorage:
    """The storage holding ``t``'s values on this process (an FSDP2 DTensor's: its local shard)."""
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_bytes(forward: Callable[[], object], exclude: Sequence[Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward()`` runs: each storage once,
    those of ``exclude`` (the parameters) left out. The graph is dropped on return."""
    skip = {_storage(t).data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


def probe_rollout(rows: int, prompt_len: int, completion_len: int, device: torch.device) -> Rollout:
    """A rollout of ``rows`` rows of token 0, every position real, each row its own group: a probe's input."""
    prompt = torch.zeros(rows, prompt_len, dtype=torch.long, device=device)
    completion = torch.zeros(rows, completion_len, dtype=torch.long, device=device)
    return Rollout(prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), torch.zeros(rows, completion_len, device=device),
                   torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.bool, device=device))


def policy_forward(model: nn.Module, rollout: Rollout) -> Tensor:
    """A policy's training forward up to what its LM head reads (the hidden states; the logits where the
    head cannot be split off, :func:`rlalign.lm.logprobs.lm_head_of`), every row running its prompt."""
    pass_of = completion_hidden if lm_head_of(model) is not None else completion_logits
    return pass_of(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)


def row_cost(model: nn.Module, forward: Callable[[nn.Module, Rollout], Tensor], prompt_len: int, completion_len: int, autocast: str) -> RowCost:
    """:class:`RowCost` of ``forward(model, rollout)`` on rows of ``prompt_len`` + ``completion_len`` tokens,
    measured at 1 and 2 rows in eval mode with grad (module docstring)."""
    device = next(model.parameters()).device

    def saved(rows: int) -> int:
        probe = probe_rollout(rows, prompt_len, completion_len, device)
        with torch.enable_grad(), evaluating(model), autocast_context(autocast, model):
            return saved_bytes(lambda: forward(model, probe), list(model.parameters()))

    one, two = saved(1), saved(2)
    per_row = max(two - one, 1)
    return RowCost(max(one - per_row, 0), per_row)


def device_budget(device: torch.device, fraction: float, meminfo: str = "/proc/meminfo") -> int:
    """Bytes a pass may still take on ``device`` (module docstring; ``meminfo``: where a CPU's is read)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cap = total * torch.cuda.get_per_process_memory_fraction(device)  # torch.cuda.set_per_process_memory_fraction's limit
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return int(min(free + reserved - allocated, cap - allocated) - (1 - fraction) * cap)
    with open(meminfo) as f:
        available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return int(fraction * available_kb * 1024)


def _pending_update_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes an update still allocates: gradients of trainable weights without one, and AdamW's two moments before its first step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
    moments = 2 * sum(p.numel() * p.element_size() for p in trainable) if optimizer is not None and not optimizer.state else 0
    return grads + moments


def rows_within(budget: int, fixed: int, row_bytes: float, limit: int) -> int:
    """floor((budget - fixed) / row_bytes), at least 1, at most ``limit``."""
    return max(1, min(limit, math.floor(max(budget - fixed, 0) / max(row_bytes, 1.0))))


def _layers_and_width(model: nn.Module) -> tuple[int, int]:
    """(decoder layers, hidden width) from the model's config; (1, 0) where it says neither (then no layer is assumed freed)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    return int(layers), int(width)


@dataclasses.dataclass(frozen=True)
class Pass:
    """A model whose forward runs on each micro-batch: ``optimizer`` None for a frozen one run without grad
    (GKD's teacher); ``forward`` None for a policy's (:func:`policy_forward`, its LM head counted apart),
    else what the model runs (a critic's values)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    forward: Callable[[nn.Module, Rollout], Tensor] | None = None


def plan_rows(
    passes: Sequence[Pass], rollout: Rollout, setting: int | str | None, minibatch: int, model_cfg: ModelConfig,
    world: distributed.World = distributed.World(), cache: dict | None = None,
) -> RowPlan:
    """Rows per forward of a step's passes, which share the rows (a policy and its critic; a student and
    its teacher). ``setting``: ``micro_batch_size`` (an int: that many; None: the whole ``minibatch``;
    "auto": from the memory budget); ``cache``: the probes' costs by shape, kept between steps."""
    if setting != "auto":
        return RowPlan(setting, setting or minibatch)
    device = next(passes[0].model.parameters()).device
    cache = {} if cache is None else cache
    prompt_len, completion_len = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    probe_p, probe_c = (int(distributed.all_max(float(-(-n // PROBE_ROUND) * PROBE_ROUND), world)) for n in (prompt_len, completion_len))  # one shape on every learner
    budget = device_budget(device, model_cfg.memory_fraction) - sum(_pending_update_bytes(p.model, p.optimizer) for p in passes)
    fixed, update_row, no_grad_row = 0, 0.0, 0.0
    tokens = prompt_len + completion_len
    for p in passes:
        key = (id(p.model), p.forward, model_cfg.autocast)
        if key not in cache or cache[key][0] < probe_p + probe_c:  # a longer shape than any probed: probe it
            cache[key] = (probe_p + probe_c, row_cost(p.model, p.forward or policy_forward, probe_p, probe_c, model_cfg.autocast))
        probed_tokens, probed = cache[key]
        cost = RowCost(probed.fixed, math.ceil(probed.per_row * min(1.0, tokens / probed_tokens)))  # a row's activations scale with its tokens
        fixed += cost.fixed
        layers, width = _layers_and_width(p.model)
        head = lm_head_of(p.model)
        vocab = head.out_features if head is not None else getattr(getattr(p.model, "config", None), "vocab_size", 0) or 0
        logits_row = completion_len * vocab * 4.0  # one row's float32 logits
        head_row = 0.0
        if p.forward is None and head is None:  # the probe measured the logits; their log-softmax and gradient come on top
            head_row = 2 * logits_row
        elif p.forward is None:  # the logits while a pass's fit logits_limit_mb, else the chunked head: at most the larger, at any rows
            fixed += int(max(3 * min(model_cfg.logits_limit_mb * 2**20, minibatch * logits_row), 4 * 4 * min(HEAD_CHUNK_ELEMENTS, minibatch * completion_len * vocab)))
        freed = cost.per_row * min(1.0, 4 / layers) + head_row / 2  # without grad: about two layers' activations in flight, and the KV cache
        no_grad_row += freed
        if p.optimizer is None:
            update_row += freed
        elif model_cfg.gradient_checkpointing:
            update_row += SLACK * (cost.per_row / layers + layers * tokens * width * 4 + head_row)
        else:
            update_row += SLACK * (cost.per_row + head_row)
    most = 2**31  # the rows that fit, agreed over learners (the fewest), then capped at this rank's own rows
    fit = [int(-distributed.all_max(-float(rows_within(budget, fixed, row, most)), world)) for row in (update_row, no_grad_row)]
    return RowPlan(min(fit[0], minibatch), min(fit[1], rollout.batch_size), budget / 2**20)
