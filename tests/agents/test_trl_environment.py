"""TRL's environment classes (GRPOTrainer(environment_factory=...)) run unchanged: the protocol is told apart
from rlalign's, the tools and their schemas, the prompt ids and the reward are TRL 1.16's own (its trainer is
the oracle, built on the tiny model and stopped before it generates)."""

from __future__ import annotations

import asyncio
import importlib.resources as pkg_resources
import os

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (the test and bench extras have it)")

from rlalign.agents import episodes as ep  # noqa: E402
from rlalign.agents.environment import EnvRunner, FunctionTools, environment_factory  # noqa: E402
from rlalign.agents.tool_calls import ToolCall  # noqa: E402
from rlalign.config import load_config  # noqa: E402
from rlalign.lm.decode import SamplingParams  # noqa: E402
from rlalign.tasks import lookup as L  # noqa: E402
from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_llama  # noqa: E402
from rlalign.train import grpo  # noqa: E402
from tests.agents.scripted import script_texts  # noqa: E402

torch.set_num_threads(1)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


class Counter:
    """TRL's documented shape: public methods are tools, reset(**row) -> text appended to the prompt, get_reward()."""

    def reset(self, **row) -> str | None:
        self.n = row.get("start", 0)
        return f" Start at {self.n}." if row.get("start") else None

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.n += step
        return self.n

    def get_reward(self) -> float:
        return float(self.n)


class Base:
    def shout(self, text: str) -> str:
        """Say it loudly.

        Args:
            text: What to say.
        """
        return text.upper()


class Busy(Base):
    """Every kind of member TRL's getmembers(type(env), isfunction) sees or skips: an inherited method and a static
    method are tools; reset, get_reward, private and dunder names, a class method and a property are not."""

    def reset(self, **row):
        return None

    @staticmethod
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    @classmethod
    def make(cls, x: int) -> int:
        return x

    @property
    def size(self) -> int:
        return 1

    def _helper(self, x: int) -> int:
        return x

    def __len__(self) -> int:
        return 0


def qwen_tokenizer():
    """The character tokenizer with TRL's shipped Qwen2.5 template (<|im_end|> is EOS), so TRL's trainer accepts it."""
    from trl.chat_template_utils import add_response_schema

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (pkg_resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return add_response_schema(tokenizer)


@pytest.fixture(scope="module")
def qwen():
    tokenizer = qwen_tokenizer()
    spec = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=2048)
    return tokenizer, build_tiny_llama(tokenizer, spec).eval()


