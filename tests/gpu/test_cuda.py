"""rlalign on a CUDA device: the sampler against ``generate``, bfloat16 training and sampling, GRPO
and PPO end to end on SmolLM2-135M-Instruct, and GPU memory handed back between phases.

Skipped without CUDA (tests/gpu/conftest.py); ``tools/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from rlalign.config import load_config
from rlalign.lm.encoding import encode_prompts
from rlalign.lm.models import load_policy, load_tokenizer
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.train import grpo, ppo
from rlalign.train.common import generation_eval

DEVICE = "cuda"
QUESTIONS = ["What is 2+2?", "Name a colour.", "What is the capital of France?", "Count from one to five."]


def chat_records(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))}]} for i in range(n)]


def varied_reward(prompts: list, completions: list) -> list[float]:
    """A deterministic, varied score of the text, so groups rarely tie and every step has a gradient.
    Completions come as text, or as messages when the prompts are (TRL's convention)."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [float(sum(map(ord, t)) % 7) for t in texts]


def rl_overrides(path, tmp_path, **extra) -> dict:
    base = {
        "model.path": str(path), "model.device": DEVICE, "output_dir": str(tmp_path / "run"), "steps": 2, "prompts_per_step": 2,
        "sampling.max_new_tokens": 24, "optim.lr": 1e-3, "progress": False, "plots": False, "overwrite": True,
    }
    base.update(extra)
    return base


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_sampler_matches_generate_token_for_token_in_float32(smollm2):
    # greedy, float32 on the GPU: rlalign's decode loop (StaticCache, one additive mask, prefill once
    # per group) must pick exactly the tokens transformers' generate picks, row by row
    tok = load_tokenizer(smollm2.path)
    model = load_policy(smollm2.path, "float32", DEVICE).eval()
    ids = encode_prompts(tok, [r["prompt"] for r in chat_records(4)])  # different lengths: left padding is exercised
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    rollout = sample(model, ids, params, tok.pad_token_id, [tok.eos_token_id])
    assert rollout.completion_ids.device.type == DEVICE
    generated = model.generate(input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_mask, do_sample=False, max_new_tokens=48,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    c = rollout.completion_ids.shape[1]
    assert torch.equal(generated[:, rollout.prompt_ids.shape[1] :][:, :c], rollout.completion_ids)
    if smollm2.real:
        assert "4" in tok.decode(rollout.completion_ids[0], skip_special_tokens=True)


def test_compiled_decode_step_on_cuda_draws_what_the_eager_one_draws(tiny_path, compiled_sampling_calls):
    # sampling.compile on the GPU: the same greedy tokens and the same sampled tokens (same uniforms)
    # as the eager loop; the counts show the compiled step really ran
    tok = load_tokenizer(tiny_path)
    model = load_policy(tiny_path, "float32", DEVICE).eval()
    ids = [tok.encode("12+7=", add_special_tokens=False), tok.encode("3+40=", add_special_tokens=False)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=12, temperature=temperature)
        runs = [sample(model, ids, params, tok.pad_token_id, [tok.eos_token_id], group_size=2, generator=torch.Generator().manual_seed(3), compile=c)
                for c in (False, True)]
        assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, rtol=0, atol=1e-4)
    assert compiled_sampling_calls["decode"] > 0 and compiled_sampling_calls["draw"] > 0


def test_cuda_graphs_decode_step_draws_what_the_eager_one_draws(tiny_path, compiled_sampling_calls):
    # sampling.cuda_graphs: the compiled step replayed as a CUDA graph draws the eager loop's tokens,
    # over two calls (the second replays what the first recorded), and inductor skipped no graph
    from torch._dynamo.utils import counters

    tok = load_tokenizer(tiny_path)
    model = load_policy(tiny_path, "float32", DEVICE).eval()
    ids = [tok.encode("12+7=", add_special_tokens=False), tok.encode("3+40=", add_special_tokens=False)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    skips = counters["inductor"]["cudagraph_skips"]
    for seed in (3, 4):
        runs = [sample(model, ids, params, tok.pad_token_id, [tok.eos_token_id], group_size=2, generator=torch.Generator().manual_seed(seed),
                       compile=c, cuda_graphs=c) for c in (False, True)]
        assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, rtol=0, atol=1e-4)
    assert compiled_sampling_calls["graphed"] > 0 and compiled_sampling_calls["decode"] == 0
    assert counters["inductor"]["cudagraph_skips"] == skips, "inductor ran the decode step without CUDA graphs"


def test_sampled_evaluation_on_cuda_draws_what_the_cpu_one_draws(tiny_path):
    # generation_eval (DPO's and SFT's evaluation) seeds a private generator; the sampler draws its
    # uniforms on the CPU, so that generator must be a CPU one on a GPU too (it was the model's device)
    tok = load_tokenizer(tiny_path)
    prompts = ["12+7=", "3+40=", "5+5="]
    runs = [generation_eval(load_policy(tiny_path, "float32", device), tok, prompts, lambda p, c: [0.0] * len(c), 8, temperature=1.0, seed=5)[1]
            for device in ("cpu", DEVICE)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "bfloat16-stochastic", "autocast"])
