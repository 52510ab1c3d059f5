"""The fast path's private torch / transformers symbols (rlalign.lm.private): present on the tested
versions (a canary for the next upgrade), and, when one is gone, the feature turns itself off with
one warning while the plain path gives the same tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlalign.lm import private
from rlalign.lm.packed import can_pack_linear
from rlalign.lm.sampling import SamplingParams, sample

PROMPTS = [[1, 5, 6, 76, 7, 9, 84], [1, 5, 76, 5, 84], [1, 20]]


@pytest.mark.canary
@pytest.mark.parametrize("feature", sorted(private.PRIVATE_SYMBOLS))
def test_every_private_symbol_is_there_on_the_tested_versions(feature):
    if feature == "cpu_decode_tuning" and torch.__version__ < "2.13":
        pytest.skip("an optional CPU tuning that torch 2.11 lacks: the decode step then compiles with inductor's defaults")
    assert private.missing(feature) == []


def test_resolve_names_what_exists_and_nothing_else():
    assert private.resolve("torch:nn.functional.linear") is torch.nn.functional.linear
    assert private.resolve("torch:nn.no_such_thing") is None
    assert private.resolve("no_such_module:x") is None
    assert private.resolve("torch:ops.mkldnn._no_such_op") is None


@pytest.fixture
def without(monkeypatch):
    """Make ``feature`` need a symbol this torch lacks (and forget earlier answers)."""

    def remove(feature: str) -> None:
        monkeypatch.setitem(private.PRIVATE_SYMBOLS, feature, (*private.PRIVATE_SYMBOLS[feature], "torch:no_such_private_symbol"))
        private.ready.cache_clear()

    yield remove
    private.ready.cache_clear()


def _tokens(model, **kwargs) -> torch.Tensor:
    noise = torch.rand((5, len(PROMPTS)), generator=torch.Generator().manual_seed(3))
    return sample(model, PROMPTS, SamplingParams(max_new_tokens=5), 0, [2], noise=noise, **kwargs).completion_ids


@pytest.mark.parametrize("feature, kwargs", [("static_cache", {}), ("compiled", {"compile": True})])
def test_a_missing_symbol_turns_the_feature_off_with_one_warning_and_the_plain_path_samples_the_same(tiny_llama, without, compiled_sampling_calls, feature, kwargs):
    expected = _tokens(tiny_llama)
    without(feature)
    with pytest.warns(RuntimeWarning, match=f"{feature} fast path is off: .*no_such_private_symbol"):
        first = _tokens(tiny_llama, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process, not one per call
        second = _tokens(tiny_llama, **kwargs)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert compiled_sampling_calls == {"decode": 0, "draw": 0, "graphed": 0}  # nothing compiled ran


def test_without_the_onednn_symbols_nothing_is_packed(without):
    without("packed")
    with pytest.warns(RuntimeWarning, match="packed fast path is off"):
        assert not can_pack_linear(torch.nn.Linear(2, 2).bfloat16())


def test_without_the_cpu_tuning_option_the_decode_step_still_compiles(without):
    # torch 2.11 lacks inductor's realize_cpu_opcount_threshold (a CPU-only tuning of the decode
    # step's attention): the compiled path stays on and compiles with inductor's defaults
    from rlalign.lm import compiled

    tuned = {} if private.missing("cpu_decode_tuning") else {"realize_cpu_opcount_threshold": 4}
    assert compiled._decode_inductor_options() == tuned
    without("cpu_decode_tuning")
    assert compiled._decode_inductor_options() == {}
    assert private.ready("compiled")

