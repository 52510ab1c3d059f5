"""The reference and pi_old passes lay rows out as the policy's update does (shared prompts or not,
the LM head in chunks or not), so while the policy is still the reference the KL is exactly 0 and
the first ratio exactly 1, also where the policy and the reference differ in how they could run:
a policy that checkpoints its activations (its training forward cannot share prompts), or one in
DDP (one forward a backward, the logits path) next to a reference of its own outside it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from rlalign.lm.model_modes import checkpointing_enabled, enable_gradient_checkpointing, is_checkpointing
from rlalign.lm.models import unwrap_causal_lm
from rlalign.core.linear_logprobs import linear_token_logprobs
from rlalign.lm.rollout import Rollout
from rlalign.train import passes
from rlalign.train.passes import completion_logprobs, head_chunks, reference_logprobs, share_prompts, training_logprobs


def make_llama() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def group_rollout() -> Rollout:
    """Two groups of 3 completions, each group one prompt of 9 tokens (no padding: packing saves nothing
    on the prompts, so sharing them runs the fewest positions), completions ragged."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 100, (2, 9), generator=g).repeat_interleave(3, 0)  # (6, 9)
    completion_mask = (torch.arange(6) < torch.tensor([6, 5, 6, 4, 6, 5])[:, None]).long()  # (6, 6)
    completion_ids = torch.randint(3, 100, (6, 6), generator=g) * completion_mask
    return Rollout(prompt_ids, torch.ones(6, 9, dtype=torch.long), completion_ids, completion_mask, torch.zeros(6, 6), torch.arange(6) // 3,
                   torch.zeros(6, dtype=torch.bool))


def forward_calls(model: torch.nn.Module, run):
    """``run()``'s result and the number of transformers forwards of ``model`` inside it (shared prompts: 2 a pass)."""
    calls = []
    handle = unwrap_causal_lm(model).register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        return run(), len(calls)
    finally:
        handle.remove()


def update_logprobs(policy: torch.nn.Module, rollout: Rollout, limit: float) -> tuple[Tensor, int]:
    """The update's log-probs of ``rollout`` (train mode, with grad) and its forwards of the model."""
    policy.train()
    (logp, _), calls = forward_calls(policy, lambda: completion_logprobs(policy, rollout, 0.7, "statistic", logits_limit_mb=limit))
    return logp.detach(), calls


def test_a_checkpointed_policy_and_its_passes_share_no_prompts_so_the_kl_starts_at_exactly_0():
    policy = enable_gradient_checkpointing(make_llama())
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    (getattr(reference, "activation_checkpointing_disable", None) or reference.gradient_checkpointing_disable)()  # a frozen reference never checkpoints
    rollout = group_rollout()
    assert checkpointing_enabled(policy) and not is_checkpointing(policy.eval()) and not share_prompts(policy) and share_prompts(reference)
    logp, update_calls = update_logprobs(policy, rollout, passes.LOGITS_LIMIT_MB)
    ref_logp, ref_calls = forward_calls(reference, lambda: reference_logprobs(policy, reference, rollout, 0.7, [slice(0, 6)]))
    old_logp, old_calls = forward_calls(policy, lambda: training_logprobs(policy, rollout, 0.7, [slice(0, 6)]))
    real = rollout.completion_mask.bool()
    assert update_calls == ref_calls == old_calls == 1  # one forward each: no shared prompts (2) in the no-grad passes
    assert torch.equal(ref_logp[real], logp[real]) and torch.equal(old_logp[real], logp[real])
    # the same reference beside a policy that does not checkpoint shares the prompts (2 forwards), as that policy's update does
    plain = make_llama()
    (ref_logp, ref_calls) = forward_calls(reference, lambda: reference_logprobs(plain, reference, rollout, 0.7, [slice(0, 6)]))
    logp, update_calls = update_logprobs(plain, rollout, passes.LOGITS_LIMIT_MB)
    assert ref_calls == update_calls == 2 and torch.equal(ref_logp[real], logp[real])


