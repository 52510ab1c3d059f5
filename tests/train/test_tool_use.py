"""Multi-turn tool use in GRPO rollouts: the masks, the log-probs, tool errors, the config wiring,
and a learning test on the embedded multiplication task."""

from __future__ import annotations

import pytest
import torch

from rlalign.config import ConfigError, load_config
from rlalign.lm.models import load_policy, load_tokenizer
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import SamplingParams
from rlalign.lm.tools import TAG, ToolCall, ToolEnvironment, ToolFormat, ToolRegistry
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo
from rlalign.train import tool_rollout as tr
from rlalign.train.passes import rollout_token_logprobs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return load_tokenizer(tiny_path)


def scripted_sampler(tokenizer, turns: list[list[str]]):
    """A stand-in for ``sample``: call k returns ``turns[k]`` (one text per active row; "<eos>" at the end
    is the EOS token), with log-prob -0.5 on every token."""
    calls = iter(turns)

    def fake_sample(model, prompts, params, pad, stop, group_size, generator=None, noise=None):
        texts = next(calls)
        assert len(texts) == len(prompts)
        rows = [tokenizer(t.removesuffix("<eos>"), add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if t.endswith("<eos>") else []) for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        n = len(prompts)
        prompt_ids = torch.ones((n, 1), dtype=torch.long)
        return Rollout(prompt_ids, torch.ones_like(prompt_ids), ids, mask, -0.5 * mask.float(), torch.arange(n), torch.zeros(n, dtype=torch.bool))

    return fake_sample


def tool_spans(text: str) -> list[int]:
    """1 on the characters of every <result>...</result> (one token per character; "<eos>" is one token)."""
    text = text.replace("<eos>", "#")
    tool = [0] * len(text)
    start = 0
    while (i := text.find("<result>", start)) != -1:
        j = text.index("</result>", i) + len("</result>")
        tool[i:j] = [1] * (j - i)
        start = j
    return tool


def test_tool_tokens_are_masked_and_turns_are_cut_after_the_closing_tag(tokenizer, monkeypatch):
    monkeypatch.setattr(tr, "sample", scripted_sampler(tokenizer, [
        # rows 0, 1: "37*48=", rows 2, 3: "1/0="; row 0 drew past its call (cut), row 3 ran out of tokens without a call
        ["<tool>calculator: 37*48</tool>junk", "12<eos>", "<tool>calculator: 1/0</tool>", "99"],
        ["1776<eos>", "<tool>calculator: 2+2</tool>"],  # rows 0 and 2
        ["<tool>calculator: 5</tool>"],  # row 2's third turn: max_turns, its call is not run
    ]))
    registry = ToolRegistry.builtin(["calculator"])
    out = tr.tool_rollout(None, tokenizer, [{"prompt": "37*48="}, {"prompt": "1/0="}], lambda: ToolEnvironment(registry, TAG, 3), TAG,
                          SamplingParams(8), group_size=2, max_turns=3)
    texts = [tokenizer.decode(ids[m.bool()].tolist()) for ids, m in zip(out.rollout.completion_ids, out.rollout.completion_mask)]
    assert texts == [
        "<tool>calculator: 37*48</tool><result>1776</result>1776<eos>",
        "12<eos>",
        "<tool>calculator: 1/0</tool><result>error: division by zero</result><tool>calculator: 2+2</tool><result>4</result><tool>calculator: 5</tool>",
        "99",
    ]
    assert out.final_texts == ["1776", "12", "<tool>calculator: 5</tool>", "99"]
    assert out.rollout.truncated.tolist() == [False, False, True, True]
    assert out.turns.tolist() == [2, 1, 3, 1] and out.tool_messages.tolist() == [1, 0, 2, 0]
    assert out.rollout.group_index.tolist() == [0, 0, 1, 1]
    for row, text in enumerate(texts):
        assistant = [1 - t for t in tool_spans(text)]
        n = len(assistant)
        assert out.assistant_mask[row].tolist() == assistant + [0] * (out.assistant_mask.shape[1] - n)  # exactly the tool tokens are 0
        assert out.rollout.logprobs[row, :n].tolist() == [-0.5 * a for a in assistant]
    assert tokenizer.decode(out.rollout.prompt_ids[2][out.rollout.prompt_mask[2].bool()].tolist()) == "<bos>1/0="


class EchoEnvironment:
    """Answers every turn with a tool message "ok" until ``max_turns`` (any text is a call)."""

    def __init__(self, max_turns: int):
        self.max_turns, self.turns = max_turns, 0

    def reset(self, record):
        return record["prompt"]

    def step(self, text):
        self.turns += 1
        return [{"role": "tool", "content": "ok"}], self.turns >= self.max_turns, float(len(text))


def test_sampler_logprobs_of_assistant_tokens_equal_the_training_forward(tiny_path, tokenizer):
    model = load_policy(tiny_path)
    out = tr.tool_rollout(model, tokenizer, [{"prompt": "12+3="}, {"prompt": "7*8*9="}], lambda: EchoEnvironment(3), TAG, SamplingParams(5),
                          group_size=3, max_turns=3, generator=torch.Generator().manual_seed(0))
    assert (out.turns == 3).any() and (out.assistant_mask == 0).logical_and(out.rollout.completion_mask == 1).any()  # tool tokens between turns
    training = rollout_token_logprobs(model, out.rollout, 1.0)  # (B, C) one forward over prompt + every turn
    sampled = out.assistant_mask.bool()
    torch.testing.assert_close(out.rollout.logprobs[sampled], training[sampled], rtol=0, atol=2e-5)  # ratio 1 before any update
    assert (out.rollout.logprobs[~sampled] == 0).all()
    assert out.env_rewards == [float(len(t)) for t in out.final_texts]  # the last turn's reward


def test_a_tool_that_raises_is_a_message_not_a_crash(tokenizer, monkeypatch):
    def broken(_: str) -> str:
        raise KeyError("no such thing")

    monkeypatch.setattr(tr, "sample", scripted_sampler(tokenizer, [["<tool>broken: x</tool>"], ["done<eos>"]]))
    registry = ToolRegistry().register_tool("broken", broken)
    out = tr.tool_rollout(None, tokenizer, [{"prompt": "q"}], lambda: ToolEnvironment(registry, TAG, 3), TAG, SamplingParams(8), max_turns=3)
    assert tokenizer.decode(out.rollout.completion_ids[0].tolist()) == "<tool>broken: x</tool><result>error: KeyError: 'no such thing'</result>done<eos>"
    assert out.final_texts == ["done"]


def shout(text: str) -> str:
    return text.upper() + "!"


def test_the_registry_of_a_config_imports_user_tools_and_adds_python_ones():
    registry = tr.tool_registry(tr.ToolsConfig(enabled=["calculator", "tests.train.test_tool_use:shout"]), {"twice": lambda s: s * 2})
    assert sorted(registry.tools) == ["calculator", "shout", "twice"]
    assert registry.call(ToolCall("shout", "hi")) == "HI!" and registry.call(ToolCall("twice", "ab")) == "abab"
    with pytest.raises(ConfigError, match="cannot be imported"):
        tr.tool_registry(tr.ToolsConfig(enabled=["tests.train.test_tool_use:nothing"]))


def test_a_single_token_closing_tag_is_a_stop_token(tokenizer):
    assert tr._stop_token(tokenizer, TAG) == []  # "</tool>" is 7 characters here
    assert tr._stop_token(tokenizer, ToolFormat("x", "<", ">", "[", "]", False)) == [tokenizer.convert_tokens_to_ids(">")]


# ----------------------------------------------------------------------------------------------
# GRPO with tools
# ----------------------------------------------------------------------------------------------


def make_cfg(tiny_path, tmp_path, **overrides) -> grpo.GRPOConfig:
    base = {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic", "rewards": [], "steps": 2,
        "prompts_per_step": 2, "group_size": 4, "sampling.max_new_tokens": 32, "optim.lr": 3e-3, "beta": 0.0, "progress": False,
        "overwrite": True, "plots": False, "tools.max_turns": 3, "tools.format": "tag",
    }
    base.update(overrides)
    return load_config(grpo.GRPOConfig, None, base)


def test_grpo_with_tools_scores_the_last_turn_and_leaves_tool_tokens_out_of_the_loss(tiny_path, tmp_path, tokenizer, monkeypatch):
    def script(model, prompts, params, pad, stop, group_size, generator=None, noise=None):  # a call first, then the answer copied from the result
        texts = ["42<eos>" if "<result>" in tokenizer.decode(p) else "<tool>calculator: 6*7</tool>" for p in prompts]
        return scripted_sampler(tokenizer, [texts])(model, prompts, params, pad, stop, group_size, generator)

    monkeypatch.setattr(tr, "sample", script)
    seen = []
    real_loss = grpo.grpo_loss

    def spy_loss(policy, rollout, advantages, mask, *args):
        seen.append((rollout, mask))
        return real_loss(policy, rollout, advantages, mask, *args)

    monkeypatch.setattr(grpo, "grpo_loss", spy_loss)
    answers = []

    def is_42(prompts, completions):
        answers.extend(completions)
        return [float(c == "42") for c in completions]

    result = grpo.train(make_cfg(tiny_path, tmp_path, **{"eval.enabled": False}), reward_functions=[grpo.RewardTerm("is_42", 1.0, is_42)], prompts=[{"prompt": "6*7="}] * 4)
    assert answers == ["42"] * 16  # the reward sees the final answer, 8 rows x 2 steps
    assert result.history[0]["tools/turns"] == 2.0 and result.history[0]["tools/messages"] == 1.0
    assert result.history[0]["reward/mean"] == 1.0
    rollout, mask = seen[0]
    text = "<tool>calculator: 6*7</tool><result>42</result>42<eos>"
    assert tokenizer.decode(rollout.completion_ids[0].tolist()) == text
    assert mask.tolist() == [[1.0 - t for t in tool_spans(text)]] * 8  # 0 exactly on the tool's tokens
    # every row the same: the share of tool tokens is the tool span's tokens over the completion's
    assert result.history[0]["tools/tokens_frac"] == pytest.approx(sum(tool_spans(text)) / len(tool_spans(text)), abs=1e-6)


def test_a_run_with_tools_is_evaluated_on_held_out_episodes_by_hand(tiny_path, tmp_path, tokenizer, monkeypatch):
    # every episode calls the calculator on its prompt's sum, then answers the result: "6*7=" episodes answer 42 (reward 1),
    # "1+1=" episodes 2 (reward 0), so success = pass@1 = pass@2 = 1/2, two turns and one tool message per episode
    def script(model, prompts, params, pad, stop, group_size, generator=None, noise=None):
        texts = []
        for p in prompts:
            text = tokenizer.decode(p, skip_special_tokens=True)
            if "<result>" in text:
                texts.append(text.split("<result>")[-1].split("</result>")[0] + "<eos>")
            else:
                texts.append("<tool>calculator: " + ("6*7" if "6*7" in text else "1+1") + "</tool>")
        return scripted_sampler(tokenizer, [texts])(model, prompts, params, pad, stop, group_size, generator)

    monkeypatch.setattr(tr, "sample", script)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"prompt": "6*7="}\n{"prompt": "1+1="}\n' * 2)
    cfg = make_cfg(tiny_path, tmp_path, steps=1, **{"eval.data.path": str(held_out), "eval.num_samples": 2, "eval.temperature": 1.0, "eval.num_samples_logged": 3})
    is_42 = grpo.RewardTerm("is_42", 1.0, lambda prompts, completions: [float(c == "42") for c in completions])
    result = grpo.train(cfg, reward_functions=[is_42], prompts=[{"prompt": "6*7="}] * 4)
    evals = [h for h in result.history if "eval/success" in h]  # after the last step
    assert len(evals) == 1
    assert {k: evals[0][k] for k in ("eval/success", "eval/pass@1", "eval/pass@2", "eval/reward/mean", "eval/turns", "eval/tool_messages")} == {
        "eval/success": 0.5, "eval/pass@1": 0.5, "eval/pass@2": 0.5, "eval/reward/mean": 0.5, "eval/turns": 2.0, "eval/tool_messages": 1.0}
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["completion"], r["final"], r["reward"]) for r in rows[-3:]] == [
        ("6*7=", "<tool>calculator: 6*7</tool><result>42</result>42", "42", 1.0), ("6*7=", "<tool>calculator: 6*7</tool><result>42</result>42", "42", 1.0),
        ("1+1=", "<tool>calculator: 1+1</tool><result>2</result>2", "2", 0.0)]


