"""GRPO through the environment path on the look-up task, from an SFT start: success before and after.

    .venv/bin/python benchmarks/agent_learning.py --seeds 0 1 2                    # SFT 300 steps, GRPO 20 steps
    .venv/bin/python benchmarks/agent_learning.py --seeds 0 --sft-steps 1000 --grpo-steps 30
    .venv/bin/python benchmarks/agent_learning.py --seeds 0 1 2 --question value   # "What is the weight of the heavier ...?"

Per seed: a fresh tiny Llama (hidden 128, 2 layers) trained on SFT conversations of
:mod:`rlalign.tasks.lookup` (two look-ups then the answer in a share ``--tool-share``, a guess in
the rest; loss on the assistant turns; ``--question value`` asks for the winner's number, task
``lookup_value``, instead of its name), then GRPO with ``environment.class:
rlalign.tasks.lookup:LookupEnvironment`` and the exact-answer reward function. Reported: held-out
success (``--eval-questions`` eval questions, default 32, x 2 episodes, temperature 1), calls per episode and malformed calls, at
the SFT start and after GRPO. One torch thread.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from rlalign.agents.env_config import EnvironmentConfig
from rlalign.config import load_config
from rlalign.lm.data import load_prompts
from rlalign.lm.decode import SamplingParams
from rlalign.tasks import lookup as L
from rlalign.tasks.tiny_model import build_char_tokenizer, train_on_conversations
from rlalign.train import grpo
from rlalign.train.env_source import evaluate_episodes


class _ModelCfg:
    autocast = "none"


def success(model, tokenizer, records: list[dict]) -> dict[str, float]:
    metrics, _ = evaluate_episodes(model, tokenizer, load_prompts(records), [], L.LookupEnvironment, EnvironmentConfig(max_turns=3),
                                   SamplingParams(L.MAX_NEW_TOKENS, temperature=1.0), _ModelCfg(), num_samples=2, seed=1)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--tool-share", type=float, default=0.5)
    parser.add_argument("--grpo-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--question", choices=["which", "value", "single"], default="which",
                        help="which: answer a name; value: answer the winner's number; single: one item's number (one look-up)")
    parser.add_argument("--eval-questions", type=int, default=32)
    parser.add_argument("--sft-from", default=None, help="a directory holding sft<seed>/ of an earlier run (its --out): start from it, no SFT")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp(prefix="agent_learning_"))
    tokenizer = build_char_tokenizer()
    held_out = L.prompt_records("eval", args.eval_questions, seed=0, question_form=args.question)
    task = "lookup_value" if args.question == "value" else "lookup"
    for seed in args.seeds:
        t0 = time.perf_counter()
        path = Path(args.sft_from) / f"sft{seed}" if args.sft_from else out / f"sft{seed}"
        if args.sft_from:  # an SFT start saved by an earlier run (its --out), for more GRPO settings from one start
            from rlalign.lm.models import load_policy

            model = load_policy(path)
        else:
            records = L.sft_records("train", 3000, seed=seed, tool_share=args.tool_share, question_form=args.question)
            model = train_on_conversations(tokenizer, records, args.sft_steps, seed, args.sft_lr)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        start = success(model, tokenizer, held_out)
        t1 = time.perf_counter()
        cfg = load_config(grpo.GRPOConfig, None, {
            "model.path": str(path), "output_dir": str(out / f"grpo{seed}"), "data.task": task, "steps": args.grpo_steps, "prompts_per_step": 8,
            "group_size": 8, "sampling.max_new_tokens": L.MAX_NEW_TOKENS, "optim.lr": args.lr, "beta": 0.0, "progress": False, "plots": False,
            "overwrite": True, "seed": seed, "eval.enabled": False, "environment.class": "rlalign.tasks.lookup:LookupEnvironment", "environment.max_turns": 3,
        })
        prompts = L.prompt_records("train", 512, seed=seed + 1, question_form="single") if args.question == "single" else None  # no task of its own
        result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("correct", 1.0, L.reward)], prompts=prompts)
        end = success(result.policy.eval(), tokenizer, held_out)
        print(f"seed {seed}: success {start['eval/success']:.3f} -> {end['eval/success']:.3f}, calls per episode {start['eval/tool_calls']:.2f} -> "
              f"{end['eval/tool_calls']:.2f}, malformed {start['eval/malformed_calls']:.2f} -> {end['eval/malformed_calls']:.2f} "
              f"(SFT {t1 - t0:.0f} s, GRPO {time.perf_counter() - t1:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
