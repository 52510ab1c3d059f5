"""BaselineVarianceReduction: variance of the REINFORCE gradient estimate with and without a baseline.

Problem (known truth): a K-armed bandit with a softmax policy pi = softmax(theta) and rewards
r ~ N(mu_a + c, sigma^2), where the offset c shifts every reward equally. The exact gradient of
J(theta) = sum_k pi_k (mu_k + c) is

    dJ/dtheta_j = pi_j (mu_j - sum_k pi_k mu_k)                        (c drops out)

The estimate from a batch of n samples is g = (1/n) sum_i (r_i - b) grad log pi(a_i), obtained as
minus the autograd gradient of :func:`rlalign.core.losses.policy_gradient_loss` with Psi = r - b
(Williams 1992; seed 002, "reward-to-go minus a baseline"). For a constant baseline b its total
variance tr Cov[g] is known in closed form, with w_k = |e_k - pi|^2 = |grad log pi(k)|^2:

    tr Cov[g] = (1/n) [ sum_k pi_k ((mu_k + c - b)^2 + sigma^2) w_k - |dJ/dtheta|^2 ]

minimised by b* = sum_k pi_k w_k (mu_k + c) / sum_k pi_k w_k (Greensmith et al. 2004). Baselines
compared: none (b = 0), the mean reward b = E_pi[r] (the value V), b*, and the leave-one-out
batch mean (RLOO, :func:`rlalign.core.advantages.rloo_advantages`; not constant, Monte-Carlo only).
Every baseline leaves the mean of g equal to the exact gradient; only the variance changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.func import grad, vmap

from rlalign.core.advantages import rloo_advantages
from rlalign.core.losses import policy_gradient_loss
from rlalign.explore._common import PLOTLY_COLOURS, grid_index, new_figure, panels_layout, save_figure, trace
from rlalign.explore.params import Param, each, number, require, whole

SUMMARY = "REINFORCE gradient variance on a softmax bandit with no baseline, mean reward, optimal b*, and RLOO"

BASELINES = ("none", "mean reward", "optimal b*", "RLOO (leave-one-out)")
THETA = (0.5, 0.0, -0.5, 0.3, -0.2)  # policy logits
MU = (0.2, 0.5, 0.8, 0.3, 0.6)  # mean reward of each arm (before the offset c)
OFFSETS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0)  # reward offsets c compared
COLOURS = ("tab:red", "tab:blue", "tab:green", "tab:purple")

PARAMS = (
    Param("sigma", "reward noise σ", 0.5, 0.0, 2.0, 0.05),
    Param("batch_size", "batch size n", 8, 2, 32, 1, kind="int"),
    Param("n_batches", "Monte-Carlo batches", 2000, 500, 8000, 500, kind="int", size=True),
    Param("seed", "random seed", 0, 0, 50, 1, kind="int"),
    Param("offset", "offset c of the right panel", "2", choices=tuple(f"{c:g}" for c in OFFSETS), kind="choice",
          stage="figure", convert=float),
)
EQUATIONS = (
    ("the REINFORCE estimate with a baseline b (Williams 1992)", r"$\hat{g} = \frac{1}{n}\sum_{i=1}^{n} (r_i - b)\,\nabla_\theta \log \pi_\theta(a_i)$"),
    ("its variance for a constant b", r"$\mathrm{tr\,Cov}[\hat{g}] = \frac{1}{n}\left[\sum_k \pi_k \left((\mu_k + c - b)^2 + \sigma^2\right) w_k - |\nabla J|^2\right],\ w_k = |e_k - \pi|^2$"),
    ("the variance-minimising baseline (Greensmith et al. 2004)", r"$b^* = \frac{\sum_k \pi_k w_k (\mu_k + c)}{\sum_k \pi_k w_k}$"),
)


@dataclass
class BaselineVarianceResult:
    offsets: np.ndarray  # (C,) reward offset c
    baselines: list[str]  # (4,)
    mc_variance: np.ndarray  # (4, C) Monte-Carlo tr Cov[g] over the batches
    exact_variance: np.ndarray  # (4, C) closed form (NaN for RLOO, which is not a constant baseline)
    mc_mean: np.ndarray  # (4, C, K) mean of g over the batches
    mc_std: np.ndarray  # (4, C, K) std of each component of g over the batches
    exact_gradient: np.ndarray  # (K,) dJ/dtheta
    pi: np.ndarray  # (K,)
    mu: np.ndarray  # (K,)
    sigma: float
    batch_size: int
    n_batches: int


def _batch_gradient(theta, actions, psi):
    """-d/dtheta policy_gradient_loss: the REINFORCE estimate of one batch. Shapes: (K,), (n,), (n,) -> (K,)."""

    def loss(th):
        logp = torch.log_softmax(th, -1)[actions]  # (n,)
        return policy_gradient_loss(logp, psi)[0]

    return -grad(loss)(theta)


def compute(
    offsets: tuple[float, ...] = OFFSETS,
    sigma: float = 0.5,
    batch_size: int = 8,
    n_batches: int = 4000,
    seed: int = 0,
) -> BaselineVarianceResult:
    """Monte-Carlo and exact variance of the batch REINFORCE gradient for each baseline and offset."""
    require(
        "baseline-variance",
        offsets=(offsets, each(number()), "a non-empty sequence of finite numbers"),
        sigma=(sigma, number(0), "a number >= 0"),
        batch_size=(batch_size, whole(2), "a whole number >= 2 (the leave-one-out baseline needs two samples)"),
        n_batches=(n_batches, whole(2), "a whole number >= 2"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    gen = torch.Generator().manual_seed(seed)
    theta = torch.tensor(THETA, dtype=torch.float64)  # (K,)
    mu = torch.tensor(MU, dtype=torch.float64)  # (K,)
    K = theta.numel()
    pi = torch.softmax(theta, -1)
    exact_grad = pi * (mu - pi @ mu)  # (K,)
    w = ((torch.eye(K, dtype=torch.float64) - pi) ** 2).sum(-1)  # (K,) |e_k - pi|^2
    batch_grads = vmap(_batch_gradient, in_dims=(None, 0, 0))

    mc_var = np.zeros((len(BASELINES), len(offsets)))
    exact_var = np.full((len(BASELINES), len(offsets)), np.nan)
    mc_mean = np.zeros((len(BASELINES), len(offsets), K))
    mc_std = np.zeros((len(BASELINES), len(offsets), K))
    for j, c in enumerate(offsets):
        actions = torch.multinomial(pi, n_batches * batch_size, replacement=True, generator=gen).view(n_batches, batch_size)
        noise = torch.randn(n_batches, batch_size, generator=gen, dtype=torch.float64)
        rewards = mu[actions] + c + sigma * noise  # (M, n)
        means = mu + c
        b_value = pi @ means
        b_star = (pi * w * means).sum() / (pi * w).sum()
        psis = {
            "none": rewards,
            "mean reward": rewards - b_value,
            "optimal b*": rewards - b_star,
            "RLOO (leave-one-out)": rloo_advantages(rewards.reshape(-1), batch_size).view(n_batches, batch_size),
        }
        constants = {"none": 0.0, "mean reward": b_value, "optimal b*": b_star}
        for i, name in enumerate(BASELINES):
            g = batch_grads(theta, actions, psis[name])  # (M, K)
            mc_var[i, j] = g.var(dim=0).sum().item()
            mc_mean[i, j] = g.mean(0).numpy()
            mc_std[i, j] = g.std(0).numpy()
            if name in constants:
                b = constants[name]
                single = (pi * ((means - b) ** 2 + sigma**2) * w).sum() - exact_grad @ exact_grad
                exact_var[i, j] = (single / batch_size).item()
    return BaselineVarianceResult(
        offsets=np.array(offsets), baselines=list(BASELINES), mc_variance=mc_var, exact_variance=exact_var,
        mc_mean=mc_mean, mc_std=mc_std, exact_gradient=exact_grad.numpy(), pi=pi.numpy(), mu=mu.numpy(),
        sigma=sigma, batch_size=batch_size, n_batches=n_batches,
    )


def plot(result: BaselineVarianceResult, path: str | Path, offset: float = 2.0) -> Path:
    fig, axes = new_figure(2, width=5.6, height=4.8)
    colours = COLOURS
    markers = ("o", "s", "^", "D")
    ax = axes[0]
    for i, name in enumerate(result.baselines):
        ax.plot(result.offsets, result.mc_variance[i], markers[i], color=colours[i], ms=7, mfc="none", label=f"{name} (Monte Carlo)")
        if np.isfinite(result.exact_variance[i]).all():
            ax.plot(result.offsets, result.exact_variance[i], "-", color=colours[i], lw=1.2)
    ax.plot([], [], "-", color="0.3", label="closed form (constant baselines)")
    ax.set_yscale("log")
    ax.set_xlabel("reward offset c added to every arm (reward units)")
    ax.set_ylabel("total variance  tr Cov[ĝ]  (reward²)")
    ax.set_title(f"Variance of the REINFORCE gradient (batch n={result.batch_size})")
    ax.legend(fontsize=8)

    ax = axes[1]
    c_index = grid_index(result.offsets, offset, "offset")
    K = result.exact_gradient.size
    x = np.arange(K)
    width = 0.18
    for i, name in enumerate(result.baselines):
        ax.errorbar(x + (i - 1.5) * width, result.mc_mean[i, c_index], yerr=result.mc_std[i, c_index], fmt=markers[i],
                    color=colours[i], capsize=3, label=f"{name}: mean ± std")
    ax.plot(x, result.exact_gradient, "k_", ms=28, mew=2.5, label="exact gradient dJ/dθ")
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xticks(x, [f"θ{k + 1}\nπ={p:.2f}\nμ={m:.1f}" for k, (p, m) in enumerate(zip(result.pi, result.mu))])
    ax.set_xlabel("policy logit θ_k of arm k (π_k, μ_k)")
    ax.set_ylabel("gradient estimate ĝ_k  (reward units)")
    ax.set_title(f"Same mean, different spread (offset c={result.offsets[c_index]:g}, {result.n_batches} batches)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower right", ncols=3, fontsize=8, title="right panel")
    fig.suptitle(f"Baseline variance reduction on a {K}-armed softmax bandit, rewards N(μ_a + c, {result.sigma:g}²)")
    return save_figure(fig, path)


def figure(result: BaselineVarianceResult, offset: float = 2.0) -> dict:
    """The live page's figure: variance against the offset c, and the estimates' spread at ``offset``."""
    c_index = grid_index(result.offsets, offset, "offset")
    symbols = ("circle-open", "square-open", "triangle-up-open", "diamond-open")
    data = []
    for i, name in enumerate(result.baselines):
        data.append(trace(result.offsets, result.mc_variance[i], f"{name} (Monte Carlo)", mode="markers", colour=COLOURS[i], symbol=symbols[i]))
        if np.isfinite(result.exact_variance[i]).all():
            data.append(trace(result.offsets, result.exact_variance[i], f"{name} (closed form)", colour=COLOURS[i], width=1.2))
    K = result.exact_gradient.size
    arms = [f"θ{k + 1} (π={p:.2f}, μ={m:.1f})" for k, (p, m) in enumerate(zip(result.pi, result.mu))]
    x = np.arange(K)
    for i, name in enumerate(result.baselines):
        data.append({"type": "scatter", "mode": "markers", "x": x + (i - 1.5) * 0.18, "y": result.mc_mean[i, c_index],
                     "name": f"{name}: mean ± std", "xaxis": "x2", "yaxis": "y2",
                     "marker": {"color": PLOTLY_COLOURS[COLOURS[i]], "size": 8, "symbol": symbols[i]},
                     "error_y": {"type": "data", "array": result.mc_std[i, c_index], "visible": True, "color": PLOTLY_COLOURS[COLOURS[i]]}})
    data.append(trace(x, result.exact_gradient, "exact gradient dJ/dθ", panel=2, mode="markers",
                      marker={"size": 40, "color": "#000", "symbol": "line-ew-open", "line": {"width": 3, "color": "#000"}}))
    layout = panels_layout(f"Baseline variance reduction on a {K}-armed softmax bandit, rewards N(μ_a + c, {result.sigma:g}²)", [
        {"title": f"Variance of the REINFORCE gradient (batch n = {result.batch_size})", "x": "reward offset c added to every arm",
         "y": "total variance tr Cov[ĝ] (reward²)", "ylog": True},
        {"title": f"Same mean, different spread (c = {result.offsets[c_index]:g}, {result.n_batches} batches)",
         "x": "policy logit θ_k of arm k", "y": "gradient estimate ĝ_k (reward units)"},
    ])
    layout["xaxis2"].update(tickvals=x.tolist(), ticktext=arms)
    return {"data": data, "layout": layout}
