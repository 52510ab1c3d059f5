"""Returns and advantage estimators.

Two layouts:
- environment time is **time-major** ``(T, N)`` (T steps of N parallel environments), with
  explicit ``terminated`` (no bootstrap: the next state is terminal) and ``episode_ends``
  (terminated or truncated: the recursion stops, the next row belongs to a new episode);
- token sequences are **batch-major** ``(B, C)``, right-padded, with ``mask`` = 1 on valid tokens.
  The episode ends at the last valid token and is terminal there (value after it is 0).

There is one GAE (:func:`gae`); :func:`token_gae` maps the token layout onto it, and
:func:`sampled_token_gae` the policy's own tokens of a multi-turn completion. Whitening is a
separate step (:func:`rlalign.core.masks.masked_whiten`), never hidden inside an estimator.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "reward_to_go",
    "total_returns",
    "td_residuals",
    "gae",
    "token_gae",
    "sampled_token_gae",
    "kl_shaped_rewards",
    "overlong_penalty",
    "last_token_index",
    "group_advantages",
    "tied_groups",
    "rloo_advantages",
    "reinforce_plus_plus_advantages",
]


def reward_to_go(rewards: Tensor, episode_ends: Tensor, gamma: float, bootstrap: Tensor | None = None) -> Tensor:
    """Discounted reward-to-go G_t = r_t + gamma * (1 - end_t) * G_{t+1}, with G_T = bootstrap (0).

    Seed 002, "Reward-to-Go": Psi_t = sum_{i>=t} gamma^(i-t) r_i within the episode.

    Args:
        rewards: Shape: (T, N).
        episode_ends: 1 where the episode ends after step t. Shape: (T, N).
        gamma: discount factor.
        bootstrap: value of the state after the last row, for rows whose episode goes on. Shape: (N,).
    Returns:
        Shape: (T, N).
    """
    T = rewards.shape[0]
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0]) if bootstrap is None else bootstrap.to(rewards.dtype)
    not_end = 1.0 - episode_ends.to(rewards.dtype)
    for t in reversed(range(T)):
        running = rewards[t] + gamma * not_end[t] * running
        out[t] = running
    return out


def total_returns(rewards: Tensor, episode_ends: Tensor, gamma: float) -> Tensor:
    """R(tau) = sum_k gamma^k r_k of the whole episode, given to every step of that episode.

    Seed 002, "Basic Policy Gradient": Psi_t = R(tau). An episode cut by the end of the batch
    counts only the rewards it has.

    Args:
        rewards, episode_ends: Shape: (T, N).
    Returns:
        Shape: (T, N).
    """
    to_go = reward_to_go(rewards, episode_ends, gamma)  # (T, N)
    out = torch.empty_like(to_go)
    start_value = to_go[0]
    ends = episode_ends.bool()
    for t in range(rewards.shape[0]):
        if t > 0:
            start_value = torch.where(ends[t - 1], to_go[t], start_value)
        out[t] = start_value
    return out


def td_residuals(rewards: Tensor, values: Tensor, next_values: Tensor, terminated: Tensor, gamma: float) -> Tensor:
    """delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t).

    Schulman et al. 2016 (GAE), eq. 9; the seeds' "one-step TD error".

    Args:
        rewards, values, next_values, terminated: Shape: (T, N). ``next_values[t]`` is V of the
            true next state, also for a truncated step (the final observation, not the reset one).
    """
    not_terminal = 1.0 - terminated.to(rewards.dtype)
    return rewards + gamma * not_terminal * next_values - values


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    episode_ends: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation.

    A_t = sum_l (gamma*lam)^l delta_{t+l}, computed backwards as
    A_t = delta_t + gamma * lam * (1 - end_t) * A_{t+1}.     Schulman et al. 2016, eq. 16.

    Bootstrapping is decided by ``terminated`` (truncated steps still bootstrap from V(s_{t+1})),
    the recursion is cut by ``episode_ends`` (terminated or truncated). lam=0 gives the TD residual;
    lam=1 gives the Monte-Carlo return minus V(s_t).

    Args:
        rewards, values, next_values, terminated, episode_ends: Shape: (T, N).
    Returns:
        (advantages, returns) with returns = advantages + values (the value-loss target). Shape: (T, N).
    """
    deltas = td_residuals(rewards, values, next_values, terminated, gamma)  # (T, N)
    not_end = 1.0 - episode_ends.to(rewards.dtype)
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[0])
    for t in reversed(range(deltas.shape[0])):
        running = deltas[t] + gamma * lam * not_end[t] * running
        advantages[t] = running
    return advantages, advantages + values


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last position with mask = 1 in each row (0 for an empty row). Shape: (B,)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (mask.to(torch.long) * positions).amax(dim=-1)


