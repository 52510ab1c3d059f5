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
from torch.func import grad_and_value, vmap

from rlalign.explore._common import CLIP_COLOUR, NEG_COLOUR, POS_COLOUR, band, new_figure, panels_layout, save_figure, trace
from rlalign.explore.params import Param, number, require, whole

SUMMARY = "PPO clipped objective vs ratio for A>0 and A<0: clip region, unclipped line, zero-gradient zones"

PARAMS = (
    Param("eps", "clip range ε", 0.2, 0.05, 0.5, 0.01, help="typical 0.1-0.2"),
    Param("advantage", "advantage |A|", 1.0, 0.1, 3.0, 0.1),
    Param("r_max", "largest ratio shown", 2.0, 1.5, 4.0, 0.1),
)
EQUATIONS = (
    ("the clipped surrogate (Schulman et al. 2017, eq. 7)", r"$L^{CLIP}(r) = \min\left(r\,A,\ \mathrm{clip}(r, 1-\epsilon, 1+\epsilon)\,A\right)$"),
    ("the probability ratio", r"$r = \frac{\pi_\theta(a\,|\,s)}{\pi_{old}(a\,|\,s)}$"),
)


@dataclass
class PPOLossResult:
    ratio: np.ndarray  # (R,) grid of r = pi / pi_old
    advantages: np.ndarray  # (2,) the two advantages, +A and -A
    objective: np.ndarray  # (2, R) L^CLIP(r) = -clipped_surrogate_loss
    unclipped: np.ndarray  # (2, R) r * A
    slope: np.ndarray  # (2, R) dL^CLIP / dr by autograd
    clipped: np.ndarray  # (2, R) core's ClipStats.clip_frac at each point (1 = the clip is active)
    eps: float


def _objective_at(ratio: torch.Tensor, advantage: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L^CLIP, clip flag) of one token with ratio ``ratio``: -clipped_surrogate_loss with log pi_old = 0. Shapes: () -> ()."""
    logp = torch.log(ratio).reshape(1)  # log pi with log pi_old = 0, so exp(logp - old) = r
    loss, stats = clipped_surrogate_loss(logp, torch.zeros_like(logp), advantage.reshape(1), eps_low=eps)
    return -loss, stats.clip_frac


def compute(eps: float = 0.2, advantage: float = 1.0, r_max: float = 2.0, n_points: int = 401) -> PPOLossResult:
    """Evaluate the clipped surrogate and its slope on a ratio grid (0, r_max] for A = +advantage, -advantage."""
    require(
        "ppo-loss-decomposition",
        eps=(eps, number(0, 1, above=True), "a number in (0, 1]"),
        advantage=(advantage, number(), "a finite number"),
        r_max=(r_max, number(0, above=True), "a number > 0"),
        n_points=(n_points, whole(2), "a whole number >= 2"),
    )
    ratio = np.linspace(r_max / n_points, r_max, n_points)
    advantages = np.array([advantage, -advantage])
    # every grid point is its own one-token loss: vmap runs them at once, grad gives dL^CLIP/dr at each
    slope_and_value = vmap(grad_and_value(_objective_at, has_aux=True), in_dims=(0, None, None))
    ratio_t = torch.tensor(ratio, dtype=torch.float64)  # (R,)
    objective, slope, clipped = np.zeros((2, n_points)), np.zeros((2, n_points)), np.zeros((2, n_points))
    for i, a in enumerate(advantages):
        grads, (values, clip) = slope_and_value(ratio_t, torch.tensor(a, dtype=torch.float64), eps)
        objective[i], slope[i], clipped[i] = values.numpy(), grads.numpy(), clip.numpy()
    return PPOLossResult(ratio, advantages, objective, advantages[:, None] * ratio[None, :], slope, clipped, eps)


def figure(result: PPOLossResult) -> dict:
    """The live page's figure: the same two panels as :func:`plot`."""
    eps, traces, shapes, panels = result.eps, [], [], []
    for p, (a, obj, unc, slope) in enumerate(zip(result.advantages, result.objective, result.unclipped, result.slope), start=1):
        colour = POS_COLOUR if a > 0 else NEG_COLOUR
        shapes.append(band(1 - eps, 1 + eps, panel=p))
        flat = np.abs(slope) < 1e-12
        if flat.any():
            shapes.append(band(result.ratio[flat].min(), result.ratio[flat].max(), panel=p, colour="#9a9a9a", opacity=0.25))
        traces.append(trace(result.ratio, obj, f"L^CLIP, A = {a:+g}", panel=p, colour=colour, width=3.5))
        traces.append(trace(result.ratio, unc, f"r·A, A = {a:+g} (unclipped)", panel=p, colour="k", dash="dash", width=1.2))
        panels.append({"title": f"A = {a:+g}   (grey: trust region [1−ε, 1+ε]; dark: dL/dr = 0)", "x": "probability ratio r = π_θ / π_old",
                       "y": "surrogate objective L^CLIP (units of A)", "xrange": [0, float(result.ratio[-1])]})
    layout = panels_layout(f"PPO clipped surrogate vs the probability ratio (ε = {eps:g})", panels)
    layout["shapes"] = shapes
    return {"data": traces, "layout": layout}


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
