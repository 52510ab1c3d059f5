"""Where the time of one rlalign GRPO step goes: cProfile by phase, then torch.profiler by operator.

    .venv/bin/python benchmarks/profile_grpo.py --out runs/bench/profile_grpo_smollm2.json
    .venv/bin/python benchmarks/profile_grpo.py --autocast      # model.autocast=bfloat16 (float32 master weights)
    .venv/bin/python benchmarks/profile_grpo.py --real          # SmolLM2-135M-Instruct's weights (EOS ends rows early)

The step: ``rlalign.train.grpo.grpo_step`` on SmolLM2-135M's shape (random weights, so every row
runs the full 32 new tokens; ``--real`` for the real weights), SmolLM2's tokenizer and chat
prompts, 2 prompts x G = 8, beta 0.04 (a reference pass runs), float32, one thread. One warm-up
step, one plain timed step, one step under cProfile (phase = cumulative time of the rlalign
function that does it), one step under torch.profiler (operators by self CPU time).

Phases (cProfile cumulative time; nested entries are part of their parent):

    generate            rlalign.lm.sampling.sample (prefill + decode loop, KV cache)
    decode text         Rollout.decode_completions
    score               rollouts.score_rollout (the reward function)
    reference pass      passes.reference_logprobs (frozen model forward, no grad)
    pi_old recompute    passes.training_logprobs (only with model.autocast: bfloat16)
    loss (forward)      grpo.grpo_loss, of which:
      policy forward      passes.completion_logits
      token log-probs     core.logprobs.token_logprobs
      entropy metric      core.kl.entropy_from_logits (no grad, over the (B, C, V) logits)
    backward            torch.Tensor.backward (inside Updater.step)
    grad clip           torch.nn.utils.clip_grad_norm_
    AdamW step          torch.optim.Optimizer.step wrapper (AdamW)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402
from mfu import random_checkpoint  # noqa: E402

# (phase, path suffix of the defining file, function name)
PHASES = [
    ("generate", "rlalign/lm/sampling.py", "sample"),
    ("decode text", "rlalign/lm/rollout.py", "decode_completions"),
    ("score", "rlalign/train/rollouts.py", "score_rollout"),
    ("reference pass", "rlalign/train/passes.py", "reference_logprobs"),
    ("pi_old recompute", "rlalign/train/passes.py", "training_logprobs"),
    ("loss (forward)", "rlalign/train/grpo.py", "grpo_loss"),
    ("  policy forward", "rlalign/train/passes.py", "completion_logits"),
    ("  token log-probs", "rlalign/core/logprobs.py", "token_logprobs"),
    ("  entropy metric", "rlalign/core/kl.py", "entropy_from_logits"),
    ("backward", "torch/_tensor.py", "backward"),
    ("grad clip", "torch/nn/utils/clip_grad.py", "clip_grad_norm_"),
    ("AdamW step", "torch/optim/adam.py", "step"),
]


def build(args) -> lb.GRPOSetup:
    torch.set_num_threads(args.threads)
    from rlalign.train.grpo import GRPOConfig

    path = lb.smollm2_checkpoint() if args.real else random_checkpoint("smollm2")
    cfg = GRPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_profile_"), seed=0, num_threads=args.threads,
            model=dict(path=str(path), autocast="bfloat16" if args.autocast else "none"),
            sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7), optim=dict(lr=1e-6, betas=(0.9, 0.95), warmup_steps=0, min_lr_ratio=1.0),
            steps=4, prompts_per_step=args.prompts, group_size=args.group_size, beta=args.beta, progress=False, plots=False,
        )
    )
    return lb.GRPOSetup(cfg, lb.chat_arithmetic_records(256, 0), lb.chat_arithmetic_reward)  # grpo.train()'s setup, no outer loop


def phase_times(stats: pstats.Stats) -> dict[str, float]:
    out = {}
    for phase, suffix, name in PHASES:
        total = 0.0
        for (filename, _, funcname), (_, _, _, cumulative, _) in stats.stats.items():
            if funcname == name and filename.replace("\\", "/").endswith(suffix):
                total = max(total, cumulative)  # one entry per (file, line, name); recursion is not an issue here
        out[phase] = total
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct's weights instead of random ones")
    parser.add_argument("--autocast", action="store_true", help="model.autocast=bfloat16: forwards in bfloat16 autocast, float32 master weights")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--top", type=int, default=20, help="operators listed from torch.profiler")
    parser.add_argument("--no-torch-profiler", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    setup = build(args)

    def step() -> tuple[float, dict]:
        t0 = time.perf_counter()
        metrics = setup.step()
        return time.perf_counter() - t0, metrics

    warm, _ = step()
    plain, metrics = step()
    print(f"warm-up step {warm:.2f} s; plain step {plain:.2f} s (generate {metrics['time/generate']:.2f}, score {metrics['time/score']:.4f}, "
          f"reference + train {metrics['time/train']:.2f}); completion tokens {metrics['tokens']:.0f}", file=sys.stderr)

    profiler = cProfile.Profile()
    profiler.enable()
    profiled, _ = step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    phases = phase_times(stats)
    rest = profiled - sum(v for k, v in phases.items() if not k.startswith("  "))

    ops_table, ops = "", []
    if not args.no_torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch_step, _ = step()
        averages = prof.key_averages()
        total_self = sum(e.self_cpu_time_total for e in averages)
        for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]:
            ops.append({"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total_self})
        ops_table = "\n".join(
            ["| operator | calls | self CPU s | share of self CPU |", "|---|---:|---:|---:|"]
            + [f"| {o['op']} | {o['calls']} | {o['self_s']:.2f} | {o['share']:.1%} |" for o in ops]
        )

    print(f"\nOne rlalign GRPO step, SmolLM2-135M {'(real weights)' if args.real else 'shape (random weights)'}, {args.prompts} x {args.group_size} x "
          f"{args.new_tokens} new tokens, beta {args.beta}, float32{' + bf16 autocast' if args.autocast else ''}, {args.threads} thread(s), "
          f"load {lb.machine_load()}, rlalign {lb.code_version()}\n")
    print(f"plain step {plain:.2f} s; under cProfile {profiled:.2f} s\n")
    print("| phase (cProfile, cumulative) | s | share of the profiled step |")
    print("|---|---:|---:|")
    for phase, secs in phases.items():
        print(f"| {phase} | {secs:.2f} | {secs / profiled:.1%} |")
    print(f"| rest (advantages, metrics, glue) | {rest:.2f} | {rest / profiled:.1%} |")
    if ops_table:
        print(f"\ntorch.profiler, one more step ({torch_step:.2f} s under the profiler), top {args.top} operators by self CPU time:\n")
        print(ops_table)
    if args.out:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(40)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "rlalign_commit": lb.code_version(), "warmup_s": warm, "plain_s": plain, "profiled_s": profiled,
            "plain_metrics": metrics, "phases": phases, "ops": ops, "cprofile_top": buf.getvalue(),
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
