"""Packed rows (rlalign.core.packing; its layout by hand in tests/core/test_packing.py): the packed
forward equal to the padded one at every real position, in value and gradient, for each
architecture that packs, the choice between packed rows and shared prompts, and PPO's critic."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlalign.core.logprobs import token_logprobs
from rlalign.lm import private
from rlalign.lm.logprobs import PACKED_ROWS_MODEL_TYPES, completion_hidden, completion_logits, packs_rows
from rlalign.lm.model_modes import attention_kernel
from rlalign.lm.models import unwrap_causal_lm


def make_model(model_type: str, vocab: int = 100, **overrides) -> torch.nn.Module:
    config = AutoConfig.for_model(
        model_type, **overrides, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **({"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if model_type == "gpt2" else {}),
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def ragged_batch(prompt_lengths: list[int], completion_lengths: list[int], prompt_width: int = 9, completion_width: int = 8, seed: int = 0):
    """Random tokens, prompts left-padded and completions right-padded to these real lengths (pad token 0)."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths)[:, None]).long()  # (B, P)
    completion_mask = (torch.arange(completion_width) < torch.tensor(completion_lengths)[:, None]).long()  # (B, C)
    prompt_ids = torch.randint(3, 100, prompt_mask.shape, generator=g) * prompt_mask
    completion_ids = torch.randint(3, 100, completion_mask.shape, generator=g) * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _forward_shapes(model, run):
    """``run()``'s result and the (rows, positions) of each forward of the transformers model inside it."""
    calls = []
    record = lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape) if kwargs.get("input_ids") is not None else None)  # noqa: E731
    handle = unwrap_causal_lm(model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        return run(), calls
    finally:
        handle.remove()


def _logits_and_grads(model, batch, packed, hidden=False):
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    model.zero_grad()
    if hidden:
        out = completion_hidden(model, *batch, packed=packed)  # (B, C, H)
        (out.pow(2) * completion_mask[..., None]).sum().backward()
    else:
        out = completion_logits(model, *batch, packed=packed)  # (B, C, V)
        (token_logprobs(out, completion_ids) * completion_mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]  # the LM head has none in the hidden pass
    model.zero_grad()
    return out.detach(), grads


ARCHS = sorted(PACKED_ROWS_MODEL_TYPES) + ["llama-eager", "llama-lora", "mistral-window", "mistral-window-eager"]


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forward_equals_the_padded_one(arch, llama_checkpoint):
    if arch == "llama-lora":
        from rlalign.lm.models import LoraConfig, load_policy

        model = load_policy(llama_checkpoint, lora=LoraConfig(r=4))
        with torch.no_grad():  # non-zero adapters, so they take part
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    elif arch.startswith("mistral-window"):  # a sliding window of 3 tokens, shorter than the rows: the packed masks keep it
        model = make_model("mistral", sliding_window=3)
    else:
        model = make_model(arch.removesuffix("-eager"))
    # six rows of 9 + 8 columns whose real lengths 9+8, 2+1, 4+6, 1+0, 3+5, 7+2 leave half the batch padding
    batch = ragged_batch([9, 2, 4, 1, 3, 7], [8, 1, 6, 0, 5, 2])
    completion_mask = batch[3]
    with attention_kernel(model, "eager" if arch.endswith("-eager") else None):
        assert packs_rows(model)
        (padded, padded_grads), padded_calls = _forward_shapes(model, lambda: _logits_and_grads(model, batch, packed=False))
        (packed, packed_grads), packed_calls = _forward_shapes(model, lambda: _logits_and_grads(model, batch, packed=True))
    # lengths 17 3 10 1 8 9, W = 17: [17], [10 3 1], [9 8]: 3 packed rows of 17 against 6 of 17
    assert padded_calls == [(6, 17)] and packed_calls == [(3, 17)]
    real = completion_mask.bool()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(packed).all()  # padding columns read a real position: finite, masked everywhere
    for packed_grad, padded_grad in zip(packed_grads, padded_grads, strict=True):  # float32 summation order
        torch.testing.assert_close(packed_grad, padded_grad, rtol=0, atol=1e-5 * padded_grad.abs().max().item())
    assert "forward" not in unwrap_causal_lm(model).get_output_embeddings().__dict__  # the head as it was


def test_packed_hidden_states_equal_the_padded_ones(tiny_llama):
    # completion_hidden wraps the head twice (left out, then read at the packed positions) and
    # unwraps both
    batch = ragged_batch([9, 2, 4, 1, 3, 7], [8, 1, 6, 0, 5, 2])
    padded, padded_grads = _logits_and_grads(tiny_llama, batch, packed=False, hidden=True)
    (packed, packed_grads), calls = _forward_shapes(tiny_llama, lambda: _logits_and_grads(tiny_llama, batch, packed=True, hidden=True))
    assert calls == [(3, 17)]
    real = batch[3].bool()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-5)
    for packed_grad, padded_grad in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(packed_grad, padded_grad, rtol=0, atol=1e-5 * padded_grad.abs().max().item())
    assert "forward" not in tiny_llama.lm_head.__dict__


