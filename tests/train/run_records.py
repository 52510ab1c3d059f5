"""What the torchrun tests read back from their runs: a runs script loaded as a module, and a run's
logged metrics without those that differ between equal runs (wall clock, a process's own rows)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType


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
