"""What every explorer shares: a Figure on the Agg canvas, and writing the numbers behind it.

Figures are built with ``matplotlib.figure.Figure`` (which renders through Agg) rather than
``pyplot``, so no global figure state and no GUI backend is ever touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

__all__ = ["new_figure", "save_figure", "to_jsonable", "write_json", "CLIP_COLOUR", "POS_COLOUR", "NEG_COLOUR"]

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


def save_figure(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


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
