"""Asynchronous rollouts against synchronous ones: the learner's steady-state steps per second, and learning.

    .venv/bin/python benchmarks/async_rollouts.py speed                  # the demo's GRPO task, rewards (a), (b), (c)
    .venv/bin/python benchmarks/async_rollouts.py speed --smollm2        # and SmolLM2-135M-Instruct (make bench-deps)
    .venv/bin/python benchmarks/async_rollouts.py learning --seeds 0 1 2 # k = 0, 1, 2 on the demo's GRPO task
    .venv/bin/python benchmarks/async_rollouts.py ranks --producers 1 2 3 # 1 learner + P producer ranks (torchrun, gloo)
    python benchmarks/async_rollouts.py ranks --device cuda --shape llama-1b --prompts 8 --producers 1   # one GPU, learner + producer

speed: each case runs GRPO from the same start, one run after the other in one script run:
synchronous with 2 torch threads (``--sync-threads``) (sampling, scoring and learning in turn), and asynchronous with
``async_rollouts.max_staleness`` k for each ``--staleness`` (default 1 and 2), one producer thread and
one learner thread. Reported: the
mean seconds per step after the first ``--warmup`` steps (steps over their total time: the
steady-state throughput), the ratio of steps per second, and for the asynchronous run the learner's
mean wait for a batch (``time/queue_wait``). The rewards:
(a) the built-in exact-answer reward; (b) the same plus a term that waits 1 s per batch (a
stand-in for a sandbox, a judge or a remote server); (c) the code-execution reward (every
completion run in its own bubblewrap sandbox against a two-assert test). "hidden" is the share of
(b)'s wait that the asynchronous run no longer pays: 1 - (async (b) - async (a)) / (sync (b) - sync (a)).

learning: the demo's arithmetic GRPO stage (one SFT start, 64 prompts x 8, temperature 0.7) at k = 0
(synchronous), 1 and 2 (decoupled objective, ``tis_cap: 2``), for each GRPO seed; reported: the held-out
reward before and after (the trainer's ``eval/reward/mean``: greedy exact answers, or with ``--reward
length`` TRL's quick-start reward -|20 - len| over up to 24 new tokens), per k, mean and spread over
seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlalign.config import load_config
from rlalign.demo import DemoConfig, evaluate_policy
from rlalign.tasks import TASKS
from rlalign.train import grpo, sft


def length_reward(completions, **kwargs):
    """TRL's quick-start reward, -|20 - len(completion)|: dense, so a few steps show learning."""
    return [-abs(20 - len(c)) for c in completions]


def wait_one_second(completions, **kwargs):
    """(b): a reward term that waits 1 s per batch and scores nothing."""
    time.sleep(1.0)
    return [0.0] * len(completions)


def sft_start(out: Path, steps: int, seed: int) -> Path:
    demo = DemoConfig()
    tiny = {"model.tiny.hidden_size": demo.hidden_size, "model.tiny.num_layers": demo.num_layers, "model.tiny.intermediate_size": 2 * demo.hidden_size}
    path = out / f"sft_{seed}"
    if not (path / "final").is_dir():
        sft.train(load_config(sft.SFTConfig, None, {
            **tiny, "seed": seed, "progress": False, "overwrite": True, "output_dir": str(path), "data.task": "arithmetic", "max_steps": steps,
            "eval_every": steps, "optim.lr": 3e-3, "optim.warmup_steps": 20,
        }))
    return path / "final"


def demo_grpo(model: Path, out: Path, steps: int, seed: int, **overrides) -> dict:
    """The demo's GRPO stage (rlalign.demo.run_demo), shortened to ``steps``."""
    return {
        "model.path": str(model), "output_dir": str(out), "data.task": "arithmetic", "data.num_prompts": 8192, "data.seed": seed, "seed": seed,
        "rewards": [{"function": "arithmetic"}], "steps": steps, "prompts_per_step": 64, "group_size": 8,
        "sampling.max_new_tokens": TASKS["arithmetic"].max_new_tokens, "sampling.temperature": 0.7, "optim.lr": 1e-4, "optim.warmup_steps": 5,
        "beta": 0.02, "save_every": 0, "progress": False, "overwrite": True, "plots": False, "eval.every": 0, **overrides,
    }


def code_prompts(n: int) -> list[dict]:
    """Arithmetic prompts with a two-assert test, for (c): the sandbox runs every completion."""
    records = TASKS["arithmetic"].prompt_records("train", n, 0)
    return [{**r, "tests": "assert f(2) == 4\nassert f(3) == 9"} for r in records]