def test_tools_are_one_process_and_single_options_only(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="not supported with multi-turn"):
        make_cfg(tiny_path, tmp_path, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="unknown built-in tool"):
        grpo.train(make_cfg(tiny_path, tmp_path, **{"tools.enabled": ["shell"]}), reward_functions=[grpo.RewardTerm("r", 1.0, lambda p, c: [0.0] * len(c))])
    with pytest.raises(ConfigError, match="cfg.tools is null"):
        grpo.train(make_cfg(tiny_path, tmp_path, tools=None), tools={"f": str})


# ----------------------------------------------------------------------------------------------
# The embedded multiplication task
# ----------------------------------------------------------------------------------------------


def test_multiplication_records_splits_and_reward():
    from rlalign.tasks import TASKS, multiplication as mul

    train = {r["prompt"] for r in mul.prompt_records("train", 500, seed=1)}
    held_out = {r["prompt"] for r in mul.prompt_records("eval", 50, seed=1)}
    assert not train & held_out and len(held_out) == 50
    records = mul.sft_records("train", 400, seed=0, tool_share=0.5)
    with_tool = [r for r in records if r["completion"].startswith("<tool>")]
    assert 150 < len(with_tool) < 250  # about half
    prompt, completion = with_tool[0]["prompt"], with_tool[0]["completion"]
    a, b = (int(x) for x in prompt.removesuffix("=").split("*"))
    assert completion == f"<tool>calculator: {a}*{b}</tool><result>{a * b}</result>{a * b}"
    assert len(completion) + 1 <= TASKS["multiplication"].max_new_tokens  # + EOS
    # the final answer: after the last </result> or </tool>, or the whole text
    assert mul.reward(["37*48="] * 5, ["1776", " 1776 ", "<tool>calculator: 37*48</tool><result>1776</result>1776", "<tool>calculator: 37*48</tool>1776",
                                       "<tool>calculator: 37*48</tool><result>1776</result>1777"]) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert mul.reward(["37*48="], ["<result>1776</result>"]) == [0.0]  # the copied result alone is no answer
    with pytest.raises(ValueError, match="not a multiplication prompt"):
        mul.correct("1+2=", "3")


