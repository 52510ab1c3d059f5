"""Training-time log-probs of completion tokens: logits only where they are needed.

    logp = completion_logprobs(policy, rollout.prompt_ids, rollout.prompt_mask,
                               rollout.completion_ids, rollout.completion_mask, temperature=1.0)  # (B, C)

The model runs on prompt + completion (B, P + C), but the LM head is applied to the C hidden
states that predict completion tokens only (``logits_to_keep``: the hidden states are selected
*before* the vocabulary projection), and the per-token log-probs come from
:func:`rlalign.core.logprobs.token_logprobs`, which never materialises a float32 (B, C, V)
log-softmax. Position P - 1 + t predicts completion token t, so the kept positions are
P - 1 .. P + C - 2.

Shared prompts: the G completions of a GRPO group share their prompt. With ``group_index`` the
prompt but its last token runs once per group (U rows instead of B = U G), its KV cache is indexed
out to the B rows (``DynamicCache.batch_select_indices``: differentiable, so the prompt positions
get the summed gradient of their G rows), and each row runs its last prompt token and its
completion tokens: the C positions that predict the completion, so the LM head runs once, on one
(B C, H) block, and the token embeddings of both passes are looked up in one call. Each call of
either gives its weight a dense (V, H) gradient in backward, and autograd sums a weight's several
into a new one: a tied LM head and embedding called once each get two such gradients and one
sum per update, where calling both in each of the two passes would give four and three. The logits are
those of the full forward up to float round-off (tested for Llama and GPT-2, with LoRA, forward
and backward); the work on prompt positions shrinks G-fold.

The positions are handed over as an index tensor, not as a count: indexing copies the kept hidden
states into one contiguous (B, C, H) block, which torch folds into a single (B C, H) x (H, V)
matmul. A count makes transformers take a strided slice, and without autograd torch then runs the
LM head as a batched matmul against the weight expanded (and, in bfloat16, copied) once per row,
which is much slower for a bfloat16-held model.

Memory saved: the logits tensor shrinks from B (P + C) V to B C V values, a fraction
P / (P + C) of it (half when prompt and completion are equally long), and its gradient shrinks
alike. :func:`completion_hidden` goes further: the same forward with the LM head left out, the
(B, C, H) hidden states it would project, for :func:`rlalign.core.linear_logprobs.linear_token_logprobs`
to turn into log-probs chunk by chunk, with no (B, C, V) logits at all. :func:`lm_head_of` says
for which models the logits are exactly the head's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from rlalign.core.logprobs import token_logprobs
from rlalign.core.masks import position_ids_from_mask
from rlalign.core.packing import PackedRows, pack_rows
from rlalign.lm import private
from rlalign.lm.model_modes import is_checkpointing
from rlalign.lm.models import cache_argument, unwrap_causal_lm

__all__ = [
    "completion_positions",
    "completion_logits",
    "completion_hidden",
    "lm_head_of",
    "packs_rows",
    "packed_layout",
    "wrapped_across_processes",
    "HEAD_LAST_MODEL_TYPES",
    "PACKED_ROWS_MODEL_TYPES",
    "PACKED_ROWS_KERNELS",
    "completion_logprobs",
    "rollout_logprobs",
]

# Architectures whose logits are exactly lm_head(last hidden state): nothing (a soft cap, a scale, a
# multiplier) is applied after the head in their transformers forward.
HEAD_LAST_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gpt2", "phi3", "olmo2"})
# Architectures whose transformers forward, given position ids and no attention mask, builds its masks
# with masking_utils, which keeps rows packed end to end apart where their position ids restart at 0,
# and the attention kernels whose masks come from there (flash attention reads the position ids itself: not tested here).
PACKED_ROWS_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gpt2", "phi3", "olmo2"})
PACKED_ROWS_KERNELS = frozenset({"sdpa", "eager"})


def wrapped_across_processes(model: nn.Module) -> bool:
    """Whether ``model`` is in DistributedDataParallel or sharded by FSDP2: then every forward must be
    the wrapper's own, one a backward, with every parameter used inside it."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, nn.parallel.DistributedDataParallel) or any(isinstance(m, FSDPModule) for m in model.modules())


def lm_head_of(model: nn.Module) -> nn.Linear | None:
    """The LM head of ``model`` when its logits are exactly ``head(hidden)`` and it is a plain
    ``nn.Linear`` (not a LoRA-wrapped or sharded one), outside DDP and FSDP2; else None (use the logits)."""
    if wrapped_across_processes(model):
        return None  # DDP and FSDP2 expect every parameter used inside their forward
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in HEAD_LAST_MODEL_TYPES or not callable(getattr(model, "get_output_embeddings", None)):
        return None
    head = model.get_output_embeddings()
    return head if type(head) is nn.Linear and type(head.weight) is nn.Parameter else None


