"""Losses of the seeds. Sign convention: every ``*_loss`` returns what is *minimised* (the seeds'
objectives are maximised, so the policy losses carry a minus sign), together with a NamedTuple of
detached statistics the training loop logs without recomputing.

Per-token losses are reduced by :func:`aggregate`, whose modes are the ones the field uses:

    token-mean                sum_{i,t} m l / sum_{i,t} m                  (DAPO, TRL "dapo"/"bnpo")
    seq-mean-token-mean       1/G sum_i 1/|o_i| sum_t l_{i,t}               (the seeds' 1/|o|, GRPO)
    seq-mean-token-sum        1/G sum_i sum_t l_{i,t}
    seq-mean-token-sum-norm   1/(G * L) sum_i sum_t l_{i,t}, L fixed        (Dr.GRPO, Liu et al. 2025)

Advantages of shape (B,) are broadcast to every token of (B, C) inputs.

Row weights: a mask may carry a weight w_i in (0, 1] on every counted token of row i instead of 1
(w_i = max_t m_{i,t}; 0/1 masks give the modes above unchanged). Row i then counts w_i times: the
sequence modes divide by sum_i w_i instead of G (token-sum-norm: rows without tokens count 1), a
row's own token mean is unchanged, and token-mean weighs each of its tokens by w_i. The agent source
uses it to count an episode of k calls (k rows) once: w = 1/k on each of its rows.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlalign.core.importance import TISStats, masked_is_weights, truncated_is_weights  # re-exported: they live in rlalign.core.importance
from rlalign.core.kl import kl_k1, kl_k2, kl_k3
from rlalign.core.masks import counted_only, masked_mean, masked_sum, masked_var

__all__ = [
    "AGGREGATION_MODES",
    "Aggregation",
    "aggregate",
    "row_weights",
    "explained_variance",
    "policy_gradient_loss",
    "clipped_surrogate_loss",
    "truncated_is_weights",
    "masked_is_weights",
    "value_loss",
    "entropy_loss",
    "kl_penalty_loss",
    "sft_loss",
    "bradley_terry_loss",
    "PGStats",
    "ClipStats",
    "TISStats",
    "ValueStats",
    "EntropyStats",
    "KLStats",
    "SFTStats",
    "BTStats",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = Aggregation.__args__


def _mask_like(x: Tensor, mask: Tensor | None) -> Tensor:
    return torch.ones_like(x) if mask is None else mask.to(x.dtype).expand_as(x)


def _broadcast(advantages: Tensor, like: Tensor) -> Tensor:
    """(B,) advantages -> (B, C) when the per-token tensor is 2-D."""
    return advantages.unsqueeze(-1) if advantages.dim() < like.dim() else advantages


def row_weights(mask: Tensor) -> Tensor:
    """Each row's weight in the sequence modes: max_t mask (0 for a row without tokens). Shape: (B,)."""
    return mask.amax(-1) if mask.shape[-1] else mask.new_zeros(mask.shape[0])


def norm_rows(mask: Tensor) -> Tensor:
    """The rows seq-mean-token-sum-norm divides by: sum_i w_i, a row without tokens counting 1."""
    weight = row_weights(mask)
    return torch.where(weight > 0, weight, torch.ones_like(weight)).sum()