# ----------------------------------------------------------------------------------------------
# Learning test: GRPO with a calculator raises the multiplication success rate from an SFT start
# ----------------------------------------------------------------------------------------------


def sft_on_transcripts(tokenizer, records: list[dict], steps: int, seed: int = 0) -> torch.nn.Module:
    """A fresh tiny Llama trained on prompt -> completion pairs, the loss on completion tokens except
    the tool's <result>...</result> (as the GRPO loss leaves tool tokens out): the model learns to call
    and to copy what comes back, not to guess the product."""
    from rlalign.tasks.tiny_model import train_on_rows

    rows = []
    for r in records:
        prompt = tokenizer(r["prompt"])["input_ids"]
        completion = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        labels = [-100] * len(prompt) + completion  # one token per character
        if "<result>" in r["completion"]:
            i, j = r["completion"].index("<result>"), r["completion"].index("</result>") + len("</result>")
            labels[len(prompt) + i : len(prompt) + j] = [-100] * (j - i)
        rows.append((prompt + completion, labels))
    return train_on_rows(tokenizer, rows, steps, seed)


def success_rates(model, tokenizer, records: list[dict], samples: int = 2) -> tuple[float, float]:
    """(success with the calculator's results fed back, success without tools: the model's own text
    after its call scored as is), sampled at temperature 1 with a fixed seed."""
    from rlalign.lm.encoding import encode_prompts
    from rlalign.lm.sampling import sample
    from rlalign.tasks import multiplication as mul

    prompts = [r["prompt"] for r in records for _ in range(samples)]
    registry = ToolRegistry.builtin(["calculator"])
    with_tools = tr.tool_rollout(model, tokenizer, records, lambda: ToolEnvironment(registry, TAG, 2), TAG, SamplingParams(32), samples, 2,
                                 torch.Generator().manual_seed(1))
    alone = sample(model, encode_prompts(tokenizer, [r["prompt"] for r in records]), SamplingParams(56), tokenizer.pad_token_id, [tokenizer.eos_token_id],
                   samples, torch.Generator().manual_seed(1))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return mean(mul.reward(prompts, with_tools.final_texts)), mean(mul.reward(prompts, alone.decode_completions(tokenizer)))