def _causal_lm(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (others are their own)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def _head_wrapped(model: nn.Module, wrap: Callable[[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]]) -> Iterator[None]:
    """The model's LM head running ``wrap(its forward)`` while the block runs, inside the model's own
    forward (so DDP and FSDP2 see every weight used there); its forward as it was afterwards."""
    head = _causal_lm(model).get_output_embeddings()
    before = head.__dict__.get("forward")  # an instance attribute: nn.Module.__call__ finds it before the class's
    head.forward = wrap(head.forward)
    try:
        yield
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def _head_left_out(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The model's LM head made the identity while the block runs: its "logits" are the hidden states."""
    return _head_wrapped(model, lambda run: lambda hidden: hidden)


def packs_rows(model: nn.Module) -> bool:
    """Whether ``model``'s transformers masks keep packed rows apart (:mod:`rlalign.core.packing`): an
    architecture of :data:`PACKED_ROWS_MODEL_TYPES` under an attention kernel of :data:`PACKED_ROWS_KERNELS`,
    with LoRA adapters or none, and transformers' packed-sequence masks there (:mod:`rlalign.lm.private`)."""
    config = getattr(unwrap_causal_lm(_causal_lm(model)), "config", None)
    return (getattr(config, "model_type", None) in PACKED_ROWS_MODEL_TYPES and getattr(config, "_attn_implementation", None) in PACKED_ROWS_KERNELS
            and _weight_adapters_only(_causal_lm(model)) and private.ready("packed_rows"))


def _weight_adapters_only(model: nn.Module) -> bool:
    """Whether every peft adapter on ``model`` is LoRA or its kin (weights changed, no virtual tokens: a
    prefix tuning's KV cache would let packed rows see each other)."""
    adapters = getattr(model, "peft_config", None) or {}  # a peft model's, or transformers' own adapters': name -> config
    if not adapters:
        return True
    from peft import LoraConfig  # only where there are adapters

    return all(isinstance(config, LoraConfig) for config in adapters.values())


def completion_positions(prompt_len: int, completion_len: int, device: torch.device | str) -> Tensor:
    """The positions P - 1 .. P + C - 2 whose hidden states predict the C completion tokens, as the
    index tensor ``logits_to_keep`` takes (contiguous LM-head input, see the module doc). Shape: (C,)."""
    return torch.arange(prompt_len - 1, prompt_len + completion_len - 1, device=device)


def completion_logits(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, group_index: Tensor | None = None,
    packed: bool = True,
) -> Tensor:
    """Logits predicting each completion token, the LM head applied at those positions only.

    Args:
        model: causal LM (transformers or peft) accepting ``logits_to_keep``.
        prompt_ids, prompt_mask: left-padded prompts. Shape: (B, P).
        completion_ids, completion_mask: right-padded completions. Shape: (B, C).
        group_index: rows with the same index have the same prompt (a GRPO group), which then runs
            once (see the module doc); None or all-distinct: one forward over prompt + completion. Shape: (B,).
        packed: the rows' real tokens may run packed end to end (:mod:`rlalign.core.packing`), where
            :func:`packs_rows` allows it and that runs fewer positions than the padded forward (or the
            shared prompts); the logits at padding columns then differ (they are masked everywhere).
    Returns:
        Shape: (B, C, V), in the model's (or autocast's) dtype; row t predicts completion token t.
    """
    batch, prompt_len = prompt_ids.shape
    padded = batch * (prompt_len + completion_ids.shape[1])  # positions the padded forward runs
    shared = None  # (each row's group among the U, U) where the groups' prompts run once
    if group_index is not None and not is_checkpointing(model) and prompt_len > 1:  # a checkpointed forward drops the KV cache the shared prompt needs
        groups, rows_group = torch.unique(group_index, return_inverse=True)  # (U,), (B,)
        if len(groups) < batch:  # all-distinct groups (or a one-token prompt, above): nothing to share
            shared, padded = (rows_group, len(groups)), len(groups) * (prompt_len - 1) + completion_ids.numel()  # U (P - 1) + B C positions
    layout = packed_layout(model, prompt_mask, completion_mask, padded) if packed else None
    if layout is not None:
        return _packed_logits(model, prompt_ids, completion_ids, layout)
    if shared is not None:
        return _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *shared)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + C)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()  # (B, P + C)
    position_ids = position_ids_from_mask(attention_mask)  # (B, P + C)
    keep = completion_positions(prompt_ids.shape[1], completion_ids.shape[1], input_ids.device)  # (C,)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, logits_to_keep=keep).logits


def packed_layout(model: nn.Module, prompt_mask: Tensor, completion_mask: Tensor, padded: int) -> PackedRows | None:
    """The packed layout of these rows (:func:`rlalign.core.packing.pack_rows`) where ``model`` packs
    rows (:func:`packs_rows`) and the packed rows run fewer positions than ``padded``; else None."""
    layout = pack_rows(prompt_mask, completion_mask) if packs_rows(model) else None
    return layout if layout is not None and layout.size < padded else None


