"""What reward functions get from a multi-turn tool episode: TRL's ``completions`` (the episode after the
prompt as messages: each assistant turn as TRL's ``parse_response`` gives it, each tool reply, the final
turn), in training (an asynchronous producer included) and in the evaluation alike; the built-in terms
still score the final answer."""

from __future__ import annotations

import functools
import importlib.resources as pkg_resources
import pickle

import pytest
import torch

from rlalign.agents import episodes as ep
from rlalign.agents.environment import FunctionTools
from rlalign.agents.tool_calls import HERMES, LLAMA3, MISTRAL, TAGS, ToolCall, call_free_text, parsed_turn
from rlalign.lm.data import PromptExample
from rlalign.lm.decode import SamplingParams
from rlalign.lm.judge import JudgeReward
from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_llama
from rlalign.train import distributed
from rlalign.train.rl_config import RewardConfig
from rlalign.train.env_source import episode_rows
from rlalign.train.rollouts import RewardTerm, build_rewards, score_shard
from tests.agents.families import family_tokenizer
from tests.agents.scripted import ids_of, script

torch.set_num_threads(1)
SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=2048)
QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def episode(monkeypatch, tokenizer, turns: list[str], prompt=QUESTION, max_turns: int = 3) -> ep.Episodes:
    """One scripted episode of ``multiply`` as a FunctionTools environment (what train(tools=[multiply]) runs)."""
    script(monkeypatch, [sum((ids_of(tokenizer, t) for t in turns), [])])
    model = build_tiny_llama(tokenizer, SPEC).eval()
    return ep.run_episodes(model, tokenizer, [{"prompt": prompt}], lambda: FunctionTools([multiply]), SamplingParams(max_new_tokens=200, temperature=1.0),
                           max_turns=max_turns)


def rewards_seen(terms_fns: dict, tokenizer, out: ep.Episodes, prompt=QUESTION, metadata=None) -> tuple[list, dict[str, float]]:
    """Score the episode's row through score_shard as the environment source does: what the functions were given, and their values."""
    seen = []
    terms = [RewardTerm(name, 1.0, lambda completions, _fn=fn, **kw: seen.append(completions) or _fn(completions)) for name, fn in terms_fns.items()]
    scored = score_shard(terms, tokenizer, [PromptExample(prompt, metadata or {})], out.rollout, out.final_texts, 1, distributed.World(), step=1,
                         max_steps=1, episodes=episode_rows(out))
    return seen[0], {name: float(values[0]) for name, values in scored.per_term.items()}


def first_content(completions, **kwargs):  # TRL's accuracy_reward and think_format_reward read completion[0]["content"]
    return [float(c[0]["content"] == "12") for c in completions]


def used_tool(completions, **kwargs):  # a common shaping term with tools
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]


CALL = '<tool_call>\n{"name": "multiply", "arguments": %s}\n</tool_call>'