@pytest.mark.slow
def test_grpo_with_a_calculator_raises_the_multiplication_success_rate(tmp_path):
    """SFT on transcripts that call the calculator half the time (the other half answer directly,
    which a tiny model cannot do), then GRPO with the calculator: the success rate rises because the
    policy learns to call; without the tool's result fed back the same policy almost never succeeds,
    and GRPO without tools does not raise it.

    Measured (64 held-out prompts x 2 samples): with tools 0.41 -> 0.91, calls per completion 0.34 ->
    0.97; SFT / GRPO seeds 1 and 3: 0.27 -> 0.84 and 0.30 -> 0.94; without tools 0 throughout. At
    optim.lr = 2e-3 GRPO collapses (the answer after the result loses its EOS), hence 5e-4."""
    from rlalign.tasks import multiplication as mul
    from rlalign.tasks.tiny_model import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = sft_on_transcripts(tokenizer, mul.sft_records("train", 5000, seed=0, tool_share=0.5), steps=250)
    model.save_pretrained(tmp_path / "sft")
    tokenizer.save_pretrained(tmp_path / "sft")
    held_out = mul.prompt_records("eval", 64, seed=0)
    start, start_alone = success_rates(model, tokenizer, held_out)

    def run_grpo(name: str, **overrides):
        cfg = load_config(grpo.GRPOConfig, None, {
            "model.path": str(tmp_path / "sft"), "output_dir": str(tmp_path / name), "data.task": "arithmetic", "steps": 20, "prompts_per_step": 8,
            "group_size": 8, "sampling.max_new_tokens": 32, "optim.lr": 5e-4, "beta": 0.0, "progress": False, "plots": False,
            "tools.max_turns": 2, "tools.format": "tag", **overrides,
        })
        return grpo.train(cfg, reward_functions=[grpo.RewardTerm("correct", 1.0, mul.reward)], prompts=mul.prompt_records("train", 512, seed=1))

    result = run_grpo("tools")
    end, end_alone = success_rates(result.policy.eval(), tokenizer, held_out)
    control = run_grpo("no_tools", tools=None, **{"sampling.max_new_tokens": 56})  # the same run, single-turn: no result comes back
    _, control_alone = success_rates(control.policy.eval(), tokenizer, held_out)
    print(f"success with tools {start:.3f} -> {end:.3f} (without tools {start_alone:.3f} -> {end_alone:.3f}); "
          f"calls per completion {result.history[0]['tools/messages']:.2f} -> {result.history[-1]['tools/messages']:.2f}; "
          f"GRPO without tools: {start_alone:.3f} -> {control_alone:.3f}")
    assert start <= 0.65  # SFT: the calculator called only part of the time
    assert end >= max(start + 0.25, 0.6)
    assert end_alone <= 0.1  # the policy's own text after its call is not the product: the tool's result is what counts
    assert control_alone <= 0.1  # GRPO cannot teach the tiny model to multiply


