"""Micro-batches at their own width against the step's width, on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/micro_width.py                       # 4 x G 4 x 64 new tokens, micro_batch_size 2, 5 steps a side
    .venv/bin/python benchmarks/micro_width.py --micro-batch-size 4 --new-tokens 128

The real model (so completions end at different lengths) runs GRPO twice in one process from the same
start and seed: once as the library does, each pass dropping the columns that are padding in all of
its rows (``rlalign.train.passes.trimmed``), once with that turned off, every micro-batch at the
step's longest row. Reported: the median update and reference-pass times of the steps after the
first, and the completions' mean length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

from rlalign.train import passes  # noqa: E402
from rlalign.train.grpo import GRPOConfig  # noqa: E402


def run_side(args, trim: bool) -> dict:
    cfg = GRPOConfig.model_validate(dict(
        output_dir=tempfile.mkdtemp(prefix="bench_width_"), seed=0, num_threads=args.threads, model=dict(path=str(lb.smollm2_checkpoint())),
        sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7), optim=dict(lr=1e-6), steps=args.steps, prompts_per_step=args.prompts,
        group_size=args.group_size, beta=0.04, micro_batch_size=args.micro_batch_size, progress=False, plots=False,
    ))
    original = passes.trimmed
    if not trim:
        passes.trimmed = lambda rollout: (rollout, rollout.completion_ids.shape[1])
    try:
        setup = lb.GRPOSetup(cfg, lb.chat_arithmetic_records(256, 0), lb.chat_arithmetic_reward)
        steps = [setup.step() for _ in range(cfg.steps)]
    finally:
        passes.trimmed = original
    later = steps[1:] or steps
    return {key: statistics.median(m[key] for m in later) for key in ("time/update", "time/reference", "completion_len/mean", "completion_len/max")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sides = {"at the step's width": run_side(args, trim=False), "at its own width": run_side(args, trim=True)}
    print(f"\nSmolLM2-135M-Instruct, {args.prompts} x G {args.group_size} x up to {args.new_tokens} new tokens, micro_batch_size {args.micro_batch_size}, "
          f"{args.threads} thread(s), medians of steps 2-{args.steps}\n")
    print("| micro-batches | update s | reference s | completion mean / max |")
    print("|---|---:|---:|---:|")
    for name, r in sides.items():
        print(f"| {name} | {r['time/update']:.2f} | {r['time/reference']:.2f} | {r['completion_len/mean']:.1f} / {r['completion_len/max']:.0f} |")


if __name__ == "__main__":
    main()
