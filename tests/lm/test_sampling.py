"""Sampling: greedy equals generate, left padding is invisible, draws follow the model's distribution."""

from __future__ import annotations

import math

import pytest
import torch

from rlalign.lm import sampling
from rlalign.lm.logprobs import rollout_logprobs
from rlalign.lm import compiled as compiled_steps
from rlalign.lm.grouped_attention import GROUPED_EAGER
from tests.lm.conftest import make_llama
from rlalign.lm.model_modes import attention_kernel
from rlalign.lm.models import cast_copy
from rlalign.lm.packed import PackedLinear, can_pack_linear, pack_linear_layers, repack_linear_layers
from rlalign.lm.sampling import SamplingParams, cache_bucket, filter_logits, inverse_cdf_draw, left_pad, sample

PROMPTS = [[1, 5, 6, 76, 7, 9, 84], [1, 5, 76, 5, 84], [1, 13, 12, 11, 80, 44, 45, 46, 47, 50, 51], [1, 20]]
EOS = 2


def _greedy(model, prompts, steps=24, eos=EOS):
    return sample(model, prompts, SamplingParams(max_new_tokens=steps, temperature=0.0), pad_token_id=0, eos_token_ids=[eos])


@pytest.mark.parametrize("eos", [EOS, 99], ids=["eos-2", "eos-99"])
def test_greedy_matches_generate_token_for_token(tiny_model, eos):
    ids, mask = left_pad(PROMPTS, 0)
    rollout = _greedy(tiny_model, (ids, mask), eos=eos)
    generated = tiny_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=eos)
    expected = generated[:, ids.shape[1] :]  # (B, N); rows that stopped are padded with 0 by generate too
    assert torch.equal(rollout.completion_ids, expected[:, : rollout.completion_ids.shape[1]])
    assert (expected[:, rollout.completion_ids.shape[1] :] == 0).all()
    assert rollout.completion_ids.unique().numel() > 5  # the test model really varies its output


def test_completion_mask_runs_through_eos_and_truncated_flag(tiny_gpt2):
    # pick as EOS a token that the greedy continuation of some prompts contains and of others not
    free = _greedy(tiny_gpt2, PROMPTS, steps=30, eos=99).completion_ids  # (B, 30)
    counts = torch.stack([torch.bincount(row, minlength=100) > 0 for row in free]).sum(0)  # rows containing each token
    eos = int(((counts > 0) & (counts < len(PROMPTS))).nonzero()[0])
    rollout = _greedy(tiny_gpt2, PROMPTS, steps=30, eos=eos)
    for ids, mask, truncated in zip(rollout.completion_ids, rollout.completion_mask, rollout.truncated):
        eos_at = (ids == eos).nonzero()
        if truncated:
            assert eos_at.numel() == 0 and mask.all()
        else:
            end = int(eos_at[0])  # mask is 1 on 0..end (EOS included), 0 after; padding after is pad id
            assert mask[: end + 1].all() and not mask[end + 1 :].any()
            assert (ids[end + 1 :] == 0).all()
    assert rollout.truncated.any() and not rollout.truncated.all()


def test_left_padding_gives_the_same_completion_as_unpadded(tiny_model):
    batched = _greedy(tiny_model, PROMPTS, eos=99)
    for row, prompt in enumerate(PROMPTS):
        alone = _greedy(tiny_model, [prompt], eos=99)
        n = alone.completion_ids.shape[1]  # the batch runs on while other rows have not stopped
        assert torch.equal(batched.completion_ids[row, :n], alone.completion_ids[0])
        assert not batched.completion_mask[row, n:].any()
        torch.testing.assert_close(batched.logprobs[row, :n], alone.logprobs[0], rtol=0, atol=1e-5)


