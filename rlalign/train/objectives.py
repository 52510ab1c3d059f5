"""The policy term GRPO and PPO share, composed from :mod:`rlalign.core`: the sampler's importance
weights (``tis_*``) and the per-token objective (``loss_type``), with their statistics under the
metric names the trainers log.

    w_t  = importance_weights(pi_old / pi_sampler; tis_min, tis_cap, tis_mode, tis_level)   (or none)
    L_pi = aggregate(w_t * l_t),   l_t = clipped surrogate | CISPO | SAPO of r_t = pi / pi_old and A_t

Metrics:
    clip       loss/policy, clip_frac, clip_frac/low, clip_frac/high, clip_frac/dual (with dual_clip), approx_kl, ratio_mean
    cispo      the same names, counting clipped importance weights (both signs of A)
    sapo       loss/policy, sapo/gate_mean (mean 4 s (1 - s): 1 on-policy), approx_kl, ratio_mean
    tis/*      weight_mean, weight_min, truncated_frac (ratio outside [tis_min, tis_cap]), masked_frac, low_frac, high_frac
"""

from __future__ import annotations

from torch import Tensor

from rlalign.core.importance import importance_weights
from rlalign.core.losses import clipped_surrogate_loss
from rlalign.core.policy_losses import cispo_loss, sapo_loss
from rlalign.train.rl_config import RLConfig

__all__ = ["sampler_weights", "policy_objective"]


def sampler_weights(cfg: RLConfig, old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The sampler's importance weights of each token (None when ``tis_cap`` and ``tis_min`` are unset) and their ``tis/*`` metrics.

    Args:
        old_logp: log pi_old. Shape: (B, C).
        sampler_logp: the sampler's (behaviour policy's) log-probs. Shape: (B, C).
        mask: 1 on the tokens of the loss. Shape: (B, C).
    """
    if not cfg.sampler_correction:
        return None, {}
    weights, s = importance_weights(old_logp, sampler_logp, mask, cfg.tis_cap, cfg.tis_min, cfg.tis_mode, cfg.tis_level)  # (B, C)
    return weights, {
        "tis/weight_mean": s.weight_mean, "tis/weight_min": s.weight_min, "tis/truncated_frac": s.truncated_frac,
        "tis/masked_frac": s.masked_frac, "tis/low_frac": s.low_frac, "tis/high_frac": s.high_frac,
    }


def policy_objective(
    cfg: RLConfig, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float, max_len: int,
    weights: Tensor | None = None, importance_sampling: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """aggregate(w_t * l_t) with l_t the ``cfg.loss_type`` objective, and its statistics.

    Args:
        logp: log pi_theta, with grad. Shape: (B, C).
        old_logp: log pi_old. Shape: (B, C).
        advantages: Shape: (B,) broadcast over tokens, or (B, C).
        mask: 1 on the tokens of the loss. Shape: (B, C).
        eps_low, eps_high: the clipped surrogate's range (loss_type clip).
        max_len: the fixed L of seq-mean-token-sum-norm.
        weights: the sampler's importance weights. Shape: (B, C).
        importance_sampling: token, or sequence (GSPO; loss_type clip).
    """
    mode = cfg.aggregation
    if cfg.loss_type == "sapo":
        loss, sapo = sapo_loss(logp, old_logp, advantages, mask, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, mode, max_len, weights)
        return loss, {"loss/policy": loss.detach(), "sapo/gate_mean": sapo.gate_mean, "approx_kl": sapo.approx_kl, "ratio_mean": sapo.ratio_mean}
    if cfg.loss_type == "cispo":
        loss, clip = cispo_loss(logp, old_logp, advantages, mask, cfg.cispo_eps_low, cfg.cispo_eps_high, mode, max_len, weights)
    else:
        loss, clip = clipped_surrogate_loss(logp, old_logp, advantages, mask, eps_low, eps_high, cfg.dual_clip, mode, max_len, importance_sampling, weights)
    stats = {
        "loss/policy": loss.detach(), "clip_frac": clip.clip_frac, "clip_frac/low": clip.clip_frac_low, "clip_frac/high": clip.clip_frac_high,
        "approx_kl": clip.approx_kl, "ratio_mean": clip.ratio_mean,
    }
    if cfg.dual_clip is not None:
        stats["clip_frac/dual"] = clip.dual_clip_frac
    return loss, stats
