"""Peak memory of GRPO, PPO and SFT steps, and what gradient checkpointing and micro-batches save, each variant in its own process.

    .venv/bin/python benchmarks/memory.py --model smollm2 --out runs/bench/memory_smollm2.json
    .venv/bin/python benchmarks/memory.py --model smollm2 --prompt explain --new-tokens 128 \
        --variants grpo,grpo-gc,grpo-micro,grpo-gc-micro,ppo,ppo-gc,sft,sft-gc,sft-micro
    .venv/bin/python benchmarks/memory.py --model tiny          # seconds; a check of the harness

Variants (``--variants``, space- or comma-separated), each run for ``--steps`` steps (default 2) in a
fresh subprocess. One step is not enough: AdamW's two moments are allocated by the first
``optimizer.step``, after the first backward, so only from the second step on does a backward run
with weights, moments, gradients and activations all alive, and the peak after one step understates
a run's:

    grpo        policy + frozen reference, rule reward                        (rlalign.train.grpo)
    grpo-rm     policy + frozen reference + reward model (the seeds' GRPO)
    grpo-lora   LoRA policy (r 16, all linear layers); reference = the same weights with adapters
                disabled (peft ``disable_adapter``), no second copy; rule reward
    ppo         policy + frozen reference + reward model + critic, each with its own AdamW
                (rlalign.train.ppo)
    sft         rlalign.train.sft on a data file of chat prompt-completion pairs (running sums worked
                step by step, long enough that every row is cut at ``--sft-length`` tokens),
                ``--sft-batch`` rows per step; no evaluation, checkpoint or final save

and, for grpo, ppo and sft, the memory savers of every LM trainer:

    <base>-gc        model.gradient_checkpointing: true (the policy; PPO's critic too): each decoder
                     layer's activations recomputed in backward instead of kept
    <base>-micro     micro_batch_size ``--micro-batch-size`` (default 4): each optimiser step's batch
                     in micro-batches whose gradients are accumulated (same update); for GRPO and PPO
                     also the rows per reference / value pass
    <base>-gc-micro  both

Same model, same rows per update: GRPO 2 prompts x G = 8 = 16 completions; PPO 16 prompts x 1
completion, 1 epoch, 1 minibatch; 32 new tokens (``--new-tokens``); float32; KL coefficient 0.04.
The reward model and critic are SmolLM2's backbone with a fresh scalar head (``_lm_bench.reward_checkpoint``:
no reward-model training is needed for a memory measurement). ``--prompt answer`` (the default) asks for the number
only, so SmolLM2's completions end after ~10-20 tokens whatever ``--new-tokens`` is; ``--prompt
explain`` asks it to explain step by step, so most completions run to ``--new-tokens`` and the
activations of the training forward grow with it. Sampling is seeded and runs in eval mode, so a
variant and its -gc / -micro versions train on the same completions (``completion_len/max`` and
``tokens`` are reported per step to show it).

Measured per variant: RSS after imports (the baseline: Python, torch, transformers), and peak
RSS (``VmHWM``, ``_lm_bench.peak_rss_mb``) after the step(s). transformers maps the safetensors weights from the
file; RSS counts every resident mapped page, so each loaded copy counts once it has been read.
Reported next to the seeds' estimate (weights only: PPO ~4x the policy, GRPO ~3x with a reward
model, 2x without) and the full count: W = parameters x 4 bytes per model held, plus gradient and
two AdamW moments (3 W) per trained model. For each -gc / -micro variant: the saving in peak RSS
above the baseline against its plain variant, and the ratios of the median step time, wall and CPU
(this process's: less moved by other jobs on the machine), and, for GRPO and PPO, of the update
phase's wall time (where the recompute happens), over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

BASES = ("grpo", "grpo-rm", "grpo-lora", "ppo", "sft")
SAVERS = ("-gc", "-micro", "-gc-micro")  # gradient checkpointing, micro-batches, both
DEFAULT_VARIANTS = ("grpo", "grpo-rm", "grpo-lora", "ppo")
VARIANTS = BASES + tuple(b + s for b in ("grpo", "ppo", "sft") for s in SAVERS)
# models held and trained, in units of the policy's weights (seeds' estimate = held; full = held + 3 x trained)
HELD = {"grpo": (2, 1), "grpo-rm": (3, 1), "grpo-lora": (1, 0), "ppo": (4, 2), "sft": (1, 1)}
SEEDS_ESTIMATE = {"grpo": "2x (policy, reference)", "grpo-rm": "~3x", "grpo-lora": "1x", "ppo": "~4x", "sft": "1x"}


def parse_variant(variant: str) -> tuple[str, bool, bool]:
    """(base variant, gradient checkpointing, micro-batches) of a variant name such as ``grpo-gc-micro``."""
    for saver in sorted(SAVERS, key=len, reverse=True):
        if variant.endswith(saver):
            return variant[: -len(saver)], "gc" in saver, "micro" in saver
    return variant, False, False


def variant_list(text: str) -> list[str]:
    """``--variants`` values: each a name or a comma-separated list of names."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    return names