def test_group_index_repeats_each_prompt(tiny_llama):
    rollout = sample(tiny_llama, PROMPTS[:2], SamplingParams(max_new_tokens=5), 0, [EOS], group_size=3, generator=torch.Generator().manual_seed(0))
    assert rollout.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2]) and not torch.equal(rollout.prompt_ids[2], rollout.prompt_ids[3])
    assert rollout.logprobs.dtype == torch.float32 and (rollout.logprobs[rollout.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("autocast", [False, True], ids=["static-cache", "dynamic-cache"])
def test_a_group_shares_one_prefill_and_samples_as_separate_rows_would(tiny_model, autocast, monkeypatch):
    # group_size G: each distinct prompt is prefilled once and its cache repeated G-fold; with the same
    # uniforms the rows equal those of sampling the G-times repeated prompt list with group_size 1.
    # Padded prefills: packed ones of 3 and of 9 prompts round differently in bfloat16 (next test)
    monkeypatch.setattr(sampling, "_prompt_rows", lambda causal_lm, prompt_mask: None)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    noise = torch.rand((8, 9), generator=torch.Generator().manual_seed(0))  # (N, B)
    repeated = [p for p in PROMPTS[:3] for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        grouped = sample(tiny_model, PROMPTS[:3], params, 0, [EOS], group_size=3, noise=noise)
        one_by_one = sample(tiny_model, repeated, params, 0, [EOS], group_size=1, noise=noise)
    assert torch.equal(grouped.completion_ids, one_by_one.completion_ids)
    assert torch.equal(grouped.completion_mask, one_by_one.completion_mask)
    torch.testing.assert_close(grouped.logprobs, one_by_one.logprobs, rtol=0, atol=1e-4 if autocast else 1e-5)
    assert len(set(map(tuple, grouped.completion_ids.tolist()))) > 3  # the rows of a group differ after the shared prefill


def test_prompts_pack_first_fit_decreasing_by_hand(tiny_llama):
    # lengths 5, 2, 4, 3, 1 into rows of 5: longest first, each into the first row it fits
    # 5 -> row 0 (full); 4 -> row 1 (1 left); 3 -> row 2 (2 left); 2 -> row 2 (0 left); 1 -> row 1
    assert sampling.pack_prompts([5, 2, 4, 3, 1], 5) == [[0], [2, 4], [3, 1]]
    assert sampling.pack_prompts([3, 3, 3], 3) == [[0], [1], [2]]

    def mask(*lengths):
        return torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])

    assert sampling._prompt_rows(tiny_llama, mask(4, 1, 2)) == [[0], [2, 1]]  # two rows for three prompts
    assert sampling._prompt_rows(tiny_llama, mask(4, 3)) is None  # no two fit in one row: padded
    wide = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])  # lengths 2 and 1, padded to 4 columns
    assert sampling._prompt_rows(tiny_llama, wide) == [[0, 1]]  # two prompts that fit one row: packed
    assert sampling._prompt_rows(tiny_llama, mask(4)) is None


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("group_size", [1, 2])
def test_packed_prefill_gives_the_padded_prefills_logits_and_cache(tiny_model, window, group_size, monkeypatch):
    # the prompts side by side in fewer rows, each token seeing only its own prompt (and window): the
    # logits and the keys and values at every real slot are the padded prefill's; padding slots hold
    # zeros. Also for a model whose LM head is not a module it calls (logits then at every position)
    ids, mask = left_pad(PROMPTS, 0)
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
    rows = sampling._prompt_rows(tiny_model, mask[::group_size])
    assert rows is not None and len(rows) < len(PROMPTS)
    total = ids.shape[1] + 4

    def prefill(rows):
        cache = sampling._static_cache(tiny_model.config, total)
        return sampling._prefill(tiny_model, ids, mask, group_size, cache, total, torch.float32, window, False, rows), cache

    padded_logits, padded = prefill(None)
    real = mask.bool()[:, None, :, None]  # (B, 1, P, 1)
    for head_called in (True, False):
        if not head_called:
            monkeypatch.setattr(tiny_model, "get_output_embeddings", lambda: torch.nn.Identity())  # a module the forward never calls
        logits, packed = prefill(rows)
        torch.testing.assert_close(logits, padded_logits, rtol=0, atol=1e-5)
        for a, b in zip(padded.layers, packed.layers):
            for expected, got in ((a.keys, b.keys), (a.values, b.values)):
                prompt_expected, prompt_got = expected[:, :, : ids.shape[1]], got[:, :, : ids.shape[1]]
                torch.testing.assert_close(prompt_got * real, prompt_expected * real, rtol=0, atol=1e-5)
                assert (prompt_got.masked_select(~real) == 0).all() and (got[:, :, ids.shape[1] :] == 0).all()


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty; z = 3.719 is the normal 1e-4 upper quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over bins with expected count >= 5 (the rest pooled into one bin)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 5)])
def test_sampled_frequencies_match_the_model_distribution(tiny_llama, temperature, top_k):
    """20,000 first tokens for one prompt; Pearson chi-square against softmax(z / tau) (renormalised
    over the top-k when top_k > 0). The test fails with probability ~1e-4 if the sampler is right."""
    prompt = PROMPTS[0]
    logits = tiny_llama(torch.tensor([prompt])).logits[0, -1].detach().double() / temperature  # (V,)
    probs = torch.softmax(filter_logits(logits[None], top_k=top_k)[0], -1)
    n = 20_000
    rollout = sample(
        tiny_llama, [prompt], SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k), 0, [EOS], group_size=n,
        generator=torch.Generator().manual_seed(1),
    )
    counts = torch.bincount(rollout.completion_ids[:, 0], minlength=probs.numel()).double()
    if top_k:
        assert counts[probs == 0].sum() == 0  # nothing outside the top-k is ever drawn
    stat, df = _chi2(counts, probs)
    assert df >= 3
    assert stat < _chi2_critical(df), f"chi2={stat:.1f} with df={df}"
    # the recorded log-prob is log softmax(z / tau)[y] over the full vocabulary
    full = torch.log_softmax(logits, -1).float()
    torch.testing.assert_close(rollout.logprobs[:, 0], full[rollout.completion_ids[:, 0]], rtol=0, atol=1e-5)