def _packed_logits(model: nn.Module, prompt_ids: Tensor, completion_ids: Tensor, layout: PackedRows) -> Tensor:
    """:func:`completion_logits` with the rows packed by ``layout``: one forward over (N, W) positions,
    no attention mask (the position ids keep the rows apart), and the LM head applied, inside that
    forward, to the (B, C) hidden states ``layout.predicting`` picks. Shape: (B, C, V)."""

    def reading(run: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        return lambda hidden: run(layout.pick(hidden))  # (N, W, H) -> (B, C, H), contiguous

    with _head_wrapped(model, reading):
        input_ids = layout.input_ids(prompt_ids, completion_ids)  # (N, W)
        return model(input_ids=input_ids, position_ids=layout.positions, use_cache=False, logits_to_keep=0).logits  # (B, C, V)


def completion_hidden(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, group_index: Tensor | None = None,
    packed: bool = True,
) -> Tensor:
    """The last hidden states that predict each completion token, what :func:`completion_logits`
    would project with the LM head (the same forward, shared prompts and packed rows included). Only for a model
    :func:`lm_head_of` accepts. Shape: (B, C, H)."""
    if lm_head_of(model) is None:
        raise ValueError(f"{type(model).__name__}: its logits are not exactly its LM head's output (lm_head_of); use completion_logits")
    with _head_left_out(model):
        return completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_index, packed)


def _shared_prompt_logits(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, rows_group: Tensor, num_groups: int
) -> Tensor:
    """:func:`completion_logits` with each prompt run once: ``rows_group`` (B,) in [0, U) says whose prompt a row has."""
    batch, prompt_len = prompt_ids.shape
    first_row = torch.full((num_groups,), batch, device=rows_group.device).scatter_reduce(
        0, rows_group, torch.arange(batch, device=rows_group.device), reduce="amin"
    )  # (U,): a row holding each group's prompt
    prompt_mask = prompt_mask.long()
    if not (torch.equal(prompt_ids[first_row][rows_group], prompt_ids) and torch.equal(prompt_mask[first_row][rows_group], prompt_mask)):
        raise ValueError("group_index groups rows whose prompts differ (e.g. rollouts concatenated without renumbering their groups)")
    head_ids, head_mask = prompt_ids[first_row, :-1], prompt_mask[first_row, :-1]  # (U, P - 1): each group's prompt but its last token
    tail_ids = torch.cat([prompt_ids[:, -1:], completion_ids[:, :-1]], dim=1)  # (B, C): last prompt token (left padding: real) + completion
    # one embedding lookup for both passes: the embedding's backward writes a dense (V, H) gradient per call
    embeds = model.get_input_embeddings()(torch.cat([head_ids.flatten(), tail_ids.flatten()]))  # (U (P - 1) + B C, H)
    head_embeds, tail_embeds = embeds.split([head_ids.numel(), tail_ids.numel()])
    cache = DynamicCache()
    model(
        inputs_embeds=head_embeds.view(*head_ids.shape, -1),
        attention_mask=head_mask,
        position_ids=position_ids_from_mask(head_mask),
        **{cache_argument(model): cache},
        use_cache=True,
        logits_to_keep=torch.tensor([prompt_len - 2], device=prompt_ids.device),  # unused: one position's logits, no gradient
    )
    cache.batch_select_indices(rows_group)  # (U, ...) -> (B, ...) keys and values of every layer
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1].long()], dim=1)  # (B, P + C - 1)
    return model(
        inputs_embeds=tail_embeds.view(*tail_ids.shape, -1),
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, prompt_len - 1 :],
        **{cache_argument(model): cache},
        use_cache=True,
    ).logits  # (B, C, V): position t predicts completion token t


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    group_index: Tensor | None = None,
) -> Tensor:
    """log pi(y_t | x, y_<t) under softmax(logits / temperature) for every completion token.

    Args:
        model: causal LM (transformers or peft) accepting ``logits_to_keep``.
        prompt_ids, prompt_mask: left-padded prompts. Shape: (B, P).
        completion_ids, completion_mask: right-padded completions. Shape: (B, C).
        temperature: the sampling temperature, so the values match the sampling log-probs.
        group_index: rows sharing a prompt, which then runs once (:func:`completion_logits`). Shape: (B,).
    Returns:
        Shape: (B, C), float32, 0 where ``completion_mask`` is 0; differentiable.
    """
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_index)  # (B, C, V)
    logp = token_logprobs(logits, completion_ids, temperature)  # (B, C)
    return logp.masked_fill(completion_mask == 0, 0.0)


def rollout_logprobs(model: nn.Module, rollout, temperature: float = 1.0, share_prompts: bool = False) -> Tensor:
    """:func:`completion_logprobs` of a :class:`rlalign.lm.rollout.Rollout`; ``share_prompts``: each
    group's prompt runs once (by ``rollout.group_index``). Shape: (B, C)."""
    r = rollout
    return completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, temperature, r.group_index if share_prompts else None)
