"""Value iteration: the exact oracle for any environment that exposes its model ``env.unwrapped.P``
(the maze, FrozenLake, CliffWalking, Taxi).

    Q(s, a) = sum_{s'} p(s' | s, a) [ r + gamma * (1 - done) * V(s') ]
    V(s)    = max_a Q(s, a)          repeated until max_s |V_new(s) - V(s)| < tol

Bellman optimality backup; Sutton & Barto (2018), section 4.4. ``policy_value`` solves the Bellman
expectation equation V = r_pi + gamma * P_pi V exactly (a linear system), which is how a learned
greedy policy is scored against the optimum.
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
from pydantic import Field

from rlalign.config import Config
from rlalign.classic.common import Result, RunLog, evaluate, seed_everything, state_index

__all__ = ["ValueIterationConfig", "ENV_KIND", "value_iteration", "policy_value", "tabular_model", "train"]

ENV_KIND = "model"  # what common.check_env asks of the environment

Model = dict[int, dict[int, list[tuple[float, int, float, bool]]]]


class ValueIterationConfig(Config):
    """Value iteration on a model-exposing environment."""

    seed: int = Field(1, ge=0, lt=2**32, description="seed of the evaluation episodes; NumPy takes 0 <= seed < 2**32")
    gamma: float = Field(
        0.9, gt=0.0, lt=1.0,
        description="discount factor, < 1: only then is a policy greedy w.r.t. V* sure to be optimal (Sutton & Barto 2018, "
        "section 4.4); at 1, bumping into the maze's walls ties with moving on and the greedy policy never finishes",
    )
    tol: float = Field(1e-10, gt=0.0, description="stop when the largest value change is below this")
    max_iters: int = Field(10_000, ge=1, description="give up after this many sweeps")
    eval_episodes: int = Field(100, ge=1, description="greedy episodes of the final evaluation")


def tabular_model(P: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The toy-text model as arrays: transition probabilities (S, A, S), expected reward (S, A)
    and the probability of continuing, i.e. of a non-terminal transition, into each s' (S, A, S)."""
    n_s, n_a = len(P), len(P[0])
    prob = np.zeros((n_s, n_a, n_s))  # (S, A, S)
    cont = np.zeros((n_s, n_a, n_s))  # (S, A, S) probability mass that bootstraps
    reward = np.zeros((n_s, n_a))  # (S, A)
    for s in range(n_s):
        for a in range(n_a):
            for p, s2, r, done in P[s][a]:
                prob[s, a, s2] += p
                cont[s, a, s2] += 0.0 if done else p
                reward[s, a] += p * r
    return prob, reward, cont


def value_iteration(
    P: Model, gamma: float, tol: float = 1e-10, max_iters: int = 10_000, on_sweep: Callable[[int, float], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Optimal values V* (S,), action values Q* (S, A) and a greedy policy (S,) of the model ``P``;
    ``on_sweep(i, max_s |V_new(s) - V(s)|)`` after each sweep i = 1, 2, ... (the convergence curve).

    The greedy policy is optimal for gamma < 1. With gamma = 1 it need not even end: on the maze
    V* = 10 in every live cell, so bumping into a wall (Q = 10, staying put) ties with moving on,
    and the first action of the tie, up, is taken everywhere."""
    _, reward, cont = tabular_model(P)
    v = np.zeros(len(P))  # (S,)
    for i in range(1, max_iters + 1):
        q = reward + gamma * cont @ v  # (S, A)
        v_new = q.max(axis=1)
        delta = np.abs(v_new - v).max()
        v = v_new
        if on_sweep is not None:
            on_sweep(i, float(delta))
        if delta < tol:
            break
    q = reward + gamma * cont @ v
    return v, q, q.argmax(axis=1)


def policy_value(P: Model, policy: np.ndarray, gamma: float) -> np.ndarray:
    """V^pi (S,) of a deterministic policy (S,): solve (I - gamma * P_pi) V = r_pi.

    With gamma = 1 the system is singular if the policy never terminates from some state; such
    states have value -inf (or +inf), so use gamma < 1 to score arbitrary policies.
    """
    _, reward, cont = tabular_model(P)
    idx = np.arange(len(P))
    cont_pi = cont[idx, policy]  # (S, S)
    r_pi = reward[idx, policy]  # (S,)
    return np.linalg.solve(np.eye(len(P)) - gamma * cont_pi, r_pi)


def train(cfg: ValueIterationConfig, env_id: str, log: RunLog | None = None) -> Result:
    """Run value iteration on ``env_id``'s model; the agent is the greedy policy table (S,)."""
    import rlalign.classic.maze  # noqa: F401  (registers the maze)

    seed_everything(cfg.seed)
    log = log or RunLog()
    env = gym.make(env_id)
    P = env.unwrapped.P
    v, q, policy = value_iteration(P, cfg.gamma, cfg.tol, cfg.max_iters, on_sweep=lambda i, delta: log.update(i, {"bellman_residual": delta}))
    obs, _ = env.reset(seed=cfg.seed)
    log.update(0, {"v_start": float(v[state_index(obs)])})  # V* of the start state

    def act(obs) -> int:
        return int(policy[state_index(obs)])

    returns = evaluate(act, env_id, cfg.eval_episodes, seed=cfg.seed + 20_000)
    return Result(policy, [], float(np.mean(returns)), returns, log)
