"""Data and reward functions made for TRL run unchanged: each trainer reads TRL's dataset types from
files, directories and saved datasets, and GRPO calls reward functions written from TRL's documented
signatures with the values TRL passes (texts, or messages for conversational data; the rows' columns)."""

from __future__ import annotations

import importlib
import json
import math
import statistics

import pytest
import torch
from datasets import Dataset, DatasetDict

from rlalign.config import load_config
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo
from rlalign.train.metrics import read_metrics
from rlalign.train.reward_model import RMConfig
from rlalign.train.reward_model import train as train_rm
from rlalign.train.sft import SFTConfig
from rlalign.train.sft import train as train_sft

torch.set_num_threads(1)

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false"]

# Written as TRL's GRPOTrainer documentation writes them; each also records what it was called with.
TRL_REWARDS = r'''
import re

calls = []


def reward_len(completions, **kwargs):
    scores = [-abs(20 - len(completion)) for completion in completions]
    calls.append(("reward_len", completions, kwargs, scores))
    return scores


def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    scores = [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
    calls.append(("reward_func", completions, kwargs, scores))
    return scores


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    scores = [1.0 if match else 0.0 for match in matches]
    calls.append(("format_reward_func", completions, kwargs, scores))
    return scores
'''


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


def _reward_module(tmp_path, monkeypatch, name: str):
    (tmp_path / f"{name}.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)  # `module:function` imports from the current directory
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _grpo(tiny_path, tmp_path, data: dict, rewards: list[dict]) -> list[dict]:
    overrides = {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "run"), "steps": 1, "prompts_per_step": 2, "group_size": 2,
        "sampling.max_new_tokens": 6, "progress": False, "plots": False, "beta": 0.0, "rewards": rewards,
        **{f"data.{key}": value for key, value in data.items()},
    }
    return grpo.train(load_config(grpo.GRPOConfig, None, overrides)).history


def test_grpo_calls_trl_reward_functions_with_texts_and_the_rows_columns(tiny_path, tmp_path, monkeypatch):
    module = _reward_module(tmp_path, monkeypatch, "trl_rewards_standard")
    rows = [{"question": f"{a}+{a}=", "ground_truth": f"x{2 * a}", "level": a} for a in range(1, 5)]
    Dataset.from_list(rows).to_csv(str(tmp_path / "prompts.csv"), index=False)
    history = _grpo(tiny_path, tmp_path, {"path": str(tmp_path / "prompts.csv"), "columns": {"question": "prompt"}},
                    [{"function": f"{module}:reward_len", "name": "len"}, {"function": f"{module}:reward_func", "name": "boxed"}])
    calls = importlib.import_module(module).calls
    assert [c[0] for c in calls] == ["reward_len", "reward_func"]
    for _, completions, kwargs, scores in calls:
        assert all(isinstance(c, str) for c in completions) and len(completions) == 4
        assert [p.split("+")[0] for p in kwargs["prompts"]] == [str(level) for level in kwargs["level"]]  # each row with its own columns
        assert set(kwargs) >= {"prompts", "completion_ids", "trainer_state", "level"} and kwargs["trainer_state"].global_step == 0
    assert [f"x{2 * level}" for level in calls[0][2]["level"]] == calls[0][2]["ground_truth"]
    assert "ground_truth" not in calls[1][2]  # named by reward_func: passed as that argument
    assert history[0]["reward/len/mean"] == pytest.approx(statistics.mean(calls[0][3]))
    assert history[0]["reward/mean"] == pytest.approx(statistics.mean(calls[0][3]) + statistics.mean(calls[1][3]))


def test_grpo_on_conversational_prompts_passes_messages_to_trl_rewards(tiny_path, tmp_path, monkeypatch):
    module = _reward_module(tmp_path, monkeypatch, "trl_rewards_chat")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in range(1, 5)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    history = _grpo(tiny_path, tmp_path, {"path": str(tmp_path / "chat.jsonl")},
                    [{"function": f"{module}:format_reward_func", "name": "fmt"}, {"function": "exact_match"}])
    (_, completions, kwargs, scores), = importlib.import_module(module).calls
    assert all(isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    assert [str(2 * int(p[0]["content"].split("+")[0])) for p in kwargs["prompts"]] == kwargs["answer"]  # the messages, as in the data
    assert history[0]["reward/fmt/mean"] == statistics.mean(scores)
    assert math.isfinite(history[0]["reward/exact_match/mean"])  # a built-in reads the completions' text


def test_sft_on_conversations_from_a_saved_dataset_with_splits(tmp_path):
    chats = [
        {"messages": [{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 1)}]} for a in range(8)
    ]
    DatasetDict({"train": Dataset.from_list(chats[:6]), "test": Dataset.from_list(chats[6:])}).save_to_disk(str(tmp_path / "chats"))
    data = str(tmp_path / "chats")
    result = train_sft(load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path / 'run'}", f"data.train_file={data}", f"data.eval_file={data}",
                                                             "batch_size=3", "max_steps=2", "eval_every=2", "max_new_tokens=3"]))
    assert math.isfinite(result["eval/loss"]) and 0.0 <= result["eval/reward"] <= 1.0  # the last assistant turn is the reference

    (tmp_path / "texts.jsonl").write_text("\n".join(json.dumps({"text": f"{a}+1={a + 1}"}) for a in range(6)) + "\n")
    texts = str(tmp_path / "texts.jsonl")
    result = train_sft(load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path / 'lm'}", f"data.train_file={texts}", f"data.eval_file={texts}",
                                                             "batch_size=3", "max_steps=2", "eval_every=2"]))
    assert "eval/reward" not in result and math.isfinite(result["eval/loss_initial"])  # plain texts have no prompt to complete
    assert [r for r in read_metrics(tmp_path / "lm" / "metrics.jsonl") if "eval/loss" in r]


def test_reward_model_on_implicit_prompt_conversations(tmp_path):
    def chat(a, reply):
        return [{"role": "user", "content": f"{a}?"}, {"role": "assistant", "content": reply}]

    pairs = [{"chosen": chat(a, "yes"), "rejected": chat(a, "no")} for a in range(8)]
    Dataset.from_list(pairs).to_parquet(str(tmp_path / "prefs.parquet"))
    data = str(tmp_path / "prefs.parquet")
    result = train_rm(load_config(RMConfig, None, TINY + [f"output_dir={tmp_path / 'rm'}", f"data.train_file={data}", f"data.eval_file={data}",
                                                           "batch_size=4", "max_steps=2", "eval_every=2"]))
    assert 0.0 <= result["eval/accuracy"] <= 1.0 and math.isfinite(result["eval/loss"])
