"""A resumption reads what the run started with: inputs changed behind the same path are named
(rlalign.train.run_dir.input_fingerprints), and a checkpoint past the run's end is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from rlalign.config import load_config
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import run_dir
from rlalign.train.checkpoints import CheckpointError, load_checkpoint
from rlalign.train.metrics import read_metrics

SPEC = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
QUIET = ["progress=false", "plots=false", "num_threads=1"]


def _rows(path, n, text="{i}+1="):
    path.write_text("".join(json.dumps({"prompt": text.format(i=i), "completion": str(i + 1)}) + "\n" for i in range(n)))
    return path


def _sft(out, model, data, *overrides):
    from rlalign.train.sft import SFTConfig

    return load_config(SFTConfig, None, [*QUIET, f"output_dir={out}", f"model.path={model}", f"data.train_file={data}", f"data.eval_file={data}",
                                         "batch_size=2", "eval_every=100", "save_every=1", "optim.min_lr_ratio=1.0", *overrides])


def test_input_fingerprints_change_with_the_contents_behind_a_path_and_skip_hub_ids(tmp_path):
    from rlalign.train.sft import SFTConfig

    model = build_tiny_checkpoint(tmp_path / "model", SPEC, seed=0)
    data = _rows(tmp_path / "train.jsonl", 4)
    cfg = load_config(SFTConfig, None, [f"model.path={model}", f"data.train_file={data}", f"data.eval_file={data}"])
    first = run_dir.input_fingerprints(cfg)
    assert sorted(first) == ["data.eval_file", "data.train_file", "model.path"] and first["model.path"]["path"] == str(model)
    assert run_dir.input_fingerprints(cfg) == first  # the same contents: the same fingerprint

    def changed(key) -> bool:
        return run_dir.input_fingerprints(cfg)[key]["fingerprint"] != first[key]["fingerprint"]

    size = data.stat().st_size
    _rows(data, 4, text="{i}-1=")  # as many bytes, other text
    assert data.stat().st_size == size and changed("data.train_file") and not changed("model.path")
    _rows(data, 4)
    assert not changed("data.train_file")
    weights = model / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of the last weight
    assert changed("model.path")
    weights.write_bytes(original)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))  # same weights, another model
    assert changed("model.path")
    shutil.rmtree(model)
    build_tiny_checkpoint(model, SPEC, seed=1)  # another model of the same shape, as an SFT rerun with overwrite=true writes
    assert changed("model.path")

    folder = tmp_path / "dataset"
    folder.mkdir()
    _rows(folder / "part-0.jsonl", 2)
    hub = load_config(SFTConfig, None, ["model.path=org/name", f"data.train_file={folder}", "data.eval_file=org/data"])
    before = run_dir.input_fingerprints(hub)
    assert sorted(before) == ["data.train_file"]  # Hub ids (not local paths) are not fingerprinted
    (folder / ".hidden").write_text("editor state")
    assert run_dir.input_fingerprints(hub) == before
    _rows(folder / "part-1.jsonl", 1)  # another file in the data directory
    assert run_dir.input_fingerprints(hub) != before

    from rlalign.train.distill import DistillConfig
    from rlalign.train.ppo import PPOConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    ppo = load_config(PPOConfig, None, [f"model.path={model}", f"reference={model}", f"critic.path={model}", f"data.path={prompts}", "data.task=null",
                                        f"rewards=[{{reward_model: {model}}}, {{judge: {{model: {model}}}}}]", f"eval.data={{path: {prompts}}}"])
    assert sorted(run_dir.input_fingerprints(ppo)) == ["critic.path", "data.path", "model.path", "reference", "rewards[0].reward_model", "rewards[1].judge.model"]
    distill = load_config(DistillConfig, None, [f"teacher={model}", "model.path=null"])
    assert sorted(run_dir.input_fingerprints(distill)) == ["teacher"]  # (the tiny model built from the config: no input)


def test_a_saved_adapters_base_is_fingerprinted_too(tmp_path):
    """A LoRA adapter directory loads the base its adapter_config.json names: a base replaced behind that path changes
    what the run trains, so it is an input of its own."""
    from rlalign.train.sft import SFTConfig

    base = build_tiny_checkpoint(tmp_path / "base", SPEC, seed=0)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    data = _rows(tmp_path / "train.jsonl", 2)
    cfg = load_config(SFTConfig, None, [f"model.path={adapter}", f"data.train_file={data}", f"data.eval_file={data}"])
    first = run_dir.input_fingerprints(cfg)
    assert sorted(first) == ["data.eval_file", "data.train_file", "model.path", "model.path (its adapter's base)"]
    assert first["model.path (its adapter's base)"]["path"] == str(base)
    shutil.rmtree(base)
    build_tiny_checkpoint(base, SPEC, seed=1)  # the base retrained behind the same path; the adapter untouched
    now = run_dir.input_fingerprints(cfg)
    assert now["model.path"] == first["model.path"] and now["model.path (its adapter's base)"] != first["model.path (its adapter's base)"]


def test_resuming_after_the_model_or_data_changed_behind_the_same_path_is_an_error(tmp_path):
    from rlalign.train.sft import train

    model = build_tiny_checkpoint(tmp_path / "model", SPEC, seed=0)
    data = _rows(tmp_path / "train.jsonl", 8)
    out = tmp_path / "run"
    train(_sft(out, model, data, "max_steps=2"))
    assert load_checkpoint(out).inputs == run_dir.input_fingerprints(_sft(out, model, data))  # recorded as the run started

    shutil.rmtree(model)
    build_tiny_checkpoint(model, SPEC, seed=1)  # model.path rewritten (the SFT stage before it rerun)
    _rows(data, 8, text="{i}*2=")
    with pytest.raises(CheckpointError, match=rf"(?s)changed behind the same path\n  model.path: {model} holds other contents.*\n"
                                              rf"  data.train_file: {data} holds other contents.*original contents.*start a new run"):
        train(_sft(out, model, data, "max_steps=3"), resume=out)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [-1, 0, 1]  # nothing lost

    shutil.rmtree(model)
    build_tiny_checkpoint(model, SPEC, seed=0)
    _rows(data, 8)
    train(_sft(out, model, data, "max_steps=3"), resume=out)  # the original contents back: it resumes
    assert load_checkpoint(out).step == 3 and load_checkpoint(out).inputs == load_checkpoint(out / "checkpoints" / "step_00000002").inputs

    marker = out / "checkpoints" / "step_00000003" / "checkpoint.json"  # a checkpoint of an older rlalign: no record, no check
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "inputs"}))
    _rows(data, 8, text="{i}*2=")
    train(_sft(out, model, data, "max_steps=4"), resume=out)
    assert load_checkpoint(out).inputs == run_dir.input_fingerprints(_sft(out, model, data))  # today's inputs, recorded from now on


def test_a_grpo_resume_refuses_a_replaced_starting_model_its_reference(tmp_path):
    # the audit's case: model.path rewritten between the run and its resumption; the reference (the starting model) was
    # reloaded from the new weights and the KL jumped from 0 to 3.3
    from rlalign.train.grpo import GRPOConfig, train

    model = build_tiny_checkpoint(tmp_path / "model", SPEC, seed=0)
    out = tmp_path / "run"

    def cfg(steps):
        return load_config(GRPOConfig, None, [*QUIET, f"output_dir={out}", f"model.path={model}", f"steps={steps}", "prompts_per_step=2",
                                              "group_size=2", "sampling.max_new_tokens=2", "eval.enabled=false", "rewards=[{function: arithmetic}]"])

    train(cfg(1))
    shutil.rmtree(model)
    build_tiny_checkpoint(model, SPEC, seed=1)
    with pytest.raises(CheckpointError, match=f"model.path: {model} holds other contents than when the run started"):
        train(cfg(2), resume=out)


def test_a_checkpoint_past_the_runs_end_is_an_error_and_one_at_its_end_writes_final(tmp_path, capsys):
    from safetensors.torch import load_file

    from rlalign.train.sft import train

    model = build_tiny_checkpoint(tmp_path / "model", SPEC, seed=0)
    data = _rows(tmp_path / "train.jsonl", 8)
    out = tmp_path / "run"
    train(_sft(out, model, data, "max_steps=2"))
    final = load_file(str(out / "final" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"it is after step 2, past this run's end \(max_steps=1\); resume with max_steps of at least 2"):
        train(_sft(out, model, data, "max_steps=1"), resume=out)  # wrote the 2-step weights as a 1-step run's final/, exit 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [-1, 0, 1]

    shutil.rmtree(out / "final")  # killed after its last checkpoint, before final/
    capsys.readouterr()
    train(_sft(out, model, data, "max_steps=2"), resume=out)
    assert "step_00000002 is at step 2, this run's end: no steps to run" in capsys.readouterr().err
    again = load_file(str(out / "final" / "model.safetensors"))
    assert all(again[k].equal(final[k]) for k in final)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [-1, 0, 1]
