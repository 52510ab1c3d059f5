"""Tiny models built locally (hidden 64, 2 layers) and the character tokenizer, shared by tests/lm."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlalign.tasks.tiny_model import build_char_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One torch thread per test process: `make test` runs two pytest workers on two cores, and a
    second OpenMP thread spinning on a busy core slows small models down by 10-50x."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


def make_llama(vocab: int = 100, seed: int = 0, **overrides) -> LlamaForCausalLM:
    # untied embeddings and a wide init give peaked, varied next-token distributions (a tied random
    # model mostly repeats its input), so greedy and sampling tests see many different tokens
    config = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def make_gpt2(vocab: int = 100, seed: int = 0, **overrides) -> GPT2LMHeadModel:
    config = dict(
        vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**config)).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    return make_llama()


@pytest.fixture(scope="session")
def tiny_gpt2():
    return make_gpt2()


@pytest.fixture(params=["llama", "gpt2"])
def tiny_model(request, tiny_llama, tiny_gpt2):
    return tiny_llama if request.param == "llama" else tiny_gpt2


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory, tokenizer):
    """An ordinary HF checkpoint dir: tiny Llama + character tokenizer."""
    path = tmp_path_factory.mktemp("llama_ckpt")
    make_llama(vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gpt2_checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("gpt2_ckpt")
    make_gpt2(vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
