"""The building blocks every trainer uses: model and optimiser configs, seeding and RNG states, the
AdamW schedule, metrics logging (metrics.jsonl, TensorBoard, Weights & Biases) and curves. The run lifecycle
built from them (start, resume, step loop, checkpoints, ``final/``) is :mod:`rlalign.train.loop`.

The checkpoint directory format is :mod:`rlalign.train.checkpoints`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, TypeAdapter, model_validator
from transformers import AutoConfig

from rlalign.config import Config, ConfigError
from rlalign.lm.encoding import encode_prompts, render_prompt
from rlalign.lm.models import LoraConfig, load_policy, load_tokenizer, resolve_model_path
from rlalign.lm.rewards import score_completions
from rlalign.lm.sampling import SamplingParams, sample

__all__ = [
    "OptimConfig",
    "TinyModelConfig",
    "ModelConfig",
    "RunConfig",
    "check_output_dir",
    "prepare_model_path",
    "is_adapter_dir",
    "merge_adapter",
    "batch_order",
    "set_seed",
    "autocast_context",
    "forward_precision",
    "rng_state",
    "restore_rng_state",
    "make_optimizer",
    "TRACKERS",
    "check_trackers",
    "MetricsLogger",
    "markdown_table",
    "read_metrics",
    "ema",
    "smoothing_weight",
    "plot_curves",
    "plot_metrics",
    "generation_eval",
    "greedy_eval",
]

ADAPTER_CONFIG = "adapter_config.json"  # what peft writes beside a saved adapter
MERGED_MARKER = "rlalign_merged_adapter.json"  # which adapter a merged base_model/ was made from

class OptimConfig(Config):
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio`` * lr."""

    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam beta1, beta2")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 over this many steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of lr (cosine decay); 1 = constant")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this value; null = no clipping")


def autocast_context(autocast: str, model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A fresh ``torch.autocast(bfloat16)`` on ``model``'s device when ``autocast`` is ``"bfloat16"``
    (:attr:`ModelConfig.autocast`), a no-op for ``"none"``. Within one context the bfloat16 copies of
    the weights are cast once (the autocast cache), so a whole sampling loop reads half the bytes a
    float32 one does."""
    if autocast not in ("none", "bfloat16"):
        raise ValueError(f"autocast must be 'none' or 'bfloat16', got {autocast!r}")
    if autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)


def forward_precision(model_cfg: ModelConfig, model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """:func:`autocast_context` of ``model_cfg.autocast``."""
    return autocast_context(model_cfg.autocast, model)


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and all CUDA devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors and plain containers (``weights_only``-loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def make_optimizer(params, cfg: OptimConfig, total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable ``params`` and its schedule:

        lr(s) = lr * s / warmup                                           for s < warmup
        lr(s) = lr * (m + (1 - m) * (1 + cos(pi * progress)) / 2)         after, m = min_lr_ratio
    """
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters")
    # the fused kernel (CPU and CUDA) updates every tensor in one pass instead of a Python loop over them
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None)
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))  # a Python float: the state stays weights_only-loadable

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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


class TinyModelConfig(Config):
    """Shape of the recipe's tiny Llama, built when no model path is given."""

    hidden_size: int = Field(128, ge=8, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, description="number of decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (hidden_size must be divisible by it)")
    intermediate_size: int = Field(256, ge=8, description="width of the MLP")
    seed: int = Field(0, description="seed of the random initialisation")