def token_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """GAE over right-padded completions: the episode ends (terminally) at the last valid token.

    delta_t = r_t + gamma * V_{t+1} - V_t with V after the last valid token = 0 (seed 003, PPO for
    LLMs: per-token rewards, score on the last token). Padded positions return 0.

    Args:
        rewards: per-token rewards, e.g. from :func:`kl_shaped_rewards`. Shape: (B, C).
        values: critic values V(s_t) per completion token. Shape: (B, C).
        mask: 1 on valid completion tokens (up to and including EOS). Shape: (B, C).
    Returns:
        (advantages, returns), both zero on padding. Shape: (B, C).
    """
    mask = mask.to(rewards.dtype)
    next_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # (B, C)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1) * next_mask
    episode_end = mask * (1.0 - next_mask)  # 1 at the last valid token
    advantages, returns = gae(
        (rewards * mask).T, (values * mask).T, next_values.T, episode_end.T, episode_end.T, gamma, lam
    )
    return advantages.T * mask, returns.T * mask


def sampled_token_gae(rewards: Tensor, values: Tensor, mask: Tensor, sampled: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """:func:`token_gae` over the tokens the policy chose only: the other completion tokens (a tool's or an
    environment's reply between turns) are the environment's transition, not time steps.

    With s_1 < ... < s_n a row's sampled positions:

        delta_k = r'_k + gamma * V(s_{k+1}) - V(s_k)   (V(s_{n+1}) = 0),   A(s_k) = delta_k + gamma * lam * A(s_{k+1})
        r'_k = sum of r_t over s_k <= t < s_{k+1}       (a reward on an environment token is the choice's before it)

    which is :func:`token_gae` on the row with its other tokens deleted (Schulman et al. 2016, eq. 16, over
    the policy's decisions), so V at the environment's positions, which the critic is never trained on,
    does not enter. A row whose tokens are all sampled (single-turn) gets exactly :func:`token_gae`'s result.
    Rewards before a row's first sampled token are dropped (no decision of the policy precedes them).

    Args:
        rewards: per-token rewards (those on padding are ignored). Shape: (B, C).
        values: critic values V(s_t); only those at sampled positions are read. Shape: (B, C).
        mask: 1 on completion tokens (sampled or not). Shape: (B, C).
        sampled: 1 on the tokens the policy chose, inside ``mask``. Shape: (B, C).
    Returns:
        (advantages, returns = A + V), 0 off the sampled tokens. Shape: (B, C).
    """
    chosen = sampled > 0  # (B, C)
    n = chosen.sum(-1, keepdim=True)  # (B, 1) decisions per row
    before = chosen.cumsum(-1) - 1  # (B, C) the place among the row's decisions of the last one at or before t; -1 before the first
    dest = torch.where(chosen, before, n + (~chosen).cumsum(-1) - 1)  # (B, C) a permutation: the decisions first, in order, then the rest
    kept = (mask > 0) & (before >= 0)  # (B, C) rewards that fold onto a decision
    packed_rewards = torch.zeros_like(rewards).scatter_add(1, before.clamp(min=0), torch.where(kept, rewards, torch.zeros_like(rewards)))  # (B, C)
    packed_values = torch.zeros_like(values).scatter(1, dest, values)  # (B, C) V(s_1), ..., V(s_n), then the rest
    packed_mask = (torch.arange(rewards.shape[-1], device=rewards.device) < n).to(rewards.dtype)  # (B, C) 1 on the first n places
    advantages, returns = token_gae(packed_rewards, packed_values, packed_mask, gamma, lam)  # (B, C), 0 past the n decisions
    return advantages.gather(1, dest), returns.gather(1, dest)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a reward added to the score:

        R_len(y) = 0                                  |y| <= L_max - L_buf
                   ((L_max - L_buf) - |y|) / L_buf    L_max - L_buf < |y| <= L_max
                   -1                                 |y| > L_max

    a penalty growing linearly from 0 to -1 over the last ``buffer`` tokens of the budget.

    Args:
        lengths: completion lengths |y|. Shape: (B,).
        max_len: L_max, the token budget.
        buffer: L_buf, 0 < L_buf <= L_max.
    Returns:
        Shape: (B,), float32.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"the overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    lengths = lengths.to(torch.float32)
    start = max_len - buffer
    ramp = (start - lengths) / buffer
    return torch.where(lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_len, ramp, torch.full_like(lengths, -1.0)))


