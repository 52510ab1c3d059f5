"""Gradient accumulation (``micro_batch_size``) and gradient checkpointing
(``model.gradient_checkpointing``) change memory, not maths: every trainer's run with them equals
the run without, weights and metrics, to float round-off.

Tiny Llama (hidden 64, 2 layers) and tiny GPT-2, one torch thread.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from rlalign.config import load_config
from rlalign.lm.logprobs import completion_logits
from rlalign.lm.model_modes import enable_gradient_checkpointing, evaluating, is_checkpointing
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import distributed, grpo, ppo
from rlalign.train.reward_model import RMConfig
from rlalign.train.reward_model import train as train_rm
from rlalign.train.run_config import OptimConfig
from rlalign.train.sft import SFTConfig
from rlalign.train.sft import train as train_sft
from rlalign.train.updater import Updater
from tests.lm.conftest import make_gpt2, make_llama

COMPARED = ("loss/", "kl", "grad_norm", "reward/mean", "entropy", "clip_frac", "score", "explained_variance", "accuracy", "eval/")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


def char_code_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(sum(ord(ch) for ch in c) % 11) for c in completions]


def rl_cfg(cls, tiny_path, out, **overrides):
    base = {
        "model.path": str(tiny_path), "output_dir": str(out), "data.task": "arithmetic", "data.num_prompts": 64, "steps": 2,
        "prompts_per_step": 2 if cls is grpo.GRPOConfig else 8, "sampling.max_new_tokens": 6, "optim.lr": 3e-3, "progress": False, "plots": False,
    }
    if cls is grpo.GRPOConfig:
        base["group_size"] = 4
    else:
        base.update({"num_minibatches": 2, "ppo_epochs": 2, "critic.optim.lr": 3e-3})
    base.update(overrides)
    return load_config(cls, None, base)


def weights(path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    assert files, f"no weights in {path}"
    return {name: t for f in files for name, t in load_file(str(f)).items()}


def assert_same_run(history_a: list[dict], history_b: list[dict], final_a, final_b, atol: float = 2e-5) -> None:
    """The same metrics step by step (those that depend on the maths, not the clock) and the same final weights."""
    assert len(history_a) == len(history_b)
    for a, b in zip(history_a, history_b):
        for key in a:
            if key.startswith(COMPARED) and a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    wa, wb = weights(final_a), weights(final_b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=atol, rtol=0, msg=name)


# ----------------------------------------------------------------------------------------------
# The update itself
# ----------------------------------------------------------------------------------------------


def test_accumulated_step_equals_the_step_on_the_whole_batch():
    # a token-mean loss over 7 rows with uneven counts, cut into micro-batches of 3, 3 and 1 rows:
    # sum_k (S_k / n_k) n_k / sum_k n_k = S / n, so the update is the one-batch update
    torch.manual_seed(0)
    x, y = torch.randn(7, 5), torch.randn(7)
    mask = torch.tensor([1.0, 2, 0, 3, 1, 1, 4])  # tokens per row

    def make() -> Updater:
        torch.manual_seed(1)
        model = torch.nn.Linear(5, 1)
        return Updater.create(model, OptimConfig(lr=0.1, warmup_steps=0, grad_clip=0.5), total_updates=2)

    def loss_of(model, rows):
        err = (model(x[rows]).squeeze(-1) - y[rows]) ** 2
        count = float(mask[rows].sum())
        return (err * mask[rows]).sum() / max(count, 1.0), count

    whole, accumulated = make(), make()
    norm_whole = whole.step(loss_of(whole.model, torch.arange(7))[0])
    chunks = torch.arange(7).split(3)
    norm_acc, scale = accumulated.accumulated_step([lambda rows=rows: loss_of(accumulated.model, rows) for rows in chunks], lambda total: 1.0,
                                                   partial(distributed.loss_share, world=distributed.World()))
    assert scale == 1.0 and norm_acc == pytest.approx(norm_whole, rel=1e-6)
    for p, q in zip(whole.model.parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-7, rtol=0)


def test_micro_batches_with_nothing_counted_make_a_zero_gradient_not_a_division_by_zero():
    # every row of every micro-batch masked out: count 0 each, so the loss and the gradient are 0
    torch.manual_seed(1)
    updater = Updater.create(torch.nn.Linear(5, 1), OptimConfig(lr=0.1, warmup_steps=0, grad_clip=0.5), total_updates=2)
    x = torch.randn(3, 5)

    def nothing_counted():
        return (updater.model(x) ** 2).sum() * 0.0, 0.0

    norm, scale = updater.accumulated_step([nothing_counted, nothing_counted], lambda total: 1.0, partial(distributed.loss_share, world=distributed.World()))
    assert norm == 0.0 and scale == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in updater.model.parameters())


def test_micro_batch_statistics_merge_by_their_weights():
    # loss/* means over counts 2 and 6: (1 * 2 + 3 * 6) / 8 = 2.5; kl over tokens 4 and 1: (0.5 * 4 + 1.0 * 1) / 5 = 0.6; ratio_dev: max
    parts = [({"loss/policy": 1.0, "kl": 0.5, "ratio_dev": 0.1}, 4.0, 2.0), ({"loss/policy": 3.0, "kl": 1.0, "ratio_dev": 0.3}, 1.0, 6.0)]
    assert distributed.merge_micro_stats(parts) == pytest.approx({"loss/policy": 2.5, "kl": 0.6, "ratio_dev": 0.3})
    # micro-batches without a counted row or token (all masked out): their means are 0, never a division by 0
    empty = [({"loss/policy": 0.0, "kl": 0.0, "ratio_dev": 0.0}, 0.0, 0.0)] * 2
    assert distributed.merge_micro_stats(empty) == {"loss/policy": 0.0, "kl": 0.0, "ratio_dev": 0.0}


def test_statistics_reduce_over_ranks_by_their_token_weights(monkeypatch):
    # two ranks with the same values (all_sum doubles, all_max keeps): kl's token-weighted mean is kl itself whatever the
    # weight, fractional weights included (weights 0.25 + 0.25 = 0.5 in all); loss/* shares sum to the loss; no weight: 0
    two = distributed.World(rank=0, size=2)
    monkeypatch.setattr(distributed, "all_sum", lambda x, world: x * 2)
    monkeypatch.setattr(distributed, "all_max", lambda value, world: value)
    stats = {"loss/policy": 1.5, "kl": 0.3, "ratio_dev": 0.1}
    assert distributed.reduce_stats(stats, 0.25, 1.0, two) == pytest.approx({"loss/policy": 1.5, "kl": 0.3, "ratio_dev": 0.1})
    assert distributed.reduce_stats(stats, 3.0, 1.0, two) == pytest.approx({"loss/policy": 1.5, "kl": 0.3, "ratio_dev": 0.1})
    assert distributed.reduce_stats(stats, 0.0, 1.0, two)["kl"] == 0.0


# ----------------------------------------------------------------------------------------------
# Whole runs: with micro-batches, and with gradient checkpointing, the same as without
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation, extra", [
    ("seq-mean-token-mean", {}),
    ("token-mean", {"num_minibatches": 2, "mu": 2, "beta": 0.1}),
    ("seq-mean-token-sum-norm", {"advantage": "rloo"}),
])
def test_grpo_with_micro_batches_is_the_same_run(tiny_path, tmp_path, aggregation, extra):
    rewards = [grpo.RewardTerm("code", 1.0, char_code_reward)]
    runs = {}
    for name, micro in (("whole", None), ("micro", 3)):  # 8 rows (or 4 per minibatch) in micro-batches of 3, 3, 2 (3, 1)
        cfg = rl_cfg(grpo.GRPOConfig, tiny_path, tmp_path / name, aggregation=aggregation, micro_batch_size=micro, **extra)
        runs[name] = grpo.train(cfg, reward_functions=rewards)
    assert runs["whole"].history[1]["grad_norm"] > 0
    assert_same_run(runs["whole"].history, runs["micro"].history, runs["whole"].final_dir, runs["micro"].final_dir)


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_with_gradient_checkpointing_is_the_same_run(tiny_path, tmp_path, lora):
    # the training forward of a checkpointed policy runs every row's prompt (it cannot keep the KV cache a
    # shared prompt needs), and so does the reference pass, to run the update's layout; sampling runs in
    # eval mode, cache kept
    rewards = [grpo.RewardTerm("code", 1.0, char_code_reward)]
    extra = {"model.lora.r": 4, "model.lora.alpha": 8} if lora else {}
    plain = grpo.train(rl_cfg(grpo.GRPOConfig, tiny_path, tmp_path / "plain", **extra), reward_functions=rewards)
    checkpointed = grpo.train(rl_cfg(grpo.GRPOConfig, tiny_path, tmp_path / "gc", **extra, **{"model.gradient_checkpointing": True}), reward_functions=rewards)
    assert checkpointed.history[0]["kl"] == 0.0  # the policy is the reference at step 0, and both passes lay the rows out alike
    assert is_checkpointing(checkpointed.policy) and checkpointed.policy.training
    assert_same_run(plain.history, checkpointed.history, plain.final_dir, checkpointed.final_dir)


@pytest.mark.parametrize("overrides", [{"micro_batch_size": 3}, {"model.gradient_checkpointing": True}], ids=["micro", "checkpointing"])
def test_ppo_with_micro_batches_or_checkpointing_is_the_same_run(tiny_path, tmp_path, overrides):
    # 8 prompts, 2 minibatches of 4 rows, micro-batches of 3 and 1 rows; policy and critic both accumulate
    rewards = [ppo.RewardTerm("code", 1.0, char_code_reward)]
    plain = ppo.train(rl_cfg(ppo.PPOConfig, tiny_path, tmp_path / "plain"), reward_functions=rewards)
    other = ppo.train(rl_cfg(ppo.PPOConfig, tiny_path, tmp_path / "other", **overrides), reward_functions=rewards)
    assert plain.history[-1]["loss/value"] > 0
    # AdamW turns the micro-batches' float32 sum-order round-off into up to ~5e-5 on a weight whose gradient is
    # near 0 after 2 steps x 2 epochs x 2 minibatches (the update is ~lr * sign there), hence 1e-4
    assert_same_run(plain.history, other.history, plain.final_dir, other.final_dir, atol=1e-4)
    assert_same_run([], [], plain.final_dir / "critic", other.final_dir / "critic", atol=1e-4)


TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false", "batch_size=8", "eval_every=2"]


def supervised_history(train, cfg_cls, out, extra: list[str]) -> list[dict]:
    from rlalign.train.metrics import read_metrics

    train(load_config(cfg_cls, None, TINY + [f"output_dir={out}", *extra]))
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("trainer, extra", [
    ("sft", ["micro_batch_size=3"]), ("sft", ["model.gradient_checkpointing=true"]), ("sft", ["data.packing=true", "micro_batch_size=3"]),
    ("rm", ["micro_batch_size=3"]), ("rm", ["model.gradient_checkpointing=true"]),
], ids=["sft-micro", "sft-checkpointing", "sft-packed-micro", "rm-micro", "rm-checkpointing"])
def test_sft_and_reward_model_with_micro_batches_or_checkpointing_are_the_same_run(tmp_path, trainer, extra):
    train, cfg_cls, data = (train_sft, SFTConfig, ["data.num_train=64", "data.num_eval=8", "max_steps=3", "max_new_tokens=4"]) if trainer == "sft" else (
        train_rm, RMConfig, ["data.num_train=64", "data.num_eval=16", "max_steps=3"])
    packing = [e for e in extra if e.startswith("data.packing")]
    plain = supervised_history(train, cfg_cls, tmp_path / "plain", data + packing)
    other = supervised_history(train, cfg_cls, tmp_path / "other", data + extra)
    assert_same_run(plain, other, tmp_path / "plain" / "final", tmp_path / "other" / "final")


# ----------------------------------------------------------------------------------------------
# The model-level pieces: a checkpointed model's gradients, and its KV cache in eval mode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("older_transformers", [False, True], ids=["now", "before-rename"])
@pytest.mark.parametrize("make", [make_llama, make_gpt2], ids=["llama", "gpt2"])
def test_checkpointed_training_forward_has_the_same_logits_and_gradients(make, older_transformers, monkeypatch):
    # before-rename: a transformers without activation_checkpointing_enable (5.17), whose
    # gradient_checkpointing_enable takes gradient_checkpointing_kwargs
    if older_transformers:
        from transformers import PreTrainedModel

        if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
            pytest.skip("this transformers is from before the rename: the 'now' case runs the older name already")
        enable = PreTrainedModel.activation_checkpointing_enable
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
        monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", lambda self, gradient_checkpointing_kwargs: enable(self, gradient_checkpointing_kwargs))
    # rows 0-1 and 2-3 share a prompt (a GRPO group): the plain model runs each prompt once through
    # the KV cache; the checkpointed one cannot keep that cache and runs every row whole
    prompt_ids = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9], [0, 8, 9]])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[10, 11, 2], [12, 2, 0], [13, 14, 15], [16, 2, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    group_index = torch.tensor([0, 0, 1, 1])
    grads = []
    for checkpointing in (False, True):
        model = make().train()
        if checkpointing:
            enable_gradient_checkpointing(model)
            assert is_checkpointing(model)
        logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_index)
        (logits * completion_mask[..., None]).square().mean().backward()
        grads.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-5, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [make_llama, make_gpt2], ids=["llama", "gpt2"])
def test_a_checkpointed_model_samples_in_eval_mode_with_its_cache(make):
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = (prompt_ids != 0).long()
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    noise = torch.rand((8, 2), generator=torch.Generator().manual_seed(0))
    plain = sample(make(), (prompt_ids, prompt_mask), params, 0, [2], noise=noise)
    model = enable_gradient_checkpointing(make().train())
    with evaluating(model):
        checkpointed = sample(model, (prompt_ids, prompt_mask), params, 0, [2], noise=noise)
    assert model.training  # the mode is restored
    torch.testing.assert_close(checkpointed.completion_ids, plain.completion_ids)
    torch.testing.assert_close(checkpointed.logprobs, plain.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("entropy", ["statistic", "gradient"])
def test_a_micro_batch_runs_at_its_own_width_with_the_same_log_probs_and_gradients(entropy):
    # three rows padded to a step's longer rows: 2 prompt columns and 3 completion columns that are padding in every row.
    # completion_logprobs runs them trimmed (rlalign.train.passes.trimmed) and pads its output back with 0
    from rlalign.lm.rollout import Rollout
    from rlalign.train.passes import completion_logprobs, trimmed

    generator = torch.Generator().manual_seed(0)
    prompt, completion = torch.randint(3, 100, (3, 4), generator=generator), torch.randint(3, 100, (3, 5), generator=generator)
    prompt_mask, completion_mask = torch.ones_like(prompt), torch.ones_like(completion)
    prompt_mask[0, 0], completion_mask[1, 3:] = 0, 0  # a left-padded prompt, a shorter completion
    tight = Rollout(prompt, prompt_mask, completion, completion_mask, torch.zeros(3, 5), torch.arange(3), torch.zeros(3, dtype=torch.bool))
    wide = Rollout(torch.nn.functional.pad(prompt, (2, 0)), torch.nn.functional.pad(prompt_mask, (2, 0)), torch.nn.functional.pad(completion, (0, 3)),
                   torch.nn.functional.pad(completion_mask, (0, 3)), torch.zeros(3, 8), torch.arange(3), torch.zeros(3, dtype=torch.bool))
    cut, width = trimmed(wide)
    assert width == 8 and cut.prompt_ids.shape == (3, 4) and torch.equal(cut.completion_ids, completion)
    results = []
    for rollout in (tight, wide):
        model = make_llama(vocab=100).train()
        embedded = []  # the token positions the model runs
        model.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
        logp, ent = completion_logprobs(model, rollout, 0.7, entropy)
        assert sum(embedded) == 3 * (4 + 5)  # every row its own prompt, 4 + 5 positions: the wide rows trimmed (untrimmed: 6 + 8)
        ((logp * rollout.completion_mask).sum() + (ent * rollout.completion_mask).sum()).backward() if entropy == "gradient" else (logp * rollout.completion_mask).sum().backward()
        results.append((logp, ent, {n: p.grad for n, p in model.named_parameters()}))
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = results
    assert logp_b.shape == (3, 8) and not logp_b[:, 5:].any() and not ent_b[:, 5:].any()
    torch.testing.assert_close(logp_b[:, :5] * completion_mask, logp_a * completion_mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_b[:, :5] * completion_mask, ent_a * completion_mask, atol=1e-6, rtol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_maxima_and_minima_merge_over_the_micro_batches_that_count_tokens():
    # distillation's adv/max and adv/min are extremes, not means: max(3.6, 2.0) and min(-1.0, -0.2) (token-weighted means
    # over 4 and 1 tokens would be 3.28 and -0.84); an empty micro-batch's placeholders (0, a weight of 1) are nobody's values
    parts = [({"adv/max": 3.6, "adv/min": -1.0, "tis/weight_min": 1.5, "kl": 0.5}, 4.0, 4.0),
             ({"adv/max": 2.0, "adv/min": -0.2, "tis/weight_min": 1.36, "kl": 1.0}, 1.0, 1.0),
             ({"adv/max": 0.0, "adv/min": 0.0, "tis/weight_min": 1.0, "kl": 0.0}, 0.0, 0.0)]
    assert distributed.merge_micro_stats(parts) == pytest.approx({"adv/max": 3.6, "adv/min": -1.0, "tis/weight_min": 1.36, "kl": 0.6})
    empty = [({"adv/max": 0.0, "tis/weight_min": 1.0}, 0.0, 0.0)] * 2  # nothing counted anywhere: the placeholders
    assert distributed.merge_micro_stats(empty) == {"adv/max": 0.0, "tis/weight_min": 1.0}


def test_maxima_and_minima_reduce_over_the_ranks_that_count_tokens(monkeypatch):
    # this rank counts no token (PPO's rank without a row of the minibatch): its placeholders adv/max 0, adv/min 0 and
    # tis/weight_min 1 must not win over the other rank's 3.6, -1.0 and 1.36 (the weight's min was logged as 1.0)
    two = distributed.World(rank=0, size=2)
    monkeypatch.setattr(distributed, "all_sum", lambda x, world: x * 2)
    placeholders = {"adv/max": 0.0, "adv/min": 0.0, "kl": 0.0, "tis/weight_min": 1.0}
    other = iter([3.6, 1.0, -1.36])  # the other rank's value in each all_max, by name: a max, then minus two minima
    monkeypatch.setattr(distributed, "all_max", lambda value, world: max(value, next(other)))
    assert distributed.reduce_stats(placeholders, 0.0, 0.0, two) == pytest.approx({"adv/max": 3.6, "adv/min": -1.0, "kl": 0.0, "tis/weight_min": 1.36})
    nobody = iter([-math.inf] * 3)  # no rank counts a token: every rank keeps its placeholders
    monkeypatch.setattr(distributed, "all_max", lambda value, world: max(value, next(nobody)))
    assert distributed.reduce_stats(placeholders, 0.0, 0.0, two) == placeholders


def test_minibatches_are_cut_from_every_ranks_rows_as_one_process_cuts_them(monkeypatch):
    # rank 1 holds global rows 5, 6, 7 after rank 0's 5 rows (an agent's calls differ per rank); m = 2: minibatch 0
    # is the global rows 0, 2, 4, 6 -> rank 1's local row 1; minibatch 1 the rows 1, 3, 5, 7 -> local rows 0 and 2
    assert distributed.minibatch_rows(6, 3, distributed.World()) == [slice(0, None, 3), slice(1, None, 3), slice(2, None, 3)]
    monkeypatch.setattr(distributed, "gather_rows", lambda x, world, uneven=False: torch.tensor([5, 3]))
    second = distributed.minibatch_rows(3, 2, distributed.World(rank=1, size=2))
    assert [torch.arange(3)[mb].tolist() for mb in second] == [[1], [0, 2]]
    assert distributed.minibatch_rows(5, 2, distributed.World(rank=0, size=2)) == [slice(0, None, 2), slice(1, None, 2)]
