"""The forward passes of an RL step besides sampling: the policy's completion logits (each group's
prompt run once, or compiled), the reference pass, the pi_old recompute, PPO's critic values, and
the statistics that compare log-probs (the sampler's against the training forward's, pi against pi_old).

    ref_logp = reference_logprobs(policy, reference, rollout, temperature, batches, autocast)      # (B, C)
    old_logp = training_logprobs(policy, rollout, temperature, minibatches, autocast)               # (B, C)
    logp, entropy = completion_logprobs(policy, minibatch, temperature, "statistic")                 # (B, C) each
    values = critic_values(critic, minibatch)                                                        # (B, C)
    logits = completion_logits(policy, minibatch)                                                    # (B, C, V)

Each pass runs its rows at their own width (:func:`trimmed`), and, where that runs fewer positions
than padded rows or shared prompts, packed end to end (:mod:`rlalign.core.packing`, by
:func:`rlalign.lm.logprobs.completion_logits`).

Log-probs come from the logits, which :mod:`rlalign.core.logprobs` reads in chunks; or, when the
float32 logits of a pass would be larger than ``logits_limit_mb`` (``model.logits_limit_mb``), from
the last hidden states and the LM head chunk by chunk, with no (B, C, V) logits at all
(:mod:`rlalign.core.linear_logprobs`), where the model allows it (:func:`rlalign.lm.logprobs.lm_head_of`:
one process, a plain head with nothing after it, not compiled). Both give the same values and
gradients to float round-off; the chunked path's memory stays flat as rows grow, for one more
matmul of the head in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlalign.core.kl import entropy_from_logits
from rlalign.core.linear_logprobs import EntropyMode, linear_token_logprobs
from rlalign.core.logprobs import token_logprobs, token_logprobs_and_entropy
from rlalign.core.masks import counted_only
from rlalign.lm import private
from rlalign.lm.logprobs import completion_hidden, lm_head_of, packed_layout, wrapped_across_processes
from rlalign.lm.logprobs import completion_logits as lm_completion_logits
from rlalign.lm.model_modes import checkpointing_enabled, evaluating
from rlalign.lm.models import reference_policy
from rlalign.lm.rollout import Rollout
from rlalign.train import distributed
from rlalign.train.common import autocast_context, memory_named

__all__ = [
    "completion_logits",
    "share_prompts",
    "head_chunks",
    "compiled_completion_logits",
    "rollout_token_logprobs",
    "completion_logprobs",
    "critic_values",
    "trimmed",
    "logprobs_and_entropy",
    "reference_logprobs",
    "training_logprobs",
    "loss_mask",
    "micro_batches",
    "LOGITS_LIMIT_MB",
    "logprob_mismatch",
    "ratio_deviation",
]


LOGITS_LIMIT_MB = 1024.0  # rlalign.train.run_config.ModelConfig.logits_limit_mb's default


def completion_logits(model: nn.Module, rollout: Rollout, compiled: bool = False, layout_from: nn.Module | None = None) -> Tensor:
    """:func:`rlalign.lm.logprobs.completion_logits` of a rollout (the trainer needs the logits
    themselves for the entropy), on the model's device, each group's prompt run once when
    :func:`share_prompts` of ``layout_from`` (default ``model``); ``compiled``: through
    :func:`compiled_completion_logits` (one forward), unless this torch lacks what that needs
    (:mod:`rlalign.lm.private`: one warning, then eager). Shape: (B, C, V)."""
    device = next(model.parameters()).device
    r = rollout.to(device)
    if compiled and private.ready("compiled"):
        from rlalign.lm.compiled import releasing_compiler_caches  # the compile machinery, only when asked for

        with releasing_compiler_caches():
            return compiled_completion_logits()(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, None, False)  # padded rows: static layout
    share = share_prompts(model if layout_from is None else layout_from)
    return lm_completion_logits(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.group_index if share else None)


def share_prompts(model: nn.Module) -> bool:
    """Whether a pass of ``model`` runs each group's prompt once (rlalign.lm.logprobs): unless it is in
    DDP or FSDP2, which expect one forward per backward (:func:`rlalign.lm.logprobs.wrapped_across_processes`),
    or checkpoints its activations, whose training forward drops the KV cache a shared prompt needs
    (its no-grad passes then do not share either, so they run the update's layout). The logits are
    the same to float round-off either way."""
    return not wrapped_across_processes(model) and not checkpointing_enabled(model)


def head_chunks(model: nn.Module, layout_from: nn.Module | None = None) -> nn.Linear | None:
    """``model``'s LM head where its log-probs may come from the hidden states and the head in chunks
    (:func:`rlalign.lm.logprobs.lm_head_of` of ``model`` and of ``layout_from``, the model whose
    update forward this pass must match); else None."""
    head = lm_head_of(model)
    return head if layout_from is None or head is None or lm_head_of(layout_from) is not None else None


def _splits_head(model: nn.Module, layout_from: nn.Module, compiled: bool) -> bool:
    """Whether ``model``'s pass may run its LM head in chunks (so ``model.logits_limit_mb`` bounds its logits)."""
    return not compiled and head_chunks(distributed.unwrap(model), layout_from) is not None


@functools.cache
def compiled_completion_logits() -> Callable[..., Tensor]:
    """:func:`rlalign.lm.logprobs.completion_logits` under ``torch.compile`` with dynamic shapes, so
    one compilation serves every (B, P, C) of a run (the ``compile`` option of GRPO and PPO: the
    training forward and its backward, the pi_old recompute and the reference pass; with and
    without grad are separate graphs, and a model of another structure or dtype compiles another;
    the decode loop is ``sampling.compile``). The compiled forward runs every row's prompt (no
    shared prompts) on the padded rows (no packed rows), which for long prompts and large G or
    ragged completions can cost more than it saves."""
    return torch.compile(lm_completion_logits, dynamic=True)


def rollout_token_logprobs(model: nn.Module, rollout: Rollout, temperature: float, compiled: bool = False, logits_limit_mb: float = LOGITS_LIMIT_MB,
                           layout_from: nn.Module | None = None) -> Tensor:
    """log pi(y_t | x, y_<t) of a rollout's completion tokens by :func:`completion_logprobs` (compiled
    or not, laid out as ``layout_from``'s would be), 0 on padding; float32, on the CPU. Shape: (B, C)."""
    logp, _ = completion_logprobs(model, rollout, temperature, "none", compiled, logits_limit_mb, layout_from)  # (B, C)
    return logp.float().cpu()


def completion_logprobs(model: nn.Module, rollout: Rollout, temperature: float, entropy: EntropyMode = "none",
                        compiled: bool = False, logits_limit_mb: float = LOGITS_LIMIT_MB, layout_from: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t) of a rollout's completion tokens under softmax(logits / temperature) and, by
    ``entropy`` ("none", "statistic": detached, "gradient": for an entropy bonus), the entropy of each
    position; float32, on the model's device. From the hidden states and the LM head in chunks when
    the float32 logits would pass ``logits_limit_mb`` and :func:`rlalign.lm.logprobs.lm_head_of`
    allows it and the forward is not compiled (module docstring); else from :func:`completion_logits`
    (faster: the chunked path computes the head's matmul once more in backward); on :func:`trimmed` columns,
    padded back with 0. Both are 0 on padding, as the sampler's and the reference's log-probs are: a
    padding position's log-prob (any token, often far below -88 at a low temperature) would otherwise
    overflow an exp in the loss (k3's pi_ref / pi, a ratio) to inf, and inf times a mask of 0 is NaN.
    ``layout_from``: the model whose update forward this pass must match bit for
    bit (a reference or pi_old pass: the policy), which then decides whether prompts are shared and the
    head may run in chunks (:func:`share_prompts`, :func:`head_chunks`); default ``model``.
    Shapes: (B, C), (B, C) or None."""
    rollout, width = trimmed(rollout)
    logp, entropy_values = _completion_logprobs(model, rollout, temperature, entropy, compiled, logits_limit_mb, layout_from)
    padding = rollout.completion_mask.to(logp.device) == 0  # (B, C')
    logp, entropy_values = logp.masked_fill(padding, 0.0), None if entropy_values is None else entropy_values.masked_fill(padding, 0.0)
    pad = width - logp.shape[1]  # the trimmed padding columns back, 0 (masked everywhere)
    return (F.pad(logp, (0, pad)), None if entropy_values is None else F.pad(entropy_values, (0, pad))) if pad else (logp, entropy_values)


def trimmed(rollout: Rollout) -> tuple[Rollout, int]:
    """``rollout`` without the columns that are padding in every row (leading prompt columns, trailing
    completion columns): a micro-batch of short rows runs at its own width, not the step's longest
    row's; and the completion width it had. The same logits at every real position (positions come
    from the masks; padding is masked out of attention) for less work."""
    width, prompt_width = rollout.completion_ids.shape[1], rollout.prompt_ids.shape[1]
    real_columns = rollout.completion_mask.any(0).nonzero()
    keep = int(real_columns[-1]) + 1 if len(real_columns) else 1
    real_prompt = rollout.prompt_mask.any(0).nonzero()
    start = min(int(real_prompt[0]), prompt_width - 1) if len(real_prompt) else prompt_width - 1  # the last prompt column stays
    if keep == width and start == 0:
        return rollout, width
    r = rollout
    return Rollout(r.prompt_ids[:, start:], r.prompt_mask[:, start:], r.completion_ids[:, :keep], r.completion_mask[:, :keep], r.logprobs[:, :keep],
                   r.group_index, r.truncated), width


def _completion_logprobs(model: nn.Module, rollout: Rollout, temperature: float, entropy: EntropyMode, compiled: bool,
                         logits_limit_mb: float, layout_from: nn.Module | None) -> tuple[Tensor, Tensor | None]:
    head = head_chunks(model, layout_from)
    logits_mb = rollout.completion_ids.numel() * (head.out_features if head is not None else 0) * 4 / 2**20
    if head is None or logits_mb <= logits_limit_mb or (compiled and private.ready("compiled")):
        logits = completion_logits(model, rollout, compiled, layout_from)  # (B, C, V)
        if entropy == "none":
            return token_logprobs(logits, rollout.completion_ids.to(logits.device), temperature), None
        return logprobs_and_entropy(logits, rollout.completion_ids.to(logits.device), temperature, entropy == "gradient")
    r = rollout.to(head.weight.device)
    share = share_prompts(model if layout_from is None else layout_from)
    hidden = completion_hidden(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.group_index if share else None)  # (B, C, H)
    return linear_token_logprobs(hidden, head.weight, r.completion_ids, temperature, head.bias, entropy)


def logprobs_and_entropy(logits: Tensor, completion_ids: Tensor, temperature: float, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """log pi(y_t) and the entropy of softmax(logits / temperature), float32. With ``entropy_grad`` (an
    entropy bonus in the loss) the entropy keeps its gradient; otherwise it is a detached statistic
    from the log-probs' own pass over the logits. Shapes: (B, C, V), (B, C) -> (B, C), (B, C)."""
    if entropy_grad:
        return token_logprobs(logits, completion_ids, temperature), entropy_from_logits(logits, temperature=temperature)
    return token_logprobs_and_entropy(logits, completion_ids, temperature)


def critic_values(critic: nn.Module, rollout: Rollout) -> Tensor:
    """V(s_t) for each completion token: the critic's scalar at position P - 1 + t (the state
    before token t is drawn), the rows at their own width (:func:`trimmed`, 0 on
    the columns dropped) and packed end to end where that runs fewer positions (as the policy's
    passes: :func:`rlalign.lm.logprobs.packed_layout`). Shape: (B, C)."""
    device = next(critic.parameters()).device
    r, width = trimmed(rollout)
    r = r.to(device)
    layout = packed_layout(critic, r.prompt_mask, r.completion_mask, r.prompt_ids.numel() + r.completion_ids.numel())
    if layout is not None:
        values = layout.pick(critic(layout.input_ids(r.prompt_ids, r.completion_ids), None, layout.positions))  # (N, W) -> (B, C)
    else:
        values = critic(r.input_ids(), r.attention_mask(), r.position_ids())[:, r.prompt_ids.shape[1] - 1 : -1]  # (B, P + C) -> (B, C)
    return F.pad(values, (0, width - values.shape[1]))


@torch.no_grad()
def reference_logprobs(
    policy: nn.Module, reference: nn.Module | None, rollout: Rollout, temperature: float, batches: int | Sequence[Tensor | slice], autocast: str = "none",
    compiled: bool = False, logits_limit_mb: float = LOGITS_LIMIT_MB,
) -> Tensor:
    """Completion log-probs under the frozen reference (or ``policy``'s LoRA base, adapters off), by the same
    forward as the updates (compiled when they are); ``policy`` as the updates run it (in DDP or not), under ``autocast``
    (:attr:`rlalign.train.run_config.ModelConfig.autocast`), in ``batches``: consecutive minibatches of
    that many rows, or these row batches (the updates' own: the same shapes, so where the policy is the
    reference the same numbers, and a KL of exactly 0: the rows laid out as the policy's updates lay
    them out, ``layout_from`` of :func:`completion_logprobs`). Shape: (B, C)."""
    batches = [slice(s, s + batches) for s in range(0, rollout.batch_size, batches)] if isinstance(batches, int) else batches
    logprobs = torch.zeros_like(rollout.logprobs)  # (B, C)
    largest = max((len(torch.arange(rollout.batch_size)[rows]) for rows in batches), default=0)
    with reference_policy(distributed.unwrap(policy), reference) as ref, evaluating(ref), distributed.gathered(ref), autocast_context(autocast, ref), \
            memory_named("the reference pass", largest, rollout.completion_ids.shape[1], _splits_head(reference if reference is not None else policy, policy, compiled)):
        for rows in batches:
            logprobs[rows] = rollout_token_logprobs(ref, rollout.select(rows), temperature, compiled, logits_limit_mb, policy)
    return logprobs


@torch.no_grad()
def training_logprobs(
    policy: nn.Module, rollout: Rollout, temperature: float, minibatches: Sequence[Tensor | slice], autocast: str = "none", compiled: bool = False,
    logits_limit_mb: float = LOGITS_LIMIT_MB,
) -> Tensor:
    """log pi_old recomputed by the training forward (:func:`completion_logits`, compiled or not as
    the updates are), on the same minibatches (same shapes, so the same kernels) as the updates that
    follow, laid out as they lay them out (``policy`` as they run it, in DDP or not; the forward
    itself outside DDP): with autocast the sampler's numerics differ. Shape: (B, C)."""
    runner, policy = policy, distributed.unwrap(policy)
    logprobs = torch.zeros_like(rollout.logprobs)  # (B, C)
    largest = max(len(torch.arange(rollout.batch_size)[batch]) for batch in minibatches)
    with autocast_context(autocast, policy), evaluating(policy), memory_named("the pi_old pass", largest, rollout.completion_ids.shape[1], _splits_head(policy, runner, compiled)):
        for rows in minibatches:
            logprobs[rows] = rollout_token_logprobs(policy, rollout.select(rows), temperature, compiled, logits_limit_mb, runner)
    return logprobs


def micro_batches(rows: Tensor, size: int | None) -> list[Tensor]:
    """``rows`` (a minibatch's row indices) cut into micro-batches of ``size`` rows (the last may be
    shorter), whose gradients one optimiser step accumulates; ``size`` None: one micro-batch."""
    return list(rows.split(size)) if size else [rows]


def loss_mask(rollout: Rollout, mask_truncated: bool) -> Tensor:
    """1 on completion tokens that count in the loss; rows without EOS zeroed when ``mask_truncated``. Shape: (B, C)."""
    mask = rollout.completion_mask.float()  # (B, C)
    if mask_truncated:
        mask = mask * (~rollout.truncated).float()[:, None]
    return mask


def logprob_mismatch(logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> Tensor:
    """max |training log-prob - sampler log-prob| over counted tokens (detached); 0 for no tokens."""
    with torch.no_grad():
        gap = (logp - sampler_logp).abs() * (mask > 0)  # (B, C); a weighted row counts as any other
        return gap.max() if gap.numel() else gap.new_zeros(())


def ratio_deviation(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """max |pi / pi_old - 1| over counted tokens (detached). On the first minibatch, before any
    update, it is the mismatch between the sampler's log-probs and the training pass's."""
    with torch.no_grad():
        deviation = (torch.exp(counted_only(logp - old_logp, mask)) - 1.0).abs()  # (B, C), 0 off the mask
        return deviation.max() if deviation.numel() else deviation.new_zeros(())
