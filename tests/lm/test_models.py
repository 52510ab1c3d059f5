"""Model loading: scalar heads read the last real token, heads survive save/reload, LoRA reference, dropout off."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from rlalign.lm.heads import HEAD_FILE, ScalarHeadModel, load_critic, load_reward_model
from rlalign.lm.models import (
    LoraConfig,
    ModelLoadError,
    apply_lora,
    cache_argument,
    cast_copy,
    copy_weights,
    hold_matmul_weights,
    load_policy,
    load_reference,
    load_tokenizer,
    reference_policy,
)
from rlalign.lm.packed import PackedLinear, can_pack_linear, pack_linear_layers, repack_linear_layers

from .conftest import make_gpt2, make_llama


@pytest.fixture(params=["llama", "gpt2"])
def checkpoint(request, llama_checkpoint, gpt2_checkpoint):
    return llama_checkpoint if request.param == "llama" else gpt2_checkpoint


def test_the_kv_cache_goes_by_the_keyword_the_forward_names(tiny_llama, llama_checkpoint):
    # transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40); a
    # model whose forward still says past_key_values (older transformers, remote code) gets that
    class OldForward(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            return input_ids

    class NewForward(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None):
            return input_ids

    assert cache_argument(OldForward()) == "past_key_values" and cache_argument(NewForward()) == "cache"
    expected = "cache" if "cache" in inspect.signature(type(tiny_llama).forward).parameters else "past_key_values"
    assert cache_argument(tiny_llama) == expected
    lora = apply_lora(load_policy(llama_checkpoint), LoraConfig(r=2))
    assert cache_argument(lora) == expected  # a peft model: its base model's forward


def test_reward_is_read_at_the_last_non_pad_token(checkpoint):
    rm = load_reward_model(checkpoint, trainable=True).eval()  # a fresh head: the test is where it is read
    ids = torch.tensor([[1, 14, 15, 16, 2], [1, 20, 2, 0, 0]])  # row 1 is right-padded after its EOS
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    scores = rm.sequence_scores(ids, mask)  # (2,)
    values = rm(ids, mask)  # (2, 5)
    assert scores[0] == values[0, 4] and scores[1] == values[1, 2]
    alone = rm.sequence_scores(ids[1:, :3], mask[1:, :3])  # the same sequence without padding
    torch.testing.assert_close(scores[1:], alone, rtol=0, atol=1e-5)
    garbage = ids.clone()
    garbage[1, 3:] = 50  # what sits in the padding does not matter
    torch.testing.assert_close(rm.sequence_scores(garbage, mask), scores, rtol=0, atol=1e-6)
    left = rm.sequence_scores(torch.tensor([[0, 0, 1, 20, 2]]), torch.tensor([[0, 0, 1, 1, 1]]))  # left padding too
    torch.testing.assert_close(left, alone, rtol=0, atol=1e-5)


def test_saved_reward_model_reloads_with_its_head(checkpoint, tmp_path):
    rm = load_reward_model(checkpoint, trainable=True)
    assert rm.head.bias is None  # a reward model is trained without bias: it saves as a HF sequence classifier
    with torch.no_grad():
        rm.head.weight.add_(0.5)
    rm.save_pretrained(tmp_path / "rm")
    assert not (tmp_path / "rm" / HEAD_FILE).exists() and (tmp_path / "rm" / "model.safetensors").is_file()
    again = load_reward_model(tmp_path / "rm")
    ids, mask = torch.tensor([[1, 14, 15, 2]]), torch.ones(1, 4, dtype=torch.long)
    torch.testing.assert_close(again.sequence_scores(ids, mask), rm.sequence_scores(ids, mask), rtol=0, atol=1e-6)
    assert not any(p.requires_grad for p in again.parameters())  # a loaded reward model is frozen
    critic = load_critic(tmp_path / "rm")  # critic initialised from the reward model keeps its head, and gets a bias to train
    assert critic.head.bias.item() == 0.0 and all(p.requires_grad for p in critic.parameters())
    torch.testing.assert_close(critic.sequence_scores(ids, mask), rm.sequence_scores(ids, mask), rtol=0, atol=1e-6)


def test_a_critic_keeps_its_bias_in_the_value_head_format(checkpoint, tmp_path):
    critic = load_critic(checkpoint)
    with torch.no_grad():
        critic.head.weight.add_(0.5)
        critic.head.bias.fill_(3.0)
    critic.save_pretrained(tmp_path / "critic")
    assert (tmp_path / "critic" / HEAD_FILE).is_file() and (tmp_path / "critic" / "model.safetensors").is_file()
    again = load_critic(tmp_path / "critic")
    assert again.head.bias.item() == 3.0
    ids, mask = torch.tensor([[1, 14, 15, 2]]), torch.ones(1, 4, dtype=torch.long)
    torch.testing.assert_close(again.sequence_scores(ids, mask), critic.sequence_scores(ids, mask), rtol=0, atol=1e-6)
    # the same directory read as a frozen reward model keeps the bias too
    torch.testing.assert_close(load_reward_model(tmp_path / "critic").sequence_scores(ids, mask), critic.sequence_scores(ids, mask), rtol=0, atol=1e-6)


def test_critic_from_an_sft_checkpoint_gets_a_fresh_head(llama_checkpoint):
    critic = load_critic(llama_checkpoint)
    assert critic.head.bias.item() == 0.0
    policy = load_policy(llama_checkpoint)
    # the backbone is the causal LM's own transformer
    torch.testing.assert_close(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)


def test_lora_reference_is_the_base_model(llama_checkpoint):
    base = load_reference(llama_checkpoint)
    policy = load_policy(llama_checkpoint, lora=LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # move the adapters away from their zero init
    ids = torch.tensor([[1, 14, 15, 16, 17]])
    assert (policy(ids).logits - base(ids).logits).abs().max() > 1e-2
    with reference_policy(policy) as ref:
        torch.testing.assert_close(ref(ids).logits, base(ids).logits, rtol=0, atol=1e-6)
    assert (policy(ids).logits - base(ids).logits).abs().max() > 1e-2  # adapters are back on
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)


def test_reference_policy_needs_a_reference_or_lora(tiny_llama):
    with reference_policy(tiny_llama, reference=tiny_llama) as ref:
        assert ref is tiny_llama
    with pytest.raises(ValueError, match="no reference"):
        with reference_policy(tiny_llama):
            pass


def test_saved_lora_policy_reloads_with_its_adapter(llama_checkpoint, tmp_path):
    policy = apply_lora(load_policy(llama_checkpoint), LoraConfig(r=2))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    policy.save_pretrained(tmp_path / "adapter")
    again = load_policy(tmp_path / "adapter")
    ids = torch.tensor([[1, 14, 15]])
    torch.testing.assert_close(again(ids).logits, policy(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_checkpoint_without_tokenizer_files_is_one_error_never_an_empty_tokenizer(tmp_path, arch):
    # from a GPT-2 config alone transformers builds a tokenizer with no vocabulary, which encodes every text as []
    from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    if arch == "gpt2":
        GPT2ForSequenceClassification(GPT2Config(vocab_size=40, n_embd=8, n_layer=1, n_head=2, num_labels=1)).save_pretrained(tmp_path)
    else:
        LlamaForSequenceClassification(LlamaConfig(vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                   num_key_value_heads=1, num_labels=1)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(tmp_path))} holds no tokenizer: save the one its model was trained with"):
        load_tokenizer(tmp_path)


def test_dropout_is_disabled(tmp_path, tokenizer):
    make_gpt2(vocab=len(tokenizer), resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3).save_pretrained(tmp_path)
    policy = load_policy(tmp_path)
    assert policy.training and policy.config.resid_pdrop == 0.0 and policy.config.attn_pdrop == 0.0
    ids = torch.tensor([[1, 14, 15, 16]])
    torch.testing.assert_close(policy(ids).logits, policy(ids).logits, rtol=0, atol=0)  # no randomness in train mode


def test_lora_dropout_is_the_configured_one_and_the_models_own_stays_off(tmp_path, tokenizer):
    # lora.dropout 0.5 was accepted and then set to 0 with the model's own dropout: the adapters trained without it
    make_gpt2(vocab=len(tokenizer), resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3).save_pretrained(tmp_path)
    policy = load_policy(tmp_path, lora=LoraConfig(r=4, dropout=0.5))
    rates = {m.p for name, m in policy.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name}
    others = {m.p for name, m in policy.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" not in name}
    assert rates == {0.5} and others == {0.0} and policy.training
    ids = torch.tensor([[1, 14, 15, 16]])
    with torch.no_grad():
        for module in policy.modules():  # B = 0 at the start leaves the adapters out of the output: make them count
            if hasattr(module, "lora_B"):
                torch.nn.init.normal_(module.lora_B["default"].weight, std=1.0)
        assert not torch.equal(policy(ids).logits, policy(ids).logits)  # the adapters' dropout draws in train mode
        policy.eval()
        torch.testing.assert_close(policy(ids).logits, policy(ids).logits, rtol=0, atol=0)
    assert load_policy(tmp_path, lora=LoraConfig(r=4)).config.resid_pdrop == 0.0  # the default: no dropout anywhere


def test_a_reloaded_adapter_is_in_train_mode_and_keeps_the_dropout_of_the_lora_that_made_it(tmp_path, tokenizer):
    # a resumed LoRA run reloads its checkpoint's adapter: with lora.dropout 0.5 it trained with 0.5 before the
    # checkpoint and must after it; every module in train mode (from_pretrained leaves the base's in eval
    # mode, where activation checkpointing and the adapters' dropout do not act)
    make_gpt2(vocab=len(tokenizer), resid_pdrop=0.3).save_pretrained(tmp_path / "base")
    load_policy(tmp_path / "base", lora=LoraConfig(r=4, dropout=0.5)).save_pretrained(tmp_path / "adapter")

    def rates(model):
        return {m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name}

    resumed = load_policy(tmp_path / "adapter", lora=LoraConfig(r=4, dropout=0.5))
    assert rates(resumed) == {0.5} and all(m.training for m in resumed.modules())
    trained_on = load_policy(tmp_path / "adapter")  # a saved adapter to train on (model.adapter: train): dropout off
    assert rates(trained_on) == {0.0} and all(m.training for m in trained_on.modules())


def test_completions_stop_where_the_generation_config_says(llama_checkpoint):
    # an instruct model lists its end of turn beside the EOS (Llama 3: <|eot_id|>): transformers' generate and TRL stop at
    # every id listed; sampling stopped at the tokenizer's EOS alone and ran on past the end of the turn
    from rlalign.lm.models import stop_token_ids
    from rlalign.lm.sampling import SamplingParams, sample

    policy, tokenizer = load_policy(llama_checkpoint), load_tokenizer(llama_checkpoint)
    eos = tokenizer.eos_token_id
    assert stop_token_ids(policy, tokenizer) == [eos]
    policy.generation_config.eos_token_id = [eos, 7, eos]
    assert stop_token_ids(policy, tokenizer) == [eos, 7]
    assert stop_token_ids(load_policy(llama_checkpoint, lora=LoraConfig(r=4)), tokenizer) == [eos]  # through peft
    policy.generation_config.eos_token_id = list(range(len(tokenizer)))  # every token ends a completion: one token each
    rollout = sample(policy, [[1, 14, 15]] * 3, SamplingParams(max_new_tokens=6), 0, stop_token_ids(policy, tokenizer),
                     generator=torch.Generator().manual_seed(0))
    assert rollout.completion_mask.sum(-1).tolist() == [1, 1, 1] and not rollout.truncated.any()


def test_dtype_and_tokenizer_options(llama_checkpoint):
    policy = load_policy(llama_checkpoint, dtype="bfloat16")
    assert next(policy.parameters()).dtype == torch.bfloat16
    rm = ScalarHeadModel.from_pretrained(llama_checkpoint, dtype="bfloat16")
    assert rm.head.weight.dtype == torch.float32  # the head stays float32
    assert rm.sequence_scores(torch.tensor([[1, 14, 2]]), torch.ones(1, 3, dtype=torch.long)).dtype == torch.float32
    tok = load_tokenizer(llama_checkpoint)
    assert tok.pad_token_id == 0 and tok.padding_side == "left"
    with pytest.raises(ValueError, match="dtype"):
        load_policy(llama_checkpoint, dtype="float8")


def test_sampling_runs_on_lora_and_bfloat16_policies(llama_checkpoint):
    from rlalign.lm.sampling import SamplingParams, sample

    base = load_reference(llama_checkpoint)
    policy = load_policy(llama_checkpoint, lora=LoraConfig(r=4))
    prompts, params = [[1, 14, 15], [1, 20]], SamplingParams(max_new_tokens=8, temperature=0.0)
    with reference_policy(policy) as ref:  # adapters off: the base model's greedy tokens
        assert torch.equal(sample(ref, prompts, params, 0, [2]).completion_ids, sample(base, prompts, params, 0, [2]).completion_ids)
    half = load_policy(llama_checkpoint, dtype="bfloat16")
    rollout = sample(half, prompts, SamplingParams(max_new_tokens=8), 0, [2], generator=torch.Generator().manual_seed(0))
    assert rollout.logprobs.dtype == torch.float32 and torch.isfinite(rollout.logprobs).all()


def test_attention_implementation_option_switches_the_kernel_not_the_tokens(llama_checkpoint):
    from rlalign.lm.sampling import SamplingParams, sample

    eager = load_policy(llama_checkpoint, attn_implementation="eager")
    default = load_policy(llama_checkpoint)
    assert eager.config._attn_implementation == "eager" and default.config._attn_implementation != "eager"
    prompts, params = [[1, 14, 15], [1, 20]], SamplingParams(max_new_tokens=8, temperature=0.0)
    assert torch.equal(sample(eager, prompts, params, 0, [2]).completion_ids, sample(default, prompts, params, 0, [2]).completion_ids)
    assert load_reference(llama_checkpoint, attn_implementation="eager").config._attn_implementation == "eager"


def test_attention_kernel_switches_for_a_block_and_back(llama_checkpoint):
    from rlalign.lm.model_modes import attention_kernel

    policy = load_policy(llama_checkpoint, attn_implementation="eager", lora=LoraConfig(r=4))  # through peft too
    config = policy.get_base_model().config
    with attention_kernel(policy, "sdpa"):
        assert config._attn_implementation == "sdpa"
    assert config._attn_implementation == "eager"
    with attention_kernel(policy, None):
        assert config._attn_implementation == "eager"


@pytest.mark.parametrize("lora", [False, True])
def test_cast_copy_holds_the_weights_in_bfloat16_and_follows_updates(llama_checkpoint, lora):
    from rlalign.lm.sampling import SamplingParams, sample

    policy = load_policy(llama_checkpoint, lora=LoraConfig(r=4) if lora else None)
    copy = cast_copy(policy, "bfloat16")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the original is untouched
    assert all(a.dtype == b.dtype for a, b in zip(copy.buffers(), policy.buffers()))  # RoPE's frequencies stay float32
    assert len(list(copy.parameters())) == len(list(policy.parameters()))
    gpt2 = make_gpt2(tie_word_embeddings=True)  # LM head tied to the token embedding: the copy's stay tied
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    tied = cast_copy(gpt2, "bfloat16")
    assert tied.lm_head.weight is tied.transformer.wte.weight and tied.lm_head.weight.dtype == torch.bfloat16
    # the same greedy tokens as a model loaded in bfloat16 (same weights, same precision)
    prompts, greedy = [[1, 14, 15], [1, 20]], SamplingParams(max_new_tokens=8, temperature=0.0)
    if not lora:
        half = load_policy(llama_checkpoint, dtype="bfloat16")
        assert torch.equal(sample(copy, prompts, greedy, 0, [2]).completion_ids, sample(half, prompts, greedy, 0, [2]).completion_ids)
    # an update of the original reaches the copy only through copy_weights
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.5)
    trainable = [(c, p) for c, p in zip(copy.parameters(), policy.parameters()) if p.requires_grad]
    assert all(not torch.equal(c, p.to(torch.bfloat16)) for c, p in trainable)
    copy_weights(copy, policy)
    assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(copy.parameters(), policy.parameters()))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_matmul_weights_held_in_bfloat16_compute_what_autocast_computes(arch):
    # nn.Linear (Llama) and Conv1D (GPT-2) weights and biases held in bfloat16: under autocast the
    # log-probs equal the float32-held model's bit for bit; embeddings, norms and a tied head stay float32
    from rlalign.lm.logprobs import completion_logprobs

    from .conftest import make_llama

    full = make_llama(tie_word_embeddings=True) if arch == "llama" else make_gpt2(tie_word_embeddings=True)
    held = hold_matmul_weights(make_llama(tie_word_embeddings=True) if arch == "llama" else make_gpt2(tie_word_embeddings=True), "bfloat16")
    dtypes = {name: p.dtype for name, p in held.named_parameters()}
    assert dtypes["lm_head.weight" if "lm_head.weight" in dtypes else next(n for n in dtypes if "embed" in n or "wte" in n)] == torch.float32
    matmul = [n for n in dtypes if any(k in n for k in ("proj", "c_attn", "c_fc"))]
    assert matmul and all(dtypes[n] == torch.bfloat16 for n in matmul)
    assert all(dtypes[n] == torch.float32 for n in dtypes if "norm" in n or "ln_" in n)
    prompt_ids, prompt_mask = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids, completion_mask = torch.tensor([[12, 13, 2], [14, 2, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = completion_logprobs(full, prompt_ids, prompt_mask, completion_ids, completion_mask)
        got = completion_logprobs(held, prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert torch.equal(got, expected)
    with torch.no_grad():  # without autocast they differ: the weights really are rounded
        assert not torch.equal(completion_logprobs(held.float(), prompt_ids, prompt_mask, completion_ids, completion_mask),
                               completion_logprobs(full, prompt_ids, prompt_mask, completion_ids, completion_mask))


needs_onednn = pytest.mark.skipif(not can_pack_linear(torch.nn.Linear(2, 2).bfloat16()), reason="no oneDNN bfloat16 kernels on this CPU")


@pytest.mark.canary
@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_computes_what_linear_computes(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, dtype=dtype)
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    with torch.no_grad():
        for shape in [(1, 96), (8, 96), (3, 5, 96), (100, 96)]:
            x = torch.randn(shape, dtype=dtype)
            if dtype == torch.bfloat16:  # one kernel family: bit for bit
                assert torch.equal(packed(x), linear(x))
            else:  # float32 F.linear runs MKL's sgemm, the packed one oneDNN's: round-off apart
                torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(4, 96, dtype=dtype)
        linear.weight.mul_(2.0)  # the blocked copy is stale until repacked
        assert not torch.allclose(packed(x).float(), linear(x).float())
        packed.repack()
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    # with grad on a trainable weight or a grad-requiring input, and under autocast, it is F.linear
    x = torch.randn(4, 96, dtype=dtype, requires_grad=True)
    packed(x).sum().backward()
    assert linear.weight.grad is not None and x.grad is not None
    linear.requires_grad_(False)
    x.grad = None
    packed(x).sum().backward()  # a frozen layer inside a model that trains something before it
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(4, 96))
    x = x.detach()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(packed(x), linear(x))


@pytest.mark.canary
@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_layers_run_as_one_matmul_with_each_layers_values(bias):
    # an attention block's q, k, v: packed as one (56, 32) blocked weight held by their group; each
    # sibling's output is bit for bit its own nn.Linear's (bfloat16), also when called on another
    # input, on the same tensor changed in place, and after a weight is replaced and repacked
    import gc
    import weakref

    def block():
        torch.manual_seed(0)
        module = torch.nn.Module()
        for name, out in (("q_proj", 32), ("k_proj", 16), ("v_proj", 8), ("o_proj", 32)):
            setattr(module, name, torch.nn.Linear(32, out, bias=bias, dtype=torch.bfloat16))
        return module

    packed, plain = block(), block()
    assert pack_linear_layers(packed) == 4
    q, k, v, o = packed.q_proj, packed.k_proj, packed.v_proj, packed.o_proj
    shared = q.shared
    assert o.shared is None and q.shared is k.shared is v.shared and q.packed is None and shared.packed is not None
    names = ("q_proj", "k_proj", "v_proj")

    def matches(x, *which):
        return all(torch.equal(getattr(packed, name)(x), getattr(plain, name)(x)) for name in which)

    x, other = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(2, 3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert matches(x, "q_proj") and shared.input is x and shared.unread == 2
        assert matches(x, "k_proj", "v_proj") and shared.input is None and shared.parts is None  # every sibling took its part: released
        assert matches(other, *names) and shared.sharing
        for name in ("k_proj", "v_proj"):  # new parameter objects (load_state_dict(assign=True)); one sibling's repack refreshes the group
            getattr(plain, name).weight.mul_(-1.5)
            getattr(packed, name).weight = torch.nn.Parameter(getattr(plain, name).weight.clone(), requires_grad=False)
        v.repack()
        assert matches(x, *names) and shared.sharing
        with torch.inference_mode():  # inference tensors have no version counter
            assert matches(torch.randn(4, 32, dtype=torch.bfloat16), *names) and shared.sharing
        assert matches(x, "q_proj")
        x.mul_(2.0)  # changed in place after q took its part: k does not take the stale one, and sharing goes off
        assert matches(x, "k_proj", "v_proj") and not shared.sharing and shared.parts is None
        assert matches(x, *names) and matches(other, "k_proj", "q_proj")  # from now on each sibling is F.linear
    assert "sibling 1 of 3" in repr(k)
    gc.disable()  # no reference cycle: a packed model is freed without the cyclic collector
    try:
        gone = weakref.ref(packed.q_proj)
        del packed, q, k, v, o, shared
        assert gone() is None
    finally:
        gc.enable()


@needs_onednn
@pytest.mark.parametrize("dtype,lora", [("bfloat16", False), ("bfloat16", True), ("float16", False)])
def test_packed_copy_samples_the_tokens_and_log_probs_of_the_plain_copy(llama_checkpoint, dtype, lora):
    from rlalign.lm.sampling import SamplingParams, sample

    policy = load_policy(llama_checkpoint, lora=LoraConfig(r=4) if lora else None)
    plain, packed = cast_copy(policy, dtype), cast_copy(policy, dtype)
    if not can_pack_linear(packed):
        pytest.skip(f"no oneDNN {dtype} kernels on this CPU")
    linears = sum(type(m) is torch.nn.Linear for m in packed.modules())  # with LoRA: base layers and adapters' A and B
    assert not can_pack_linear(torch.nn.Linear(2, 2).to("meta")) and not can_pack_linear(policy)  # float32: not packed
    before = list(packed.parameters())
    assert pack_linear_layers(packed) == linears > 0 and not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert all(a is b for a, b in zip(packed.parameters(), before, strict=True))  # the same parameters: copy_weights still applies
    prompts, params = [[1, 14, 15], [1, 20], [1, 7, 8, 9]], SamplingParams(max_new_tokens=8, temperature=1.0)

    def draw(model):
        return sample(model, prompts, params, 0, [2], group_size=2, generator=torch.Generator().manual_seed(3))

    for _ in range(2):  # before and after an update of the policy reaches both copies
        a, b = draw(plain), draw(packed)
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:  # with LoRA the adapters move (B starts at 0: after this, the adapters count)
                    p.add_(0.01 * torch.randn_like(p))
        copy_weights(plain, policy)
        copy_weights(packed, policy)
        repack_linear_layers(packed)
    gpt2 = cast_copy(make_gpt2(tie_word_embeddings=True), "bfloat16")  # a tied LM head stays tied to the embedding
    pack_linear_layers(gpt2)
    assert isinstance(gpt2.lm_head, PackedLinear) and gpt2.lm_head.weight is gpt2.transformer.wte.weight


@pytest.mark.canary
def test_compiler_caches_released_only_after_a_compile(monkeypatch):
    """releasing_compiler_caches drops the caches when the block compiled a graph, and only then;
    what was compiled still runs afterwards, with the same values."""
    import linecache

    import rlalign.lm.compiled as compiled

    released = []
    monkeypatch.setattr(compiled, "release_compiler_caches", lambda: released.append(True))
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
    x = torch.linspace(-1.0, 1.0, 7)
    with compiled.releasing_compiler_caches():
        first = fn(x)
    assert released == [True]
    with compiled.releasing_compiler_caches():
        fn(x)  # the same graph: nothing compiled
    assert released == [True]

    monkeypatch.undo()
    linecache.getline(inspect.getsourcefile(compiled), 1)
    assert linecache.cache
    compiled.release_compiler_caches()
    assert not linecache.cache
    torch.testing.assert_close(fn(x), first, rtol=0, atol=0)
    torch.testing.assert_close(first, torch.sin(x) * 2 + 1)


@pytest.mark.canary
def test_compiling_inside_releasing_compiler_caches_skips_the_guard_profile():
    """dynamo flushes the CPU caches with a fresh 32 MiB buffer to time each new graph's guards, which
    sets the process's peak memory that far above its resident memory; a compile inside
    releasing_compiler_caches does not, one outside it still does (so the mechanism is still there to
    skip), and the guards still work: a changed input shape recompiles. In a fresh process, where the
    peak (VmHWM) is not already above the resident memory (VmRSS)."""
    script = textwrap.dedent(
        """
        import torch
        from rlalign.lm.compiled import releasing_compiler_caches

        def peak_over_resident_mib():
            status = dict(line.split(":", 1) for line in open("/proc/self/status"))
            return (int(status["VmHWM"].split()[0]) - int(status["VmRSS"].split()[0])) / 1024

        inside = torch.compile(lambda x: x * 3 - 1, backend="eager")
        outside = torch.compile(lambda x: x * 2 + 1, backend="eager")
        with releasing_compiler_caches():
            assert inside(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
            assert inside(torch.ones(2, 2)).tolist() == [[2.0, 2.0], [2.0, 2.0]]  # guards failed: a second graph
        print(peak_over_resident_mib())
        outside(torch.ones(3))
        print(peak_over_resident_mib())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    inside_mib, outside_mib = map(float, result.stdout.split())
    assert inside_mib < 12, result.stdout
    assert outside_mib > 24, result.stdout


@pytest.mark.canary
def test_guard_profiling_comes_back_after_overlapping_blocks():
    """Blocks that overlap without nesting (as two threads' would): the skip holds until the last one
    ends, and torch's own function is back after it."""
    from torch._dynamo import guards

    from rlalign.lm.compiled import skipping_guard_profiling

    original = guards.profile_guard_manager
    first, second = skipping_guard_profiling(), skipping_guard_profiling()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert guards.profile_guard_manager is not original
    second.__exit__(None, None, None)
    assert guards.profile_guard_manager is original


def test_a_hugging_face_sequence_classification_reward_model_keeps_its_trained_head(tmp_path, tokenizer):
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from rlalign.lm.models import ModelLoadError

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    hf = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        hf.score.weight.normal_(std=1.0)
    hf.save_pretrained(tmp_path / "hf_rm")
    tokenizer.save_pretrained(tmp_path / "hf_rm")
    ids = torch.tensor([[1, 14, 15, 16, 2]])
    expected = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_rm").eval()(input_ids=ids).logits[:, 0]
    rm = load_reward_model(tmp_path / "hf_rm")
    torch.testing.assert_close(rm.sequence_scores(ids, torch.ones_like(ids)), expected, rtol=0, atol=1e-5)
    # a reward model must come with a trained head: a causal LM alone is an error, never a random head
    with pytest.raises(ModelLoadError, match="no trained reward head"):
        load_reward_model(_causal_lm(tmp_path, tokenizer))
    two_labels = LlamaForSequenceClassification(LlamaConfig(**{**config.to_dict(), "num_labels": 2}))
    two_labels.save_pretrained(tmp_path / "two")
    with pytest.warns(UserWarning, match="2 labels; the reward is label 0's logit"):  # as TRL's GRPOTrainer reads logits[:, 0]
        two = load_reward_model(tmp_path / "two")
    expected = AutoModelForSequenceClassification.from_pretrained(tmp_path / "two").eval()(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(two.sequence_scores(ids, torch.ones_like(ids)), expected, rtol=0, atol=1e-5)


def _causal_lm(tmp_path, tokenizer):
    path = tmp_path / "causal"
    make_llama(vocab=len(tokenizer)).save_pretrained(path)
    return path


def test_a_hub_id_resolves_through_the_hugging_face_cache_and_offline_without_it_is_one_error(tmp_path, monkeypatch, tokenizer):
    from rlalign.lm.models import ModelLoadError, resolve_model_path

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    make_llama(vocab=len(tokenizer)).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot
    policy = load_policy("tiny-org/tiny-llama")
    assert load_tokenizer("tiny-org/tiny-llama").eos_token_id == tokenizer.eos_token_id and policy.config.vocab_size == len(tokenizer)
    with pytest.raises(ModelLoadError, match="'nobody/nothing' is neither a local directory nor in the Hugging Face cache, and rlalign downloads nothing unless asked"):
        resolve_model_path("nobody/nothing")
    assert resolve_model_path(tmp_path) == tmp_path  # a local directory is taken as it is


def test_a_prompt_learning_adapter_is_one_clear_error(tmp_path, tokenizer, llama_checkpoint):
    # prefix tuning adds virtual tokens to every sequence: the completion log-probs would sit at the
    # wrong positions (and packed rows would see each other), so such an adapter is refused by name
    from peft import PrefixTuningConfig, get_peft_model

    from rlalign.lm.models import ModelLoadError, check_checkpoint_dir

    adapter = get_peft_model(load_policy(llama_checkpoint), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    adapter.save_pretrained(tmp_path / "prefix")
    tokenizer.save_pretrained(tmp_path / "prefix")
    message = "adapter_config.json: peft_type PREFIX_TUNING adds virtual tokens to every sequence; rlalign trains and loads LoRA adapters"
    with pytest.raises(ModelLoadError, match=message):
        load_policy(tmp_path / "prefix")
    with pytest.raises(ModelLoadError, match=message):
        check_checkpoint_dir(tmp_path / "prefix")


def test_a_saved_model_keeps_the_dropout_it_was_loaded_with(tmp_path, tokenizer):
    # training zeroes the model's dropout, in its modules and its config; the config was saved so, so a final/ of a
    # GPT-2 (0.1 by default) said 0.0 to whoever trained it next (TRL zeroes only the modules)
    import json

    from rlalign.lm.heads import load_critic
    from rlalign.train.loop import SavedModels

    make_gpt2(vocab=len(tokenizer), resid_pdrop=0.3, embd_pdrop=0.2, attn_pdrop=0.1).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    as_loaded = {"resid_pdrop": 0.3, "embd_pdrop": 0.2, "attn_pdrop": 0.1}

    def saved(path):
        config = json.loads((path / "config.json").read_text())
        return {key: config[key] for key in as_loaded}

    policy, critic = load_policy(tmp_path / "base"), load_critic(tmp_path / "base")
    SavedModels(policy, critic=critic).save_pretrained(tmp_path / "full")
    assert saved(tmp_path / "full") == as_loaded and saved(tmp_path / "full" / "critic") == as_loaded
    assert policy.config.resid_pdrop == 0.0 and {m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}  # still off
    assert {m.p for m in critic.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}

    lora = load_policy(tmp_path / "base", lora=LoraConfig(r=4))
    SavedModels(lora).save_pretrained(tmp_path / "merged", merged=True)
    assert saved(tmp_path / "merged") == as_loaded and lora.config.embd_pdrop == 0.0
    assert load_policy(tmp_path / "merged").config.attn_pdrop == 0.0  # loaded to train again: off


def test_a_merged_adapter_keeps_the_dropout_its_base_was_saved_with(tmp_path, tokenizer):
    # model.adapter: merge trains from the base with the adapter merged in, written by merge_adapter: it was written
    # with the dropout zeroed, so the run loaded 0.0 "as loaded" and its final/config.json said 0.0 too
    import json

    from rlalign.train.common import merge_adapter

    make_gpt2(vocab=len(tokenizer), resid_pdrop=0.3, attn_pdrop=0.1).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    load_policy(tmp_path / "base", lora=LoraConfig(r=4)).save_pretrained(tmp_path / "adapter")
    config = json.loads((merge_adapter(tmp_path / "adapter", tmp_path / "merged") / "config.json").read_text())
    assert (config["resid_pdrop"], config["attn_pdrop"]) == (0.3, 0.1)
    assert load_policy(tmp_path / "merged").config.resid_pdrop == 0.0  # trained without it