def kl_shaped_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float | Tensor) -> Tensor:
    """Per-token RLHF reward: r_t = -beta * KL_t, plus the sequence score at the last valid token.

    Ziegler et al. 2019 / InstructGPT (Ouyang et al. 2022, eq. 2); seed 003, "KL penalty in the reward".

    Args:
        scores: reward-model (or rule) score per completion. Shape: (B,).
        kl: per-token KL estimate log pi(o_t) - log pi_ref(o_t) (k1) or k3. Shape: (B, C).
        mask: 1 on valid completion tokens. Shape: (B, C).
        beta: KL coefficient.
    Returns:
        Shape: (B, C), 0 on padding.
    """
    mask = mask.to(kl.dtype)
    rewards = -beta * kl * mask  # (B, C)
    last = last_token_index(mask)  # (B,)
    has_tokens = mask.sum(-1) > 0
    bonus = torch.where(has_tokens, scores.to(kl.dtype), torch.zeros_like(scores, dtype=kl.dtype))
    return rewards.scatter_add(1, last[:, None], bonus[:, None])


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    if not scores.is_floating_point():
        scores = scores.to(torch.float32)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"scores must be 1-D with a length divisible by group_size={group_size}, got {tuple(scores.shape)}")
    return scores.view(-1, group_size)  # (B/G, G)


