"""KLDivergenceExplorer: forward vs reverse KL, and the bias and spread of the k1, k2, k3 estimators.

Part 1 (mode covering vs mode seeking). A bimodal target p on a grid of outcomes x (an equal
mixture of N(-2.5, 0.7^2) and N(+2.5, 0.7^2), discretised) is fitted by a discretised Gaussian
q_(mu, sigma), minimising :func:`rlalign.core.kl.categorical_kl` with Adam:

- forward KL(p || q) is maximum likelihood; q ∝ exp(a x + b x^2) on the grid is an exponential
  family, so the optimum matches the moments exactly: E_q[x] = E_p[x], E_q[x^2] = E_p[x^2] (mode
  covering: one wide bump between the modes);
- reverse KL(q || p) locks onto one mode (mode seeking): mu -> +-2.5, sigma -> 0.7, KL -> log 2.
  Reverse KL is not convex in (mu, sigma): from a wide q centred between the modes it can also
  stop in the symmetric local optimum, so both fits start at mu = 1, sigma = 1 (nearer the right mode).

The grid spans [-x_max, x_max] with x_max = max(6, 2 (mode_distance + 2 mode_sigma)) by default. A
narrower grid breaks both fits: the forward optimum exists only while E_p[x^2] is below the grid's
uniform second moment x_max^2 / 3 (past it moment matching needs b > 0, which no Gaussian has, and
sigma grows without bound), and the reverse fit stalls on a near-uniform q (KL(q||p) of 4-20 nats
at modes +-3 to +-4 on a grid ending at +-6).

Part 2 (estimators; Schulman, "Approximating KL divergence", 2020; seed 002). For pi moving away
from ref (logits z + delta u vs z, 20 categories) the per-sample estimators of KL(pi || ref) with
a ~ pi, x = log ref(a) - log pi(a), are :func:`rlalign.core.kl.kl_k1` (-x), ``kl_k2`` (x^2/2) and
``kl_k3`` (e^x - 1 - x). Their exact mean and standard deviation are sums over the categories
weighted by pi; Monte-Carlo means over samples are drawn on top. Known truth: E[k1] = E[k3] = KL
(unbiased); E[k2] is another f-divergence, equal to KL only to second order in log(ref/pi), so k2
is biased as the distributions move apart (here low); k1's relative standard deviation blows up
as KL -> 0 (it takes both signs), k2's and k3's do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlalign.core.kl import categorical_kl, kl_k1, kl_k2, kl_k3
from rlalign.explore._common import PLOTLY_COLOURS, new_figure, panels_layout, save_figure, trace
from rlalign.explore.params import Param, each, number, require, whole

SUMMARY = "forward vs reverse KL fitting a Gaussian to a bimodal target; bias and std of k1/k2/k3 vs true KL"

ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
COLOURS = {"k1": "tab:green", "k2": "tab:purple", "k3": "tab:orange"}

# the live page fits with fewer, larger Adam steps than the CLI (the fits still reach their optima)
PARAMS = (
    Param("mode_distance", "target modes at ±", 2.5, 0.5, 4.0, 0.1),
    Param("mode_sigma", "width of each mode", 0.7, 0.3, 1.5, 0.05),
    Param("start", "both fits start at μ =", 1.0, -3.0, 3.0, 0.1, convert=lambda mu: (mu, 1.0),
          help="reverse KL is not convex: from near 0 it can stop between the modes"),
    Param("n_fit_steps", "fit steps (Adam)", 120, 20, 1500, 20, kind="int", size=True),
    Param("lr", "fit learning rate", 0.15, 0.01, 0.3, 0.01),
    Param("n_samples", "samples per estimator point", 4000, 500, 8000, 500, kind="int", size=True),
    Param("seed", "random seed", 0, 0, 50, 1, kind="int"),
)
EQUATIONS = (
    ("forward (mode covering) and reverse (mode seeking) KL",
     r"$\mathrm{KL}(p\,\|\,q) = \sum_x p(x) \log\frac{p(x)}{q(x)},\qquad \mathrm{KL}(q\,\|\,p) = \sum_x q(x) \log\frac{q(x)}{p(x)}$"),
    ("single-sample estimators of KL(π‖ref), a ~ π (Schulman 2020)",
     r"$x = \log\frac{\pi_{ref}(a)}{\pi(a)}:\quad k_1 = -x,\quad k_2 = \frac{x^2}{2},\quad k_3 = e^x - 1 - x$"),
)


@dataclass
class KLDivergenceResult:
    x: np.ndarray  # (V,) grid of outcomes
    p: np.ndarray  # (V,) bimodal target
    q_forward: np.ndarray  # (V,) argmin_q KL(p||q)
    q_reverse: np.ndarray  # (V,) argmin_q KL(q||p)
    forward_params: np.ndarray  # (2,) mu, sigma
    reverse_params: np.ndarray  # (2,)
    p_moments: np.ndarray  # (2,) E_p[x], E_p[x^2]
    q_forward_moments: np.ndarray  # (2,)
    forward_kl_values: np.ndarray  # (2,) KL(p||q_fwd), KL(p||q_rev)
    reverse_kl_values: np.ndarray  # (2,) KL(q_fwd||p), KL(q_rev||p)
    deltas: np.ndarray  # (D,) distance parameter
    true_kl: np.ndarray  # (D,) KL(pi||ref), exact
    estimator_mean: dict[str, np.ndarray]  # name -> (D,) exact E_pi[k]
    estimator_std: dict[str, np.ndarray]  # name -> (D,) exact std of one sample's k
    mc_mean: dict[str, np.ndarray]  # name -> (D,) Monte-Carlo mean over n_samples
    mc_se: dict[str, np.ndarray]  # name -> (D,) its standard error
    n_samples: int


def _gauss_logits(x: torch.Tensor, mu: torch.Tensor, log_sigma: torch.Tensor) -> torch.Tensor:
    return -0.5 * ((x - mu) / log_sigma.exp()) ** 2


def _fit(x: torch.Tensor, p_logits: torch.Tensor, n_steps: int, start: tuple[float, float], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, log sigma) minimising KL(p||q) (forward) and KL(q||p) (reverse), each with Adam from ``start`` = (mu, sigma).

    Both fits run in one loop: row 0 is the forward fit, row 1 the reverse one. Their losses touch
    disjoint rows and Adam is per-parameter, so each row moves exactly as it would alone.
    """
    params = torch.tensor([[start[0], np.log(start[1])]] * 2, dtype=torch.float64, requires_grad=True)  # (2, 2)
    opt = torch.optim.Adam([params], lr=lr)
    for _ in range(n_steps):
        q_forward = _gauss_logits(x, params[0, 0], params[0, 1])
        q_reverse = _gauss_logits(x, params[1, 0], params[1, 1])
        loss = categorical_kl(p_logits, q_forward) + categorical_kl(q_reverse, p_logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return params[0].detach(), params[1].detach()


def compute(
    n_grid: int | None = None,
    x_max: float | None = None,
    mode_distance: float = 2.5,
    mode_sigma: float = 0.7,
    n_fit_steps: int = 1500,
    start: tuple[float, float] = (1.0, 1.0),
    lr: float = 0.05,
    n_categories: int = 20,
    deltas: tuple[float, ...] = tuple(np.round(np.geomspace(0.03, 3.0, 15), 4)),
    n_samples: int = 4000,
    seed: int = 0,
) -> KLDivergenceResult:
    """Fit a Gaussian to the bimodal target both ways; exact and sampled moments of k1, k2, k3.

    The grid: ``n_grid`` outcomes on [-x_max, x_max]; None: x_max = max(6, 2 (mode_distance + 2 mode_sigma))
    (module docstring) and a point every 0.1.
    """
    require(
        "kl-divergence",
        n_grid=(n_grid, lambda v: v is None or whole(2)(v), "None or a whole number >= 2"),
        x_max=(x_max, lambda v: v is None or number(0, above=True)(v), "None or a number > 0"),
        mode_distance=(mode_distance, number(), "a finite number"),
        mode_sigma=(mode_sigma, number(0, above=True), "a number > 0"),
        n_fit_steps=(n_fit_steps, whole(1), "a whole number >= 1"),
        start=(start, lambda v: len(v) == 2 and each(number())(v), "two finite numbers"),
        lr=(lr, number(0, above=True), "a number > 0"),
        n_categories=(n_categories, whole(2), "a whole number >= 2"),
        deltas=(deltas, each(number(0, above=True)), "a non-empty sequence of numbers > 0"),
        n_samples=(n_samples, whole(1), "a whole number >= 1"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    x_max = max(6.0, 2.0 * (abs(mode_distance) + 2.0 * mode_sigma)) if x_max is None else x_max
    n_grid = int(round(20 * x_max)) + 1 if n_grid is None else n_grid
    x = torch.linspace(-x_max, x_max, n_grid, dtype=torch.float64)  # (V,)
    p_logits = torch.logaddexp(_gauss_logits(x, torch.tensor(-mode_distance), torch.tensor(np.log(mode_sigma))),
                               _gauss_logits(x, torch.tensor(mode_distance), torch.tensor(np.log(mode_sigma))))
    fits = {}
    for name, (mu, log_sigma) in zip(("forward", "reverse"), _fit(x, p_logits, n_fit_steps, start, lr)):
        fits[name] = (np.array([mu.item(), log_sigma.exp().item()]), _gauss_logits(x, mu, log_sigma))
    p = torch.softmax(p_logits, -1)
    q_fwd = torch.softmax(fits["forward"][1], -1)
    q_rev = torch.softmax(fits["reverse"][1], -1)

    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n_categories, generator=gen, dtype=torch.float64)  # ref logits
    u = torch.randn(n_categories, generator=gen, dtype=torch.float64)  # direction pi moves in
    ref_logp = torch.log_softmax(z, -1)
    true_kl, mean, std, mc_mean, mc_se = [], {k: [] for k in ESTIMATORS}, {k: [] for k in ESTIMATORS}, {k: [] for k in ESTIMATORS}, {k: [] for k in ESTIMATORS}
    for delta in deltas:
        logits = z + delta * u
        logp = torch.log_softmax(logits, -1)
        pi = logp.exp()
        true_kl.append(categorical_kl(logits, z).item())
        samples = torch.multinomial(pi, n_samples, replacement=True, generator=gen)  # (n,)
        for name, fn in ESTIMATORS.items():
            k = fn(logp, ref_logp)  # (V,) the estimator's value at each outcome
            m = (pi * k).sum()
            mean[name].append(m.item())
            std[name].append(torch.sqrt((pi * (k - m) ** 2).sum()).item())
            ks = fn(logp[samples], ref_logp[samples])  # (n,) per-sample estimates
            mc_mean[name].append(ks.mean().item())
            mc_se[name].append((ks.std() / np.sqrt(n_samples)).item())
    arr = lambda d: {k: np.array(v) for k, v in d.items()}  # noqa: E731
    moments = lambda w: np.array([(w * x).sum().item(), (w * x**2).sum().item()])  # noqa: E731
    return KLDivergenceResult(
        x=x.numpy(), p=p.numpy(), q_forward=q_fwd.numpy(), q_reverse=q_rev.numpy(),
        forward_params=fits["forward"][0], reverse_params=fits["reverse"][0],
        p_moments=moments(p), q_forward_moments=moments(q_fwd),
        forward_kl_values=np.array([categorical_kl(p_logits, fits[n][1]).item() for n in ("forward", "reverse")]),
        reverse_kl_values=np.array([categorical_kl(fits[n][1], p_logits).item() for n in ("forward", "reverse")]),
        deltas=np.array(deltas), true_kl=np.array(true_kl), estimator_mean=arr(mean), estimator_std=arr(std),
        mc_mean=arr(mc_mean), mc_se=arr(mc_se), n_samples=n_samples,
    )


def plot(result: KLDivergenceResult, path: str | Path) -> Path:
    fig, axes = new_figure(3, width=4.9, height=4.3)
    ax = axes[0]
    ax.fill_between(result.x, result.p, color="0.8", label="target p (bimodal)")
    (mf, sf), (mr, sr) = np.round(result.forward_params, 2) + 0.0, np.round(result.reverse_params, 2) + 0.0  # no "-0.00"
    ax.plot(result.x, result.q_forward, color="tab:blue", lw=2,
            label=f"argmin KL(p‖q): μ={mf:.2f}, σ={sf:.2f}\n(mode covering, KL(p‖q)={result.forward_kl_values[0]:.2f})")
    ax.plot(result.x, result.q_reverse, color="tab:red", lw=2,
            label=f"argmin KL(q‖p): μ={mr:.2f}, σ={sr:.2f}\n(mode seeking, KL(q‖p)={result.reverse_kl_values[1]:.2f})")
    ax.set_xlabel("outcome x (grid of %d categories)" % result.x.size)
    ax.set_ylabel("probability per category")
    ax.set_title("Fitting one Gaussian to two modes")
    ax.legend(fontsize=7.5, loc="upper left")
    ax.set_ylim(0, max(result.p.max(), result.q_reverse.max()) * 1.45)

    colours = COLOURS
    kl = result.true_kl
    ax = axes[1]
    for name, col in colours.items():
        ax.plot(kl, result.estimator_mean[name] - kl, "-", color=col, lw=1.5, label=f"{name}: exact bias")
        ax.errorbar(kl, result.mc_mean[name] - kl, yerr=2 * result.mc_se[name], fmt="o", color=col, ms=3.5, mfc="none",
                    capsize=2, lw=0.8, label=f"{name}: sample mean − KL ± 2 SE")
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("true KL(π ‖ ref)  (nats)")
    ax.set_ylabel("bias  E[k] − KL  (nats)")
    ax.set_title(f"Bias (n = {result.n_samples} samples a ~ π per point)")
    ax.legend(fontsize=7, ncols=2)

    ax = axes[2]
    for name, col in colours.items():
        ax.plot(kl, result.estimator_std[name] / kl, "o-", color=col, ms=3.5, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("true KL(π ‖ ref)  (nats)")
    ax.set_ylabel("std of one sample's estimate / true KL")
    ax.set_title("Relative spread of a single-sample estimate")
    ax.legend(fontsize=8)
    fig.suptitle("KL divergence: forward vs reverse, and the k1 / k2 / k3 estimators (core.kl)")
    return save_figure(fig, path)


def figure(result: KLDivergenceResult) -> dict:
    """The live page's figure: the two fits, and the estimators' bias and relative spread against the true KL."""
    (mf, sf), (mr, sr) = result.forward_params, result.reverse_params
    data = [
        trace(result.x, result.p, "target p (bimodal)", colour="#aaaaaa", fill="tozeroy", width=1),
        trace(result.x, result.q_forward, f"argmin KL(p‖q): μ={mf:.2f}, σ={sf:.2f} (mode covering)", colour="tab:blue"),
        trace(result.x, result.q_reverse, f"argmin KL(q‖p): μ={mr:.2f}, σ={sr:.2f} (mode seeking)", colour="tab:red"),
    ]
    kl = result.true_kl
    for name, col in COLOURS.items():
        data.append(trace(kl, result.estimator_mean[name] - kl, f"{name}: exact bias", panel=2, colour=col, width=1.5))
        data.append(trace(kl, result.mc_mean[name] - kl, f"{name}: sample mean − KL ± 2 SE", panel=2, mode="markers", colour=col,
                          symbol="circle-open", error_y={"type": "data", "array": 2 * result.mc_se[name], "visible": True,
                                                         "color": PLOTLY_COLOURS[col]}))
        data.append(trace(kl, result.estimator_std[name] / kl, f"{name}: std / KL", panel=3, mode="lines+markers", colour=col))
    layout = panels_layout("KL divergence: forward vs reverse, and the k1 / k2 / k3 estimators (core.kl)", [
        {"title": "Fitting one Gaussian to two modes", "x": f"outcome x (grid of {result.x.size} categories)", "y": "probability per category"},
        {"title": f"Bias (n = {result.n_samples} samples per point)", "x": "true KL(π ‖ ref) (nats)", "y": "bias E[k] − KL (nats)"},
        {"title": "Relative spread of one sample's estimate", "x": "true KL(π ‖ ref) (nats)", "y": "std / true KL", "ylog": True},
    ], height=520)
    layout["xaxis2"]["type"] = layout["xaxis3"]["type"] = "log"
    return {"data": data, "layout": layout}
