"""Peak memory of token log-probs: rlalign.core.token_logprobs vs log_softmax + gather; with
``--hidden H``, from the last hidden states and an LM head instead of from the logits, and the fused
head (rlalign.core.linear_logprobs, no logits at all) beside them.

Each variant runs in a fresh subprocess (peak RSS cannot be reset in-process); the number reported
is the peak RSS growth above the inputs (logits, or hidden states and head weight; tokens; the
upstream gradient), forward and backward, relative to the size of the logits.

    python benchmarks/logprobs_memory.py [--batch 4 --length 512 --vocab 32000 --dtype float32]
    python benchmarks/logprobs_memory.py --hidden 576 --vocab 49152    # SmolLM2-135M's head
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402


def _measure(variant: str, batch: int, length: int, vocab: int, dtype: str, temperature: float, hidden: int = 0) -> dict:
    import torch

    from rlalign.core.linear_logprobs import linear_token_logprobs
    from rlalign.core.logprobs import token_logprobs

    torch.manual_seed(0)
    dtype_ = getattr(torch, dtype)
    if hidden:  # the head's inputs: the logits are made inside the measured pass (or never, fused)
        states = torch.randn(batch, length, hidden, dtype=dtype_).requires_grad_()
        head = (torch.randn(vocab, hidden, dtype=dtype_) / hidden**0.5).requires_grad_()
    else:
        logits = torch.randn(batch, length, vocab, dtype=dtype_).requires_grad_()
    tokens = torch.randint(0, vocab, (batch, length))
    weights = torch.randn(batch, length)
    base = lb.peak_rss_mb()  # this process's own peak (VmHWM), not one carried over from the parent
    if variant == "fused":
        logp, _ = linear_token_logprobs(states, head, tokens, temperature)
    else:
        if hidden:
            logits = states @ head.t()  # (B, T, V)
        if variant == "naive":
            logp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]
        else:
            logp = token_logprobs(logits, tokens, temperature)
    (logp * weights).sum().backward()
    peak = lb.peak_rss_mb()
    logits_bytes = batch * length * vocab * dtype_.itemsize
    return {"variant": variant, "peak_growth_mb": peak - base, "logits_mb": logits_bytes / 2**20,
            "ratio_to_logits": (peak - base) * 2**20 / logits_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--hidden", type=int, default=0, help="measure from hidden states of this width and an LM head (adds the fused variant)")
    parser.add_argument("--child", choices=["naive", "rlalign", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child, args.batch, args.length, args.vocab, args.dtype, args.temperature, args.hidden)))
        return
    rows = []
    for variant in ("naive", "rlalign", "fused") if args.hidden else ("naive", "rlalign"):
        cmd = [sys.executable, __file__, "--child", variant] + [f"--{k}={getattr(args, k)}" for k in ("batch", "length", "vocab", "dtype", "temperature", "hidden")]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    source = f"hidden states (H={args.hidden}) and an LM head" if args.hidden else "logits"
    print(f"B={args.batch} T={args.length} V={args.vocab} {args.dtype}, from {source}, temperature {args.temperature}, forward + backward")
    print("| variant | peak RSS growth (MB) | x logits size |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['peak_growth_mb']:.0f} | {row['ratio_to_logits']:.2f} |")
    for row in rows[1:]:
        print(f"{row['variant']} / naive peak: {row['peak_growth_mb'] / rows[0]['peak_growth_mb']:.2f}")


if __name__ == "__main__":
    main()
