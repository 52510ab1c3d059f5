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
from rlalign.classic.value_iteration import tabular_model, value_iteration
from rlalign.explore._common import new_figure, panels_layout, save_figure, trace, vline
from rlalign.explore.params import Param

SUMMARY = "2x3 maze: V* heatmap with greedy-policy arrows, Q* per action, and V_k over value-iteration sweeps"

ACTION_NAMES = ("up", "down", "left", "right")  # the maze's action order (MOVES)
_ARROW = {0: (0.0, -0.28), 1: (0.0, 0.28), 2: (-0.28, 0.0), 3: (0.28, 0.0)}  # (dx, dy) with row 0 at the top
_TERMINAL = {GOAL: "G  +10", TRAP: "T  -10"}
SWEEPS = 30

PARAMS = (
    Param("sweep", "value-iteration sweep k", 1, 0, SWEEPS, 1, kind="int", stage="figure"),
    Param("gamma", "discount γ", 0.9, 0.5, 0.99, 0.01),
)
EQUATIONS = (
    ("the Bellman optimality backup, one sweep", r"$V_{k+1}(s) = \max_a \left[ r(s, a) + \gamma \sum_{s'} p(s'\,|\,s, a)\, V_k(s') \right],\quad V_0 = 0$"),
    ("its fixed point and the greedy policy", r"$Q^*(s, a) = r(s, a) + \gamma\, V^*(s'),\qquad \pi^*(s) = \arg\max_a Q^*(s, a)$"),
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


def compute(gamma: float = 0.9, sweeps: int = SWEEPS) -> MazeValuesResult:
    """Run ``sweeps`` value-iteration sweeps on the maze from V_0 = 0 and solve it with ``value_iteration``."""
    if sweeps < 1:
        raise ValueError("sweeps must be >= 1")
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
    v_star, q_star, policy = value_iteration(P, gamma)
    # ||V_k - V*|| <= gamma^k ||V_0 - V*||: the sweeps are value iteration's, and converged ones equal V*
    bound = gamma ** np.arange(sweeps + 1) * np.abs(v_star).max() + 1e-9
    assert np.all(np.abs(values - v_star).max(axis=1) <= bound), "per-sweep values disagree with value_iteration"
    terminal = np.array([float(all(done for _, _, _, done in P[s][0])) for s in range(n_s)])
    return MazeValuesResult(
        values=values,
        bellman_residual=residual,
        q_star=q_star,
        v_star=v_star,
        policy=policy,
        reward=reward,
        next_state=prob.argmax(axis=2),
        terminal=terminal,
        gamma=float(gamma),
        sweeps=int(sweeps),
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


def plot(result: MazeValuesResult, path: str | Path, sweep: int | None = None) -> Path:
    """Heatmap of V_sweep (default: the last sweep) with the greedy arrows of Q*, Q* per action, and V_k, residual vs k."""
    k = result.sweeps if sweep is None else int(sweep)
    if not 0 <= k <= result.sweeps:
        raise ValueError(f"sweep must be in [0, {result.sweeps}], got {k}")
    fig, axes = new_figure(2, 2, width=6.0, height=4.3)
    span = max(np.abs(result.values).max(), np.abs(result.q_star).max(), 1e-9)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-span, vmax=span)
    cmap = "RdYlGn"

    # (1) V_k heatmap with the greedy policy of Q*
    ax = axes[0]
    v = result.values[k]
    im = ax.imshow(v.reshape(ROWS, COLS), cmap=cmap, norm=norm)
    for s in range(ROWS * COLS):
        r, c = divmod(s, COLS)
        ax.text(c, r - 0.3, _cell_label(s), ha="center", va="center", fontsize=9, fontweight="bold")
        ax.text(c, r + 0.02, f"V={v[s]:.2f}", ha="center", va="center", fontsize=11)
        if not result.terminal[s]:
            dx, dy = _ARROW[int(result.policy[s])]  # an arrow of the same length whichever way it points
            ax.annotate("", xy=(c + dx / 2, r + 0.3 + dy / 2), xytext=(c - dx / 2, r + 0.3 - dy / 2),
                        arrowprops={"arrowstyle": "-|>", "lw": 2.5, "mutation_scale": 18, "color": "k"})
    _draw_walls(ax)
    converged = " = V*" if np.allclose(v, result.v_star, atol=1e-9) else ""
    _grid_axes(ax, f"V_{k}{converged} (sweep {k} of {result.sweeps})\narrows: greedy policy argmax_a Q*(s, a)")
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

    # (3) V_k(s) over sweeps
    ax = axes[2]
    sweeps = np.arange(result.sweeps + 1)
    styles = itertools.cycle([{"marker": "o", "ms": 4}, {"marker": "s", "ms": 7, "mfc": "none", "ls": "--"}, {"marker": "^", "ms": 4, "ls": ":"}, {"marker": "D", "ms": 4}])
    for s in range(ROWS * COLS):
        if result.terminal[s]:
            continue
        r, c = divmod(s, COLS)
        (line,) = ax.plot(sweeps, result.values[:, s], **next(styles), label=f"s={s} (row {r}, col {c})" + (" start" if s == START else ""))
        ax.axhline(result.v_star[s], color=line.get_color(), ls=":", lw=1)
    ax.axvline(k, color="0.4", ls="--", lw=1, label=f"sweep shown: k={k}")
    ax.set_xlabel("value-iteration sweep k")
    ax.set_ylabel("V_k(s)  (dotted: V*(s))")
    ax.set_title(f"V_k converging to V* (γ = {result.gamma:g}; goal/trap cells stay 0)")
    ax.legend(fontsize=8, loc="lower right")

    # (4) Bellman residual over sweeps with the gamma^k contraction bound
    ax = axes[3]
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

    fig.suptitle("MazeValueIteration: the seed's 2x3 maze solved by value iteration (S start, G goal +10, T trap −10, thick line: wall)")
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


def figure(result: MazeValuesResult, sweep: int = SWEEPS) -> dict:
    """The live page's figure: V_sweep with the greedy arrows of Q*, Q* per action, V_k over sweeps, the Bellman residual."""
    k = int(sweep)
    if not 0 <= k <= result.sweeps:
        raise ValueError(f"sweep must be in [0, {result.sweeps}], got {k}")
    span = float(max(np.abs(result.values).max(), np.abs(result.q_star).max(), 1e-9))
    v = result.values[k]
    cells = [f"{_cell_label(s)}<br>V={v[s]:.2f}" for s in range(ROWS * COLS)]
    colours = {"colorscale": [[0.0, "#a50026"], [0.25, "#f46d43"], [0.5, "#ffffbf"], [0.75, "#66bd63"], [1.0, "#006837"]],  # RdYlGn
               "zmin": -span, "zmax": span, "showscale": False}
    data = [{"type": "heatmap", "z": v.reshape(ROWS, COLS), "x": list(range(COLS)), "y": list(range(ROWS)), "name": f"V_{k}",
             "text": np.array(cells).reshape(ROWS, COLS).tolist(), "texttemplate": "%{text}", "textfont": {"size": 13},
             **colours}]
    live = [s for s in range(ROWS * COLS) if not result.terminal[s]]
    state_names = [f"s{s}{' (start)' if s == START else ''}" for s in live]
    data.append({"type": "heatmap", "z": result.q_star[live], "x": list(ACTION_NAMES), "y": state_names, "name": "Q*",
                 "text": [[f"{q:.2f}{' ◀' if a == result.policy[s] else ''}" for a, q in enumerate(result.q_star[s])] for s in live],
                 "texttemplate": "%{text}", "xaxis": "x2", "yaxis": "y2", **colours})
    sweeps = np.arange(result.sweeps + 1)
    for s, name in zip(live, state_names):
        data.append(trace(sweeps, result.values[:, s], name, panel=3, mode="lines+markers"))
    data.append(trace(sweeps, result.bellman_residual, "max_s |T V_k(s) − V_k(s)|", panel=4, mode="lines+markers", colour="tab:blue"))
    data.append(trace(sweeps, result.bellman_residual[0] * result.gamma**sweeps, "γ^k · residual_0 (contraction bound)", panel=4,
                      colour="0.4", dash="dash"))
    converged = " = V*" if np.allclose(v, result.v_star, atol=1e-9) else ""
    layout = panels_layout("The seed's 2x3 maze solved by value iteration (S start, G goal +10, T trap −10, thick line: wall)", [
        {"title": f"V_{k}{converged} (sweep {k} of {result.sweeps}); arrows: greedy policy of Q*", "x": "column", "y": "row"},
        {"title": f"Q*(s, a) = r + γ V*(s'), γ = {result.gamma:g} (◀ greedy)", "x": "action", "y": "state"},
        {"title": "V_k(s) converging to V*", "x": "value-iteration sweep k", "y": "V_k(s)"},
        {"title": "Bellman residual per sweep", "x": "value-iteration sweep k", "y": "residual (reward units)"},
    ], height=420, columns=2)
    layout["yaxis"].update(autorange="reversed", tickvals=list(range(ROWS)), ticktext=[f"row {r}" for r in range(ROWS)], scaleanchor="x")
    layout["xaxis"].update(tickvals=list(range(COLS)), ticktext=[f"col {c}" for c in range(COLS)], showgrid=False)
    layout["yaxis2"]["autorange"] = "reversed"
    layout["shapes"] = _wall_shapes(1) + [vline(k, panel=3), vline(k, panel=4)]
    for s in live:
        r, c = divmod(s, COLS)
        dx, dy = _ARROW[int(result.policy[s])]
        layout["annotations"].append({"x": c + dx / 2, "y": r + 0.3 + dy / 2, "ax": c - dx / 2, "ay": r + 0.3 - dy / 2, "xref": "x",
                                      "yref": "y", "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 2, "arrowwidth": 2.5,
                                      "arrowcolor": "#000", "text": ""})
    return {"data": data, "layout": layout}
