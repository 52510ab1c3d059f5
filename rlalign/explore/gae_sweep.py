"""GAELambdaSweep (and the seeds' GAEExplorer): bias and variance of the GAE advantage against lambda.

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),      A_t^GAE(lambda) = sum_l (gamma lambda)^l delta_{t+l}

Schulman et al. 2016, eq. 16; seeds 000/001, "GAE". Advantages come from
:func:`rlalign.core.advantages.gae` on Monte-Carlo episodes.

Problem (known truth): a chain of N states walked left to right until the terminal state N. Each
step the agent "walks" (s -> s+1, mean reward -0.1) or "runs" (s -> s+1 or s+2 with probability
1/2 each, mean reward -0.3), chosen with probability 1/2; entering the terminal state pays +2;
every reward carries N(0, sigma^2) noise. The true values are exact:
V = (I - gamma P_pi)^-1 R_pi and Q(s, a) = R(s, a) + gamma sum_s' P(s'|s, a) V(s').

The estimator is judged against what it estimates given the critic V_hat it is handed:
Q(s_t, a_t) - V_hat(s_t) (the policy gradient only sees the action-dependent part; V_hat(s_t) is a
known constant at time t). With the exact critic this is the true advantage and every lambda is
unbiased; the variance sum_l (gamma lambda)^(2l) Var[delta_{t+l}] grows with lambda (the deltas
are uncorrelated). With a biased, noisy critic, lambda = 1 (Monte-Carlo return minus V_hat) stays
unbiased while lambda = 0 (the TD residual) inherits gamma E[V_hat - V](s_{t+1}): the trade-off.

Bias^2 and variance are per (state, action) pair, averaged with the visit counts as weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlalign.core.advantages import gae
from rlalign.explore._common import grid_index, new_figure, panels_layout, save_figure, trace, vline
from rlalign.explore.params import Param, each, number, require, whole

SUMMARY = "bias^2, variance and MSE of the GAE advantage vs lambda on a chain MDP with exact values (also GAEExplorer)"

WALK_REWARD, RUN_REWARD, GOAL_REWARD = -0.1, -0.3, 2.0

PARAMS = (
    Param("lam", "GAE λ (marked)", 0.95, 0.0, 1.0, 0.05, stage="figure", help="typical 0.95"),
    Param("gamma", "discount γ", 0.95, 0.8, 1.0, 0.01, help="typical 0.99-1.0"),
    Param("sigma", "reward noise σ", 1.0, 0.0, 2.0, 0.1),
    Param("critic_bias", "critic bias E[V̂ − V]", 1.5, -2.0, 2.0, 0.1),
    Param("critic_noise", "critic noise (std of V̂ − V)", 0.5, 0.0, 1.5, 0.05),
    Param("n_episodes", "Monte-Carlo episodes", 10000, 2000, 40000, 2000, kind="int", size=True),
    Param("seed", "random seed", 0, 0, 50, 1, kind="int"),
)
EQUATIONS = (
    ("the TD residual", r"$\delta_t = r_t + \gamma V(s_{t+1}) - V(s_t)$"),
    ("GAE (Schulman et al. 2016, eq. 16)", r"$\hat{A}_t^{GAE(\gamma,\lambda)} = \sum_{l=0}^{\infty} (\gamma\lambda)^l\,\delta_{t+l}$"),
    ("the error it is judged by", r"$\mathrm{MSE} = \mathrm{bias}^2 + \mathrm{variance}$ of $\hat{A}_t - (Q(s_t, a_t) - \hat{V}(s_t))$"),
)


@dataclass
class GAESweepResult:
    lambdas: np.ndarray  # (L,)
    critics: list[str]  # ("exact V", "biased, noisy V_hat")
    bias_sq: np.ndarray  # (2, L) visit-weighted mean of bias(s, a)^2
    bias_se: np.ndarray  # (2, L) largest standard error of a per-pair bias
    max_abs_bias_z: np.ndarray  # (2, L) max over pairs of |bias(s, a)| / its standard error
    variance: np.ndarray  # (2, L) visit-weighted mean of Var[A_hat | s, a]
    mse: np.ndarray  # (2, L) mean (A_hat - target)^2
    v_true: np.ndarray  # (N,)
    v_hat: np.ndarray  # (N,)
    q_true: np.ndarray  # (N, 2)
    gamma: float
    sigma: float
    n_episodes: int


def chain_mdp(n_states: int, gamma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Transition tensor P (N, 2, N+1), mean rewards R (N, 2), and exact V (N,), Q (N, 2) under pi = (1/2, 1/2)."""
    N = n_states
    P = np.zeros((N, 2, N + 1))
    for s in range(N):
        P[s, 0, s + 1] = 1.0
        P[s, 1, min(s + 1, N)] += 0.5
        P[s, 1, min(s + 2, N)] += 0.5
    R = np.array([WALK_REWARD, RUN_REWARD])[None, :] + GOAL_REWARD * P[:, :, N]  # (N, 2)
    P_pi = P.mean(1)[:, :N]  # (N, N), pi uniform
    V = np.linalg.solve(np.eye(N) - gamma * P_pi, R.mean(1))
    Q = R + gamma * P[:, :, :N] @ V
    return P, R, V, Q


