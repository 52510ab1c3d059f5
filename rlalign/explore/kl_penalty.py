"""KLPenaltyTradeoff: reward against KL to the reference over beta, found by gradient ascent vs closed form.

Problem (known truth): a K-armed bandit with deterministic rewards r and a reference policy ref
that prefers the low-reward arms. The KL-regularised objective of RLHF

    max_pi  E_pi[r] - beta KL(pi || ref)     has the exact maximiser   pi* = ref exp(r / beta) / Z

(Ziegler et al. 2019; Rafailov et al. 2023, eq. 4; seeds 000/003, "KL penalty"). Two ways the
field applies the penalty are run by gradient ascent (Adam on softmax logits, started at ref), with
exact expectations over the K arms (the loss ``mask`` holds pi(a) as weights, so every masked
mean is E_pi):

- **k1 in the reward** (PPO/RLHF shaping): advantage r - beta k1, k1 = log pi - log ref, through
  :func:`rlalign.core.losses.policy_gradient_loss`. Its expected gradient is exactly
  grad(E[r] - beta KL(pi||ref)), so it converges to pi*.
- **k3 in the loss** (GRPO, Shao et al. 2024 eq. 3): policy_gradient_loss with advantage r plus
  beta :func:`rlalign.core.losses.kl_penalty_loss` (k3). Differentiated through log pi only, its
  expected gradient is E_pi[(1 - ref/pi) grad log pi] = grad KL(ref || pi): the *forward* KL. It
  converges to the maximiser of E[r] - beta KL(ref||pi), pi_k = beta ref_k / (lam - r_k) with lam
  fixed by sum_k pi_k = 1 (found by bisection) — not to pi*.

KL values are :func:`rlalign.core.kl.categorical_kl`. (k1 put in the loss has zero expected
gradient, E_pi[grad log pi] = 0, and so regularises nothing; it is not drawn.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlalign.core.kl import categorical_kl, kl_k1
from rlalign.core.losses import kl_penalty_loss, policy_gradient_loss
from rlalign.explore._common import PLOTLY_COLOURS, grid_index, new_figure, panels_layout, save_figure, trace
from rlalign.explore.params import Param, each, number, require, whole

SUMMARY = "reward vs KL(pi||ref) over beta on a bandit: k1-in-reward and k3-in-loss ascent vs the closed form"

REWARD = (0.0, 0.25, 0.5, 0.75, 1.0)
REF_LOGITS = (1.0, 0.5, 0.0, -0.5, -1.0)
BETAS = (0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.6, 2.5, 4.0)

# the live page runs fewer, larger steps than the CLI (total variation to the optimum stays below 0.02)
PARAMS = (
    Param("beta", "KL coefficient β (policies shown)", "0.4", choices=tuple(f"{b:g}" for b in BETAS), kind="choice",
          stage="figure", convert=float),
    Param("n_steps", "ascent steps (Adam, cosine-annealed)", 100, 50, 1000, 50, kind="int", size=True),
    Param("lr", "learning rate", 0.3, 0.05, 0.5, 0.05),
)
EQUATIONS = (
    ("the KL-regularised objective of RLHF and its optimum (Rafailov et al. 2023, eq. 4)",
     r"$\max_\pi\ E_{\pi}[r] - \beta\,\mathrm{KL}(\pi\,\|\,\pi_{ref}),\qquad \pi^*(a) = \frac{\pi_{ref}(a)\,e^{r(a)/\beta}}{Z}$"),
    ("k1 in the reward (PPO) and k3 in the loss (GRPO, Shao et al. 2024)",
     r"$A = r - \beta \log\frac{\pi}{\pi_{ref}},\qquad k_3 = \frac{\pi_{ref}}{\pi} - \log\frac{\pi_{ref}}{\pi} - 1$"),
)


@dataclass
class KLPenaltyResult:
    betas: np.ndarray  # (B,)
    reward: np.ndarray  # (K,)
    ref: np.ndarray  # (K,)
    pi_closed: np.ndarray  # (B, K) ref exp(r/beta) / Z
    pi_k1_reward: np.ndarray  # (B, K) found with k1 in the reward
    pi_k3_loss: np.ndarray  # (B, K) found with k3 in the loss
    pi_forward_closed: np.ndarray  # (B, K) maximiser of E[r] - beta KL(ref || pi)
    tv_k1_reward: np.ndarray  # (B,) total variation to pi_closed
    tv_k3_loss: np.ndarray  # (B,) total variation to pi_closed
    tv_k3_loss_forward: np.ndarray  # (B,) total variation to pi_forward_closed
    frontier_betas: np.ndarray  # (F,) dense grid for the closed-form curves
    frontier_kl: np.ndarray  # (F,) KL(pi*||ref)
    frontier_reward: np.ndarray  # (F,) E_pi*[r]
    forward_kl: np.ndarray  # (F,) KL(pi_fwd||ref) of the forward-KL optimum
    forward_reward: np.ndarray  # (F,)
    kl: dict[str, np.ndarray]  # method -> (B,) KL(pi||ref) of the found policies
    expected_reward: dict[str, np.ndarray]  # method -> (B,) E_pi[r]
    n_steps: int


def closed_form(reward: torch.Tensor, ref_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """pi* = softmax(log ref + r / beta), the maximiser of E[r] - beta KL(pi||ref). Shape: (K,)."""
    return torch.softmax(torch.log_softmax(ref_logits, -1) + reward / beta, -1)


def forward_kl_optimum(reward: torch.Tensor, ref: torch.Tensor, beta: float | torch.Tensor, iters: int = 200) -> torch.Tensor:
    """Maximiser of E_pi[r] - beta KL(ref||pi): pi_k = beta ref_k / (lam - r_k), sum = 1, by bisection on lam.

    ``beta`` a float gives (K,); a (B,) tensor of betas gives (B, K), bisected together.
    """
    betas = torch.as_tensor(beta, dtype=reward.dtype).reshape(-1, 1)  # (B, 1)
    lo = reward.max().expand_as(betas).clone()  # total mass > 1 just above max r, <= 1 at max r + beta
    hi = lo + betas
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        above = (betas * ref / (mid - reward)).sum(-1, keepdim=True) > 1.0  # (B, 1)
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    pi = betas * ref / (hi - reward)  # (B, K)
    pi = pi / pi.sum(-1, keepdim=True)
    return pi[0] if not torch.is_tensor(beta) or beta.dim() == 0 else pi


def _ascend(reward, ref_logits, betas, n_steps: int, lr: float) -> dict[str, torch.Tensor]:
    """Adam on one row of logits per beta and method (rows independent); returns each method's policies (B, K).

    Both methods run in one loop: rows 0..B-1 put k1 in the reward, rows B..2B-1 put k3 in the loss.
    The two losses touch disjoint rows and Adam is per-parameter, so each row moves exactly as it
    would alone.
    """
    B = betas.numel()
    ref_logp = torch.log_softmax(ref_logits, -1).expand(B, -1)  # (B, K)
    theta = ref_logits.repeat(2 * B, 1).clone().requires_grad_(True)  # (2B, K), start at ref
    opt = torch.optim.Adam([theta], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, n_steps)
    rewards = reward.expand(B, -1)  # (B, K)
    k3_mask_scale = (betas / betas.mean())[:, None]  # (B, 1)
    for _ in range(n_steps):
        logp = torch.log_softmax(theta, -1)  # (2B, K)
        weights = logp.detach().exp()  # pi(a): the masked means below are exact expectations E_pi
        logp_k1, logp_k3 = logp[:B], logp[B:]
        # k1 in the reward: advantage r - beta k1
        advantages = rewards - betas[:, None] * kl_k1(logp_k1, ref_logp).detach()
        k1_loss, _ = policy_gradient_loss(logp_k1, advantages, mask=weights[:B])
        # k3 in the loss: mask = (beta_i / mean beta) pi sums to B, so the masked mean is sum_i beta_i E_i[k3] / sum_i beta_i;
        # times sum(beta) / B it is (1/B) sum_i beta_i E_i[k3], the same 1/B per row as the pg term
        pg, _ = policy_gradient_loss(logp_k3, rewards, mask=weights[B:])
        kl, _ = kl_penalty_loss(logp_k3, ref_logp, mask=k3_mask_scale * weights[B:], estimator="k3")
        loss = k1_loss + pg + kl * betas.sum() / B
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    policies = torch.softmax(theta.detach(), -1)
    return {"k1 in reward": policies[:B], "k3 in loss": policies[B:]}


def compute(
    betas: tuple[float, ...] = BETAS,
    n_steps: int = 800,
    lr: float = 0.2,
) -> KLPenaltyResult:
    """Gradient-ascent policies for each beta and method, the two closed forms, and their reward/KL."""
    require(
        "kl-penalty-tradeoff",
        betas=(betas, each(number(0, above=True)), "a non-empty sequence of numbers > 0"),
        n_steps=(n_steps, whole(1), "a whole number >= 1"),
        lr=(lr, number(0, above=True), "a number > 0"),
    )
    reward = torch.tensor(REWARD, dtype=torch.float64)
    ref_logits = torch.tensor(REF_LOGITS, dtype=torch.float64)
    ref = torch.softmax(ref_logits, -1)
    beta_t = torch.tensor(betas, dtype=torch.float64)
    found = _ascend(reward, ref_logits, beta_t, n_steps, lr)
    pi_closed = torch.stack([closed_form(reward, ref_logits, b) for b in betas])  # (B, K)
    pi_fwd = forward_kl_optimum(reward, ref, beta_t)  # (B, K)

    def kl_to_ref(pi):  # KL(pi || ref) with core's exact categorical KL
        return categorical_kl(torch.log(pi), ref_logits.expand_as(pi)).numpy()

    def tv(p, q):
        return 0.5 * (p - q).abs().sum(-1).numpy()

    dense = np.logspace(-1.3, 1.0, 120)
    frontier = torch.stack([closed_form(reward, ref_logits, b) for b in dense])
    forward = forward_kl_optimum(reward, ref, torch.tensor(dense, dtype=torch.float64))
    return KLPenaltyResult(
        betas=np.array(betas), reward=reward.numpy(), ref=ref.numpy(), pi_closed=pi_closed.numpy(),
        pi_k1_reward=found["k1 in reward"].numpy(), pi_k3_loss=found["k3 in loss"].numpy(), pi_forward_closed=pi_fwd.numpy(),
        tv_k1_reward=tv(found["k1 in reward"], pi_closed), tv_k3_loss=tv(found["k3 in loss"], pi_closed),
        tv_k3_loss_forward=tv(found["k3 in loss"], pi_fwd),
        frontier_betas=dense, frontier_kl=kl_to_ref(frontier), frontier_reward=(frontier @ reward).numpy(),
        forward_kl=kl_to_ref(forward), forward_reward=(forward @ reward).numpy(),
        kl={m: kl_to_ref(p) for m, p in found.items()}, expected_reward={m: (p @ reward).numpy() for m, p in found.items()},
        n_steps=n_steps,
    )


def plot(result: KLPenaltyResult, path: str | Path, beta: float = 0.4) -> Path:
    fig, axes = new_figure(2, width=5.6, height=4.4)
    ax = axes[0]
    ax.plot(result.frontier_kl, result.frontier_reward, "k-", lw=2, label="closed form π* ∝ ref·exp(r/β)")
    ax.plot(result.forward_kl, result.forward_reward, "--", color="tab:orange", lw=1.5, label="closed form of max E[r] − β KL(ref‖π)")
    ax.plot(result.kl["k1 in reward"], result.expected_reward["k1 in reward"], "o", color="tab:blue", ms=9, mfc="none", mew=2,
            label="ascent, k1 in the reward (PPO)")
    ax.plot(result.kl["k3 in loss"], result.expected_reward["k3 in loss"], "s", color="tab:orange", ms=6,
            label="ascent, k3 in the loss (GRPO)")
    for b, x, y in zip(result.betas, result.kl["k1 in reward"], result.expected_reward["k1 in reward"]):
        if x < 0.1:  # the large-beta points crowd at the origin
            continue
        ax.annotate(f"β={b:g}", (x, y), xytext=(6, -10), textcoords="offset points", fontsize=7, color="tab:blue")
    ax.set_xlabel("KL(π ‖ ref)  (nats)")
    ax.set_ylabel("expected reward  E_π[r]  (reward units)")
    ax.set_title(f"Reward–KL trade-off, β from {result.betas.max():g} (origin) to {result.betas.min():g}")
    ax.legend(fontsize=8, loc="lower right")

    ax = axes[1]
    i = grid_index(result.betas, beta, "beta")
    K = result.reward.size
    x = np.arange(K)
    w = 0.19
    bars = [("reference", result.ref, "0.6"), ("closed form π*", result.pi_closed[i], "k"),
            ("k1 in reward (found)", result.pi_k1_reward[i], "tab:blue"), ("k3 in loss (found)", result.pi_k3_loss[i], "tab:orange")]
    for j, (name, probs, col) in enumerate(bars):
        ax.bar(x + (j - 1.5) * w, probs, w, color=col, label=name)
    ax.plot(x + 1.5 * w, result.pi_forward_closed[i], "_", color="tab:red", ms=14, mew=2.5, label="closed form for k3 in loss")
    ax.set_xticks(x, [f"arm {k + 1}\nr={r:g}" for k, r in enumerate(result.reward)])
    ax.set_ylabel("probability")
    ax.set_title(f"Policies at β = {result.betas[i]:g} ({result.n_steps} Adam steps)")
    ax.legend(fontsize=8)
    fig.suptitle("KL-penalised bandit: max E[r] − β·KL(π‖ref); where each way of applying the penalty converges")
    return save_figure(fig, path)


def figure(result: KLPenaltyResult, beta: float = 0.4) -> dict:
    """The live page's figure: the reward-KL frontier with the found policies (``beta`` ringed), and the policies at ``beta``."""
    i = grid_index(result.betas, beta, "beta")
    k1, k3 = "k1 in reward", "k3 in loss"
    data = [
        trace(result.frontier_kl, result.frontier_reward, "closed form π* ∝ ref·exp(r/β)", colour="k"),
        trace(result.forward_kl, result.forward_reward, "closed form of max E[r] − β KL(ref‖π)", colour="tab:orange", dash="dash", width=1.5),
        trace(result.kl[k1], result.expected_reward[k1], "ascent, k1 in the reward (PPO)", mode="markers", colour="tab:blue",
              symbol="circle-open", text=[f"β={b:g}" for b in result.betas], marker={"size": 11, "color": PLOTLY_COLOURS["tab:blue"],
                                                                                  "symbol": "circle-open", "line": {"width": 2}}),
        trace(result.kl[k3], result.expected_reward[k3], "ascent, k3 in the loss (GRPO)", mode="markers", colour="tab:orange",
              symbol="square", text=[f"β={b:g}" for b in result.betas]),
        trace([result.kl[k1][i], result.kl[k3][i]], [result.expected_reward[k1][i], result.expected_reward[k3][i]], f"β = {result.betas[i]:g}",
              mode="markers", marker={"size": 22, "color": "rgba(0,0,0,0)", "line": {"width": 2, "color": "#d62728"}}),
    ]
    arms = [f"arm {k + 1} (r={r:g})" for k, r in enumerate(result.reward)]
    for name, probs, col in (("reference", result.ref, "#999999"), ("closed form π*", result.pi_closed[i], "#000000"),
                             ("k1 in reward (found)", result.pi_k1_reward[i], PLOTLY_COLOURS["tab:blue"]),
                             ("k3 in loss (found)", result.pi_k3_loss[i], PLOTLY_COLOURS["tab:orange"]),
                             ("closed form for k3 in loss", result.pi_forward_closed[i], PLOTLY_COLOURS["tab:red"])):
        data.append({"type": "bar", "x": arms, "y": probs, "name": name, "xaxis": "x2", "yaxis": "y2", "marker": {"color": col}})
    layout = panels_layout("KL-penalised bandit: max E[r] − β·KL(π‖ref); where each way of applying the penalty converges", [
        {"title": f"Reward–KL trade-off, β from {result.betas.max():g} (origin) to {result.betas.min():g}", "x": "KL(π ‖ ref) (nats)",
         "y": "expected reward E_π[r]"},
        {"title": f"Policies at β = {result.betas[i]:g} ({result.n_steps} Adam steps)", "x": "arm", "y": "probability"},
    ])
    layout["barmode"] = "group"
    return {"data": data, "layout": layout}
