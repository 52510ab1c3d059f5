"""One run per output directory: the lock, a fresh start or a resume, and what each must find there.

    lock = claim_run_dir(cfg, checkpoint)   # rank 0: lock, refuse or clear, tidy; then keep ``lock`` open

- A run holds an exclusive lock on ``<output_dir>/.rlalign.lock`` for its whole life: a second run on
  the same directory fails at once, naming the holder's process id.
- A fresh run refuses a directory that already holds a run (metrics, checkpoints, a final model)
  unless the config says ``overwrite: true``; then the old contents go before anything is written.
  What a start that failed before its first step left (a built tiny ``base_model``, empty logs) is
  cleared without asking: there is nothing of a run to lose, and the corrected command runs.
- A resumed run continues in its directory. The checkpoint must come from the same trainer, and the
  fields that define the run (model, data, batch shape, seed, optimiser, ...) must match; every
  difference is named. Lines of ``metrics.jsonl``, ``samples.jsonl`` and ``eval_samples.jsonl`` from the resumed step on are
  cut, so each step has exactly one line; checkpoints after the resumed step are an error (they
  belong to a run that went further: resume from the latest, or into another directory). A
  checkpoint past the run's end (more steps than ``steps`` / ``max_steps``) is an error.
- The contents behind the run's input paths (models and data files, :func:`input_fingerprints`) are
  recorded in its checkpoints as it starts; a resumption whose inputs changed behind the same path
  is an error naming each one (an older checkpoint without the record resumes unchecked).
- Temporary directories a killed run left behind are removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rlalign.config import Config, ConfigError
from rlalign.lm.models import adapter_base
from rlalign.train.checkpoints import Checkpoint, CheckpointError, list_checkpoints, load_checkpoint, remove_stale_temp_dirs

__all__ = ["RUN_FILES", "RESUMABLE_CHANGES", "claim_run_dir", "config_differences", "cut_logs", "input_fingerprints", "run_inputs"]

LOCK_FILE = ".rlalign.lock"
# what a run writes in its directory; the trackers' files too (report_to): tensorboard/ events, the W&B run in wandb/ and its id
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "checkpoints", "final", "curves.png", "tensorboard", "wandb", "wandb_id", "base_model")
# fields that may differ between a checkpoint's run and its resumption: length, logging, evaluation, saving, threads, memory
# ("tensorboard": the field report_to replaced, still in older checkpoints' configs)
RESUMABLE_CHANGES = {
    "steps", "max_steps", "output_dir", "overwrite", "progress", "report_to", "tensorboard", "plots", "save_every", "keep_last",
    "sample_every", "num_samples_logged", "eval_every", "eval_batch_size", "num_threads", "model.device", "save_merged",
    "eval", "micro_batch_size", "model.memory_fraction", "model.gradient_checkpointing",  # evaluation, and memory-only options (the same updates)
    "ddp_timeout",
}


def claim_run_dir(cfg: Config, checkpoint: Checkpoint | None):
    """Lock ``cfg.output_dir`` and make it ready for this run (a fresh start or the resumption of
    ``checkpoint``); returns the open lock file, which the caller keeps open for the run's life."""
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock(run_dir)
    try:
        _prepare(cfg, run_dir, checkpoint)
    except BaseException:
        lock.close()
        raise
    return lock


def _prepare(cfg: Config, run_dir: Path, checkpoint: Checkpoint | None) -> None:
    """The checks, then (only when they pass) the changes: restore or remove what a killed run left,
    set corrupt later checkpoints aside, delete an old run on ``overwrite``, cut the logs back."""
    remove_stale_temp_dirs(run_dir)
    used = [name for name in RUN_FILES if (run_dir / name).exists()]
    resuming_here = checkpoint is not None and run_dir.resolve() in (  # a link to one of its checkpoints, or its checkpoints/ a link elsewhere
        checkpoint.path.parent.parent.resolve(), checkpoint.path.resolve().parent.parent)
    if checkpoint is not None:
        check_resumable(cfg, checkpoint)
    if used and not resuming_here:
        if not cfg.overwrite and not _failed_start(run_dir, used):  # what a start that failed before its first step left is cleared
            resume = ", continue it with --resume" if list_checkpoints(run_dir) else ""  # (none: it stopped before its first checkpoint)
            raise ConfigError(
                f"output_dir {str(run_dir)!r} already holds a run ({', '.join(used)}); choose another output_dir{resume}, "
                "or set overwrite=true to delete it first"
            )
        read = _input_paths(cfg) + ([checkpoint.path.resolve()] if checkpoint is not None else [])
        inputs = [path for path in read if any(_inside(path, run_dir / name) for name in used)]
        if inputs:
            raise ConfigError(f"overwrite=true would delete {inputs[0]}, which this run reads; choose another output_dir")
    if resuming_here:
        later = [p for p in list_checkpoints(run_dir) if int(p.name[5:]) > checkpoint.step]
        readable = [p.name for p in later if _readable(p)]
        if readable:
            raise CheckpointError(
                f"cannot resume {run_dir} from step {checkpoint.step}: it holds later checkpoints ({', '.join(readable)}); "
                "resume from the latest (--resume with the run directory), or into another output_dir"
            )
        for path in later:  # unreadable (the resume fell back past them): kept for a look, out of the run's way
            aside = path.with_name(f".corrupt_{path.name}")
            path.rename(aside if not aside.exists() else path.with_name(f".corrupt_{path.name}_{os.getpid()}_{time.time_ns()}"))
    elif used:
        for name in used:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if checkpoint is not None:
        cut_logs(run_dir, checkpoint.step)


