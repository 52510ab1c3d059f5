"""The checkpoint directory format, written atomically and read back checked.

    save_checkpoint(run_dir, step, model, tokenizer=tok, config=cfg, data_position=i, extra=state, keep_last=2)
    ckpt = load_checkpoint(run_dir)          # a checkpoint dir, or a run dir: its latest readable one

A checkpoint after n steps is ``<run_dir>/checkpoints/step_<n>`` holding ``model/``
(``save_pretrained``: safetensors weights, config, tokenizer when given), ``optimizer.pt`` (an
optimizer / scheduler given to :func:`save_checkpoint`; the trainers keep theirs in ``extra``
instead, one entry per updater), ``trainer_state.pt`` (step, Python / NumPy / torch RNG states,
data position, extra state: all tensors and plain containers, read back with
``torch.load(weights_only=True)``), ``config.yaml`` and ``checkpoint.json`` (written last; its
presence is what makes a directory a checkpoint; it names the config class that wrote it, lists every
other file with its size, and holds the fingerprints of the run's inputs,
:func:`rlalign.train.run_dir.input_fingerprints`). A
checkpoint is written in a temporary sibling directory, fsynced and moved into place with
``os.replace`` (:func:`replace_dir`, also used for ``final/``), so a crash at any moment leaves the
previous checkpoints whole and no half-written one under a real name.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open

from rlalign.config import Config
from rlalign.errors import RLAlignError
from rlalign.train.seeding import rng_state

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "is_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "fsync_tree",
    "replace_dir",
    "remove_stale_temp_dirs",
]

CHECKPOINT_MARKER = "checkpoint.json"
CHECKPOINT_FORMAT = 1
STEP_NAME = re.compile(r"step_(\d+)")  # a checkpoint's directory name (a copy such as step_00000006.bak is none)
WEIGHT_FILES = ("*.safetensors", "*.bin")


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
    inputs: dict[str, dict[str, str]] | None = None  # the run's inputs as it started: {config key: {path, fingerprint}}; None for an older checkpoint


def _checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CHECKPOINT_MARKER).is_file()


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = _checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and is_checkpoint(p)), key=lambda p: int(p.name[5:]))


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
    inputs: dict[str, dict[str, str]] | None = None,
) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step>`` atomically; keep the newest ``keep_last`` (None = all).

    ``model`` is anything with ``save_pretrained`` (a transformers or peft model, a
    :class:`rlalign.lm.heads.ScalarHeadModel`, :class:`rlalign.train.loop.SavedModels`). ``extra``
    must hold tensors and plain containers. ``inputs``: the fingerprints of what the run reads, kept in ``checkpoint.json``
    for a resumption to compare (:func:`rlalign.train.run_dir.input_fingerprints`).
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
        marker = {"format": CHECKPOINT_FORMAT, "step": step, "time": time.time(), "config": type(config).__name__ if isinstance(config, Config) else None,
                  "files": {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}}
        if inputs is not None:
            marker["inputs"] = inputs
        (tmp / CHECKPOINT_MARKER).write_text(json.dumps(marker))
        replace_dir(tmp, final)  # fsynced, then renamed into place: a crash leaves the old one or the new one
    except BaseException as err:
        full = disk_full(err, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from err
        raise
    if keep_last is not None:  # the oldest go; never one after this step (a resumed run refuses to start beside those)
        kept = [p for p in list_checkpoints(run_dir) if int(p.name[5:]) <= step]
        for old in kept[:-keep_last]:
            (old / CHECKPOINT_MARKER).unlink()  # first: a removal cut short leaves no checkpoint that looks whole
            shutil.rmtree(old)
    return final


def disk_full(err: BaseException, path: Path) -> OSError | None:
    """An ``OSError(ENOSPC)`` naming ``path`` when ``err`` (raised writing under it) came from a full disk, whatever its
    kind: torch, safetensors and tokenizers raise their own (a RuntimeError "unexpected pos", a SafetensorError or an
    Exception "No space left on device (os error 28)"); else None."""
    if isinstance(err, OSError) or not isinstance(err, Exception):
        return None  # an OSError: the caller's message reads it as it is; an interrupt stays one
    text = str(err)
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        free = None
    torch_short_write = type(err) is RuntimeError and free is not None and free < 2**20  # torch.save's "unexpected pos": no errno, no text
    if "No space left on device" in text or "os error 28" in text or torch_short_write:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


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
    """Tidy what a killed run left in ``run_dir``; call only while holding its lock. A version moved
    aside by :func:`replace_dir` whose replacement never arrived goes back; every other temporary
    directory (half-written checkpoints or final models) is removed. Returns what was removed."""
    run_dir = Path(run_dir)
    for folder in (run_dir, _checkpoint_root(run_dir)):
        for old in folder.glob(".old_*"):
            name = old.name[len(".old_"):].rsplit("_", 1)[0]  # .old_<name>_<pid>
            if old.is_dir() and not (folder / name).exists():
                os.replace(old, folder / name)
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


class _MissingFile(Exception):
    pass


def _missing_file(path: Path, marker: dict) -> None:
    """Check that every file ``checkpoint.json`` lists is there at its size (an older checkpoint, listing none: that
    every model directory under ``model/`` holds a weights file); :class:`_MissingFile` names the one that is not."""
    listed = marker.get("files")
    if listed is None:
        configs = [c.parent for name in ("config.json", "adapter_config.json") for c in (path / "model").rglob(name)]
        listed = {}
        for folder in configs or [path / "model"]:
            if not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
                raise _MissingFile(f"{folder.relative_to(path)} holds no weights file")
    for name, size in listed.items():
        file = path / name
        if not file.is_file():
            raise _MissingFile(f"{name} is missing")
        if file.stat().st_size != size:
            raise _MissingFile(f"{name} has {file.stat().st_size} bytes, not the {size} written")


def _read_checkpoint(path: Path) -> Checkpoint:
    """One checkpoint directory, every file checked: its state files load, its weights files have a whole header."""
    current = path / CHECKPOINT_MARKER
    try:
        marker = json.loads(current.read_text())
        current = path / "optimizer.pt"
        optim = torch.load(current, weights_only=True)
        current = path / "trainer_state.pt"
        state = torch.load(current, weights_only=True)
        current = path / "config.yaml"
        config = yaml.safe_load(current.read_text()) or {}
        current = path / CHECKPOINT_MARKER
        _missing_file(path, marker)
        for current in sorted((path / "model").rglob("*.safetensors")):
            with safe_open(str(current), "pt"):  # reads and checks the header against the file's size
                pass
    except _MissingFile as err:
        raise CheckpointError(f"checkpoint {path} is incomplete: {err}") from None
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
        trainer=marker.get("config"),
        inputs=marker.get("inputs"),
    )
