"""MazeValueIteration: V*, Q* and the greedy policy of the seed's 2x3 maze, and value iteration getting there.

The maze is :mod:`rlalign.classic.maze` (seed 002, section 2.2: +10 goal, -10 trap, 0 otherwise,
walls block moves). Its model is turned into arrays by :func:`rlalign.classic.value_iteration.tabular_model`
and swept with the Bellman optimality backup used by :func:`~rlalign.classic.value_iteration.value_iteration`:

    Q_k(s, a) = r(s, a) + gamma * sum_{s'} p_cont(s' | s, a) V_k(s'),     V_{k+1}(s) = max_a Q_k(s, a)

from V_0 = 0, keeping every V_k (``value_iteration`` returns only the fixed point, which the last
sweep is checked against). The seed names no discount; gamma = 0.9 is the default of
``ValueIterationConfig`` and of the Q-learning trainer on this maze.

Known truth (gamma = 0.9): V*(4) = 10 (step right into the goal), V*(1) = V*(3) = 0.9 * 10 = 9,
V*(0) = 0.9 * 9 = 8.1 (right, down, right; the wall blocks down), terminal cells 0. Value iteration
is exact after 3 sweeps here (the longest optimal path has 3 steps) and every sweep shrinks the
Bellman residual by at least a factor gamma (the backup is a gamma-contraction in the max norm).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.patches import Polygon, Rectangle

from rlalign.classic.maze import COLS, GOAL, ROWS, START, TRAP, WALLS, _model
from rlalign.classic.policy_evaluation import (
    deterministic_policy,
    epsilon_greedy_policy,
    monte_carlo_evaluation,
    policy_evaluation,
    uniform_policy,
)
from rlalign.classic.value_iteration import tabular_model, value_iteration
from rlalign.explore._common import new_figure, panels_layout, save_figure, trace, vline
from rlalign.explore.params import Param, number, require, whole

SUMMARY = ("2x3 maze: V* and Q* by value iteration beside V^π, Q^π and A^π of a chosen policy (exact, and Monte Carlo "
           "converging to them)")

ACTION_NAMES = ("up", "down", "left", "right")  # the maze's action order (MOVES)
_ARROW = {0: (0.0, -0.28), 1: (0.0, 0.28), 2: (-0.28, 0.0), 3: (0.28, 0.0)}  # (dx, dy) with row 0 at the top
_TERMINAL = {GOAL: "G  +10", TRAP: "T  -10"}
SWEEPS = 30
POLICIES = ("uniform", "greedy", "epsilon-greedy", "arrows")  # pi: uniform random, argmax Q*, epsilon-greedy around Q*, chosen arrows
LIVE = tuple(s for s in range(ROWS * COLS) if s not in _TERMINAL)  # (0, 1, 3, 4): the cells a policy acts in
_ARROW_HELP = "the action at this cell when the policy is 'arrows'"

PARAMS = (
    Param("sweep", "value-iteration sweep k", 1, 0, SWEEPS, 1, kind="int", stage="figure"),
    Param("gamma", "discount γ", 0.9, 0.5, 0.99, 0.01),
    Param("policy", "policy π", "uniform", kind="choice", choices=POLICIES,
          help="uniform random; greedy in Q*; ε-greedy around Q*; or the arrows chosen per cell below"),
    Param("epsilon", "ε of ε-greedy", 0.2, 0.0, 1.0, 0.05, help="with policy ε-greedy: the probability of a uniformly random action"),
    *(Param(f"arrow_{s}", f"arrow at s{s}{' (start)' if s == START else ''}", ACTION_NAMES[a], kind="choice", choices=ACTION_NAMES,
            help=_ARROW_HELP) for s, a in zip(LIVE, (3, 1, 3, 3))),  # defaults: the greedy path
    Param("episodes", "Monte-Carlo episodes", 2000, 100, 20_000, 100, kind="int", size=True,
          help="first-visit Monte-Carlo episodes, per estimate of V^π and of Q^π"),
)
EQUATIONS = (
    ("the Bellman optimality backup, one sweep", r"$V_{k+1}(s) = \max_a \left[ r(s, a) + \gamma \sum_{s'} p(s'\,|\,s, a)\, V_k(s') \right],\quad V_0 = 0$"),
    ("its fixed point and the greedy policy", r"$Q^*(s, a) = r(s, a) + \gamma\, V^*(s'),\qquad \pi^*(s) = \arg\max_a Q^*(s, a)$"),
    ("the values of a given policy π, solved exactly (seed 002, 4.1)",
     r"$V^\pi(s) = \sum_a \pi(a|s)\, Q^\pi(s, a),\quad Q^\pi(s, a) = r(s, a) + \gamma\, V^\pi(s'),\quad A^\pi = Q^\pi - V^\pi$"),
    ("their Monte-Carlo estimate: the mean return after the first visit of s in n episodes under π",
     r"$\hat V^\pi_n(s) = \frac{1}{N_n(s)} \sum_{i \leq n} G^{(i)}(s),\qquad G_t = \sum_{j \geq 0} \gamma^j\, r_{t+j}$"),
)


@dataclass
class MazeValuesResult:
    values: np.ndarray  # (K+1, S) V_k for sweeps k = 0..K, V_0 = 0
    bellman_residual: np.ndarray  # (K+1,) max_s |(T V_k)(s) - V_k(s)| = max_s |V_{k+1}(s) - V_k(s)|
    q_star: np.ndarray  # (S, A) Q* from value_iteration
    v_star: np.ndarray  # (S,) V* from value_iteration
    policy: np.ndarray  # (S,) greedy action argmax_a Q*(s, a) (0 up, 1 down, 2 left, 3 right)
    reward: np.ndarray  # (S, A) expected reward of (s, a)
    next_state: np.ndarray  # (S, A) where (s, a) leads (deterministic maze)
    terminal: np.ndarray  # (S,) 1 for the goal and the trap
    gamma: float
    sweeps: int
    pi_name: str  # which policy pi: one of POLICIES
    pi: np.ndarray  # (S, A) pi(a|s)
    v_pi: np.ndarray  # (S,) V^pi, exact
    q_pi: np.ndarray  # (S, A) Q^pi, exact
    a_pi: np.ndarray  # (S, A) A^pi = Q^pi - V^pi
    mc_episodes: np.ndarray  # (K,) numbers of Monte-Carlo episodes n at which the estimate is shown
    mc_v: np.ndarray  # (K, S) first-visit Monte-Carlo estimate of V^pi after n episodes (nan: terminal, never visited)
    mc_v_se: np.ndarray  # (K, S) its standard error
    mc_error: np.ndarray  # (K,) max over the live cells of |V^pi_hat - V^pi|
    mc_q: np.ndarray  # (S, A) Monte-Carlo estimate of Q^pi from all the episodes (exploring starts)


def maze_policy(name: str, q_star: np.ndarray, epsilon: float = 0.2, arrows: tuple[int, ...] = (3, 1, 3, 3)) -> np.ndarray:
    """pi (S, A) by name (POLICIES); ``arrows``: the action of each live cell (0, 1, 3, 4) for "arrows"."""
    n_s, n_a = q_star.shape
    if name == "uniform":
        return uniform_policy(n_s, n_a)
    if name == "greedy":
        return epsilon_greedy_policy(q_star, 0.0)
    if name == "epsilon-greedy":
        return epsilon_greedy_policy(q_star, epsilon)
    if name == "arrows":
        actions = q_star.argmax(axis=1)  # terminal cells: any action, nothing follows
        actions[list(LIVE)] = arrows
        return deterministic_policy(actions, n_a)
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")


def compute(gamma: float = 0.9, sweeps: int = SWEEPS, policy: str = "uniform", epsilon: float = 0.2, arrow_0: str = "right",
            arrow_1: str = "down", arrow_3: str = "right", arrow_4: str = "right", episodes: int = 2000, seed: int = 0) -> MazeValuesResult:
    """Run ``sweeps`` value-iteration sweeps on the maze from V_0 = 0 and solve it with ``value_iteration``; evaluate
    the policy ``policy`` exactly and by ``episodes`` first-visit Monte-Carlo episodes (seeded by ``seed``)."""
    require(
        "maze-values",
        gamma=(gamma, number(0, 1), "a number in [0, 1]"),
        sweeps=(sweeps, whole(1), "a whole number >= 1"),
        epsilon=(epsilon, number(0, 1), "a number in [0, 1]"),
        episodes=(episodes, whole(1), "a whole number >= 1"),
        seed=(seed, whole(0), "a whole number >= 0"),
    )
    P = _model()
    prob, reward, cont = tabular_model(P)  # (S, A, S), (S, A), (S, A, S)
    n_s = len(P)
    values = np.zeros((sweeps + 1, n_s))
    residual = np.zeros(sweeps + 1)
    for k in range(sweeps + 1):
        backed_up = (reward + gamma * cont @ values[k]).max(axis=1)  # (T V_k)(s), the same backup as value_iteration
        residual[k] = np.abs(backed_up - values[k]).max()
        if k < sweeps:
            values[k + 1] = backed_up
    v_star, q_star, greedy = value_iteration(P, gamma)
    # ||V_k - V*|| <= gamma^k ||V_0 - V*||: the sweeps are value iteration's, and converged ones equal V*
    bound = gamma ** np.arange(sweeps + 1) * np.abs(v_star).max() + 1e-9
    assert np.all(np.abs(values - v_star).max(axis=1) <= bound), "per-sweep values disagree with value_iteration"
    terminal = np.array([float(all(done for _, _, _, done in P[s][0])) for s in range(n_s)])

    arrows = tuple(ACTION_NAMES.index(a) for a in (arrow_0, arrow_1, arrow_3, arrow_4))
    pi = maze_policy(policy, q_star, epsilon, arrows)  # (S, A)
    exact = policy_evaluation(P, pi, gamma)
    mc = monte_carlo_evaluation(P, pi, gamma, episodes, seed=seed)
    checkpoints = np.unique(np.round(np.geomspace(min(10, episodes), episodes, 25)).astype(int))  # (K,)
    mc_v = np.stack([mc.v(n) for n in checkpoints])  # (K, S)
    mc_v_se = np.stack([mc.v_standard_error(n) for n in checkpoints])  # (K, S)
    live = list(LIVE)
    return MazeValuesResult(
        values=values,
        bellman_residual=residual,
        q_star=q_star,
        v_star=v_star,
        policy=greedy,
        reward=reward,
        next_state=prob.argmax(axis=2),
        terminal=terminal,
        gamma=float(gamma),
        sweeps=int(sweeps),
        pi_name=policy,
        pi=pi,
        v_pi=exact.v,
        q_pi=exact.q,
        a_pi=exact.advantage,
        mc_episodes=checkpoints,
        mc_v=mc_v,
        mc_v_se=mc_v_se,
        mc_error=np.abs(mc_v[:, live] - exact.v[live]).max(axis=1),  # nan until every live cell is visited
        mc_q=mc.q(),
    )


def _draw_walls(ax) -> None:
    ax.add_patch(Rectangle((-0.5, -0.5), COLS, ROWS, fill=False, lw=3, color="k"))
    for pair in WALLS:
        a, b = sorted(pair)
        (ra, ca), (rb, cb) = divmod(a, COLS), divmod(b, COLS)
        if ca == cb:  # vertically adjacent: a horizontal wall between rows
            y = (ra + rb) / 2
            ax.plot([ca - 0.5, ca + 0.5], [y, y], color="k", lw=6, solid_capstyle="butt")
        else:
            x = (ca + cb) / 2
            ax.plot([x, x], [ra - 0.5, ra + 0.5], color="k", lw=6, solid_capstyle="butt")


def _grid_axes(ax, title: str) -> None:
    ax.grid(False)
    ax.set_xlim(-0.5, COLS - 0.5)
    ax.set_ylim(ROWS - 0.5, -0.5)  # row 0 at the top, as in the maze's drawing
    ax.set_xticks(range(COLS), [f"col {c}" for c in range(COLS)])
    ax.set_yticks(range(ROWS), [f"row {r}" for r in range(ROWS)])
    ax.set_aspect("equal")
    ax.set_title(title)


def _cell_label(s: int) -> str:
    return _TERMINAL.get(s, "S  (start)" if s == START else "")


_PI_NAMES = {"uniform": "uniform random π", "greedy": "greedy π = argmax Q*", "epsilon-greedy": "ε-greedy π around Q*",
             "arrows": "the chosen arrows"}


def _pi_arrows(result: MazeValuesResult) -> list[tuple[int, int, float]]:
    """(cell, action, length) of each arrow of pi drawn from the cell's anchor: longer for likelier actions."""
    return [(s, a, 0.08 + 0.14 * float(result.pi[s, a])) for s in LIVE for a in range(len(ACTION_NAMES)) if result.pi[s, a] >= 0.005]