def timed_run(base: dict, k: int | None, warmup: int, reward_functions=(), prompts=None, sync_threads: int = 2) -> dict:
    """Seconds per step of one run: synchronous (``k`` None, ``sync_threads`` torch threads) or asynchronous
    with max_staleness ``k`` (one learner thread, one producer thread)."""
    options = {"async_rollouts.enabled": True, "async_rollouts.max_staleness": k, "tis_cap": 2.0} if k is not None else {}
    torch.set_num_threads(sync_threads)  # the asynchronous run sets its own
    cfg = load_config(grpo.GRPOConfig, None, {**base, **options})
    history = grpo.train(cfg, reward_functions=list(reward_functions), prompts=prompts).history
    steady = history[warmup:]
    seconds = [row["time/rollout"] + row["time/train"] for row in steady]  # the learner's wall time of each step
    wait = [row.get("time/queue_wait", 0.0) for row in steady]
    # steady-state throughput: steps over their total time (an asynchronous learner's steps come in bursts when the
    # producer hands over several at once, so a median step would flatter it)
    return {"step_s": sum(seconds) / len(seconds), "queue_wait_s": sum(wait) / len(wait), "generate_s": statistics.median(r["time/generate"] for r in steady)}


def speed(args) -> None:
    out = Path(args.out or tempfile.mkdtemp(prefix="async_rollouts_"))
    steps = args.warmup + args.steps
    cases = []
    if not args.smollm2_only:
        model = sft_start(out, args.sft_steps, 0)
        base = demo_grpo(model, out / "run", steps, 0, **{"prompts_per_step": args.prompts, "group_size": 8})
        cases += [
            ("demo GRPO task, (a) built-in reward", base, (), None),
            ("demo GRPO task, (b) + a reward that waits 1 s", base, (wait_one_second,), None),
            ("demo GRPO task, (c) code-execution reward", {**base, "rewards": [{"function": "code_execution"}]},
             (), code_prompts(512)),
        ]
    if args.smollm2 or args.smollm2_only:
        from _lm_bench import smollm2_checkpoint  # benchmarks/ is on the path when this script runs

        path = smollm2_checkpoint()
        for tokens in args.smollm2_tokens:
            base = {
                "model.path": str(path), "output_dir": str(out / "smol"), "data.task": "arithmetic", "data.num_prompts": 512,
                "rewards": [{"function": "arithmetic"}], "steps": steps, "prompts_per_step": 2, "group_size": 8, "sampling.max_new_tokens": tokens,
                "optim.lr": 1e-6, "beta": 0.0, "save_every": 0, "progress": False, "overwrite": True, "plots": False, "eval.enabled": False,
            }
            cases.append((f"SmolLM2-135M-Instruct, 2 x 8 x {tokens}, (a) built-in reward", base, (), None))
            cases.append((f"SmolLM2-135M-Instruct, 2 x 8 x {tokens}, (b) + a reward that waits 1 s", base, (wait_one_second,), None))
    cases = [case for case in cases if any(f"({letter})" in case[0] for letter in args.rewards)]
    rows = []
    for name, base, rewards, prompts in cases:
        sync = timed_run(base, None, args.warmup, rewards, prompts, args.sync_threads)
        for k in args.staleness:
            asynchronous = timed_run(base, k, args.warmup, rewards, prompts)
            row = {
                "case": name, "k": k, "sync_step_s": sync["step_s"], "async_step_s": asynchronous["step_s"], "speedup": sync["step_s"] / asynchronous["step_s"],
                "async_queue_wait_s": asynchronous["queue_wait_s"], "sync_generate_s": sync["generate_s"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    # (b)'s wait costs each mode (its step time with the wait - without it); hidden = 1 - async cost / sync cost
    plain = {(r["case"].split(", (")[0], r["k"]): r for r in rows if "(a)" in r["case"]}
    for r in rows:
        base = plain.get((r["case"].split(", (")[0], r["k"]))
        if "(b)" in r["case"] and base is not None:
            r["hidden"] = 1.0 - (r["async_step_s"] - base["async_step_s"]) / (r["sync_step_s"] - base["sync_step_s"])
    print("\n| case | k | sync s/step | async s/step | async/sync steps/s | learner's wait (async) | share of the 1 s wait hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hidden = f"{r['hidden']:.0%}" if "hidden" in r else "-"
        print(f"| {r['case']} | {r['k']} | {r['sync_step_s']:.3f} | {r['async_step_s']:.3f} | {r['speedup']:.2f}x | {r['async_queue_wait_s']:.3f} | {hidden} |")


def ranks(args) -> None:
    """Producer ranks: the demo's GRPO task under torchrun with 1 learner and P producer ranks (gloo),
    ``async_rollouts.max_staleness`` = P (P producers make P steps at once only when k >= P - 1),
    against the synchronous one-process run, one run after the other. Reported: the learner's seconds
    per step after the warm-up (steps over their total time), the ratio of steps per second, and the
    model of RESULTS.md ("Producers and learners as ranks") from each rank run's measured generate +
    score (g, as the producers measured it), the learner's own work (u) and weight-sync (w) times."""
    import os
    import subprocess
    import sys

    out = Path(args.out or tempfile.mkdtemp(prefix="async_ranks_"))
    steps = args.warmup + args.steps
    rewards = [{"function": "arithmetic"}] + ([{"function": "async_rollouts:wait_one_second"}] if args.wait else [])
    if args.shape is None:  # the demo's model and task
        model = sft_start(out, args.sft_steps, 0)
        base = demo_grpo(model, out / "sync", steps, 0, **{"prompts_per_step": args.prompts, "group_size": 8, "rewards": rewards, "num_threads": 1})
    else:  # a random-weight Llama of that shape, as grpo_vs_trl.py's rlalign-bf16-copy-graphs side runs it
        from _lm_bench import random_checkpoint  # benchmarks/ is on the path when this script runs

        base = demo_grpo(random_checkpoint(args.shape), out / "sync", steps, 0, **{
            "prompts_per_step": args.prompts, "group_size": 8, "rewards": rewards, "sampling.max_new_tokens": args.new_tokens,
            "model.device": args.device, "model.autocast": "bfloat16", "sampling.dtype": "bfloat16", "sampling.compile": True,
            "sampling.cuda_graphs": args.device == "cuda", "optim.lr": 1e-6,
        })
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}

    def learner_steps(run_dir: Path) -> tuple[float, dict[str, float]]:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in rows if r["step"] >= args.warmup]
        mean = {key: statistics.mean(r.get(key, 0.0) for r in steady) for key in ("time/generate", "time/score", "time/update", "time/reference",
                                                                                   "time/old_logp", "time/weight_sync", "time/queue_wait")}
        return statistics.mean(r["time/rollout"] + r["time/train"] for r in steady), mean

    def launch(processes: int, overrides: dict, run_dir: Path) -> None:
        argv = [f"{key}={json.dumps(value)}" for key, value in {**base, **overrides, "output_dir": str(run_dir)}.items()]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m", "rlalign", "grpo", *argv]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-6000:]}")

    launch(1, {}, out / "sync")
    sync_s, sync_t = learner_steps(out / "sync")
    g = sync_t["time/generate"] + sync_t["time/score"]  # one process making a whole step
    print(json.dumps({"case": "sync", "step_s": sync_s, **sync_t}), flush=True)
    rows = []
    for p in args.producers:
        k = p
        launch(1 + p, {"async_rollouts.enabled": True, "async_rollouts.producers": p, "async_rollouts.max_staleness": k, "tis_cap": 2.0}, out / f"p{p}")
        step_s, t = learner_steps(out / f"p{p}")
        u = step_s - t["time/queue_wait"] - t["time/weight_sync"]  # the learner's own work a step
        w, gp = t["time/weight_sync"], t["time/generate"] + t["time/score"]  # gp: a step's generate + score as the producers measured it
        model_s = max(gp / p, u + w, (u + w + gp) / (k + 1))  # 1 learner: the producers' capacity, the learner's, or the staleness window
        rows.append({"producers": p, "k": k, "step_s": step_s, "speedup": sync_s / step_s, "model_step_s": model_s, "g": g, "gp": gp, "u": u, **t})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nsynchronous, one process: {sync_s:.3f} s a step (generate + score {g:.3f} s)")
    print("| learner + producers | k | s/step | async/sync steps/s | learner's wait | weight sync (w) | learner's work (u) | producer's g | "
          "model: max(g/P, u + w, (u + w + g)/(k + 1)) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| 1 + {r['producers']} | {r['k']} | {r['step_s']:.3f} | {r['speedup']:.2f}x | {r['time/queue_wait']:.3f} | {r['time/weight_sync']:.4f} | "
              f"{r['u']:.3f} | {r['gp']:.3f} | {r['model_step_s']:.3f} |")


