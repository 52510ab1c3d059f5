"""Importance weights of the sampling (behaviour) policy against the trainer's pi_old.

The tokens of a rollout were drawn by a sampler whose probabilities differ from the trainer's pi_old:
another precision or inference engine (the training/inference mismatch), or an older policy
(asynchronous rollouts, where pi_old is the learner's proximal policy). The ratio

    rho_t = pi_old(a_t) / pi_sampler(a_t)                                   per token, or
    rho_i = prod_t rho_t = exp(sum_t (log pi_old - log pi_sampler))         per sequence (TRL's sequence_* modes)

reweights each token's policy loss towards the on-policy gradient. Left raw its variance is unbounded,
so it is bounded by a band [low, high] in one of two ways:

    truncate   w = clip(rho, low, high)                      TIS (Yao et al. 2025; Ionides 2008)
    mask       w = rho * 1[low <= rho <= high]               MIS (Yao et al. 2025), AReaL's decoupled loss
                                                             (Fu et al. 2025); two-sided: IcePop (Ling Team 2025)

A masked token (or every token of a masked sequence) leaves the loss; the aggregation's denominator
is unchanged, as in TRL. The weights are detached: they scale the loss, they are not trained.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlalign.core.masks import counted_only, masked_mean, masked_sum

__all__ = ["IS_MODES", "IS_LEVELS", "ISStats", "TISStats", "importance_weights", "truncated_is_weights", "masked_is_weights"]

IS_MODES: tuple[str, ...] = ("truncate", "mask")
IS_LEVELS: tuple[str, ...] = ("token", "sequence")


class ISStats(NamedTuple):
    """Over the counted tokens (a sequence's weight counts once per token of it)."""

    weight_mean: Tensor
    weight_min: Tensor
    truncated_frac: Tensor  # share whose ratio left [low, high]: truncated, or masked
    masked_frac: Tensor  # share whose weight is 0 (mask mode)
    low_frac: Tensor  # share with ratio < low
    high_frac: Tensor  # share with ratio > high


TISStats = ISStats


def importance_weights(
    old_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor | None = None,
    high: float | None = None,
    low: float | None = None,
    mode: Literal["truncate", "mask"] = "truncate",
    level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, ISStats]:
    """The sampler's importance weights (module docstring): truncated or masked, per token or per sequence.

    Args:
        old_logp: log pi_old(a_t) by the trainer's forward. Shape: (B, C).
        sampler_logp: log-probs the sampler drew a_t with. Shape: (B, C).
        mask: 1 on counted tokens: the sequence ratio sums over them, the statistics average over them.
        high: upper bound C_max > 0 (null: none).
        low: lower bound C_min > 0 (null: none); below ``high``.
        mode: truncate (clip into the band) or mask (weight 0 outside it, rho inside).
        level: token (one ratio per token) or sequence (one per row, broadcast to its tokens).
    Returns:
        (weights, detached, shape (B, C); stats).
    """
    if high is None and low is None:
        raise ValueError("importance weights need a bound: the cap (high) or the floor (low)")
    if (high is not None and high <= 0) or (low is not None and low <= 0):
        raise ValueError(f"the importance-weight cap and floor must be > 0, got cap={high}, floor={low}")
    if high is not None and low is not None and low >= high:
        raise ValueError(f"the importance-weight floor ({low}) must be below the cap ({high})")
    if mode not in IS_MODES or level not in IS_LEVELS:
        raise ValueError(f"mode must be one of {IS_MODES} and level one of {IS_LEVELS}, got {mode!r}, {level!r}")
    m = torch.ones_like(old_logp) if mask is None else mask.to(old_logp.dtype).expand_as(old_logp)  # (B, C)
    log_ratio = counted_only(old_logp.detach() - sampler_logp.detach(), m)  # (B, C), 0 off the mask: its exp is never inf there
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, m > 0, dim=-1).unsqueeze(-1).expand_as(old_logp)  # (B, C): the row's sum on each token (a row's weight weighs its loss, not its ratio)
    ratio = torch.exp(log_ratio)  # (B, C)
    below = ratio < low if low is not None else torch.zeros_like(ratio, dtype=torch.bool)
    above = ratio > high if high is not None else torch.zeros_like(ratio, dtype=torch.bool)
    if mode == "truncate":
        weights = ratio.clamp(min=low, max=high)
        masked = torch.zeros_like(below)
    else:
        masked = below | above
        weights = torch.where(masked, torch.zeros_like(ratio), ratio)
    counted = m > 0
    weight_min = weights[counted].min() if counted.any() else weights.new_ones(())
    # statistics over the counted tokens, or with one weight a row (sequence) over the rows that have some, as TRL logs them
    at, share = (slice(None), m) if level == "token" else (slice(0, 1), counted.any(-1, keepdim=True).to(m.dtype))  # share: (B, C) or (B, 1)
    stats = ISStats(
        weight_mean=masked_mean(weights[:, at], share),
        weight_min=weight_min,
        truncated_frac=masked_mean((below | above)[:, at].to(m.dtype), share),
        masked_frac=masked_mean(masked[:, at].to(m.dtype), share),
        low_frac=masked_mean(below[:, at].to(m.dtype), share),
        high_frac=masked_mean(above[:, at].to(m.dtype), share),
    )
    return weights, stats


def truncated_is_weights(old_logp: Tensor, sampler_logp: Tensor, cap: float, mask: Tensor | None = None) -> tuple[Tensor, ISStats]:
    """Truncated importance sampling per token: w_t = min(pi_old(a_t) / pi_sampler(a_t), C) (Yao et al. 2025).

    Args:
        old_logp, sampler_logp: Shape: (B, C).
        cap: C > 0.
    """
    return importance_weights(old_logp, sampler_logp, mask, high=cap)


def masked_is_weights(old_logp: Tensor, sampler_logp: Tensor, cap: float, mask: Tensor | None = None) -> tuple[Tensor, ISStats]:
    """Masked importance sampling per token: w_t = rho_t where rho_t = pi_old(a_t) / pi_sampler(a_t) <= C, else 0.

    The ratio's tail carries the bias of an off-policy token; masking removes it rather than keep a
    capped share (Yao et al. 2025; TRL's ``token_mask``; AReaL's behaviour-weight cap).

    Args:
        old_logp, sampler_logp: Shape: (B, C).
        cap: C > 0.
    """
    return importance_weights(old_logp, sampler_logp, mask, high=cap, mode="mask")
