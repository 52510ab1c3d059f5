"""Batched multi-turn episodes: the trained ids are the sampled ids plus the template's tokens, the
cache carried across turns gives the training forward's log-probs, and the environment's tools,
errors, time limit and rewards."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from rlalign.agents import episodes as ep
from rlalign.agents.tool_calls import TAGS
from rlalign.lm.data import load_prompts
from rlalign.lm.decode import SamplingParams
from rlalign.tasks.lookup import LookupEnvironment, lookup, prompt_records
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_llama
from rlalign.train.passes import rollout_token_logprobs
from tests.agents.families import HERMES_TEMPLATE, family_tokenizer
from tests.agents.scripted import ids_of, script

torch.set_num_threads(1)
SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=1024)


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"name": "%s"}}\n</tool_call><|im_end|>'


def test_hermes_episodes_are_the_sampled_ids_plus_the_templates_tokens(monkeypatch):
    tokenizer = family_tokenizer("hermes")
    model = build_tiny_llama(tokenizer, SPEC).eval()
    records = prompt_records("train", 40)
    records = [records[0], next(r for r in records if len(r["prompt"][0]["content"]) != len(records[0]["prompt"][0]["content"]))]  # left padding
    a, b = records[0]["items"]
    turns0 = [ids_of(tokenizer, CALL % a), ids_of(tokenizer, CALL % b), ids_of(tokenizer, records[0]["answer"] + "<|im_end|>")]
    turns1 = [ids_of(tokenizer, CALL % "nope"), ids_of(tokenizer, "guess<|im_end|>")]  # a reply of another length than row 0's
    script(monkeypatch, [sum(turns0, []), sum(turns1, [])])
    out = ep.run_episodes(model, tokenizer, records, LookupEnvironment, SamplingParams(max_new_tokens=100, temperature=1.0), max_turns=4)

    assert out.turns.tolist() == [3, 2] and out.tool_calls.tolist() == [2, 1] and out.finished.tolist() == [True, True]
    assert out.final_texts == [records[0]["answer"], "guess"] and out.env_rewards == [1.0, 0.0]
    # the whole row is the template's rendering of the episode's conversation, token for token
    conversation = out.conversations[0]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert conversation[2]["content"] == lookup(a)
    from transformers.utils import get_json_schema

    rendered = ids_of(tokenizer, tokenizer.apply_chat_template(conversation, tools=[get_json_schema(lookup)], tokenize=False))
    n = int(out.rollout.completion_mask[0].sum())
    row = out.rollout.prompt_ids[0][out.rollout.prompt_mask[0].bool()].tolist() + out.rollout.completion_ids[0, :n].tolist()
    assert row == rendered[: len(row)] and rendered[len(row):] == ids_of(tokenizer, "\n")  # the template's newline after the last <|im_end|>
    # sampled ids exactly where the mask is 1, the environment's where it is 0
    mask = out.assistant_mask[0, :n].tolist()
    assert [t for t, m in zip(out.rollout.completion_ids[0, :n].tolist(), mask) if m] == sum(turns0, [])
    env = [t for t, m in zip(out.rollout.completion_ids[0, :n].tolist(), mask) if not m]
    assert tokenizer.decode(env).count("<tool_response>") == 2 and out.assistant_mask[1].sum() == len(sum(turns1, []))
    # the cache carried across turns (and rows sampled side by side) gives the training forward's log-probs
    train = rollout_token_logprobs(model, out.rollout, 1.0)
    sampled = out.assistant_mask.bool()
    torch.testing.assert_close(out.rollout.logprobs[sampled], train[sampled], rtol=0, atol=2e-5)
    assert (out.rollout.logprobs[~sampled] == 0).all()


def test_a_final_answer_cut_at_max_new_tokens_is_truncated_not_finished(monkeypatch):
    # it counted as finished: mask_truncated, DAPO's overlong filter and PPO's missing-EOS penalty never saw it
    from rlalign.train.passes import loss_mask
    from rlalign.train.sources import Scorer

    tokenizer = family_tokenizer("hermes")
    records = prompt_records("train", 8)[:2]
    cut = ids_of(tokenizer, "I think it is the " + "x" * 200)  # no <|im_end|> within the 100 tokens
    script(monkeypatch, [ids_of(tokenizer, records[0]["answer"] + "<|im_end|>"), cut])
    out = ep.run_episodes(build_tiny_llama(tokenizer, SPEC).eval(), tokenizer, records, LookupEnvironment,
                          SamplingParams(max_new_tokens=100, temperature=1.0), max_turns=4)
    assert out.finished.tolist() == [True, False] and out.rollout.truncated.tolist() == [False, True]
    assert loss_mask(out.rollout, mask_truncated=True)[1].sum() == 0
    penalised = Scorer([], tokenizer, 1, missing_eos_penalty=1.0)(load_prompts(records), out.rollout, out.final_texts, 0, out.env_rewards)
    assert penalised.scores.tolist() == [1.0, -1.0]  # the environment's 1.0 for the right answer, 0.0 minus the penalty for the cut one


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Characters plus one merged token "ok" (so "o" "k" sampled apart re-encode as one id)."""
    chars = list("abcdefghijklmnopqrstuvwxyz<>/:=? \n")
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *chars, "ok"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("o", "k")], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    return tokenizer


