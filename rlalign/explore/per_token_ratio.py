"""PerTokenRatioExplorer: per-token ratios r_t = pi(o_t) / pi_old(o_t) after one small policy update,
and which tokens the PPO clip bounds.

Problem (known truth): a tiny position-wise categorical policy over a 6-token vocabulary, logits
(T, V), no context. A sequence o_1..o_T is sampled from pi_old. Each token has a reward table
R(v); its exact per-token advantage is A_t = R(o_t) - E_{v ~ pi_old(.|t)} R(v). One SGD step on the
policy-gradient loss (:func:`rlalign.core.losses.policy_gradient_loss`) moves the policy; the new
and old log-probs of the sampled tokens come from :func:`rlalign.core.logprobs.token_logprobs`,
and each token's clipped objective and clip flag from
:func:`rlalign.core.losses.clipped_surrogate_loss` applied to that token alone:

    l_t = min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)            Schulman et al. 2017, eq. 7

Seeds 000/001, "probability ratio". The clip bounds token t when A_t > 0 and r_t > 1 + eps, or
A_t < 0 and r_t < 1 - eps; those tokens then contribute no gradient. Simplification: the
advantage is exact (no critic), so only the ratio and the clip are on show.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.patches import Patch

from rlalign.core.logprobs import token_logprobs
from rlalign.core.losses import clipped_surrogate_loss, policy_gradient_loss
from rlalign.explore._common import CLIP_COLOUR, NEG_COLOUR, PLOTLY_COLOURS, POS_COLOUR, new_figure, panels_layout, save_figure
from rlalign.explore.params import Param, number, require, whole

SUMMARY = "per-token ratios pi/pi_old of a sampled sequence after one update, and which tokens the clip bounds"

VOCAB = ("the", "cat", "sat", "on", "mat", ".")
TOKEN_REWARD = (0.2, 1.0, 0.6, 0.0, 0.9, -0.5)  # R(v), one per vocabulary entry

PARAMS = (
    Param("eps", "clip range ε", 0.2, 0.05, 0.5, 0.01, help="typical 0.1-0.2"),
    Param("lr", "step size of the policy update", 12.0, 0.5, 30.0, 0.5),
    Param("seq_len", "sequence length T", 12, 4, 24, 1, kind="int"),
    Param("seed", "random seed (policy, sampled sequence)", 0, 0, 50, 1, kind="int"),
)
EQUATIONS = (
    ("the per-token probability ratio", r"$r_t(\theta) = \frac{\pi_\theta(o_t\,|\,q, o_{<t})}{\pi_{\theta_{old}}(o_t\,|\,q, o_{<t})}$"),
    ("each token's clipped objective (Schulman et al. 2017, eq. 7)",
     r"$\ell_t = \min\left(r_t A_t,\ \mathrm{clip}(r_t, 1-\epsilon, 1+\epsilon)\,A_t\right)$"),
)


@dataclass
class PerTokenRatioResult:
    tokens: list[str]  # (T,) sampled tokens o_t
    advantages: np.ndarray  # (T,) exact A_t = R(o_t) - E_pi_old[R]
    old_prob: np.ndarray  # (T,) pi_old(o_t)
    new_prob: np.ndarray  # (T,) pi(o_t) after the update
    ratio: np.ndarray  # (T,) r_t = exp(logp - old_logp)
    unclipped: np.ndarray  # (T,) r_t A_t
    clipped_objective: np.ndarray  # (T,) min(r_t A_t, clip(r_t) A_t) = -clipped_surrogate_loss on token t
    clip_active: np.ndarray  # (T,) 1 where the clip bounds token t (ClipStats.clip_frac)
    token_grad_norm: np.ndarray  # (T,) |d l_t / d logits| of the clipped objective of token t
    eps: float
    lr: float


def compute(seq_len: int = 12, eps: float = 0.2, lr: float = 12.0, seed: int = 0) -> PerTokenRatioResult:
    """Sample a sequence from pi_old, take one PG step of size ``lr``, report per-token ratios and clipping."""
    require(
        "per-token-ratio",
        seq_len=(seq_len, whole(1), "a whole number >= 1"),
        eps=(eps, number(0, 1, above=True), "a number in (0, 1]"),
        lr=(lr, number(0), "a number >= 0"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    gen = torch.Generator().manual_seed(seed)
    V = len(VOCAB)
    old_logits = torch.randn(1, seq_len, V, generator=gen, dtype=torch.float64)  # (1, T, V)
    tokens = torch.multinomial(torch.softmax(old_logits[0], -1), 1, generator=gen).view(1, seq_len)  # (1, T)
    reward = torch.tensor(TOKEN_REWARD, dtype=torch.float64)  # (V,)
    advantages = reward[tokens[0]] - torch.softmax(old_logits[0], -1) @ reward  # (T,) exact A_t

    # one small policy update: a single SGD step on the REINFORCE loss of this sequence
    logits = old_logits.clone().requires_grad_(True)
    pg_loss, _ = policy_gradient_loss(token_logprobs(logits, tokens)[0], advantages)
    (grad,) = torch.autograd.grad(pg_loss, logits)
    new_logits = (old_logits - lr * grad).detach()

    old_logp = token_logprobs(old_logits, tokens)[0]  # (T,)
    new_logits.requires_grad_(True)
    logp = token_logprobs(new_logits, tokens)[0]  # (T,)
    objective, clip_active, grad_norm = [], [], []
    for t in range(seq_len):  # each token's own clipped objective, so the clip is visible per token
        loss_t, stats_t = clipped_surrogate_loss(logp[t : t + 1], old_logp[t : t + 1], advantages[t : t + 1], eps_low=eps)
        (g,) = torch.autograd.grad(-loss_t, new_logits, retain_graph=True)
        objective.append(-loss_t.item())
        clip_active.append(stats_t.clip_frac.item())
        grad_norm.append(g.norm().item())
    ratio = torch.exp(logp - old_logp).detach()
    return PerTokenRatioResult(
        tokens=[VOCAB[i] for i in tokens[0].tolist()],
        advantages=advantages.numpy(),
        old_prob=old_logp.exp().numpy(),
        new_prob=logp.detach().exp().numpy(),
        ratio=ratio.numpy(),
        unclipped=(ratio * advantages).numpy(),
        clipped_objective=np.array(objective),
        clip_active=np.array(clip_active),
        token_grad_norm=np.array(grad_norm),
        eps=eps,
        lr=lr,
    )


def plot(result: PerTokenRatioResult, path: str | Path) -> Path:
    fig, axes = new_figure(1, nrows=2, width=9.0, height=3.4)
    T = len(result.tokens)
    x = np.arange(T)
    labels = [f"{t}\n{tok}" for t, tok in enumerate(result.tokens, start=1)]
    colours = [POS_COLOUR if a > 0 else NEG_COLOUR for a in result.advantages]
    clipped = result.clip_active > 0.5
    eps = result.eps

    ax = axes[0]
    ax.axhspan(1 - eps, 1 + eps, color=CLIP_COLOUR, label=f"trust region [1-ε, 1+ε], ε={eps:g}")
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.bar(x, result.ratio - 1.0, bottom=1.0, color=colours, edgecolor="k", hatch=["//" if c else "" for c in clipped])
    for xi, r, c in zip(x, result.ratio, clipped):
        if c:
            ax.annotate("clipped", (xi, r), xytext=(0, 3 if r > 1 else -11), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylabel("ratio  r_t = π(o_t) / π_old(o_t)")
    ax.set_title(f"Per-token probability ratio after one policy-gradient step (lr={result.lr:g})")
    ax.set_xticks(x, labels)
    handles = [
        Patch(color=CLIP_COLOUR, label=f"trust region [1-ε, 1+ε], ε={eps:g}"),
        Patch(facecolor=POS_COLOUR, edgecolor="k", label="A_t > 0"),
        Patch(facecolor=NEG_COLOUR, edgecolor="k", label="A_t < 0"),
        Patch(facecolor="w", edgecolor="k", hatch="//", label="clip active: token gives no gradient"),
    ]
    ax.legend(handles=handles, fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    lo, hi = min(result.ratio.min(), 1 - eps), max(result.ratio.max(), 1 + eps)
    ax.set_ylim(lo - 0.15, hi + 0.15)
    ax.margins(x=0.01)

    ax = axes[1]
    w = 0.38
    ax.bar(x - w / 2, result.unclipped, w, color="w", edgecolor=colours, lw=1.5, label="unclipped  r_t·A_t")
    ax.bar(x + w / 2, result.clipped_objective, w, color=colours, edgecolor="k", hatch=["//" if c else "" for c in clipped], label="clipped  min(r_t·A_t, clip(r_t)·A_t)")
    ax.axhline(0.0, color="0.4", lw=0.8)
    ax.set_ylabel("token objective  (reward units)")
    ax.set_xlabel("position t and sampled token o_t")
    ax.set_title("Token-level PPO objective: the clip caps gains (A>0, r>1+ε) and stops pushing down (A<0, r<1-ε)")
    ax.set_xticks(x, labels)
    handles = [
        Patch(facecolor="w", edgecolor="0.3", lw=1.5, label="unclipped  r_t·A_t (outline)"),
        Patch(facecolor="0.6", edgecolor="k", label="clipped  min(r_t·A_t, clip(r_t)·A_t) (filled)"),
        Patch(facecolor="0.6", edgecolor="k", hatch="//", label="clip active"),
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    return save_figure(fig, path)


def figure(result: PerTokenRatioResult) -> dict:
    """The live page's figure: the ratio and the token objectives of :func:`plot`, as bars per position."""
    labels = [f"{t} {tok}" for t, tok in enumerate(result.tokens, start=1)]
    colours = [PLOTLY_COLOURS[POS_COLOUR if a > 0 else NEG_COLOUR] for a in result.advantages]
    hatch = ["/" if c > 0.5 else "" for c in result.clip_active]
    eps = result.eps

    def bars(y, name, panel, **extra):
        suffix = "" if panel == 1 else str(panel)
        return {"type": "bar", "x": labels, "y": y, "name": name, "xaxis": f"x{suffix}", "yaxis": f"y{suffix}", **extra}

    data = [
        bars(result.ratio - 1.0, "ratio r_t (hatched: clip active, no gradient)", 1, base=1.0,
             marker={"color": colours, "pattern": {"shape": hatch}, "line": {"color": "#000", "width": 1}},
             customdata=result.ratio, hovertemplate="r_t = %{customdata:.3f}<extra></extra>"),
        bars(result.unclipped, "unclipped r_t·A_t", 2, marker={"color": "#ffffff", "line": {"color": colours, "width": 2}}),
        bars(result.clipped_objective, "clipped min(r_t·A_t, clip(r_t)·A_t)", 2,
             marker={"color": colours, "pattern": {"shape": hatch}, "line": {"color": "#000", "width": 1}}),
    ]
    lo, hi = min(float(result.ratio.min()), 1 - eps), max(float(result.ratio.max()), 1 + eps)
    layout = panels_layout(f"Per-token ratios after one policy-gradient step (lr = {result.lr:g}); blue A_t > 0, red A_t < 0", [
        {"title": f"ratio r_t; grey band: trust region [1−ε, 1+ε], ε = {eps:g}", "x": "position t and sampled token o_t",
         "y": "r_t = π(o_t) / π_old(o_t)", "yrange": [lo - 0.15, hi + 0.15]},
        {"title": "token objective: outline unclipped, filled clipped", "x": "position t and sampled token o_t",
         "y": "token objective (reward units)"},
    ])
    layout["barmode"] = "group"
    layout["shapes"] = [{"type": "rect", "xref": "x domain", "yref": "y", "x0": 0, "x1": 1, "y0": 1 - eps, "y1": 1 + eps,
                         "fillcolor": "#d9d9d9", "opacity": 0.6, "line": {"width": 0}, "layer": "below"}]
    return {"data": data, "layout": layout}
