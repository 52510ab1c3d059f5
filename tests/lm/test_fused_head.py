"""Log-probs from the hidden states and the LM head in chunks (no (B, C, V) logits) against the
logits path, through the trainers' own loss functions: the same loss, statistics and gradient of
every parameter, for a Llama (untied head) and a GPT-2 (head tied to the embedding), with shared
prompts, a temperature, an entropy bonus, the sampler's importance weights, and under bfloat16
autocast; and which models take the path at all."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlalign.config import load_config
from rlalign.core import linear_logprobs
from rlalign.lm.logprobs import completion_hidden, lm_head_of
from rlalign.lm.rollout import Rollout
from rlalign.train import distill, grpo, passes, ppo
from tests.lm.conftest import make_gpt2, make_llama

VOCAB = 100


def rollout(seed: int = 0) -> Rollout:
    """Two groups of two rows: left-padded prompts of different lengths, right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (4, 5), generator=g)
    prompt_ids[2:] = prompt_ids[2]  # group 1: one prompt twice
    prompt_ids[:2] = prompt_ids[0]  # group 0 likewise
    prompt_mask = torch.ones(4, 5, dtype=torch.long)
    prompt_mask[:2, :2] = 0  # group 0's prompt is 3 tokens, left-padded
    prompt_ids[:2, :2] = 0
    completion_ids = torch.randint(3, VOCAB, (4, 6), generator=g)
    completion_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 6])
    completion_ids[completion_mask == 0] = 0
    logprobs = -torch.rand(4, 6, generator=g) * 3 * completion_mask  # the sampler's: far from the policy's, so the TIS weights matter
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, torch.tensor([0, 0, 1, 1]), torch.tensor([False, True, True, False]))


def cfg_of(module, tmp_path, **overrides):
    base = {"model.path": str(tmp_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic", "progress": False, "plots": False,
            "sampling.max_new_tokens": 6, "sampling.temperature": 0.7, "model.logits_limit_mb": 0}  # 0: the chunked head for any size
    return load_config(module.GRPOConfig if module is grpo else module.PPOConfig, None, {**base, **overrides})


def both_paths(monkeypatch, model, run):
    """(fused, logits) results of ``run(model)``: each the returned loss and stats and every parameter's gradient."""
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(passes, "lm_head_of", lambda model: None)
        calls = []
        original = passes.linear_token_logprobs
        monkeypatch.setattr(passes, "linear_token_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
        model.zero_grad()
        loss, stats = run(model)
        loss.backward()
        assert bool(calls) == fused  # the path asked for is the path taken
        results.append((loss.detach(), {k: v.detach() for k, v in stats.items()}, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return results


def assert_same(fused, logits, rtol=1e-5, atol=1e-6, grad_tol=1e-5):
    """Loss and statistics to float32 round-off; each gradient to ``grad_tol`` of its largest entry
    (its sums run in another order: 5e-7 of the largest seen in float32)."""
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = fused, logits
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    assert stats_a.keys() == stats_b.keys()
    for key in stats_a:
        assert torch.allclose(stats_a[key], stats_b[key], rtol=rtol, atol=atol), (key, stats_a[key], stats_b[key])
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        scale = grads_b[name].abs().max().item()
        assert scale > 0 and (grads_a[name] - grads_b[name]).abs().max().item() <= grad_tol * scale, name


MODELS = {"llama": lambda: make_llama(VOCAB), "gpt2-tied": lambda: make_gpt2(VOCAB, tie_word_embeddings=True)}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("options", [
    {},
    {"entropy_coef": 0.01},
    {"tis_cap": 2.0, "entropy_coef": 0.05, "sampling.temperature": 1.3},
    {"loss_type": "cispo", "aggregation": "seq-mean-token-sum-norm"},
], ids=["plain", "entropy-bonus", "tis-entropy-temperature", "cispo"])
def test_grpo_loss_is_the_same_from_the_hidden_states_as_from_the_logits(monkeypatch, tmp_path, family, options):
    model = MODELS[family]().train()
    cfg = cfg_of(grpo, tmp_path, **options)
    batch = rollout()
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2])
    ref = batch.logprobs - 0.1  # a reference's log-probs
    fused, logits = both_paths(monkeypatch, model, lambda m: grpo.grpo_loss(m, batch, advantages, batch.completion_mask.float(), ref, cfg))
    assert_same(fused, logits)


@pytest.mark.parametrize("family", list(MODELS))
def test_ppo_policy_loss_is_the_same_from_the_hidden_states_as_from_the_logits(monkeypatch, tmp_path, family):
    model = MODELS[family]().train()
    cfg = cfg_of(ppo, tmp_path, entropy_coef=0.02, tis_cap=2.0)
    batch = rollout(1)
    advantages = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)) * batch.completion_mask
    fused, logits = both_paths(monkeypatch, model, lambda m: ppo.policy_loss(m, batch, advantages, batch.completion_mask.float(), cfg, batch.logprobs - 0.05))
    assert_same(fused, logits)