def test_past_the_logits_limit_a_plain_policy_still_shares_its_prompts_and_a_checkpointed_one_does_not(monkeypatch):
    # the chunked head's path (hidden states, no logits) lays rows out as the logits path does
    chunked_calls = []
    monkeypatch.setattr(passes, "linear_token_logprobs", lambda *args, **kwargs: chunked_calls.append(1) or linear_token_logprobs(*args, **kwargs))
    rollout = group_rollout()
    plain, checkpointed = make_llama(), enable_gradient_checkpointing(make_llama())
    for policy, forwards in ((plain, 2), (checkpointed, 1)):  # shared prompts: the prompts' forward, then the completions'
        via_logits, calls_logits = update_logprobs(policy, rollout, passes.LOGITS_LIMIT_MB)
        chunked, calls_chunked = update_logprobs(policy, rollout, 0.0)
        assert calls_logits == calls_chunked == forwards
        real = rollout.completion_mask.bool()
        torch.testing.assert_close(chunked[real], via_logits[real], atol=1e-5, rtol=0)
        reference = copy.deepcopy(policy).requires_grad_(False)  # past the limit too, the reference runs the update's chunked head and layout
        ref_logp, ref_calls = forward_calls(reference, lambda: reference_logprobs(policy, reference, rollout, 0.7, [slice(0, 6)], logits_limit_mb=0.0))
        assert ref_calls == forwards and torch.equal(ref_logp[real], chunked[real])
        assert len(chunked_calls) == 2  # the update's and the reference's: no logits made past the limit
        chunked_calls.clear()


def test_the_no_grad_passes_keep_no_graph_even_of_weights_that_train():
    policy, reference = make_llama(), make_llama()  # both with trainable weights: only no_grad keeps their graphs (and memory) away
    rollout = group_rollout()
    assert not reference_logprobs(policy, reference, rollout, 0.7, [slice(0, 6)]).requires_grad
    assert not training_logprobs(policy, rollout, 0.7, [slice(0, 6)]).requires_grad


def test_the_compiled_forward_runs_padded_rows(monkeypatch):
    # torch.compile with dynamic shapes compiles once for every (B, P, C); packed rows would change shape with the completions' lengths
    calls = []

    def recorded(*args):
        calls.append(args[-2:])  # (group_index, packed)
        return passes.lm_completion_logits(*args)

    monkeypatch.setattr(passes, "compiled_completion_logits", lambda: recorded)
    monkeypatch.setattr(passes.private, "ready", lambda what: True)
    rollout = group_rollout()
    passes.completion_logits(make_llama(), rollout, compiled=True)
    assert calls == [(None, False)]


def test_the_passes_default_logits_limit_is_the_configs():
    from rlalign.train.run_config import ModelConfig

    assert passes.LOGITS_LIMIT_MB == ModelConfig().logits_limit_mb == 1024.0


def test_trimmed_drops_padding_columns_at_either_end_and_keeps_a_tight_rollout_as_it_is():
    rollout = group_rollout()  # no prompt padding; completions of 4 to 6 tokens in 6 columns: nothing to drop
    cut, width = passes.trimmed(rollout)
    assert cut is rollout and width == 6
    wide = Rollout(rollout.prompt_ids, rollout.prompt_mask, torch.nn.functional.pad(rollout.completion_ids, (0, 3)),
                   torch.nn.functional.pad(rollout.completion_mask, (0, 3)), torch.zeros(6, 9), rollout.group_index, rollout.truncated)
    cut, width = passes.trimmed(wide)  # 3 trailing completion columns that are padding in every row, no leading prompt padding
    assert width == 9 and torch.equal(cut.completion_ids, rollout.completion_ids) and torch.equal(cut.prompt_ids, rollout.prompt_ids)