@pytest.mark.parametrize("own_copy", [False, True], ids=["policy-samples", "sampling-copy"])
def test_tool_episodes_sample_under_the_policys_autocast_unless_a_sampling_copy_holds_its_own_precision(tiny_path, tokenizer, own_copy, monkeypatch):
    from types import SimpleNamespace

    policy = load_policy(tiny_path)
    sampler = load_policy(tiny_path) if own_copy else policy
    autocast_seen = []
    sampler.register_forward_pre_hook(lambda module, args: autocast_seen.append(torch.is_autocast_enabled("cpu")))
    updater = SimpleNamespace(module=policy, sampler=lambda: sampler)
    sampling = SimpleNamespace(params=lambda: SamplingParams(4), attn_implementation=None)

    def spy(*args, **kwargs):  # the contexts are the test, not the episodes: one forward of the sampler inside them
        sampler(input_ids=torch.tensor([[1, 2]]))
        return "episodes"

    monkeypatch.setattr(tr, "tool_rollout", spy)
    out = tr.sample_tool_shard(updater, tokenizer, [{"prompt": "1+1="}], sampling, SimpleNamespace(autocast="bfloat16"), 2, torch.Generator(),
                               tr.ToolsConfig(enabled=["calculator"]), ToolRegistry.builtin(["calculator"]))
    assert out == "episodes" and autocast_seen == [not own_copy]  # a low-precision copy samples in its own dtype
