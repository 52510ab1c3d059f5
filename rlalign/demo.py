"""``rlalign demo``: the whole pipeline on a tiny model, offline, on a laptop CPU.

    tiny Llama --SFT on arithmetic--> SFT --GRPO (reward: exact answer)--> GRPO
    tiny Llama --SFT on words--> SFT --Bradley-Terry RM on hidden-rule preferences--> RM
                                 SFT --PPO (score: the RM, KL to SFT in the reward)--> PPO

Prints a before/after table (held-out arithmetic accuracy, hidden-rule score, KL to the SFT
model) and writes it to ``<output_dir>/summary.json``; each stage's run directory holds its
metrics.jsonl and curves.png; each stage, the final evaluation included, shows one progress bar.
Every stage is an ordinary trainer call with an ordinary config
(``rlalign.train.{sft,reward_model,grpo,ppo}.train``), so each can be rerun alone from its
``config.yaml`` in the run's checkpoint.

How the columns are measured, on prompts no stage trained on:
- accuracy: greedy completions of held-out arithmetic problems, exact answer;
- hidden score: the preference task's hidden rule (share of vowels) of completions sampled at
  temperature 1 for held-out word prompts: the ground truth the reward model only approximates;
- KL to SFT: sum over completion tokens of log pi(o_t) - log pi_SFT(o_t) for completions sampled
  from pi at temperature 1 (a Monte-Carlo estimate of KL(pi || pi_SFT) per sequence, nats).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field

from rlalign.config import Config, load_config
from rlalign.lm.encoding import encode_prompts, render_prompt
from rlalign.lm.logprobs import rollout_logprobs
from rlalign.lm.models import load_policy, load_reference, load_tokenizer
from rlalign.lm.rewards import score_completions
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.tasks import TASKS
from rlalign.train import grpo, ppo, reward_model, sft
from rlalign.train.common import greedy_eval

__all__ = ["DemoConfig", "evaluate_policy", "run_demo", "add_arguments", "run"]


class DemoConfig(Config):
    """Sizes and budgets of the demo; the defaults fit in 10 minutes on 2 CPU cores."""

    output_dir: str = Field("runs/demo", description="where every stage writes its run directory, and summary.json")
    seed: int = Field(0, description="seed of every stage")
    num_threads: int = Field(1, ge=1, description="torch CPU threads (1: tiny matrices gain little from more, and a busy second core makes 2 threads crawl)")
    hidden_size: int = Field(128, ge=8, description="tiny Llama width")
    num_layers: int = Field(4, ge=1, description="tiny Llama depth")
    sft_arithmetic_steps: int = Field(1000, ge=1, description="SFT steps on arithmetic (batch 64)")
    grpo_steps: int = Field(400, ge=1, description="GRPO steps (grpo_prompts_per_step prompts x 8 completions each)")
    grpo_prompts_per_step: int = Field(64, ge=1, description="GRPO prompts per step")
    sft_preference_steps: int = Field(200, ge=1, description="SFT steps on words with the natural vowel share")
    rm_steps: int = Field(300, ge=1, description="reward-model steps (batch 32 pairs)")
    ppo_steps: int = Field(60, ge=1, description="PPO steps (ppo_prompts_per_step prompts each)")
    ppo_prompts_per_step: int = Field(32, ge=2, multiple_of=2, description="PPO rollout size (even: PPO's 2 minibatches a step)")
    eval_prompts: int = Field(1000, ge=1, description="held-out prompts per evaluation")
    progress: bool = Field(True, description="progress bars of the stages")


@torch.no_grad()
def sequence_kl(policy, reference, tokenizer, prompts: list[str], max_new_tokens: int, seed: int) -> float:
    """Mean over prompts of sum_t log pi(o_t) - log pi_ref(o_t), o ~ pi at temperature 1 (nats)."""
    rollout = sample(
        policy, encode_prompts(tokenizer, prompts), SamplingParams(max_new_tokens, 1.0), tokenizer.pad_token_id, [tokenizer.eos_token_id],
        generator=torch.Generator().manual_seed(seed),
    )
    ref_logp = rollout_logprobs(reference, rollout)  # (B, C), 0 on padding
    return float(((rollout.logprobs - ref_logp) * rollout.completion_mask).sum(-1).mean())


@torch.no_grad()
def sampled_score(policy, tokenizer, prompts: list[str], reward_fn, max_new_tokens: int, seed: int) -> float:
    """Mean reward of completions sampled at temperature 1."""
    rollout = sample(
        policy, encode_prompts(tokenizer, prompts), SamplingParams(max_new_tokens, 1.0), tokenizer.pad_token_id, [tokenizer.eos_token_id],
        generator=torch.Generator().manual_seed(seed),
    )
    texts = [render_prompt(tokenizer, p) for p in prompts]
    return float(score_completions([reward_fn], texts, rollout.decode_completions(tokenizer)).nanmean())  # NaN where unscored


def evaluate_policy(path: Path, sft_path: Path, task_name: str, eval_prompts: int, seed: int) -> dict[str, float]:
    """accuracy (arithmetic, greedy) or hidden_score (preference, sampled), and KL to the SFT model."""
    task = TASKS[task_name]
    tokenizer = load_tokenizer(path)
    policy = load_policy(path).eval()
    reference = load_reference(sft_path)
    prompts = [r["prompt"] for r in task.prompt_records("eval", eval_prompts, seed)]
    if task_name == "arithmetic":
        score, _ = greedy_eval(policy, tokenizer, prompts, task.reward, task.max_new_tokens)
    else:
        score = sampled_score(policy, tokenizer, prompts, task.reward, task.max_new_tokens, seed)
    return {task.reward_name: score, "kl_to_sft": sequence_kl(policy, reference, tokenizer, prompts, task.max_new_tokens, seed)}


@dataclass
class DemoResult:
    rows: list[dict]  # one per model: stage, task, metric values
    summary_path: Path
    seconds: float


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the six stages and the evaluations; returns the table rows."""
    torch.set_num_threads(cfg.num_threads)
    out = Path(cfg.output_dir)
    started = time.perf_counter()
    tiny = {"model.tiny.hidden_size": cfg.hidden_size, "model.tiny.num_layers": cfg.num_layers, "model.tiny.intermediate_size": 2 * cfg.hidden_size}
    common = {"seed": cfg.seed, "progress": cfg.progress, "overwrite": True}  # every stage starts afresh
    timings: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        value = fn(*args, **kwargs)
        timings[name] = time.perf_counter() - t0
        return value

    # --- arithmetic: SFT, then GRPO with the exact-answer reward -------------------------------
    sft_arith = load_config(sft.SFTConfig, None, {
        **common, **tiny, "output_dir": str(out / "sft_arithmetic"), "data.task": "arithmetic", "max_steps": cfg.sft_arithmetic_steps,
        "eval_every": cfg.sft_arithmetic_steps, "optim.lr": 3e-3, "optim.warmup_steps": 20,
    })
    timed("sft_arithmetic", sft.train, sft_arith)
    sft_arith_path = out / "sft_arithmetic" / "final"
    grpo_cfg = load_config(grpo.GRPOConfig, None, {
        **common, "output_dir": str(out / "grpo_arithmetic"), "model.path": str(sft_arith_path), "data.task": "arithmetic",
        "data.num_prompts": 8192, "data.seed": cfg.seed, "rewards": [{"function": "arithmetic"}], "steps": cfg.grpo_steps,
        "prompts_per_step": cfg.grpo_prompts_per_step, "group_size": 8, "sampling.max_new_tokens": TASKS["arithmetic"].max_new_tokens,
        "sampling.temperature": 0.7, "optim.lr": 1e-4, "optim.warmup_steps": 5, "beta": 0.02, "save_every": 0,
    })
    timed("grpo", grpo.train, grpo_cfg)

    # --- preference: SFT on words, reward model on hidden-rule pairs, PPO against the RM -------
    sft_pref = load_config(sft.SFTConfig, None, {
        **common, **tiny, "output_dir": str(out / "sft_preference"), "data.task": "preference", "max_steps": cfg.sft_preference_steps,
        "eval_every": cfg.sft_preference_steps, "optim.lr": 3e-3, "optim.warmup_steps": 20,
    })
    timed("sft_preference", sft.train, sft_pref)
    sft_pref_path = out / "sft_preference" / "final"
    rm_cfg = load_config(reward_model.RMConfig, None, {
        **common, "output_dir": str(out / "rm_preference"), "model.path": str(sft_pref_path), "max_steps": cfg.rm_steps, "eval_every": cfg.rm_steps,
        "use_margin": False,  # the task's margins are its hidden rule's gaps: the demo's reward model learns the ranking alone
    })
    rm_metrics = timed("reward_model", reward_model.train, rm_cfg)
    ppo_cfg = load_config(ppo.PPOConfig, None, {
        **common, "output_dir": str(out / "ppo_preference"), "model.path": str(sft_pref_path), "data.task": "preference",
        "data.num_prompts": 2048, "rewards": [{"reward_model": str(out / "rm_preference" / "final"), "name": "rm"}],
        "critic.optim.lr": 1e-3, "steps": cfg.ppo_steps, "prompts_per_step": cfg.ppo_prompts_per_step, "ppo_epochs": 4, "num_minibatches": 2,
        "sampling.max_new_tokens": TASKS["preference"].max_new_tokens, "optim.lr": 3e-4, "missing_eos_penalty": 1.0,
        "kl_coef": 1.0, "kl_target": 4.0, "kl_horizon": 150.0,  # adaptive beta: the RM's scores span ~30, so the KL needs a firm hand
        "save_every": 0,
    })
    timed("ppo", ppo.train, ppo_cfg)

    # --- before / after -------------------------------------------------------------------------
    t0 = time.perf_counter()
    rows = []
    models = (
        ("SFT", "arithmetic", sft_arith_path, sft_arith_path),
        ("GRPO", "arithmetic", out / "grpo_arithmetic" / "final", sft_arith_path),
        ("SFT", "preference", sft_pref_path, sft_pref_path),
        ("PPO", "preference", out / "ppo_preference" / "final", sft_pref_path),
    )
    with _stage_bar("evaluation", len(models), cfg.progress) as advance:  # like each training stage, one bar
        for stage, task, path, sft_path in models:
            rows.append({"stage": stage, "task": task, **evaluate_policy(path, sft_path, task, cfg.eval_prompts, cfg.seed + 1)})
            advance()
    timings["evaluation"] = time.perf_counter() - t0
    seconds = time.perf_counter() - started
    summary = {
        "rows": rows,
        "reward_model": {k: rm_metrics[k] for k in ("eval/accuracy_initial", "eval/accuracy") if k in rm_metrics},
        "seconds": timings | {"total": seconds},
        "threads": cfg.num_threads,
        "config": cfg.model_dump(),
        "plots": [str(p) for p in sorted(out.glob("*/curves.png"))],
    }
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=1))
    return DemoResult(rows, summary_path, seconds)