def test_grpo_end_to_end_on_smollm2(smollm2, tmp_path, precision):
    # bfloat16: weights, optimiser and sampling all in bfloat16; autocast: float32 master weights,
    # bfloat16 forwards (model.autocast). Every step's numbers are finite, every weight on the GPU
    # moved, and the run wrote its final model. Held in bfloat16, a weight near 1 (an RMSNorm gain)
    # has a spacing of 2^-7 = 0.0078, so an AdamW step of lr = 1e-3 rounds back to the same value
    # (seen on an H200): that run takes lr = 1e-2, above half the spacing of weights below 2; with
    # stochastic rounding (optim.bf16_rounding) lr = 1e-4 moves a gain's entry with probability ~1/40 a step.
    extra = {
        "bfloat16": {"model.dtype": "bfloat16", "optim.lr": 1e-2},
        "bfloat16-stochastic": {"model.dtype": "bfloat16", "optim.bf16_rounding": "stochastic", "optim.lr": 1e-4},
        "autocast": {"model.autocast": "bfloat16"},
    }.get(precision, {})
    cfg = load_config(grpo.GRPOConfig, None, rl_overrides(smollm2.path, tmp_path, group_size=4, beta=0.04, **extra))
    start = weights(load_policy(smollm2.path, cfg.model.dtype))
    result = grpo.train(cfg, reward_functions=[varied_reward], prompts=chat_records(8))
    assert len(result.history) == 2
    for metrics in result.history:
        for key in ("loss/policy", "kl", "reward/mean", "grad_norm", "entropy"):
            assert math.isfinite(metrics[key]), (key, metrics[key])
    params = dict(result.policy.named_parameters())
    assert {p.device.type for p in params.values()} == {DEVICE}
    assert {p.dtype for p in params.values()} == {torch.bfloat16 if precision.startswith("bfloat16") else torch.float32}
    unchanged = [name for name, w in start.items() if torch.equal(params[name].detach().cpu(), w)]
    assert not unchanged, f"{len(unchanged)} of {len(start)} parameters did not change: {unchanged[:5]}"
    assert (result.final_dir / "config.json").is_file()


def test_ppo_end_to_end_on_smollm2(smollm2, tmp_path):
    cfg = load_config(ppo.PPOConfig, None, rl_overrides(smollm2.path, tmp_path, prompts_per_step=4, ppo_epochs=2, num_minibatches=2,
                                                        kl_coef=0.01, **{"model.autocast": "bfloat16", "critic.optim.lr": 1e-4}))
    result = ppo.train(cfg, reward_functions=[varied_reward], prompts=chat_records(8))
    assert len(result.history) == 2
    for metrics in result.history:
        finite = {k: v for k, v in metrics.items() if isinstance(v, float) and not k.startswith("time/")}
        assert finite and all(math.isfinite(v) for v in finite.values()), finite
    assert {p.device.type for p in result.critic.parameters()} == {DEVICE}
    assert (result.final_dir / "critic").is_dir()


