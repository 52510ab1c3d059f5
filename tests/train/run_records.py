"""What the torchrun tests share: their launch (retried once), a runs script loaded as a module, and
a run's logged metrics without those that differ between equal runs (wall clock, a process's own rows)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import warnings
from pathlib import Path
from types import ModuleType


def launch(cmd: list[str], env: dict[str, str], out: Path, timeout: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a torchrun command that writes under ``out``; a failed launch runs once more, into an emptied
    ``out``, with the first failure kept visible as a warning: a real bug fails twice. Seen in full
    suite runs on a 2-core machine, rarely and not reproducibly: a rank aborting ("terminate called
    without an active exception", SIGABRT) as it exited with its Gloo groups alive (PyTorch issue
    190489). Destroying the groups before exit is no cure: that deadlocked once here (the group's
    destructor joining a Gloo thread that waited for the GIL)."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if done.returncode != 0:
        warnings.warn(f"torchrun launch failed once (rc {done.returncode}), retrying:\n{done.stderr[-3000:]}")
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return done


def load_script(path: Path) -> ModuleType:
    """The Python file ``path`` (a ``*_runs.py`` script, not a package module) loaded as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compared_metrics(run: Path, not_compared: tuple[str, ...]) -> list[dict[str, float]]:
    """``run``'s metrics.jsonl rows, less the keys starting with any of ``not_compared``."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(not_compared)} for r in rows]