def test_a_wrong_sampler_fails_the_chi_square_test(tiny_llama):
    """Power check: draws at temperature 1.2 are rejected as samples of the temperature-1 distribution."""
    prompt = PROMPTS[0]
    probs = torch.softmax(tiny_llama(torch.tensor([prompt])).logits[0, -1].detach().double(), -1)
    rollout = sample(tiny_llama, [prompt], SamplingParams(max_new_tokens=1, temperature=1.2), 0, [EOS], group_size=20_000, generator=torch.Generator().manual_seed(1))
    stat, df = _chi2(torch.bincount(rollout.completion_ids[:, 0], minlength=probs.numel()).double(), probs)
    assert stat > _chi2_critical(df)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: the mass ranked above each is 0, 0.5, 0.8, 0.95; with p = 0.8 the
    # first two stay (0 < 0.8, 0.5 < 0.8) and the third goes (0.8 >= 0.8)
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    kept = filter_logits(logits, top_p=0.8).isfinite()
    assert kept.tolist() == [[False, True, False, True]]
    assert filter_logits(logits, top_p=0.01).isfinite().tolist() == [[False, True, False, False]]  # the top token always stays
    assert filter_logits(logits, top_k=3).isfinite().tolist() == [[True, True, False, True]]
    # probs 0.4, 0.3, 0.3 with p = 0.5: mass above 0, 0.4, 0.7 keeps the first 0.3; the other 0.3 ties
    # with it and stays too (as top-k keeps ties with the k-th; transformers' pick between them is the sort's)
    tied = torch.log(torch.tensor([[0.3, 0.4, 0.3]]))
    assert filter_logits(tied, top_p=0.5).isfinite().tolist() == [[True, True, True]]
    # a row whose logits hold a NaN (or are all -inf) has no mass below p anywhere: it is left as it is, not an index of -1
    # (an IndexError here, a device-side assert on a GPU) that ends the run
    odd = torch.tensor([[1.0, float("nan"), 3.0], [float("-inf")] * 3, [1.0, 2.0, 3.0]])
    out = filter_logits(odd, top_p=0.5)
    assert out[1].isneginf().all() and out[2].isfinite().tolist() == [False, False, True] and out[0, 2] == 3.0