def _unit(a: int) -> tuple[float, float]:
    dx, dy = _ARROW[a]
    return dx / 0.28, dy / 0.28


def _mc_reference(result: MazeValuesResult) -> np.ndarray:
    """2 max_s SE(n), the Monte-Carlo error bar, as 1/sqrt(n) through its value at the last n. Shape: (K,)."""
    last = np.nanmax(result.mc_v_se[-1, list(LIVE)])
    return 2 * last * np.sqrt(result.mc_episodes[-1] / result.mc_episodes)


def plot(result: MazeValuesResult, path: str | Path, sweep: int | None = None) -> Path:
    """V_sweep (default: the last sweep) with the greedy arrows of Q*, Q* per action, V^pi with pi's arrows, Q^pi and
    A^pi per action, V_k and the Bellman residual against k, and the Monte-Carlo estimate of V^pi against episodes."""
    k = result.sweeps if sweep is None else int(sweep)
    if not 0 <= k <= result.sweeps:
        raise ValueError(f"sweep must be in [0, {result.sweeps}], got {k}")
    fig, axes = new_figure(2, 4, width=6.0, height=4.3)
    span = max(np.abs(result.values).max(), np.abs(result.q_star).max(), np.abs(result.v_pi).max(), 1e-9)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-span, vmax=span)
    cmap = "RdYlGn"
    pi_name = _PI_NAMES[result.pi_name]

    # (1) V_k heatmap with the greedy policy of Q*, (3) V^pi with the arrows of pi
    for ax, v, title in ((axes[0], result.values[k], None), (axes[2], result.v_pi, f"V^π of {pi_name} (exact)")):
        im = ax.imshow(v.reshape(ROWS, COLS), cmap=cmap, norm=norm)
        for s in range(ROWS * COLS):
            r, c = divmod(s, COLS)
            ax.text(c, r - 0.3, _cell_label(s), ha="center", va="center", fontsize=9, fontweight="bold")
            ax.text(c, r + 0.02, f"V={v[s]:.2f}", ha="center", va="center", fontsize=11)
        if title is None:
            for s in LIVE:
                r, c = divmod(s, COLS)
                dx, dy = _ARROW[int(result.policy[s])]  # an arrow of the same length whichever way it points
                ax.annotate("", xy=(c + dx / 2, r + 0.3 + dy / 2), xytext=(c - dx / 2, r + 0.3 - dy / 2),
                            arrowprops={"arrowstyle": "-|>", "lw": 2.5, "mutation_scale": 18, "color": "k"})
            converged = " = V*" if np.allclose(v, result.v_star, atol=1e-9) else ""
            title = f"V_{k}{converged} (sweep {k} of {result.sweeps})\narrows: greedy policy argmax_a Q*(s, a)"
        else:
            for s, a, length in _pi_arrows(result):
                r, c = divmod(s, COLS)
                ux, uy = _unit(a)
                ax.annotate("", xy=(c + ux * length, r + 0.3 + uy * length), xytext=(c, r + 0.3),
                            arrowprops={"arrowstyle": "-|>", "lw": 1.8, "mutation_scale": 11, "color": "k"})
            title += "\narrows: π(a|s), longer = likelier"
        _draw_walls(ax)
        _grid_axes(ax, title)
        fig.colorbar(im, ax=ax, label="value (discounted return)")

    # (2) Q*(s, a): each cell split into four triangles, one per action
    ax = axes[1]
    for s in range(ROWS * COLS):
        r, c = divmod(s, COLS)
        corners = {"tl": (c - 0.5, r - 0.5), "tr": (c + 0.5, r - 0.5), "bl": (c - 0.5, r + 0.5), "br": (c + 0.5, r + 0.5)}
        tri = {0: ("tl", "tr"), 1: ("bl", "br"), 2: ("tl", "bl"), 3: ("tr", "br")}
        for a, (p1, p2) in tri.items():
            colour = im.cmap(norm(result.q_star[s, a]))
            ax.add_patch(Polygon([corners[p1], corners[p2], (c, r)], closed=True, facecolor=colour, edgecolor="0.3", lw=0.6))
            dx, dy = _ARROW[a]
            best = not result.terminal[s] and a == result.policy[s]
            ax.text(c + dx * 1.2, r + dy * 1.1, f"{result.q_star[s, a]:.2f}", ha="center", va="center", fontsize=8,
                    fontweight="bold" if best else "normal")
        if result.terminal[s]:
            ax.text(c, r, _TERMINAL[s] + "\n(terminal)", ha="center", va="center", fontsize=8, fontweight="bold",
                    bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
        elif s == START:
            ax.text(c, r, "S", ha="center", va="center", fontsize=9, fontweight="bold")
    _draw_walls(ax)
    _grid_axes(ax, "Q*(s, a) = r + γ V*(s') per action\n(each triangle points the way of its move; bold = greedy)")

    # (4) A^pi(s, a) per live cell and action, with Q^pi and its Monte-Carlo estimate
    ax = axes[3]
    live = list(LIVE)
    a_span = max(np.abs(result.a_pi).max(), 1e-9)
    im_a = ax.imshow(result.a_pi[live], cmap="RdBu", norm=TwoSlopeNorm(vcenter=0.0, vmin=-a_span, vmax=a_span), aspect="auto")
    for i, s in enumerate(live):
        for a in range(len(ACTION_NAMES)):
            ax.text(a, i, f"Q={result.q_pi[s, a]:.2f}\nA={result.a_pi[s, a]:+.2f}\nMC Q={result.mc_q[s, a]:.2f}", ha="center",
                    va="center", fontsize=7, color="w" if abs(result.a_pi[s, a]) > 0.6 * a_span else "k")
    ax.grid(False)
    ax.set_xticks(range(len(ACTION_NAMES)), ACTION_NAMES)
    ax.set_yticks(range(len(live)), [f"s{s}" + (" (start)" if s == START else "") for s in live])
    ax.set_title(f"A^π = Q^π − V^π of {pi_name}\n(Σ_a π(a|s) A^π(s, a) = 0 in every row)")
    fig.colorbar(im_a, ax=ax, label="A^π(s, a)")

    # (5) V_k(s) over sweeps
    ax = axes[4]
    sweeps = np.arange(result.sweeps + 1)
    styles = [{"marker": "o", "ms": 4}, {"marker": "s", "ms": 7, "mfc": "none", "ls": "--"}, {"marker": "^", "ms": 4, "ls": ":"}, {"marker": "D", "ms": 4}]
    colours = {}
    for s, style in zip(LIVE, itertools.cycle(styles)):
        r, c = divmod(s, COLS)
        (line,) = ax.plot(sweeps, result.values[:, s], **style, label=f"s={s} (row {r}, col {c})" + (" start" if s == START else ""))
        colours[s] = line.get_color()
        ax.axhline(result.v_star[s], color=line.get_color(), ls=":", lw=1)
    ax.axvline(k, color="0.4", ls="--", lw=1, label=f"sweep shown: k={k}")
    ax.set_xlabel("value-iteration sweep k")
    ax.set_ylabel("V_k(s)  (dotted: V*(s))")
    ax.set_title(f"V_k converging to V* (γ = {result.gamma:g}; goal/trap cells stay 0)")
    ax.legend(fontsize=8, loc="lower right")

    # (6) Bellman residual over sweeps with the gamma^k contraction bound
    ax = axes[5]
    res = result.bellman_residual
    ax.plot(sweeps, res, marker="o", ms=4, label="max_s |T V_k(s) − V_k(s)|")
    ax.plot(sweeps, res[0] * result.gamma**sweeps, "--", color="0.4", label="γ^k · residual_0 (contraction bound)")
    zero = np.flatnonzero(res == 0.0)
    if zero.size:
        ax.axvline(zero[0], color="tab:green", ls=":", label=f"residual exactly 0 from sweep {zero[0]}")
    ax.set_xlabel("value-iteration sweep k")
    ax.set_ylabel("Bellman residual (reward units)")
    ax.set_title("Bellman residual per sweep")
    ax.legend(fontsize=8)

    # (7) the first-visit Monte-Carlo estimate of V^pi against episodes, +-2 SE, dotted: exact
    ax = axes[6]
    n = result.mc_episodes
    for s in LIVE:
        mean, se = result.mc_v[:, s], result.mc_v_se[:, s]
        ax.plot(n, mean, marker="o", ms=3, color=colours[s], label=f"s={s}")
        ax.fill_between(n, mean - 2 * se, mean + 2 * se, color=colours[s], alpha=0.15, lw=0)
        ax.axhline(result.v_pi[s], color=colours[s], ls=":", lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("episodes n")
    ax.set_ylabel("V^π estimate (dotted: exact V^π)")
    ax.set_title("Monte Carlo: first-visit mean → V^π (dotted)")
    ax.legend(fontsize=8, loc="lower right")

    # (8) its largest error, against the 1/sqrt(n) error bar
    ax = axes[7]
    ax.plot(n, result.mc_error, marker="o", ms=4, label="max_s |V^π estimate − V^π|")
    ax.plot(n, _mc_reference(result), "--", color="0.4", label="2 · max_s SE, ∝ 1/√n")
    ax.set_xscale("log")
    ax.set_xlabel("episodes n")
    ax.set_ylabel("error (reward units)")
    ax.set_title("Monte-Carlo error shrinks as 1/√n")
    ax.legend(fontsize=8)

    fig.suptitle("MazeValueIteration: the seed's 2x3 maze, V* and Q* by value iteration and V^π, Q^π, A^π of a policy π\n"
                 "(S start, G goal +10, T trap −10, thick line: wall)")
    return save_figure(fig, path)


def _wall_shapes(panel: int) -> list[dict]:
    suffix = "" if panel == 1 else str(panel)
    shapes = [{"type": "rect", "xref": f"x{suffix}", "yref": f"y{suffix}", "x0": -0.5, "x1": COLS - 0.5, "y0": -0.5, "y1": ROWS - 0.5,
               "line": {"color": "#000", "width": 3}}]
    for pair in WALLS:
        a, b = sorted(pair)
        (ra, ca), (rb, cb) = divmod(a, COLS), divmod(b, COLS)
        if ca == cb:
            x0, x1, y0, y1 = ca - 0.5, ca + 0.5, (ra + rb) / 2, (ra + rb) / 2
        else:
            x0, x1, y0, y1 = (ca + cb) / 2, (ca + cb) / 2, ra - 0.5, ra + 0.5
        shapes.append({"type": "line", "xref": f"x{suffix}", "yref": f"y{suffix}", "x0": x0, "x1": x1, "y0": y0, "y1": y1,
                       "line": {"color": "#000", "width": 7}})
    return shapes


def _arrow(panel: int, x: float, y: float, ax: float, ay: float, width: float, head: float = 1.0) -> dict:
    suffix = "" if panel == 1 else str(panel)
    return {"x": x, "y": y, "ax": ax, "ay": ay, "xref": f"x{suffix}", "yref": f"y{suffix}", "axref": f"x{suffix}", "ayref": f"y{suffix}",
            "showarrow": True, "arrowhead": 2, "arrowsize": head, "arrowwidth": width, "arrowcolor": "#000", "text": ""}


def figure(result: MazeValuesResult, sweep: int = SWEEPS) -> dict:
    """The live page's figure: V_sweep with the greedy arrows of Q*, Q* per action, V^pi with pi's arrows, A^pi (and Q^pi)
    per action, V_k over sweeps, the Bellman residual, and the Monte-Carlo estimate of V^pi and its error against episodes."""
    k = int(sweep)
    if not 0 <= k <= result.sweeps:
        raise ValueError(f"sweep must be in [0, {result.sweeps}], got {k}")
    span = float(max(np.abs(result.values).max(), np.abs(result.q_star).max(), np.abs(result.v_pi).max(), 1e-9))
    colours = {"colorscale": [[0.0, "#a50026"], [0.25, "#f46d43"], [0.5, "#ffffbf"], [0.75, "#66bd63"], [1.0, "#006837"]],  # RdYlGn
               "zmin": -span, "zmax": span, "showscale": False}
    live = list(LIVE)
    state_names = [f"s{s}{' (start)' if s == START else ''}" for s in live]
    data = []
    for panel, v, name in ((1, result.values[k], f"V_{k}"), (3, result.v_pi, "V^π")):
        suffix = "" if panel == 1 else str(panel)
        cells = [f"{_cell_label(s)}<br>V={v[s]:.2f}" for s in range(ROWS * COLS)]
        data.append({"type": "heatmap", "z": v.reshape(ROWS, COLS), "x": list(range(COLS)), "y": list(range(ROWS)), "name": name,
                     "text": np.array(cells).reshape(ROWS, COLS).tolist(), "texttemplate": "%{text}", "textfont": {"size": 13},
                     "xaxis": f"x{suffix}", "yaxis": f"y{suffix}", **colours})
        if panel == 1:
            data.append({"type": "heatmap", "z": result.q_star[live], "x": list(ACTION_NAMES), "y": state_names, "name": "Q*",
                         "text": [[f"{q:.2f}{' ◀' if a == result.policy[s] else ''}" for a, q in enumerate(result.q_star[s])] for s in live],
                         "texttemplate": "%{text}", "xaxis": "x2", "yaxis": "y2", **colours})
    a_span = float(max(np.abs(result.a_pi).max(), 1e-9))
    data.append({"type": "heatmap", "z": result.a_pi[live], "x": list(ACTION_NAMES), "y": state_names, "name": "A^π = Q^π − V^π",
                 "text": [[f"Q={result.q_pi[s, a]:.2f} (MC {result.mc_q[s, a]:.2f})<br>A={result.a_pi[s, a]:+.2f}"
                           for a in range(len(ACTION_NAMES))] for s in live],
                 "texttemplate": "%{text}", "textfont": {"size": 11}, "xaxis": "x4", "yaxis": "y4", "showscale": False,
                 "colorscale": [[0.0, "#b2182b"], [0.5, "#f7f7f7"], [1.0, "#2166ac"]], "zmin": -a_span, "zmax": a_span})  # RdBu
    sweeps = np.arange(result.sweeps + 1)
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for s, name, colour in zip(live, state_names, palette):
        data.append(trace(sweeps, result.values[:, s], name, panel=5, mode="lines+markers", colour=colour))
    data.append(trace(sweeps, result.bellman_residual, "max_s |T V_k(s) − V_k(s)|", panel=6, mode="lines+markers", colour="tab:blue"))
    data.append(trace(sweeps, result.bellman_residual[0] * result.gamma**sweeps, "γ^k · residual_0 (contraction bound)", panel=6,
                      colour="0.4", dash="dash"))
    n = result.mc_episodes
    for s, name, colour in zip(live, state_names, palette):
        data.append(trace(n, result.mc_v[:, s], f"{name}: V^π estimate", panel=7, mode="lines+markers", colour=colour, legend=False,
                          error_y={"type": "data", "array": 2 * result.mc_v_se[:, s], "visible": True, "thickness": 1}))
        data.append(trace(n[[0, -1]], [result.v_pi[s]] * 2, f"{name}: V^π exact", panel=7, colour=colour, dash="dot", width=1.5,
                          legend=False))
    data.append(trace(n, result.mc_error, "max_s |V^π estimate − V^π|", panel=8, mode="lines+markers", colour="tab:purple"))
    data.append(trace(n, _mc_reference(result), "2 · max_s SE, ∝ 1/√n", panel=8, colour="0.4", dash="dash"))
    converged = " = V*" if np.allclose(result.values[k], result.v_star, atol=1e-9) else ""
    pi_name = _PI_NAMES[result.pi_name]
    layout = panels_layout("The seed's 2x3 maze: value iteration and the values of a policy π (S start, G goal +10, T trap −10, "
                           "thick line: wall)", [
        {"title": f"V_{k}{converged} (sweep {k} of {result.sweeps}); arrows: greedy policy of Q*", "x": "column", "y": "row"},
        {"title": f"Q*(s, a) = r + γ V*(s'), γ = {result.gamma:g} (◀ greedy)", "x": "action", "y": "state"},
        {"title": f"V^π of {pi_name}; arrows: π(a|s)", "x": "column", "y": "row"},
        {"title": "A^π = Q^π − V^π (Q^π exact, and by Monte Carlo)", "x": "action", "y": "state"},
        {"title": "V_k(s) converging to V*", "x": "value-iteration sweep k", "y": "V_k(s)"},
        {"title": "Bellman residual per sweep", "x": "value-iteration sweep k", "y": "residual (reward units)"},
        {"title": "Monte Carlo: mean first-visit return ± 2 SE → V^π (dotted)", "x": "episodes n", "y": "V^π estimate"},
        {"title": "Monte-Carlo error shrinks as 1/√n", "x": "episodes n", "y": "error (reward units)"},
    ], height=420, columns=2)
    for suffix in ("", "3"):
        layout[f"yaxis{suffix}"].update(autorange="reversed", tickvals=list(range(ROWS)), ticktext=[f"row {r}" for r in range(ROWS)],
                                        scaleanchor=f"x{suffix}")
        layout[f"xaxis{suffix}"].update(tickvals=list(range(COLS)), ticktext=[f"col {c}" for c in range(COLS)], showgrid=False)
    layout["yaxis2"]["autorange"] = layout["yaxis4"]["autorange"] = "reversed"
    layout["xaxis7"]["type"] = layout["xaxis8"]["type"] = "log"
    layout["shapes"] = _wall_shapes(1) + _wall_shapes(3) + [vline(k, panel=5), vline(k, panel=6)]
    for s in live:
        r, c = divmod(s, COLS)
        dx, dy = _ARROW[int(result.policy[s])]
        layout["annotations"].append(_arrow(1, c + dx / 2, r + 0.3 + dy / 2, c - dx / 2, r + 0.3 - dy / 2, 2.5))
    for s, a, length in _pi_arrows(result):
        r, c = divmod(s, COLS)
        ux, uy = _unit(a)
        layout["annotations"].append(_arrow(3, c + ux * length, r + 0.3 + uy * length, c, r + 0.3, 2.0, head=0.7))
    return {"data": data, "layout": layout}
