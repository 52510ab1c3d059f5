"""PPO's surrogates along the line from theta_old to theta_new (Schulman et al. 2017, figure 2; seed 002).

A softmax policy pi_theta(a | s) over K actions in each of S states (theta: (S, K) logits) draws N
(state, action) samples from pi_old, each with an advantage A_t. theta_new is the policy after PPO's
update: ``epochs`` steps of gradient ascent on L^CLIP from theta_old. Along
theta(alpha) = theta_old + alpha (theta_new - theta_old), with r_t = pi_theta(a_t | s_t) / pi_old(a_t | s_t):

    E_t[KL_t]           mean exact KL(pi_old(. | s_t) || pi_theta(. | s_t))     rlalign.core.kl.categorical_kl
    L^CPI               E_t[r_t A_t]   (TRPO's surrogate, "conservative policy iteration")
    E_t[clip(r_t) A_t]  the clipped term alone
    L^CLIP              E_t[min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)]   = -rlalign.core.losses.clipped_surrogate_loss

Known truth: at alpha = 0 every ratio is 1, the KL is 0 and the three surrogates equal E_t[A_t], with the
same slope in alpha; L^CLIP <= L^CPI everywhere (a pessimistic bound: the clipped objective stops
rewarding a ratio past the clip but keeps every penalty), so L^CLIP peaks near the update while L^CPI
keeps rising along the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.func import vmap

from rlalign.core.kl import categorical_kl
from rlalign.core.losses import clipped_surrogate_loss
from rlalign.explore._common import new_figure, panels_layout, save_figure, trace, vline
from rlalign.explore.params import Param, number, require, whole

SUMMARY = "PPO paper fig. 2: KL, L^CPI, the clipped term and L^CLIP along the line from theta_old to the PPO update and beyond"

PARAMS = (
    Param("eps", "clip range ε", 0.2, 0.05, 0.5, 0.01, help="typical 0.1-0.2"),
    Param("lr", "learning rate of the update (Adam)", 0.02, 0.001, 0.05, 0.001),
    Param("epochs", "update epochs on the samples", 50, 1, 200, 1, kind="int", size=True),
    Param("seed", "random seed (policy, samples)", 0, 0, 50, 1, kind="int"),
)
EQUATIONS = (
    ("TRPO's surrogate (conservative policy iteration)", r"$L^{CPI}(\theta) = \hat{E}_t\left[r_t(\theta)\,\hat{A}_t\right]$"),
    ("PPO's clipped objective (Schulman et al. 2017, eq. 7)",
     r"$L^{CLIP}(\theta) = \hat{E}_t\left[\min\left(r_t\hat{A}_t,\ \mathrm{clip}(r_t, 1-\epsilon, 1+\epsilon)\hat{A}_t\right)\right]$"),
    ("the line the figure follows", r"$\theta(\alpha) = \theta_{old} + \alpha\,(\theta_{new} - \theta_{old})$"),
)


@dataclass
class PPOSurrogatesResult:
    alpha: np.ndarray  # (L,) interpolation factor: 0 = theta_old, 1 = theta_new (the PPO update)
    kl: np.ndarray  # (L,) E_t KL(pi_old || pi_theta(alpha))
    cpi: np.ndarray  # (L,) L^CPI
    clipped_term: np.ndarray  # (L,) E_t[clip(r) A]
    clip_objective: np.ndarray  # (L,) L^CLIP
    clip_frac: np.ndarray  # (L,) share of samples whose clip is active
    advantage_mean: float
    eps: float


def _policy_samples(n_states: int, n_actions: int, n_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """theta_old (S, K), the sampled states (N,) and actions (N,) drawn from pi_old, their advantages (N,)."""
    g = torch.Generator().manual_seed(seed)
    theta_old = torch.randn(n_states, n_actions, generator=g, dtype=torch.float64)
    q_values = torch.randn(n_states, n_actions, generator=g, dtype=torch.float64)
    states = torch.randint(n_states, (n_samples,), generator=g)
    actions = torch.multinomial(torch.softmax(theta_old[states], -1), 1, generator=g).squeeze(-1)
    pi_old = torch.softmax(theta_old, -1)
    advantages = q_values[states, actions] - (pi_old * q_values).sum(-1)[states]  # A = Q(s, a) - V(s)
    return theta_old, states, actions, (advantages - advantages.mean()) / advantages.std()


def _surrogates(theta: torch.Tensor, theta_old: torch.Tensor, states: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor, eps: float):
    """(L^CLIP loss with grad, ClipStats, log-ratios (N,)) of ``theta`` on the samples."""
    logp = torch.log_softmax(theta[states], -1).gather(-1, actions[:, None]).squeeze(-1)  # (N,)
    old_logp = torch.log_softmax(theta_old[states], -1).gather(-1, actions[:, None]).squeeze(-1)  # (N,)
    loss, stats = clipped_surrogate_loss(logp, old_logp, advantages, eps_low=eps)
    return loss, stats, logp - old_logp


def compute(
    eps: float = 0.2, n_states: int = 8, n_actions: int = 4, n_samples: int = 512, epochs: int = 100, lr: float = 0.01,
    alpha_max: float = 2.5, n_points: int = 101, seed: int = 0,
) -> PPOSurrogatesResult:
    """theta_new by ``epochs`` full-batch Adam steps on L^CLIP, then the four curves on ``n_points`` alphas in [0, alpha_max]."""
    require(
        "ppo-surrogates",
        eps=(eps, number(0, 1, above=True), "a number in (0, 1]"),
        n_states=(n_states, whole(1), "a whole number >= 1"),
        n_actions=(n_actions, whole(2), "a whole number >= 2"),
        n_samples=(n_samples, whole(1), "a whole number >= 1"),
        epochs=(epochs, whole(1), "a whole number >= 1"),
        lr=(lr, number(0, above=True), "a number > 0"),
        alpha_max=(alpha_max, number(0, above=True), "a number > 0"),
        n_points=(n_points, whole(2), "a whole number >= 2"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    theta_old, states, actions, advantages = _policy_samples(n_states, n_actions, n_samples, seed)
    theta = theta_old.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    for _ in range(epochs):  # PPO's update: several epochs on the same samples
        loss, _, _ = _surrogates(theta, theta_old, states, actions, advantages, eps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    direction = theta.detach() - theta_old  # (S, K)
    alpha = np.linspace(0.0, alpha_max, n_points)

    def along(a: torch.Tensor) -> torch.Tensor:  # the five curves at one alpha: (5,)
        theta_a = theta_old + a * direction
        loss, stats, log_ratio = _surrogates(theta_a, theta_old, states, actions, advantages, eps)
        ratio = log_ratio.exp()
        return torch.stack([
            categorical_kl(theta_old[states], theta_a[states]).mean(),
            (ratio * advantages).mean(),
            (ratio.clamp(1 - eps, 1 + eps) * advantages).mean(),
            -loss,
            stats.clip_frac,
        ])

    with torch.no_grad():
        curves = vmap(along)(torch.tensor(alpha, dtype=torch.float64)).T.numpy()  # (5, L): every alpha at once
    return PPOSurrogatesResult(alpha, *curves, advantage_mean=advantages.mean().item(), eps=eps)


def plot(result: PPOSurrogatesResult, path: str | Path) -> Path:
    fig, (ax,) = new_figure(1, width=7.0, height=4.6)
    ax.plot(result.alpha, result.kl, color="tab:purple", lw=1.8, label="E_t[KL(π_old ‖ π_θ)]")
    ax.plot(result.alpha, result.cpi, color="tab:blue", lw=1.8, label="L^CPI = E_t[r_t A_t]")
    ax.plot(result.alpha, result.clip_objective, color="tab:red", lw=2.6, label="L^CLIP = E_t[min(r_t A_t, clip(r_t) A_t)]")
    ax.plot(result.alpha, result.clipped_term, color="tab:orange", lw=1.4, ls="--", label="E_t[clip(r_t, 1-ε, 1+ε) A_t]")
    ax.axvline(1.0, color="0.4", lw=0.9, ls=":", label="the PPO update (α = 1)")
    ax.set_xlabel("linear interpolation factor α  (θ = θ_old + α (θ_new − θ_old))")
    ax.set_ylabel("objective / KL  (units of A; nats)")
    ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"PPO surrogates from θ_old along the PPO update (ε = {result.eps:g})")
    return save_figure(fig, path)


def figure(result: PPOSurrogatesResult) -> dict:
    """The live page's figure: the four curves of :func:`plot` along alpha."""
    a = result.alpha
    data = [
        trace(a, result.kl, "E_t[KL(π_old ‖ π_θ)]", colour="tab:purple"),
        trace(a, result.cpi, "L^CPI = E_t[r_t A_t]", colour="tab:blue"),
        trace(a, result.clip_objective, "L^CLIP = E_t[min(r_t A_t, clip(r_t) A_t)]", colour="tab:red", width=3.5),
        trace(a, result.clipped_term, "E_t[clip(r_t, 1−ε, 1+ε) A_t]", colour="tab:orange", dash="dash", width=1.6),
    ]
    layout = panels_layout(f"PPO surrogates from θ_old along the PPO update (ε = {result.eps:g}; dotted: the update, α = 1)", [
        {"title": "", "x": "interpolation factor α  (θ = θ_old + α (θ_new − θ_old))", "y": "objective / KL  (units of A; nats)"}])
    layout["shapes"] = [vline(1.0)]
    return {"data": data, "layout": layout}
