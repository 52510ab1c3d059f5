"""Rows per forward from a memory budget: ``micro_batch_size: auto``.

    plan = plan_rows([Pass(policy, optimizer, runner=ddp_policy)], rollout, "auto", minibatch_rows, model_cfg, world, cache)
    plan.update      # rows per forward + backward of an update (its gradient accumulated over them)
    plan.no_grad     # rows per reference / pi_old / value pass

The budget is what the device has left for one pass:

    CUDA:  budget = min(free + (reserved - allocated), cap - allocated) - (1 - memory_fraction) * cap
           (torch.cuda.mem_get_info: the card's free memory, the caching allocator's own free blocks
           counted as free, other processes' use not; cap: the card's total times this process's
           torch.cuda.set_per_process_memory_fraction)
    CPU:   budget = memory_fraction * min(MemAvailable, cgroup memory.max - memory.current) / LOCAL_WORLD_SIZE
           (/proc/meminfo; a container's limit; each of torchrun's processes on the host its share)
    other devices: no plan, the whole minibatch (as micro_batch_size: null)

minus what the update will add to it: the gradients of trainable weights that have none yet, and
AdamW's two moments before its first step (each the trainable weights' bytes, this rank's shard).

What a row costs is measured, not guessed per architecture: a probe runs the model's forward (a
policy's up to the hidden states its LM head reads) on 1 and then 2 rows of the rollout's (P, C)
shape (each rounded up to a multiple of 32 tokens) under ``torch.autograd.graph.saved_tensors_hooks``
and sums the bytes of the tensors autograd keeps for backward (parameters left out, each storage
once; a frozen model's weights made to need a gradient for it):

    saved(n) = fixed + n * per_row          (fixed: the autocast copies of the weights; linear in n)
    per_row  = saved(2) - saved(1)

A run probes again only when its rows grow longer than the longest probed; a shorter row costs
per_row * T / T_probed (activations grow with tokens, attention's scores faster: scaled down
linearly, an upper bound). The probe runs in eval mode (no activation checkpointing; dropout is 0
either way) and with every row running its prompt at full width (no shared prompts, no packed
rows: a pass runs at most that many positions, :mod:`rlalign.core.packing`), an upper bound of what a
pass keeps. Then, with L layers of width H, T = P + C tokens a row and V the vocabulary:

    update row  = SLACK * per_row + head_row                         a trained model
                = SLACK * (per_row / L + L * T * H * 4) + head_row   with checkpointing: each layer keeps its input
                                                                     (T x H float32), one layer recomputed at a time
    frozen row  = per_row * min(1, 4 / L) + head_row                 without grad each layer's activations are freed as
                                                                     the next runs: a few layers' in flight (no-grad passes;
                                                                     GKD's teacher in each micro-batch)
    head_row    = k * C * V * 4        where the pass keeps the logits (a head that cannot be split off, a model in
                                       DDP or FSDP2, a compiled forward): k float32 copies (3 for log-probs, 5 with an
                                       entropy bonus, 9 for GKD; 2 without grad); else 0, and
    fixed      += max(k * min(logits_limit_mb, the pass's float32 logits), 16 bytes x one chunk of
                  rlalign.core.linear_logprobs) (a pass keeps the logits while they fit the limit)
    rows        = floor((budget - fixed) / row), at least 1, at most the minibatch (the rollout: no-grad passes)

Models whose forwards share an update micro-batch add up (a student and GKD's teacher); models updated
one after another (PPO's policy, then its critic), and the no-grad passes, take the fewest rows of any.
SLACK = 1.25 covers backward's transient activation gradients. Under torchrun the learners agree on
the probe's shape (the largest) and on the rows that fit (the fewest), so every rank runs the same
probes (FSDP2 gathers weights in each); a rank with fewer rows runs fewer micro-batches, evened out by
:func:`rlalign.train.updater.minibatch_step`. Micro-batches change only memory and round-off, never
the update; an out-of-memory anyway names the rows and the settings to lower
(:func:`rlalign.train.common.memory_named`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlalign.core.linear_logprobs import CHUNK_ELEMENTS
from rlalign.lm.logprobs import completion_hidden, completion_logits, lm_head_of
from rlalign.lm.model_modes import evaluating
from rlalign.lm.rollout import Rollout
from rlalign.train import distributed
from rlalign.train.bf16_adamw import StochasticRoundingAdamW
from rlalign.train.common import autocast_context, memory_named
from rlalign.train.run_config import ModelConfig

__all__ = ["RowPlan", "Pass", "plan_rows", "policy_forward", "probe_rollout", "device_budget", "saved_bytes", "RowCost", "row_cost", "rows_within", "SLACK", "PROBE_ROUND"]

SLACK = 1.25  # backward's transient activation gradients, on top of what the forward keeps
PROBE_ROUND = 32  # probe shapes: prompt and completion widths rounded up to this many tokens


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Rows per update micro-batch (None: the whole minibatch) and per no-grad pass."""

    update: int | None
    no_grad: int
    budget_mb: float | None = None  # the budget they were planned for (auto only)

    def metrics(self) -> dict[str, float]:
        """memory/micro_rows, memory/pass_rows and memory/budget_mb, when planned (auto: every number set)."""
        if self.budget_mb is None:
            return {}
        return {"memory/micro_rows": float(self.update), "memory/pass_rows": float(self.no_grad), "memory/budget_mb": self.budget_mb}


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
        return t.detach()  # keeps the storage (no address reused while counting) but not ``t``: a node's saved output,
        # returned itself, would hold its own node (a reference cycle through C++ that no collector frees: measured,
        # SmolLM2's probe of 2 rows left 415 MB resident at every call)

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
    measured at 1 and 2 rows in eval mode with grad (module docstring). A frozen model (a teacher, a
    reference) saves nothing for backward, so its weights need a gradient for the probe: what it then
    keeps is what a trained one's forward makes."""
    device = next(model.parameters()).device
    frozen = [p for p in model.parameters() if not p.requires_grad] if not any(p.requires_grad for p in model.parameters()) else []

    def saved(rows: int) -> int:
        probe = probe_rollout(rows, prompt_len, completion_len, device)
        for p in frozen:
            p.requires_grad_(True)
        try:
            with torch.enable_grad(), evaluating(model), autocast_context(autocast, model), memory_named("the memory probe", rows, completion_len):
                return saved_bytes(lambda: forward(model, probe), list(model.parameters()))
        finally:
            for p in frozen:
                p.requires_grad_(False)

    one, two = saved(1), saved(2)
    per_row = max(two - one, 1)
    return RowCost(max(one - per_row, 0), per_row)


