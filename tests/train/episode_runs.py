"""The runs of tests/train/test_episodes_under_torchrun.py: tools, an environment and an agent.

    torchrun --standalone --nproc-per-node 2 tests/train/episode_runs.py OUT TINY_MODEL 0 NAME...   (2 learners)
    torchrun --standalone --nproc-per-node 3 tests/train/episode_runs.py OUT TINY_MODEL 1 NAME...   (2 learners + 1 producer rank)
    python tests/train/episode_runs.py OUT TINY_MODEL 0 NAME...                                   (one process)

NAME: tools (multi-turn calculator calls, tag format), environment (the lookup task's Python
environment), agent (an ``openai``-client agent making one or two calls an episode). Each run is
GRPO for two steps on the lookup task's prompts, in ``OUT/NAME``.
"""

from __future__ import annotations

import sys

import torch

from rlalign.config import load_config
from rlalign.tasks import lookup as lk
from rlalign.train import grpo
from rlalign.train.distributed import exit_process


def correct(prompts: list, completions: list, answer: list, **columns) -> list[float]:
    """The lookup task's exact-answer reward, plus a hundredth per character (the episodes of a group differ)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [r + 0.01 * len(t) for r, t in zip(lk.reward(prompts, texts, answer), texts)]


SETUPS = {
    "tools": {"tools.enabled": ["calculator"], "tools.format": "tag", "tools.max_turns": 2},
    "environment": {"environment.class": "rlalign.tasks.lookup:LookupEnvironment", "environment.max_turns": 2},
    "agent": {"agent.function": "tests.train.test_agent_source:two_call_agent", "agent.timeout_s": 60},
}


def run(out: str, tiny: str, producers: int, name: str) -> None:
    options = {
        "model.path": tiny, "output_dir": f"{out}/{name}", "steps": 2, "prompts_per_step": 4, "group_size": 2, "sampling.max_new_tokens": 8,
        "optim.lr": 3e-3, "beta": 0.1, "progress": False, "plots": False, "eval.enabled": False, "num_threads": 1, "num_minibatches": 2, **SETUPS[name],
    }
    if producers:
        options.update({"async_rollouts.enabled": True, "async_rollouts.max_staleness": 0, "async_rollouts.producers": producers})
    prompts = lk.prompt_records("train", 32, seed=1, question_form="single") if name != "agent" else lk.prompt_records("train", 32, seed=1)
    grpo.train(load_config(grpo.GRPOConfig, None, options), reward_functions=[grpo.RewardTerm("correct", 1.0, correct)], prompts=prompts)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[4:]:
        run(sys.argv[1], sys.argv[2], int(sys.argv[3]), name)
    exit_process(0)  # as the program ends a rank