class Echo:
    tools = ["echo"]

    def reset(self, record):
        return [{"role": "user", "content": "say ok"}]

    def echo(self, text: str) -> str:
        """Echo.

        Args:
            text: what to echo.
        """
        return text


def test_trained_ids_are_the_sampled_ids_even_where_a_round_trip_would_change_them(monkeypatch):
    tokenizer = bpe_tokenizer()
    v = tokenizer.get_vocab()
    sampled = [v[c] for c in "<tool>echo: o"] + [v["k"]] + [v[c] for c in "</tool>"] + [v["<eos>"]] + [v["o"], v["k"], v["<eos>"]]
    assert tokenizer.decode(sampled[-3:-1]) == "ok" and ids_of(tokenizer, "ok") == [v["ok"]]  # a round trip merges them
    script(monkeypatch, [sampled])
    model = build_tiny_llama(tokenizer, SPEC).eval()
    out = ep.run_episodes(model, tokenizer, [{}], Echo, SamplingParams(max_new_tokens=30, temperature=1.0), max_turns=3, fmt=TAGS)
    completion = out.rollout.completion_ids[0][out.rollout.completion_mask[0].bool()].tolist()
    assert [t for t, m in zip(completion, out.assistant_mask[0].tolist()) if m] == sampled
    env = [t for t, m in zip(completion, out.assistant_mask[0].tolist()) if not m]
    assert tokenizer.decode(env) == "\ntool: ok\nassistant: " and v["ok"] in env  # the environment's own text is encoded once, as the template renders it
    assert out.final_texts == ["ok"] and out.conversations[0][2] == {"role": "tool", "name": "echo", "content": "ok", "tool_call_id": "c00000000"}


class Slow:
    """Tools that wait (async), fail, or take arguments; ``reward`` counts the calls that worked."""

    tools = ["wait", "fail", "add"]

    def reset(self, record):
        self.ok = 0
        return record["prompt"]

    async def wait(self, seconds: str) -> str:
        """Wait.

        Args:
            seconds: how long.
        """
        await asyncio.sleep(float(seconds))
        self.ok += 1
        return "waited"

    def fail(self, x: str) -> str:
        """Fail.

        Args:
            x: anything.
        """
        raise KeyError(x)

    def add(self, a: int, b: int) -> int:
        """Add.

        Args:
            a: one.
            b: two.
        """
        self.ok += 1
        return a + b

    def reward(self, answer: str) -> float:
        return float(self.ok)