class ModelConfig(Config):
    """Which checkpoint to start from and how to hold it."""

    path: str | None = Field(
        None, description="HF checkpoint dir, Hub id, or a LoRA adapter dir (adapter_config.json: see adapter); null = build the tiny recipe model in <output_dir>/base_model"
    )
    adapter: Literal["merge", "train"] = Field(
        "merge", description="when path is a LoRA adapter dir: merge it into its base and train the merged model (fresh adapters if lora is set), "
        "or keep training that adapter; either way the reference, critic and reward-model backbone start from base + adapter"
    )
    gguf_file: str | None = Field(None, description="a .gguf file inside path to load instead of safetensors")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of all weights (policy models only)")
    autocast: Literal["none", "bfloat16"] = Field(
        "none", description="run forwards under torch.autocast in bfloat16 with float32 master weights (CPUs with AMX / AVX512-BF16, GPUs)"
    )
    attn_implementation: str | None = Field(
        None, description="transformers attention kernel for every model of the run (null = its default, sdpa); eager is faster for short sequences on CPU"
    )
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="under torchrun: ddp = a full copy per process (DDP); fsdp = parameters, gradients and optimiser state sharded (FSDP2)"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in backward instead of storing them: the same gradients, less memory, about a third more compute"
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="shape of the tiny model built when path is null")

    @model_validator(mode="after")
    def _adapter(self) -> ModelConfig:
        if self.adapter == "train" and self.lora is not None:
            raise ValueError("model.adapter: train keeps training the saved adapter; model.lora would add fresh ones on top: set one of them")
        return self


def check_output_dir(output_dir: str) -> None:
    """An empty ``output_dir`` would write the run into the current directory: refused."""
    if not output_dir.strip():
        raise ValueError("output_dir is empty: give the directory the run writes its files to")


