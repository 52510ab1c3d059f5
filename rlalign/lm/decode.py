"""One step of the decode loop: the sampling parameters, the filters (top-k, top-p), the draw of the
next token by inverse CDF from one uniform per row, and the model call that feeds the last token.

    token, logp = _decode_step(model, token, step_mask, position_ids, cache, cache_keyword, params, uniform)

:func:`rlalign.lm.sampling.sample` runs these eagerly; :mod:`rlalign.lm.compiled` runs the same
functions through ``torch.compile``. Shapes: B rows, V the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["SamplingParams", "filter_logits", "inverse_cdf_draw", "CDF_BLOCK"]


@dataclass(frozen=True)
class SamplingParams:
    """How to draw completions. ``temperature=0`` means greedy; ``top_k=0`` and ``top_p=1`` are off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(scaled_logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf. Shape: (B, V) -> (B, V).

    Top-p keeps token i when the probability mass of the tokens ranked strictly above it is < p,
    so the most likely token always stays (transformers' ``TopPLogitsWarper``). The kept tokens are
    those whose logit reaches the n-th largest, n the number kept in sorted order: no scatter back
    from sorted order (inductor, with the decode step's ``realize_cpu_opcount_threshold``, read the
    scattered mask as all False and so kept every token). A token tied with the last kept one stays,
    as top-k keeps ties with the k-th.
    """
    out = scaled_logits
    if top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]  # (B, 1)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(out, dim=-1, descending=True).values  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs  # (B, V)
        kept = (mass_above < top_p).sum(-1, keepdim=True).clamp(min=1)  # (B, 1): the top token has no mass above it (a NaN row has none
        # below p: kept 0 would index -1, an IndexError on a CPU and a device-side assert on a GPU; it keeps every token, as before)
        cutoff = sorted_logits.gather(-1, kept - 1)  # (B, 1): the last kept logit
        out = out.masked_fill(out < cutoff, float("-inf"))
    return out


CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF (SmolLM2's 49152-token vocabulary: 192 blocks)


def _last_positive(weights: Tensor) -> Tensor:
    """Index of the last entry > 0 along the last axis (0 if none). Shape: (..., K) -> (...)."""
    index = torch.arange(weights.shape[-1], device=weights.device)  # (K,)
    return torch.where(weights > 0, index, 0).amax(-1)


def inverse_cdf_draw(weights: Tensor, uniform: Tensor, block: int = CDF_BLOCK) -> Tensor:
    """The first y with F(y) > u * F(V), F the cumulative sum of ``weights`` (B, V) (non-negative,
    not normalised, at least one > 0 per row) and u = ``uniform`` (B,) in [0, 1): a categorical draw
    with probabilities weights / sum. Returns (B,) int64.

    Two levels, so no cumulative sum runs over the whole vocabulary (a sequential scan, ~1 ns an
    entry on one core): the block sums' cumulative sum picks the block where F crosses u * F(V),
    then the cumulative sum inside that block picks the token. Where float round-off would let the
    crossing fall past the last token of positive weight (u * F(V) rounded up to F(V), or a block
    sum and its cumulative sum that differ in the last bit), the draw is that token: a
    zero-weight token (filtered out, or padding of the last block) is never drawn."""
    batch, vocab = weights.shape
    if vocab % block:
        weights = nn.functional.pad(weights, (0, -vocab % block))  # zero weights past V
    blocks = weights.view(batch, -1, block)  # (B, K, block)
    block_cdf = blocks.sum(-1).cumsum(-1)  # (B, K)
    target = uniform * block_cdf[:, -1]  # (B,)
    chosen = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(-1)  # (B,): first block with F(end) > target
    chosen = torch.minimum(chosen, _last_positive(block_cdf.diff(dim=-1, prepend=block_cdf.new_zeros(batch, 1))))
    rows = torch.arange(batch, device=weights.device)
    inside = blocks[rows, chosen]  # (B, block)
    before = torch.where(chosen > 0, block_cdf[rows, (chosen - 1).clamp(min=0)], 0.0)  # (B,): F at the end of the previous block
    offset = torch.searchsorted(inside.cumsum(-1), (target - before)[:, None], right=True).squeeze(-1)  # (B,)
    offset = torch.minimum(offset, _last_positive(inside))
    return chosen * block + offset


def _draw(logits: Tensor, params: SamplingParams, uniform: Tensor | None) -> tuple[Tensor, Tensor]:
    """Next token (B,) and its log-prob under softmax(logits / tau) (B,), from logits (B, V) and
    one uniform in [0, 1) per row (B,) (None when greedy)."""
    logits = logits.float()
    if params.greedy:
        token = logits.argmax(-1)  # (B,)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits if params.temperature == 1 else logits / params.temperature  # (B, V); a pass over the logits less at tau = 1
    probs = torch.softmax(scaled, -1)  # (B, V)
    weights = probs
    if params.top_k or params.top_p < 1:
        weights = probs.masked_fill(filter_logits(scaled, params.top_k, params.top_p).isneginf(), 0.0)  # a filtered token is never drawn
    token = inverse_cdf_draw(weights, uniform)  # (B,)
    return token, probs.gather(-1, token[:, None]).squeeze(-1).log()  # log p of a drawn token: p > 0, round-off ~1e-7 relative


def _next_logits(
    model: nn.Module, token: Tensor, step_mask: Tensor | dict[str, Tensor], position_ids: Tensor, cache, cache_keyword: str
) -> Tensor:
    """The logits (B, V) after feeding ``token`` (B,) at ``position_ids`` (B, 1);
    ``step_mask``: the additive mask (B, 1, 1, L), or one per layer type (:func:`rlalign.lm.prefill._model_mask`);
    ``cache_keyword``: :func:`~rlalign.lm.models.cache_argument` of the model (found outside the compiled step)."""
    return model(
        input_ids=token[:, None], attention_mask=step_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1, **{cache_keyword: cache}
    ).logits[:, -1, :]


def _decode_step(
    model: nn.Module,
    token: Tensor,
    step_mask: Tensor | dict[str, Tensor],
    position_ids: Tensor,
    cache,
    cache_keyword: str,
    params: SamplingParams,
    uniform: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """One decode step: feed ``token`` (B,) (:func:`_next_logits`) and draw the next token from the
    logits (:func:`_draw`). Returns the token (B,) and its log-prob (B,). Compiled, the step and the
    draw are one call: one guard check and one graph wrapper a step instead of two, with the same
    tokens and log-probs."""
    return _draw(_next_logits(model, token, step_mask, position_ids, cache, cache_keyword), params, uniform)