def test_the_same_under_bfloat16_autocast(monkeypatch, tmp_path):
    # the head's matmul in bfloat16 on both paths (the same bfloat16 logits), log-softmax in float32;
    # the head's weight gradient is summed in float32 chunk by chunk here, in one bfloat16 matmul there
    model = make_llama(VOCAB).train()
    cfg = cfg_of(grpo, tmp_path, **{"model.autocast": "bfloat16", "entropy_coef": 0.01})
    batch = rollout(2)
    advantages = torch.tensor([0.5, -1.0, 1.5, -0.2])
    fused, logits = both_paths(monkeypatch, model, lambda m: grpo.grpo_loss(m, batch, advantages, batch.completion_mask.float(), None, cfg))
    # (the logits path's entropy bonus divides the bfloat16 logits by the temperature in bfloat16: 1e-3 apart)
    assert_same(fused, logits, rtol=2e-3, atol=1e-4, grad_tol=2e-2)


@pytest.mark.parametrize("family", list(MODELS))
def test_reference_and_pi_old_log_probs_are_the_same_from_the_hidden_states(monkeypatch, family):
    model = MODELS[family]().eval()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = rollout(4)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(passes, "lm_head_of", lambda model: None)
        runs.append((passes.reference_logprobs(model, reference, batch, 0.8, 2, logits_limit_mb=0),
                     passes.training_logprobs(model, batch, 0.8, [slice(0, 2), slice(2, 4)], logits_limit_mb=0)))
    for ours, theirs in zip(*runs):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert (ours[batch.completion_mask == 0] == 0).all()