def aggregate(token_values: Tensor, mask: Tensor | None = None, mode: Aggregation = "token-mean", max_len: int | None = None) -> Tensor:
    """Reduce per-token values to a scalar with one of :data:`AGGREGATION_MODES` (module docstring).

    Args:
        token_values: Shape: (B, C), or (N,) for flat batches (then every mode is a plain masked mean
            except the token-sum modes, which treat each element as a one-token sequence).
        mask: 1 on counted tokens. Shape: like ``token_values``.
        max_len: the fixed L of seq-mean-token-sum-norm; defaults to C.
    """
    mask = _mask_like(token_values, mask)
    if mode == "token-mean":
        return masked_mean(token_values, mask)
    values_2d = token_values if token_values.dim() > 1 else token_values.unsqueeze(-1)  # (B, C)
    mask_2d = mask if mask.dim() > 1 else mask.unsqueeze(-1)
    seq_sum = masked_sum(values_2d, mask_2d, dim=-1)  # (B,) weighted by the row's weight
    seq_len = mask_2d.sum(-1)  # (B,)
    row_weight = row_weights(mask_2d).to(values_2d.dtype)  # (B,) 1 for a 0/1 row with tokens, 0 without
    n_seqs = row_weight.sum()
    n_seqs = torch.where(n_seqs > 0, n_seqs, torch.ones_like(n_seqs))
    if mode == "seq-mean-token-mean":
        safe_len = torch.where(seq_len > 0, seq_len, torch.ones_like(seq_len))
        return (seq_sum / safe_len * row_weight).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        length = values_2d.shape[-1] if max_len is None else max_len
        return seq_sum.sum() / (norm_rows(mask_2d) * length)
    raise ValueError(f"aggregation mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def explained_variance(predictions: Tensor, targets: Tensor, mask: Tensor | None = None) -> Tensor:
    """1 - Var[target - prediction] / Var[target]: 1 is perfect, 0 no better than the mean, < 0 worse.

    Returns NaN-free 0 when the targets have no variance.
    """
    predictions, targets = predictions.detach().float(), targets.detach().float()
    var_target = masked_var(targets, mask)
    var_residual = masked_var(targets - predictions, mask)
    return torch.where(var_target > 0, 1.0 - var_residual / var_target.clamp(min=1e-12), torch.zeros_like(var_target))


class PGStats(NamedTuple):
    logp_mean: Tensor
    advantage_mean: Tensor


def policy_gradient_loss(logp: Tensor, advantages: Tensor, mask: Tensor | None = None, mode: Aggregation = "token-mean") -> tuple[Tensor, PGStats]:
    """REINFORCE / VPG: L = -E[log pi(a_t|s_t) * Psi_t]  (Williams 1992; seed 002, the policy gradient).

    Its gradient is -E[grad log pi * Psi]; ``advantages`` is any Psi_t (return, reward-to-go,
    reward-to-go minus a baseline, advantage) and is treated as a constant.

    Args:
        logp: log pi(a_t|s_t). Shape: (B, C) or (N,).
        advantages: Psi_t. Shape: like ``logp``, or (B,) broadcast over tokens.
    """
    advantages = _broadcast(advantages.detach(), logp)
    loss = aggregate(-logp * advantages, mask, mode)
    mask_full = _mask_like(logp, mask)
    stats = PGStats(masked_mean(logp.detach(), mask_full), masked_mean(advantages.expand_as(logp), mask_full))
    return loss, stats


class ClipStats(NamedTuple):
    clip_frac: Tensor  # fraction of tokens whose clipped term is active (either side)
    clip_frac_low: Tensor  # A < 0 and r < 1 - eps_low
    clip_frac_high: Tensor  # A > 0 and r > 1 + eps_high
    dual_clip_frac: Tensor  # A < 0 and the dual clip -c*A is active
    approx_kl: Tensor  # mean((r - 1) - log r), the k3 estimate of KL(pi_old || pi)
    ratio_mean: Tensor


def clipped_surrogate_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
    importance_sampling: Literal["token", "sequence"] = "token",
    token_weights: Tensor | None = None,
) -> tuple[Tensor, ClipStats]:
    """PPO clipped surrogate, per token:

        l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),   r_t = pi(a_t) / pi_old(a_t)

    Schulman et al. 2017, eq. 7; asymmetric clip ("clip-higher") from DAPO (Yu et al. 2025).
    Gradient is zero when A > 0 and r > 1 + eps_high, and when A < 0 and r < 1 - eps_low.
    With ``dual_clip = c > 1`` the loss of a negative-advantage token is also capped at -c*A
    (Ye et al. 2020): l_t = min(l_t, -c A_t) for A_t < 0.

    ``importance_sampling="sequence"`` is GSPO (Zheng et al. 2025, eq. 5-7): one ratio per sequence,
    the geometric mean of its token ratios, s_i = exp(1/|o_i| sum_t (log pi - log pi_old)), clipped at
    the sequence level; every token of sequence i carries l_i = -min(s_i A_i, clip(s_i) A_i), so the
    seq-mean-token-mean aggregation gives GSPO's 1/G sum_i l_i.

    ``token_weights`` w_t (detached) multiply each token's loss before aggregation: the sampler's
    importance weights (:func:`rlalign.core.importance.importance_weights`).

    Args:
        logp: log pi_theta(a_t), with grad. Shape: (B, C) or (N,).
        old_logp: log pi_old(a_t), the sampling policy. Shape: like ``logp``.
        advantages: Shape: like ``logp``, or (B,) broadcast over tokens.
        mask: 1 on counted tokens.
        eps_high: defaults to ``eps_low``.
        token_weights: Shape: like ``logp``.
    """
    eps_high = eps_low if eps_high is None else eps_high
    advantages = _broadcast(advantages.detach(), logp)
    log_ratio = counted_only(logp - old_logp.detach(), mask)  # 0 off the mask: its exp is never inf there
    if importance_sampling == "sequence":
        if logp.dim() != 2:
            raise ValueError("importance_sampling='sequence' needs (B, C) log-probs")
        counted = (_mask_like(logp, mask) > 0).to(logp.dtype)  # a row's weight weighs its loss, not its ratio
        seq_log_ratio = masked_sum(log_ratio, counted, dim=-1) / counted.sum(-1).clamp(min=1.0)  # (B,): mean token log-ratio
        log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logp)  # (B, C): each token carries its sequence's
    elif importance_sampling != "token":
        raise ValueError(f"importance_sampling must be 'token' or 'sequence', got {importance_sampling!r}")
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    token_loss = -torch.min(unclipped, clipped)  # (B, C)
    dual_active = torch.zeros_like(token_loss, dtype=torch.bool)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual_active = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(advantages < 0, torch.min(token_loss, cap), token_loss)
    if token_weights is not None:
        token_loss = token_loss * token_weights.detach()
    loss = aggregate(token_loss, mask, mode, max_len)

    with torch.no_grad():
        m = _mask_like(logp, mask)
        low = ((ratio < 1.0 - eps_low) & (advantages < 0)).to(m.dtype)
        high = ((ratio > 1.0 + eps_high) & (advantages > 0)).to(m.dtype)
        stats = ClipStats(
            clip_frac=masked_mean(low + high, m),
            clip_frac_low=masked_mean(low, m),
            clip_frac_high=masked_mean(high, m),
            dual_clip_frac=masked_mean(dual_active.to(m.dtype), m),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            ratio_mean=masked_mean(ratio, m),
        )
    return loss, stats