class RunConfig(Config):
    """The fields of every LM training run (rlalign.train.loop): where it writes, its seed and
    threads, its starting model, how it saves and shows progress. Each trainer's config extends it."""

    output_dir: str = Field("runs/run", description="run directory: metrics.jsonl, checkpoints/, final/")
    seed: int = Field(0, description="seed of Python, NumPy and torch, of the data order and of the sampling / shuffling generator")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (null = torch's default)")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(), description="starting checkpoint (e.g. an SFT run's final/), dtype, device, LoRA")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    keep_last: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    progress: bool = Field(True, description="show a progress bar with the step's headline metrics")
    report_to: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="trackers of the metrics: jsonl = <output_dir>/metrics.jsonl, which is always written (resume, curves.png and the "
        "summaries read it); tensorboard = event files in <output_dir>/tensorboard (pip install 'rlalign[tensorboard]'); "
        "wandb = a Weights & Biases run (pip install 'rlalign[wandb]'; project WANDB_PROJECT, default rlalign; WANDB_MODE=offline works without network)",
    )
    plots: bool = Field(True, description="write curves.png of the headline metrics at the end")
    overwrite: bool = Field(False, description="start afresh in an output_dir that holds a run, deleting its contents first (otherwise an error)")
    save_merged: bool = Field(
        False, description="LoRA runs: write final/ as the full model (adapter merged into its base, loadable with AutoModelForCausalLM) instead of the adapter alone"
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_tensorboard(cls, data: Any) -> Any:
        """``tensorboard: true`` (the field report_to replaced, in older YAMLs and checkpoints) adds
        tensorboard to report_to; ``tensorboard: false`` adds nothing."""
        if isinstance(data, dict) and "tensorboard" in data:
            data = dict(data)
            if TypeAdapter(bool).validate_python(data.pop("tensorboard")):
                report_to = list(data.get("report_to") or ["jsonl"])
                data["report_to"] = report_to + ["tensorboard"] * ("tensorboard" not in report_to)
        return data

    @model_validator(mode="after")
    def _output_dir(self) -> RunConfig:
        check_output_dir(self.output_dir)
        check_trackers(self.report_to)  # a missing package fails here, before the run directory is touched
        return self


def is_adapter_dir(path: str | Path) -> bool:
    """A directory holding a saved LoRA adapter (peft's ``adapter_config.json``), not a full model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def merge_adapter(adapter_dir: Path, out_dir: Path) -> Path:
    """Write ``adapter_dir``'s base with the adapter merged into it, a full checkpoint in the base's
    dtype with the tokenizer (the adapter's, else the base's), to ``out_dir`` (atomically; reused
    when it already holds this adapter's merge). Returns ``out_dir``."""
    from rlalign.train.checkpoints import replace_dir

    marker = {"merged_adapter": str(adapter_dir.resolve())}
    if (out_dir / MERGED_MARKER).is_file() and json.loads((out_dir / MERGED_MARKER).read_text()) == marker:
        return out_dir
    base_path = Path(json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])
    merged = load_policy(adapter_dir).merge_and_unload()
    stored = AutoConfig.from_pretrained(str(resolve_model_path(base_path))).dtype or torch.float32
    tmp = out_dir.parent / f".tmp_{out_dir.name}_{os.getpid()}"
    merged.to(stored).save_pretrained(tmp)
    load_tokenizer(adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else resolve_model_path(base_path)).save_pretrained(tmp)
    (tmp / MERGED_MARKER).write_text(json.dumps(marker))
    replace_dir(tmp, out_dir)
    return out_dir


def prepare_model_path(cfg: ModelConfig, output_dir: str | Path) -> Path:
    """The run's base checkpoint: ``cfg.path`` (a directory, or a Hugging Face Hub id through the Hub
    cache); for a LoRA adapter directory its base with the adapter merged, written once to
    ``<output_dir>/base_model`` (the previous stage's full model: the reference, the critic's and a
    reward model's start); with no path the tiny recipe model built there."""
    if cfg.path is not None:
        path = resolve_model_path(cfg.path)
        if not path.is_dir():
            raise ConfigError(f"model.path {cfg.path!r} is not a directory (nor a Hugging Face Hub id)")
        if is_adapter_dir(path):
            return merge_adapter(path.resolve(), Path(output_dir).resolve() / "base_model")
        return path.resolve()  # absolute: a saved LoRA adapter records its base by this path
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint

    path = Path(output_dir).resolve() / "base_model"
    if not (path / "config.json").is_file():
        t = cfg.tiny
        spec = TinyModelSpec(hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads, num_kv_heads=t.num_heads, intermediate_size=t.intermediate_size)
        build_tiny_checkpoint(path, spec, seed=t.seed)
    return path


def batch_order(num_examples: int, position: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the examples at data positions [position, position + batch_size).

    Epoch e = position // N visits the examples in a permutation drawn from seed + e, so the
    order depends only on the position: a resumed run continues where the original stopped.
    """
    permutations: dict[int, list[int]] = {}
    out = []
    for p in range(position, position + batch_size):
        epoch, offset = divmod(p, num_examples)
        if epoch not in permutations:
            permutations[epoch] = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        out.append(permutations[epoch][offset])
    return out


@torch.no_grad()
def generation_eval(
    model, tokenizer, prompts: list, reward_fn, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 64, seed: int = 0,
    columns: dict[str, list] | None = None,
) -> tuple[float, list[str]]:
    """Mean ``reward_fn`` of completions of ``prompts`` (text or messages), and the completions;
    ``columns``: one value per prompt each (e.g. ``answer``), passed to the reward (TRL's convention).

    ``temperature=0`` is greedy; otherwise draws use a private generator seeded with ``seed``, so
    an evaluation neither consumes nor depends on the global RNG (a resumed run stays identical).
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    texts = [render_prompt(tokenizer, p) for p in prompts]
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        ids = encode_prompts(tokenizer, prompts[start : start + batch_size])
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        rollout = sample(model, ids, params, tokenizer.pad_token_id, [tokenizer.eos_token_id], generator=generator)
        completions.extend(rollout.decode_completions(tokenizer))
    model.train(was_training)
    scores = score_completions([reward_fn], texts, completions, columns=columns)
    return float(scores.mean()), completions


def greedy_eval(model, tokenizer, prompts: list, reward_fn, max_new_tokens: int, batch_size: int = 64) -> tuple[float, list[str]]:
    """:func:`generation_eval` with greedy decoding."""
    return generation_eval(model, tokenizer, prompts, reward_fn, max_new_tokens, 0.0, batch_size)
