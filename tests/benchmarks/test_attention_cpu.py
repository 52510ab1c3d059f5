"""benchmarks/attention_cpu.py on the tiny Llama: a line per shape, both kernels timed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_tiny_run_prints_both_kernels_per_shape(capsys):
    import attention_cpu

    assert attention_cpu.main(["--config", "tiny", "--shapes", "4x16", "2x40", "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " x " in line]
    assert [line.split(":")[0] for line in lines] == ["4 x 16", "2 x 40"]
    for line in lines:
        eager, sdpa, ratio = map(float, re.findall(r"(\d+\.\d+)", line))
        assert eager > 0 and sdpa > 0 and ratio > 0
