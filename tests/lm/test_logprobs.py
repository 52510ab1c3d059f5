"""Training log-probs: sliced before the LM head, equal to the full log_softmax + gather."""

from __future__ import annotations

import pytest
import torch

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
