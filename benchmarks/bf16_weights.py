"""Learning curves of the weight precisions: float32 weights against bfloat16 weights rounded to
nearest or stochastically, on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/bf16_weights.py                        # SFT, lr 1e-5, 40 steps a side
    .venv/bin/python benchmarks/bf16_weights.py --lr 2e-6 --steps 60

The real model fine-tunes (SFT on the arithmetic task, batch 16, constant lr) four times in one
process from the same start, seed and batches:

- ``float32``: float32 weights, AdamW exact (16 bytes a weight: weight, gradient, two moments);
- ``autocast``: the same float32 master weights, forwards under bfloat16 autocast (``model.autocast``);
- ``bf16 nearest``: bfloat16 weights, torch's AdamW rounding each new weight to nearest (8 bytes a
  weight; here with the guard that refuses it turned off, to show what the guard prevents);
- ``bf16 stochastic``: bfloat16 weights, each step in float32 with float32 moments, rounded
  stochastically (``optim.bf16_rounding: stochastic``, 12 bytes a weight).

Reported: the training loss (mean of each window of steps), the final held-out loss, and the share
of weights the run moved away from their starting bfloat16 value.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

from rlalign.lm.models import load_policy  # noqa: E402
from rlalign.train import sft, updater  # noqa: E402

SIDES = {
    "float32": dict(model=dict(dtype="float32")),
    "autocast": dict(model=dict(dtype="float32", autocast="bfloat16")),
    "bf16 nearest": dict(model=dict(dtype="bfloat16"), optim=dict(bf16_rounding="nearest")),
    "bf16 stochastic": dict(model=dict(dtype="bfloat16"), optim=dict(bf16_rounding="stochastic")),
}


def run_side(args, name: str) -> dict:
    side = SIDES[name]
    out = Path(tempfile.mkdtemp(prefix="bench_bf16_"))
    cfg = sft.SFTConfig.model_validate(dict(
        output_dir=str(out), seed=0, num_threads=args.threads, progress=False, plots=False,
        model=dict(path=str(lb.smollm2_checkpoint()), **side["model"]),
        data=dict(task="arithmetic", num_train=args.batch_size * args.steps, num_eval=64), max_new_tokens=4,
        optim=dict(lr=args.lr, warmup_steps=0, min_lr_ratio=1.0, **side.get("optim", {})),
        batch_size=args.batch_size, max_steps=args.steps, eval_every=args.steps, eval_batch_size=64,
    ))
    guard = updater.check_bfloat16_steps
    if name == "bf16 nearest":
        updater.check_bfloat16_steps = lambda params, lr: None  # the run the guard refuses, to show why
    try:
        final = sft.train(cfg)
    finally:
        updater.check_bfloat16_steps = guard
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/sft"] for r in rows if "loss/sft" in r]
    start = load_policy(lb.smollm2_checkpoint(), dtype="bfloat16").state_dict()
    end = load_policy(out / "final", dtype="bfloat16").state_dict()
    moved = sum(int((end[k] != start[k]).sum()) for k in start) / sum(v.numel() for v in start.values())
    initial = next(r["eval/loss"] for r in rows if "eval/loss" in r)  # the evaluation before the first step
    return {"losses": losses, "eval_loss": final["eval/loss"], "eval_loss_initial": initial, "moved": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--window", type=int, default=10, help="steps a training-loss mean covers")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: run_side(args, name) for name in SIDES}
    windows = range(0, args.steps, args.window)
    print(f"\nSmolLM2-135M-Instruct, SFT on arithmetic, batch {args.batch_size}, constant lr {args.lr:g}, {args.steps} steps, {args.threads} thread(s)\n")
    print("| weights | " + " | ".join(f"loss {w + 1}-{min(w + args.window, args.steps)}" for w in windows) + " | held-out loss | weights moved |")
    print("|---|" + "---:|" * (len(windows) + 2))
    for name, r in results.items():
        means = [sum(r["losses"][w : w + args.window]) / len(r["losses"][w : w + args.window]) for w in windows]
        print(f"| {name} | " + " | ".join(f"{m:.3f}" for m in means) + f" | {r['eval_loss']:.3f} | {r['moved']:.1%} |")
    print("\nheld-out loss before training: " + ", ".join(f"{name} {r['eval_loss_initial']:.3f}" for name, r in results.items()))


if __name__ == "__main__":
    main()
