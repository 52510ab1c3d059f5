"""``micro_batch_size: auto``: rows per forward from a memory budget (rlalign.train.memory_plan).

What a row keeps is measured by the bytes autograd saves for backward; the tests pin that count by
hand, check that it is linear in rows and bounds what a real training forward keeps (Llama, GPT-2,
Qwen2; float32 and bfloat16 autocast), derive the plan's rows by hand from a budget, and run whole
GRPO and PPO runs whose planned micro-batches give the run of the same explicit ``micro_batch_size``.
"""

from __future__ import annotations

import gc
import math
import types
import weakref

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlavaConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.pytorch_utils import Conv1D

from rlalign.config import load_config
from rlalign.core.linear_logprobs import CHUNK_ELEMENTS
from rlalign.lm.model_modes import evaluating
from rlalign.lm.rollout import Rollout
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, memory_plan, ppo
from rlalign.train.memory_plan import SLACK, Pass, RowCost, device_budget, plan_rows, policy_forward, row_cost, rows_within, saved_bytes
from rlalign.train.common import autocast_context
from rlalign.train.passes import completion_logprobs
from rlalign.train.run_config import ModelConfig
from tests.lm.conftest import make_gpt2, make_llama
from tests.train.test_accumulation import assert_same_run, char_code_reward, weights

MB = 2**20
HEAD = max(3 * 8 * 14 * 100 * 4, 16 * 8 * 14 * 100)  # a minibatch of 8 rows x 14 tokens, vocabulary 100: its float32 logits x 3, or a chunk x 16 bytes


def make_qwen2(vocab: int = 100) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)).eval()


MODELS = {"llama": make_llama, "gpt2": make_gpt2, "qwen2": make_qwen2}


def test_saved_bytes_counts_each_kept_storage_once_and_leaves_out_the_weights():
    x = torch.randn(3, 4, requires_grad=True)  # 12 floats: 48 bytes
    w = torch.nn.Parameter(torch.randn(4))

    def forward():
        a = torch.exp(x)  # keeps its result: 48
        b = x * w  # keeps x (48) and w (left out)
        c = torch.sin(x)  # keeps x again: the same storage, not counted twice
        return a + b + c

    assert saved_bytes(forward, [w]) == 48 + 48
    assert saved_bytes(forward) == 48 + 48 + 16  # with w: 4 floats more
    with torch.no_grad():
        assert saved_bytes(forward) == 0  # nothing kept without grad


def test_saved_bytes_frees_what_the_forward_kept_when_it_returns():
    # exp saves its own output: handed back as itself, the saved output would hold its node and the node it (a cycle
    # no collector sees, measured: every probe of SmolLM2 left 415 MB resident)
    x = torch.randn(1000, requires_grad=True)
    outputs = []

    def forward():
        a = torch.exp(x)
        outputs.append(weakref.ref(a))
        return a.sum()

    assert saved_bytes(forward) == 4000  # exp's output (sum keeps only a shape)
    gc.collect()
    assert outputs[0]() is None  # freed with the graph


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("autocast", ["none", "bfloat16"])
def test_what_a_forward_keeps_is_fixed_plus_rows_times_a_row(arch, autocast):
    model = MODELS[arch]()
    cost = row_cost(model, policy_forward, 7, 12, autocast)
    assert cost.per_row > 0
    for rows in (3, 5):
        probe = memory_plan.probe_rollout(rows, 7, 12, torch.device("cpu"))
        with torch.enable_grad(), evaluating(model), autocast_context(autocast, model):
            measured = saved_bytes(lambda: policy_forward(model, probe), list(model.parameters()))
        assert measured == pytest.approx(cost.fixed + rows * cost.per_row, rel=0.01)
    linear_bytes = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
    if autocast == "bfloat16":  # the bfloat16 copies of the linear layers' weights, once whatever the rows
        assert linear_bytes * 0.9 <= cost.fixed <= linear_bytes * 1.1 + 1024
    else:  # a few constants (positions)
        assert cost.fixed < 1024


