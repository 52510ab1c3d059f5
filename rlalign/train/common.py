"""The building blocks every trainer uses: model and optimiser configs, seeding and RNG states, the
AdamW schedule, metrics logging and curves, the checkpoint directory format. The run lifecycle
built from them (start, resume, step loop, checkpoints, ``final/``) is :mod:`rlalign.train.loop`.

Checkpoints are directories ``<run_dir>/checkpoints/step_<n>`` (n steps done) holding ``model/``
(``save_pretrained``: safetensors weights, config, tokenizer when given), ``optimizer.pt`` (an
optimizer / scheduler given to :func:`save_checkpoint`; the trainers keep theirs in ``extra``
instead, one entry per updater), ``trainer_state.pt`` (step, Python / NumPy / torch RNG states,
data position, extra state: all tensors and plain containers, read back with
``torch.load(weights_only=True)``), ``config.yaml`` and ``checkpoint.json`` (written last; its
presence is what makes a directory a checkpoint). A checkpoint is written in a temporary sibling
directory and moved into place with ``os.replace``, so a crash mid-save leaves the previous
checkpoints intact and no half-written one under a real name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml
from pydantic import Field, model_validator
from safetensors import safe_open

from rlalign.config import Config, ConfigError
from rlalign.errors import RLAlignError
from rlalign.lm.data import encode_prompts, render_prompt
from rlalign.lm.models import LoraConfig
from rlalign.lm.rewards import score_completions
from rlalign.lm.sampling import SamplingParams, sample

__all__ = [
    "OptimConfig",
    "TinyModelConfig",
    "ModelConfig",
    "RunConfig",
    "check_output_dir",
    "prepare_model_path",
    "batch_order",
    "set_seed",
    "autocast_context",
    "forward_precision",
    "rng_state",
    "restore_rng_state",
    "make_optimizer",
    "MetricsLogger",
    "read_metrics",
    "plot_metrics",
    "CheckpointError",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "is_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "generation_eval",
    "greedy_eval",
]

CHECKPOINT_MARKER = "checkpoint.json"
CHECKPOINT_FORMAT = 1


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


class MetricsLogger:
    """Metrics to ``<run_dir>/metrics.jsonl`` (one ``{"step": s, name: value, ...}`` line per call),
    a rich progress bar, and TensorBoard scalars when ``tensorboard=True`` and it is importable.
    ``enabled=False`` (every rank but 0 under torchrun) writes and shows nothing."""

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        progress: bool = True,
        tensorboard: bool = False,
        description: str = "training",
        start_step: int = 0,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self._writer = self._progress = self._file = None
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed; logging to metrics.jsonl only")
        self._progress = None
        if progress:  # rich imported here: a run without a bar (notebooks, ranks but 0, benchmarks) does without its imports
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[summary]}")
            )
            self._task = self._progress.add_task(description, total=total_steps, completed=start_step, summary="")
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float], summary_keys: tuple[str, ...] = ()) -> None:
        """Append one line; advance the bar to ``step + 1`` and show ``summary_keys`` next to it."""
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _json_number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), step)
        if self._progress is not None:
            summary = "  ".join(f"{k}={metrics[k]:.4g}" for k in summary_keys if k in metrics)
            self._progress.update(self._task, completed=step + 1, summary=summary)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json_number(value: float) -> float | None:
    """``value`` as a float, or None (JSON null) when it is NaN or infinite: metrics.jsonl stays strict JSON."""
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(path: str | Path, keys: list[str], out: str | Path) -> Path:
    """One panel per metric in ``keys`` against step, from a metrics.jsonl file; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(path)
    fig, axes = plt.subplots(len(keys), 1, figsize=(6, 2.4 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if not points:
            raise KeyError(f"metric {key!r} is not in {path}")
        steps, values = zip(*points)
        ax.plot(steps, values, marker="." if len(points) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


class CheckpointError(RLAlignError, ValueError):
    """A path that is not a checkpoint directory (or not a run directory holding one)."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` reads back. Model weights stay on disk at ``model_dir``."""

    path: Path
    step: int
    model_dir: Path
    optimizer_state: dict | None
    scheduler_state: dict | None
    rng: dict[str, Any]
    data_position: int
    extra: dict[str, Any]
    config: dict[str, Any]
    trainer: str | None = None  # the config class that wrote it (e.g. GRPOConfig); None for an older checkpoint


def _checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CHECKPOINT_MARKER).is_file()


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = _checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and is_checkpoint(p)), key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    tokenizer=None,
    config: Config | dict | None = None,
    data_position: int = 0,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = 3,
) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step>`` atomically; keep the newest ``keep_last`` (None = all).

    ``model`` is anything with ``save_pretrained`` (a transformers or peft model, a
    :class:`rlalign.lm.models.ScalarHeadModel`, :class:`rlalign.train.loop.SavedModels`). ``extra``
    must hold tensors and plain containers.
    """
    root = _checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model.save_pretrained(tmp / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        optimizer_state = optimizer.state_dict() if optimizer is not None else None
        torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / "optimizer.pt")
        torch.save({"step": step, "data_position": data_position, "rng": rng_state(), "extra": extra or {}}, tmp / "trainer_state.pt")
        config_dict = config.model_dump(mode="json") if isinstance(config, Config) else (config or {})
        (tmp / "config.yaml").write_text(yaml.safe_dump(config_dict, sort_keys=False))
        marker = {"format": CHECKPOINT_FORMAT, "step": step, "time": time.time(), "config": type(config).__name__ if isinstance(config, Config) else None}
        (tmp / CHECKPOINT_MARKER).write_text(json.dumps(marker))
        replace_dir(tmp, final)  # fsynced, then renamed into place: a crash leaves the old one or the new one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:  # the oldest go; never one after this step (a resumed run refuses to start beside those)
        kept = [p for p in list_checkpoints(run_dir) if int(p.name[5:]) <= step]
        for old in kept[:-keep_last]:
            shutil.rmtree(old)
    return final


def fsync_tree(path: str | Path) -> None:
    """Flush every file under ``path``, and the directories themselves, to the disk."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a directory
        pass
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory ``tmp`` to ``final`` atomically (its files fsynced first); an old
    ``final`` is moved aside, then removed, so at every moment one complete version exists."""
    fsync_tree(tmp)
    old = final.with_name(f".old_{final.name}_{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_temp_dirs(run_dir: str | Path) -> list[Path]:
    """Remove the temporary directories a killed run left in ``run_dir`` (half-written checkpoints or
    final models); call only while holding the run directory's lock. Returns what was removed."""
    run_dir = Path(run_dir)
    stale = [p for p in [*run_dir.glob(".tmp_*"), *run_dir.glob(".old_*"), *_checkpoint_root(run_dir).glob(".tmp_step_*"), *_checkpoint_root(run_dir).glob(".old_*")] if p.is_dir()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint directory, or the latest readable checkpoint of a run directory (a corrupt
    newer one is skipped with a warning naming the bad file).

    Raises:
        CheckpointError: when ``path`` is neither, or the checkpoint asked for is unreadable (naming what is missing or bad).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"cannot resume from {path}: no such directory")
    if is_checkpoint(path):
        return _read_checkpoint(path)
    candidates = list_checkpoints(path)
    if not candidates:
        raise CheckpointError(f"cannot resume from {path}: not a checkpoint directory (no {CHECKPOINT_MARKER}) and no checkpoints/step_* inside")
    for candidate in reversed(candidates):
        try:
            return _read_checkpoint(candidate)
        except CheckpointError as err:
            warnings.warn(f"{err}; trying the previous checkpoint", RuntimeWarning, stacklevel=2)
    raise CheckpointError(f"cannot resume from {path}: none of its {len(candidates)} checkpoints is readable (warnings above name the bad files)")