def test_rows_that_would_not_shrink_run_padded(tiny_llama):
    # every row as long as the longest: packing cannot take a row away, the padded forward runs
    batch = ragged_batch([9, 9, 9], [8, 8, 8])
    _, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, *batch))
    assert calls == [(3, 17)]


def test_packing_or_shared_prompts_whichever_runs_fewer_positions(tiny_llama):
    # two groups of four rows, 9-token prompts (9 columns), 8 completion columns. Shared: U (P - 1) + B C
    # = 2 x 8 + 8 x 8 = 80 positions; padded 8 x 17 = 136.
    group_index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])

    def batch_of(completion_lengths):
        prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch([9] * 8, completion_lengths)
        prompt_ids[4:], prompt_ids[:4] = prompt_ids[4], prompt_ids[0]  # each group's rows share their prompt
        return prompt_ids, prompt_mask, completion_ids, completion_mask

    # completions of 8: packed rows of 17 hold one row each (136 positions): the shared prompts run
    _, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, *batch_of([8] * 8), group_index))
    assert calls == [None, None]  # (inputs_embeds) the groups' prompts, then every row's completion
    # completions of 1: rows of 10 tokens, W = 10, one a packed row: 8 x 10 = 80, not fewer than 80: shared
    _, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, *batch_of([1] * 8), group_index))
    assert calls == [None, None]
    # a tie: group 0's 9-token prompt with completions 0, 1, 0, 1, group 1's 1-token prompt with
    # completions of 8: rows of 9, 10, 9, 10 and 9, W = 10, no two fit one packed row: 8 x 10 = 80,
    # fewer than the padded 8 x 17 but not than the shared 2 x 8 + 8 x 8 = 80: shared
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch_of([0, 1, 0, 1] + [8] * 4)
    prompt_mask[4:, :8] = 0
    prompt_ids = prompt_ids * prompt_mask
    _, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, prompt_ids, prompt_mask, completion_ids, completion_mask, group_index))
    assert calls == [None, None]
    _, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, prompt_ids, prompt_mask, completion_ids, completion_mask))
    assert calls == [(8, 10)]  # without groups to share, the same rows pack (80 < 136)
    # shorter prompts make sharing worth less: 2-token prompts of completions 8, 1, 1, 1: shared 2 x 1 + 8 x 8 = 66;
    # rows of 10 and 3, W = 10: [10] [10] [3 3 3] [3 3 3]: 40 positions: packed
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch_of([8, 1, 1, 1] * 2)
    prompt_mask[:, :7] = 0
    prompt_ids = prompt_ids * prompt_mask
    logits, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, prompt_ids, prompt_mask, completion_ids, completion_mask, group_index))
    assert calls == [(4, 10)]
    padded = completion_logits(tiny_llama, prompt_ids, prompt_mask, completion_ids, completion_mask, packed=False)
    real = completion_mask.bool()
    torch.testing.assert_close(logits[real], padded[real], rtol=1e-5, atol=1e-5)


def test_packed_rows_are_weighed_against_the_shared_prompts_u_p_minus_1_plus_b_c_positions(tiny_llama, monkeypatch):
    # two groups of four rows, 9-column prompts, 8 completion columns: shared U (P - 1) + B C = 2 x 8 + 8 x 8 = 80
    # positions, padded B (P + C) = 8 x 17 = 136; the hidden states' pass (the chunked head) packs as the logits' does
    import rlalign.lm.logprobs as logprobs_module

    weighed = []
    real = logprobs_module.packed_layout
    monkeypatch.setattr(logprobs_module, "packed_layout", lambda model, pm, cm, padded: weighed.append(padded) or real(model, pm, cm, padded))
    batch = ragged_batch([9] * 8, [8] * 8)
    batch[0][4:], batch[0][:4] = batch[0][4], batch[0][0]  # each group's rows share their prompt
    completion_logits(tiny_llama, *batch, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    completion_logits(tiny_llama, *batch)
    assert weighed == [80, 136]
    monkeypatch.undo()
    short = ragged_batch([2, 3, 2, 3], [1, 2, 1, 2])  # rows of 3, 5, 3, 5 tokens in 17 columns: 4 packed rows of W = 5 (20 < 68 positions)
    _, calls = _forward_shapes(tiny_llama, lambda: completion_hidden(tiny_llama, *short))
    assert calls == [(4, 5)]


def test_without_transformers_packed_masks_rows_run_padded(tiny_llama, monkeypatch):
    # packed rows need transformers to tell them apart by their position ids (rlalign.lm.private):
    # where that is missing, one warning and the padded forward
    monkeypatch.setitem(private.PRIVATE_SYMBOLS, "packed_rows", ("transformers.masking_utils:no_such_symbol",))
    private.ready.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="packed_rows fast path is off"):
            assert not packs_rows(tiny_llama)
        _, calls = _forward_shapes(tiny_llama, lambda: completion_logits(tiny_llama, *ragged_batch([9, 2, 4], [8, 1, 6])))
    finally:
        private.ready.cache_clear()
    assert calls == [(3, 17)]


