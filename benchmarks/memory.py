"""Peak memory of one PPO step against one GRPO step on the same model, each in its own process.

    .venv/bin/python benchmarks/memory.py --model smollm2 --out runs/bench/memory_smollm2.json
    .venv/bin/python benchmarks/memory.py --model tiny          # seconds; a check of the harness

Variants (``--variants``), each run for ``--steps`` steps (default 2) in a fresh subprocess. One
step is not enough: AdamW's two moments are allocated by the first ``optimizer.step``, after the
first backward, so only from the second step on does a backward run with weights, moments,
gradients and activations all alive, and the peak after one step understates a run's:

    grpo        policy + frozen reference, rule reward                        (rlalign.train.grpo)
    grpo-rm     policy + frozen reference + reward model (the seeds' GRPO)
    grpo-lora   LoRA policy (r 16, all linear layers); reference = the same weights with adapters
                disabled (peft ``disable_adapter``), no second copy; rule reward
    ppo         policy + frozen reference + reward model + critic, each with its own AdamW
                (rlalign.train.ppo)

Same model, same rows per update: GRPO 2 prompts x G = 8 = 16 completions; PPO 16 prompts x 1
completion, 1 epoch, 1 minibatch; 32 new tokens (``--new-tokens``); float32; KL coefficient 0.04.
The reward model and critic are SmolLM2's backbone with a fresh scalar head (no reward-model
training is needed for a memory measurement).

Measured per variant: RSS after imports (the baseline: Python, torch, transformers), and peak
RSS (``VmHWM``, ``_lm_bench.peak_rss_mb``) after the step(s). transformers maps the safetensors weights from the
file; RSS counts every resident mapped page, so each loaded copy counts once it has been read.
Reported next to the seeds' estimate (weights only: PPO ~4x the policy, GRPO ~3x with a reward
model, 2x without) and the full count: W = parameters x 4 bytes per model held, plus gradient and
two AdamW moments (3 W) per trained model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

VARIANTS = ("grpo", "grpo-rm", "grpo-lora", "ppo")
# models held and trained, in units of the policy's weights (seeds' estimate = held; full = held + 3 x trained)
HELD = {"grpo": (2, 1), "grpo-rm": (3, 1), "grpo-lora": (1, 0), "ppo": (4, 2)}
SEEDS_ESTIMATE = {"grpo": "2x (policy, reference)", "grpo-rm": "~3x", "grpo-lora": "1x", "ppo": "~4x"}


def setting(model: str):
    if model == "tiny":
        from rlalign.tasks import TASKS

        return lb.tiny_checkpoint(), TASKS["arithmetic"].prompt_records("train", 256, 0), lb.arithmetic_reward
    return lb.smollm2_checkpoint(), lb.chat_arithmetic_records(256, 0), lb.chat_arithmetic_reward


def run_grpo(variant: str, args, path: Path, records, reward_fn) -> dict:
    from rlalign.train.grpo import GRPOConfig

    lora = {"r": 16, "alpha": 32.0, "target_modules": "all-linear"} if variant == "grpo-lora" else None
    rewards_cfg = [{"reward_model": str(path), "name": "rm"}] if variant == "grpo-rm" else []
    cfg = GRPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_mem_"), seed=0, num_threads=args.threads,
            model=dict(path=str(path), lora=lora), rewards=rewards_cfg, sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7),
            optim=dict(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0), steps=args.steps, prompts_per_step=2, group_size=8, beta=0.04,
            progress=False, plots=False,
        )
    )
    # grpo.train()'s setup without its outer loop, whose checkpoint and final-model writing would add to the peak
    setup = lb.GRPOSetup(cfg, records, None if variant == "grpo-rm" else reward_fn)  # LoRA: no reference copy, the base with adapters off
    return measure_steps(setup, [setup.policy], args.steps)


def run_ppo(args, path: Path, records, reward_fn) -> dict:
    from rlalign.train.ppo import PPOConfig

    cfg = PPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_mem_"), seed=0, num_threads=args.threads, model=dict(path=str(path)),
            rewards=[{"reward_model": str(path), "name": "rm"}], sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7),
            optim=dict(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0), steps=args.steps, prompts_per_step=16, ppo_epochs=1, num_minibatches=1,
            kl_coef=0.04, kl_target=None, progress=False, plots=False,
        )
    )
    setup = lb.PPOSetup(cfg, records)  # ppo.train()'s setup; the critic starts from the reward model's backbone (here: the base)
    return measure_steps(setup, [setup.policy, setup.critic], args.steps)


def measure_steps(setup, trained, steps: int) -> dict:
    info = {"trainable_params": sum(p.numel() for m in trained for p in m.parameters() if p.requires_grad), "rss_loaded_mb": lb.current_rss_mb()}
    times, peaks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        setup.step()
        times.append(time.perf_counter() - t0)
        peaks.append(lb.peak_rss_mb())
    return {**info, "step_s": times, "peak_after_step_mb": peaks}


def worker(variant: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import rlalign.train.grpo  # noqa: F401  (imports torch, transformers, peft: part of the baseline)
    import rlalign.train.ppo  # noqa: F401

    rss_import = lb.current_rss_mb()
    path, records, reward_fn = setting(args.model)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # counted without allocating or reading any weight
        n_params = lb.count_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    out = run_ppo(args, path, records, reward_fn) if variant == "ppo" else run_grpo(variant, args, path, records, reward_fn)
    return {"variant": variant, "rss_import_mb": rss_import, "peak_rss_mb": lb.peak_rss_mb(), "policy_params": n_params, **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=2, help="steps per variant; the second is the first with AdamW's moments allocated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        chan = lb.Channel()
        chan.send(worker(args.worker, args))
        return 0

    setting(args.model)  # build / convert the checkpoint once, outside the measured processes
    results = []
    for variant in args.variants:  # one at a time: a fresh process each, nothing else of ours running
        cmd = [sys.executable, __file__, "--worker", variant, "--model", args.model, "--steps", str(args.steps),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"{variant} failed ({proc.returncode})")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{variant}: peak {r['peak_rss_mb']:.0f} MB (after each step: {[round(m) for m in r['peak_after_step_mb']]}), "
              f"step(s) {[round(t, 1) for t in r['step_s']]} s", file=sys.stderr)

    print(f"\nPeak RSS of one step, {args.model} ({results[0]['policy_params'] / 1e6:.1f}M parameters, float32: "
          f"W = {results[0]['policy_params'] * 4 / 2**20:.0f} MB per copy), {args.new_tokens} new tokens, 16 completions per update, "
          f"load {lb.machine_load()}, rlalign {lb.code_version()}\n")
    print("| variant | peak RSS MB | above imports MB | in W | seeds' estimate (weights) | weights + grads + AdamW, in W | trainable params |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for r in results:
        w = r["policy_params"] * 4 / 2**20
        held, trained = HELD[r["variant"]]
        full = held + 3 * trained
        above = r["peak_rss_mb"] - r["rss_import_mb"]
        print(f"| {r['variant']} | {r['peak_rss_mb']:.0f} | {above:.0f} | {above / w:.2f} | {SEEDS_ESTIMATE[r['variant']]} | "
              f"{full}{' + adapters' if r['variant'] == 'grpo-lora' else ''} | {r['trainable_params'] / 1e6:.2f}M |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join([Path(sys.executable).name, *sys.argv]), "rlalign_commit": lb.code_version(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