def test_tools_errors_time_limit_and_rewards_of_a_text_prompt(monkeypatch):
    tokenizer = family_tokenizer("hermes")
    tokenizer.chat_template = None  # text prompts: no template; tool replies in the format's result tags
    turns = [
        ["<tool>wait: 0.01</tool>", '<tool>add: {"a": 2, "b": 3}</tool>', "done<|im_end|>"],  # two good calls then the answer
        ["<tool>fail: q</tool>", "<tool>nope: 1</tool>", '<tool>add: {"a": 1}</tool>'],  # errors; max_turns: the third call is not run
        ["<tool>add: {broken</tool>", "x<|im_end|>"],  # a malformed call, answered with an error
    ]
    script(monkeypatch, [sum((ids_of(tokenizer, t) for t in row), []) for row in turns])
    model = build_tiny_llama(tokenizer, SPEC).eval()
    out = ep.run_episodes(model, tokenizer, [{"prompt": f"q{i}"} for i in range(3)], Slow, SamplingParams(max_new_tokens=40, temperature=1.0),
                          max_turns=3, fmt=TAGS, timeout_s=None)  # no limit here, however slow the machine: the one below is tested alone
    text = [tokenizer.decode(out.rollout.completion_ids[r][out.rollout.completion_mask[r].bool()]) for r in range(3)]
    assert text[0] == "<tool>wait: 0.01</tool><result>waited</result><tool>add: {\"a\": 2, \"b\": 3}</tool><result>5</result>done<|im_end|>"
    assert text[1] == ("<tool>fail: q</tool><result>error: KeyError: 'q'</result><tool>nope: 1</tool><result>error: unknown tool 'nope'; available: add, fail, wait</result>"
                       '<tool>add: {"a": 1}</tool>')
    assert text[2].startswith("<tool>add: {broken</tool><result>error: malformed tool call: the arguments of 'add' are not JSON")
    assert out.timed_out.tolist() == [False, False, False] and out.finished.tolist() == [True, False, True]
    assert out.rollout.truncated.tolist() == [False, True, False]
    assert out.env_rewards == [2.0, 0.0, 0.0] and out.malformed.tolist() == [0, 0, 1] and out.tool_calls.tolist() == [2, 3, 1]
    metrics = ep.episode_metrics(out)
    assert metrics["agents/timed_out"] == 0.0 and metrics["agents/malformed_calls"] == pytest.approx(1 / 3) and metrics["agents/tool_calls"] == 2

    # past the time limit: a tool that would answer after 120 s, cut at 0.5 s from the batch's start
    script(monkeypatch, [ids_of(tokenizer, "<tool>wait: 120</tool>")])
    out = ep.run_episodes(model, tokenizer, [{"prompt": "q"}], Slow, SamplingParams(max_new_tokens=40, temperature=1.0), max_turns=3, fmt=TAGS, timeout_s=0.5)
    assert out.timed_out.tolist() == [True] and out.finished.tolist() == [False] and out.rollout.truncated.tolist() == [True]
    assert out.env_rewards == [None] and out.tool_calls.tolist() == [1] and ep.episode_metrics(out)["agents/timed_out"] == 1.0


class Stepper:
    """An environment with a step function instead of tool methods; done after its first reply."""

    tool_schemas = []

    def reset(self, record):
        self.done = False
        return [{"role": "user", "content": "go"}]

    def step(self, calls):
        self.done = True
        return f"{len(calls)} calls: {calls[0].name}"


def test_a_step_environment_and_done(monkeypatch):
    tokenizer = family_tokenizer("hermes")
    script(monkeypatch, [ids_of(tokenizer, CALL % "x")])
    model = build_tiny_llama(tokenizer, SPEC).eval()
    out = ep.run_episodes(model, tokenizer, [{}], Stepper, SamplingParams(max_new_tokens=100, temperature=1.0), max_turns=3)
    assert out.turns.tolist() == [1] and out.finished.tolist() == [True] and out.conversations[0][-1] == {"role": "tool", "content": "1 calls: lookup"}
    assert int(out.assistant_mask[0].sum()) == int(out.rollout.completion_mask[0].sum())  # done: no environment tokens follow


def test_a_step_environments_replies_are_cut_at_max_result_chars_as_a_tools_are():
    from rlalign.agents.environment import EnvRunner
    from rlalign.agents.tool_calls import ToolCall

    class Long:
        def reset(self, record):
            return "go"

        def step(self, calls):
            return "y" * 5000 if len(calls) == 1 else [{"role": "tool", "content": "z" * 5000}, {"role": "user", "content": "w" * 5000}]

    runner = EnvRunner(Long(), max_result_chars=1000)
    one = asyncio.run(runner.respond([ToolCall("f", {})]))
    two = asyncio.run(runner.respond([ToolCall("f", {}), ToolCall("g", {})]))
    assert [len(m["content"]) for m in one + two] == [1000, 1000, 1000]  # 5000 each before: only tool methods' results were cut


