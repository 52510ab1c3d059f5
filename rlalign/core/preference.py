"""Direct preference losses on sequence log-probs: DPO, conservative DPO, IPO and SimPO.

Each pair is a prompt x with a preferred response y_c and a dispreferred one y_r. The inputs are
sequence log-probs log pi(y | x) = sum_t log pi(y_t | x, y_<t) over the response's tokens (its EOS
included), already reduced by the caller; the lengths |y| are token counts. With the log-ratios to
the frozen reference

    rho_c = log pi(y_c | x) - log pi_ref(y_c | x),      rho_r = log pi(y_r | x) - log pi_ref(y_r | x)

the losses are

    DPO    L = -log sigmoid(beta (rho_c - rho_r))                                 Rafailov et al. 2023, eq. 7
    cDPO   L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h),  h = rho_c - rho_r
                                                  Mitchell 2023, "A note on DPO with noisy preferences"
    IPO    L = (rho_c / |y_c| - rho_r / |y_r| - 1 / (2 beta))^2                  Azar et al. 2023, eq. 17
    SimPO  L = -log sigmoid(beta / |y_c| log pi(y_c | x) - beta / |y_r| log pi(y_r | x) - gamma)
                                                                                Meng et al. 2024, eq. 6

each a mean over the pairs. IPO's beta is the paper's tau. IPO's log-ratios are per-token averages:
the paper writes sequence log-ratios, but summed ones make the squared loss grow with the length;
the IPO authors and TRL's DPOTrainer (``loss_type="ipo"``) divide by the response lengths, and so
does :func:`ipo_loss`. SimPO's gamma is the target margin itself (not gamma / beta), as in the
paper's equation and TRL's ``simpo_gamma``; SimPO needs no reference model.

Statistics (:class:`PreferenceStats`): the implicit rewards r = beta * rho of DPO, cDPO and IPO
(summed log-ratios, as TRL logs them for every loss type) or r = beta / |y| log pi(y | x) of SimPO,
their means, the mean margin r_c - r_r and the accuracy, the fraction of pairs with r_c > r_r.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PreferenceStats", "dpo_loss", "ipo_loss", "simpo_loss"]


class PreferenceStats(NamedTuple):
    chosen_reward: Tensor  # mean implicit reward of the chosen responses
    rejected_reward: Tensor  # mean implicit reward of the rejected responses
    margin: Tensor  # mean of r_c - r_r
    accuracy: Tensor  # fraction of pairs with r_c > r_r


def _stats(chosen_rewards: Tensor, rejected_rewards: Tensor) -> PreferenceStats:
    with torch.no_grad():
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        margin = chosen_rewards - rejected_rewards  # (B,)
        return PreferenceStats(chosen_rewards.mean(), rejected_rewards.mean(), margin.mean(), (margin > 0).float().mean())


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, PreferenceStats]:
    """DPO: L = -log sigmoid(beta h), h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)).

    Rafailov et al. 2023, "Direct Preference Optimization", eq. 7. With ``label_smoothing`` eps > 0 it
    is conservative DPO: each label is taken to be flipped with probability eps, so
    L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (Mitchell 2023), whose gradient
    vanishes at sigmoid(beta h) = 1 - eps instead of pushing h to infinity.

    Args:
        policy_chosen_logps, policy_rejected_logps: log pi(y | x), summed over response tokens. Shape: (B,).
        ref_chosen_logps, ref_rejected_logps: the same under the reference (no gradient flows). Shape: (B,).
        beta: inverse temperature of the implicit reward beta * log(pi / pi_ref), > 0.
        label_smoothing: eps in [0, 0.5).
    Returns:
        The mean loss over the B pairs, and :class:`PreferenceStats` of the rewards beta * rho.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()  # (B,)
    logits = beta * (chosen_logratios - rejected_logratios)  # (B,)
    losses = -F.logsigmoid(logits)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-logits)
    return losses.mean(), _stats(beta * chosen_logratios, beta * rejected_logratios)


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, PreferenceStats]:
    """IPO: L = (rho_c / |y_c| - rho_r / |y_r| - 1 / (2 beta))^2, rho = log pi(y) - log pi_ref(y).

    Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
    eq. 17 (beta is the paper's tau), with per-token average log-ratios (the module docstring). A
    squared loss: it pulls the averaged log-ratio gap to 1 / (2 beta) and no further.

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: summed
            over response tokens, as for :func:`dpo_loss`. Shape: (B,).
        chosen_lengths, rejected_lengths: response token counts |y| (a length below 1 counts as 1). Shape: (B,).
        beta: > 0.
    Returns:
        The mean loss over the B pairs, and :class:`PreferenceStats` of the rewards beta * rho (summed, as DPO's).
    """
    _check_beta(beta)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()  # (B,)
    h = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)  # (B,)
    losses = (h - 1 / (2 * beta)) ** 2
    return losses.mean(), _stats(beta * chosen_logratios, beta * rejected_logratios)


def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> tuple[Tensor, PreferenceStats]:
    """SimPO: L = -log sigmoid(beta / |y_c| log pi(y_c | x) - beta / |y_r| log pi(y_r | x) - gamma).

    Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    eq. 6: the implicit reward is the length-normalised log-likelihood beta / |y| log pi(y | x), and
    the chosen one must beat the rejected one by the target margin gamma. No reference model.

    Args:
        policy_chosen_logps, policy_rejected_logps: log pi(y | x), summed over response tokens. Shape: (B,).
        chosen_lengths, rejected_lengths: response token counts |y| (a length below 1 counts as 1). Shape: (B,).
        beta: > 0; gamma: the target reward margin.
    Returns:
        The mean loss over the B pairs, and :class:`PreferenceStats` of the rewards beta / |y| log pi(y | x).
    """
    _check_beta(beta)
    chosen_rewards = beta * policy_chosen_logps / chosen_lengths.clamp(min=1)  # (B,)
    rejected_rewards = beta * policy_rejected_logps / rejected_lengths.clamp(min=1)  # (B,)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses.mean(), _stats(chosen_rewards, rejected_rewards)