@contextlib.contextmanager
def _stage_bar(description: str, total: int, show: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar of ``total`` items while the block runs (nothing when not ``show``); yields ``advance()``."""
    if not show:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


def format_table(rows: list[dict]) -> str:
    """The before/after table as text ('-' where a column does not apply)."""
    header = f"{'task':<11} {'model':<6} {'accuracy':>9} {'hidden score':>13} {'KL to SFT':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if "accuracy" in r else "-"
        hidden = f"{r['hidden_score']:.3f}" if "hidden_score" in r else "-"
        kl = 0.0 if abs(r["kl_to_sft"]) < 5e-4 else r["kl_to_sft"]  # no "-0.000" for the SFT rows (float round-off)
        lines.append(f"{r['task']:<11} {r['stage']:<6} {acc:>9} {hidden:>13} {kl:>10.3f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="optional YAML with DemoConfig fields")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. output_dir=runs/demo2 num_threads=4 grpo_steps=50")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(DemoConfig, args.config, args.overrides)
    result = run_demo(cfg)
    summary = json.loads(result.summary_path.read_text())
    print(format_table(result.rows))
    if "eval/accuracy" in summary["reward_model"]:
        print(f"reward model: held-out pair accuracy {summary['reward_model']['eval/accuracy']:.3f}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["seconds"].items()) + f" ({cfg.num_threads} thread(s))")
    print(f"summary.json and each stage's curves.png under {result.summary_path.parent}")
    return 0