def _failed_start(run_dir: Path, used: list[str]) -> bool:
    """Whether ``used`` (the run files in ``run_dir``) is only what a start that failed before its first step leaves:
    the tiny model it built (``base_model``) and an empty metrics log. Anything else (a logged line, samples, a
    tracker's files, a checkpoint) is a run's and is never deleted without ``overwrite``."""
    metrics = run_dir / "metrics.jsonl"
    return all(name == "base_model" or (name == "metrics.jsonl" and metrics.is_file() and metrics.stat().st_size == 0) for name in used)


def _inputs(cfg: Config) -> list[tuple[str, str, bool]]:
    """(config key, path as configured, whether it is a model) of what a run reads: its model, reference, critic, teacher,
    reward and judge models (and the base a saved adapter among them loads), and its training data (``eval.data`` is left
    out: evaluation may change on a resume)."""
    data = getattr(cfg, "data", None)
    models = [("model.path", getattr(getattr(cfg, "model", None), "path", None)), ("reference", getattr(cfg, "reference", None)),
              ("critic.path", getattr(getattr(cfg, "critic", None), "path", None)), ("teacher", getattr(cfg, "teacher", None))]
    for i, term in enumerate(getattr(cfg, "rewards", None) or []):
        models += [(f"rewards[{i}].reward_model", term.reward_model), (f"rewards[{i}].judge.model", getattr(term.judge, "model", None))]
    models = [(key, str(path)) for key, path in models if path]
    models += [(f"{key} (its adapter's base)", base) for key, path in models if (base := _adapter_base(path))]
    files = [(f"data.{name}", getattr(data, name, None)) for name in ("train_file", "eval_file", "path")]
    return [(key, path, True) for key, path in models] + [(key, str(path), False) for key, path in files if path]


def _adapter_base(path: str) -> str | None:
    """The base model a saved LoRA adapter at ``path`` loads (its ``adapter_config.json``), or None for anything else."""
    try:
        return adapter_base(path) or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _input_paths(cfg: Config) -> list[Path]:
    """The files and directories a run reads (:func:`_inputs`), resolved."""
    return [Path(path).resolve() for _, path, _ in _inputs(cfg)]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MODEL_CONFIG_FILES = ("config.json", "adapter_config.json")
CHUNK = 1 << 20  # bytes read at each end of a weights file, or of a large data file
WHOLE_DATA_LIMIT = 256 << 20  # data up to this size is hashed whole


def input_fingerprints(cfg: Config) -> dict[str, dict[str, str]]:
    """{config key: {"path": as configured, "fingerprint": sha256 hex}} of every local model directory and data file or
    directory the run reads (:func:`_inputs`); a Hugging Face Hub id (not a local path) has none.

    A model directory's fingerprint covers its weights files' names and sizes, their first and last MiB, and the whole of
    ``config.json`` / ``adapter_config.json``; data (a file, or a directory's files bar hidden ones) is hashed whole up to
    256 MiB in all, above that by each file's size and its first and last MiB. Cheap (a few MiB read per model), and any
    retrained or replaced model or edited data changes it."""
    out = {}
    for key, path, is_model in _inputs(cfg):
        root = Path(path)
        if not root.exists():
            continue
        if root.is_file():
            files = [root]
        elif is_model:
            files = sorted(f for f in root.iterdir() if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name in MODEL_CONFIG_FILES))
        else:
            files = sorted(f for f in root.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts))
        sizes = [f.stat().st_size for f in files]
        whole = not is_model and sum(sizes) <= WHOLE_DATA_LIMIT
        digest = hashlib.sha256()
        for file, size in zip(files, sizes):
            digest.update(f"{file.relative_to(root) if file != root else file.name}\0{size}\0".encode())
            with file.open("rb") as f:
                if whole or file.name in MODEL_CONFIG_FILES or size <= 2 * CHUNK:
                    for block in iter(lambda: f.read(CHUNK), b""):
                        digest.update(block)
                else:
                    digest.update(f.read(CHUNK))
                    f.seek(size - CHUNK)
                    digest.update(f.read(CHUNK))
        out[key] = {"path": path, "fingerprint": digest.hexdigest()}
    return out


