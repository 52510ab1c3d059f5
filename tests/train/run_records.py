"""What the torchrun tests share: their launch, a runs script loaded as a module, and
a run's logged metrics without those that differ between equal runs (wall clock, a process's own rows)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType


def launch(cmd: list[str], env: dict[str, str], timeout: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a torchrun command once, with no retry:
    a rank that aborted at exit (Gloo threads meeting a finalizing interpreter) was a defect, fixed
    by :func:`rlalign.train.distributed.exit_process` and tested in ``test_exit_process.py``."""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


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
