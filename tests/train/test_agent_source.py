"""Agent code written against the ``openai`` client as a rollout source: each call a row, an
episode's rows sharing its advantage and counting once (pinned by hand through grpo_step), the rows
token-exact (the sampler's log-probs equal the training forward's), GRPO and PPO runs with agents that
call several times, async agents, and the config's errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from rlalign.agents.agent_source import Episode, episode_rows, make_agent_source, row_weights  # noqa: E402
from rlalign.agents.openai_server import CallRecord  # noqa: E402
from rlalign.agents.tool_calls import tool_schemas  # noqa: E402
from rlalign.config import ConfigError, load_config  # noqa: E402
from rlalign.lm.data import load_prompts  # noqa: E402
from rlalign.lm.encoding import completion_text  # noqa: E402
from rlalign.lm.models import load_policy, load_tokenizer  # noqa: E402
from rlalign.lm.reward_calls import RewardFunctionError  # noqa: E402
from rlalign.tasks import lookup as lk  # noqa: E402
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint  # noqa: E402
from rlalign.train import grpo, ppo  # noqa: E402
from rlalign.train.passes import rollout_token_logprobs  # noqa: E402
from rlalign.train.rollouts import ScoredRollout  # noqa: E402
from rlalign.train.sources import ScoredBatch  # noqa: E402
from tests.train.test_rl_composed import PROMPTS, build_rollout, detached, grads, grpo_cfg, hand_forward, sgd_updater  # noqa: E402

torch.set_num_threads(1)
HERE = "tests.train.test_agent_source"


# ----------------------------------------------------------------------------------------------
# Agents, as a user writes them
# ----------------------------------------------------------------------------------------------


def lookup_agent(base_url: str, record: dict) -> str:
    """Ask; run each tool call the reply makes and ask again (at most 3 calls); the last reply is the answer."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages, tools = list(record["prompt"]), tool_schemas([lk.lookup])
    for _ in range(3):
        message = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                result = lk.lookup(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def two_call_agent(base_url: str, record: dict) -> dict:
    """One call, or two for 'heavier' / 'lighter' questions (ask, then ask again with the first reply
    in the history); returns the answer and a reward of its own (0.5 per call made, 0.01 per character
    of the answer: the episodes of a group differ)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(record["prompt"])
    calls = 2 if record["kind"] in ("heavier", "lighter") else 1
    for _ in range(calls):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Sure?"}]
    return {"answer": reply, "reward": 0.5 * calls + 0.01 * len(reply or "")}


async def async_agent(base_url: str, record: dict) -> str:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    first = await client.chat.completions.create(model="policy", messages=record["prompt"], max_tokens=4)
    again = record["prompt"] + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    return (await client.chat.completions.create(model="policy", messages=again, max_tokens=4)).choices[0].message.content


def failing_agent(base_url: str, record: dict) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="policy", messages=record["prompt"], max_tokens=3)
    raise RuntimeError("the agent's own bug")


def heavier_failing_agent(base_url: str, record: dict) -> str:
    """Answers every question but the 'heavier' ones, on which it raises after its call."""
    reply = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model="policy", messages=record["prompt"], max_tokens=3)
    if record["kind"] == "heavier":
        raise RuntimeError("the agent's own bug")
    return reply.choices[0].message.content or ""


def kind_agent(base_url: str, record: dict) -> dict:
    """One call; its own reward 1 for 'heavier' questions, 0 for the rest (whatever the reply)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=record["prompt"], max_tokens=3).choices[0].message.content
    return {"answer": reply, "reward": 1.0 if record["kind"] == "heavier" else 0.0}


def nan_reward_agent(base_url: str, record: dict) -> dict:
    """One call; its own reward NaN on 'heavier' questions (a bug in its scoring), 1 on the rest."""
    openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model="policy", messages=record["prompt"], max_tokens=2)
    return {"answer": "x", "reward": float("nan") if record["kind"] == "heavier" else 1.0}


