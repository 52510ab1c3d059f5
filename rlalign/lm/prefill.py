"""The prefill of :func:`rlalign.lm.sampling.sample`: each distinct prompt run once, its keys and
values written to the decode loop's cache for the G rows of its group, the logits of its last token.

Prompts of different lengths are left-padded (:func:`_prefill`), or, when that takes fewer rows,
run side by side, several to a row, each token seeing only its own prompt (:func:`pack_prompts`,
:func:`_packed_prefill`), so padding is hardly computed. Masks are additive 4-D tensors (0 where a
query sees a key, the dtype's minimum elsewhere), with a sliding window where the model has one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache, StaticCache

from rlalign.core.masks import position_ids_from_mask
from rlalign.lm.models import cache_argument, unwrap_causal_lm

__all__ = ["pack_prompts"]


def _prefill_mask(prompt_valid: Tensor, total: int, dtype: torch.dtype, window: int | None = None) -> Tensor:
    """Additive mask (B, 1, P, L) over the L = P + N cache slots: query q sees key k <= q when k is
    a real prompt token (0 where allowed, the dtype's minimum elsewhere); with a sliding ``window``
    also only k > q - window (transformers' sliding-window rule, on cache slots).

    A padding query also sees itself, so no softmax row is empty (its output is never used).
    """
    prompt_len = prompt_valid.shape[1]
    key_valid = torch.ones((prompt_valid.shape[0], total), dtype=torch.bool, device=prompt_valid.device)  # (B, L)
    key_valid[:, :prompt_len] = prompt_valid
    q = torch.arange(prompt_len, device=prompt_valid.device)[:, None]  # (P, 1)
    k = torch.arange(total, device=prompt_valid.device)[None, :]  # (1, L)
    seen = (k <= q) if window is None else (k <= q) & (k > q - window)  # (P, L)
    allowed = (seen[None] & key_valid[:, None, :]) | (k == q)[None]  # (B, P, L)
    return _additive_mask(allowed, dtype)  # (B, 1, P, L)


def _additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed`` (B, Q, K), the dtype's minimum elsewhere, as the model's (B, 1, Q, K) attention mask."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _model_mask(full: Tensor, windowed: Tensor | None, by_layer_type: bool) -> Tensor | dict[str, Tensor]:
    """The ``attention_mask`` argument: the full-attention mask, or with a sliding window the windowed
    one (every layer slides, e.g. Mistral), or both by layer type (models with ``config.layer_types``
    of full and sliding layers, e.g. Qwen2, Gemma 2/3, which take a prepared mask per type; other
    layer types are refused by :func:`_layer_types`)."""
    if windowed is None:
        return full
    return {"full_attention": full, "sliding_attention": windowed} if by_layer_type else windowed


def _layer_types(config, window: int | None) -> bool:
    """Whether the model takes its masks by layer type (``config.layer_types``); with a window, only
    full and sliding layers are supported (a KeyError deep in the model otherwise)."""
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    if layer_types is None:
        return False
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if window is not None and other:
        raise ValueError(f"the sampler's sliding-window masks cover full and sliding attention layers; this model also has {other}")
    return True


def pack_prompts(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Prompt indices by row, the prompts of a row together no longer than ``width`` tokens: first-fit
    decreasing bin packing (at most 11/9 of the fewest rows plus 6/9; Dosa 2007). The packed
    prefill (:func:`_prefill`) runs these rows of width P, the longest prompt, instead of one
    left-padded row per prompt: fewer tokens, and no more attention scores (R P^2 <= N P^2)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda n: -lengths[n]):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(width)
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def _packed_mask(segment: Tensor, position: Tensor, dtype: torch.dtype, window: int | None = None) -> Tensor:
    """Additive mask (R, 1, T, T) over rows of prompts packed side by side: token i sees token j of
    its row when both belong to the same prompt (``segment`` (R, T), unique per padding token) and j
    is not after i (``position`` (R, T), the position within the prompt); with a sliding ``window``
    also only position_j > position_i - window (the rule of :func:`_prefill_mask`, whose slots differ by positions)."""
    seen = (segment[:, :, None] == segment[:, None, :]) & (position[:, None, :] <= position[:, :, None])  # (R, T, T)
    if window is not None:
        seen &= position[:, None, :] > position[:, :, None] - window
    return _additive_mask(seen, dtype)  # (R, 1, T, T)


@contextlib.contextmanager
def _lm_head_on(causal_lm: nn.Module, positions: Tensor) -> Iterator[list[bool]]:
    """Inside the block the LM head of ``causal_lm`` sees only the hidden states at ``positions``
    (K,), flat indices over (batch, sequence), as one row (1, K, hidden): logits (1, K, V) for the
    last tokens of packed prompts, which ``logits_to_keep`` (one set of columns for every row)
    cannot pick. Yields a list whose one entry says whether the head ran (a model that multiplies
    by its embedding matrix itself never calls it: its logits cover every position)."""
    ran = [False]

    def pick(module: nn.Module, args: tuple) -> tuple:
        ran[0] = True
        return (args[0].flatten(0, -2)[positions][None], *args[1:])

    handle = causal_lm.get_output_embeddings().register_forward_pre_hook(pick)
    try:
        yield ran
    finally:
        handle.remove()


def _prefill(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group_size: int,
    cache: DynamicCache | StaticCache,
    total: int,
    dtype: torch.dtype,
    window: int | None = None,
    by_layer_type: bool = False,
    rows: list[list[int]] | None = None,
) -> Tensor:
    """Run each distinct prompt once (rows 0, G, 2G, ... of the B = N G rows), fill ``cache`` with the
    prompt keys and values of all B rows, and return the logits at the last prompt position. Shape: (B, V).

    With G > 1 the N prompts run into a DynamicCache that is then repeated G-fold
    (``batch_repeat_interleave``) and, for a StaticCache, written into its first P slots: the prefill
    does N rows of work instead of B.
    ``rows`` (:func:`_prompt_rows`): the prompts run side by side in these rows, each token seeing
    its own prompt (:func:`_packed_mask`), and their keys and values are then laid out left-padded in
    (N, heads, P, head dim), zeros on padding (which the decode masks hide). For example 32 prompts
    of 4-12 tokens (251 in all) fit in 23 rows of 12 instead of 32; rows of the longest prompt's
    width, not one row of all tokens, keep the attention's (L, L) scores small.
    """
    distinct = slice(None, None, group_size)
    ids, mask = prompt_ids[distinct], prompt_mask[distinct]  # (N, P)
    if rows is not None:
        return _packed_prefill(model, ids, mask, rows, group_size, cache, dtype, window, by_layer_type)
    prompt_len = ids.shape[1]
    prefill_cache = cache if isinstance(cache, DynamicCache) or group_size == 1 else DynamicCache()
    visible = total if isinstance(prefill_cache, StaticCache) else prompt_len  # key columns: the cache's length
    windowed = None if window is None else _prefill_mask(mask.bool(), total, dtype, window)[..., :visible]
    logits = model(
        input_ids=ids,
        attention_mask=_model_mask(_prefill_mask(mask.bool(), total, dtype)[..., :visible], windowed, by_layer_type),
        position_ids=position_ids_from_mask(mask),
        **{cache_argument(model): prefill_cache},
        use_cache=True,
        logits_to_keep=torch.tensor([prompt_len - 1], device=ids.device),  # an index, not 1: a contiguous LM-head input (rlalign.lm.logprobs)
    ).logits[:, -1, :]  # (N, V)
    if group_size > 1:
        prefill_cache.batch_repeat_interleave(group_size)  # (N, ...) -> (B, ...) in every layer
        if prefill_cache is not cache:
            positions = torch.arange(prompt_len, device=ids.device)
            for layer_idx, layer in enumerate(prefill_cache.layers):
                cache.update(layer.keys, layer.values, layer_idx, {"cache_position": positions})
    return logits.repeat_interleave(group_size, dim=0)  # (B, V)


def _packed_prefill(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    rows: list[list[int]],
    group_size: int,
    cache: DynamicCache | StaticCache,
    dtype: torch.dtype,
    window: int | None,
    by_layer_type: bool,
) -> Tensor:
    """:func:`_prefill` of the N distinct prompts ``ids``, ``mask`` (N, P) side by side in ``rows`` (prompt indices). Shape: (B, V)."""
    width = ids.shape[1]
    valid = mask.bool()  # (N, P)
    lengths = valid.sum(-1).tolist()
    row_of, start_of = [0] * len(lengths), [0] * len(lengths)
    for row, members in enumerate(rows):
        start = 0
        for index in members:
            row_of[index], start_of[index] = row, start
            start += lengths[index]
    within = valid.long().cumsum(-1) - 1  # (N, P) position of a slot's token in its prompt (-1 before it)
    flat = torch.tensor(row_of, device=ids.device)[:, None] * width + torch.tensor(start_of, device=ids.device)[:, None] + within  # (N, P) place in the (R, P) grid
    grid = len(rows) * width
    packed_ids = ids.new_zeros(grid).index_put_((flat[valid],), ids[valid]).view(len(rows), width)  # (R, P)
    position = within.new_zeros(grid).index_put_((flat[valid],), within[valid]).view(len(rows), width)  # (R, P)
    segment = -torch.arange(1, grid + 1, device=ids.device)  # a padding token is its own segment: it sees itself only
    prompt_index = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    segment = segment.index_put_((flat[valid],), prompt_index[valid]).view(len(rows), width)  # (R, P)
    windowed = None if window is None else _packed_mask(segment, position, dtype, window)
    packed_cache = DynamicCache()
    last = flat[:, -1]  # (N,) each prompt's last token: its slot P - 1
    with _lm_head_on(unwrap_causal_lm(model), last) as head_ran:
        logits = model(
            input_ids=packed_ids,
            attention_mask=_model_mask(_packed_mask(segment, position, dtype), windowed, by_layer_type),
            position_ids=position,
            **{cache_argument(model): packed_cache},
            use_cache=True,
            logits_to_keep=0,  # every position to the LM head, where _lm_head_on picks N of them
        ).logits
    logits = logits[0] if head_ran[0] else logits.flatten(0, -2)[last]  # (N, V)
    padding = ~valid[:, None, :, None]  # (N, 1, P, 1)
    slots = torch.arange(width, device=ids.device)
    source = flat.clamp(min=0)  # (N, P); any place on padding
    for layer_idx, layer in enumerate(packed_cache.layers):
        keys, values = (
            t.transpose(0, 1).flatten(1, 2)[:, source].transpose(0, 1).masked_fill(padding, 0).repeat_interleave(group_size, dim=0) for t in (layer.keys, layer.values)
        )  # (R, H, P, D) -> (H, R P, D) -> (N, H, P, D) -> (B, H, P, D)
        cache.update(keys, values, layer_idx, {"cache_position": slots})
    return logits.repeat_interleave(group_size, dim=0)  # (B, V)


def _prompt_rows(causal_lm: nn.Module, prompt_mask: Tensor) -> list[list[int]] | None:
    """The rows of :func:`pack_prompts` for the N prompts of ``prompt_mask`` (N, P) when they are
    fewer than N, else None: the padded prefill (also for an empty prompt, or a model without an
    output-embeddings module)."""
    lengths = prompt_mask.sum(-1).tolist()
    if len(lengths) < 2 or min(lengths) == 0 or causal_lm.get_output_embeddings() is None:
        return None
    rows = pack_prompts(lengths, prompt_mask.shape[1])
    return rows if len(rows) < len(lengths) else None