def _rollouts(P: np.ndarray, n_episodes: int, sigma: float, gen: np.random.Generator):
    """Episodes from state 0 under the uniform policy, time-major (T, M), padded after termination."""
    N = P.shape[0]
    M = n_episodes
    states = np.zeros((N, M), dtype=np.int64)
    actions = np.zeros((N, M), dtype=np.int64)
    next_states = np.full((N, M), N, dtype=np.int64)
    rewards = np.zeros((N, M))
    valid = np.zeros((N, M), dtype=bool)
    s = np.zeros(M, dtype=np.int64)
    for t in range(N):  # every step moves at least one state right, so N steps always suffice
        alive = s < N
        a = gen.integers(0, 2, size=M)
        cum = P[np.minimum(s, N - 1), a].cumsum(-1)  # (M, N+1)
        s_next = np.where(alive, (gen.random((M, 1)) > cum).sum(-1), N)
        r = np.where(a == 0, WALK_REWARD, RUN_REWARD) + GOAL_REWARD * (s_next == N) + sigma * gen.standard_normal(M)
        states[t], actions[t], next_states[t], valid[t] = np.minimum(s, N - 1), a, s_next, alive
        rewards[t] = np.where(alive, r, 0.0)
        s = s_next
    return states, actions, next_states, rewards, valid


