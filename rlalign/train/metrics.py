"""A run's metrics: metrics.jsonl, TensorBoard and Weights & Biases (:class:`MetricsLogger`), the
trackers' packages checked before a run starts, sample tables, and the curves of a metrics.jsonl file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlalign.config import ConfigError

__all__ = [
    "TRACKERS",
    "check_trackers",
    "MetricsLogger",
    "markdown_table",
    "read_metrics",
    "ema",
    "smoothing_weight",
    "plot_curves",
    "plot_metrics",
]


TRACKERS = ("jsonl", "tensorboard", "wandb")
_TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker -> the package it needs (and the rlalign extra of that name)


def check_trackers(report_to: Sequence[str]) -> None:
    """A :class:`ConfigError` naming the ``pip install`` line when a tracker of ``report_to`` lacks its package
    (checked without importing it, so a config loads fast and fails before any run directory is touched)."""
    for tracker in report_to:
        package = _TRACKER_PACKAGES.get(tracker)
        if package is not None and _missing(package):
            raise ConfigError(_missing_message(tracker))


def _missing(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is None  # None too when sys.modules blocks it (set to None)
    except (ImportError, ValueError):
        return True


def _missing_message(tracker: str) -> str:
    return f"report_to includes {tracker!r} but the {_TRACKER_PACKAGES[tracker]} package is not installed: pip install 'rlalign[{tracker}]'"


class MetricsLogger:
    """A run's metrics and sample tables, to its trackers:

    - ``<run_dir>/metrics.jsonl``, always (one ``{"step": s, "time": t, name: value, ...}`` line per
      :meth:`log`; resume, curves.png and the summaries read it);
    - ``"tensorboard"`` in ``report_to``: scalars and text tables in ``<run_dir>/tensorboard``
      (a resumed run's writer hides the events of the steps it redoes: ``purge_step``);
    - ``"wandb"``: a Weights & Biases run named after ``run_dir``, writing under ``<run_dir>/wandb``,
      with ``config``; its id is kept in ``<run_dir>/wandb_id`` so a resumed run continues it. Every
      metric is charted against the logged ``step``. ``WANDB_MODE=offline`` needs no network;
      the project is ``WANDB_PROJECT`` (default ``rlalign``).

    and a rich progress bar when ``progress``. ``enabled=False`` (every rank but 0 under torchrun)
    writes and shows nothing. Close it (or use it as a context manager) to flush and finish the trackers.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        progress: bool = True,
        report_to: Sequence[str] = ("jsonl",),
        description: str = "training",
        start_step: int = 0,
        enabled: bool = True,
        config: dict[str, Any] | None = None,
    ):
        self.enabled = enabled
        self._writer = self._wandb = self._progress = self._file = None
        if not enabled:
            return
        unknown = sorted(set(report_to) - set(TRACKERS))
        if unknown:
            raise ConfigError(f"unknown trackers {unknown} in report_to; choose from {list(TRACKERS)}")
        check_trackers(report_to)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        try:
            if "tensorboard" in report_to:
                self._writer = _tensorboard_writer(self.run_dir / "tensorboard", start_step)
            if "wandb" in report_to:
                self._wandb = _wandb_run(self.run_dir, config)
        except BaseException:
            self.close()
            raise
        if progress:  # rich imported here: a run without a bar (notebooks, ranks but 0, benchmarks) does without its imports
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[summary]}")
            )
            self._task = self._progress.add_task(description, total=total_steps, completed=start_step, summary="")
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float], summary_keys: tuple[str, ...] = ()) -> None:
        """Append one line, send the scalars to the trackers at ``step``; advance the bar to ``step + 1``
        and show ``summary_keys`` next to it."""
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _json_number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), step)
        if self._wandb is not None:
            self._wandb.log({**{k: float(v) for k, v in metrics.items()}, "step": step})
        if self._progress is not None:
            summary = "  ".join(f"{k}={metrics[k]:.4g}" for k in summary_keys if k in metrics)
            self._progress.update(self._task, completed=step + 1, summary=summary)

    def log_samples(self, step: int, name: str, rows: list[dict]) -> None:
        """Show ``rows`` (e.g. prompts, completions, rewards: one dict per row, the columns in order of
        first appearance) as the table ``name`` at ``step``: TensorBoard text (a markdown table, tag
        ``<name>/text_summary``), a W&B table. Nothing goes to metrics.jsonl: the caller keeps its own JSONL file."""
        if not self.enabled or not rows:
            return
        columns = list(dict.fromkeys(key for row in rows for key in row))
        if self._writer is not None:
            self._writer.add_text(name, markdown_table(columns, rows), step)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=columns, data=[[_table_cell(row.get(c)) for c in columns] for row in rows], allow_mixed_types=True)
            self._wandb.log({name: table, "step": step})

    def close(self, failed: bool = False) -> None:
        """Stop the bar, flush and close metrics.jsonl and the TensorBoard writer, finish the W&B run
        (``failed``: marked as exited with an error)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def _tensorboard_writer(log_dir: Path, start_step: int):
    """A SummaryWriter; resuming at ``start_step`` > 0 hides the older events of steps >= it (they are redone)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(_missing_message("tensorboard")) from None
    return SummaryWriter(str(log_dir), purge_step=start_step if start_step > 0 else None)


