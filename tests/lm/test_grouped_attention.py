"""Grouped decode attention: the query heads of a group stacked against their shared key/value head
equal transformers' attention with the keys and values repeated, and the sampler uses it without
repeating the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.integrations import sdpa_attention
from transformers.models.llama import modeling_llama

from rlalign.lm import grouped_attention as grouped_attention_module
from rlalign.lm.grouped_attention import GROUPED_EAGER, GROUPED_SDPA, _fold, grouped_eager_attention, grouped_kernel, grouped_sdpa_attention
from rlalign.lm.model_modes import attention_kernel
from rlalign.lm.sampling import SamplingParams, sample
from tests.lm.conftest import make_llama

PROMPTS = [[1, 5, 6, 76, 7, 9, 84], [1, 5, 76, 5, 84], [1, 13, 12, 11, 80, 44, 45, 46, 47, 50, 51], [1, 20]]


class _Attention(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def _inputs(batch=3, kv_heads=2, groups=4, queries=1, keys=9, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, queries, kv_heads * groups, dim, generator=g, dtype=dtype).transpose(1, 2)  # (B, H, Q, d) as the models lay it out
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=g, dtype=dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, queries, keys, dtype=dtype)
    mask[0, ..., :3] = torch.finfo(dtype).min  # left padding of row 0
    mask[2, ..., -1] = torch.finfo(dtype).min  # a slot not yet written
    return _Attention(groups), query, key, value, mask


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("masked", [True, False])
def test_grouped_eager_attention_equals_the_repeated_one(dtype, atol, masked):
    module, query, key, value, mask = _inputs(dtype=dtype)
    mask = mask if masked else None
    out, weights = grouped_eager_attention(module, query, key, value, mask, scaling=0.35)
    want, want_weights = modeling_llama.eager_attention_forward(module, query, key, value, mask, scaling=0.35)
    assert out.shape == want.shape == (3, 1, 8, 8) and weights.shape == want_weights.shape
    torch.testing.assert_close(out, want, rtol=0, atol=atol)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=atol)
    if masked:  # the padded keys get no weight in any head
        assert weights[0, :, :, :3].abs().max() == 0


def test_grouped_eager_attention_by_hand():
    # one row, one key/value head shared by 2 query heads, 2 keys: weights = softmax(q . k * scale)
    module = _Attention(2)
    query = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # (1, 2, 1, 2)
    key = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])  # (1, 1, 2, 2)
    value = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    out, weights = grouped_eager_attention(module, query, key, value, None, scaling=1.0)
    # head 0: scores (1, 0) -> softmax (e/(e+1), 1/(e+1)); head 1: scores (0, 2) -> (1/(1+e^2), e^2/(1+e^2))
    e = torch.e
    torch.testing.assert_close(weights[0, :, 0], torch.tensor([[e / (e + 1), 1 / (e + 1)], [1 / (1 + e**2), e**2 / (1 + e**2)]]))
    torch.testing.assert_close(out[0, 0], 10 * weights[0, :, 0])


@pytest.mark.parametrize("masked", [True, False])
def test_grouped_sdpa_attention_equals_transformers_sdpa(masked):
    module, query, key, value, mask = _inputs()
    mask = mask if masked else None
    out, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.35)
    want, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.35)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


def test_a_prefill_or_a_per_head_mask_runs_the_plain_attention(monkeypatch):
    repeats = []
    plain = modeling_llama.repeat_kv
    monkeypatch.setattr(modeling_llama, "repeat_kv", lambda x, n: repeats.append(n) or plain(x, n))
    module, query, key, value, mask = _inputs(queries=5)  # a prefill: 5 query positions
    out, _ = grouped_eager_attention(module, query, key, value, mask, scaling=0.35)
    assert repeats == [4, 4]
    module, query, key, value, _ = _inputs()
    per_head = torch.zeros(3, 8, 1, 9)  # ALiBi-like: one mask a head
    per_head[:, ::2, :, 0] = -1e4
    out, _ = grouped_eager_attention(module, query, key, value, per_head, scaling=0.35)
    want, _ = modeling_llama.eager_attention_forward(module, query, key, value, per_head, scaling=0.35)
    assert len(repeats) == 6 and torch.equal(out, want)


def test_which_models_and_kernels_it_stands_in_for(monkeypatch):
    gqa, mha = make_llama(num_key_value_heads=2), make_llama(num_key_value_heads=4)
    assert grouped_kernel(gqa, "eager") == GROUPED_EAGER and grouped_kernel(gqa, None) is None  # the model's own: sdpa
    assert grouped_kernel(mha, "eager") is None  # nothing shared: nothing to stack
    assert grouped_kernel(gqa, "flex_attention") is None
    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8))
    assert grouped_kernel(gemma2, "eager") is None  # its eager attention soft-caps the scores: not the plain one
    assert grouped_kernel(gqa, "sdpa") is None  # this transformers' SDPA already stacks a decode step's heads
    monkeypatch.delattr(sdpa_attention, "pack_gqa")
    assert grouped_kernel(gqa, "sdpa") == GROUPED_SDPA


@pytest.mark.parametrize("compile", [False, True])
def test_the_sampler_decodes_without_repeating_the_cache_and_draws_the_plain_attentions_tokens(compile, monkeypatch):
    model = make_llama(num_key_value_heads=2)
    params = SamplingParams(max_new_tokens=12)

    def draw():
        with attention_kernel(model, "eager"):
            return sample(model, PROMPTS, params, 0, [2], group_size=2, generator=torch.Generator().manual_seed(0), compile=compile)

    folds = []
    if not compile:  # counted eagerly only (a counter inside a compiled step would recompile it each call)
        monkeypatch.setattr(grouped_attention_module, "_fold", lambda query, groups: folds.append(groups) or _fold(query, groups))
    grouped = draw()
    monkeypatch.setattr("rlalign.lm.sampling.grouped_kernel", lambda model, base: None)
    repeated = draw()
    if not compile:  # every layer of every decode step stacked its heads (2 layers, n = 2); the plain loop none
        decode_steps = grouped.completion_ids.shape[1] - 1
        assert len(folds) == 2 * decode_steps and set(folds) == {2}
    assert torch.equal(grouped.completion_ids, repeated.completion_ids) and repeated.completion_ids.unique().numel() > 5
    torch.testing.assert_close(grouped.logprobs, repeated.logprobs, rtol=0, atol=1e-5)


def test_on_a_transformers_without_pack_gqa_the_sdpa_decode_loop_stacks_the_heads_and_draws_the_same_tokens(monkeypatch):
    model = make_llama(num_key_value_heads=2)
    params = SamplingParams(max_new_tokens=12)
    before = sample(model, PROMPTS, params, 0, [2], group_size=2, generator=torch.Generator().manual_seed(0))
    monkeypatch.delattr(sdpa_attention, "pack_gqa")
    seen = []
    monkeypatch.setattr(grouped_attention_module, "_fold", lambda query, groups: seen.append(groups) or _fold(query, groups))
    after = sample(model, PROMPTS, params, 0, [2], group_size=2, generator=torch.Generator().manual_seed(0))
    assert seen and set(seen) == {2} and model.config._attn_implementation == "sdpa"
    assert torch.equal(before.completion_ids, after.completion_ids)
    torch.testing.assert_close(before.logprobs, after.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", [GROUPED_EAGER, GROUPED_SDPA])
def test_a_forward_given_a_2d_mask_inside_the_switch_builds_the_masks_it_did_before(name):
    # padding and causality: a model switched to a grouped name and given a 2-D mask (a forward or
    # generate() inside the switch) computes what its own kernel does
    model = make_llama(num_key_value_heads=2)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        changed = ids.clone()
        changed[:, 5:] = 11
        with attention_kernel(model, name):
            got = model(input_ids=ids, attention_mask=mask).logits
            later_changed = model(input_ids=changed, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-5)
    real = mask[:, :5].bool()
    assert torch.equal(later_changed[:, :5][real], got[:, :5][real])  # causal: a position never sees later tokens


def test_a_model_whose_repeat_kv_pairs_heads_otherwise_is_not_admitted(monkeypatch):
    # the eager attention's own code is Llama's, but the repeat_kv it calls tiles the heads (head h
    # meets key/value head h % KVH): stacking by h // n would pair them wrongly
    model = make_llama(num_key_value_heads=2)
    assert grouped_kernel(model, "eager") == GROUPED_EAGER
    monkeypatch.setattr(modeling_llama, "repeat_kv", lambda x, n: x.repeat(1, n, 1, 1))
    assert grouped_kernel(model, "eager") is None


def test_dropout_in_training_mode_draws_what_the_plain_attention_draws():
    module, query, key, value, mask = _inputs()
    module.train()
    torch.manual_seed(0)
    out, weights = grouped_eager_attention(module, query, key, value, mask, scaling=0.35, dropout=0.5)
    torch.manual_seed(0)
    want, want_weights = modeling_llama.eager_attention_forward(module, query, key, value, mask, scaling=0.35, dropout=0.5)
    assert (weights == 0).any()  # dropout ran
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6)


def test_grouped_sdpa_leaves_a_position_bias_or_a_softcap_to_transformers():
    module, query, key, value, mask = _inputs()
    bias = torch.randn(3, 8, 1, 9, generator=torch.Generator().manual_seed(1))  # one a head: nothing to stack
    out, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.35, position_bias=bias)
    want, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.35, position_bias=bias)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    assert (out - grouped_sdpa_attention(module, query, key, value, mask, scaling=0.35)[0]).abs().max() > 1e-2  # the bias counted
    with pytest.raises(ValueError, match="softcap"):
        grouped_sdpa_attention(module, query, key, value, mask, scaling=0.35, softcap=30.0)
