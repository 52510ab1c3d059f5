"""EntropyCollapseDemo: policy entropy over training with and without the entropy bonus.

Problem (known truth): a K-armed Bernoulli bandit (success probabilities mu) with a softmax policy
pi = softmax(theta), started uniform. Each step samples a batch of arms, scores them, and takes an
Adam step on

    L = L_PG + c2 L_H,   L_PG = -mean_i log pi(a_i) A_i   (policy_gradient_loss, A = RLOO advantage)
                         L_H  = -H[pi]                     (entropy_loss of entropy_from_logits)

Seeds 000/001, "entropy bonus" (c2 ~ 0.01); Williams 1992; Kool et al. 2019 (RLOO). On-policy, so
the PG loss needs no ratio. Without the bonus the policy collapses onto the best arm and H -> 0.
With it, the objective is E_pi[mu] + c2 H[pi], whose exact maximiser is pi* = softmax(mu / c2)
(the Gibbs distribution), so the entropy settles at H(softmax(mu / c2)) — a known number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlalign.core.advantages import rloo_advantages
from rlalign.core.kl import entropy_from_logits
from rlalign.core.losses import entropy_loss, policy_gradient_loss
from rlalign.explore._common import new_figure, panels_layout, save_figure, trace
from rlalign.explore.params import Param, each, number, require, whole

SUMMARY = "policy entropy and reward over training on a bandit, with and without the entropy bonus c2*H"

MU = (0.9, 0.85, 0.7, 0.5, 0.3, 0.1)  # success probability of each arm
COLOURS = ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple", "tab:brown")

# the live page compares no bonus with one coefficient, on a shorter run (fewer, larger steps) than the CLI's
PARAMS = (
    Param("coefs", "entropy coefficient c2 (vs none)", 0.1, 0.01, 0.5, 0.01, convert=lambda c2: (0.0, c2), help="typical 0.01"),
    Param("lr", "learning rate (Adam, cosine-annealed)", 0.25, 0.01, 0.5, 0.01),
    Param("n_steps", "training steps", 100, 50, 1500, 50, kind="int", size=True),
    Param("batch_size", "batch size", 64, 8, 256, 8, kind="int"),
    Param("seed", "random seed", 0, 0, 50, 1, kind="int"),
)
EQUATIONS = (
    ("the loss: policy gradient plus the entropy bonus", r"$L = L_{PG} - c_2\,H[\pi_\theta],\quad H[\pi] = -\sum_a \pi(a) \log \pi(a)$"),
    ("its exact optimum (the Gibbs policy)", r"$\pi^* = \arg\max_\pi\ E_\pi[\mu] + c_2 H[\pi] = \mathrm{softmax}(\mu / c_2)$"),
)


@dataclass
class EntropyCollapseResult:
    coefs: np.ndarray  # (E,) entropy coefficients c2 (0 = no bonus)
    steps: np.ndarray  # (S,)
    entropy: np.ndarray  # (E, S) H[pi] in nats after each step
    expected_reward: np.ndarray  # (E, S) E_pi[mu]
    target_entropy: np.ndarray  # (E,) H(softmax(mu / c2)); 0 for c2 = 0
    target_reward: np.ndarray  # (E,) E_{softmax(mu/c2)}[mu]; max(mu) for c2 = 0
    final_probs: np.ndarray  # (E, K)
    mu: np.ndarray  # (K,)
    batch_size: int
    lr: float


def gibbs(mu: torch.Tensor, coef: float) -> torch.Tensor:
    """Maximiser of E_pi[mu] + coef * H[pi]: softmax(mu / coef); the greedy one-hot for coef = 0."""
    if coef == 0:
        return torch.nn.functional.one_hot(mu.argmax(), mu.numel()).to(mu.dtype)
    return torch.softmax(mu / coef, -1)


def compute(
    coefs: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2),
    n_steps: int = 1500,
    batch_size: int = 64,
    lr: float = 0.05,
    seed: int = 0,
) -> EntropyCollapseResult:
    """Train one softmax policy per entropy coefficient; record entropy and expected reward per step."""
    require(
        "entropy-collapse",
        coefs=(coefs, each(number(0)), "a non-empty sequence of numbers >= 0"),
        n_steps=(n_steps, whole(1), "a whole number >= 1"),
        batch_size=(batch_size, whole(2), "a whole number >= 2 (the leave-one-out baseline needs two samples)"),
        lr=(lr, number(0, above=True), "a number > 0"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    mu = torch.tensor(MU, dtype=torch.float64)  # (K,)
    K, E = mu.numel(), len(coefs)
    gen = torch.Generator().manual_seed(seed)
    theta = torch.zeros(E, K, dtype=torch.float64, requires_grad=True)  # one independent policy per row
    coef_t = torch.tensor(coefs, dtype=torch.float64)  # (E,)
    opt = torch.optim.Adam([theta], lr=lr)  # per-parameter, so the rows do not interact
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, n_steps)  # annealed: the end is the optimum, not noise
    entropy = np.zeros((E, n_steps))
    reward = np.zeros((E, n_steps))
    for step in range(n_steps):
        probs = torch.softmax(theta.detach(), -1)  # (E, K)
        actions = torch.multinomial(probs, batch_size, replacement=True, generator=gen)  # (E, n)
        scores = torch.bernoulli(mu[actions], generator=gen)  # (E, n)
        advantages = rloo_advantages(scores.view(-1), batch_size).view(E, batch_size)  # one group per row
        logp = torch.log_softmax(theta, -1).gather(1, actions)  # (E, n)
        # the E rows are independent policies: token-mean over (E, n) is (1/E) sum_e (row e's PG
        # loss), and the entropy loss of c2_e * H_e is -(1/E) sum_e c2_e H_e, the same 1/E per row
        pg, _ = policy_gradient_loss(logp, advantages)
        ent_loss, _ = entropy_loss(coef_t * entropy_from_logits(theta))
        loss = pg + ent_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            entropy[:, step] = entropy_from_logits(theta).numpy()
            reward[:, step] = (torch.softmax(theta, -1) @ mu).numpy()
    final = torch.softmax(theta.detach(), -1).numpy()
    targets = [gibbs(mu, c) for c in coefs]
    target_entropy = np.array([-(p * torch.log(p.clamp(min=1e-300))).sum().item() for p in targets])
    target_reward = np.array([(p @ mu).item() for p in targets])
    return EntropyCollapseResult(np.array(coefs), np.arange(1, n_steps + 1), entropy, reward, target_entropy, target_reward, final, mu.numpy(), batch_size, lr)


def plot(result: EntropyCollapseResult, path: str | Path) -> Path:
    fig, axes = new_figure(2, width=5.4, height=4.3)
    colours = COLOURS
    K = result.mu.size
    for e, coef in enumerate(result.coefs):
        name = "no bonus (c2 = 0)" if coef == 0 else f"c2 = {coef:g}"
        col = colours[e % len(colours)]
        axes[0].plot(result.steps, result.entropy[e], color=col, lw=1.5, label=name)
        axes[0].axhline(result.target_entropy[e], color=col, ls=":", lw=1.5)
        axes[1].plot(result.steps, result.expected_reward[e], color=col, lw=1.5, label=name)
        axes[1].axhline(result.target_reward[e], color=col, ls=":", lw=1.5)
    axes[0].axhline(np.log(K), color="0.4", ls="--", lw=1, label=f"uniform policy, log {K}")
    axes[0].plot([], [], ":", color="0.3", label="exact optimum  H(softmax(μ/c2))")
    axes[0].set_ylabel("policy entropy  H[π]  (nats)")
    axes[0].set_title("Entropy: → 0 without the bonus, → H(softmax(μ/c2)) with it")
    axes[1].plot([], [], ":", color="0.3", label="exact optimum  E_{softmax(μ/c2)}[μ]")
    axes[1].set_ylabel("expected reward  E_π[μ]  (success probability)")
    axes[1].set_title("Reward: the bonus trades some reward for spread")
    axes[0].set_ylim(-0.05, np.log(K) + 0.55)
    axes[0].legend(fontsize=8, loc="upper right", ncols=2)
    axes[1].legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.set_xlabel(f"training step (Adam, cosine-annealed lr, batch of {result.batch_size})")
    fig.suptitle(f"Entropy collapse on a {K}-armed Bernoulli bandit, μ = {tuple(float(m) for m in result.mu)}, PG loss with RLOO advantages")
    return save_figure(fig, path)


def figure(result: EntropyCollapseResult) -> dict:
    """The live page's figure: entropy and expected reward over training per coefficient, dotted: the exact optimum."""
    data = []
    ends = result.steps[[0, -1]]
    for e, coef in enumerate(result.coefs):
        name = "no bonus (c2 = 0)" if coef == 0 else f"c2 = {coef:g}"
        col = COLOURS[e % len(COLOURS)]
        data += [
            trace(result.steps, result.entropy[e], name, panel=1, colour=col, width=1.6),
            trace(ends, [result.target_entropy[e]] * 2, f"{name}: optimum H(softmax(μ/c2))", panel=1, colour=col, dash="dot", width=1.4),
            trace(result.steps, result.expected_reward[e], name, panel=2, colour=col, width=1.6, legend=False),
            trace(ends, [result.target_reward[e]] * 2, f"{name}: optimum reward", panel=2, colour=col, dash="dot", width=1.4, legend=False),
        ]
    K = result.mu.size
    data.append(trace(ends, [np.log(K)] * 2, f"uniform policy, log {K}", colour="0.4", dash="dash", width=1))
    x = f"training step (Adam, cosine-annealed lr = {result.lr:g}, batch of {result.batch_size})"
    layout = panels_layout(f"Entropy collapse on a {K}-armed Bernoulli bandit, PG loss with RLOO advantages", [
        {"title": "Entropy: → 0 without the bonus, → H(softmax(μ/c2)) with it", "x": x, "y": "policy entropy H[π] (nats)",
         "yrange": [-0.05, float(np.log(K)) + 0.3]},
        {"title": "Reward: the bonus trades some reward for spread", "x": x, "y": "expected reward E_π[μ]"},
    ])
    return {"data": data, "layout": layout}