def setting(model: str, prompt: str = "answer"):
    if model == "tiny":
        from rlalign.tasks import TASKS

        return lb.tiny_checkpoint(), TASKS["arithmetic"].prompt_records("train", 256, 0), lb.arithmetic_reward
    records = lb.chat_arithmetic_records(256, 0)
    if prompt == "explain":  # SmolLM2 then writes to the length cap on most rows
        for r in records:
            r["prompt"][0]["content"] = r["prompt"][0]["content"].replace("Reply with the number only.", "Explain step by step.")
    return lb.smollm2_checkpoint(), records, lb.chat_arithmetic_reward


def sft_data(path: Path, n: int, seed: int = 0, lines: int = 40) -> Path:
    """``n`` chat prompt-completion pairs as JSONL at ``path``: "Starting from a, add k, step by step,
    ``lines`` times." and the running sum line by line ("a+k=b"), ~10 tokens a line: a short prompt and
    a completion of a few hundred tokens, so every row is cut at ``--sft-length`` and is all completion
    after its first ~30 tokens."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            total, k = rng.randint(10, 99), rng.randint(2, 49)
            prompt = f"Starting from {total}, add {k}, step by step, {lines} times."
            steps = []
            for _ in range(lines):
                steps.append(f"{total}+{k}={total + k}")
                total += k
            row = {"prompt": [{"role": "user", "content": prompt}], "completion": [{"role": "assistant", "content": "\n".join(steps)}]}
            f.write(json.dumps(row) + "\n")
    return path


def run_grpo(variant: str, args, path: Path, records, reward_fn) -> dict:
    from rlalign.train.grpo import GRPOConfig

    variant, gc, micro = parse_variant(variant)
    lora = {"r": 16, "alpha": 32.0, "target_modules": "all-linear"} if variant == "grpo-lora" else None
    rewards_cfg = [{"reward_model": str(lb.reward_checkpoint(path)), "name": "rm"}] if variant == "grpo-rm" else []
    cfg = GRPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_mem_"), seed=0, num_threads=args.threads,
            model=dict(path=str(path), lora=lora, gradient_checkpointing=gc), rewards=rewards_cfg,
            sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7), optim=dict(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0),
            steps=args.steps, prompts_per_step=2, group_size=8, beta=0.04, micro_batch_size=args.micro_batch_size if micro else None,
            progress=False, plots=False,
        )
    )
    # grpo.train()'s setup without its outer loop, whose checkpoint and final-model writing would add to the peak
    setup = lb.GRPOSetup(cfg, records, None if variant == "grpo-rm" else reward_fn)  # LoRA: no reference copy, the base with adapters off
    return measure_steps(setup, [setup.policy], args.steps)


def run_ppo(variant: str, args, path: Path, records) -> dict:
    from rlalign.train.ppo import PPOConfig

    _, gc, micro = parse_variant(variant)
    cfg = PPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_mem_"), seed=0, num_threads=args.threads, model=dict(path=str(path), gradient_checkpointing=gc),
            rewards=[{"reward_model": str(lb.reward_checkpoint(path)), "name": "rm"}], sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7),
            optim=dict(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0), steps=args.steps, prompts_per_step=16, ppo_epochs=1, num_minibatches=1,
            micro_batch_size=args.micro_batch_size if micro else None, kl_coef=0.04, kl_target=None, progress=False, plots=False,
        )
    )
    setup = lb.PPOSetup(cfg, records)  # ppo.train()'s setup; the critic starts from the reward model's backbone (here: the base)
    return measure_steps(setup, [setup.policy, setup.critic], args.steps)


def run_sft(variant: str, args, path: Path) -> dict:
    from rlalign.train.sft import SFTConfig

    _, gc, micro = parse_variant(variant)
    out = Path(tempfile.mkdtemp(prefix="bench_mem_"))
    data = sft_data(out / "pairs.jsonl", 4 * args.sft_batch)
    cfg = SFTConfig.model_validate(
        dict(
            output_dir=str(out / "run"), seed=0, num_threads=args.threads, model=dict(path=str(path), gradient_checkpointing=gc),
            data=dict(train_file=str(data), eval_file=str(data), max_length=args.sft_length), batch_size=args.sft_batch,
            micro_batch_size=args.micro_batch_size if micro else None, optim=dict(lr=1e-5, warmup_steps=0), max_steps=args.steps,
            progress=False, plots=False,
        )
    )
    setup = lb.SFTSetup(cfg)  # sft.train()'s setup and supervised_loop's step, without evaluation, checkpoints or the final save
    return measure_steps(setup, [setup.policy], args.steps)


# per-step metrics kept: how much was trained on (equal across a variant and its -gc / -micro versions) and where the time went
STEP_KEYS = ("tokens", "completion_len/max", "time/generate", "time/reference", "time/update")


def checkpointing_state(models) -> list[bool]:
    """Per trained model: would its training forward recompute activations in backward (checkpointing on, train mode)?"""
    from rlalign.lm.heads import ScalarHeadModel
    from rlalign.lm.models import unwrap_causal_lm

    state = []
    for m in models:
        backbone = m.backbone if isinstance(m, ScalarHeadModel) else unwrap_causal_lm(m)
        state.append(bool(getattr(backbone, "is_gradient_checkpointing", False)) and m.training)
    return state


def measure_steps(setup, trained, steps: int) -> dict:
    info = {"trainable_params": sum(p.numel() for m in trained for p in m.parameters() if p.requires_grad), "rss_loaded_mb": lb.current_rss_mb(),
            "checkpointing": checkpointing_state(trained)}
    times, cpu, peaks, metrics = [], [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        m = setup.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # CPU seconds of this process: less moved by other jobs on the machine than wall time
        peaks.append(lb.peak_rss_mb())
        metrics.append({k: float(m[k]) for k in STEP_KEYS if k in m})
    return {**info, "step_s": times, "step_cpu_s": cpu, "peak_after_step_mb": peaks, "step_metrics": metrics}


def worker(variant: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import rlalign.train.grpo  # noqa: F401  (imports torch, transformers, peft: part of the baseline)
    import rlalign.train.ppo  # noqa: F401
    import rlalign.train.sft  # noqa: F401

    rss_import = lb.current_rss_mb()
    path, records, reward_fn = setting(args.model, args.prompt)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # counted without allocating or reading any weight
        n_params = lb.count_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    base = parse_variant(variant)[0]
    if base == "ppo":
        out = run_ppo(variant, args, path, records)
    elif base == "sft":
        out = run_sft(variant, args, path)
    else:
        out = run_grpo(variant, args, path, records, reward_fn)
    return {"variant": variant, "rss_import_mb": rss_import, "peak_rss_mb": lb.peak_rss_mb(), "policy_params": n_params, **out}


def later_median(values: list[float]) -> float:
    """Median over the steps after the first (the first allocates AdamW's moments and warms caches); the only step if one."""
    return statistics.median(values[1:] or values)


def savings_table(results: list[dict]) -> None:
    """Per variant: baseline, peak, peak above baseline; for each -gc / -micro variant its saving against the plain one and its time ratios."""
    by_name = {r["variant"]: r for r in results}
    print("\n| variant | baseline RSS MB | peak RSS MB | peak - baseline MB | saving vs plain MB | saving % | step time / plain | step CPU time / plain | update time / plain | tokens trained | longest completion |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        above = r["peak_rss_mb"] - r["rss_import_mb"]
        base, gc, micro = parse_variant(r["variant"])
        plain = by_name.get(base) if (gc or micro) else None
        last = r["step_metrics"][-1] if r["step_metrics"] else {}
        cells = ["", "", "", "", ""]
        if plain is not None:
            plain_above = plain["peak_rss_mb"] - plain["rss_import_mb"]
            cells[0] = f"{plain_above - above:.0f}"
            cells[1] = f"{100 * (plain_above - above) / plain_above:.0f}%"
            cells[2] = f"{later_median(r['step_s']) / later_median(plain['step_s']):.2f}"
            cells[3] = f"{later_median(r['step_cpu_s']) / later_median(plain['step_cpu_s']):.2f}" if "step_cpu_s" in r and "step_cpu_s" in plain else ""
            upd, plain_upd = ([m["time/update"] for m in x["step_metrics"] if "time/update" in m] for x in (r, plain))
            cells[4] = f"{later_median(upd) / later_median(plain_upd):.2f}" if upd and plain_upd else ""
        longest = f"{last['completion_len/max']:.0f}" if "completion_len/max" in last else ""
        print(f"| {r['variant']} | {r['rss_import_mb']:.0f} | {r['peak_rss_mb']:.0f} | {above:.0f} | {' | '.join(cells)} | {last.get('tokens', 0):.0f} | {longest} |")
        if gc and not all(r["checkpointing"]):
            print(f"  WARNING: {r['variant']}: gradient checkpointing is not on in every trained model ({r['checkpointing']})", file=sys.stderr)
        if plain is not None and plain["step_metrics"] and r["step_metrics"] and plain["step_metrics"][-1].get("tokens") != last.get("tokens"):
            print(f"  note: {r['variant']} trained on {last.get('tokens')} tokens in its last step, {base} on {plain['step_metrics'][-1].get('tokens')}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--variants", nargs="+", type=variant_list, default=[list(DEFAULT_VARIANTS)],
                        help=f"space- or comma-separated, from: {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant; the second is the first with AdamW's moments allocated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", choices=["answer", "explain"], default="answer",
                        help="SmolLM2's prompts: 'answer' = the number only (short completions), 'explain' = step by step (most run to --new-tokens)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="micro_batch_size of the -micro variants")
    parser.add_argument("--sft-batch", type=int, default=16, help="SFT rows per step")
    parser.add_argument("--sft-length", type=int, default=128, help="SFT data.max_length: every row is cut to this many tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variants = [v for group in args.variants for v in group]
    if args.worker:
        chan = lb.Channel()
        chan.send(worker(args.worker, args))
        return 0

    path = setting(args.model, args.prompt)[0]  # build / convert the checkpoints once, outside the measured processes
    lb.reward_checkpoint(path)
    results = []
    for variant in args.variants:  # one at a time: a fresh process each, nothing else of ours running
        cmd = [sys.executable, __file__, "--worker", variant, "--model", args.model, "--steps", str(args.steps),
               "--new-tokens", str(args.new_tokens), "--prompt", args.prompt, "--micro-batch-size", str(args.micro_batch_size),
               "--sft-batch", str(args.sft_batch), "--sft-length", str(args.sft_length), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"{variant} failed ({proc.returncode})")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{variant}: peak {r['peak_rss_mb']:.0f} MB (after each step: {[round(m) for m in r['peak_after_step_mb']]}), "
              f"step(s) {[round(t, 1) for t in r['step_s']]} s, checkpointing {r['checkpointing']}, last step {r['step_metrics'][-1]}", file=sys.stderr)

    print(f"\nPeak RSS of one step, {args.model} ({results[0]['policy_params'] / 1e6:.1f}M parameters, float32: "
          f"W = {results[0]['policy_params'] * 4 / 2**20:.0f} MB per copy), RL: {args.new_tokens} new tokens ({args.prompt} prompts), "
          f"16 completions per update; SFT: {args.sft_batch} rows x {args.sft_length} tokens; -micro: {args.micro_batch_size} rows; "
          f"load {lb.machine_load()}, rlalign {lb.code_version()}\n")
    print("| variant | peak RSS MB | above imports MB | in W | seeds' estimate (weights) | weights + grads + AdamW, in W | trainable params |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for r in results:
        w = r["policy_params"] * 4 / 2**20
        base = parse_variant(r["variant"])[0]
        held, trained = HELD[base]
        full = held + 3 * trained
        above = r["peak_rss_mb"] - r["rss_import_mb"]
        print(f"| {r['variant']} | {r['peak_rss_mb']:.0f} | {above:.0f} | {above / w:.2f} | {SEEDS_ESTIMATE[base]} | "
              f"{full}{' + adapters' if base == 'grpo-lora' else ''} | {r['trainable_params'] / 1e6:.2f}M |")
    savings_table(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join([Path(sys.executable).name, *sys.argv]), "rlalign_commit": lb.code_version(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