def learning(args) -> None:
    out = Path(args.out or tempfile.mkdtemp(prefix="async_learning_"))
    results: dict[int, list[dict]] = {}
    model = sft_start(out, args.sft_steps, 0)  # one SFT start; the seeds vary the GRPO runs (prompts, sampling)
    before = held_out(args, model, model)
    print(json.dumps({"sft_start": str(model), **before}), flush=True)
    for seed in args.seeds:
        for k in args.staleness:
            options = {"async_rollouts.enabled": True, "async_rollouts.max_staleness": k, "tis_cap": 2.0} if k > 0 else {}
            overrides = {"eval.every": args.steps, "optim.lr": args.lr, **options}
            if args.reward == "length":
                overrides.update({"rewards": [], "sampling.max_new_tokens": 24})
            cfg = load_config(grpo.GRPOConfig, None, demo_grpo(model, out / f"grpo_{seed}_{k}", args.steps, seed, **overrides))
            torch.set_num_threads(1)
            history = grpo.train(cfg, reward_functions=[length_reward] if args.reward == "length" else []).history
            records = [json.loads(line) for line in (out / f"grpo_{seed}_{k}" / "metrics.jsonl").read_text().splitlines()]
            evals = [r["eval/reward/mean"] for r in records if "eval/reward/mean" in r]
            row = {"seed": seed, "k": k, "eval_before": evals[0], "eval_after": evals[-1], "train_reward_last5": statistics.mean(r["reward/mean"] for r in history[-5:])}
            row.update({f"{name}_after": value for name, value in held_out(args, out / f"grpo_{seed}_{k}" / "final", model).items()})
            results.setdefault(k, []).append(row)
            print(json.dumps(row), flush=True)
    metric = "accuracy" if args.reward == "arithmetic" and args.eval_prompts else "eval"
    print(f"\nheld-out {metric} before: " + (f"{before['accuracy']:.3f} ({args.eval_prompts} prompts, greedy)" if metric == "accuracy" else "per run"))
    print(f"| k | {metric} after, mean ± spread (population std) | per seed | KL to the SFT start (nats/seq), per seed | training reward, last 5 steps |")
    print("|---:|---:|---|---|---|")
    for k, rows in results.items():
        after = [r["accuracy_after"] if metric == "accuracy" else r["eval_after"] for r in rows]
        kl = ", ".join(f"{r['kl_to_sft_after']:.2f}" for r in rows) if metric == "accuracy" else "-"
        per_seed = ", ".join(f"{a:.3f}" for a in after)
        train = ", ".join(f"{r['train_reward_last5']:.3f}" for r in rows)
        print(f"| {k} | {statistics.mean(after):.3f} ± {statistics.pstdev(after):.3f} | {per_seed} | {kl} | {train} |")