def group_advantages(
    scores: Tensor,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """GRPO group-relative advantage  A_i = (r_i - mean(r_group)) / std(...)  (Shao et al. 2024, eq. 3).

    ``scale``: "group" divides by the group's std (DeepSeekMath), "batch" by the std of all scores
    in the batch, "none" does not divide (Dr.GRPO, Liu et al. 2025). std is the unbiased one.
    A group whose rewards all tie (std <= eps) gets advantage 0, never NaN.

    Args:
        scores: one scalar reward per completion, groups contiguous: [p0 x G, p1 x G, ...]. Shape: (B,).
        valid: the completions whose score counts (the rest, whose reward could not be computed, are
            left out of every mean and std and get 0; a group with fewer than two counts as tied);
            None: all. Shape: (B,).
    Returns:
        Shape: (B,).
    """
    if valid is not None:
        return _masked_group_advantages(scores, group_size, scale, eps, valid)
    grouped = _grouped(scores, group_size)  # (B/G, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    group_std = grouped.std(dim=1, keepdim=True)  # (B/G, 1)
    tied = group_std <= eps
    if scale == "group":
        advantages = centred / group_std.clamp(min=eps)
    elif scale == "batch":
        batch_std = grouped.std()
        advantages = centred / batch_std.clamp(min=eps)
    elif scale == "none":
        advantages = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return torch.where(tied, torch.zeros_like(advantages), advantages).view(-1)


def _valid_group_moments(scores: Tensor, group_size: int, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grouped scores, valid as numbers, centred scores (0 where not valid), unbiased std over the valid): (B/G, G) x 3, (B/G, 1)."""
    grouped, v = _grouped(scores, group_size), _grouped(valid.to(scores.dtype if scores.is_floating_point() else torch.float32), group_size)  # (B/G, G)
    count = v.sum(dim=1, keepdim=True)  # (B/G, 1)
    mean = (grouped * v).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (grouped - mean) * v  # (B/G, G), 0 where not valid
    group_std = ((centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # unbiased, over the valid; 0 with fewer than two
    return grouped, v, centred, group_std


def tied_groups(scores: Tensor, group_size: int, valid: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """The groups whose rewards all tie: the std of the ``valid`` completions' scores (all if None) is at most
    ``eps``, or fewer than two are valid. They carry no gradient under :func:`group_advantages` (advantage 0),
    so dynamic sampling drops them (Yu et al. 2025, DAPO, eq. 11). Shapes: scores and valid (B,), groups
    contiguous; returns (B/G,) bool."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    _, _, _, group_std = _valid_group_moments(scores, group_size, valid)
    return (group_std <= eps).view(-1)


def _masked_group_advantages(scores: Tensor, group_size: int, scale: str, eps: float, valid: Tensor) -> Tensor:
    """:func:`group_advantages` over the ``valid`` completions only (0 for the rest)."""
    grouped, v, centred, group_std = _valid_group_moments(scores, group_size, valid)  # (B/G, G) x 3, (B/G, 1)
    tied = group_std <= eps  # (B/G, 1), a group with fewer than two valid included (std 0)
    if scale == "group":
        advantages = centred / group_std.clamp(min=eps)
    elif scale == "batch":
        kept = grouped[v.bool()]  # (n valid,)
        advantages = centred / (kept.std() if kept.numel() > 1 else kept.new_zeros(())).clamp(min=eps)
    elif scale == "none":
        advantages = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return torch.where(tied, torch.zeros_like(advantages), advantages).view(-1)


def rloo_advantages(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r)).

    Kool et al. 2019; Ahmadian et al. 2024. A tied group gives 0. ``valid``: as in
    :func:`group_advantages` (the others' mean is over the valid ones; fewer than two: 0).

    Args:
        scores: groups contiguous. Shape: (B,).
    Returns:
        Shape: (B,).
    """
    if valid is not None:
        grouped, v = _grouped(scores, group_size), _grouped(valid.float(), group_size)  # (B/G, G)
        count = v.sum(dim=1, keepdim=True)
        others_mean = ((grouped * v).sum(dim=1, keepdim=True) - grouped) / (count - 1).clamp(min=1)
        mean = (grouped * v).sum(dim=1, keepdim=True) / count.clamp(min=1)
        tied = (((grouped - mean) * v).abs().amax(dim=1, keepdim=True) == 0) | (count < 2)
        return torch.where(tied, torch.zeros_like(grouped), (grouped - others_mean) * v).view(-1)
    grouped = _grouped(scores, group_size)  # (B/G, G)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = grouped - others_mean
    tied = grouped.std(dim=1, keepdim=True) == 0
    return torch.where(tied, torch.zeros_like(advantages), advantages).view(-1)


def reinforce_plus_plus_advantages(scores: Tensor, group_size: int, baseline: bool = False, eps: float = 1e-6, valid: Tensor | None = None) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++", global advantage normalisation): no critic and no per-group
    scale; the rewards are normalised over the whole batch.

        REINFORCE++             A_i = (R_i - mean_batch R) / std_batch R
        REINFORCE++-baseline    R'_i = R_i - mean_{group(i)} R,   A_i = R'_i / std_batch R'

    (the batch mean of R' is 0, every group being centred). OpenRLHF's ``reinforce`` /
    ``reinforce_baseline`` and verl's ``reinforce_plus_plus`` / ``reinforce_plus_plus_baseline`` whiten
    the same quantity over the batch's *tokens* (each completion weighted by its length) and verl's
    ``reinforce_plus_plus`` also discounts per-token rewards; here each completion counts once (the
    paper's per-sample form) and std is the unbiased one, as in :func:`group_advantages`. Unlike
    GRPO's z-score, a group whose rewards all tie keeps a non-zero advantage without the baseline.
    A batch whose values all tie (std <= eps) gets 0.

    Args:
        scores: one reward per completion, groups contiguous (for the baseline). Shape: (B,).
        group_size: G, the completions per prompt (used by the baseline only).
        baseline: subtract each group's mean first (REINFORCE++-baseline).
        valid: as in :func:`group_advantages`: every mean and std over the valid completions only; 0 for the rest.
    Returns:
        Shape: (B,).
    """
    if valid is not None:
        v = valid.to(torch.float32)
        if baseline:
            centred = _masked_group_advantages(scores, group_size, "none", 0.0, valid)  # (B,) R - mean of the valid of its group, 0 elsewhere
        else:
            values = scores.to(torch.float32) if not scores.is_floating_point() else scores
            centred = (values - (values * v).sum() / v.sum().clamp(min=1)) * v  # (B,)
        kept = centred[valid.bool()]
        std = kept.std() if kept.numel() > 1 else centred.new_zeros(())
        return torch.zeros_like(centred) if std <= eps else centred / std
    if baseline:
        grouped = _grouped(scores, group_size)  # (B/G, G)
        centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (B,)
    else:
        if scores.dim() != 1:
            raise ValueError(f"scores must be 1-D, got {tuple(scores.shape)}")
        scores = scores if scores.is_floating_point() else scores.to(torch.float32)
        centred = scores - scores.mean()  # (B,)
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    if std <= eps:
        return torch.zeros_like(centred)
    return centred / std
