"""Bellman backups of value-based RL and the target-network update.

    Q-learning target      y = r + gamma * (1 - terminated) * max_a' Q(s', a')       (Watkins 1989)
    Q-learning update      Q(s, a) <- Q(s, a) + alpha * (y - Q(s, a))            (seed 002, Bellman update)
    double-DQN target      y = r + gamma * (1 - terminated) * Q_target(s', argmax_a' Q_online(s', a'))
                                                                                  (van Hasselt et al. 2016)
    EMA / "mean teacher"   theta_target <- (1 - tau) * theta_target + tau * theta  (Tarvainen & Valpola 2017;
                                                                                  Polyak averaging)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["q_learning_target", "double_q_target", "q_learning_update", "polyak_update_"]


def q_learning_target(rewards: Tensor, next_q: Tensor, terminated: Tensor, gamma: float) -> Tensor:
    """y = r + gamma * (1 - terminated) * max_a' Q(s', a'); a truncated step still bootstraps.

    Args:
        rewards: Shape: (B,).
        next_q: Q-values of the next state (from the target network in DQN). Shape: (B, A).
        terminated: 1 where s' is terminal. Shape: (B,).
    Returns:
        Shape: (B,).
    """
    return rewards + gamma * (1.0 - terminated.to(rewards.dtype)) * next_q.max(dim=-1).values


def double_q_target(rewards: Tensor, next_q_online: Tensor, next_q_target: Tensor, terminated: Tensor, gamma: float) -> Tensor:
    """Double DQN: the online network picks a', the target network evaluates it. Shapes as above."""
    best = next_q_online.argmax(dim=-1, keepdim=True)  # (B, 1)
    return rewards + gamma * (1.0 - terminated.to(rewards.dtype)) * next_q_target.gather(-1, best).squeeze(-1)


def q_learning_update(q_sa: Tensor, target: Tensor, alpha: float) -> Tensor:
    """Q(s, a) + alpha * (y - Q(s, a)): the tabular Bellman update's new value. Shapes: (B,) -> (B,)."""
    return q_sa + alpha * (target - q_sa)


@torch.no_grad()
def polyak_update_(target_params: Iterable[Tensor], online_params: Iterable[Tensor], tau: float) -> None:
    """In place: theta_target <- (1 - tau) * theta_target + tau * theta. tau = 1 is a hard copy."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    for target, online in zip(target_params, online_params, strict=True):
        target.lerp_(online, tau)
