"""Eager against SDPA attention for a float32 training pass on the CPU: SmolLM2-135M-Instruct's forward
and backward (the loss on the last 32 positions' logits), the same batch through both kernels, the
median of ``--repeats`` rounds with the two kernels alternating.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attention_cpu.py --threads 1
    .venv/bin/python benchmarks/attention_cpu.py --config tiny --shapes 8x64 16x160     # the tiny Llama, seconds

Rows are left-padded like a rollout batch: half of them have their first quarter masked. Prints
one line per shape (rows x tokens): each kernel's seconds and eager / SDPA. This is the measurement
behind leaving ``model.attn_implementation`` at transformers' default (SDPA) in float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

KERNELS = ("eager", "sdpa")


def time_pass(model, ids, mask) -> float:
    """Seconds of one forward and backward of ``model`` on ``ids`` (B, T) under ``mask`` (B, T)."""
    t0 = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
    logits[:, -32:].logsumexp(-1).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--shapes", nargs="+", default=["8x64", "16x64", "16x96", "16x160", "8x320"], help="rows x tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = lb.smollm2_checkpoint() if args.config == "smollm2" else lb.tiny_checkpoint()
    models = {k: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=k) for k in KERNELS}
    vocab = models["sdpa"].config.vocab_size
    for shape in args.shapes:
        rows, tokens = map(int, shape.split("x"))
        ids = torch.randint(0, vocab, (rows, tokens))
        mask = torch.ones_like(ids)
        mask[: rows // 2, : tokens // 4] = 0  # left padding on half the rows
        times: dict[str, list[float]] = {k: [] for k in KERNELS}
        for _ in range(args.repeats):
            for k in KERNELS:
                times[k].append(time_pass(models[k], ids, mask))
        eager, sdpa = (statistics.median(times[k]) for k in KERNELS)
        print(f"{rows} x {tokens}: eager {eager:.3f} s, sdpa {sdpa:.3f} s, eager / sdpa {eager / sdpa:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
