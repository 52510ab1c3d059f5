"""Fixtures shared by tests/lm and tests/train."""

from __future__ import annotations

import pytest

from rlalign.lm import compiled


@pytest.fixture
def compiled_sampling_calls(monkeypatch) -> dict[str, int]:
    """Counts of the calls that reach the compiled decode step and draw of ``sample(compile=True)``,
    so a test sees it if compiling was silently off (the counts stay 0)."""
    calls = {"decode": 0, "draw": 0}

    def counting(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    monkeypatch.setattr(compiled, "_compiled_decode_step", counting("decode", compiled._compiled_decode_step))
    monkeypatch.setattr(compiled, "_compiled_draw", counting("draw", compiled._compiled_draw))
    return calls
