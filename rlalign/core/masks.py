"""Masked reductions. One convention everywhere: ``mask`` is 1 (or True) where a position counts.

``mask=None`` means every position counts, so the same functions serve flat environment batches
(N,) and right-padded token batches (B, C).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "whiten", "counted_only", "position_ids_from_mask"]


def _as_weight(x: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return torch.ones_like(x)
    if mask.shape != x.shape:
        mask = mask.expand_as(x)
    return mask.to(x.dtype)


def counted_only(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x`` where ``mask`` > 0, 0 elsewhere (``mask`` broadcastable to ``x``; None: ``x`` as it is).

    For a value that is exponentiated before a mask weighs it (a log-ratio, a KL estimator's
    inputs): a position the mask leaves out (padding, an environment's tokens in a multi-turn
    rollout) may hold any log-prob, e^x of it may overflow to inf, and inf x 0 is NaN, in the value
    and in the gradient. Here such a position holds 0, and x gets no gradient there.
    """
    return x if mask is None else x.masked_fill(mask <= 0, 0.0)


def masked_sum(x: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """sum_i m_i x_i over ``dim`` (all dimensions when None).

    Args:
        x: values. Shape: any, e.g. (B, C).
        mask: 1 where a position counts, same shape as ``x`` (or broadcastable).
    """
    weight = _as_weight(x, mask)
    return (x * weight).sum() if dim is None else (x * weight).sum(dim)


def masked_mean(x: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """sum_i m_i x_i / sum_i m_i. An all-zero mask gives 0, never NaN.

    The mask may hold fractional weights (e.g. probabilities): the result is then the weighted mean.

    Args:
        x: values. Shape: any, e.g. (B, C).
        mask: 1 where a position counts, same shape as ``x``.
        dim: reduce this dimension only (e.g. ``dim=-1`` gives per-sequence means (B,)).
    """
    weight = _as_weight(x, mask)
    total = weight.sum() if dim is None else weight.sum(dim)
    summed = masked_sum(x, weight, dim)
    return torch.where(total > 0, summed / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(summed))


def masked_var(x: Tensor, mask: Tensor | None = None, unbiased: bool = True) -> Tensor:
    """Variance of the counted positions: sum m (x - mean)^2 / (n - 1) (or / n when not unbiased).

    With fewer than two counted positions the unbiased variance is defined as 0.
    """
    weight = _as_weight(x, mask)
    mean = masked_mean(x, weight)
    n = weight.sum()
    sq = masked_sum((x - mean) ** 2, weight)
    if unbiased:
        return torch.where(n > 1, sq / (n - 1).clamp(min=1.0), torch.zeros_like(sq))
    return sq / n.clamp(min=1.0)


def masked_whiten(x: Tensor, mask: Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the counted positions; padded positions come back as 0.

    With ``shift_mean=False`` the mean is added back: x' = (x - mean) / std + mean, i.e. only the
    scale changes (as TRL/OpenRLHF do for rewards). Uses the unbiased variance.
    """
    weight = _as_weight(x, mask)
    return whiten(x, masked_mean(x, weight), masked_var(x, weight, unbiased=True), weight, shift_mean, eps)


def whiten(x: Tensor, mean: Tensor, var: Tensor, mask: Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with given statistics (e.g. over several processes' batches);
    :func:`masked_whiten` computes them from ``x``. Padded positions come back as 0."""
    weight = _as_weight(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * weight


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token among the real tokens of its row; 0 on padding (as HF generate). Shape: (B, T)."""
    positions = attention_mask.long().cumsum(-1) - 1  # (B, T)
    return positions.clamp(min=0)