def test_distillation_reverse_kl_is_the_same_from_the_hidden_states(monkeypatch, tmp_path):
    model = make_llama(VOCAB).train()
    base = {"model.path": str(tmp_path), "teacher": str(tmp_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic",
            "progress": False, "plots": False, "sampling.max_new_tokens": 6, "model.logits_limit_mb": 0}
    cfg = load_config(distill.DistillConfig, None, base)
    assert cfg.objective == "reverse_kl"
    batch = rollout(5)
    teacher_logp = batch.logprobs - 0.2
    fused, logits = both_paths(monkeypatch, model, lambda m: distill.distill_loss(m, None, batch, batch.completion_mask.float(), teacher_logp, cfg))
    assert_same(fused, logits)


def test_the_logits_path_below_the_limit_and_the_chunked_head_above_it(monkeypatch):
    # 4 rows x 6 tokens x 100 entries x 4 bytes = 9,600 bytes of float32 logits
    model, batch = make_llama(VOCAB), rollout()
    calls = []
    original = passes.linear_token_logprobs
    monkeypatch.setattr(passes, "linear_token_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    for limit_mb, chunked in ((9600 / 2**20, False), (9599 / 2**20, True), (0.0, True), (1024.0, False)):
        calls.clear()
        passes.completion_logprobs(model, batch, 1.0, "none", logits_limit_mb=limit_mb)
        assert bool(calls) == chunked, limit_mb
    # compiled forwards keep the logits (the compiled graph is of completion_logits)
    monkeypatch.setattr(passes.private, "ready", lambda name: True)
    monkeypatch.setattr(passes, "compiled_completion_logits", lambda: lambda m, *a: passes.lm_completion_logits(m, *a))
    calls.clear()
    passes.completion_logprobs(model, batch, 1.0, "none", compiled=True, logits_limit_mb=0)
    assert not calls


def test_which_models_take_the_path():
    llama, gpt2 = make_llama(VOCAB), make_gpt2(VOCAB)
    assert lm_head_of(llama) is llama.lm_head and lm_head_of(gpt2) is gpt2.lm_head
    # a LoRA adapter on the head: the head is no plain Linear, so the logits path
    on_head = get_peft_model(make_llama(VOCAB), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert lm_head_of(on_head) is None
    elsewhere = get_peft_model(make_llama(VOCAB), LoraConfig(r=2, target_modules=["q_proj"]))
    assert lm_head_of(elsewhere) is elsewhere.get_output_embeddings()
    # an architecture not known to leave its logits as the head made them (a soft cap, a scale): the logits path
    other = make_llama(VOCAB)
    other.config.model_type = "gemma2"
    assert lm_head_of(other) is None
    batch = rollout()
    with pytest.raises(ValueError, match="not exactly its LM head's output"):
        completion_hidden(other, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    # the head comes back whole after the hidden states are read
    hidden = completion_hidden(llama, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.group_index)
    assert hidden.shape == (4, 6, llama.config.hidden_size) and "forward" not in vars(llama.lm_head)
    assert linear_logprobs.linear_token_logprobs(hidden, llama.lm_head.weight, batch.completion_ids)[0].shape == (4, 6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_is_the_same_from_both_models_hidden_states_as_from_their_logits(monkeypatch, tmp_path, beta):
    # the teacher with a larger vocabulary (a padded one): the divergences over the smaller one's entries
    model, teacher = make_llama(VOCAB).train(), make_llama(VOCAB + 12, seed=1).eval()
    base = {"model.path": str(tmp_path), "teacher": str(tmp_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic",
            "progress": False, "plots": False, "sampling.max_new_tokens": 6, "sampling.temperature": 0.8, "objective": "gkd", "beta": beta,
            "model.logits_limit_mb": 0}
    cfg = load_config(distill.DistillConfig, None, base)
    batch = rollout(6)
    chunked = []
    original = distill.head_divergences
    monkeypatch.setattr(distill, "head_divergences", lambda *a, **k: chunked.append(1) or original(*a, **k))
    runs = []
    for limit in (0, 1024):  # 0: both heads in chunks; 1024 MB: these tiny logits
        model.zero_grad()
        loss, stats = distill.distill_loss(model, teacher, batch, batch.completion_mask.float(), None, cfg.model_copy(update={"model": cfg.model.model_copy(update={"logits_limit_mb": limit})}))
        loss.backward()
        runs.append((loss.detach(), {k: v.detach() for k, v in stats.items()}, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert chunked == [1]
    assert_same(*runs)
    assert all(p.grad is None for p in teacher.parameters())  # the teacher is a constant


def test_a_model_in_ddp_or_fsdp2_takes_the_logits_path_with_one_forward_a_pass():
    # DDP and FSDP2 expect one forward a backward with every parameter inside it: no fused head, no shared prompts;
    # the same model outside them (a learner alone, a producer rank under torchrun) takes both
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rlalign.train.passes import share_prompts

    llama = make_llama(VOCAB)
    assert lm_head_of(llama) is llama.lm_head and share_prompts(llama)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(make_llama(VOCAB))
        assert lm_head_of(ddp) is None and not share_prompts(ddp)
        sharded = fully_shard(make_llama(VOCAB))
        assert lm_head_of(sharded) is None and not share_prompts(sharded)
        assert lm_head_of(llama) is llama.lm_head and share_prompts(llama)  # a process group alone changes nothing
    finally:
        dist.destroy_process_group()
