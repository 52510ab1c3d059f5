"""The value functions of a given policy pi: exactly by solving the Bellman expectation equation, and by
Monte-Carlo returns of sampled episodes, for any environment that exposes its model ``env.unwrapped.P``.

    V^pi(s)    = E_{tau ~ (pi, T)}[R(tau) | s_0 = s]              = sum_a pi(a|s) Q^pi(s, a)
    Q^pi(s, a) = E_{tau ~ (pi, T)}[R(tau) | s_0 = s, a_0 = a]     = r(s, a) + gamma sum_{s'} p_cont(s'|s, a) V^pi(s')
    A^pi(s, a) = Q^pi(s, a) - V^pi(s)                             so sum_a pi(a|s) A^pi(s, a) = 0

(seed 002, section 4.1: the on-policy value, action-value and advantage functions). Exact policy
evaluation solves the linear system (I - gamma P_pi) V = r_pi with P_pi(s, s') = sum_a pi(a|s)
p_cont(s'|s, a), the probability of moving to s' without the episode ending, and r_pi(s) = sum_a
pi(a|s) r(s, a) (Sutton & Barto 2018, eq. 4.4). Monte-Carlo prediction averages the discounted return
G_t = r_t + gamma G_{t+1} observed after the first (or every) visit of a state or state-action pair
(Sutton & Barto 2018, sections 5.1-5.3).

Simplifications, stated: the policy is a table pi (S, A) of probabilities; V is estimated from episodes
that start in a uniformly drawn non-terminal state and follow pi throughout, Q from "exploring starts"
episodes whose first state and action are uniform (S non-terminal x A), following pi afterwards, so every
pair is visited even under a deterministic policy. An episode still running after ``max_steps`` is cut
there, which biases a return by at most gamma^max_steps * max|V|.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlalign.classic.value_iteration import Model, tabular_model

__all__ = [
    "PolicyValues", "MonteCarloEstimate", "policy_evaluation", "monte_carlo_evaluation", "uniform_policy", "deterministic_policy",
    "epsilon_greedy_policy", "terminal_states",
]


@dataclass
class PolicyValues:
    v: np.ndarray  # (S,) V^pi
    q: np.ndarray  # (S, A) Q^pi
    advantage: np.ndarray  # (S, A) A^pi = Q^pi - V^pi


def uniform_policy(n_states: int, n_actions: int) -> np.ndarray:
    """pi(a|s) = 1/A everywhere. Shape: (S, A)."""
    return np.full((n_states, n_actions), 1.0 / n_actions)


def deterministic_policy(actions: np.ndarray, n_actions: int) -> np.ndarray:
    """pi(a|s) = 1 if a = actions[s] else 0. Shapes: (S,) -> (S, A)."""
    return np.eye(n_actions)[np.asarray(actions)]


def epsilon_greedy_policy(q: np.ndarray, epsilon: float) -> np.ndarray:
    """pi(a|s) = (1 - eps) [a = argmax_a' q(s, a')] + eps / A; ties go to the first action, as in value_iteration.

    Shapes: (S, A) -> (S, A). epsilon = 0 is the greedy policy, epsilon = 1 the uniform one.
    """
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    n_actions = q.shape[1]
    return (1.0 - epsilon) * deterministic_policy(q.argmax(axis=1), n_actions) + epsilon / n_actions


def terminal_states(P: Model) -> np.ndarray:
    """1 where every action ends the episode in place with reward 0 (the toy-text goal, trap, hole). Shape: (S,)."""
    return np.array([float(all(s2 == s and r == 0.0 and done for a in P[s] for _, s2, r, done in P[s][a])) for s in range(len(P))])


def _check_policy(pi: np.ndarray, n_states: int, n_actions: int) -> np.ndarray:
    pi = np.asarray(pi, dtype=np.float64)
    if pi.shape != (n_states, n_actions):
        raise ValueError(f"policy must have shape (S, A) = ({n_states}, {n_actions}), got {pi.shape}")
    if (pi < 0).any() or not np.allclose(pi.sum(axis=1), 1.0, atol=1e-9):
        raise ValueError("policy rows must be probability distributions (non-negative, summing to 1)")
    return pi


def policy_evaluation(P: Model, pi: np.ndarray, gamma: float) -> PolicyValues:
    """V^pi (S,), Q^pi (S, A) and A^pi (S, A) of the stochastic policy ``pi`` (S, A): solve (I - gamma P_pi) V = r_pi.

    With gamma = 1 the system is singular when pi never ends the episode from some state (its return is
    unbounded or undefined): numpy raises ``LinAlgError``; use gamma < 1 for such policies.
    """
    _, reward, cont = tabular_model(P)  # (S, A), (S, A, S)
    pi = _check_policy(pi, *reward.shape)
    cont_pi = np.einsum("sa,sat->st", pi, cont)  # (S, S) P_pi
    r_pi = (pi * reward).sum(axis=1)  # (S,)
    v = np.linalg.solve(np.eye(len(P)) - gamma * cont_pi, r_pi)  # (S,)
    q = reward + gamma * cont @ v  # (S, A)
    return PolicyValues(v=v, q=q, advantage=q - v[:, None])


@dataclass
class MonteCarloEstimate:
    """Per-episode sums of the returns recorded for each state (V episodes) and pair (Q episodes), so the
    estimate after the first n episodes is a prefix sum. First-visit: at most one return per episode each."""

    v_returns: np.ndarray  # (M, S) sum of the returns episode m records for s
    v_squares: np.ndarray  # (M, S) sum of their squares
    v_visits: np.ndarray  # (M, S) how many it records (first visit: 0 or 1)
    q_returns: np.ndarray  # (M, S, A)
    q_squares: np.ndarray  # (M, S, A)
    q_visits: np.ndarray  # (M, S, A)
    first_visit: bool

    @staticmethod
    def _mean(sums: np.ndarray, visits: np.ndarray, n: int | None) -> np.ndarray:
        total, count = sums[:n].sum(axis=0), visits[:n].sum(axis=0)
        return np.divide(total, count, out=np.full(total.shape, np.nan), where=count > 0)  # nan where never visited

    @staticmethod
    def _standard_error(sums, squares, visits, n: int | None) -> np.ndarray:
        count = visits[:n].sum(axis=0)
        mean = np.divide(sums[:n].sum(axis=0), count, out=np.full(count.shape, np.nan), where=count > 0)
        mean_sq = np.divide(squares[:n].sum(axis=0), count, out=np.full(count.shape, np.nan), where=count > 0)
        var = np.maximum(mean_sq - mean**2, 0.0) * count / np.maximum(count - 1, 1)  # unbiased sample variance
        return np.sqrt(np.divide(var, count, out=np.full(count.shape, np.nan), where=count > 1))

    def v(self, n_episodes: int | None = None) -> np.ndarray:
        """The estimate of V^pi from the first ``n_episodes`` V episodes (all by default). Shape: (S,)."""
        return self._mean(self.v_returns, self.v_visits, n_episodes)

    def q(self, n_episodes: int | None = None) -> np.ndarray:
        """The estimate of Q^pi from the first ``n_episodes`` Q episodes. Shape: (S, A)."""
        return self._mean(self.q_returns, self.q_visits, n_episodes)

    def v_standard_error(self, n_episodes: int | None = None) -> np.ndarray:
        """std / sqrt(visits) of the V estimate: its standard error for first-visit returns (independent
        across episodes); for every-visit returns, which correlate within an episode, only indicative. (S,)."""
        return self._standard_error(self.v_returns, self.v_squares, self.v_visits, n_episodes)

    def q_standard_error(self, n_episodes: int | None = None) -> np.ndarray:
        """The same for Q. Shape: (S, A)."""
        return self._standard_error(self.q_returns, self.q_squares, self.q_visits, n_episodes)


def _outcomes(P: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The model's outcomes padded to K per pair: probability, next state, reward, done. Shapes: (S, A, K)."""
    n_s, n_a = len(P), len(P[0])
    k = max(len(P[s][a]) for s in range(n_s) for a in range(n_a))
    prob, nxt, rew, done = np.zeros((n_s, n_a, k)), np.zeros((n_s, n_a, k), dtype=np.int64), np.zeros((n_s, n_a, k)), np.ones((n_s, n_a, k), bool)
    for s in range(n_s):
        for a in range(n_a):
            for i, (p, s2, r, d) in enumerate(P[s][a]):
                prob[s, a, i], nxt[s, a, i], rew[s, a, i], done[s, a, i] = p, s2, r, d
    return prob, nxt, rew, done