def test_greedy_rows_batched_equal_rows_alone():
    tokenizer = family_tokenizer("hermes")
    model = build_tiny_llama(tokenizer, SPEC, seed=3).eval()
    records = prompt_records("train", 3)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    batched = ep.run_episodes(model, tokenizer, records, LookupEnvironment, params, max_turns=2)
    for r, record in enumerate(records):
        alone = ep.run_episodes(model, tokenizer, [record], LookupEnvironment, params, max_turns=2)
        n = int(alone.rollout.completion_mask[0].sum())
        assert batched.rollout.completion_ids[r, :n].tolist() == alone.rollout.completion_ids[0, :n].tolist()
        torch.testing.assert_close(batched.rollout.logprobs[r, :n], alone.rollout.logprobs[0, :n], rtol=0, atol=2e-5)


def test_an_episode_is_the_sft_tokens_of_its_conversation(monkeypatch):
    # the tiny template writes "\n" after each turn and no end-of-turn token: SFT trains "<tool>...</tool>\n<eos>" then
    # "tool: ...", so an episode whose policy drew "\n<eos>" must continue with "tool: ...", not a second "\n"
    from rlalign.lm.encoding import example_tokens
    from rlalign.tasks.lookup import sft_records
    from rlalign.tasks.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    record = sft_records("train", 1, tool_share=1.0)[0]["messages"]
    ids, target = example_tokens(tokenizer, None, record)
    prompt_len = target.index(1)
    turns = []  # the SFT targets of each assistant turn, as the policy would draw them
    for i in range(prompt_len, len(ids)):
        if target[i] and (i == prompt_len or not target[i - 1]):
            turns.append([])
        if target[i]:
            turns[-1].append(ids[i])
    script(monkeypatch, [sum(turns, [])])
    model = build_tiny_llama(tokenizer, SPEC).eval()
    rec = {"prompt": record[:1], "answer": record[-1]["content"], "items": [], "kind": "heavier"}
    out = ep.run_episodes(model, tokenizer, [rec], LookupEnvironment, SamplingParams(max_new_tokens=40, temperature=1.0), max_turns=3)
    n = int(out.rollout.completion_mask[0].sum())
    assert out.rollout.prompt_ids[0].tolist() == ids[:prompt_len] and out.rollout.completion_ids[0, :n].tolist() == ids[prompt_len:]
    assert out.assistant_mask[0, :n].tolist() == target[prompt_len:] and out.env_rewards == [1.0]


def test_a_string_argument_of_a_typed_tool_is_cast_as_trl_casts_it():
    # TRL runs multiply(a=3, b=4) for {"a": "3", "b": "4"} (its calls are typed by the schema): 12, not a TypeError
    from rlalign.agents.environment import EnvRunner, FunctionTools
    from rlalign.agents.tool_calls import ToolCall

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a * b

    loop = asyncio.new_event_loop()
    try:
        replies = loop.run_until_complete(EnvRunner(FunctionTools([multiply])).respond([ToolCall("multiply", {"a": "3", "b": "4"}), ToolCall("multiply", "5")]))
    finally:
        loop.close()
    assert [m["content"] for m in replies] == ["12", "error: multiply takes 2 arguments; write them as a JSON object"]


def test_function_tools_and_environment_factory():
    from rlalign.agents.environment import EnvRunner, FunctionTools, environment_factory
    from rlalign.agents.tool_calls import ToolCall

    runner = EnvRunner(FunctionTools([lookup]))
    assert [s["function"]["name"] for s in runner.schemas()] == ["lookup"]
    loop = asyncio.new_event_loop()
    try:
        replies = loop.run_until_complete(runner.respond([ToolCall("lookup", {"name": "brom"}), ToolCall("lookup", {"nam": "x"}), ToolCall("lookup", "tiva")], 3, 1))
        assert loop.run_until_complete(runner.reset({"prompt": "q"})) == "q" and loop.run_until_complete(runner.reward("x")) is None
    finally:
        loop.close()
    assert [m["content"] for m in replies] == [lookup("brom"), "error: bad arguments for lookup: missing a required argument: 'name'", lookup("tiva")]
    assert [m["tool_call_id"] for m in replies] == ["c00030100", "c00030101", "c00030102"]  # 9 characters (Mistral's templates check)
    assert environment_factory("rlalign.tasks.lookup:LookupEnvironment") is LookupEnvironment
    with pytest.raises(ValueError, match="cannot be imported"):
        environment_factory("rlalign.tasks.lookup:Nothing")
    with pytest.raises(ValueError, match="neither tools"):
        EnvRunner(object())