@pytest.fixture
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_reference_beside_a_ddp_policy_runs_the_ddp_policys_layout(process_group):
    # the DDP policy's update shares no prompts and takes the logits (no head in chunks, even past the
    # logits limit); a reference of its own, and the pi_old pass of the policy's own module, both
    # outside DDP, could do both, and must not
    policy = torch.nn.parallel.DistributedDataParallel(make_llama())
    reference = copy.deepcopy(policy.module).eval().requires_grad_(False)
    rollout = group_rollout()
    limit = 1e-6  # every pass past the logits limit
    assert head_chunks(reference) is reference.lm_head and head_chunks(reference, policy) is None and head_chunks(policy) is None
    logp, update_calls = update_logprobs(policy, rollout, limit)
    chunked = []
    original = passes.linear_token_logprobs
    passes.linear_token_logprobs = lambda *a, **k: chunked.append(1) or original(*a, **k)
    try:
        ref_logp, ref_calls = forward_calls(reference, lambda: reference_logprobs(policy, reference, rollout, 0.7, [slice(0, 6)], logits_limit_mb=limit))
        old_logp, old_calls = forward_calls(policy.module, lambda: training_logprobs(policy, rollout, 0.7, [slice(0, 6)], logits_limit_mb=limit))
        alone, _ = forward_calls(reference, lambda: passes.rollout_token_logprobs(reference, rollout, 0.7, logits_limit_mb=limit))
    finally:
        passes.linear_token_logprobs = original
    assert chunked == [1]  # only the reference on its own took the head in chunks
    real = rollout.completion_mask.bool()
    assert update_calls == ref_calls == old_calls == 1 and torch.equal(ref_logp[real], logp[real]) and torch.equal(old_logp[real], logp[real])
    assert torch.allclose(alone[real], logp[real], atol=1e-5)  # the other layout: equal to round-off only


def test_dpo_reference_of_a_checkpointed_policy_runs_the_policys_layout():
    # DPO's pairs share their prompt; a checkpointed policy's training forward cannot share it, so
    # neither does its reference pass: equal log-probs at equal weights (the loss starts at log 2 exactly)
    from rlalign.lm.encoding import PreferenceCompletionBatch
    from rlalign.train.dpo import reference_logps, sequence_logps

    rollout = group_rollout()
    prompt_ids = rollout.prompt_ids[:1].expand(6, -1)  # (6, 9): 3 pairs of one prompt (rows b and 3 + b)
    batch = PreferenceCompletionBatch(prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    policy = enable_gradient_checkpointing(make_llama())
    reference = make_llama().eval().requires_grad_(False)
    policy.train()
    (logps, _), update_calls = forward_calls(policy, lambda: sequence_logps(policy, batch))
    ref_logps, ref_calls = forward_calls(reference, lambda: reference_logps(policy, reference, batch))
    alone, alone_calls = forward_calls(reference, lambda: sequence_logps(reference, batch)[0])
    assert update_calls == ref_calls == 1 and alone_calls == 2  # on its own the reference shares each pair's prompt
    assert torch.equal(ref_logps, logps.detach()) and torch.allclose(alone, ref_logps, atol=1e-5)


@pytest.mark.parametrize("limit", [1e9, 0.0], ids=["logits", "chunked-head"])
def test_log_probs_are_0_on_padding_so_a_low_temperature_kl_is_finite_and_exactly_0(limit):
    # At temperature 0.05 a padding position's log-prob of the pad token is far below -88 (its logits
    # over 0.05), so GRPO's k3 term exp(log pi_ref - log pi) - ... against the reference's 0 there
    # overflowed to inf, and inf times a mask of 0 made the loss NaN (the run stopped) although the
    # policy is the reference. The passes give 0 on padding, as the sampler and the reference do.
    from rlalign.config import load_config
    from rlalign.train import grpo

    policy, rollout, temperature = make_llama(), group_rollout(), 0.05
    reference = copy.deepcopy(policy).requires_grad_(False)
    padding = rollout.completion_mask == 0
    with torch.no_grad():
        raw, _ = passes._completion_logprobs(policy, rollout, temperature, "none", False, limit, None)  # before the mask
    assert raw[padding].min() < -88.8  # exp(-(that)) is inf in float32: the case that broke
    cfg = load_config(grpo.GRPOConfig, None, {"model.path": "unused", "sampling.temperature": temperature, "model.logits_limit_mb": limit,
                                              "beta": 0.04, "kl_estimator": "k3", "group_size": 3, "prompts_per_step": 2})
    ref_logp = reference_logprobs(policy, reference, rollout, temperature, [slice(0, 6)], logits_limit_mb=limit)  # (6, 6)
    policy.train()
    logp, entropy = completion_logprobs(policy, rollout, temperature, "gradient", logits_limit_mb=limit)
    assert not logp[padding].any() and not entropy[padding].any() and not ref_logp[padding].any()
    loss, stats = grpo.grpo_loss(policy, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 2.0]), rollout.completion_mask.float(), ref_logp, cfg,
                                 on_policy=True)
    loss.backward()
    assert torch.isfinite(loss) and float(stats["kl"]) == 0.0
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
