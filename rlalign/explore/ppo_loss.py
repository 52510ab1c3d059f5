"""PPOLossDecomposition: the clipped surrogate objective as a function of the ratio, for A > 0 and A < 0.

    L^CLIP(r) = min(r A, clip(r, 1 - eps, 1 + eps) A),     r = pi_theta(a|s) / pi_old(a|s)

Schulman et al. 2017, eq. 7; seeds 000/001, "the clipped surrogate". Each point is computed with
:func:`rlalign.core.losses.clipped_surrogate_loss` (objective = -loss) on a single token whose
log-ratio is log r, and its slope dL^CLIP/dr by autograd through that loss.

Known truth: L^CLIP = r A inside the trust region; flat (slope exactly 0) for A > 0, r > 1 + eps
and for A < 0, r < 1 - eps; equal to the unclipped r A (slope A) on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlalign.core.losses import clipped_surrogate_loss
from rlalign.explore._common import CLIP_COLOUR, NEG_COLOUR, POS_COLOUR, new_figure, save_figure

SUMMARY = "PPO clipped objective vs ratio for A>0 and A<0: clip region, unclipped line, zero-gradient zones"


@dataclass
class PPOLossResult:
    ratio: np.ndarray  # (R,) grid of r = pi / pi_old
    advantages: np.ndarray  # (2,) the two advantages, +A and -A
    objective: np.ndarray  # (2, R) L^CLIP(r) = -clipped_surrogate_loss
    unclipped: np.ndarray  # (2, R) r * A
    slope: np.ndarray  # (2, R) dL^CLIP / dr by autograd
    clipped: np.ndarray  # (2, R) core's ClipStats.clip_frac at each point (1 = the clip is active)
    eps: float


def compute(eps: float = 0.2, advantage: float = 1.0, r_max: float = 2.0, n_points: int = 401) -> PPOLossResult:
    """Evaluate the clipped surrogate and its slope on a ratio grid (0, r_max] for A = +advantage, -advantage."""
    ratio = np.linspace(r_max / n_points, r_max, n_points)
    advantages = np.array([advantage, -advantage])
    objective = np.zeros((2, n_points))
    slope = np.zeros((2, n_points))
    clipped = np.zeros((2, n_points))
    for i, a in enumerate(advantages):
        for j, r in enumerate(ratio):
            ratio_t = torch.tensor([r], dtype=torch.float64, requires_grad=True)  # (1,)
            logp = torch.log(ratio_t)  # log pi with log pi_old = 0, so exp(logp - old) = r
            loss, stats = clipped_surrogate_loss(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([a], dtype=torch.float64), eps_low=eps)
            (grad,) = torch.autograd.grad(-loss, ratio_t)
            objective[i, j] = -loss.item()
            slope[i, j] = grad.item()
            clipped[i, j] = stats.clip_frac.item()
    return PPOLossResult(ratio, advantages, objective, advantages[:, None] * ratio[None, :], slope, clipped, eps)


def plot(result: PPOLossResult, path: str | Path) -> Path:
    fig, axes = new_figure(2, width=5.0, height=4.0)
    eps = result.eps
    for ax, a, obj, unc, slope in zip(axes, result.advantages, result.objective, result.unclipped, result.slope):
        colour = POS_COLOUR if a > 0 else NEG_COLOUR
        ax.axvspan(1 - eps, 1 + eps, color=CLIP_COLOUR, label=f"trust region [1-ε, 1+ε], ε={eps:g}")
        flat = np.abs(slope) < 1e-12  # where autograd says the objective does not move
        if flat.any():
            lo, hi = result.ratio[flat].min(), result.ratio[flat].max()
            ax.axvspan(lo, hi, facecolor="none", edgecolor="0.4", hatch="//", lw=0, label="dL/dr = 0 (clip active, no gradient)")
        ax.plot(result.ratio, obj, color=colour, lw=3, label="clipped  min(r·A, clip(r,1-ε,1+ε)·A)")
        ax.plot(result.ratio, unc, "--", color="k", lw=1.2, label="unclipped  r·A")
        ax.axvline(1.0, color="0.5", lw=0.8)
        ax.axhline(0.0, color="0.5", lw=0.8)
        sign = ">" if a > 0 else "<"
        ax.set_title(f"A = {a:+g}  (A {sign} 0)")
        ax.set_xlabel("probability ratio  r = π_θ(a|s) / π_old(a|s)  (dimensionless)")
        ax.set_ylabel("surrogate objective  L^CLIP  (units of A)")
        ax.set_xlim(0, result.ratio[-1])
        ax.legend(loc="upper left" if a > 0 else "lower left", fontsize=8)
    fig.suptitle("PPO clipped surrogate objective vs probability ratio (computed with clipped_surrogate_loss)")
    return save_figure(fig, path)