class ValueStats(NamedTuple):
    clip_frac: Tensor  # fraction of tokens where the clipped error is the larger one
    explained_variance: Tensor
    value_mean: Tensor


def value_loss(
    values: Tensor,
    returns: Tensor,
    mask: Tensor | None = None,
    old_values: Tensor | None = None,
    clip_range: float | None = None,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
) -> tuple[Tensor, ValueStats]:
    """Critic regression L_V = 1/2 (V(s_t) - R_t)^2  (the seeds' value loss, R_t the GAE return).

    With ``clip_range`` and ``old_values`` (PPO2 / OpenAI baselines value clipping):
    L_V = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    Args:
        values: V(s_t), with grad. Shape: (B, C) or (N,).
        returns: targets R_t. Shape: like ``values``.
        old_values: the values at sampling time, needed when clip_range is set.
    """
    returns = returns.detach()
    error = (values - returns) ** 2
    clip_active = torch.zeros_like(error)
    if clip_range is not None:
        if old_values is None:
            raise ValueError("value_loss: clip_range needs old_values")
        old_values = old_values.detach()
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped_error = (clipped_values - returns) ** 2
        # inside the range V_old + (V - V_old) is V up to round-off, and "clipped_error > error" would
        # then be a coin flip: the clipped term counts only where the clamp moved V
        clip_active = (((values - old_values).abs() > clip_range) & (clipped_error > error)).to(error.dtype).detach()
        error = torch.max(error, clipped_error)
    loss = 0.5 * aggregate(error, mask, mode, max_len)
    m = _mask_like(values, mask)
    stats = ValueStats(
        clip_frac=masked_mean(clip_active, m),
        explained_variance=explained_variance(values, returns, m),
        value_mean=masked_mean(values.detach(), m),
    )
    return loss, stats


class EntropyStats(NamedTuple):
    entropy: Tensor


