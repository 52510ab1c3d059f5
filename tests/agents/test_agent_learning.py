"""Learning through the OpenAI-compatible endpoint: an agent written against the ``openai`` client
(ask, run the lookup tool calls itself, ask again) is trained by GRPO on the embedded look-up task
from an SFT start that calls the tool half the time; its success rate must rise.

    RLALIGN_AGENT_SEEDS=0,1,2 .venv/bin/python -m pytest -p no:xdist -s tests/agents/test_agent_learning.py   # several seeds, printed
    RLALIGN_AGENT_FORM=single RLALIGN_AGENT_SEEDS=0,1,2 .venv/bin/python -m pytest -p no:xdist -s tests/agents/test_agent_learning.py
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from rlalign.agents.openai_server import PolicyServer, model_generate  # noqa: E402
from rlalign.config import load_config  # noqa: E402
from rlalign.lm.encoding import completion_text  # noqa: E402
from rlalign.tasks import lookup as lk  # noqa: E402
from rlalign.tasks.tiny_model import build_char_tokenizer, train_on_conversations  # noqa: E402
from rlalign.train import grpo  # noqa: E402
from tests.train.test_agent_source import lookup_agent  # noqa: E402

torch.set_num_threads(1)


def agent_success(model, tokenizer, records: list[dict], samples: int = 2, seed: int = 1) -> tuple[float, float]:
    """(success rate, calls per episode) of ``lookup_agent`` against ``model`` served at temperature 1."""
    with PolicyServer(tokenizer, model_generate(model.eval(), tokenizer), max_new_tokens=lk.MAX_NEW_TOKENS, seed=seed, max_calls=3) as server:
        ids = [f"eval-{i}-{j}" for i in range(len(records)) for j in range(samples)]
        for e in ids:
            server.open_episode(e)
        with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda e: lookup_agent(server.url(e), records[int(e.split("-")[1])]), ids))
        calls = [len(server.close_episode(e)) for e in ids]
    right = [lk.correct(records[int(e.split("-")[1])], a) for e, a in zip(ids, answers)]
    return sum(right) / len(right), sum(calls) / len(calls)


def correct(prompts: list, completions: list, answer: list, **columns) -> list[float]:
    return lk.reward(prompts, [completion_text(c) for c in completions], answer)


# question form -> (SFT steps, GRPO steps, GRPO lr): "which" is the CI run; "single" (one look-up, a copied
# number only the look-up gives) is measured with RLALIGN_AGENT_FORM=single
SETTINGS = {"which": (300, 12, 5e-4), "single": (500, 20, 3e-4)}


def learn(tmp_path, seed: int, form: str = "which") -> tuple[float, float, float, float]:
    """(success before, after, calls per episode before, after) of one SFT + GRPO run."""
    sft_steps, grpo_steps, lr = SETTINGS[form]
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = train_on_conversations(tokenizer, lk.sft_records("train", 3000, seed=seed, tool_share=0.5, question_form=form), steps=sft_steps, seed=seed)
    model.save_pretrained(tmp_path / "sft")
    tokenizer.save_pretrained(tmp_path / "sft")
    held_out = lk.prompt_records("eval", 48, seed=0, question_form=form)
    start, calls_start = agent_success(model, tokenizer, held_out)
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tmp_path / "sft"), "output_dir": str(tmp_path / "grpo"), "data.task": "arithmetic", "steps": grpo_steps, "prompts_per_step": 8,
        "group_size": 8, "sampling.max_new_tokens": lk.MAX_NEW_TOKENS, "optim.lr": lr, "beta": 0.0, "progress": False, "plots": False,
        "eval.enabled": False, "seed": seed, "agent.function": "tests.train.test_agent_source:lookup_agent", "agent.max_calls": 3,
    })
    result = grpo.train(cfg, reward_functions=[grpo.RewardTerm("correct", 1.0, correct)],
                        prompts=lk.prompt_records("train", 512, seed=seed + 1, question_form=form))
    end, calls_end = agent_success(result.policy, tokenizer, held_out)
    return start, end, calls_start, calls_end


@pytest.mark.slow
def test_grpo_through_the_openai_endpoint_raises_the_lookup_success_rate(tmp_path):
    """Measured (48 held-out questions x 2 episodes, temperature 1): seed 0, 300 SFT + 12 GRPO steps: 0.10 -> 0.23
    (about 290 s on a shared core); 600 SFT + 20 GRPO steps: 0.20 -> 0.34 while calls per episode fall from 2.06
    to 1.06 (seeds 1 and 2: 0.13 -> 0.26 and 0.18 -> 0.40, calls 1.65 -> 1.00 and 1.85 -> 1.06): the tiny model
    compares the looked-up numbers badly, and GRPO raises the success rate mostly by answering without looking
    up (a guess is right half the time). With RLALIGN_AGENT_FORM=single (one look-up whose number is the answer;
    500 SFT + 20 GRPO steps at lr 3e-4) the rise goes through the tool: 0.10 -> 0.26, 0.18 -> 0.36 and 0.12 -> 0.40
    (seeds 0, 1, 2) while chat calls per episode rise from 1.53, 1.67, 1.44 to 1.91, 1.94, 1.98 (2 = look up, then answer)."""
    seeds = [int(s) for s in os.environ.get("RLALIGN_AGENT_SEEDS", "0").split(",")]
    for seed in seeds:
        start, end, calls_start, calls_end = learn(tmp_path / f"seed{seed}", seed, os.environ.get("RLALIGN_AGENT_FORM", "which"))
        print(f"seed {seed}: success {start:.3f} -> {end:.3f}, calls per episode {calls_start:.2f} -> {calls_end:.2f}")
        assert start <= 0.8
        assert end >= start + 0.08
