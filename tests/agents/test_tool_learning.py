"""Learning through the tools, on the environment path: GRPO raises the success rate on look-up
questions that only a look-up can answer, by calling the tool more.

The question asks for one item's value ("What is the weight of the brom?"): the answer is a number
from 1 to 99 that the policy can only copy from the ``lookup`` result (a guess is right about 1 time
in 99). The SFT start looks up in half of its demonstrations and guesses in the rest, so it calls the
tool about half the time; GRPO with :class:`rlalign.tasks.lookup.LookupEnvironment` must make it call
more and so answer right more often.

    RLALIGN_AGENT_SEEDS=0,1,2 .venv/bin/python -m pytest -p no:xdist -s tests/agents/test_tool_learning.py   # several seeds, printed
"""

from __future__ import annotations

import os

import pytest
import torch

from rlalign.agents.env_config import EnvironmentConfig
from rlalign.config import load_config
from rlalign.lm.data import load_prompts
from rlalign.lm.decode import SamplingParams
from rlalign.tasks import lookup as L
from rlalign.tasks.tiny_model import build_char_tokenizer, train_on_conversations
from rlalign.train import grpo
from rlalign.train.env_source import evaluate_episodes

torch.set_num_threads(1)


class _NoAutocast:
    autocast = "none"


def episodes(model, tokenizer, records: list[dict]) -> dict[str, float]:
    """Success rate and tool calls per episode on ``records``, 2 episodes each at temperature 1."""
    metrics, _ = evaluate_episodes(model.eval(), tokenizer, load_prompts(records), [], L.LookupEnvironment, EnvironmentConfig(max_turns=3),
                                   SamplingParams(L.MAX_NEW_TOKENS, temperature=1.0), _NoAutocast(), num_samples=2, seed=1)
    return metrics


def learn(tmp_path, seed: int) -> tuple[dict, dict]:
    """(metrics at the SFT start, after GRPO) of one run."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = train_on_conversations(tokenizer, L.sft_records("train", 3000, seed=seed, tool_share=0.5, question_form="single"), steps=500, seed=seed)
    model.save_pretrained(tmp_path / "sft")
    tokenizer.save_pretrained(tmp_path / "sft")
    held_out = L.prompt_records("eval", 48, seed=0, question_form="single")
    start = episodes(model, tokenizer, held_out)
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tmp_path / "sft"), "output_dir": str(tmp_path / "grpo"), "steps": 20, "prompts_per_step": 8, "group_size": 8,
        "sampling.max_new_tokens": L.MAX_NEW_TOKENS, "optim.lr": 3e-4, "beta": 0.0, "progress": False, "plots": False, "eval.enabled": False,
        "seed": seed, "environment.class": "rlalign.tasks.lookup:LookupEnvironment", "environment.max_turns": 3,
    })
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("correct", 1.0, L.reward)],
                        prompts=L.prompt_records("train", 512, seed=seed + 1, question_form="single"))
    return start, episodes(result.policy, tokenizer, held_out)


@pytest.mark.slow
def test_grpo_learns_to_look_up_what_it_cannot_guess(tmp_path):
    """Measured (48 held-out questions x 2 episodes; 500 SFT + 20 GRPO steps, about 2 minutes on an idle core):
    success 0.40 -> 0.66 (seed 0) while tool calls per episode rise 0.50 -> 1.00."""
    for seed in [int(s) for s in os.environ.get("RLALIGN_AGENT_SEEDS", "0").split(",")]:
        start, end = learn(tmp_path / f"seed{seed}", seed)
        print(f"seed {seed}: success {start['eval/success']:.3f} -> {end['eval/success']:.3f}, "
              f"tool calls per episode {start['eval/tool_calls']:.2f} -> {end['eval/tool_calls']:.2f}")
        assert 0.2 <= start["eval/tool_calls"] <= 0.8  # the start calls the tool only part of the time
        assert end["eval/tool_calls"] >= max(0.9, start["eval/tool_calls"] + 0.15)  # it learns to look up
        assert end["eval/success"] >= start["eval/success"] + 0.15
