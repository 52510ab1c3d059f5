"""What every explorer shares: a Figure on the Agg canvas, and writing the numbers behind it.

Figures are built with ``matplotlib.figure.Figure`` (which renders through Agg) rather than
``pyplot``, so no global figure state and no GUI backend is ever touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from matplotlib.figure import Figure

__all__ = [
    "new_figure", "save_figure", "to_jsonable", "write_json", "trace", "panels_layout", "band", "vline", "grid_index", "CLIP_COLOUR", "POS_COLOUR", "NEG_COLOUR",
]

POS_COLOUR = "tab:blue"  # A > 0
NEG_COLOUR = "tab:red"  # A < 0
CLIP_COLOUR = "0.85"  # shaded trust region [1 - eps, 1 + eps]


def new_figure(ncols: int, nrows: int = 1, width: float = 5.2, height: float = 4.2) -> tuple[Figure, np.ndarray]:
    """A constrained-layout Figure with an (nrows, ncols) grid of axes, returned flat."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained", dpi=110)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def save_figure(fig: Figure, path: str | Path | BinaryIO) -> Path | BinaryIO:
    """Write ``fig`` as PNG to ``path`` (creating its folder), or into a binary buffer."""
    if hasattr(path, "write"):
        fig.savefig(path, format="png")
        return path
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def grid_index(grid: np.ndarray, value: float, what: str) -> int:
    """Index of ``value`` in a computed ``grid`` (lambdas, betas, offsets), or ValueError naming ``what``."""
    if not np.any(np.isclose(grid, value)):
        raise ValueError(f"{what} {value:g} is not one of the computed {what}s {np.asarray(grid).tolist()}")
    return int(np.argmin(np.abs(grid - value)))


# ---------------------------------------------------------------- the live page's figures (plotly.js, plain dicts)

PLOTLY_COLOURS = {  # matplotlib's tab10, so the live page and the PNG use the same colours
    "tab:blue": "#1f77b4", "tab:orange": "#ff7f0e", "tab:green": "#2ca02c", "tab:red": "#d62728", "tab:purple": "#9467bd",
    "tab:brown": "#8c564b", "tab:pink": "#e377c2", "tab:gray": "#7f7f7f", "tab:olive": "#bcbd22", "tab:cyan": "#17becf",
    "k": "#000000", "0.4": "#666666", "0.5": "#808080",
}


def trace(x: Any, y: Any, name: str, panel: int = 1, mode: str = "lines", colour: str | None = None, dash: str | None = None,
          width: float = 2.0, symbol: str | None = None, legend: bool = True, **extra: Any) -> dict[str, Any]:
    """One plotly scatter trace on subplot ``panel`` (1-based), x and y as arrays or lists."""
    suffix = "" if panel == 1 else str(panel)
    out: dict[str, Any] = {"type": "scatter", "x": x, "y": y, "name": name, "mode": mode, "xaxis": f"x{suffix}",
                           "yaxis": f"y{suffix}", "showlegend": legend, "legendgroup": name}
    colour = PLOTLY_COLOURS.get(colour, colour)
    if "lines" in mode:
        out["line"] = {"width": width, **({"color": colour} if colour else {}), **({"dash": dash} if dash else {})}
    if "markers" in mode:
        out["marker"] = {"size": 7, **({"color": colour} if colour else {}), **({"symbol": symbol} if symbol else {})}
    return {**out, **extra}


def panels_layout(title: str, panels: list[dict[str, Any]], height: int = 480, columns: int | None = None) -> dict[str, Any]:
    """A plotly layout of panels in a grid of ``columns`` (default: one row); each panel: {"title", "x", "y"} and
    optional "xrange", "yrange", "ylog"."""
    n = len(panels)
    columns = columns or n
    rows = -(-n // columns)
    xgap, ygap = (0.07 if columns > 1 else 0.0), (0.16 if rows > 1 else 0.0)
    width, tall = (1.0 - xgap * (columns - 1)) / columns, (1.0 - ygap * (rows - 1)) / rows
    layout: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 15}}, "height": height * rows, "margin": {"t": 80, "l": 60, "r": 20, "b": 60},
        "legend": {"orientation": "h", "y": -0.22 / rows, "font": {"size": 11}}, "hovermode": "closest", "annotations": [],
    }
    for i, panel in enumerate(panels, start=1):
        suffix = "" if i == 1 else str(i)
        row, col = divmod(i - 1, columns)
        left, top = col * (width + xgap), 1.0 - row * (tall + ygap)
        layout[f"xaxis{suffix}"] = {"domain": [left, left + width], "title": {"text": panel["x"]}, "anchor": f"y{suffix}",
                                    "gridcolor": "#e5e5e5", "zeroline": False, **({"range": panel["xrange"]} if "xrange" in panel else {})}
        layout[f"yaxis{suffix}"] = {"domain": [top - tall, top], "title": {"text": panel["y"]}, "anchor": f"x{suffix}", "gridcolor": "#e5e5e5",
                                    **({"type": "log"} if panel.get("ylog") else {}), **({"range": panel["yrange"]} if "yrange" in panel else {})}
        layout["annotations"].append({"text": f"<b>{panel['title']}</b>", "x": left + width / 2, "y": top, "xref": "paper", "yref": "paper",
                                      "xanchor": "center", "yanchor": "bottom", "showarrow": False, "font": {"size": 13}})
    return layout


def band(x0: float, x1: float, panel: int = 1, colour: str = "#d9d9d9", opacity: float = 0.6) -> dict[str, Any]:
    """A vertical shaded band [x0, x1] over the whole height of ``panel`` (a layout shape)."""
    suffix = "" if panel == 1 else str(panel)
    return {"type": "rect", "xref": f"x{suffix}", "yref": f"y{suffix} domain", "x0": x0, "x1": x1, "y0": 0, "y1": 1,
            "fillcolor": colour, "opacity": opacity, "line": {"width": 0}, "layer": "below"}


def vline(x: float, panel: int = 1, colour: str = "#666666", dash: str = "dot") -> dict[str, Any]:
    suffix = "" if panel == 1 else str(panel)
    return {"type": "line", "xref": f"x{suffix}", "yref": f"y{suffix} domain", "x0": x, "x1": x, "y0": 0, "y1": 1,
            "line": {"color": colour, "width": 1.2, "dash": dash}}


def to_jsonable(value: Any) -> Any:
    """Dataclasses, arrays, tensors and numpy scalars -> plain JSON types (NaN/inf -> None)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def write_json(result: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(result), indent=1) + "\n")
    return path