def qwen_tokenizer():
    """The character tokenizer with TRL's own Qwen2.5 chat template and response schema (so parse_response applies)."""
    pytest.importorskip("trl", reason="TRL is not installed (the test extra has it)")
    from trl.chat_template_utils import add_response_schema

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])  # added, not special: as Qwen's
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (pkg_resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return add_response_schema(tokenizer)


@pytest.mark.parametrize("turns", [
    [CALL % '{"a": 3, "b": 4}' + "<|im_end|>", "12<|im_end|>"],
    # text before the calls, two calls, an argument written as a string ("3" for a: int is 3, as TRL's parser types it)
    ["Let me multiply.\n" + CALL % '{"a": "3", "b": 4}' + "\n" + CALL % '{"a": 5, "b": 4}' + "<|im_end|>", "The product is 12.<|im_end|>"],
])
def test_reward_functions_get_trls_messages_of_the_episode(turns, monkeypatch):
    # TRL 1.16's _tool_call_loop: completions[i] = [parse_response(turn 1), {"role": "tool", "name": N, "content": str(result)} per call,
    # parse_response(turn 2)], each turn parsed with the ids before it as prefix; rlalign gave [{"role": "assistant", "content": <turn 2>}]
    from trl.chat_template_utils import parse_response

    tokenizer = qwen_tokenizer()
    out = episode(monkeypatch, tokenizer, turns)
    first_ids, last_ids = ids_of(tokenizer, turns[0]), ids_of(tokenizer, turns[1])
    prompt_ids = out.rollout.prompt_ids[0][out.rollout.prompt_mask[0].bool()].tolist()
    completion_ids = out.rollout.completion_ids[0][out.rollout.completion_mask[0].bool()].tolist()
    first = parse_response(tokenizer, first_ids, prefix=prompt_ids, tools=[multiply])
    replies = [{"role": "tool", "name": c["function"]["name"], "content": str(multiply(**c["function"]["arguments"]))} for c in first["tool_calls"]]
    last = parse_response(tokenizer, last_ids, prefix=prompt_ids + completion_ids[: -len(last_ids)], tools=[multiply])
    trl = [first, *replies, last]
    assert len(first["tool_calls"]) == len(turns[0].split("<tool_call>")) - 1 and first["tool_calls"][0]["function"]["arguments"] == {"a": 3, "b": 4}

    seen, values = rewards_seen({"first_content": first_content, "used_tool": used_tool}, tokenizer, out)
    assert seen == [trl] and out.completions == [trl]
    assert values == {"first_content": first_content([trl])[0], "used_tool": 1.0}  # 0.0 and 1.0; rlalign gave 1.0 and 0.0
    assert out.final_texts == [last["content"]]  # the final answer, what the built-in terms and env.reward score


def test_a_pickled_sampled_step_scores_as_the_episode_it_came_from(monkeypatch):
    # an asynchronous producer hands Sampled over: the episodes' messages go with it
    from rlalign.train.sources import Sampled, SampledSource, Scorer

    tokenizer = family_tokenizer("hermes")
    out = episode(monkeypatch, tokenizer, [CALL % '{"a": 3, "b": 4}' + "<|im_end|>", "12<|im_end|>"])
    sampled = Sampled(0, [PromptExample(QUESTION, {})], out.rollout, out.final_texts, out.assistant_mask, 0.0, out.env_rewards, episodes=episode_rows(out))
    scorer = Scorer([RewardTerm("used_tool", 1.0, used_tool)], tokenizer, 1, max_steps=1)
    batch = SampledSource(None, scorer, [], 1, 0, None, None).score(pickle.loads(pickle.dumps(sampled)))
    assert batch.scored.per_term["used_tool"].tolist() == [1.0] and batch.scored.completions == ["12"]


def test_builtin_terms_and_the_judge_score_the_final_answer(monkeypatch):
    # exact_match / math_answer read the last assistant turn, not the contents joined ("" + "12" + "12" would be "1212"); so does the judge
    tokenizer = family_tokenizer("hermes")
    out = episode(monkeypatch, tokenizer, [CALL % '{"a": 3, "b": 4}' + "<|im_end|>", "12<|im_end|>"])
    assert [m["role"] for m in out.completions[0]] == ["assistant", "tool", "assistant"] and out.completions[0][1]["content"] == "12"
    specs = [RewardConfig(function="exact_match"), RewardConfig(function="math_answer")]
    examples = [PromptExample(QUESTION, {"answer": "12"})]
    terms = build_rewards(specs, examples, tokenizer, None)
    scored = score_shard(terms, tokenizer, examples, out.rollout, out.final_texts, 1, distributed.World(), step=1, max_steps=1, episodes=episode_rows(out))
    assert {name: values.tolist() for name, values in scored.per_term.items()} == {"exact_match": [1.0], "math_answer": [1.0]}
    judge = JudgeReward(lambda conversations: ["Score: 10"] * len(conversations), template="{completion}")
    assert judge.conversations([QUESTION], out.completions, {}) == [[{"role": "user", "content": "12"}]]


class Submit:
    """An rlalign environment that ends the episode (done) when the answer is submitted through its tool."""

    tools = ["submit"]
    done = False

    def reset(self, record):
        return record["prompt"]

    def submit(self, answer: str) -> str:
        """Submit the final answer.

        Args:
            answer: The answer.
        """
        self.done = True
        return "submitted"


def test_an_episode_the_environment_ends_scores_its_last_assistant_turn(monkeypatch):
    # the completion ends with the tool reply (done after it): the built-in terms score the last assistant turn's text
    # outside the call, not "" (the trailing assistant messages of [turn, reply] are none; math_answer read the turn before)
    tokenizer = family_tokenizer("hermes")
    script(monkeypatch, [ids_of(tokenizer, '12 <tool_call>\n{"name": "submit", "arguments": {"answer": "12"}}\n</tool_call><|im_end|>')])
    out = ep.run_episodes(build_tiny_llama(tokenizer, SPEC).eval(), tokenizer, [{"prompt": QUESTION}], Submit,
                          SamplingParams(max_new_tokens=200, temperature=1.0), max_turns=3)
    assert [m["role"] for m in out.completions[0]] == ["assistant", "tool"] and out.finished.tolist() == [True]
    examples = [PromptExample(QUESTION, {"answer": "12"})]
    terms = build_rewards([RewardConfig(function="exact_match"), RewardConfig(function="math_answer")], examples, tokenizer, None)
    scored = score_shard(terms, tokenizer, examples, out.rollout, out.final_texts, 1, distributed.World(), step=1, max_steps=1, episodes=episode_rows(out))
    assert {name: values.tolist() for name, values in scored.per_term.items()} == {"exact_match": [1.0], "math_answer": [1.0]}
    judge = JudgeReward(lambda conversations: ["Score: 10"] * len(conversations), template="{completion}")
    assert judge.conversations([QUESTION], out.completions, {}) == [[{"role": "user", "content": "12"}]]


class Logged:
    """An rlalign environment that returns its own log of the conversation from reset and keeps writing to it."""

    tools = ["multiply"]

    def reset(self, record):
        self.log = list(record["prompt"])
        return self.log

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.log.append({"role": "user", "content": f"(multiplied {a} and {b})"})
        return a * b


def test_the_prompt_reward_functions_get_is_the_one_reset_returned_not_the_list_grown_since(monkeypatch):
    # Episodes.prompts held the very list reset returned: what the environment appended to it during the episode
    # reached the reward functions and the samples table as part of the prompt
    tokenizer = family_tokenizer("hermes")
    script(monkeypatch, [ids_of(tokenizer, CALL % '{"a": 3, "b": 4}' + "<|im_end|>12<|im_end|>")])
    out = ep.run_episodes(build_tiny_llama(tokenizer, SPEC).eval(), tokenizer, [{"prompt": QUESTION}], Logged,
                          SamplingParams(max_new_tokens=200, temperature=1.0), max_turns=3)
    assert out.environments[0].log[-1]["content"] == "(multiplied 3 and 4)"  # the tool ran and grew the environment's list
    seen = []
    scored = score_shard([RewardTerm("seen", 1.0, lambda prompts, **kw: seen.extend(prompts) or [0.0])], tokenizer, [PromptExample(QUESTION, {})],
                         out.rollout, out.final_texts, 1, distributed.World(), step=1, max_steps=1, episodes=episode_rows(out))
    assert seen == [QUESTION] and "multiplied" not in scored.prompts[0]


def test_a_text_prompt_and_a_single_turn_keep_their_completions(monkeypatch):
    # TRL's completions are texts for text prompts: the episode's final text, as before
    tokenizer = family_tokenizer("hermes")
    out = episode(monkeypatch, tokenizer, ['<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>', "12<|im_end|>"], prompt="3*4=")
    assert out.completions == [None] and out.turns.tolist() == [2]
    seen, _ = rewards_seen({"seen": lambda completions: [0.0]}, tokenizer, out, prompt="3*4=")
    assert seen == ["12"]
    single = score_shard([RewardTerm("seen", 1.0, lambda completions, **kw: [float(completions == [[{"role": "assistant", "content": "12"}]])])], tokenizer,
                         [PromptExample(QUESTION, {})], out.rollout, ["12"], 1, distributed.World(), step=1, max_steps=1)
    assert single.per_term["seen"].tolist() == [1.0]


@pytest.mark.parametrize("fmt, text, content", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "f"}\n</tool_call>\n', "Sure.\n\n"),
    (TAGS, "a <tool>f: x</tool> b", "a  b"),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {}}', ""),
    (LLAMA3, '{"name": "f", "parameters": {}}', ""),
    (MISTRAL, 'Let me see.[TOOL_CALLS][{"name": "f", "arguments": {}}]', "Let me see."),
])
def test_the_text_outside_the_calls_of_each_format(fmt, text, content):
    assert call_free_text(fmt, text) == content
    assert [c.name for c in fmt.parse(text)] == ["f"]


