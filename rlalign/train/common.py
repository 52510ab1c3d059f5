"""The building blocks every trainer uses: model and optimiser configs, seeding and RNG states, the
AdamW schedule, metrics logging and curves. The run lifecycle
built from them (start, resume, step loop, checkpoints, ``final/``) is :mod:`rlalign.train.loop`.

The checkpoint directory format is :mod:`rlalign.train.checkpoints`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from transformers import AutoConfig

from rlalign.config import Config, ConfigError
from rlalign.lm.data import encode_prompts, render_prompt
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
    "MetricsLogger",
    "read_metrics",
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
    tensorboard: bool = Field(False, description="also write TensorBoard scalars when tensorboard is installed")
    overwrite: bool = Field(False, description="start afresh in an output_dir that holds a run, deleting its contents first (otherwise an error)")
    save_merged: bool = Field(
        False, description="LoRA runs: write final/ as the full model (adapter merged into its base, loadable with AutoModelForCausalLM) instead of the adapter alone"
    )

    @model_validator(mode="after")
    def _output_dir(self) -> RunConfig:
        check_output_dir(self.output_dir)
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