def test_packed_critic_values_equal_the_padded_ones():
    # PPO's critic reads the same positions as the policy's head: V(s_t) at P - 1 + t
    from rlalign.lm.heads import ScalarHeadModel
    from rlalign.lm.rollout import Rollout
    from rlalign.train.passes import critic_values

    critic = ScalarHeadModel(make_model("llama").model)
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch([9, 2, 4, 1, 3, 7], [8, 1, 6, 0, 5, 2])
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(completion_mask.shape), torch.arange(6),
                      torch.zeros(6, dtype=torch.bool))
    padded = critic(rollout.input_ids(), rollout.attention_mask(), rollout.position_ids())[:, 8:-1]  # (B, C): positions P - 1 .. P + C - 2
    (padded * completion_mask).sum().backward()
    padded_grads = [p.grad.clone() for p in critic.parameters()]
    critic.zero_grad()
    shapes = []
    handle = critic.backbone.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        packed = critic_values(critic, rollout)  # (B, C)
    finally:
        handle.remove()
    (packed * completion_mask).sum().backward()
    assert shapes == [(3, 17)]
    real = completion_mask.bool()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-5)
    for p, padded_grad in zip(critic.parameters(), padded_grads, strict=True):
        torch.testing.assert_close(p.grad, padded_grad, rtol=0, atol=1e-5 * padded_grad.abs().max().item())


def test_prefix_tuning_runs_padded(tiny_llama):
    # a prefix-tuning adapter hands the model a KV cache of virtual tokens, and transformers tells
    # packed rows apart only without one: such a model never packs
    from peft import PrefixTuningConfig, get_peft_model

    model = get_peft_model(make_model("llama"), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert packs_rows(tiny_llama) and not packs_rows(model)
    batch = ragged_batch([9, 2, 4, 1, 3, 7], [8, 1, 6, 0, 5, 2])
    with torch.no_grad():
        _, calls = _forward_shapes(model, lambda: completion_logits(model, *batch))
    assert calls == [(6, 17)]


def test_a_policy_still_the_reference_has_a_kl_of_exactly_0_with_packed_rows():
    # GRPO's reference pass runs on the updates' row batches: the same rows pack alike in the no-grad
    # eval-mode reference pass and the training forward, so the log-probs are equal bit for bit
    import copy

    from rlalign.lm.rollout import Rollout
    from rlalign.train.passes import completion_logprobs, reference_logprobs

    policy = make_model("llama").train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch([9, 2, 4, 1, 3, 7], [8, 1, 6, 0, 5, 2])
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(completion_mask.shape), torch.arange(6),
                      torch.zeros(6, dtype=torch.bool))
    update_rows = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5])]
    (ref_logp, calls) = _forward_shapes(reference, lambda: reference_logprobs(policy, reference, rollout, 0.7, update_rows))
    # rows of 17, 3, 10, 1 pack into [17] [10 3 1]; rows of 8 and 9 (trimmed to 7 + 5 columns: 2 x 12 padded) into [9] [8]
    assert calls == [(2, 17), (2, 9)]
    for rows, shape in zip(update_rows, calls, strict=True):
        (logp, _), update_calls = _forward_shapes(policy, lambda: completion_logprobs(policy, rollout.select(rows), 0.7, "statistic"))  # (b, C), with grad
        real = completion_mask[rows].bool()
        assert update_calls == [shape] and torch.equal(logp.detach()[real], ref_logp[rows][real])


def test_the_head_is_restored_when_the_forward_fails(tiny_llama):
    def fail(module, args):
        raise RuntimeError("out of memory, say")

    handle = tiny_llama.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="out of memory, say"):
            completion_hidden(tiny_llama, *ragged_batch([9, 2, 4], [8, 1, 6]))  # the head wrapped twice: left out, read packed
    finally:
        handle.remove()
    assert "forward" not in tiny_llama.lm_head.__dict__
    logits = completion_logits(tiny_llama, *ragged_batch([9, 2, 4], [8, 1, 6]))
    assert logits.shape == (3, 8, 100)  # the head projects again