def _draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of ``probs`` (M, K) by inverse CDF. Shape: (M,)."""
    return np.minimum((rng.random((len(probs), 1)) > probs.cumsum(axis=1)).sum(axis=1), probs.shape[1] - 1)


def _visit_returns(P: Model, pi: np.ndarray, gamma: float, n_episodes: int, rng: np.random.Generator, for_q: bool, first_visit: bool,
                   max_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample ``n_episodes`` episodes side by side and record the return after each (first) visit of a state
    (``for_q`` False: starts in a uniform non-terminal state) or of a pair (``for_q``: exploring starts):
    per-episode sums of the returns, of their squares, and visit counts. Shapes: (M, S) or (M, S * A)."""
    prob, nxt, rew, done = _outcomes(P)  # (S, A, K) each
    n_s, n_a = pi.shape
    M = n_episodes
    live = np.flatnonzero(terminal_states(P) == 0)
    s = live[rng.integers(len(live), size=M)]  # (M,)
    first_action = rng.integers(n_a, size=M)  # (M,) used only with exploring starts
    alive = np.ones(M, bool)
    states, actions, rewards, alives = [], [], [], []  # each (M,) per step
    for t in range(max_steps):
        a = first_action if t == 0 and for_q else _draw(pi[s], rng)
        k = _draw(prob[s, a], rng)  # which outcome of (s, a)
        states.append(s), actions.append(a), rewards.append(np.where(alive, rew[s, a, k], 0.0)), alives.append(alive)
        alive = alive & ~done[s, a, k]
        s = nxt[s, a, k]
        if not alive.any():
            break
    T = len(states)
    S, A, R, L = np.stack(states), np.stack(actions), np.stack(rewards), np.stack(alives)  # (T, M) each
    G = np.zeros((T + 1, M))  # G[T] = 0: nothing after the end (or the cut)
    for t in reversed(range(T)):
        G[t] = R[t] + gamma * G[t + 1]
    G = G[:T]  # (T, M) the return from step t
    index, size = (S * n_a + A, n_s * n_a) if for_q else (S, n_s)  # (T, M) the visited state or pair s * A + a
    record = L.copy()  # (T, M) which steps' returns are recorded
    if first_visit:
        seen = np.zeros((M, size), bool)
        for t in range(T):
            record[t] &= ~seen[np.arange(M), index[t]]
            seen[np.arange(M), index[t]] |= L[t]
    flat = (np.arange(M)[None, :] * size + index)[record]  # into an (M, size) table
    sums, squares, visits = (np.bincount(flat, weights=w[record], minlength=M * size).reshape(M, size) for w in (G, G**2, np.ones_like(G)))
    return sums, squares, visits