def text_reward_agent(base_url: str, record: dict) -> dict:
    openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model="policy", messages=record["prompt"], max_tokens=2)
    return {"answer": "x", "reward": "1.0"}


def float_agent(base_url: str, record: dict) -> float:
    """Returns its reward where its answer belongs: a bug in the agent's code."""
    openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model="policy", messages=record["prompt"], max_tokens=2)
    return 1.0


def misspelt_agent(base_url: str, record: dict) -> dict:
    openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model="policy", messages=record["prompt"], max_tokens=2)
    return {"answer": "x", "rewrd": 5.0}


def none_answer_agent(base_url: str, record: dict) -> dict:
    reply = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model="policy", messages=record["prompt"], max_tokens=2)
    return {"answer": None, "reward": len(reply.choices[0].message.content or "")}


def correct(prompts: list, completions: list, answer: list, **columns) -> list[float]:
    """The lookup task's exact-answer reward; conversational prompts get their completions as messages (TRL's convention)."""
    return lk.reward(prompts, [completion_text(c) for c in completions], answer)


CORRECT = grpo.RewardTerm("correct", 1.0, correct)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=2, intermediate_size=64), seed=0)


def agent_cfg(cls, tiny_path, tmp_path, function: str, **overrides):
    base = {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic", "steps": 2, "prompts_per_step": 2,
        "sampling.max_new_tokens": 12, "progress": False, "plots": False, "eval.enabled": False, "agent.function": f"{HERE}:{function}",
        "agent.timeout_s": 60,
    }
    if cls is grpo.GRPOConfig:
        base["group_size"] = 2
    return load_config(cls, None, {**base, **overrides})


class _Sampler:
    """The Updater's face the source uses: the policy and its sampling copy (itself)."""

    def __init__(self, model):
        self.module = model

    def sampler(self):
        return self.module


# ----------------------------------------------------------------------------------------------
# Rows: one per call, token-exact, weighted 1 / k
# ----------------------------------------------------------------------------------------------


def first_batch(cfg, tiny_path, records):
    """The agent source's first step on ``records`` (prompt records), the source closed however it ends."""
    source = make_agent_source(cfg, _Sampler(load_policy(tiny_path)), load_tokenizer(tiny_path), [CORRECT], load_prompts(records))
    try:
        return source.next(grpo.TrainState(step=0, generator=torch.Generator()))
    finally:
        source.close()


def test_each_call_is_a_row_of_its_episode_weighted_one_over_its_calls():
    def call(n: int) -> CallRecord:
        return CallRecord([5] * n, [7] * n, [-0.5] * n, False, "x", "stop")

    episodes = [Episode([call(1), call(2)], "a"), Episode([], "", error="boom"), Episode([call(3)], "b"), Episode([call(1), call(1), call(2)], "c")]
    rollout, row_episode = episode_rows(episodes, pad=0)
    assert row_episode.tolist() == [0, 0, 2, 3, 3, 3]
    assert rollout.group_index.tolist() == [0, 1, 2, 0, 0, 1]  # rows with one prompt share it
    assert rollout.completion_lengths().tolist() == [1, 2, 3, 1, 1, 2]
    assert rollout.prompt_mask.sum(-1).tolist() == [1, 2, 3, 1, 1, 2]
    assert row_weights([2, 0, 1, 3], "seq-mean-token-mean").tolist() == pytest.approx([0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3])
    assert row_weights([2, 0, 1, 3], "token-mean").tolist() == [1.0] * 6
    with pytest.raises(RuntimeError, match="boom"):
        episode_rows([Episode([], "", error="boom")], 0)