def run_inputs(cfg: Config, checkpoint: Checkpoint | None) -> dict[str, dict[str, str]]:
    """What a run records in its checkpoints as its inputs: those of its fresh start, carried on through every resumption
    (:func:`check_resumable` compared them); for a resumption of an older checkpoint without them, today's."""
    if checkpoint is not None and checkpoint.inputs is not None:
        return checkpoint.inputs
    return input_fingerprints(cfg)


def _changed_inputs(cfg: Config, checkpoint: Checkpoint) -> list[tuple[str, str]]:
    """(config key, path) of each input recorded in ``checkpoint`` whose contents now differ behind the same path (one no
    longer there, or set to another path where that may change, is not compared: its loader or the config check speaks)."""
    if checkpoint.inputs is None:
        return []
    now = input_fingerprints(cfg)
    return [(key, then["path"]) for key, then in checkpoint.inputs.items()
            if key in now and now[key]["path"] == then.get("path") and now[key]["fingerprint"] != then.get("fingerprint")]


def _inside(path: Path, root: Path) -> bool:
    return path == root.resolve() or root.resolve() in path.parents


def _readable(path: Path) -> bool:
    try:
        load_checkpoint(path)
    except CheckpointError:
        return False
    return True


def _lock(run_dir: Path):
    lock = (run_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"output_dir {str(run_dir)!r} is in use by another rlalign run (process {holder}); wait for it or choose another output_dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def check_resumable(cfg: Config, checkpoint: Checkpoint) -> None:
    """The checkpoint comes from this trainer and the run-defining fields match (every difference named)."""
    trainer = type(cfg).__name__
    if checkpoint.trainer is not None and checkpoint.trainer != trainer:
        raise CheckpointError(f"cannot resume a {trainer} run from {checkpoint.path}: it is a {checkpoint.trainer} checkpoint")
    now = cfg.model_dump(mode="json")
    changed = config_differences(checkpoint.config, now)
    decays = now.get("optim", {}).get("min_lr_ratio", 1.0) != 1.0 or now.get("critic", {}).get("optim", {}).get("min_lr_ratio", 1.0) != 1.0
    for key in ("steps", "max_steps"):  # more steps are fine for a constant learning rate; a cosine schedule would change shape
        if key in now and checkpoint.config.get(key) != now[key] and decays:
            changed.append((f"{key} (the length of the cosine learning-rate schedule)", checkpoint.config.get(key), now[key]))
    if changed:
        lines = "\n".join(f"  {key}: {before!r} in the checkpoint, {after!r} now" for key, before, after in changed)
        raise CheckpointError(
            f"cannot resume from {checkpoint.path}: the run's config differs in\n{lines}\n"
            "resume with the checkpoint's values, or start a new run from its weights (model.path set to its model/ directory)"
        )
    for key in ("steps", "max_steps"):
        if isinstance(now.get(key), int) and checkpoint.step > now[key]:
            raise CheckpointError(
                f"cannot resume from {checkpoint.path}: it is after step {checkpoint.step}, past this run's end ({key}={now[key]}); "
                f"resume with {key} of at least {checkpoint.step}, or start a new run from its weights (model.path set to its model/ directory)"
            )
    inputs = _changed_inputs(cfg, checkpoint)
    if inputs:
        lines = "\n".join(f"  {key}: {path} holds other contents than when the run started" for key, path in inputs)
        raise CheckpointError(
            f"cannot resume from {checkpoint.path}: what the run reads changed behind the same path\n{lines}\n"
            "resume with the original contents at that path, or start a new run (another output_dir, or overwrite=true)"
        )


def config_differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of every field that differs, bar :data:`RESUMABLE_CHANGES`."""
    out = []
    for key in sorted(set(saved) | set(now)):
        dotted = prefix + key
        if dotted in RESUMABLE_CHANGES:
            continue
        before, after = saved.get(key), now.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            out.extend(config_differences(before, after, dotted + "."))
        elif before != after and not (isinstance(before, list) and isinstance(after, (list, tuple)) and list(after) == before):
            out.append((dotted, before, after))
    return out


def cut_logs(run_dir: Path, step: int) -> None:
    """Drop the lines of ``metrics.jsonl``, ``samples.jsonl`` and ``eval_samples.jsonl`` for steps ``step`` and later (written
    after the checkpoint a run resumes from), so each step ends up with one line."""
    for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
        path = run_dir / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and _step(line) < step]
        if len(kept) != len(lines):
            tmp = path.with_name(f".tmp_{name}")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)


def _step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", float("inf")))
    except (ValueError, AttributeError):
        return float("inf")  # a torn last line from a kill: dropped