def test_inverse_cdf_draw_by_hand():
    # weights 0.15, 0.5, 0.05, 0.3 in blocks of 2: F = 0.15, 0.65, 0.70, 1.0; the token is the first y
    # with F(y) > u F(V): u = 0.1 -> 0, 0.15 -> 1 (F(0) = 0.15 is not > 0.15), 0.66 -> 2, 0.75 -> 3, 0.999 -> 3
    weights = torch.tensor([[0.15, 0.5, 0.05, 0.3]], dtype=torch.float64).repeat(5, 1)
    uniform = torch.tensor([0.1, 0.15, 0.66, 0.75, 0.999], dtype=torch.float64)
    assert inverse_cdf_draw(weights, uniform, block=2).tolist() == [0, 1, 2, 3, 3]
    # unnormalised weights (x 4) and a vocabulary that is not a multiple of the block (padded to 6)
    assert inverse_cdf_draw(4 * weights, uniform, block=3).tolist() == [0, 1, 2, 3, 3]


def test_inverse_cdf_draw_equals_the_one_level_search_and_never_draws_a_zero_weight_token():
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand((64, 1000), generator=generator, dtype=torch.float64) ** 4  # (B, V)
    weights[:, 700:] = 0.0  # a filtered tail: the end of one block of 256 and all of the last
    weights[:, 699] = 1.0  # the last token of positive weight, too heavy for round-off to skip
    weights[::2, 256:512] = 0.0  # a whole block of zeros in every other row
    uniform = torch.rand(64, generator=generator, dtype=torch.float64)
    cdf = weights.cumsum(-1)
    one_level = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    for block in (1, 7, 256, 1000, 4096):
        assert torch.equal(inverse_cdf_draw(weights, uniform, block=block), one_level)
    # u * F(V) rounded up to F(V) (u = 1 stands in for it): the last token of positive weight, not
    # the zero-weight tail nor the padding past V
    last = inverse_cdf_draw(weights.float(), torch.ones(64), block=256)
    assert torch.equal(last, torch.full((64,), 699))


def test_bad_parameters_are_errors(tiny_llama):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="empty prompt"):
        sample(tiny_llama, [[]], SamplingParams(), 0, [EOS])
    with pytest.raises(ValueError, match="eos_token_ids"):
        sample(tiny_llama, PROMPTS, SamplingParams(), 0, [])