def _read_checkpoint(path: Path) -> Checkpoint:
    """One checkpoint directory, every file checked: its state files load, its weights files have a whole header."""
    current = path / CHECKPOINT_MARKER
    try:
        json.loads(current.read_text())
        current = path / "optimizer.pt"
        optim = torch.load(current, weights_only=True)
        current = path / "trainer_state.pt"
        state = torch.load(current, weights_only=True)
        current = path / "config.yaml"
        config = yaml.safe_load(current.read_text()) or {}
        for current in sorted((path / "model").rglob("*.safetensors")):
            with safe_open(str(current), "pt"):  # reads and checks the header against the file's size
                pass
    except Exception as err:  # torch, yaml, json and safetensors each raise their own kinds
        raise CheckpointError(f"checkpoint {path} is unreadable: {current} ({type(err).__name__}: {err})") from None
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        model_dir=path / "model",
        optimizer_state=optim["optimizer"],
        scheduler_state=optim["scheduler"],
        rng=state["rng"],
        data_position=int(state["data_position"]),
        extra=state["extra"],
        config=config,
        trainer=json.loads((path / CHECKPOINT_MARKER).read_text()).get("config"),
    )


class TinyModelConfig(Config):
    """Shape of the recipe's tiny Llama, built when no model path is given."""

    hidden_size: int = Field(128, ge=8, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, description="number of decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (hidden_size must be divisible by it)")
    intermediate_size: int = Field(256, ge=8, description="width of the MLP")
    seed: int = Field(0, description="seed of the random initialisation")


class ModelConfig(Config):
    """Which checkpoint to start from and how to hold it."""

    path: str | None = Field(None, description="HF checkpoint dir; null = build the tiny recipe model in <output_dir>/base_model")
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
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="shape of the tiny model built when path is null")


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
    tensorboard: bool = Field(False, description="also write TensorBoard scalars when tensorboard is installed")
    overwrite: bool = Field(False, description="start afresh in an output_dir that holds a run, deleting its contents first (otherwise an error)")

    @model_validator(mode="after")
    def _output_dir(self) -> RunConfig:
        check_output_dir(self.output_dir)
        return self


def prepare_model_path(cfg: ModelConfig, output_dir: str | Path) -> Path:
    """``cfg.path``, or the tiny recipe model built once in ``<output_dir>/base_model``."""
    if cfg.path is not None:
        path = Path(cfg.path)
        if not path.is_dir():
            raise ConfigError(f"model.path {cfg.path!r} is not a directory")
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
    model, tokenizer, prompts: list, reward_fn, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 64, seed: int = 0
) -> tuple[float, list[str]]:
    """Mean ``reward_fn`` of completions of ``prompts`` (text or messages), and the completions.

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
    scores = score_completions([reward_fn], texts, completions)
    return float(scores.mean()), completions


def greedy_eval(model, tokenizer, prompts: list, reward_fn, max_new_tokens: int, batch_size: int = 64) -> tuple[float, list[str]]:
    """:func:`generation_eval` with greedy decoding."""
    return generation_eval(model, tokenizer, prompts, reward_fn, max_new_tokens, 0.0, batch_size)