def _wandb_run(run_dir: Path, config: dict[str, Any] | None):
    """``wandb.init`` for ``run_dir``: a new run whose id is written to ``<run_dir>/wandb_id``, or the
    run of that id continued (``resume="allow"``)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(_missing_message("wandb")) from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits, unique within the project
        id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "rlalign"), name=run_dir.name, dir=str(run_dir), config=config or {}, id=run_id, resume="allow",
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")  # charts against the run's step (also -1, the record before the first), not W&B's own counter
    return run


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    """``rows`` as a markdown table with ``columns`` (missing cells empty; ``|`` escaped, line breaks as ``<br>``)."""

    def cell(value) -> str:
        text = "" if value is None else value if isinstance(value, str) else json.dumps(value, default=str)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _table_cell(value):
    """A W&B table cell: strings, numbers, booleans and None as they are, anything else as JSON text."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value, default=str)


def _json_number(value: float) -> float | None:
    """``value`` as a float, or None (JSON null) when it is NaN or infinite: metrics.jsonl stays strict JSON."""
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing:

        m_t = w * m_{t-1} + (1 - w) * x_t,  m_0 = 0,   shown as  m_t / (1 - w^t)

    so the first point is x_1 (not pulled towards 0) and ``weight`` 0 returns ``values``."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"weight must be in [0, 1), got {weight}")
    out, m = [], 0.0
    for t, x in enumerate(values, start=1):
        m = weight * m + (1.0 - weight) * x
        out.append(m / (1.0 - weight**t))
    return out


SMOOTH_MIN_POINTS = 20  # a curve of at most this many points (an eval metric logged every few hundred steps) is drawn point by point


def smoothing_weight(n: int) -> float:
    """The EMA weight of a curve of ``n`` points: an averaging window of about n / 20 points
    (1 - w = 20 / n), none up to ``SMOOTH_MIN_POINTS`` = 20 points, at most 0.99 (a 100-point window)."""
    return min(0.99, max(0.0, 1.0 - SMOOTH_MIN_POINTS / max(n, 1)))


def plot_curves(
    series: dict[str, tuple[Sequence[float], Sequence[float]]], out: str | Path, title: str | None = None, xlabel: str = "step", smooth: bool = True,
) -> Path:
    """One panel per ``{name: (xs, ys)}``, saved as PNG at ``out``: a curve of many points as its
    exponential moving average (:func:`ema`, weight :func:`smoothing_weight`) over the raw values drawn
    light behind it; a sparse one (at most ``SMOOTH_MIN_POINTS``, e.g. evaluations: with markers), or
    every one when ``smooth`` is False (deterministic curves), as its points joined. Every panel is
    labelled (``xlabel``; the name) and spans the x range of them all; ``title`` heads the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_x = [x for xs, _ in series.values() for x in xs]
    if not all_x:
        raise ValueError("no curves to plot")
    x_lo, x_hi = min(all_x), max(all_x)
    margin = 0.03 * (x_hi - x_lo) or 0.5
    ncols = 1 if len(series) <= 3 else 2
    nrows = math.ceil(len(series) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 2.6 * nrows + (0.4 if title else 0)), squeeze=False)
    for ax in axes.ravel()[len(series):]:
        ax.remove()
    legend_done = False
    for ax, (name, (xs, ys)) in zip(axes.ravel(), series.items()):
        if smooth and len(ys) > SMOOTH_MIN_POINTS:
            ax.plot(xs, ys, color="C0", alpha=0.25, linewidth=0.8, label="raw")
            ax.plot(xs, ema(ys, smoothing_weight(len(ys))), color="C0", linewidth=1.6, label="smoothed (EMA)")
            if not legend_done:
                ax.legend(fontsize=7, loc="best")
                legend_done = True
        else:
            ax.plot(xs, ys, color="C1", marker="o" if len(ys) <= SMOOTH_MIN_POINTS else None, markersize=4, linewidth=1.0)
        ax.set_xlim(x_lo - margin, x_hi + margin)  # a metric logged at a few steps (evaluations) is placed within the whole run
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_metrics(path: str | Path, keys: Sequence[str], out: str | Path, title: str | None = None) -> Path:
    """curves.png of a metrics.jsonl file: one panel per metric in ``keys`` against step (:func:`plot_curves`),
    each from the steps where it was logged (an eval metric: its evaluation steps). A key never logged is a KeyError."""
    records = read_metrics(path)
    series = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if not points:
            raise KeyError(f"metric {key!r} is not in {path}")
        steps, values = zip(*points)
        series[key] = (list(steps), list(values))
    return plot_curves(series, out, title)