def test_the_rows_are_the_sampled_tokens_and_their_logprobs_equal_the_training_forward(tiny_path, tmp_path):
    """Through the source: the rows of a two-call agent hold the sampler's ids, and the sampler's
    log-probs equal the training forward's on those rows (ratio 1 before any update)."""
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "two_call_agent")
    model, tokenizer = load_policy(tiny_path), load_tokenizer(tiny_path)
    source = make_agent_source(cfg, _Sampler(model), tokenizer, [CORRECT], load_prompts(lk.prompt_records("train", 8)))
    try:
        batch = source.next(grpo.TrainState(step=0, generator=torch.Generator()))
    finally:
        source.close()
    calls = [2 if ex.metadata["kind"] in ("heavier", "lighter") else 1 for ex in batch.examples for _ in range(2)]
    assert batch.rollout.batch_size == sum(calls) and batch.row_episode.tolist() == [e for e, k in enumerate(calls) for _ in range(k)]
    assert batch.row_weight.tolist() == pytest.approx([1 / k for k in calls for _ in range(k)])
    assert batch.scored.scores.shape == (4,) and all(r >= 0.5 * k for r, k in zip(batch.scored.per_term["agent"].tolist(), calls))
    assert batch.metrics["agent/calls"] == sum(calls) / 4 and batch.metrics["agent/failed"] == 0.0
    with torch.no_grad():
        train_logp = rollout_token_logprobs(model.eval(), batch.rollout, cfg.sampling.temperature)  # (B, C)
    mask = batch.rollout.completion_mask.bool()
    assert (train_logp - batch.rollout.logprobs)[mask].abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------
# The composition: grpo_step on an agent batch, by hand
# ----------------------------------------------------------------------------------------------


class _FixedSource:
    def __init__(self, batch):
        self.batch = batch

    def next(self, state):
        return self.batch

    def publish(self, policy, version):
        return 0.0


def test_grpo_step_counts_each_episode_once_by_hand(tiny_path, tmp_path):
    """Episodes e = 0..3, G = 2 (e 0, 1 ask prompt p0; e 2, 3 ask p1). The fixed rows 0-3 of
    test_rl_composed are their calls: rows 0 and 1 episode 0 (k = 2), row 2 episode 2, row 3 episode 3;
    episode 1 made no call (its score still counts in its group). Scores R = (2, 0.5, -1, 3):
    A = (R - mean_g) / std_g = (0.707, -0.707, -0.707, 0.707). One update (pi_old = pi, r = 1), beta 0:

        L = 1/3 [ 1/2 (mean_t -A_0 r_0t + mean_t -A_0 r_1t) + mean_t -A_2 r_2t + mean_t -A_3 r_3t ]

    value 1/3 (-A_0 - A_2 - A_3) = -0.2357; the gradient is that of the expression."""
    cfg = grpo_cfg(tiny_path, tmp_path, beta=0.0)
    tokenizer, policy = load_tokenizer(tiny_path), load_policy(tiny_path)
    rollout = build_rollout(tokenizer, detached(hand_forward(policy, tokenizer)), PROMPTS, 2)  # the sampler's log-probs: the policy's own
    scores = torch.tensor([2.0, 0.5, -1.0, 3.0])
    scored = ScoredRollout(["p0", "p0", "p1", "p1"], [""] * 4, scores, {"r": scores}, scores, {"r": scores})
    batch = ScoredBatch(load_prompts([{"prompt": p} for p in PROMPTS[::2]]), rollout, scored, rollout.completion_mask.float(),
                        row_episode=torch.tensor([0, 0, 2, 3]), row_weight=torch.tensor([0.5, 0.5, 1.0, 1.0]))
    updater = sgd_updater(policy, lr=0.0)
    metrics, _ = grpo.grpo_step(updater, None, _FixedSource(batch), grpo.TrainState(step=0, generator=torch.Generator()), cfg)
    trainer = grads(policy)

    policy.zero_grad()
    a = 1 / math.sqrt(2)  # |R - mean| / std for a group of two distinct scores
    advantage = [a, a, -a, a]  # rows 0, 1: episode 0 (+a); row 2: episode 2 (-a); row 3: episode 3 (+a)
    logp = hand_forward(policy, tokenizer)
    per_row = [sum(-advantage[i] * torch.exp(lp - lp.detach()) for lp in row) / len(row) for i, row in enumerate(logp)]
    expected = (0.5 * (per_row[0] + per_row[1]) + per_row[2] + per_row[3]) / 3
    expected.backward()
    assert metrics["loss/policy"] == pytest.approx(expected.item(), abs=1e-6) and expected.item() == pytest.approx(-a / 3, abs=1e-6)
    for name, g in grads(policy).items():
        torch.testing.assert_close(trainer[name], g, rtol=1e-4, atol=1e-6)
    assert max(g.abs().max().item() for g in trainer.values()) > 1e-3
    assert metrics["reward/mean"] == pytest.approx(1.125)  # the episodes' mean, not the rows'


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def test_grpo_runs_two_steps_with_an_openai_agent_that_calls_several_times(tiny_path, tmp_path):
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "two_call_agent", **{"optim.lr": 1e-3})
    before = {k: v.clone() for k, v in load_policy(tiny_path).state_dict().items()}
    result = grpo.train(cfg, reward_functions=[CORRECT], prompts=lk.prompt_records("train", 16))
    assert len(result.history) == 2
    for m in result.history:
        assert 1.0 <= m["agent/calls"] <= 2.0 and m["agent/failed"] == 0.0
        assert 0.5 * m["agent/calls"] <= m["reward/agent/mean"] <= 0.5 * m["agent/calls"] + 0.07
        assert m["ratio_dev/first"] < 1e-4
    assert any(not torch.equal(before[k], v) for k, v in result.policy.state_dict().items())