def grouped_rollout(groups: int, size: int, prompt_len: int, completion_len: int, vocab: int) -> Rollout:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (groups, prompt_len), generator=generator).repeat_interleave(size, 0)
    completions = torch.randint(3, vocab, (groups * size, completion_len), generator=generator)
    completion_mask = torch.ones_like(completions)
    completion_mask[0, completion_len // 2 :] = 0  # one shorter completion
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[:size, :2] = 0  # the first group's prompt left-padded
    rows = groups * size
    return Rollout(prompts, prompt_mask, completions, completion_mask, torch.zeros(rows, completion_len), torch.arange(groups).repeat_interleave(size),
                   torch.zeros(rows, dtype=torch.bool))


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("autocast", ["none", "bfloat16"])
def test_the_planned_cost_bounds_what_a_training_forward_keeps(arch, autocast):
    # the real pass: train mode, shared prompts, log-probs and an entropy with its gradient through the logits
    model = MODELS[arch]().train()
    rollout = grouped_rollout(groups=2, size=4, prompt_len=9, completion_len=14, vocab=100)
    cfg = ModelConfig(autocast=autocast)
    with autocast_context(autocast, model):
        kept = saved_bytes(lambda: completion_logprobs(model, rollout, 0.7, "gradient", logits_limit_mb=cfg.logits_limit_mb), list(model.parameters()))
    cost = row_cost(model, policy_forward, 32, 32, autocast)  # the probe's shape: 9 and 14 rounded up to 32
    head = 3 * 8 * 14 * 100 * 4  # logits, log-softmax and gradient of 8 rows (below logits_limit_mb: the logits path)
    planned = cost.fixed + 8 * cost.per_row * SLACK + head
    assert kept <= planned
    exact = row_cost(model, policy_forward, 9, 14, autocast)
    assert kept >= 0.5 * (exact.fixed + 8 * exact.per_row)  # a bound, not a guess orders of magnitude off


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("entropy, limit_mb", [("statistic", 1024.0), ("gradient", 1024.0), ("statistic", 0.0)], ids=["logits", "entropy-bonus", "chunked-head"])
def test_the_rows_planned_for_a_budget_keep_what_the_update_saves_within_it(monkeypatch, arch, entropy, limit_mb):
    # a large vocabulary (5000), so the LM head's share is real; the budget leaves room for a few of 16 rows
    model = MODELS[arch](vocab=5000).train()
    optimizer = torch.optim.AdamW(model.parameters())
    rollout = grouped_rollout(groups=4, size=4, prompt_len=9, completion_len=14, vocab=5000)
    pending = 3 * sum(p.numel() * 4 for p in model.parameters())  # gradients and AdamW's moments to come
    cfg, cache = ModelConfig(logits_limit_mb=limit_mb), {}
    for extra in range(0, 64 * MB, MB // 8):  # the smallest budget that gives 4 rows or more
        monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + extra)
        plan = plan_rows([Pass(model, optimizer, head_copies=5.0 if entropy == "gradient" else 3.0)], rollout, "auto", 16, cfg, cache=cache)
        if plan.update >= 4:
            break
    assert 4 <= plan.update < 16
    micro = rollout.select(slice(0, plan.update))
    kept = saved_bytes(lambda: completion_logprobs(model, micro, 0.7, entropy, logits_limit_mb=limit_mb), list(model.parameters()))
    assert kept <= extra  # what the forward keeps, before backward's transients (the slack above it)


def test_a_frozen_model_is_probed_as_if_it_trained():
    # a teacher or a reference saves nothing for backward; its probe makes its embeddings need a gradient
    trained, frozen = make_llama(), make_llama().requires_grad_(False)
    a, b = row_cost(trained, policy_forward, 8, 8, "none"), row_cost(frozen, policy_forward, 8, 8, "none")
    assert b == a and not any(p.requires_grad for p in frozen.parameters())  # the weights frozen again after it


def per_row_costs(monkeypatch, costs: dict) -> None:
    """row_cost mocked: ``costs[id(model)]`` bytes a row of 9 + 14 tokens (probed at 32 + 32, scaled back to 23 tokens), nothing fixed."""
    monkeypatch.setattr(memory_plan, "row_cost", lambda model, *args: RowCost(fixed=0, per_row=costs[id(model)] * 64 // 23))


def budget_above_pending(monkeypatch, models, extra: int) -> None:
    """device_budget mocked: the gradients and AdamW moments still to come of ``models``, then ``extra`` bytes."""
    pending = 3 * sum(p.numel() * 4 for m in models for p in m.parameters())
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + extra)


def test_a_head_the_update_cannot_split_off_costs_its_logits_every_row(monkeypatch):
    # DDP (lm_head_of is None on the wrapper) or a compiled forward: the update keeps the logits whatever logits_limit_mb says
    model = make_llama(vocab=100)  # 2 layers: a no-grad pass keeps min(1, 4 / 2) = all of a row's activations
    rollout = grouped_rollout(groups=4, size=4, prompt_len=9, completion_len=14, vocab=100)  # 16 rows of 9 + 14 tokens
    per_row_costs(monkeypatch, {id(model): 1000})
    logits_row = 14 * 100 * 4
    update_row, no_grad_row = SLACK * 1000 + 5 * logits_row, 1000 + 2 * logits_row  # 29,250 and 12,200 bytes
    budget_above_pending(monkeypatch, [model], 5 * 29_250)
    plan = plan_rows([Pass(model, torch.optim.AdamW(model.parameters()), head_copies=5.0)], rollout, "auto", 16, ModelConfig(), compiled=True)
    assert (plan.update, plan.no_grad) == (5, 146_250 // 12_200) == (5, int(5 * update_row // no_grad_row))
    assert plan.metrics() == {"memory/micro_rows": 5.0, "memory/pass_rows": 11.0, "memory/budget_mb": 146_250 / MB}


def test_a_frozen_model_in_each_micro_batch_and_deep_no_grad_passes_plan_as_they_run(monkeypatch):
    # GKD's teacher runs in each micro-batch of the student's update, without grad; with 8 layers a no-grad pass keeps
    # about 4 layers' activations of a row: min(1, 4 / 8) = half. Compiled: every head keeps its logits (5,600 bytes a copy).
    student = make_llama(vocab=100, num_hidden_layers=8)
    teacher = make_llama(vocab=100, num_hidden_layers=8, seed=1).requires_grad_(False)
    rollout = grouped_rollout(groups=8, size=4, prompt_len=9, completion_len=14, vocab=100)  # 32 rows
    per_row_costs(monkeypatch, {id(student): 40_000, id(teacher): 40_000})
    # update row: the student's 1.25 x 40,000 + 3 x 5,600, the teacher's 40,000 / 2 + 2 x 5,600 = 66,800 + 31,200 = 98,000
    # no-grad row: 40,000 / 2 + 2 x 5,600 = 31,200 for either model
    budget_above_pending(monkeypatch, [student], 554_400)
    passes = [Pass(student, torch.optim.AdamW(student.parameters())), Pass(teacher, None, group=0)]
    plan = plan_rows(passes, rollout, "auto", 32, ModelConfig(), compiled=True)
    assert (plan.update, plan.no_grad) == (554_400 // 98_000, 554_400 // 31_200) == (5, 17)


def test_passes_plan_alike_in_any_order_and_a_large_minibatch_is_not_capped(monkeypatch):
    policy, critic, reference = make_llama(vocab=100), make_llama(vocab=100, seed=1), make_llama(vocab=100, seed=2).requires_grad_(False)
    rollout = grouped_rollout(groups=2, size=4, prompt_len=9, completion_len=14, vocab=100)
    per_row_costs(monkeypatch, {id(policy): 1000, id(critic): 40_000, id(reference): 40_000})
    budget_above_pending(monkeypatch, [policy, critic], HEAD + 250_000)  # past each head's chunk, the critic's rows are the fewest: 1.25 x 40,000 each
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (policy, critic)]
    passes = [Pass(policy, optimizers[0]), Pass(critic, optimizers[1], group=1), Pass(reference, None, group=None)]
    plan = plan_rows(passes, rollout, "auto", 8, ModelConfig())
    assert (plan.update, plan.no_grad) == (250_000 // 50_000, 250_000 // 40_000) == (5, 6)  # no-grad: the reference's 40,000 a row
    reordered = plan_rows([passes[0], passes[2], passes[1]], rollout, "auto", 8, ModelConfig())  # the reference before the critic
    assert reordered == plan
    # a minibatch of 256 rows that all fit: every one in one forward
    rollout = grouped_rollout(groups=64, size=4, prompt_len=9, completion_len=14, vocab=100)
    per_row_costs(monkeypatch, {id(policy): 10})
    budget_above_pending(monkeypatch, [policy], 10**12)
    plan = plan_rows([Pass(policy, optimizers[0])], rollout, "auto", 256, ModelConfig())
    assert (plan.update, plan.no_grad) == (256, 256)


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layer_recomputed(monkeypatch):
    # 8 layers of width 64, rows of 23 tokens: SLACK x (40,000 / 8 + 8 x 23 x 64 x 4) + 3 x 5,600 = 1.25 x 52,104 + 16,800 = 81,930
    model = make_llama(vocab=100, num_hidden_layers=8)
    rollout = grouped_rollout(groups=4, size=4, prompt_len=9, completion_len=14, vocab=100)
    per_row_costs(monkeypatch, {id(model): 40_000})
    budget_above_pending(monkeypatch, [model], 5 * 81_930)
    plan = plan_rows([Pass(model, torch.optim.AdamW(model.parameters()))], rollout, "auto", 16, ModelConfig(gradient_checkpointing=True), compiled=True)
    assert plan.update == 5


def test_a_split_head_costs_its_logits_copies_while_they_fit_the_limit_and_one_chunk_past_it(monkeypatch):
    # the head split off (one process, eager): a fixed cost, not a row's. Rows of 9 + 14 tokens cost 1000 bytes.
    model = make_llama(vocab=100)
    pending = 3 * sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(memory_plan, "row_cost", lambda *args: RowCost(fixed=0, per_row=64 * 1000 // 23))
    rollout = grouped_rollout(groups=2, size=4, prompt_len=9, completion_len=14, vocab=100)
    # under the limit, 5 float32 copies of the minibatch's logits (an entropy bonus): 5 x 8 x 14 x 100 x 4 = 224,000 bytes,
    # more than a chunk's 16 bytes x 8 x 14 x 100 = 179,200; then rows of SLACK x 1000 = 1250 bytes
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + 224_000 + 5 * 1250)
    plan = plan_rows([Pass(model, torch.optim.AdamW(model.parameters()), head_copies=5.0)], rollout, "auto", 8, ModelConfig())
    assert plan.update == 5
    # past the limit (0 MB): one chunk of the fused head, 16 bytes a logit, at most 2**24 logits (a minibatch of
    # 16 x 14 x 100,000 = 22.4M logits is more)
    assert CHUNK_ELEMENTS == 2**24  # the fused head's chunk (rlalign.core.linear_logprobs), which the plan reads
    big = make_llama(vocab=100_000, hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1)
    pending = 3 * sum(p.numel() * 4 for p in big.parameters())
    rollout = grouped_rollout(groups=4, size=4, prompt_len=9, completion_len=14, vocab=100)
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + 16 * 2**24 + 7 * 1250)
    plan = plan_rows([Pass(big, torch.optim.AdamW(big.parameters()), head_copies=5.0)], rollout, "auto", 16, ModelConfig(logits_limit_mb=0))
    assert plan.update == 7
    # a 100 MB limit, below a minibatch's logits (32 x 14 x 100,000 x 4 = 179.2 MB): the log-probs' 3 copies of that much
    # (3 x 100 MiB = 314.6 MB, more than a chunk's 268.4 MB)
    rollout = grouped_rollout(groups=8, size=4, prompt_len=9, completion_len=14, vocab=100)
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + 3 * 100 * 2**20 + 7 * 1250)
    plan = plan_rows([Pass(big, torch.optim.AdamW(big.parameters()))], rollout, "auto", 32, ModelConfig(logits_limit_mb=100))
    assert plan.update == 7


def test_layers_width_and_vocabulary_come_from_the_text_config_of_a_composite_model():
    text = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=77)
    assert memory_plan._layers_and_width(types.SimpleNamespace(config=text)) == (3, 64, 77)
    assert memory_plan._layers_and_width(types.SimpleNamespace(config=LlavaConfig(text_config=text.to_dict()))) == (3, 64, 77)  # a vision-language model
    assert memory_plan._layers_and_width(types.SimpleNamespace(config=GPT2Config(n_layer=5, n_embd=32, vocab_size=50))) == (5, 32, 50)
    assert memory_plan._layers_and_width(torch.nn.Linear(2, 2)) == (1, 0, 0)  # no config: no layer assumed freed, no logits


def test_models_of_no_grad_passes_only_and_one_after_another_plan_as_they_run(monkeypatch):
    policy, critic, reference = make_llama(vocab=100), make_llama(vocab=100, seed=1), make_llama(vocab=100, seed=2).requires_grad_(False)
    rollout = grouped_rollout(groups=2, size=4, prompt_len=9, completion_len=14, vocab=100)
    costs = {id(policy): 1000, id(critic): 1000, id(reference): 40_000}  # a row of 9 + 14 tokens
    monkeypatch.setattr(memory_plan, "row_cost", lambda model, *args: RowCost(fixed=0, per_row=costs[id(model)] * 64 // 23))
    pending = 3 * sum(p.numel() * 4 for m in (policy, critic) for p in m.parameters())
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + HEAD + 64_000)
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (policy, critic)]
    alone = plan_rows([Pass(policy, optimizers[0])], rollout, "auto", 8, ModelConfig())
    both = plan_rows([Pass(policy, optimizers[0]), Pass(critic, optimizers[1], group=1), Pass(reference, None, group=None)], rollout, "auto", 8, ModelConfig())
    assert both.update == alone.update == min(8, int(64_000 // (SLACK * 1000)))  # the critic's update runs after the policy's: not added
    assert both.no_grad == int(64_000 // (40_000 * min(1, 4 / 2)))  # the reference's pass is the largest of the no-grad passes
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + 2 * HEAD + 10_000)
    together = plan_rows([Pass(policy, optimizers[0]), Pass(critic, optimizers[1], group=0)], rollout, "auto", 8, ModelConfig())
    assert together.update == int(10_000 // (2 * SLACK * 1000))  # in the same micro-batch (as GKD's student and teacher): both heads, rows added


def test_the_policy_probe_runs_up_to_what_its_head_reads():
    model = make_llama(vocab=100)
    probe = memory_plan.probe_rollout(2, 3, 4, torch.device("cpu"))
    assert policy_forward(model, probe).shape == (2, 4, 64)  # a plain head: the hidden states, the head counted apart

    class CappedHead(torch.nn.Linear):  # not a plain nn.Linear (a soft-capped or adapted head): its logits are kept
        pass

    model.lm_head.__class__ = CappedHead
    assert policy_forward(model, probe).shape == (2, 4, 100)


def test_the_budget_on_a_cpu_is_a_share_of_the_available_memory(tmp_path, monkeypatch):
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    cgroup.mkdir()  # no memory.max: not in a container with a limit
    assert device_budget(torch.device("cpu"), 0.5, str(meminfo), str(cgroup)) == 4_000_000 * 1024
    assert device_budget(torch.device("cpu"), 0.9) > 0  # this machine's
    (cgroup / "memory.max").write_text("max\n")  # a container without a limit: the host's memory
    (cgroup / "memory.current").write_text("123456789\n")
    assert device_budget(torch.device("cpu"), 0.5, str(meminfo), str(cgroup)) == 4_000_000 * 1024
    (cgroup / "memory.max").write_text(f"{6 * 2**30}\n")  # a 6 GiB container that holds 2 GiB: 4 GiB left, less than the host's 7.6
    (cgroup / "memory.current").write_text(f"{2 * 2**30}\n")
    assert device_budget(torch.device("cpu"), 0.5, str(meminfo), str(cgroup)) == 2 * 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four processes of the run on this host: a quarter each
    assert device_budget(torch.device("cpu"), 0.5, str(meminfo), str(cgroup)) == 2**29
    (cgroup / "memory.max").write_text(f"{32 * 2**30}\n")  # a container larger than the host's memory: the host's
    assert device_budget(torch.device("cpu"), 0.5, str(meminfo), str(cgroup)) == 1_000_000 * 1024


def test_the_budget_on_a_gpu_counts_the_allocators_free_blocks_and_leaves_a_share_of_the_card(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))  # free on the card, total
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib)  # held by this process's allocator
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 20 * gib)  # of which in use: 10 GiB free blocks
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert device_budget(torch.device("cuda", 0), 0.75) == (30 + 10) * gib - 20 * gib  # the card's 40 free, a quarter of 80 left aside
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)  # this process may hold 40 GiB of the 80
    assert device_budget(torch.device("cuda", 0), 0.75) == (40 - 20) * gib - 10 * gib


def test_rows_within_takes_what_fits_at_least_one_at_most_the_limit():
    assert rows_within(1000, 100, 200.0, 64) == 4  # floor(900 / 200)
    assert rows_within(1000, 100, 200.0, 3) == 3
    assert rows_within(50, 100, 200.0, 64) == 1  # nothing fits: one row, and an out-of-memory names the setting
    assert rows_within(10**12, 0, 1.0, 8) == 8


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_plan_from_a_budget_by_hand(monkeypatch, checkpointing):
    model = make_llama(vocab=100)  # 2 layers, width 64
    optimizer = torch.optim.AdamW(model.parameters())
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    rollout = grouped_rollout(groups=4, size=4, prompt_len=9, completion_len=14, vocab=100)  # 16 rows, 23 tokens
    monkeypatch.setattr(memory_plan, "row_cost", lambda *args: RowCost(fixed=1000, per_row=400_000))
    budget = 3 * weight_bytes + 1000 + HEAD + 5 * MB  # grads and AdamW's moments to come, the fixed part, the LM head's
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: budget)
    cfg = ModelConfig(gradient_checkpointing=checkpointing)
    plan = plan_rows([Pass(model, optimizer)], rollout, "auto", 8, cfg)
    per_row = math.ceil(400_000 * 23 / 64)  # probed at 32 + 32 tokens; the rows have 9 + 14
    row = SLACK * (per_row / 2 + 2 * 23 * 64 * 4) if checkpointing else SLACK * per_row  # a layer's recompute and every layer's input; or all
    assert plan.update == min(8, int(5 * MB // row))
    assert plan.no_grad == min(16, int(5 * MB // (per_row * min(1, 4 / 2))))  # two layers in flight of 2: all of it
    assert plan.metrics() == {"memory/micro_rows": plan.update, "memory/pass_rows": plan.no_grad, "memory/budget_mb": (1000 + HEAD + 5 * MB) / MB}
    # fixed settings pass through: an int for every pass; null the whole minibatch
    assert (plan_rows([Pass(model, optimizer)], rollout, 3, 8, cfg).update, plan_rows([Pass(model, optimizer)], rollout, None, 8, cfg).no_grad) == (3, 8)


def test_a_frozen_model_in_each_micro_batch_and_a_first_step_count_in_the_plan(monkeypatch):
    student, teacher = make_llama(vocab=100), make_llama(vocab=100, seed=1).requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters())
    rollout = grouped_rollout(groups=2, size=4, prompt_len=9, completion_len=14, vocab=100)
    monkeypatch.setattr(memory_plan, "row_cost", lambda *args: RowCost(fixed=0, per_row=MB * 64 // 23))  # MB a row of 9 + 14 tokens
    pending = 3 * sum(p.numel() * 4 for p in student.parameters())  # the teacher's weights are frozen: nothing pending
    monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + 2 * HEAD + 10 * MB)
    plan = plan_rows([Pass(student, optimizer), Pass(teacher, None)], rollout, "auto", 8, ModelConfig())
    assert plan.update == int(10 * MB // (SLACK * MB + MB))  # the student's row kept for backward, the teacher's row in flight: 4
    student(torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    optimizer.step()  # gradients and moments now exist: no longer pending, the same budget holds more
    again = plan_rows([Pass(student, optimizer), Pass(teacher, None)], rollout, "auto", 8, ModelConfig())
    assert again.update == int((pending + 10 * MB) // (SLACK * MB + MB))


def test_a_run_probes_again_only_when_its_rows_grow_longer(monkeypatch):
    model = make_llama(vocab=100)
    probes = []

    def counted(*args):
        probes.append(args[2:4])
        return RowCost(fixed=0, per_row=1000)

    monkeypatch.setattr(memory_plan, "row_cost", counted)
    cache = {}
    for prompt_len, completion_len in ((9, 14), (30, 30), (9, 40), (20, 10)):  # 64 tokens probed; 60 fits; 9 + 40 -> 32 + 64: longer
        plan_rows([Pass(model, None)], grouped_rollout(1, 4, prompt_len, completion_len, 100), "auto", 4, ModelConfig(), cache=cache)
    assert probes == [(32, 32), (32, 64)]


# ----------------------------------------------------------------------------------------------
# Whole runs: the planned rows give the run of the same explicit micro_batch_size
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=2, intermediate_size=64), seed=0)


def run_cfg(cls, tiny_path, out, **overrides):
    base = {"model.path": str(tiny_path), "output_dir": str(out), "data.task": "arithmetic", "data.num_prompts": 64, "steps": 2,
            "sampling.max_new_tokens": 6, "optim.lr": 3e-3, "progress": False, "plots": False}
    base.update({"prompts_per_step": 2, "group_size": 4, "beta": 0.1, "mu": 2, "num_minibatches": 2} if cls is grpo.GRPOConfig else
                {"prompts_per_step": 8, "num_minibatches": 2, "ppo_epochs": 2, "critic.optim.lr": 3e-3})
    base.update(overrides)
    return load_config(cls, None, base)


@pytest.mark.parametrize("trainer", [grpo, ppo], ids=["grpo", "ppo"])
def test_a_run_planned_to_one_row_is_the_run_of_micro_batch_size_one(tiny_path, tmp_path, monkeypatch, trainer):
    cls = grpo.GRPOConfig if trainer is grpo else ppo.PPOConfig
    rewards = [trainer.RewardTerm("code", 1.0, char_code_reward)]
    whole = trainer.train(run_cfg(cls, tiny_path, tmp_path / "whole", micro_batch_size=None), reward_functions=rewards)
    one = trainer.train(run_cfg(cls, tiny_path, tmp_path / "one", micro_batch_size=1), reward_functions=rewards)
    with monkeypatch.context() as patch:
        patch.setattr(memory_plan, "device_budget", lambda device, fraction: 0)  # nothing to spare: one row per forward
        planned = trainer.train(run_cfg(cls, tiny_path, tmp_path / "auto"), reward_functions=rewards)
    assert [(h["memory/micro_rows"], h["memory/pass_rows"]) for h in planned.history] == [(1, 1), (1, 1)]
    for name, w in weights(one.final_dir).items():  # the same forwards in the same order: the same bits
        assert torch.equal(weights(planned.final_dir)[name], w), name
    assert_same_run(whole.history, planned.history, whole.final_dir, planned.final_dir)  # and the whole-batch run to round-off
    roomy = trainer.train(run_cfg(cls, tiny_path, tmp_path / "roomy"), reward_functions=rewards)  # this machine's budget: every row at once
    assert roomy.history[0]["memory/micro_rows"] == 4  # a minibatch: 8 rows in 2
    for name, w in weights(whole.final_dir).items():
        assert torch.equal(weights(roomy.final_dir)[name], w), name


def test_no_grad_passes_beside_a_ddp_policy_are_planned_with_their_logits(monkeypatch):
    # beside a policy in DDP (one forward a backward: the logits path) the reference pass lays its rows
    # out as the policy's updates do (test_pass_layout.py), so it keeps the (rows, C, V) logits even past
    # logits_limit_mb: the plan must count them. Planned as if its head ran in chunks, all 64 rows came
    # back, whose float32 logits and log-softmax alone are 1 GB against a 600 MB budget
    import copy

    import torch.distributed as dist

    vocab, completion_len = 32000, 64
    rollout = grouped_rollout(groups=16, size=4, prompt_len=16, completion_len=completion_len, vocab=vocab)
    cfg = ModelConfig(logits_limit_mb=64)
    logits_row = completion_len * vocab * 4  # one row's float32 logits: 8 MB
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = make_llama(vocab=vocab)
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
        ddp = torch.nn.parallel.DistributedDataParallel(policy)
        optimizer = torch.optim.AdamW(policy.parameters())
        pending = 3 * sum(p.numel() * 4 for p in policy.parameters())
        monkeypatch.setattr(memory_plan, "device_budget", lambda device, fraction: pending + 600 * MB)
        plan = plan_rows([Pass(policy, optimizer, runner=ddp), Pass(reference, None, group=None)], rollout, "auto", 16, cfg)
        assert 1 <= plan.no_grad < 64
        assert 2 * plan.no_grad * logits_row <= 600 * MB
    finally:
        dist.destroy_process_group()
