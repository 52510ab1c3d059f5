"""The extra cost per step of DAPO dynamic sampling on the demo's GRPO task.

    .venv/bin/python benchmarks/dynamic_sampling.py                 # SFT the demo's tiny model, then GRPO with and without
    .venv/bin/python benchmarks/dynamic_sampling.py --steps 30 --sft-steps 1000

The demo's arithmetic GRPO stage (tiny model, 64 prompts x 8 completions, temperature 0.7, the
exact-answer reward) from an SFT start, run twice from the same start in one process: plain, and
with ``dynamic_sampling: true``. Reported: the median step time of each (steps after the first),
their ratio, the mean number of draws per step and the share of drawn groups whose rewards all
tie (those dynamic sampling drops), and the mean reward of each run's last steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rlalign.config import load_config
from rlalign.demo import DemoConfig
from rlalign.tasks import TASKS
from rlalign.train import grpo, sft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    parser.add_argument("--sft-steps", type=int, default=600, help="SFT steps before GRPO (the demo: 1000)")
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args()
    demo = DemoConfig()
    torch.set_num_threads(demo.num_threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="dynamic_sampling_"))
    tiny = {"model.tiny.hidden_size": demo.hidden_size, "model.tiny.num_layers": demo.num_layers, "model.tiny.intermediate_size": 2 * demo.hidden_size}
    common = {"seed": demo.seed, "progress": False, "overwrite": True, "plots": False}
    sft.train(load_config(sft.SFTConfig, None, {
        **common, **tiny, "output_dir": str(out / "sft"), "data.task": "arithmetic", "max_steps": args.sft_steps, "eval_every": args.sft_steps,
        "optim.lr": 3e-3, "optim.warmup_steps": 20,
    }))
    results = {}
    for name, dynamic in (("plain", False), ("dynamic", True)):
        cfg = load_config(grpo.GRPOConfig, None, {
            **common, "output_dir": str(out / name), "model.path": str(out / "sft" / "final"), "data.task": "arithmetic", "data.num_prompts": 8192,
            "data.seed": demo.seed, "rewards": [{"function": "arithmetic"}], "steps": args.steps, "prompts_per_step": demo.grpo_prompts_per_step,
            "group_size": 8, "sampling.max_new_tokens": TASKS["arithmetic"].max_new_tokens, "sampling.temperature": 0.7, "optim.lr": 1e-4,
            "optim.warmup_steps": 5, "beta": 0.02, "save_every": 0, "eval.enabled": False, "dynamic_sampling": dynamic,
        })
        history = grpo.train(cfg).history
        step_times = [h["time/generate"] + h["time/score"] + h["time/train"] for h in history[1:]]
        results[name] = {
            "median_step_s": statistics.median(step_times),
            "reward_last5": statistics.mean(h["reward/mean"] for h in history[-5:]),
            "frac_zero_std_groups_first_draw": statistics.mean(h["frac_zero_std_groups"] for h in history) if not dynamic else None,
        }
        if dynamic:
            drawn = sum(h["dynamic/prompts_drawn"] for h in history)
            results[name].update({
                "draws_per_step": statistics.mean(h["dynamic/draws"] for h in history),
                "tied_share_of_drawn": sum(h["dynamic/tied_groups"] for h in history) / drawn,
                "filled_groups_per_step": statistics.mean(h["dynamic/filled_groups"] for h in history),
            })
    results["step_time_ratio"] = results["dynamic"]["median_step_s"] / results["plain"]["median_step_s"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
