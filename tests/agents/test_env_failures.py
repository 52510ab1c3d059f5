"""Environment episodes that cannot be trained as they are: an episode past ``environment.timeout_s``
is left out of training (advantage 0, no loss tokens, counted), and an environment's reward that is
not a finite number is an error naming the environment and the prompt."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlalign.agents import episodes as ep
from rlalign.agents.env_config import EnvironmentConfig
from rlalign.config import load_config
from rlalign.lm.data import load_prompts
from rlalign.lm.decode import SamplingParams
from rlalign.lm.reward_calls import RewardFunctionError
from rlalign.tasks.tiny_model import build_tiny_llama
from rlalign.train import grpo
from rlalign.train.env_source import TIMED_OUT, EnvironmentSource
from rlalign.train.rollouts import select_rows
from rlalign.train.sources import ScoredBatch, Scorer
from tests.agents.families import family_tokenizer
from tests.agents.test_episodes import CALL, SPEC, ids_of, script
from tests.train.test_agent_source import _FixedSource
from tests.train.test_rl_composed import assert_same_grads, grads, sgd_updater

torch.set_num_threads(1)
PROMPT = [{"role": "user", "content": "What is the weight of the brom?"}]


class StuckLookup:
    """A look-up whose backend never answers; its own reward: 1 for the answer "31", else 0."""

    tools = ["lookup"]

    def reset(self, record):
        return record["prompt"]

    async def lookup(self, name: str) -> str:
        """Look up an item.

        Args:
            name: The item's name.
        """
        await asyncio.sleep(3600)
        return "weight=31"

    async def reward(self, answer: str) -> float:  # async: answers at once, however late in the episode's time
        return float(answer == "31")


class _Sampler:
    def __init__(self, model):
        self.module = model

    def sampler(self):
        return self.module


def _cfg(group_size: int) -> grpo.GRPOConfig:
    return load_config(grpo.GRPOConfig, None, {
        "model.path": "unused", "data.task": "arithmetic", "prompts_per_step": 1, "group_size": group_size, "beta": 0.0, "sampling.max_new_tokens": 80,
        "progress": False, "plots": False,
    })


def test_a_timed_out_episode_gets_advantage_0_and_no_loss_tokens(monkeypatch):
    """One prompt, G = 3 episodes: "31" (environment reward 1), "7" (reward 0), and a look-up whose tool never
    answers, cut at timeout_s (no reward: scored 0 by the terms, of which there are none). Left out of training,
    the timed-out row changes nothing: GRPO's step on the three rows has the gradient of its step on the two
    finished rows alone as a group of 2 (A = +-1/sqrt 2; with the row kept, scores (1, 0, 0) would give
    A = (2, -1, -1)/sqrt 3 and its tokens a share of the loss)."""
    tokenizer = family_tokenizer("hermes")
    model = build_tiny_llama(tokenizer, SPEC)
    script(monkeypatch, [ids_of(tokenizer, "31<|im_end|>"), ids_of(tokenizer, "7<|im_end|>"), ids_of(tokenizer, CALL % "brom")])
    cfg = _cfg(3)
    source = EnvironmentSource(_Sampler(model), Scorer([], tokenizer, 3), load_prompts([{"prompt": PROMPT}]), 1, 0, cfg.sampling, cfg.model,
                               env=StuckLookup, env_cfg=EnvironmentConfig(max_turns=2, timeout_s=0.5))
    batch = source.next(grpo.TrainState(step=0, generator=torch.Generator()))
    assert batch.metrics["agents/timed_out"] == pytest.approx(1 / 3)
    assert batch.scored.failed[TIMED_OUT].tolist() == [False, False, True]
    assert batch.scored.scores.tolist() == [1.0, 0.0, 0.0]
    assert batch.token_mask[2].sum() == len(ids_of(tokenizer, CALL % "brom"))  # its sampled tokens, which the step must leave out

    updater = sgd_updater(model, lr=0.0)
    metrics, _ = grpo.grpo_step(updater, None, _FixedSource(batch), grpo.TrainState(step=0, generator=torch.Generator()), cfg)
    trainer = grads(model)
    assert metrics["reward/environment_timeout/failed"] == 1.0
    assert metrics["adv/std"] == pytest.approx(0.5 ** 0.5, abs=1e-6)  # A = (1/sqrt 2, -1/sqrt 2, 0): unbiased std sqrt((1/2 + 1/2 + 0) / 2); kept, (2, -1, -1)/sqrt 3 has std 1

    finished = torch.tensor([0, 1])
    two = ScoredBatch(batch.examples, batch.rollout.select(finished), select_rows(batch.scored, finished), batch.token_mask[finished], {}, 0)
    model.zero_grad()
    grpo.grpo_step(updater, None, _FixedSource(two), grpo.TrainState(step=0, generator=torch.Generator()), _cfg(2))
    assert_same_grads(trainer, grads(model))


class NanReward(StuckLookup):
    def reward(self, answer: str) -> float:
        return float("nan") if answer == "bad" else 1.0


class TextReward(StuckLookup):
    def reward(self, answer: str):
        return "1.0"


@pytest.mark.parametrize(("env", "message"), [
    (NanReward, r"environment NanReward.reward returned nan for prompt \[\{'role': 'user', 'content': 'What is the weight of the brom\?'\}\]: expected a finite"),
    (TextReward, r"environment TextReward.reward returned '1.0' for prompt .*What is the weight.*: expected a finite number, or None for no reward"),
])
def test_an_environment_reward_that_is_not_a_finite_number_is_an_error_naming_it_and_the_prompt(monkeypatch, env, message):
    tokenizer = family_tokenizer("hermes")
    model = build_tiny_llama(tokenizer, SPEC).eval()
    script(monkeypatch, [ids_of(tokenizer, "ok<|im_end|>"), ids_of(tokenizer, "bad<|im_end|>")])
    with pytest.raises(RewardFunctionError, match=message):
        ep.run_episodes(model, tokenizer, [{"prompt": PROMPT}, {"prompt": PROMPT}], env, SamplingParams(max_new_tokens=8, temperature=1.0), max_turns=1)


def test_the_scorer_refuses_a_non_finite_environment_reward_of_any_source():
    """The rewards of the tools' environments (rlalign.lm.tools) reach the scores through the Scorer too."""
    from rlalign.lm.rollout import Rollout

    tokenizer = family_tokenizer("hermes")
    rollout = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                      torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool))
    examples = load_prompts([{"prompt": "2+3="}])
    with pytest.raises(RewardFunctionError, match="the environment's reward is inf for prompt '2\\+3=': not a finite number"):
        Scorer([], tokenizer, 2)(examples, rollout, ["5", "6"], 0, [1.0, float("inf")])
    assert Scorer([], tokenizer, 2)(examples, rollout, ["5", "6"], 0, [1.0, None]).scores.tolist() == [1.0, 0.0]