def compute(
    lambdas: tuple[float, ...] = tuple(np.round(np.linspace(0.0, 1.0, 21), 3)),
    n_states: int = 8,
    gamma: float = 0.95,
    sigma: float = 1.0,
    critic_bias: float = 1.5,
    critic_noise: float = 0.5,
    n_episodes: int = 20000,
    seed: int = 0,
) -> GAESweepResult:
    """Bias^2, variance and MSE of core's GAE at each lambda, for the exact critic and a biased noisy one."""
    require(
        "gae-lambda-sweep",
        lambdas=(lambdas, each(number(0, 1)), "a non-empty sequence of numbers in [0, 1]"),
        n_states=(n_states, whole(1), "a whole number >= 1"),
        gamma=(gamma, number(0, 1), "a number in [0, 1]"),
        sigma=(sigma, number(0), "a number >= 0"),
        critic_bias=(critic_bias, number(), "a finite number"),
        critic_noise=(critic_noise, number(0), "a number >= 0"),
        n_episodes=(n_episodes, whole(2), "a whole number >= 2"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    gen = np.random.default_rng(seed)
    P, _, V, Q = chain_mdp(n_states, gamma)
    V_hat = V + critic_bias + critic_noise * gen.standard_normal(n_states)
    states, actions, next_states, rewards, valid = _rollouts(P, n_episodes, sigma, gen)
    pair = (states * 2 + actions)[valid]  # (n,) flat (s, a) index of every real step
    n_pairs = 2 * n_states
    counts = np.bincount(pair, minlength=n_pairs).astype(float)
    seen = counts > 1
    critics = {"exact V": V, "biased, noisy V̂": V_hat}
    L = len(lambdas)
    out = {k: np.zeros((2, L)) for k in ("bias_sq", "bias_se", "max_z", "variance", "mse")}
    t = torch.as_tensor
    for c, critic in enumerate(critics.values()):
        v_ext = np.append(critic, 0.0)  # V(terminal) = 0
        values = t(np.where(valid, v_ext[states], 0.0))  # (T, M)
        next_values = t(np.where(valid, v_ext[next_states], 0.0))
        terminated = t(((next_states == n_states) | ~valid).astype(np.float64))
        target = (Q[states, actions] - critic[states])[valid]  # (n,) Q(s,a) - V_critic(s)
        for j, lam in enumerate(lambdas):
            adv, _ = gae(t(rewards), values, next_values, terminated, terminated, gamma, float(lam))
            err = adv.numpy()[valid] - target  # (n,)
            mean = np.bincount(pair, err, n_pairs)[seen] / counts[seen]
            sq = np.bincount(pair, err**2, n_pairs)[seen] / counts[seen]
            var = (sq - mean**2) * counts[seen] / (counts[seen] - 1)  # unbiased Var[A_hat | s, a]
            se = np.sqrt(var / counts[seen])
            w = counts[seen] / counts[seen].sum()
            out["bias_sq"][c, j] = w @ mean**2
            out["bias_se"][c, j] = se.max()
            out["max_z"][c, j] = np.max(np.abs(mean) / se)
            out["variance"][c, j] = w @ var
            out["mse"][c, j] = np.mean(err**2)
    return GAESweepResult(
        lambdas=np.array(lambdas), critics=list(critics), bias_sq=out["bias_sq"], bias_se=out["bias_se"],
        max_abs_bias_z=out["max_z"], variance=out["variance"], mse=out["mse"], v_true=V, v_hat=V_hat, q_true=Q,
        gamma=gamma, sigma=sigma, n_episodes=n_episodes,
    )


def plot(result: GAESweepResult, path: str | Path, lam: float | None = None) -> Path:
    """Bias², variance and MSE against lambda for both critics; ``lam`` (one of the computed lambdas) marked."""
    marked = None if lam is None else grid_index(result.lambdas, lam, "lambda")
    fig, axes = new_figure(2, width=5.4, height=4.3)
    lam = result.lambdas
    for ax, c in zip(axes, (1, 0)):
        ax.plot(lam, result.bias_sq[c], "o-", color="tab:red", ms=4, label="bias²  (visit-weighted)")
        ax.plot(lam, result.variance[c], "s-", color="tab:blue", ms=4, label="variance")
        ax.plot(lam, result.mse[c], "k--", lw=1.5, label="MSE = bias² + variance")
        best = int(np.argmin(result.mse[c]))
        ax.plot(lam[best], result.mse[c, best], "k*", ms=14, label=f"lowest MSE at λ={lam[best]:g}")
        if marked is not None:
            ax.axvline(lam[marked], color="0.4", ls=":", lw=1.2, label=f"λ={lam[marked]:g}: MSE {result.mse[c, marked]:.3g}")
        ax.set_xlabel("GAE λ   (0: TD residual δ_t;  1: Monte-Carlo return − V_critic(s_t))")
        ax.set_ylabel("error of Â_t against Q(s_t,a_t) − V_critic(s_t)  (reward²)")
        ax.set_title(f"critic: {result.critics[c]}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper center")
    axes[0].set_title(f"critic: V̂ = V + bias + noise  (mean V̂ − V = {np.mean(result.v_hat - result.v_true):.2f})")
    axes[1].set_title("critic: exact V (every λ unbiased)")
    n = result.v_true.size
    fig.suptitle(f"GAE bias–variance trade-off on an {n}-state chain (γ={result.gamma:g}, reward noise σ={result.sigma:g}, {result.n_episodes} episodes)")
    return save_figure(fig, path)


def figure(result: GAESweepResult, lam: float = 0.95) -> dict:
    """The live page's figure: bias², variance and MSE against lambda for both critics, ``lam`` marked."""
    j = grid_index(result.lambdas, lam, "lambda")
    data, panels = [], []
    for p, c in enumerate((1, 0), start=1):
        best = int(np.argmin(result.mse[c]))
        first = p == 1
        data += [
            trace(result.lambdas, result.bias_sq[c], "bias² (visit-weighted)", panel=p, mode="lines+markers", colour="tab:red", legend=first),
            trace(result.lambdas, result.variance[c], "variance", panel=p, mode="lines+markers", colour="tab:blue", symbol="square", legend=first),
            trace(result.lambdas, result.mse[c], "MSE = bias² + variance", panel=p, colour="k", dash="dash", legend=first),
            trace([result.lambdas[best]], [result.mse[c, best]], "lowest MSE", panel=p, mode="markers", colour="k", symbol="star",
                  legend=first, marker={"size": 16, "color": "#000", "symbol": "star"}),
        ]
        critic = "exact V (every λ unbiased)" if c == 0 else f"V̂ = V + bias + noise (mean V̂ − V = {np.mean(result.v_hat - result.v_true):.2f})"
        panels.append({"title": f"critic: {critic}<br>λ = {result.lambdas[j]:g}: bias² {result.bias_sq[c, j]:.3g}, "
                                f"variance {result.variance[c, j]:.3g}, MSE {result.mse[c, j]:.3g}",
                       "x": "GAE λ (0: TD residual δ_t; 1: Monte-Carlo return − V̂(s_t))", "y": "error of Â_t (reward²)"})
    n = result.v_true.size
    layout = panels_layout(f"GAE bias–variance trade-off on an {n}-state chain (γ = {result.gamma:g}, reward noise σ = {result.sigma:g}, "
                           f"{result.n_episodes} episodes)", panels)
    layout["shapes"] = [vline(result.lambdas[j], panel=1), vline(result.lambdas[j], panel=2)]
    return {"data": data, "layout": layout}