def monte_carlo_evaluation(P: Model, pi: np.ndarray, gamma: float, n_episodes: int, seed: int = 0, first_visit: bool = True,
                           max_steps: int = 200) -> MonteCarloEstimate:
    """Monte-Carlo prediction of V^pi and Q^pi from ``n_episodes`` sampled episodes each (see the module docstring).

    V: episodes from a uniform non-terminal state following pi; Q: exploring starts, then pi. Each
    estimate is the mean of the discounted returns recorded after the first (``first_visit``) or every
    visit; terminal states are never visited and estimate to nan (their value is 0 by definition).
    """
    if n_episodes < 1 or max_steps < 1:
        raise ValueError("n_episodes and max_steps must be >= 1")
    rng = np.random.default_rng(seed)
    n_s, n_a = len(P), len(P[0])
    pi = _check_policy(pi, n_s, n_a)
    v_sums, v_sq, v_n = _visit_returns(P, pi, gamma, n_episodes, rng, False, first_visit, max_steps)
    q_sums, q_sq, q_n = _visit_returns(P, pi, gamma, n_episodes, rng, True, first_visit, max_steps)
    shape = (n_episodes, n_s, n_a)
    return MonteCarloEstimate(v_returns=v_sums, v_squares=v_sq, v_visits=v_n, q_returns=q_sums.reshape(shape), q_squares=q_sq.reshape(shape),
                              q_visits=q_n.reshape(shape), first_visit=first_visit)