def trl_prompts(tmp_path, tokenizer, model, factory, rows, tools=None):
    """TRL's trainer with ``environment_factory=factory``: its tools per environment, and the prompt ids its
    ``_generate_and_score_completions`` builds for ``rows`` (reset, the text appended, the per-row schemas)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(rows), num_generations=len(rows), max_completion_length=8,
                      report_to="none", use_cpu=True, save_strategy="no")
    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], environment_factory=factory, tools=tools)
    seen = {}

    class Stop(Exception):
        pass

    def generate(prompts):  # the prompts after reset, tokenized by TRL's own method; then stop before sampling
        seen["prompts"], seen["ids"] = prompts, trainer._tokenize_prompts(prompts)[0]
        raise Stop

    trainer._generate = generate
    with pytest.raises(Stop):
        trainer._generate_and_score_completions([dict(r) for r in rows])
    return trainer, seen["ids"]


def rlalign_prompt_ids(out) -> list[list[int]]:
    return [out.rollout.prompt_ids[r][out.rollout.prompt_mask[r].bool()].tolist() for r in range(out.rollout.prompt_ids.shape[0])]


def test_protocols_are_told_apart_and_ambiguity_names_the_class():
    from rlalign.agents.trl_environment import TRLEnvironment, protocol

    assert protocol(Counter()) == "trl" and protocol(Busy()) == "trl"  # get_reward; reset(**row)
    assert protocol(L.LookupEnvironment()) == "rlalign" and protocol(FunctionTools([L.lookup])) == "rlalign"
    assert isinstance(EnvRunner(Counter()).env, TRLEnvironment) and EnvRunner(Counter()).env.env.__class__ is Counter
    assert type(EnvRunner(L.LookupEnvironment()).env) is L.LookupEnvironment  # rlalign's: not wrapped

    class Both(Counter):
        tools = ["increment"]

    class Either:
        def reset(self, record, **row):
            return record

    for cls in (Both, Either):
        with pytest.raises(ValueError, match=f"environment {cls.__name__}"):
            EnvRunner(cls())


def test_tools_and_schemas_are_trls(tmp_path, qwen):
    from transformers.utils import get_json_schema

    tokenizer, model = qwen
    trainer, _ = trl_prompts(tmp_path, tokenizer, model, Busy, [{"prompt": [{"role": "user", "content": "hi"}]}] * 2)
    runner = EnvRunner(environment_factory(Busy)())
    assert [t.__name__ for t in trainer._env_tools[None]] == list(runner.tools) == ["add", "shout"]
    assert runner.schemas() == [get_json_schema(t) for t in trainer._env_tools[None]]


@pytest.mark.parametrize("start", [0, 4], ids=["reset-None", "reset-text"])
def test_prompt_ids_tool_calls_and_reward_of_an_episode_equal_trls(start, tmp_path, qwen, monkeypatch):
    # row 0 calls increment(step=3) then answers; row 1 answers at once: rewards start + 3 and start (get_reward reads n)
    tokenizer, model = qwen
    rows = [{"prompt": [{"role": "user", "content": "count"}], "start": start}] * 2
    _, trl_ids = trl_prompts(tmp_path, tokenizer, model, Counter, rows)
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call><|im_end|>'
    script_texts(monkeypatch, tokenizer, [call + "done<|im_end|>", "done<|im_end|>"])
    out = ep.run_episodes(model, tokenizer, rows, environment_factory(Counter), SamplingParams(max_new_tokens=80, temperature=1.0), max_turns=3)
    assert rlalign_prompt_ids(out) == [list(ids) for ids in trl_ids]
    assert ("Start at 4." in tokenizer.decode(trl_ids[0])) == (start == 4)
    assert out.conversations[0][-2] == {"role": "tool", "name": "increment", "content": str(start + 3), "tool_call_id": "c00000000"}
    assert out.env_rewards == [float(start + 3), float(start)] and rows[0]["prompt"][0]["content"] == "count"  # the record is left as it was


class Echo:
    def reset(self, **row):
        return " Echo mode."

    def echo(self, text: str) -> str:
        """Repeat the text.

        Args:
            text: What to repeat.
        """
        return text


ENVIRONMENTS = {"counter": Counter, "echo": Echo}  # environment.class may name a dict: tests.agents.test_trl_environment:ENVIRONMENTS


def test_a_dict_of_environments_picks_each_rows_by_its_environment_column(tmp_path, qwen, monkeypatch):
    # TRL's multi-environment form: each row's prompt shows only its environment's tools; the column is not passed to reset
    tokenizer, model = qwen
    rows = [{"prompt": [{"role": "user", "content": "go"}], "environment": name, "start": 2} for name in ("counter", "echo")]
    factories = {"counter": Counter, "echo": Echo}
    _, trl_ids = trl_prompts(tmp_path, tokenizer, model, factories, rows)
    script_texts(monkeypatch, tokenizer, ["ok<|im_end|>"] * 2)
    out = ep.run_episodes(model, tokenizer, rows, environment_factory(factories), SamplingParams(max_new_tokens=8, temperature=1.0), max_turns=1)
    assert rlalign_prompt_ids(out) == [list(ids) for ids in trl_ids]
    assert out.env_rewards == [2.0, None]  # Echo has no get_reward: no reward, as TRL's None
    runner = EnvRunner(environment_factory("tests.agents.test_trl_environment:ENVIRONMENTS")())
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.reset(rows[1]))
    assert list(runner.tools) == ["echo"] and loop.run_until_complete(runner.respond([ToolCall("echo", {"text": "hey"})]))[0]["content"] == "hey"
    with pytest.raises(ValueError, match="environment='nowhere'"):
        loop.run_until_complete(runner.reset({**rows[0], "environment": "nowhere"}))
    loop.close()


class TRLLookup:
    """The look-up task as a TRL environment: reset(**row) keeps the answer column, get_reward() reads the state."""

    scored: list[tuple[str, float]] = []  # (answer, reward) of each get_reward call (the test reads it)

    def reset(self, **row):
        self.answer, self.lookups = row["answer"], 0

    def lookup(self, name: str) -> str:
        """Look up an item of the catalogue by name and return its attributes.

        Args:
            name: The item's name, e.g. "brom".
        """
        self.lookups += 1
        return L.lookup(name)

    def get_reward(self) -> float:
        value = len(self.answer) + 10.0 * self.lookups
        TRLLookup.scored.append((self.answer, value))
        return value


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from rlalign.tasks.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)


@pytest.mark.parametrize("entry", ["config", "python"])
def test_the_environments_get_reward_is_the_reward_trained_on(entry, tiny_path, tmp_path, monkeypatch):
    # environment.class: module:Class, or train(environment=Class): get_reward() of each episode is its term "environment"
    seen = []
    real = ep.run_episodes
    monkeypatch.setattr("rlalign.train.env_source.run_episodes", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    monkeypatch.setattr(TRLLookup, "scored", [])
    fields = {"model.path": str(tiny_path), "output_dir": str(tmp_path), "data.task": "arithmetic", "rewards": [], "steps": 1, "prompts_per_step": 2,
              "group_size": 2, "sampling.max_new_tokens": 8, "beta": 0.0, "progress": False, "plots": False, "eval.enabled": False,
              "environment.max_turns": 2}
    if entry == "config":
        fields["environment.class"] = "tests.agents.test_trl_environment:TRLLookup"
    cfg = load_config(grpo.GRPOConfig, None, fields)
    records = L.prompt_records("train", 8)
    history = grpo.train(cfg, prompts=records, environment=TRLLookup if entry == "python" else None).history[0]
    rewards = [value for _, value in TRLLookup.scored]  # in the order the episodes ended
    assert sorted(seen[0].env_rewards) == sorted(rewards) and len(rewards) == 4
    assert {answer for answer, _ in TRLLookup.scored} <= {r["answer"] for r in records}  # the answer column reached reset
    assert history["reward/environment/mean"] == pytest.approx(sum(rewards) / 4)


def test_reward_functions_get_the_episodes_environments_as_trl_passes_them(tiny_path, tmp_path, monkeypatch):
    # TRL hands reward functions `environments`, each row's environment object as the user wrote it (a reward reading
    # its state, or `type(e) is Class`); they got no such keyword (TypeError: missing argument 'environments')
    seen = []

    def lookups_made(completions, environments, answer, **kwargs):
        assert [e.answer for e in environments] == answer  # each row's own environment, in the rows' order (the row's answer column)
        seen.append([(type(e), e.lookups, e.answer) for e in environments])
        return [float(e.lookups) for e in environments]

    monkeypatch.setattr(TRLLookup, "scored", [])
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(tiny_path), "output_dir": str(tmp_path), "data.task": "arithmetic", "rewards": [], "steps": 1, "prompts_per_step": 2,
        "group_size": 2, "sampling.max_new_tokens": 8, "beta": 0.0, "progress": False, "plots": False, "eval.enabled": False,
        "environment.max_turns": 2})
    records = L.prompt_records("train", 8)
    history = grpo.train(cfg, prompts=records, environment=TRLLookup, reward_functions=[lookups_made]).history[0]
    assert len(seen) == 1 and len(seen[0]) == 4 and all(kind is TRLLookup for kind, _, _ in seen[0])  # the user's objects, unwrapped
    answers = [r["answer"] for r in records]
    assert all(answer in answers for _, _, answer in seen[0])  # each episode's own instance, reset with its row
    assert history["reward/lookups_made/mean"] == pytest.approx(sum(n for _, n, _ in seen[0]) / 4)


def test_reward_functions_get_the_prompt_as_reset_made_it(tmp_path, qwen, monkeypatch):
    # TRL scores the prompt it generated from, reset's text appended; the reward functions got the record's prompt
    from rlalign.lm.data import PromptExample
    from rlalign.train import distributed
    from rlalign.train.env_source import episode_rows
    from rlalign.train.rollouts import RewardTerm, score_shard

    tokenizer, model = qwen
    rows = [{"prompt": [{"role": "user", "content": "count"}], "start": 4}]
    script_texts(monkeypatch, tokenizer, ["done<|im_end|>"])
    out = ep.run_episodes(model, tokenizer, rows, environment_factory(Counter), SamplingParams(max_new_tokens=20, temperature=1.0), max_turns=2)
    seen = []
    term = RewardTerm("seen", 1.0, lambda prompts, completions, **kw: seen.extend(prompts) or [0.0] * len(prompts))
    scored = score_shard([term], tokenizer, [PromptExample(rows[0]["prompt"], {"start": 4})], out.rollout, out.final_texts, 1, distributed.World(),
                         step=1, max_steps=1, episodes=episode_rows(out))
    assert seen == [[{"role": "user", "content": "count Start at 4."}]]  # what the policy saw, as TRL passes it
    assert "Start at 4." in scored.prompts[0]  # the samples table shows it too


def test_tools_given_beside_a_trl_environment_come_first_as_trls(tmp_path, qwen, monkeypatch):
    # TRL's GRPOTrainer(tools=[...], environment_factory=...): the standalone tools, then the environment's methods, in
    # every prompt's schema; it was refused ("tools=[...] and an environment were both given")
    from transformers.utils import get_json_schema

    from rlalign.agents.trl_environment import with_standalone_tools
    from rlalign.train.env_source import train_tools

    tokenizer, model = qwen
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}] * 2
    trainer, trl_ids = trl_prompts(tmp_path, tokenizer, model, Busy, rows, tools=[L.lookup])
    _, make_env = train_tools(load_config(grpo.GRPOConfig, None, {"environment.max_turns": 2}), [L.lookup], Busy)
    runner = EnvRunner(make_env())
    assert [t.__name__ for t in trainer._env_tools[None]] == list(runner.tools) == ["lookup", "add", "shout"]
    assert runner.schemas() == [get_json_schema(t) for t in trainer._env_tools[None]]
    script_texts(monkeypatch, tokenizer, ["done<|im_end|>", "done<|im_end|>"])
    out = ep.run_episodes(model, tokenizer, rows, make_env, SamplingParams(max_new_tokens=20, temperature=1.0), max_turns=2)
    assert rlalign_prompt_ids(out) == [list(ids) for ids in trl_ids]
    with pytest.raises(ValueError, match="only TRL's environment classes take tools given apart"):
        with_standalone_tools(L.LookupEnvironment, [L.lookup])