def test_kv_cache_is_released_before_the_training_passes(smollm2, tmp_path, monkeypatch):
    # the sampler's KV cache (B rows x (P + N) slots x 30 layers x K and V x 3 heads x 64, float32)
    # must be gone when the reference and training passes start: measured at the entry of
    # grpo.reference_logprobs (looked up by grpo_step at call time), against the step's start
    cfg = load_config(grpo.GRPOConfig, None, rl_overrides(smollm2.path, tmp_path, group_size=8, steps=2, **{"sampling.max_new_tokens": 128}))
    seen = {}
    real_reference, real_step = grpo.reference_logprobs, grpo.grpo_step

    def reference_logprobs(*args, **kwargs):
        seen["at_reference"] = torch.cuda.memory_allocated()
        return real_reference(*args, **kwargs)

    def grpo_step(*args, **kwargs):
        seen["at_step_start"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(grpo, "reference_logprobs", reference_logprobs)
    monkeypatch.setattr(grpo, "grpo_step", grpo_step)
    before_run = torch.cuda.memory_allocated()
    result = grpo.train(cfg, reward_functions=[varied_reward], prompts=chat_records(8))
    peak = torch.cuda.max_memory_allocated()  # of the last step
    rows, slots = 16, 128 + 20  # prompts of the chat template are ~20-40 tokens
    kv_bytes = rows * slots * 30 * 2 * 3 * 64 * 4
    assert peak - seen["at_step_start"] > kv_bytes  # the cache (at least its completion part) existed during the step
    assert seen["at_reference"] - seen["at_step_start"] < kv_bytes / 4  # ... and was freed before the reference pass
    # after the run, with its result dropped, the GPU holds what it held before
    del result
    gc.collect()
    assert torch.cuda.memory_allocated() - before_run < 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_lm_head_on_cuda_equals_the_logits_path_and_holds_less(dtype):
    # a Qwen-sized vocabulary: 64 rows x 128 tokens of 151,936 logits are 5 GB in float32
    from rlalign.core.linear_logprobs import linear_token_logprobs
    from rlalign.core.logprobs import token_logprobs

    g = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(64, 128, 896, device=DEVICE, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(151936, 896, device=DEVICE, generator=g, dtype=dtype) / 30).requires_grad_()
    tokens = torch.randint(0, 151936, (64, 128), device=DEVICE, generator=g)
    results, peaks = [], []
    for chunked in (True, False):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp = linear_token_logprobs(hidden, weight, tokens, 0.7)[0] if chunked else token_logprobs(hidden @ weight.t(), tokens, 0.7)
        logp.sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((logp.detach(), hidden.grad.clone(), weight.grad.clone()))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for ours, theirs in zip(*results):
        assert (ours.float() - theirs.float()).abs().max() <= tolerance * theirs.float().abs().max()
    assert peaks[0] < 0.5 * peaks[1], peaks  # no logits, nor their gradient, held whole


def test_a_producer_rank_sharing_the_learners_gpu_trains_as_one_process(tiny_path, tmp_path):
    # torchrun, 2 ranks on one GPU: a learner and a producer rank (gloo default group, CUDA IPC weight
    # slots: device to device), k = 0, against the same run in one process on that GPU
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[2]
    runs = root / "tests" / "train" / "rank_runs.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(runs), str(tmp_path / "ranks"), str(tiny_path), "k0"]
    done = subprocess.run([*cmd], env={**env, "RLALIGN_RANK_RUNS_PRODUCERS": "1", "RLALIGN_RANK_RUNS_DEVICE": "cuda"}, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "shared slots on this host" in done.stdout
    one = subprocess.run([sys.executable, str(runs), str(tmp_path / "one"), str(tiny_path), "k0"], env={**env, "RLALIGN_RANK_RUNS_DEVICE": "cuda"},
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert one.returncode == 0, one.stderr[-5000:]
    a, b = load_file(str(tmp_path / "one" / "k0" / "final" / "model.safetensors")), load_file(str(tmp_path / "ranks" / "k0" / "final" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-4)
    rows = [json.loads(line) for line in (tmp_path / "ranks" / "k0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [-1, 0, 1, 2]