def test_a_turn_with_a_malformed_call_keeps_its_text_and_lists_its_good_calls():
    # parse_response falls back to the decoded text; the environment still ran the well-formed call, so it is listed
    calls = [ToolCall("multiply", {"a": "3", "b": 4}), ToolCall("", {}, "", "malformed tool call: not JSON")]
    text = CALL % '{"a": "3", "b": 4}' + "<tool_call>{bad</tool_call>"
    schema = {"type": "function", "function": {"name": "multiply", "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    turn = parsed_turn(text, text, calls, HERMES, [schema])
    assert turn == {"role": "assistant", "content": text, "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
    assert parsed_turn("12", "12", [], HERMES) == {"role": "assistant", "content": "12"}


def test_the_evaluation_gives_reward_functions_the_training_structure(monkeypatch):
    from rlalign.agents.env_config import EnvironmentConfig
    from rlalign.train.env_source import evaluate_episodes

    tokenizer = family_tokenizer("hermes")
    turns = [CALL % '{"a": 3, "b": 4}' + "<|im_end|>", "12<|im_end|>"]
    trained = episode(monkeypatch, tokenizer, turns).completions
    script(monkeypatch, [sum((ids_of(tokenizer, t) for t in turns), [])])
    seen = []
    term = RewardTerm("seen", 1.0, lambda completions, **kw: seen.extend(completions) or [1.0] * len(completions))
    model_cfg = type("ModelCfg", (), {"autocast": "none"})()  # float32 forwards
    metrics, _ = evaluate_episodes(build_tiny_llama(tokenizer, SPEC).eval(), tokenizer, [PromptExample(QUESTION, {})], [term],
                                   functools.partial(FunctionTools, [multiply]), EnvironmentConfig(max_turns=3), SamplingParams(200, 1.0), model_cfg)
    assert seen == trained and metrics["eval/tool_calls"] == 1.0


def test_a_reward_model_reads_the_whole_episode_as_trls_model_reward_does(monkeypatch):
    # TRL scores a reward model on apply_chat_template({"messages": prompt + completion}); the template renders the parsed
    # tool calls and the tool replies, so the "text" format reads the episode, and "eos" closes the same rendering by EOS
    from trl.data_utils import apply_chat_template

    from rlalign.lm.encoding import example_tokens
    from rlalign.lm.rewards import RewardModelReward

    tokenizer = qwen_tokenizer()
    out = episode(monkeypatch, tokenizer, [CALL % '{"a": 3, "b": 4}' + "<|im_end|>", "12<|im_end|>"])
    text = RewardModelReward(build_tiny_llama(tokenizer, SPEC), tokenizer, "text").text(QUESTION, out.completions[0])
    assert text == apply_chat_template({"messages": QUESTION + out.completions[0]}, tokenizer)["text"]
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>' in text and "<tool_response>\n12\n</tool_response>" in text
    ids, is_target = example_tokens(tokenizer, QUESTION, out.completions[0])
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode([t for t, target in zip(ids, is_target) if target]) == text[len(prompt):]  # ends <|im_end|>\n: EOS already there


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from rlalign.tasks.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)


ITEM = "brom"


def trl_shape(completions, **kwargs):
    """1 where the completion is TRL's list for the scripted episode: a look-up call, its reply, the answer."""
    def shaped(c):
        call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"name": ITEM}}}]}
        return [m["role"] for m in c] == ["assistant", "tool", "assistant"] and c[0] == call and c[1]["name"] == "lookup" and c[2]["content"] == ITEM
    return [float(shaped(c)) for c in completions]


