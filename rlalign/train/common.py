"""The building blocks every trainer uses: forward precision (autocast), the AdamW optimiser and its
schedule, the run's starting model (a checkpoint, a LoRA adapter merged into its base, or the tiny
recipe model) and the generation evaluation. The configs are :mod:`rlalign.train.run_config`; seeds,
RNG states and the data order :mod:`rlalign.train.seeding`; metrics logging and curves
:mod:`rlalign.train.metrics`. The run lifecycle built from them (start, resume, step loop,
checkpoints, ``final/``) is :mod:`rlalign.train.loop`.

The checkpoint directory format is :mod:`rlalign.train.checkpoints`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch
from transformers import AutoConfig

from rlalign.config import ConfigError
from rlalign.errors import RLAlignError
from rlalign.lm.encoding import encode_prompts, render_prompt
from rlalign.lm.models import adapter_base, dropout_as_loaded, load_policy, load_tokenizer, resolve_model_path, stop_token_ids
from rlalign.lm.rewards import score_completions
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.train.bf16_adamw import StochasticRoundingAdamW
from rlalign.train.checkpoints import replace_dir
from rlalign.train.run_config import ModelConfig, OptimConfig

__all__ = [
    "prepare_model_path",
    "is_adapter_dir",
    "merge_adapter",
    "autocast_context",
    "forward_precision",
    "make_optimizer",
    "generation_eval",
    "greedy_eval",
    "OutOfMemory",
    "memory_named",
]


class OutOfMemory(RLAlignError, MemoryError):
    """A pass ran out of device memory; the message names the settings that lower what it holds."""


@contextlib.contextmanager
def memory_named(what: str, rows: int, tokens: int | None, head_split: bool = True, planned: bool = True):
    """Turn an out-of-memory error inside the block (``what``: the pass, of ``rows`` rows x ``tokens`` completion tokens
    at once, or ``rows`` examples where ``tokens`` is None; a CUDA one, or a CPU allocation that failed) into one
    :class:`OutOfMemory` naming the settings that lower it: fewer rows at once while there are several (``planned``: the
    run may plan them from ``model.memory_fraction``), the LM head in chunks where ``head_split`` (the pass's log-probs
    may come from the hidden states, not the logits)."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in str(err):  # the CPU allocator's failure
            raise
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        head = ", or a lower model.logits_limit_mb (the LM head in chunks instead of the logits)" if head_split else ""
        auto = "; with micro_batch_size: auto, a lower model.memory_fraction" if planned else ""
        if rows > 1:
            advice = f"set micro_batch_size below {rows} (rows per forward and backward; the same update{auto}), or model.gradient_checkpointing: true{head}"
        else:
            advice = f"it runs one row at a time already: set model.gradient_checkpointing: true{head}, or shorter rows, or a smaller model"
        held = f"{rows} rows x {tokens} completion tokens" if tokens is not None else f"{rows} examples"
        raise OutOfMemory(f"out of memory in {what} ({held} at once): {advice} ({detail})") from None


ADAPTER_CONFIG = "adapter_config.json"  # what peft writes beside a saved adapter
MERGED_MARKER = "rlalign_merged_adapter.json"  # which adapter a merged base_model/ was made from


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


def make_optimizer(params, cfg: OptimConfig, total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable ``params`` (bfloat16 ones rounded as ``cfg.bf16_rounding`` says:
    :mod:`rlalign.train.bf16_adamw`) and its schedule:

        lr(s) = lr * s / warmup                                           for s < warmup
        lr(s) = lr * (m + (1 - m) * (1 + cos(pi * progress)) / 2)         after, m = min_lr_ratio
    """
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters")
    # the fused kernel (CPU and CUDA) updates every tensor in one pass instead of a Python loop over them
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in trainable)
    adamw = StochasticRoundingAdamW if cfg.bf16_rounding == "stochastic" else torch.optim.AdamW  # the same step on float32 weights
    optimizer = adamw(trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None)
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))  # a Python float: the state stays weights_only-loadable

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def is_adapter_dir(path: str | Path) -> bool:
    """A directory holding a saved LoRA adapter (peft's ``adapter_config.json``), not a full model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def merge_adapter(adapter_dir: Path, out_dir: Path) -> Path:
    """Write ``adapter_dir``'s base with the adapter merged into it, a full checkpoint in the base's
    dtype with the tokenizer (the adapter's, else the base's), to ``out_dir`` (atomically; reused
    when it already holds this adapter's merge). Returns ``out_dir``."""
    marker = {"merged_adapter": str(adapter_dir.resolve())}
    if (out_dir / MERGED_MARKER).is_file() and json.loads((out_dir / MERGED_MARKER).read_text()) == marker:
        return out_dir
    base_path = Path(adapter_base(adapter_dir))
    merged = load_policy(adapter_dir).merge_and_unload()
    stored = AutoConfig.from_pretrained(str(resolve_model_path(base_path))).dtype or torch.float32
    tmp = out_dir.parent / f".tmp_{out_dir.name}_{os.getpid()}"
    with dropout_as_loaded(merged):  # the base's own dropout in config.json: the run trained from it saves what it loads
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


@torch.no_grad()
def generation_eval(
    model, tokenizer, prompts: list, reward_fn, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 64, seed: int = 0,
    columns: dict[str, list] | None = None,
) -> tuple[float, list[str]]:
    """Mean ``reward_fn`` of completions of ``prompts`` (text or messages) over those it scored (a None or
    UNSCORED is no 0; NaN when it scored none), and the completions;
    ``columns``: one value per prompt each (e.g. ``answer``), passed to the reward (TRL's convention).

    ``temperature=0`` is greedy; otherwise draws use a private generator seeded with ``seed``, so
    an evaluation neither consumes nor depends on the global RNG (a resumed run stays identical).
    The generator is a CPU one on every device: the sampler draws its uniforms on the CPU and moves
    them to the model (so a GPU run draws what a CPU run draws).
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    texts = [render_prompt(tokenizer, p) for p in prompts]
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        ids = encode_prompts(tokenizer, prompts[start : start + batch_size])
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        rollout = sample(model, ids, params, tokenizer.pad_token_id, stop_token_ids(model, tokenizer), generator=generator)
        completions.extend(rollout.decode_completions(tokenizer))
    model.train(was_training)
    scores = score_completions([reward_fn], texts, completions, columns=columns)
    return float(scores.nanmean()), completions  # (B,) NaN where unscored


def greedy_eval(model, tokenizer, prompts: list, reward_fn, max_new_tokens: int, batch_size: int = 64) -> tuple[float, list[str]]:
    """:func:`generation_eval` with greedy decoding."""
    return generation_eval(model, tokenizer, prompts, reward_fn, max_new_tokens, 0.0, batch_size)
