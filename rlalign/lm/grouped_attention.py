"""Decode attention for grouped-query models that reads each key/value head once.

A grouped-query model (Llama-3, Qwen2/3, Mistral, SmolLM2: H query heads sharing KVH < H key/value
heads, n = H / KVH) runs transformers' eager attention as

    k, v = repeat_kv(k, n), repeat_kv(v, n)                    # (B, KVH, T, d) -> (B, H, T, d): a copy
    out = softmax(q k^T * scale + mask) v                      # q (B, H, 1, d) at a decode step

so every decode step copies the whole KV cache n times (the n-fold write, then the n-fold read).
Measured on an H200 (Llama-3.2-1B's shape, n = 4, 64 rows, the compiled decode step replayed as a
CUDA graph): those copies were 27% of the decode's device time, the attention products reading
them another 30%. At one query position the n query heads of a group can instead be stacked as n
query rows against their shared head (transformers' own SDPA path does this since its ``pack_gqa``;
its eager path, the one a compiled decode step uses, does not):

    q (B, H, 1, d) -> (B, KVH, n, d)
    w = softmax(q k^T * scale + mask, float32)                 # (B, KVH, n, T); mask (B, 1, 1, T)
    out = w v  -> (B, KVH, n, d) -> (B, 1, H, d)

the same products, sums and softmax row by row as the repeated form (query head h = g n + r meets
key/value head g in both), with no copy of the cache.

    name = grouped_kernel(model, "eager")   # "rlalign_grouped_eager", or None where it does not apply
    with attention_kernel(model, name): ... # rlalign.lm.model_modes

It applies where the model's own eager attention is transformers' plain one (the same code as
Llama's: not Gemma-2's soft-capping or gpt-oss's sinks) and n > 1; a call with more than one query
position (a prefill) or a per-head mask runs the plain attention unchanged.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations import sdpa_attention
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama import modeling_llama

from rlalign.lm.models import unwrap_causal_lm

__all__ = ["GROUPED_EAGER", "GROUPED_SDPA", "grouped_kernel", "grouped_eager_attention", "grouped_sdpa_attention"]

GROUPED_EAGER = "rlalign_grouped_eager"
GROUPED_SDPA = "rlalign_grouped_sdpa"
_plain_eager, _plain_repeat_kv = modeling_llama.eager_attention_forward, modeling_llama.repeat_kv  # the reference code, as imported


def _foldable(module: nn.Module, query: Tensor, attention_mask: Tensor | None, kwargs: dict) -> bool:
    """One query position, n > 1, a mask shared by the heads, and nothing beyond plain attention."""
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    return query.shape[2] == 1 and getattr(module, "num_key_value_groups", 1) > 1 and shared_mask and kwargs.get("position_bias") is None


def _fold(query: Tensor, groups: int) -> Tensor:
    """(B, H, 1, d) -> (B, KVH, n, d): query head g n + r becomes row r of key/value head g."""
    batch, heads, _, dim = query.shape
    return query.reshape(batch, heads // groups, groups, dim)


def _unfold(out: Tensor, heads: int) -> Tensor:
    """(B, KVH, n, d) -> (B, 1, H, d), the layout transformers' attention functions return."""
    return out.reshape(out.shape[0], heads, 1, out.shape[-1]).transpose(1, 2).contiguous()


def grouped_eager_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                            scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, Tensor]:
    """transformers' eager attention (float32 softmax, cast back) with the query heads of a group
    stacked against their key/value head at a decode step; the plain one otherwise.
    Shapes: query (B, H, Q, d), key/value (B, KVH, T, d), mask (B, 1, Q, T) -> (B, Q, H, d)."""
    if not _foldable(module, query, attention_mask, kwargs):
        return _plain_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    q = _fold(query, module.num_key_value_groups)  # (B, KVH, n, d)
    weights = torch.matmul(q, key.transpose(2, 3)) * scaling  # (B, KVH, n, T)
    if attention_mask is not None:
        weights = weights + attention_mask  # (B, 1, 1, T) over every head and row
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    batch, heads, _, _ = query.shape
    return _unfold(torch.matmul(weights, value), heads), weights.reshape(batch, heads, 1, -1)  # weights as the plain one gives them


def grouped_sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' SDPA attention, with a decode step's query heads stacked as above (what its own
    ``pack_gqa`` does, for a transformers without it)."""
    if not _foldable(module, query, attention_mask, kwargs) or kwargs.get("softcap") is not None:
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q = _fold(query, module.num_key_value_groups)  # (B, KVH, n, d)
    out = nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)  # (B, KVH, n, d)
    return _unfold(out, query.shape[1]), None


# each name with the masks of the kernel it stands in for: a model switched to it and given a 2-D mask
# (a forward or generate() inside the switch) builds the same causal and padding masks as before
AttentionInterface.register(GROUPED_EAGER, grouped_eager_attention)
AttentionMaskInterface.register(GROUPED_EAGER, eager_mask)
AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def _same_code(fn, plain) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and (code.co_code, code.co_consts, code.co_names) == (plain.__code__.co_code, plain.__code__.co_consts, plain.__code__.co_names)


def _is_plain_eager(fn) -> bool:
    """``fn`` is transformers' plain eager attention: the same code as Llama's (a model's copy of it),
    calling a ``repeat_kv`` of the same code too (which query head meets which key/value head) and
    the same torch."""
    names = getattr(fn, "__globals__", {})
    return (_same_code(fn, _plain_eager) and _same_code(names.get("repeat_kv"), _plain_repeat_kv)
            and names.get("torch") is torch and names.get("nn") is nn)


def grouped_kernel(model: nn.Module, base: str | None) -> str | None:
    """The grouped decode attention standing in for ``base`` (the model's attention for the decode
    loop: "eager", "sdpa", None for the model's own), or None where it does not apply: a model
    without grouped heads, one whose eager attention is not the plain one, another kernel, or SDPA
    on a transformers whose SDPA path already stacks the heads."""
    causal_lm = unwrap_causal_lm(model)
    config = causal_lm.config
    base = base or config._attn_implementation
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not heads or not kv_heads or heads == kv_heads:
        return None
    if not _is_plain_eager(getattr(sys.modules.get(type(causal_lm).__module__), "eager_attention_forward", None)):
        return None
    if base == "eager":
        return GROUPED_EAGER
    if base == "sdpa" and not hasattr(sdpa_attention, "pack_gqa"):
        return GROUPED_SDPA
    return None