def test_ppo_runs_two_steps_with_an_async_agent(tiny_path, tmp_path):
    cfg = agent_cfg(ppo.PPOConfig, tiny_path, tmp_path, "async_agent", **{"optim.lr": 1e-3})
    result = ppo.train(cfg, reward_functions=[CORRECT], prompts=lk.prompt_records("train", 16))
    assert len(result.history) == 2 and all(m["agent/calls"] == 2.0 for m in result.history)


def test_grpo_with_the_lookup_agent_and_asynchronous_rollouts(tiny_path, tmp_path):
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "lookup_agent", **{"async_rollouts.enabled": True, "async_rollouts.max_staleness": 0})
    result = grpo.train(cfg, reward_functions=[CORRECT], prompts=lk.prompt_records("train", 16))
    assert len(result.history) == 2 and all(m["agent/calls"] >= 1.0 for m in result.history)


def test_an_agent_that_raises_fails_its_episode_and_leaves_training_never_scored_0(tiny_path, tmp_path):
    # its answer "" was scored 0 and entered its group's baseline: a failure became a 0
    from rlalign.agents.agent_source import AGENT_FAILED
    from rlalign.train.rollouts import trusted_rows

    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "failing_agent")
    batch = first_batch(cfg, tiny_path, lk.prompt_records("train", 8))
    assert batch.metrics["agent/failed"] == 1.0 and batch.rollout.batch_size == 4  # its calls are still rows, with no loss tokens
    assert batch.scored.failed[AGENT_FAILED].tolist() == [True] * 4 and not trusted_rows(batch.scored).any()


def test_only_the_failed_episodes_leave_training_and_their_groups_baselines(tiny_path, tmp_path):
    from rlalign.agents.agent_source import AGENT_FAILED
    from rlalign.train.rollouts import trusted_rows

    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "heavier_failing_agent")
    records = lk.prompt_records("train", 16)
    records = [next(r for r in records if r["kind"] == "heavier"), next(r for r in records if r["kind"] != "heavier")]
    batch = first_batch(cfg, tiny_path, records)
    heavier = [ex.metadata["kind"] == "heavier" for ex in batch.examples for _ in range(cfg.group_size)]  # the step's order, G episodes each
    assert batch.scored.failed[AGENT_FAILED].tolist() == heavier and trusted_rows(batch.scored).tolist() == [not h for h in heavier]


