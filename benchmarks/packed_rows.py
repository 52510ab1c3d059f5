"""Packed rows against padded rows in GRPO's training and reference passes, on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/packed_rows.py                       # 4 x G 8 x up to 96 new tokens, 4 steps a side
    .venv/bin/python benchmarks/packed_rows.py --separate-prompts    # every row runs its prompt, as under DDP / FSDP2
    .venv/bin/python benchmarks/packed_rows.py --device cuda --prompts 16 --group-size 16 --new-tokens 256

The real model (so completions end at different lengths) runs GRPO twice in one process from the
same start and seed, with ``micro_batch_size: auto``: once as the library does, a pass whose rows
are ragged packing their real tokens end to end where that runs fewer positions than the padded
rows or the shared prompts (``rlalign.core.packing``); once with packing turned off, each pass at
its own width (``rlalign.train.passes.trimmed``) with shared prompts. ``--separate-prompts`` turns
the shared prompts off on both sides, as a DistributedDataParallel or FSDP2 learner runs. Reported:
the median update and reference-pass times of the steps after the first, and the completions'
lengths.
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

from rlalign.lm import logprobs  # noqa: E402
from rlalign.train import passes  # noqa: E402
from rlalign.train.grpo import GRPOConfig  # noqa: E402

METRICS = ("time/update", "time/reference", "completion_len/mean", "completion_len/max")


def run_side(args, packed: bool) -> dict:
    cfg = GRPOConfig.model_validate(dict(
        output_dir=tempfile.mkdtemp(prefix="bench_packed_"), seed=0, num_threads=args.threads,
        model=dict(path=str(lb.smollm2_checkpoint()), device=args.device, autocast="bfloat16" if args.device.startswith("cuda") else "none"),
        sampling=dict(max_new_tokens=args.new_tokens, temperature=1.0), optim=dict(lr=1e-6), steps=args.steps, prompts_per_step=args.prompts,
        group_size=args.group_size, beta=0.04, progress=False, plots=False,
    ))
    patches = [(logprobs, "packs_rows", logprobs.packs_rows, None if packed else (lambda model: False))]
    if args.separate_prompts:
        patches.append((passes, "share_prompts", passes.share_prompts, lambda model: False))
    for module, name, _, replacement in patches:
        if replacement is not None:
            setattr(module, name, replacement)
    try:
        setup = lb.GRPOSetup(cfg, lb.chat_arithmetic_records(256, 0), lb.chat_arithmetic_reward)
        steps = [setup.step() for _ in range(cfg.steps)]
    finally:
        for module, name, original, _ in patches:
            setattr(module, name, original)
    later = steps[1:] or steps
    return {key: statistics.median(m[key] for m in later) for key in METRICS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--separate-prompts", action="store_true", help="every row runs its prompt on both sides (DDP / FSDP2 learners)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sides = {"padded rows": run_side(args, packed=False), "packed rows": run_side(args, packed=True)}
    prompts = "each row's prompt" if args.separate_prompts else "shared prompts where fewer"
    print(f"\nSmolLM2-135M-Instruct on {args.device}, {args.prompts} x G {args.group_size} x up to {args.new_tokens} new tokens, micro_batch_size auto, "
          f"{prompts}, {args.threads} thread(s), medians of steps 2-{args.steps}\n")
    print("| rows | update s | reference s | completion mean / max |")
    print("|---|---:|---:|---:|")
    for name, r in sides.items():
        print(f"| {name} | {r['time/update']:.2f} | {r['time/reference']:.2f} | {r['completion_len/mean']:.1f} / {r['completion_len/max']:.0f} |")
    padded, packed = sides["padded rows"], sides["packed rows"]
    print(f"\npacked / padded: update {packed['time/update'] / padded['time/update']:.2f}x, reference {packed['time/reference'] / padded['time/reference']:.2f}x")


if __name__ == "__main__":
    main()