def test_compiled_decode_step_samples_what_the_eager_one_does_and_follows_weight_updates(tiny_model, compiled_sampling_calls):
    # compile=True runs the decode step (the draw of the next token in it) through torch.compile (static shapes, cache
    # rounded up by cache_bucket, guards skipped from the third step). Same uniforms -> same tokens;
    # the compiled graph reads the parameters at call time, so an in-place update shows in the next call
    calls = compiled_sampling_calls
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    noise = torch.rand((10, 8), generator=torch.Generator().manual_seed(1))  # (N, B)

    attention = tiny_model.config._attn_implementation

    def both(prompts=PROMPTS, group_size=2, noise=noise):
        eager = sample(tiny_model, prompts, params, 0, [EOS], group_size=group_size, noise=noise)
        compiled = sample(tiny_model, prompts, params, 0, [EOS], group_size=group_size, noise=noise, compile=True)
        assert not torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()  # the stance is set back
        assert tiny_model.config._attn_implementation == attention  # and the model's attention (eager inside the compiled step)
        assert torch.equal(compiled.completion_ids, eager.completion_ids)
        assert torch.equal(compiled.completion_mask, eager.completion_mask)
        torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-4)
        return compiled.completion_ids

    before = both()
    assert calls["decode"] >= 9 and calls["draw"] == 1  # the compiled functions ran the steps (the step draws its next token; the first draw is its own call)
    weight = tiny_model.get_output_embeddings().weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(3.0)  # sharper next-token distributions: different draws from the same uniforms
        after = both()
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert not torch.equal(before, after)
    # another batch size and a longer prompt (another cache bucket) in the same process
    long_prompts = [list(range(3, 60)), [1, 5, 6]]  # 57 + 10 positions -> 80 slots instead of 32
    both(long_prompts, group_size=3, noise=torch.rand((10, 6), generator=torch.Generator().manual_seed(2)))
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    assert torch.equal(sample(tiny_model, PROMPTS, greedy, 0, [EOS], compile=True).completion_ids, _greedy(tiny_model, PROMPTS).completion_ids)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.3, 0, 0.8), (1.0, 5, 0.9)])
def test_the_compiled_decode_step_filters_top_p_as_the_eager_one_does(tiny_llama, compiled_sampling_calls, temperature, top_k, top_p):
    # top-p after a temperature or a top-k: the compiled decode step (inductor with the decode
    # options) once read the mask scattered back from sorted order as all False and drew from every
    # token; every draw must stay in the eager step's top-p set, so the tokens are the eager ones
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    noise = torch.rand((12, 8), generator=torch.Generator().manual_seed(0))  # (N, B)
    eager = sample(tiny_llama, PROMPTS[:2], params, 0, [EOS], group_size=4, noise=noise)
    compiled = sample(tiny_llama, PROMPTS[:2], params, 0, [EOS], group_size=4, noise=noise, compile=True)
    assert compiled_sampling_calls["decode"] >= 11
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-4)


def test_cuda_graphs_on_a_cpu_model_run_the_plain_compiled_step(tiny_model, compiled_sampling_calls):
    # cuda_graphs only changes a CUDA device's step (tests/gpu checks that one); on a CPU the call is
    # sample(compile=True) exactly, and the config refuses cuda_graphs without compile
    from rlalign.train.rl_config import SamplingConfig, check_compile
    from rlalign.train.run_config import ModelConfig

    noise = torch.rand((8, 2 * len(PROMPTS)), generator=torch.Generator().manual_seed(5))
    params = SamplingParams(max_new_tokens=8)
    plain, graphed = (sample(tiny_model, PROMPTS, params, 0, [EOS], group_size=2, noise=noise, compile=True, cuda_graphs=g) for g in (False, True))
    assert torch.equal(plain.completion_ids, graphed.completion_ids)
    assert compiled_sampling_calls["graphed"] == 0 and compiled_sampling_calls["decode"] > 0
    with pytest.raises(ValueError, match="sampling.cuda_graphs=true"):
        check_compile(False, ModelConfig(path="m"), SamplingConfig(cuda_graphs=True))


@pytest.mark.parametrize("kv_heads, kernel", [(2, GROUPED_EAGER), (4, "eager")])
def test_the_compiled_decode_step_runs_eager_attention_and_the_model_gets_its_own_back(kv_heads, kernel, monkeypatch):
    # inside the compiled decode loop the model runs eager attention (inductor fuses it; SDPA's CPU
    # kernel is slow for one query row), grouped where heads share key/value heads; the prefill and
    # everything after keep the model's own
    model = make_llama(num_key_value_heads=kv_heads)
    own = model.config._attn_implementation
    assert own != "eager"
    seen = []
    decode = sampling._decode_step
    monkeypatch.setattr(compiled_steps, "_compiled_decode_step", lambda model, *args: seen.append(model.config._attn_implementation) or decode(model, *args))
    sample(model, PROMPTS, SamplingParams(max_new_tokens=4), 0, [EOS], compile=True)
    assert seen and set(seen) == {kernel} and model.config._attn_implementation == own
    with pytest.raises(RuntimeError, match="boom"), attention_kernel(model, "eager"):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == own