def held_out(args, path: Path, sft_path: Path) -> dict[str, float]:
    """The demo's own evaluation (rlalign.demo.evaluate_policy): greedy exact-answer accuracy on
    ``--eval-prompts`` held-out problems and the KL to the SFT start; nothing for the length reward."""
    if args.reward != "arithmetic" or not args.eval_prompts:
        return {}
    return evaluate_policy(path, sft_path, "arithmetic", args.eval_prompts, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--steps", type=int, default=8, help="timed steps per run, after the warm-up")
    s.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    s.add_argument("--prompts", type=int, default=64, help="prompts per step on the demo task (x 8 completions)")
    s.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the demo model's start")
    s.add_argument("--staleness", type=int, nargs="+", default=[1, 2], help="the asynchronous runs' max_staleness values")
    s.add_argument("--sync-threads", type=int, default=2, help="torch threads of the synchronous run (the asynchronous: 1 + 1)")
    s.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct (needs make bench-deps)")
    s.add_argument("--smollm2-only", action="store_true", help="only SmolLM2-135M-Instruct")
    s.add_argument("--smollm2-tokens", type=int, nargs="+", default=[32, 128], help="SmolLM2's new tokens per completion, one case each")
    s.add_argument("--rewards", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"], help="which of the reward cases to run")
    s.add_argument("--out", default=None)
    s.set_defaults(run=speed)
    r = sub.add_parser("ranks")
    r.add_argument("--producers", type=int, nargs="+", default=[1, 2, 3], help="producer ranks beside one learner, one run each")
    r.add_argument("--steps", type=int, default=8, help="timed steps per run, after the warm-up")
    r.add_argument("--warmup", type=int, default=2, help="steps left out")
    r.add_argument("--prompts", type=int, default=64, help="prompts per step on the demo task (x 8 completions)")
    r.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the demo model's start")
    r.add_argument("--wait", action="store_true", help="add reward (b): a term that waits 1 s per batch")
    r.add_argument("--shape", choices=["smollm2", "llama-1b"], default=None, help="a random-weight Llama of this shape instead of the demo's model")
    r.add_argument("--device", default="cpu", help="model.device (cuda: every rank on the GPU of its local rank mod the GPUs)")
    r.add_argument("--new-tokens", type=int, default=256, help="new tokens per completion with --shape")
    r.add_argument("--out", default=None)
    r.set_defaults(run=ranks)
    le = sub.add_parser("learning")
    le.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    le.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    le.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    le.add_argument("--reward", choices=["arithmetic", "length"], default="arithmetic", help="the demo's exact-answer reward, or TRL's quick-start length reward")
    le.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate (the demo: 1e-4)")
    le.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the start (the demo: 1000)")
    le.add_argument("--eval-prompts", type=int, default=1000, help="held-out problems of the final greedy evaluation (the demo's 1000; 0: only the trainer's)")
    le.add_argument("--out", default=None)
    le.set_defaults(run=learning)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