@pytest.mark.parametrize(("function", "shown", "why"), [
    ("nan_reward_agent", "nan", "expected a finite number in float32"), ("text_reward_agent", "'1.0'", "expected a finite number, or None for no reward"),
])
def test_an_agents_reward_that_is_not_a_finite_number_is_an_error_naming_the_agent_and_the_prompt(tiny_path, tmp_path, function, shown, why):
    """As a reward term's NaN is: not a NaN score in every advantage of its group, nor a failed episode."""
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, function)
    records = [r for r in lk.prompt_records("train", 16) if r["kind"] == "heavier"][:2]
    with pytest.raises(RewardFunctionError) as err:
        first_batch(cfg, tiny_path, records)
    prompts = [repr(r["prompt"]) for r in records]
    message = str(err.value)
    assert message.startswith(f"agent {HERE}:{function} returned {shown} for prompt ") and why in message
    assert message.split(" for prompt ")[1].split(": expected")[0] in prompts


@pytest.mark.parametrize(("function", "message"), [
    ("float_agent", "the agent returned float; expected text, a dict with 'answer' / 'reward', or None"),
    ("misspelt_agent", "the agent returned a dict with 'rewrd'; its keys are 'answer' and 'reward'"),
])
def test_an_agent_whose_return_is_no_answer_is_an_error_naming_it_and_the_prompt(tiny_path, tmp_path, function, message):
    # it failed its episode: trained as the answer "" with no error, skewing its group's advantages
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, function)
    records = lk.prompt_records("train", 16)[:2]
    with pytest.raises(RewardFunctionError) as err:
        first_batch(cfg, tiny_path, records)
    assert str(err.value).startswith(f"agent {HERE}:{function}: {message} (prompt ")


def test_an_answer_of_none_is_the_last_reply_as_a_none_return_is(tiny_path, tmp_path):
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "none_answer_agent")
    batch = first_batch(cfg, tiny_path, lk.prompt_records("train", 8))
    assert batch.metrics["agent/failed"] == 0.0 and "None" not in batch.scored.completions  # was the text "None"
    assert batch.scored.per_term["agent"].tolist() == [float(len(c)) for c in batch.scored.completions]  # the answer is the reply it measured


def test_agent_config_errors(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "lookup_agent", dynamic_sampling=True)
    with pytest.raises(ConfigError, match="kl_in: reward"):
        agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "lookup_agent", kl_in="reward")
    with pytest.raises(ConfigError, match="package.module:function"):
        load_config(grpo.GRPOConfig, None, {"agent.function": "no_colon"})
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "missing_agent")
    with pytest.raises(ConfigError, match="cannot be imported"):
        grpo.train(cfg, reward_functions=[CORRECT], prompts=lk.prompt_records("train", 4))


def test_an_agent_run_is_evaluated_on_held_out_episodes_by_hand(tiny_path, tmp_path):
    # the agent's own reward decides each episode (no reward term scores): success = the share of 'heavier' questions,
    # the same for both samples of a prompt, so pass@1 = pass@2 = success; one call per episode
    zero = grpo.RewardTerm("zero", 1.0, lambda prompts, completions, **kw: [0.0] * len(completions))
    eval_cfg = {"eval.enabled": True, "eval.data.task": "lookup", "eval.num_prompts": 12, "eval.num_samples": 2, "eval.temperature": 1.0,
                "eval.num_samples_logged": 3}
    cfg = agent_cfg(grpo.GRPOConfig, tiny_path, tmp_path, "kind_agent", steps=1, **eval_cfg)
    result = grpo.train(cfg, reward_functions=[zero], prompts=lk.prompt_records("train", 16))
    share = sum(r["kind"] == "heavier" for r in lk.prompt_records("eval", 12, cfg.eval.data.seed)) / 12
    assert 0 < share < 1
    evals = [h for h in result.history if "eval/success" in h]
    assert len(evals) == 1
    assert evals[0]["eval/success"] == pytest.approx(share) and evals[0]["eval/pass@1"] == pytest.approx(share)
    assert evals[0]["eval/pass@2"] == pytest.approx(share) and evals[0]["eval/reward/mean"] == pytest.approx(share)
    assert evals[0]["eval/calls"] == 1.0 and evals[0]["eval/failed"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 and {"episode", "calls", "final", "reward", "error"} <= set(rows[0]) and rows[0]["calls"] == 1