@pytest.mark.parametrize("producer", [False, True])
def test_training_with_trls_tools_gives_reward_functions_the_episode(producer, tiny_path, tmp_path, monkeypatch):
    # grpo.train(cfg, tools=[lookup]) as TRL's GRPOTrainer(tools=[lookup]); the asynchronous producer (a forked process) scores as the learner would
    from rlalign.config import load_config
    from rlalign.lm.models import load_tokenizer
    from rlalign.tasks import lookup as L
    from rlalign.train import grpo

    tokenizer = load_tokenizer(tiny_path)
    turns = ids_of(tokenizer, '<tool>lookup: {"name": "%s"}</tool>' % ITEM) + [tokenizer.eos_token_id] + ids_of(tokenizer, ITEM) + [tokenizer.eos_token_id]
    script(monkeypatch, [turns] * 4)  # 2 prompts x 2 episodes
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tiny_path), "output_dir": str(tmp_path), "data.task": "arithmetic", "rewards": [], "steps": 1, "prompts_per_step": 2,
        "group_size": 2, "sampling.max_new_tokens": 48, "beta": 0.0, "progress": False, "plots": False, "eval.enabled": False, "environment.max_turns": 2,
        "async_rollouts.enabled": producer, "async_rollouts.max_staleness": 0,
    })
    history = grpo.train(cfg, reward_functions=[trl_shape, used_tool], prompts=L.prompt_records("train", 8), tools=[L.lookup]).history[0]
    assert history["reward/trl_shape/mean"] == 1.0 and history["reward/used_tool/mean"] == 1.0 and history["agents/tool_calls"] == 1.0
    assert ("time/producer_idle" in history) == producer  # scored in the producer process