def entropy_loss(entropy: Tensor, mask: Tensor | None = None, mode: Aggregation = "token-mean", max_len: int | None = None) -> tuple[Tensor, EntropyStats]:
    """Entropy bonus as a loss: L_H = -H[pi(.|s_t)]; the trainer adds c2 * L_H (seeds: c2 ~ 0.01).

    Args:
        entropy: per-token entropy, with grad for a bonus (e.g. :func:`rlalign.core.kl.entropy_from_logits`);
            detached, the loss has no gradient and only the statistic is used. Shape: (B, C) or (N,).
    """
    loss = -aggregate(entropy, mask, mode, max_len)
    return loss, EntropyStats(masked_mean(entropy.detach(), _mask_like(entropy, mask)))


class KLStats(NamedTuple):
    kl: Tensor  # mean per-token estimate


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor | None = None,
    estimator: Literal["k1", "k2", "k3"] = "k3",
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
) -> tuple[Tensor, KLStats]:
    """KL-to-reference term of the loss: L_KL = agg_t k(log pi(o_t), log pi_ref(o_t)).

    GRPO puts beta * L_KL in the loss with the k3 estimator (Shao et al. 2024, eq. 3-4); the
    trainer multiplies by beta. Returned unscaled so the coefficient stays visible in the loop.

    Note on gradients (Tang & Munos 2025, "On a few pitfalls in KL gradient estimation"): with
    o ~ pi, differentiating k3 through log pi gives grad k3 = -(pi_ref/pi - 1) grad log pi, whose
    expectation is grad KL(pi_ref || pi) -- the *forward* KL, not KL(pi || pi_ref); k1 in the loss
    has zero expected gradient. The value of the term estimates KL(pi || pi_ref) all the same.
    ``rlalign explore kl-penalty-tradeoff`` shows the two optima side by side. To optimise the
    reverse KL exactly, put k1 in the reward instead (PPO, :func:`rlalign.core.advantages.kl_shaped_rewards`).
    """
    if estimator not in _ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {sorted(_ESTIMATORS)}, got {estimator!r}")
    token_kl = _ESTIMATORS[estimator](counted_only(logp, mask), counted_only(ref_logp.detach(), mask))  # 0 off the mask, never inf x 0
    loss = aggregate(token_kl, mask, mode, max_len)
    return loss, KLStats(masked_mean(token_kl.detach(), _mask_like(logp, mask)))


class SFTStats(NamedTuple):
    nll: Tensor  # mean per-token negative log-likelihood
    tokens: Tensor  # number of counted tokens


def sft_loss(logp: Tensor, mask: Tensor | None = None, mode: Aggregation = "token-mean") -> tuple[Tensor, SFTStats]:
    """Supervised fine-tuning: L = -agg_t log pi(y_t | x, y_<t) over completion tokens only.

    Args:
        logp: log-probs of the target tokens. Shape: (B, C).
        mask: 1 on completion tokens (prompt and padding are 0). Shape: (B, C).
    """
    loss = aggregate(-logp, mask, mode)
    m = _mask_like(logp, mask)
    return loss, SFTStats(masked_mean(-logp.detach(), m), m.sum().detach())


class BTStats(NamedTuple):
    accuracy: Tensor  # fraction of pairs with r_chosen > r_rejected
    margin_mean: Tensor  # mean of r_chosen - r_rejected
    reward_mean: Tensor  # mean of all rewards (centring diagnostic)


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, BTStats]:
    """Bradley-Terry reward-model loss: L = -log sigmoid(r_c - r_r - m).

    P(chosen > rejected) = sigmoid(r_c - r_r) (Bradley & Terry 1952; InstructGPT, Ouyang et al.
    2022, eq. 1; seed 003, section 4). ``margin`` m is Llama 2's per-pair margin (Touvron et al.
    2023). ``center_coef`` adds c * mean((r_c + r_r)^2), which pins the reward's mean at 0
    (Eisenstein et al. 2023).

    Args:
        chosen_rewards, rejected_rewards: Shape: (B,).
        margin: Shape: (B,) or a scalar.
    """
    diff = chosen_rewards - rejected_rewards  # (B,)
    shifted = diff if margin is None else diff - margin
    loss = -F.logsigmoid(shifted).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen_rewards + rejected_rewards) ** 2).mean()
    with torch.no_grad():
        stats = BTStats(
            accuracy=(diff > 0).float().mean(),
            margin_mean=diff.mean(),
            reward_mean=torch.cat([chosen_rewards, rejected_rewards]).mean(),
        )
    return loss, stats
