"""Tabular Q-learning with epsilon-greedy exploration.

    Q(s_t, a_t) <- Q(s_t, a_t) + alpha * [ r_t + gamma * (1 - terminated_t) * max_a Q(s_{t+1}, a) - Q(s_t, a_t) ]

Watkins (1989); seed 002, section 3.1 (the seed writes the alpha = 1 form
Q(s_t, a_t) = r_t + gamma * max_a Q(s_{t+1}, a), exact for deterministic environments such as the
maze; stochastic ones such as slippery FrozenLake need alpha < 1). A truncated episode still
bootstraps: only termination zeroes the future. Epsilon decays linearly from ``eps_start`` to
``eps_end`` over ``exploration_fraction`` of the run; alpha decays linearly to ``alpha_end``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from pydantic import Field

from rlalign.classic.common import (
    ClassicConfig,
    EpisodeTracker,
    FiniteGuard,
    Result,
    RunLog,
    finish,
    linear_schedule,
    maybe_evaluate,
    num_actions,
    num_states,
    seed_everything,
    state_index,
)

__all__ = ["QLearningConfig", "ENV_KIND", "train"]

ENV_KIND = "tabular"  # what common.check_env asks of the environment


class QLearningConfig(ClassicConfig):
    """Tabular Q-learning."""

    total_steps: int = Field(5_000, ge=1, description="environment steps to train for")
    gamma: float = Field(
        0.9, gt=0.0, lt=1.0,
        description="discount factor, < 1: only then is a policy greedy w.r.t. V* sure to be optimal (Sutton & Barto 2018, "
        "section 4.4); at 1, bumping into the maze's walls ties with moving on and the greedy policy never finishes",
    )
    alpha: float = Field(1.0, gt=0.0, le=1.0, description="initial step size of the Bellman update (1 = the seed's form)")
    alpha_end: float = Field(1.0, gt=0.0, le=1.0, description="step size at the end of the run (linear decay)")
    eps_start: float = Field(1.0, ge=0.0, le=1.0, description="initial exploration probability")
    eps_end: float = Field(0.05, ge=0.0, le=1.0, description="final exploration probability")
    exploration_fraction: float = Field(0.5, gt=0.0, le=1.0, description="fraction of the run over which epsilon decays")


def train(cfg: QLearningConfig, env_id: str, log: RunLog | None = None) -> Result:
    """Learn a Q-table (S, A); the agent is the table, the evaluation acts greedily on it."""
    import rlalign.classic.maze  # noqa: F401  (registers the maze)

    seed_everything(cfg.seed)
    log = log or RunLog()
    rng = np.random.default_rng(cfg.seed)
    env = gym.make(env_id)
    n_states, n_actions = num_states(env), num_actions(env.action_space)
    guard = FiniteGuard("q_learning", env_id, {})
    q = np.zeros((n_states, n_actions))  # (S, A)
    tracker, last_eval = EpisodeTracker(1), 0

    def greedy(obs) -> int:
        return int(q[state_index(obs)].argmax())

    obs, _ = env.reset(seed=cfg.seed)
    s = state_index(obs)
    for step in range(1, cfg.total_steps + 1):
        eps = linear_schedule(cfg.eps_start, cfg.eps_end, int(cfg.exploration_fraction * cfg.total_steps), step)
        alpha = linear_schedule(cfg.alpha, cfg.alpha_end, cfg.total_steps, step)
        a = int(rng.integers(n_actions)) if rng.random() < eps else int(q[s].argmax())
        obs, reward, terminated, truncated, _ = env.step(a)
        guard.rewards(step, reward)
        s2 = state_index(obs)
        target = reward + cfg.gamma * (0.0 if terminated else q[s2].max())
        q[s, a] += alpha * (target - q[s, a])
        for ret in tracker.step(np.array([reward]), np.array([terminated or truncated])):
            log.episode(step, ret)
        if terminated or truncated:
            obs, _ = env.reset()
            s2 = state_index(obs)
        s = s2
        if step % 1000 == 0:
            log.progress(step)
        last_eval = maybe_evaluate(cfg, env_id, greedy, log, step, last_eval)
        if log.stop:
            break
    log.progress(step)
    return finish(cfg, env_id, q, greedy, log)