def test_cache_buckets_by_hand():
    assert [cache_bucket(n) for n in (1, 16, 17, 64, 65, 80, 81, 128, 129, 200, 1000, 1025)] == [16, 16, 32, 64, 80, 80, 96, 128, 160, 224, 1024, 1280]


@pytest.mark.parametrize("capped_function", ["_compiled_draw", "_compiled_decode_step"])  # the first token's draw; the steps (with their draws)
def test_past_the_cap_on_compiled_versions_a_call_warns_and_runs_eager(tiny_llama, monkeypatch, capped_function):
    def capped(*args):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit reached")

    monkeypatch.setattr(compiled_steps, capped_function, capped)
    params = SamplingParams(max_new_tokens=6)
    noise = torch.rand((6, 4), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="compiled versions"):
        compiled = sample(tiny_llama, PROMPTS, params, 0, [EOS], noise=noise, compile=True)
    assert torch.equal(compiled.completion_ids, sample(tiny_llama, PROMPTS, params, 0, [EOS], noise=noise).completion_ids)


_SAMPLE_EAGERLY = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import rlalign.train.grpo
from rlalign.lm.sampling import SamplingParams, sample
model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
sample(model, [[1, 5, 6], [1, 7]], SamplingParams(max_new_tokens=3), 0, [2])
print([name in sys.modules for name in ("torch._functorch.aot_autograd", "networkx")])
"""


@pytest.mark.canary
def test_a_process_that_samples_eagerly_never_imports_the_compile_backends():
    # calling torch.compile imports dynamo's backends (~20 MB resident), so the sampler calls it at its first compiled call
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SAMPLE_EAGERLY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[False, False]"]


@pytest.mark.parametrize("per_function", [True, False], ids=["torch.compile-limit", "dynamo-settings"])
def test_past_its_recompile_limit_a_compiled_function_raises_on_either_torch(monkeypatch, per_function):
    # torch 2.11's torch.compile takes no recompile_limit: the limit then comes from dynamo's settings
    # around each call; either way the call past the limit raises FailOnRecompileLimitHit (the sampler
    # then warns and runs eager)
    monkeypatch.setattr(compiled_steps, "compile_takes_recompile_limit", lambda: per_function)

    def triple(x):
        return x * 3

    compiled = compiled_steps._CompiledOnFirstCall(triple, fullgraph=True, dynamic=False, recompile_limit=2)
    for n in (1, 2):
        assert torch.equal(compiled(torch.ones(n)), torch.full((n,), 3.0))
    assert bool(compiled.limits) is not per_function
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # fullgraph: past the limit dynamo fails hard
        compiled(torch.ones(3))


def test_compiled_on_first_call_compiles_at_the_first_call_and_only_then():
    def double(x):
        return x * 2

    compiled = compiled_steps._CompiledOnFirstCall(double, fullgraph=True, dynamic=False)
    assert compiled.compiled is None
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    made = compiled.compiled
    assert made._torchdynamo_orig_callable is double  # torch.compile's wrapper of this function
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0)) and compiled.compiled is made


def _sliding_window_model(kind: str):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "mistral":  # every layer slides; one mask
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=6)).eval()
    # Qwen2 with use_sliding_window: layer 0 full, layer 1 sliding; a mask per layer type
    return Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=6, max_window_layers=1)).eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2-hybrid"])
def test_sliding_window_models_sample_as_generate(kind):
    # a window of 6 slots, shorter than prompt + completion (up to 12 + 20): the sampler's window mask
    # (prefill and every decode step, eager and compiled) gives generate's greedy tokens
    model = _sliding_window_model(kind)
    assert getattr(model.config, "layer_types", None) == (["full_attention", "sliding_attention"] if kind == "qwen2-hybrid" else None)
    for prompts in (PROMPTS, [p + [7] for p in PROMPTS]):
        ids, mask = left_pad(prompts, 0)
        expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=99)[:, ids.shape[1]:]
        assert expected.unique().numel() > 5
        for compile in (False, True):
            rollout = sample(model, (ids, mask), SamplingParams(max_new_tokens=20, temperature=0.0), 0, [99], compile=compile)
            assert torch.equal(rollout.completion_ids, expected), (kind, compile)
    # the training pass (transformers' own sliding-window masks over prompt + completion) gives the sampler's log-probs
    drawn = sample(model, PROMPTS, SamplingParams(max_new_tokens=20), 0, [EOS], group_size=2, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rollout_logprobs(model, drawn), drawn.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(rollout_logprobs(model, drawn, share_prompts=True), drawn.logprobs, rtol=0, atol=1e-5)  # each prompt run once
    grouped = sample(model, PROMPTS[:2], SamplingParams(max_new_tokens=20, temperature=0.0), 0, [99], group_size=3)  # the shared prefill path
    assert torch.equal(grouped.completion_ids[::3], sample(model, PROMPTS[:2], SamplingParams(max_new_tokens=20, temperature=0.0), 0, [99]).completion_ids)


def test_attention_the_window_masks_cannot_express_is_a_clear_error():
    # chunked attention (Llama 4) past its chunk, and layer types besides full and sliding past the window
    from transformers import Llama4TextConfig, Qwen2Config

    chunked = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8)
    assert sampling._sliding_window(chunked, 8) is None  # fits in a chunk: plain causal attention
    with pytest.raises(ValueError, match="chunked attention"):
        sampling._sliding_window(chunked, 9)
    hybrid = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert sampling._sliding_window(hybrid, 6) is None and sampling._sliding_window(hybrid, 7) == 6
    hybrid.layer_types = ["conv", "sliding_attention"]
    assert sampling._layer_types(hybrid, None)  # no window in play: one full mask, whatever the layer types
    with pytest.raises(ValueError, match="conv"):
        sampling._layer_types(hybrid, 6)


def test_windows_that_differ_by_layer_or_another_sliding_layer_kind_are_a_clear_error(monkeypatch):
    # the sampler masks one window over plain layers: sliding layers of windows 4 and 6, or a sliding
    # layer of a kind it does not know (even with one window), cannot be expressed by its masks
    from transformers import LlamaConfig
    from transformers.cache_utils import StaticSlidingWindowLayer

    class OtherSlidingLayer(StaticSlidingWindowLayer):
        pass

    def fake_cache(*layers):
        return lambda config, max_cache_len: type("Cache", (), {"layers": [kind(max_cache_len=max_cache_len, sliding_window=w) for kind, w in layers]})()

    config = LlamaConfig(num_hidden_layers=2)
    monkeypatch.setattr(sampling, "StaticCache", fake_cache((StaticSlidingWindowLayer, 4), (StaticSlidingWindowLayer, 4)))
    assert sampling._sliding_window(config, 10) == 4  # one window, the known kind: the sampler masks it
    monkeypatch.setattr(sampling, "StaticCache", fake_cache((StaticSlidingWindowLayer, 4), (StaticSlidingWindowLayer, 6)))
    with pytest.raises(ValueError, match=r"\[4, 6\] at 10 positions"):
        sampling._sliding_window(config, 10)
    monkeypatch.setattr(sampling, "StaticCache", fake_cache((OtherSlidingLayer, 4), (StaticSlidingWindowLayer, 4)))
    with pytest.raises(ValueError, match="OtherSlidingLayer"):
        sampling._sliding_window(config, 10)


def test_compile_under_autocast_is_an_error(tiny_llama):
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="StaticCache"):
        sample(tiny_llama, PROMPTS, SamplingParams(max_new_tokens=4), 0, [EOS], compile=True)


@pytest.mark.canary
@pytest.mark.skipif(not can_pack_linear(torch.nn.Linear(2, 2).bfloat16()), reason="no oneDNN bfloat16 kernels on this CPU")
def test_compiled_decode_step_runs_packed_linear_layers_and_sees_a_repack_without_recompiling(tiny_llama, compiled_sampling_calls, monkeypatch):
    # a bfloat16 copy with its linear layers packed for oneDNN (the training sampler's copy): compiled,
    # it draws what the compiled plain copy draws; after a weight update and repack, the same graph
    # computes with the new weights
    from torch._dynamo.utils import counters

    plain, packed = cast_copy(tiny_llama, "bfloat16"), cast_copy(tiny_llama, "bfloat16")
    assert pack_linear_layers(packed) > 0
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    noise = torch.rand((10, 8), generator=torch.Generator().manual_seed(4))  # (N, B)

    def draws(model):
        return sample(model, PROMPTS, params, 0, [EOS], group_size=2, noise=noise, compile=True)

    def same():
        a, b = draws(plain), draws(packed)
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
        return b.completion_ids

    before = same()
    # every compiled decode step runs every layer through the packed kernel (not F.linear)
    kernel_calls = []
    kernel = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: kernel_calls.append(1) or kernel(*args))
    decode_before = compiled_sampling_calls["decode"]
    draws(packed)
    decode_steps = compiled_sampling_calls["decode"] - decode_before
    packed_layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    products = sum(m.shared is None or m.index == 0 for m in packed_layers)  # q, k, v one matmul; gate and up one
    assert products == 9 and len(packed_layers) == 15  # 2 layers of (q, k, v) + o + (gate, up) + down, and the LM head
    assert decode_steps >= 9 and len(kernel_calls) >= products * (decode_steps + 1)  # + the eager prefill
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for model in (plain, packed):
            model.get_output_embeddings().weight.mul_(3.0)  # sharper distributions: other draws from the same uniforms
            model.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # and a layer of a group run as one matmul
    repack_linear_layers(packed)  # a new packed buffer: a graph input, so no recompile
    after = draws(packed)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(after.completion_ids, same()) and not torch.equal(after.completion_ids, before)
    assert compiled_sampling_calls["decode"] >= 45  # five compiled calls of 9+ decode steps


def test_sampling_params_reject_top_p_outside_0_1():
    SamplingParams(max_new_tokens=4, top_p=1.0)
    for top_p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(max_new_tokens=4, top_p=top_p)


def test_packed_prefill_padding_never_joins_a_prompts_segment(tiny_llama):
    # lengths 4, 2, 2, 2, 2, 2, 2, 2, 3 into rows of 4, first fit decreasing: [0], [8], [1, 2], [3, 4],
    # [5, 6], [7]. Row 1 holds prompt 8 at grid slots 4-6 and padding at slot 7. Padding slots are
    # segments of their own (negative ids): were slot 7's id 7 + 1 = 8, prompt 8 would attend to it.
    lengths = [4, 2, 2, 2, 2, 2, 2, 2, 3]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=generator).tolist() for n in lengths]
    ids, mask = left_pad(prompts, 0)
    rows = sampling._prompt_rows(tiny_llama, mask)
    assert rows == [[0], [8], [1, 2], [3, 4], [5, 6], [7]]
    total = ids.shape[1] + 2

    def prefill(rows):
        cache = sampling._static_cache(tiny_llama.config, total)
        return sampling._prefill(tiny_llama, ids, mask, 1, cache, total, torch.float32, None, False, rows)

    torch.testing.assert_close(prefill(rows), prefill(None), rtol=0, atol=1e-5)


def test_sampling_builds_no_graph_even_from_a_trainable_model(tiny_llama):
    # the log-probs become log pi_old: a graph through them would send gradient into pi_old
    assert any(p.requires_grad for p in tiny_llama.parameters())
    rollout = sample(tiny_llama, PROMPTS, SamplingParams(max_new_tokens=3), 0, [EOS], noise=torch.rand(3, len(PROMPTS)))
    assert not rollout.logprobs.requires_grad
