"""Policy objectives beside PPO's clipped surrogate (:func:`rlalign.core.losses.clipped_surrogate_loss`),
with the same conventions: each returns what is minimised and a NamedTuple of detached statistics,
per-token losses are reduced by :func:`rlalign.core.losses.aggregate`, advantages of shape (B,) are
broadcast over the tokens of (B, C) inputs, and ``token_weights`` (the sampler's importance weights,
detached) multiply each token's loss before the reduction.

    CISPO   l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(a_t)        MiniMax 2025 (MiniMax-M1)
    SAPO    l_t = -(4 / tau) sigmoid(tau (r_t - 1)) A_t,  tau = tau_pos if A_t > 0 else tau_neg   Gao et al. 2025

with r_t = pi(a_t) / pi_old(a_t). Both act on token ratios (GSPO's sequence ratio is the clipped
surrogate's option).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlalign.core.losses import Aggregation, aggregate
from rlalign.core.masks import counted_only, masked_mean

__all__ = ["cispo_loss", "sapo_loss", "CISPOStats", "SAPOStats"]


def _token_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(advantages broadcast to (B, C), log r = log pi - log pi_old, mask as floats), all detached but log r."""
    advantages = advantages.detach()
    if advantages.dim() < logp.dim():
        advantages = advantages.unsqueeze(-1)  # (B,) -> (B, 1)
    advantages = advantages.expand_as(logp)  # (B, C)
    m = torch.ones_like(logp) if mask is None else mask.to(logp.dtype).expand_as(logp)
    return advantages, counted_only(logp - old_logp.detach(), m), m.detach()  # log r 0 off the mask: its exp is never inf there


class CISPOStats(NamedTuple):
    clip_frac: Tensor  # share of tokens whose IS weight was clipped (either side, whatever the advantage's sign)
    clip_frac_low: Tensor  # r < 1 - eps_low
    clip_frac_high: Tensor  # r > 1 + eps_high
    approx_kl: Tensor  # mean((r - 1) - log r)
    ratio_mean: Tensor


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    eps_low: float | None = None,
    eps_high: float = 4.0,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, CISPOStats]:
    """CISPO, clipped IS-weight policy optimisation, per token:

        l_t = -sg(r_hat_t) A_t log pi(a_t),    r_hat_t = clip(r_t, 1 - eps_low, 1 + eps_high)

    MiniMax 2025, "MiniMax-M1", eq. 4-5. The clip bounds the importance weight, not the update: the
    gradient -r_hat_t A_t grad log pi is never zero, so a token whose ratio left the band (often a
    rare, decisive token such as "However" or "Wait") still trains, at a bounded weight. Unlike the
    clipped surrogate, whose gradient vanishes outside the band. The paper sets no lower bound
    (``eps_low=None``) and tunes only eps_high; TRL's ``epsilon_high`` for cispo is the cap itself,
    1 + eps_high here (its recommended 5.0 is ``eps_high=4``, ScaleRL's eps_max). The paper
    aggregates by token-mean.

    Args:
        logp: log pi_theta(a_t), with grad. Shape: (B, C).
        old_logp: log pi_old(a_t). Shape: like ``logp``.
        advantages: Shape: like ``logp``, or (B,) broadcast over tokens.
        mask: 1 on counted tokens.
        eps_low: 0 < eps_low < 1, or None for no lower bound.
        eps_high: > 0.
        token_weights: Shape: like ``logp``.
    """
    if eps_high <= 0 or (eps_low is not None and not 0 < eps_low < 1):
        raise ValueError(f"CISPO needs eps_high > 0 and eps_low in (0, 1) or None, got eps_low={eps_low}, eps_high={eps_high}")
    advantages, log_ratio, m = _token_inputs(logp, old_logp, advantages, mask)
    ratio = torch.exp(log_ratio.detach())  # (B, C): the weight is a constant of the gradient
    low = None if eps_low is None else 1.0 - eps_low
    weight = ratio.clamp(min=low, max=1.0 + eps_high)  # (B, C) sg(r_hat)
    token_loss = -weight * advantages * logp  # (B, C)
    if token_weights is not None:
        token_loss = token_loss * token_weights.detach()
    loss = aggregate(token_loss, m, mode, max_len)
    with torch.no_grad():
        clipped_low = (ratio < low).to(m.dtype) if low is not None else torch.zeros_like(m)
        clipped_high = (ratio > 1.0 + eps_high).to(m.dtype)
        stats = CISPOStats(
            clip_frac=masked_mean(clipped_low + clipped_high, m),
            clip_frac_low=masked_mean(clipped_low, m),
            clip_frac_high=masked_mean(clipped_high, m),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            ratio_mean=masked_mean(ratio, m),
        )
    return loss, stats


class SAPOStats(NamedTuple):
    gate_mean: Tensor  # mean gradient gate 4 s (1 - s), s = sigmoid(tau (r - 1)): 1 at r = 1, towards 0 far off-policy
    approx_kl: Tensor  # mean((r - 1) - log r)
    ratio_mean: Tensor


def sapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, SAPOStats]:
    """SAPO, soft adaptive policy optimisation, per token:

        l_t = -f(r_t) A_t,    f(r) = (4 / tau) sigmoid(tau (r - 1)),    tau = tau_pos if A_t > 0 else tau_neg

    Gao et al. 2025 (Qwen), "Soft Adaptive Policy Optimization", the objective with its gate f. Its
    gradient is -4 s (1 - s) r A grad log pi with s = sigmoid(tau (r - 1)): at r = 1 the gate
    4 s (1 - s) is 1 and the step is the policy gradient's; it decays smoothly as r moves off 1 in
    either direction, where the hard clip drops the token at once. A larger tau decays faster:
    tau_neg > tau_pos damps negative-advantage tokens more (their updates spread mass over the whole
    vocabulary, the less stable side). Defaults are the paper's (and TRL's) 1.0 and 1.05; the paper
    (and TRL's "sapo") aggregates seq-mean-token-mean.

    Args:
        logp: log pi_theta(a_t), with grad. Shape: (B, C).
        old_logp: log pi_old(a_t). Shape: like ``logp``.
        advantages: Shape: like ``logp``, or (B,) broadcast over tokens.
        mask: 1 on counted tokens.
        temperature_pos, temperature_neg: tau > 0 for A > 0 and for A <= 0.
        token_weights: Shape: like ``logp``.
    """
    if temperature_pos <= 0 or temperature_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got {temperature_pos}, {temperature_neg}")
    advantages, log_ratio, m = _token_inputs(logp, old_logp, advantages, mask)
    ratio = torch.exp(log_ratio)  # (B, C), with grad
    tau = torch.where(advantages > 0, torch.full_like(logp, temperature_pos), torch.full_like(logp, temperature_neg)).detach()  # (B, C)
    gate = torch.sigmoid(tau * (ratio - 1.0))  # (B, C)
    token_loss = -(4.0 / tau) * gate * advantages  # (B, C)
    if token_weights is not None:
        token_loss = token_loss * token_weights.detach()
    loss = aggregate(token_loss, m, mode, max_len)
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        stats = SAPOStats(
            gate_mean=masked_mean(4.0 * gate * (1.0 - gate), m),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            ratio_mean=masked_mean(ratio.detach(), m),
        )
    return loss, stats