def _cgroup_available(root: str) -> int | None:
    """Bytes this container may still take (cgroup v2 memory.max - memory.current under ``root``), None without a limit."""
    try:
        limit = open(os.path.join(root, "memory.max")).read().strip()
        current = int(open(os.path.join(root, "memory.current")).read())
    except OSError:
        return None
    return None if limit == "max" else int(limit) - current


def device_budget(device: torch.device, fraction: float, meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes a pass may still take on ``device`` (module docstring; ``meminfo`` and ``cgroup``: where a CPU's are read)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cap = total * torch.cuda.get_per_process_memory_fraction(device)  # torch.cuda.set_per_process_memory_fraction's limit
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return int(min(free + reserved - allocated, cap - allocated) - (1 - fraction) * cap)
    with open(meminfo) as f:
        available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    contained = _cgroup_available(cgroup)
    available = available if contained is None else min(available, contained)
    return int(fraction * available / int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # the host's share of each process on it


def _local_bytes(p: Tensor, element_size: int | None = None) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel() * (element_size or p.element_size())  # an FSDP2 weight: this rank's shard


def _pending_update_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes an update still allocates: gradients of trainable weights without one, and AdamW's two moments before its first step
    (in the weight's dtype; float32 for bfloat16 weights stepped in float32, :class:`StochasticRoundingAdamW`)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(_local_bytes(p) for p in trainable if p.grad is None)
    float32_moments = isinstance(optimizer, StochasticRoundingAdamW)
    moment_size = lambda p: 4 if float32_moments and p.dtype == torch.bfloat16 else None  # noqa: E731
    moments = 2 * sum(_local_bytes(p, moment_size(p)) for p in trainable) if optimizer is not None and not optimizer.state else 0
    return grads + moments


def rows_within(budget: int, fixed: int, row_bytes: float, limit: int) -> int:
    """floor((budget - fixed) / row_bytes), at least 1, at most ``limit``."""
    return max(1, min(limit, math.floor(max(budget - fixed, 0) / max(row_bytes, 1.0))))


def _layers_and_width(model: nn.Module) -> tuple[int, int, int]:
    """(decoder layers, hidden width, vocabulary) from the model's config; (1, 0, 0) where it says none
    (then no layer is assumed freed, no layer input kept, no logits)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    return int(layers), int(width), int(getattr(config, "vocab_size", None) or 0)


@dataclasses.dataclass(frozen=True)
class Pass:
    """A model a step runs forwards of.

    model: the module itself (probed; its no-grad passes call it). optimizer: None for a frozen one.
    forward: None for a policy's (:func:`policy_forward`, its LM head counted apart), else what the
    model runs (a critic's values). runner: the model the updates call where it is another (a DDP
    wrapper, whose forward keeps the logits). group: passes of one group run in the same update
    micro-batch (their rows add up: a student and GKD's teacher); groups run one after another
    (PPO's policy, then its critic); None: the model runs in no-grad passes only (a reference, the
    reverse-KL teacher). head_copies: the float32 logits' copies the update's loss keeps and makes in
    backward (3: log-probs; 5 with an entropy bonus; 9 for GKD's full-vocabulary divergence).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    forward: Callable[[nn.Module, Rollout], Tensor] | None = None
    runner: nn.Module | None = None
    group: int | None = 0
    head_copies: float = 3.0


def plan_rows(
    passes: Sequence[Pass], rollout: Rollout, setting: int | str | None, minibatch: int, model_cfg: ModelConfig,
    world: distributed.World = distributed.World(), cache: dict | None = None, compiled: bool = False,
) -> RowPlan:
    """Rows per forward of a step's passes, the policy's first (every no-grad pass lays its rows out as
    the policy's updates do: the LM head in chunks only where theirs can be, :func:`rlalign.train.passes.head_chunks`).
    ``setting``: ``micro_batch_size`` (an int: that many; None:
    the whole ``minibatch``; "auto": from the memory budget, on a CPU or a CUDA GPU; another device
    takes the whole minibatch); ``cache``: the probes' costs by shape, kept between steps;
    ``compiled``: the trainer's compiled forwards (they keep the logits)."""
    device = next(passes[0].model.parameters()).device
    if setting != "auto" or device.type not in ("cpu", "cuda"):
        return RowPlan(None if setting == "auto" else setting, setting if isinstance(setting, int) else minibatch)
    cache = {} if cache is None else cache
    prompt_len, completion_len = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    probe_p, probe_c = (int(distributed.all_max(float(-(-n // PROBE_ROUND) * PROBE_ROUND), world)) for n in (prompt_len, completion_len))  # one shape on every learner
    budget = device_budget(device, model_cfg.memory_fraction) - sum(_pending_update_bytes(p.model, p.optimizer) for p in passes)
    limit = model_cfg.logits_limit_mb * 2**20
    tokens = prompt_len + completion_len
    groups: dict[int, list[tuple[float, float]]] = {}  # group -> (fixed, row) of its passes
    no_grad: list[tuple[float, float]] = []
    policy_chunks = lm_head_of(passes[0].runner or passes[0].model) is not None  # no-grad passes lay rows out as the policy's updates (passes: layout_from)
    for p in passes:
        key = (id(p.model), p.forward, model_cfg.autocast)
        if key not in cache or cache[key][0] < probe_p + probe_c:  # a longer shape than any probed: probe it
            cache[key] = (probe_p + probe_c, row_cost(p.model, p.forward or policy_forward, probe_p, probe_c, model_cfg.autocast))
        probed_tokens, probed = cache[key]
        per_row = math.ceil(probed.per_row * tokens / probed_tokens)  # a row's activations scale with its tokens (never more than probed)
        layers, width, vocab = _layers_and_width(p.model)
        logits_row = completion_len * vocab * 4.0 if p.forward is None else 0.0  # one row's float32 logits (none for a critic)
        chunk = 16.0 * min(CHUNK_ELEMENTS, minibatch * completion_len * vocab) if p.forward is None else 0.0  # the chunked head's working set

        def head(rows: int, copies: float, split: bool) -> tuple[float, float]:
            """(fixed, per row) of the LM head: split off, the logits while a pass's fit the limit, else one chunk; else the logits of every row."""
            return (max(copies * min(limit, rows * logits_row), chunk), 0.0) if split else (0.0, copies * logits_row)

        split_no_grad = lm_head_of(p.model) is not None and policy_chunks and not compiled
        head_fixed, head_row = head(rollout.batch_size, 2.0, split_no_grad)
        freed = per_row * min(1.0, 4 / layers)  # without grad each layer's activations are freed as the next runs: a few layers' in flight
        no_grad.append((probed.fixed + head_fixed, freed + head_row))
        if p.group is None:
            continue
        trained = p.optimizer is not None
        head_fixed, head_row = head(minibatch, p.head_copies if trained else 2.0, lm_head_of(p.runner or p.model) is not None and not compiled)
        if not trained:  # a frozen model in each micro-batch (GKD's teacher): no grad
            row = freed + head_row
        elif model_cfg.gradient_checkpointing:  # each layer keeps its input; one layer recomputed at a time
            row = SLACK * (per_row / layers + layers * tokens * width * 4) + head_row
        else:
            row = SLACK * per_row + head_row
        groups.setdefault(p.group, []).append((probed.fixed + head_fixed, row))
    most = 2**31  # the rows that fit, agreed over learners (the fewest), then capped at this rank's own rows
    update_fit = min(rows_within(budget, int(sum(f for f, _ in g)), sum(r for _, r in g), most) for g in groups.values()) if groups else most
    no_grad_fit = min(rows_within(budget, int(f), r, most) for f, r in no_grad)
    fit = [int(-distributed.all_max(-float(n), world)) for n in (update_fit, no_grad_fit)]
    return RowPlan(min(fit[0], minibatch), min(fit[1], rollout.batch_size), budget / 2**20)
