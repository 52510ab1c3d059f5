"""Training log-probs: sliced before the LM head, equal to the full log_softmax + gather."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlalign.core.logprobs import token_logprobs
from rlalign.lm.logprobs import completion_logprobs, rollout_logprobs
from rlalign.lm.sampling import SamplingParams, sample

PROMPTS = [[1, 5, 6, 76, 7, 9, 84], [1, 5, 76, 5, 84], [1, 13, 12, 11, 80, 44, 45, 46, 47]]


def _full_reference(model, rollout, temperature):
    """log_softmax over all positions of the full (B, P + C, V) logits, then gather."""
    logits = model(
        input_ids=rollout.input_ids(), attention_mask=rollout.attention_mask(), position_ids=rollout.position_ids()
    ).logits.double()  # (B, P + C, V)
    p = rollout.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1] / temperature, -1)  # (B, C, V)
    picked = logp.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    return picked.masked_fill(rollout.completion_mask == 0, 0).float()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_equal_full_log_softmax_gather(tiny_model, temperature):
    rollout = sample(tiny_model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=temperature), 0, [2], group_size=2, generator=torch.Generator().manual_seed(0))
    ours = rollout_logprobs(tiny_model, rollout, temperature)  # (B, C)
    torch.testing.assert_close(ours, _full_reference(tiny_model, rollout, temperature), rtol=0, atol=2e-5)
    # and equal to the log-probs recorded while sampling: the first PPO ratio is exactly 1
    torch.testing.assert_close(ours, rollout.logprobs, rtol=0, atol=2e-5)


def test_completion_logprobs_are_differentiable(tiny_llama):
    rollout = sample(tiny_llama, PROMPTS, SamplingParams(max_new_tokens=6), 0, [2], generator=torch.Generator().manual_seed(0))
    tiny_llama.zero_grad()
    logp = completion_logprobs(tiny_llama, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    logp.sum().backward()
    assert tiny_llama.lm_head.weight.grad.abs().sum() > 0
    tiny_llama.zero_grad()


def test_lm_head_gets_a_contiguous_input(tiny_llama):
    # a strided slice of the hidden states makes torch run the LM head (without autograd) as a bmm
    # against the weight expanded per row, copied in bfloat16 (5x slower on SmolLM2); the kept
    # positions are passed as an index tensor so the LM head sees one contiguous block
    seen = []
    handle = tiny_llama.lm_head.register_forward_pre_hook(lambda module, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        rollout = sample(tiny_llama, PROMPTS, SamplingParams(max_new_tokens=4), 0, [2], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            completion_logprobs(tiny_llama, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    finally:
        handle.remove()
    c = rollout.completion_ids.shape[1]
    assert seen[0][0] == (3, 1, tiny_llama.config.hidden_size)  # prefill: the last prompt position only
    assert seen[-1][0] == (3, c, tiny_llama.config.hidden_size)  # training pass: the C positions that predict completion tokens
    assert all(contiguous for _, contiguous in seen), seen


@pytest.mark.parametrize("arch", ["llama", "llama-eager", "gpt2", "lora"])
@pytest.mark.parametrize("prompts", [PROMPTS, [[7], *PROMPTS[:2]], [[7], [8]]], ids=["prompts", "one-token-prompt", "one-token-prompts"])
def test_shared_prompt_logits_equal_the_full_forward(arch, prompts, tiny_llama, tiny_gpt2, llama_checkpoint):
    # group_index: each group's prompt but its last token runs once and its KV cache is indexed out to
    # the group's rows; logits and gradients equal those of one forward over prompt + completion per
    # row. A one-token prompt beside longer ones leaves that group's shared part all padding; when
    # every prompt is one token long there is nothing to share and one forward runs.
    from rlalign.lm.models import LoraConfig, load_policy
    from rlalign.lm.model_modes import attention_kernel

    model = {"llama": tiny_llama, "llama-eager": tiny_llama, "gpt2": tiny_gpt2}.get(arch) or load_policy(llama_checkpoint, lora=LoraConfig(r=4))
    if arch == "lora":  # non-zero adapters, so they take part
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    with attention_kernel(model, "eager" if arch == "llama-eager" else None):
        _check_shared_prompt_logits(model, prompts)


def _check_shared_prompt_logits(model, prompts):
    from rlalign.lm.logprobs import completion_logits
    from rlalign.lm.models import unwrap_causal_lm

    rollout = sample(model, prompts, SamplingParams(max_new_tokens=7, temperature=1.0), 0, [2], group_size=3, generator=torch.Generator().manual_seed(1))
    completion_mask = rollout.completion_mask.clone()
    completion_mask[1, 4:], completion_mask[5, 2:] = 0, 0  # two completions that ended early (right padding after them)
    rollout = dataclasses.replace(rollout, completion_mask=completion_mask, completion_ids=rollout.completion_ids.masked_fill(completion_mask == 0, 0))
    assert (rollout.prompt_mask == 0).any() == (len({len(p) for p in prompts}) > 1)  # left padding where lengths differ
    order = torch.randperm(rollout.batch_size, generator=torch.Generator().manual_seed(0))  # groups need not be adjacent
    r = rollout.select(order)
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    trainable = [p for p in model.parameters() if p.requires_grad]
    outputs, calls = {}, []  # calls: (rows, positions) of each forward of the transformers model
    record = lambda module, args, kwargs: calls.append(tuple((kwargs.get("inputs_embeds") if kwargs.get("input_ids") is None else kwargs["input_ids"]).shape[:2]))  # noqa: E731
    handle = unwrap_causal_lm(model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        for shared in (False, True):
            model.zero_grad()
            calls.clear()
            logits = completion_logits(model, *args, r.group_index if shared else None, packed=False)  # (B, C, V): the padded rows, not packed
            (token_logprobs(logits, r.completion_ids) * r.completion_mask).sum().backward()
            outputs[shared] = (logits.detach(), [p.grad.clone() for p in trainable])
    finally:
        handle.remove()
    (batch, prompt_len), completion_len = r.prompt_ids.shape, r.completion_ids.shape[1]
    groups = len(set(r.group_index.tolist()))
    assert calls == ([(groups, prompt_len - 1), (batch, completion_len)] if prompt_len > 1 else [(batch, prompt_len + completion_len)])
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-5, atol=1e-5)
    for shared_grad, full_grad in zip(outputs[True][1], outputs[False][1]):  # float32 summation order: ~2e-6 of the largest entry
        torch.testing.assert_close(shared_grad, full_grad, rtol=0, atol=1e-5 * full_grad.abs().max().item())
    one_token = completion_logits(model, r.prompt_ids, r.prompt_mask, r.completion_ids[:, :1], r.completion_mask[:, :1], r.group_index, packed=False)
    torch.testing.assert_close(one_token, outputs[False][0][:, :1], rtol=1e-5, atol=1e-5)
    model.zero_grad()


def test_group_index_over_different_prompts_is_an_error(tiny_llama):
    rollout = sample(tiny_llama, PROMPTS[:2], SamplingParams(max_new_tokens=3), 0, [2], group_size=2, generator=torch.Generator().manual_seed(0))
    from rlalign.lm.logprobs import completion_logits

    wrong_groups = torch.tensor([0, 0, 0, 1])  # row 2 has the second prompt
    with pytest.raises(ValueError, match="prompts differ"):
        completion_logits(tiny_llama, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask, wrong_groups, packed=False)
    same_length = sample(tiny_llama, [PROMPTS[0], PROMPTS[0][::-1]], SamplingParams(max_new_tokens=3), 0, [2], group_size=2,
                         generator=torch.Generator().manual_seed(0))  # masks alike, tokens not
    with pytest.raises(ValueError, match="prompts differ"):
        completion_logits(tiny_llama, same_length.prompt_ids, same_length.prompt_mask, same_length.completion_ids, same_length.completion_mask, wrong_groups,
                          packed=False)


def test_rollout_logprobs_share_a_groups_prompt_only_when_asked(tiny_model):
    # share_prompts: each group's prompt but its last token runs once (a forward of the U prompts, then one of
    # the B rows' last prompt token and completion); by default one forward of every row's prompt and completion
    from rlalign.lm.models import unwrap_causal_lm

    rollout = sample(tiny_model, PROMPTS, SamplingParams(max_new_tokens=12), 0, [2], group_size=4, generator=torch.Generator().manual_seed(0))
    calls = []
    handle = unwrap_causal_lm(tiny_model).register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs.get("inputs_embeds") is not None),
                                                                    with_kwargs=True)
    try:
        plain = rollout_logprobs(tiny_model, rollout)
        assert calls == [False]
        shared = rollout_logprobs(tiny_model, rollout, share_prompts=True)
        assert calls == [False, True, True]  # the shared passes feed embeddings looked up once for both
    finally:
        handle.remove()
    torch.testing.assert_close(shared, plain, rtol=0, atol=2e-5)
