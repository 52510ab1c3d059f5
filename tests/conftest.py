"""Fixtures shared by tests/lm and tests/train."""

from __future__ import annotations

import pytest

from rlalign.lm import compiled
from rlalign.train import distributed


def pytest_addoption(parser):
    parser.addoption(
        "--model-device", default="cpu",
        help="the device every trainer run of the tests uses where its config says model.device=cpu (the default): e.g. cuda, to run "
        "the trainer tests on a GPU (tools/gpu_check.sh); tests that build models directly keep them where they build them",
    )


@pytest.fixture(autouse=True)
def _model_device(request, monkeypatch):
    """With ``--model-device=cuda``, ``World.device`` (where a run resolves ``model.device``) maps cpu to cuda."""
    device = request.config.getoption("--model-device")
    if device != "cpu":
        resolve = distributed.World.device
        monkeypatch.setattr(distributed.World, "device", lambda world, requested: resolve(world, device if requested == "cpu" else requested))


@pytest.fixture
def compiled_sampling_calls(monkeypatch) -> dict[str, int]:
    """Counts of the calls that reach the compiled decode step and draw of ``sample(compile=True)``,
    so a test sees it if compiling was silently off (the counts stay 0)."""
    calls = {"decode": 0, "draw": 0, "graphed": 0}

    def counting(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    monkeypatch.setattr(compiled, "_compiled_decode_step", counting("decode", compiled._compiled_decode_step))
    monkeypatch.setattr(compiled, "_compiled_draw", counting("draw", compiled._compiled_draw))
    monkeypatch.setattr(compiled, "_graphed_decode_step", counting("graphed", compiled._graphed_decode_step))
    return calls
