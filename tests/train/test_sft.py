"""SFT: the loss falls and task accuracy rises; the CLI runs; a resumed run equals the uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlalign.cli import main
from rlalign.config import ConfigError, load_config
from rlalign.tasks.arithmetic import sft_records
from rlalign.train.metrics import read_metrics
from rlalign.train.sft import SFTConfig, train

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false"]


def _pairs_file(path, n=24):
    path.write_text("\n".join(json.dumps(r) for r in sft_records("train", n, seed=5)) + "\n")
    return str(path)


@pytest.mark.slow
def test_sft_learns_the_training_pairs(tmp_path):
    """24 fixed problems, eval on the same pairs: memorising them is the easiest SFT signal there is.
    A broken loss mask, label shift or optimiser step leaves greedy exact-match accuracy at 0."""
    data = _pairs_file(tmp_path / "pairs.jsonl")
    cfg = load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path / 'run'}", f"data.train_file={data}", f"data.eval_file={data}",
                                                "batch_size=24", "max_steps=120", "eval_every=60", "optim.lr=1e-2", "max_new_tokens=6"])
    result = train(cfg)
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/loss" in r]
    assert result["eval/reward_initial"] == 0.0
    assert result["eval/reward"] >= 0.5, result
    assert evals[-1]["eval/loss"] < 0.5 * evals[0]["eval/loss"]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file() and (tmp_path / "run" / "final" / "tokenizer.json").is_file()


def test_cli_smoke_with_packing_and_builtin_task(tmp_path, capsys):
    code = main(["sft", f"output_dir={tmp_path}", *TINY, "max_steps=2", "eval_every=1", "data.num_train=64", "data.num_eval=8",
                 "data.packing=true", "batch_size=8"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # one summary line naming the output paths
    assert summary["output_dir"] == str(tmp_path) and summary["final"] == str(tmp_path / "final") and "eval/reward" in summary
    assert (tmp_path / "base_model" / "config.json").is_file()  # the tiny model was built in the output dir
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [-1, 0, 1] and "eval/reward" in records[-1]


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    common = TINY + ["data.num_train=64", "data.num_eval=4", "batch_size=8", "eval_every=100", "max_steps=4", "optim.warmup_steps=1", "save_every=2"]
    train(load_config(SFTConfig, None, common + [f"output_dir={tmp_path / 'full'}"]))
    # a second run that starts from the full run's checkpoint after 2 steps (steps 0-1 done) and does steps 2-3
    step1 = tmp_path / "full" / "checkpoints" / "step_00000002"
    train(load_config(SFTConfig, None, common + [f"output_dir={tmp_path / 'resumed'}"]), resume=step1)
    full = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "final" / "model.safetensors"))
    before = load_file(str(step1 / "model" / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert (full[name] - before[name]).abs().max() > 1e-4  # steps 2-3 changed the weights
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=1e-6)


def test_bad_config_and_resume_path_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'batchsize'"):
        load_config(SFTConfig, None, ["batchsize=3"])
    with pytest.raises(ConfigError, match="data.eval_file is required"):
        load_config(SFTConfig, None, ["data.train_file=x.jsonl"])
    assert main(["sft", "optim.lr=-1"]) == 2
    from rlalign.train.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        train(load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path}", "data.num_train=8", "data.num_eval=2"]), resume=tmp_path)


def test_lora_sft_saves_an_adapter_that_reloads(tmp_path):
    from rlalign.lm.models import load_policy

    assert main(["sft", f"output_dir={tmp_path}", *TINY, "max_steps=2", "eval_every=2", "data.num_train=16", "data.num_eval=4", "batch_size=4", "model.lora.r=4"]) == 0
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    policy = load_policy(tmp_path / "final")
    assert any("lora" in name for name, p in policy.named_parameters() if p.requires_grad)


def test_bfloat16_autocast_trains(tmp_path):
    # model.autocast is honoured by SFT too (forward under bfloat16 autocast, float32 master weights)
    cfg = load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path}", "max_steps=40", "eval_every=40", "data.num_train=256", "data.num_eval=8",
                                                "model.autocast=bfloat16", "optim.lr=3e-3"])
    train(cfg)
    losses = [r["loss/sft"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss/sft" in r]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert next((tmp_path / "final").glob("*.safetensors")).is_file()


@pytest.mark.parametrize("task", ["lookup", "lookup_value", "multiplication"])
def test_the_tool_tasks_train_on_their_whole_conversations_and_a_cut_that_loses_every_target_is_an_error(tmp_path, task, capsys):
    # the look-up conversations are ~190-210 tokens with the tiny tokenizer: the default max_length keeps every target token
    from rlalign.lm.data import DataError, load_sft
    from rlalign.lm.encoding import example_tokens
    from rlalign.lm.models import load_tokenizer
    from rlalign.tasks import TASKS

    cfg = load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path / 'run'}", f"data.task={task}", "max_steps=1", "eval_every=1", "batch_size=4",
                                                "data.num_train=4", "data.num_eval=2", "model.tiny.num_layers=1"])
    train(cfg)
    assert "data: max_length=256 cuts 0 of the 6 rows checked" in capsys.readouterr().out
    tokenizer = load_tokenizer(tmp_path / "run" / "final")
    examples = load_sft(TASKS[task].sft_records("train", 4, cfg.seed))
    targets = sum(sum(example_tokens(tokenizer, ex.prompt, ex.completion)[1]) for ex in examples)
    step = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "tokens" in r][0]
    assert step["tokens"] == targets  # every assistant token of the 4 conversations, none cut
    cut = load_config(SFTConfig, None, TINY + [f"output_dir={tmp_path / 'cut'}", f"data.task={task}", "max_steps=1", "data.max_length=64",
                                                "data.num_train=4", "data.num_eval=2", "batch_size=4"])
    if task == "lookup_value":  # the question alone is ~60 tokens: 64 cuts before the first assistant token
        with pytest.raises(DataError, match="max_length=64 cuts every target token of the example"):
            train(cut)
    else:  # a cut inside the conversation trains on what is left, and says how many rows it shortened
        train(cut)
        assert f"data: max_length=64 cuts {6 if task == 'lookup' else 0} of the 6 rows checked" in capsys.readouterr().out


def test_generation_pairs_of_a_conversation_are_its_turns_before_the_last_answer_and_that_answer():
    from rlalign.lm.data import load_sft
    from rlalign.train.sft import generation_pairs

    talk = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "And?"},
            {"role": "assistant", "content": "4"}]
    examples = load_sft([{"messages": talk}, {"messages": talk[:2]}, {"prompt": "1+1=", "completion": "2"}, {"text": "plain"}])
    assert generation_pairs(examples) == [(talk[:3], "4"), (talk[:1], "Let me think."), ("1+1=", "2")]


def test_file_eval_generates_enough_tokens_to_match_its_longest_reference(tmp_path, capsys):
    # a reference of 44 characters (45 tokens with EOS for the character tokenizer) could never be matched in the 32 tokens
    # generated before, whatever the model learnt: eval/reward stayed 0 on a memorised pair
    from rlalign.tasks.tiny_model import build_char_tokenizer
    from rlalign.train.sft import _datasets, length_report

    long = "a" * 44
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "1+1=", "completion": "2"}, {"prompt": "x", "completion": long}]) + "\n")
    tokenizer = build_char_tokenizer()
    cfg = load_config(SFTConfig, None, [f"data.train_file={data}", f"data.eval_file={data}"])
    assert _datasets(cfg, tokenizer)[2].max_new_tokens == 45  # the longest reference and its EOS
    short = load_config(SFTConfig, None, [f"data.train_file={data}", f"data.eval_file={data}", "data.max_length=20"])
    assert _datasets(short, tokenizer)[2].max_new_tokens == 20  # at most data.max_length: a 5000-token reference decoded 5001 tokens a prompt
    assert length_report(tokenizer, _datasets(cfg, tokenizer)[1], 45) is None
    capped = load_config(SFTConfig, None, [f"data.train_file={data}", f"data.eval_file={data}", "max_new_tokens=32"])
    assert _datasets(capped, tokenizer)[2].max_new_tokens == 32  # as set, and said:
    assert length_report(tokenizer, _datasets(capped, tokenizer)[1], 32).startswith(
        "eval: max_new_tokens=32 is too few for 1 of the 2 eval references (the longest needs 45 tokens with its EOS)")
