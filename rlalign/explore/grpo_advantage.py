"""GRPOAdvantageExplorer: group-relative advantages against the rewards and the group size.

Problem (known truth): binary (pass/fail) rewards. A group of G completions with k correct has
empirical success rate p_hat = k / G. The advantages come from
:func:`rlalign.core.advantages.group_advantages` (scale "group" = GRPO, "batch", "none" = Dr.GRPO)
and :func:`rlalign.core.advantages.rloo_advantages`, and have closed forms (unbiased std):

    GRPO  (scale="group"):  A_correct = sqrt((1 - p_hat) / p_hat * (G - 1) / G),
                            A_wrong   = -sqrt(p_hat / (1 - p_hat) * (G - 1) / G)
    Dr.GRPO (scale="none"): A_correct = 1 - p_hat,    A_wrong = -p_hat
    RLOO:                   A_correct = G/(G-1) (1 - p_hat)

Shao et al. 2024, eq. 3 (GRPO); Liu et al. 2025 (Dr.GRPO); Kool et al. 2019 (RLOO); seed 000,
"group-normalised advantage". A group whose rewards all tie (k = 0 or k = G) carries no signal and
gets advantage 0; with true success rate p this happens with probability p^G + (1 - p)^G, measured
here by sampling groups and counting those whose advantages are all zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlalign.core.advantages import group_advantages, rloo_advantages
from rlalign.explore._common import PLOTLY_COLOURS, new_figure, panels_layout, save_figure, trace
from rlalign.explore.params import Param, each, require, whole

SUMMARY = "GRPO/Dr.GRPO/RLOO advantages of right and wrong answers vs success rate and G; fraction of tied groups"

CMAP = ("tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:red", "tab:brown")
PARAMS = (
    Param("scales_group_size", "group size G (middle panel)", 8, 2, 64, 1, kind="int", help="typical 4-16"),
    Param("n_groups", "sampled groups per point (right panel)", 2000, 500, 8000, 500, kind="int", size=True),
    Param("seed", "random seed", 0, 0, 50, 1, kind="int"),
)
EQUATIONS = (
    ("GRPO's group-normalised advantage (Shao et al. 2024, eq. 3)", r"$\hat{A}_{i} = \frac{r_i - \mathrm{mean}(r_1, \ldots, r_G)}{\mathrm{std}(r_1, \ldots, r_G)}$"),
    ("for pass/fail rewards with k of G correct, p = k/G", r"$\hat{A}_{correct} = \sqrt{\frac{1 - \hat{p}}{\hat{p}}\,\frac{G - 1}{G}},\quad \hat{A}_{wrong} = -\sqrt{\frac{\hat{p}}{1 - \hat{p}}\,\frac{G - 1}{G}}$"),
    ("a group that ties carries no signal, with probability", r"$P(\mathrm{tie}) = p^G + (1 - p)^G$"),
)


@dataclass
class GRPOAdvantageResult:
    group_sizes: list[int]  # sizes G for the z-score panel
    p_hat: list[np.ndarray]  # per G: (G-1,) success rates k/G, k = 1..G-1
    adv_correct: list[np.ndarray]  # per G: (G-1,) GRPO advantage of a correct answer
    adv_wrong: list[np.ndarray]  # per G: (G-1,) GRPO advantage of a wrong answer
    scales_group_size: int  # G for the scale comparison
    scale_p_hat: np.ndarray  # (G-1,)
    scale_correct: dict[str, np.ndarray]  # name -> (G-1,) advantage of a correct answer
    tie_group_sizes: list[int]  # sizes G for the tie panel
    tie_p: np.ndarray  # (P,) true success rates
    tie_fraction: np.ndarray  # (len(tie_group_sizes), P) measured fraction of all-zero-advantage groups
    tie_exact: np.ndarray  # (len(tie_group_sizes), P) p^G + (1-p)^G
    n_groups: int


def _group_with_k(k: int, G: int, copies: int = 1) -> torch.Tensor:
    """Scores of ``copies`` identical groups, each with k ones then G - k zeros. Shape: (copies * G,)."""
    one = torch.cat([torch.ones(k), torch.zeros(G - k)]).to(torch.float64)
    return one.repeat(copies)


def compute(
    group_sizes: tuple[int, ...] = (2, 4, 8, 16, 64),
    scales_group_size: int = 8,
    tie_group_sizes: tuple[int, ...] = (2, 4, 8, 16),
    n_groups: int = 4000,
    seed: int = 0,
) -> GRPOAdvantageResult:
    """Advantages of a correct and a wrong answer for every k, and the tied-group fraction by sampling."""
    require(
        "grpo-advantage",
        group_sizes=(group_sizes, each(whole(2)), "a non-empty sequence of whole numbers >= 2"),
        scales_group_size=(scales_group_size, whole(2), "a whole number >= 2"),
        tie_group_sizes=(tie_group_sizes, each(whole(2)), "a non-empty sequence of whole numbers >= 2"),
        n_groups=(n_groups, whole(1), "a whole number >= 1"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    p_hat, correct, wrong = [], [], []
    for G in group_sizes:
        groups = torch.cat([_group_with_k(k, G) for k in range(1, G)])  # ((G-1) G,): one group per k, normalised per group
        adv = group_advantages(groups, G, scale="group").view(G - 1, G)  # (G-1, G)
        p_hat.append(np.arange(1, G) / G)
        correct.append(adv[:, 0].numpy())  # position 0 is correct for every k >= 1
        wrong.append(adv[:, -1].numpy())  # the last position is wrong for every k <= G-1

    G = scales_group_size
    copies = 16  # a batch of identical groups, so the "batch" std is that of the whole batch
    scale_correct = {}
    for scale in ("group", "batch", "none"):
        scale_correct[f'group_advantages(scale="{scale}")'] = np.array(
            [group_advantages(_group_with_k(k, G, copies), G, scale=scale)[0].item() for k in range(1, G)]
        )
    scale_correct["rloo_advantages"] = np.array([rloo_advantages(_group_with_k(k, G), G)[0].item() for k in range(1, G)])

    gen = torch.Generator().manual_seed(seed)
    tie_p = np.linspace(0.0, 1.0, 21)
    tie_fraction = np.zeros((len(tie_group_sizes), tie_p.size))
    for i, Gs in enumerate(tie_group_sizes):  # every success rate at once: (P, n_groups * G) scores, groups consecutive
        probs = torch.tensor(tie_p, dtype=torch.float64)[:, None].expand(-1, n_groups * Gs)
        scores = torch.bernoulli(probs, generator=gen)
        adv = group_advantages(scores.reshape(-1), Gs).view(tie_p.size, n_groups, Gs)
        tie_fraction[i] = (adv == 0).all(dim=2).double().mean(dim=1).numpy()
    tie_exact = np.array([tie_p**Gs + (1 - tie_p) ** Gs for Gs in tie_group_sizes])
    return GRPOAdvantageResult(
        list(group_sizes), p_hat, correct, wrong, G, np.arange(1, G) / G, scale_correct,
        list(tie_group_sizes), tie_p, tie_fraction, tie_exact, n_groups,
    )


def plot(result: GRPOAdvantageResult, path: str | Path) -> Path:
    fig, axes = new_figure(3, width=4.8, height=4.3)
    cmap = CMAP
    ax = axes[0]
    for i, G in enumerate(result.group_sizes):
        col = cmap[i % len(cmap)]
        ax.plot(result.p_hat[i], result.adv_correct[i], "o-", color=col, ms=3, label=f"G = {G}")
        ax.plot(result.p_hat[i], result.adv_wrong[i], "s--", color=col, ms=3)
    ax.axhline(0, color="0.4", lw=0.8)
    ax.plot([], [], "k-", label="correct answer (r = 1)")
    ax.plot([], [], "k--", label="wrong answer (r = 0)")
    ax.set_xlabel("group success rate  p̂ = k / G")
    ax.set_ylabel("GRPO advantage  (r − mean) / std  (std units)")
    ax.set_title("GRPO z-score advantage vs p̂ and G")
    ax.legend(fontsize=7, ncols=2)

    ax = axes[1]
    styles = ("o-", "s-", "^--", "D:")
    for (name, values), style in zip(result.scale_correct.items(), styles):
        ax.plot(result.scale_p_hat, values, style, ms=4, label=name)
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xlabel("group success rate  p̂ = k / G")
    ax.set_ylabel("advantage of a correct answer (r = 1)")
    ax.set_title(f"Scaling choices, G = {result.scales_group_size}  (none/RLOO in reward units)")
    ax.legend(fontsize=7)

    ax = axes[2]
    for i, G in enumerate(result.tie_group_sizes):
        col = cmap[result.group_sizes.index(G) % len(cmap)] if G in result.group_sizes else cmap[i % len(cmap)]
        ax.plot(result.tie_p, result.tie_fraction[i], "o", color=col, ms=3.5, mfc="none", label=f"G = {G} (sampled)")
        ax.plot(result.tie_p, result.tie_exact[i], "-", color=col, lw=1.2)
    ax.plot([], [], "k-", label="exact  p^G + (1−p)^G")
    ax.set_xlabel("true success rate p")
    ax.set_ylabel("fraction of groups with all-tied rewards (advantage 0)")
    ax.set_title(f"Tied groups: no learning signal ({result.n_groups} per point)")
    ax.legend(fontsize=7)
    fig.suptitle("GRPO group-relative advantages with binary rewards (computed with group_advantages / rloo_advantages)")
    return save_figure(fig, path)


def figure(result: GRPOAdvantageResult) -> dict:
    """The live page's figure: the three panels of :func:`plot`."""
    data = []
    for i, G in enumerate(result.group_sizes):
        col = CMAP[i % len(CMAP)]
        data.append(trace(result.p_hat[i], result.adv_correct[i], f"G = {G}: correct", panel=1, mode="lines+markers", colour=col))
        data.append(trace(result.p_hat[i], result.adv_wrong[i], f"G = {G}: wrong", panel=1, mode="lines+markers", colour=col, dash="dash",
                          symbol="square"))
    for (name, values), dash in zip(result.scale_correct.items(), (None, None, "dash", "dot")):
        data.append(trace(result.scale_p_hat, values, name, panel=2, mode="lines+markers", dash=dash))
    for i, G in enumerate(result.tie_group_sizes):
        col = CMAP[result.group_sizes.index(G) % len(CMAP)] if G in result.group_sizes else CMAP[i % len(CMAP)]
        data.append(trace(result.tie_p, result.tie_fraction[i], f"G = {G}: sampled", panel=3, mode="markers", colour=col, symbol="circle-open"))
        data.append(trace(result.tie_p, result.tie_exact[i], f"G = {G}: p^G + (1−p)^G", panel=3, colour=col, width=1.2))
    layout = panels_layout("GRPO group-relative advantages with binary rewards (group_advantages / rloo_advantages)", [
        {"title": "GRPO z-score advantage vs p̂ and G", "x": "group success rate p̂ = k / G", "y": "GRPO advantage (std units)"},
        {"title": f"Scaling choices, G = {result.scales_group_size}", "x": "group success rate p̂ = k / G",
         "y": "advantage of a correct answer (r = 1)"},
        {"title": f"Tied groups: no signal ({result.n_groups} per point)", "x": "true success rate p",
         "y": "fraction of all-tied groups"},
    ], height=520)
    layout["colorway"] = [PLOTLY_COLOURS[c] for c in ("tab:blue", "tab:orange", "tab:green", "tab:red")]
    return {"data": data, "layout": layout}
