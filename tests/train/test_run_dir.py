"""One run per output directory, resume checks, crash-clean files, no silent NaN, one message per
bad input (rlalign.train.run_dir, rlalign.train.loop, rlalign.cli)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from rlalign.cli import main
from rlalign.config import ConfigError, load_config
from rlalign.lm.rewards import RewardFunctionError, score_completions
from rlalign.train import run_dir
from rlalign.train.checkpoints import CheckpointError, list_checkpoints, load_checkpoint
from rlalign.train.metrics import read_metrics
from rlalign.train.reward_model import RMConfig, train
from rlalign.lm.data import DataError
from rlalign.train.updater import NonFiniteError

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "progress=false"]
RM = [*TINY, "data.num_train=32", "data.num_eval=4", "batch_size=4", "eval_every=100"]


def rm_cfg(out, *overrides) -> RMConfig:
    return load_config(RMConfig, None, [*RM, f"output_dir={out}", *overrides])


def test_a_second_run_on_a_locked_output_dir_fails_at_once(tmp_path):
    lock = run_dir.claim_run_dir(rm_cfg(tmp_path), None)
    try:
        with pytest.raises(ConfigError, match="in use by another rlalign run"):
            train(rm_cfg(tmp_path, "max_steps=1"))
    finally:
        lock.close()
    train(rm_cfg(tmp_path, "max_steps=1"))  # the lock went with its holder


def test_a_fresh_run_refuses_a_used_output_dir_unless_told_to_overwrite(tmp_path):
    train(rm_cfg(tmp_path, "max_steps=2"))
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, checkpoints, final, curves.png, base_model\).*overwrite=true"):
        train(rm_cfg(tmp_path, "max_steps=1"))
    train(rm_cfg(tmp_path, "max_steps=1", "overwrite=true"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [-1, 0]  # nothing of the first run mixed in
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]


def test_a_start_that_failed_before_its_first_step_does_not_block_the_corrected_command(tmp_path):
    # a bad data file is found after the tiny base model was built into output_dir/base_model; the fixed command was
    # refused ("already holds a run (base_model)") and --resume had no checkpoint to go on from
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chosen": "a", "rejected": "b"}\n{"chosen": 1}\n')
    out = tmp_path / "run"
    with pytest.raises(DataError):
        train(rm_cfg(out, f"data.train_file={bad}", f"data.eval_file={bad}", "max_steps=1"))
    assert (out / "base_model").exists()
    train(rm_cfg(out, "max_steps=1"))  # the corrected command
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [-1, 0]
    # anything beyond a failed start's leftovers is a run's, never deleted without overwrite (a tracker's files, samples)
    kept = tmp_path / "kept"
    (kept / "base_model").mkdir(parents=True)
    (kept / "samples.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        train(rm_cfg(kept, "max_steps=1"))
    assert (kept / "samples.jsonl").read_text() == '{"step": 0}\n'


def test_resume_names_every_run_defining_difference_and_allows_more_steps(tmp_path):
    train(rm_cfg(tmp_path / "a", "max_steps=2", "optim.min_lr_ratio=1.0"))
    with pytest.raises(CheckpointError, match=r"(?s)optim.lr: 0.001 in the checkpoint, 0.002 now.*seed: 0 in the checkpoint, 1 now"):
        train(rm_cfg(tmp_path / "b", "max_steps=3", "optim.lr=0.002", "seed=1", "optim.min_lr_ratio=1.0"), resume=tmp_path / "a")
    train(rm_cfg(tmp_path / "a", "max_steps=3", "optim.min_lr_ratio=1.0"), resume=tmp_path / "a")  # more steps at a constant lr: allowed
    train(rm_cfg(tmp_path / "d", "max_steps=2"))
    with pytest.raises(CheckpointError, match=r"max_steps \(the length of the cosine learning-rate schedule\): 2 in the checkpoint, 3 now"):
        train(rm_cfg(tmp_path / "d", "max_steps=3"), resume=tmp_path / "d")
    assert [r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [-1, 0, 1, 2]  # one line a step
    from rlalign.train.sft import SFTConfig
    from rlalign.train.sft import train as sft_train

    with pytest.raises(CheckpointError, match="cannot resume a SFTConfig run from .*: it is a RMConfig checkpoint"):
        sft_train(load_config(SFTConfig, None, [*TINY, f"output_dir={tmp_path / 'c'}"]), resume=tmp_path / "a")


def test_resume_cuts_the_logs_back_and_refuses_a_directory_with_later_checkpoints(tmp_path):
    train(rm_cfg(tmp_path, "max_steps=3", "save_every=1", "keep_last=5"))
    with pytest.raises(CheckpointError, match="holds later checkpoints \\(step_00000003\\)"):
        train(rm_cfg(tmp_path, "max_steps=3", "save_every=1", "keep_last=5"), resume=tmp_path / "checkpoints" / "step_00000002")
    # a run killed after step 3 was logged but before its checkpoint: the log runs ahead of the checkpoint
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")
    train(rm_cfg(tmp_path, "max_steps=3", "save_every=1", "keep_last=5"), resume=tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [-1, 0, 1, 2]


def test_stale_temp_dirs_go_and_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    train(rm_cfg(tmp_path, "max_steps=2", "save_every=1"))
    (tmp_path / "checkpoints" / ".tmp_step_00000003_999").mkdir()
    (tmp_path / ".tmp_final_999").mkdir()
    weights = tmp_path / "checkpoints" / "step_00000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated by a crash
    with pytest.raises(CheckpointError, match="step_00000002 is incomplete: model/model.safetensors has 100 bytes, not the"):
        load_checkpoint(tmp_path / "checkpoints" / "step_00000002")  # asked for by name: an error
    with pytest.warns(RuntimeWarning, match="step_00000002 is incomplete: model/model.safetensors.*trying the previous"):
        assert load_checkpoint(tmp_path).step == 1
    with pytest.warns(RuntimeWarning, match="step_00000002 is incomplete"):
        train(rm_cfg(tmp_path, "max_steps=2", "save_every=1"), resume=tmp_path)  # the corrupt step 2 is set aside, step 2 redone
    assert not list(tmp_path.glob(".tmp_*")) and not list((tmp_path / "checkpoints").glob(".tmp_*"))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert (tmp_path / "checkpoints" / ".corrupt_step_00000002").is_dir()  # kept for a look


def test_a_checkpoint_missing_a_file_falls_back_a_copy_beside_them_is_ignored_and_corrupt_ones_go_aside_each_time(tmp_path):
    train(rm_cfg(tmp_path, "max_steps=3", "save_every=1", "keep_last=5"))
    shutil.copytree(tmp_path / "checkpoints" / "step_00000003", tmp_path / "checkpoints" / "step_00000003.bak")  # a user's copy
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002", "step_00000003"]
    (tmp_path / "checkpoints" / "step_00000003" / "model" / "model.safetensors").unlink()  # its weights lost, the rest whole
    with pytest.raises(CheckpointError, match="step_00000003 is incomplete: model/model.safetensors is missing"):
        load_checkpoint(tmp_path / "checkpoints" / "step_00000003")
    with pytest.warns(RuntimeWarning, match="step_00000003 is incomplete"):
        assert load_checkpoint(tmp_path).step == 2
    for _ in range(2):  # step 3 redone, then lost again: the second corrupt copy goes aside beside the first
        with pytest.warns(RuntimeWarning, match="step_00000003 is incomplete"):
            train(rm_cfg(tmp_path, "max_steps=3", "save_every=1", "keep_last=5"), resume=tmp_path)
        (tmp_path / "checkpoints" / "step_00000003" / "model" / "model.safetensors").write_bytes(b"")
    assert len(list((tmp_path / "checkpoints").glob(".corrupt_step_00000003*"))) == 2
    marker = tmp_path / "checkpoints" / "step_00000002" / "checkpoint.json"  # an older checkpoint lists no files: its model directory is looked at
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))
    assert load_checkpoint(marker.parent).step == 2
    (marker.parent / "model" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="step_00000002 is incomplete: model holds no weights file"):
        load_checkpoint(marker.parent)


def test_a_link_to_a_checkpoint_of_the_run_resumes_it_in_place_even_with_overwrite(tmp_path):
    run = tmp_path / "run"
    train(rm_cfg(run, "max_steps=2", "save_every=1", "keep_last=5", "optim.min_lr_ratio=1.0"))
    (tmp_path / "best").symlink_to(run / "checkpoints" / "step_00000002")
    train(rm_cfg(run, "max_steps=3", "save_every=1", "keep_last=5", "optim.min_lr_ratio=1.0", "overwrite=true"), resume=tmp_path / "best")
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001", "step_00000002", "step_00000003"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss/rm" in r] == [0, 1, 2]
    archive = run / "checkpoints" / "archive"  # another run kept inside this one's checkpoints/
    shutil.copytree(run, tmp_path / "copy", ignore=shutil.ignore_patterns(".rlalign.lock"))
    shutil.move(tmp_path / "copy", archive)
    with pytest.raises(ConfigError, match="overwrite=true would delete .*archive/checkpoints/step_00000003, which this run reads"):
        train(rm_cfg(run, "max_steps=4", "save_every=1", "keep_last=5", "optim.min_lr_ratio=1.0", "overwrite=true"),
              resume=archive / "checkpoints" / "step_00000003")
    assert (archive / "checkpoints" / "step_00000003" / "checkpoint.json").is_file()


def test_a_run_whose_checkpoints_directory_is_a_link_elsewhere_resumes_in_place(tmp_path):
    run = tmp_path / "run"
    train(rm_cfg(run, "max_steps=2", "save_every=1", "keep_last=5", "optim.min_lr_ratio=1.0"))
    shutil.move(run / "checkpoints", tmp_path / "scratch")  # moved to another disk, linked back
    (run / "checkpoints").symlink_to(tmp_path / "scratch")
    train(rm_cfg(run, "max_steps=3", "save_every=1", "keep_last=5", "optim.min_lr_ratio=1.0"), resume=run)
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001", "step_00000002", "step_00000003"]


def test_a_run_stopped_before_its_first_checkpoint_is_not_offered_a_resume(tmp_path):
    train(rm_cfg(tmp_path, "max_steps=1", "save_every=5"))  # final/ only, no checkpoint
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    with pytest.raises(ConfigError, match=r"already holds a run \(.*\); choose another output_dir, or set overwrite=true") as caught:
        train(rm_cfg(tmp_path, "max_steps=1"))
    assert "--resume" not in str(caught.value)


def test_a_final_model_moved_aside_by_a_killed_swap_comes_back(tmp_path):
    from rlalign.train.checkpoints import remove_stale_temp_dirs

    train(rm_cfg(tmp_path, "max_steps=1"))
    (tmp_path / "final").rename(tmp_path / ".old_final_4242")  # killed between the two renames of replace_dir
    (tmp_path / ".tmp_final_4242").mkdir()  # its half-written successor
    remove_stale_temp_dirs(tmp_path)
    assert (tmp_path / "final" / "model.safetensors").is_file() and not list(tmp_path.glob(".*_final_*"))


def test_overwrite_checks_first_and_never_deletes_what_the_run_reads(tmp_path):
    train(rm_cfg(tmp_path / "a", "max_steps=1"))
    with pytest.raises(ConfigError, match="overwrite=true would delete .*final, which this run reads"):
        train(rm_cfg(tmp_path / "a", "max_steps=1", "overwrite=true", f"model.path={tmp_path / 'a' / 'final'}"))
    assert (tmp_path / "a" / "final" / "model.safetensors").is_file()
    with pytest.raises(CheckpointError, match="differs"):  # a failing resume check deletes nothing either
        train(rm_cfg(tmp_path / "a", "max_steps=2", "overwrite=true", "seed=5"), resume=tmp_path / "a")
    assert (tmp_path / "a" / "metrics.jsonl").is_file()


def test_non_finite_config_floats_and_rewards_are_errors():
    with pytest.raises(ConfigError, match="optim.lr = inf: Input should be a finite number"):
        load_config(RMConfig, None, ["optim.lr=.inf"])
    from rlalign.train.grpo import GRPOConfig

    with pytest.raises(ConfigError, match="beta = nan"):
        load_config(GRPOConfig, None, ["beta=.nan"])
    with pytest.raises(RewardFunctionError, match=r"returned inf for prompt 'p1': not finite in float32"):
        score_completions([lambda p, c: [0.0, 1e39]], ["p0", "p1"], ["a", "b"])  # finite in float64, not in float32
    with pytest.raises(RewardFunctionError, match=r"\(weight 1e\+39\) is inf for prompt 'p0'"):
        score_completions([lambda p, c: [1.0, 1.0]], ["p0", "p1"], ["a", "b"], weights=[1e39])


def test_a_diverging_run_stops_with_the_step_and_the_last_good_checkpoint_and_writes_no_nan(tmp_path, capsys):
    args = ["rm", *RM, f"output_dir={tmp_path}", "max_steps=6", "save_every=1", "optim.lr=1e30", "optim.grad_clip=null", "optim.warmup_steps=0"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: transformers' loading bars)
    assert err.startswith("rlalign rm: step 1 stopped: update 2: the loss is nan") and "The last good checkpoint is" in err, err
    assert not (tmp_path / "final").exists()
    for checkpoint in list_checkpoints(tmp_path):
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(str(checkpoint / "model" / "model.safetensors")).values())
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    with pytest.raises(NonFiniteError):
        main(["--debug", *args[:2], *args[2:-3], f"output_dir={tmp_path / 'debug'}", "optim.lr=1e30", "optim.grad_clip=null", "optim.warmup_steps=0"])


def test_a_resumed_run_that_diverges_names_the_update_the_uninterrupted_run_names(tmp_path, capsys):
    # the updater counted its updates from 0 again after a resume: "step 1 stopped: update 1" where the run had done one
    args = ["rm", *RM, f"output_dir={tmp_path}", "max_steps=6", "save_every=1", "optim.lr=1e30", "optim.grad_clip=null", "optim.warmup_steps=0"]
    assert main(args) == 2
    straight = capsys.readouterr().err.strip().splitlines()[-1]
    assert main([*args, "--resume", str(tmp_path)]) == 2  # from the checkpoint after step 0: step 1 diverges again
    resumed = capsys.readouterr().err.strip().splitlines()[-1]
    assert straight.startswith("rlalign rm: step 1 stopped: update 2: the loss is nan"), straight
    assert resumed.split(". The last good")[0] == straight.split(". The last good")[0]


def test_an_update_that_steps_the_weights_past_float_range_stops_the_run_before_anything_is_saved(tmp_path, capsys):
    # a finite loss and gradient with a learning rate of 1e38: the update makes the weights inf, and final/ and the step's
    # checkpoint were written with them, exit 0
    args = ["rm", *RM, f"output_dir={tmp_path}", "max_steps=2", "save_every=1", "optim.lr=1e38", "optim.warmup_steps=0"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rlalign rm: step 0 stopped: update 1: the weights are not finite after it (the loss was"), err
    assert "The last good checkpoint is none" in err and not (tmp_path / "final").exists() and not list_checkpoints(tmp_path)


def test_the_weight_check_tells_huge_finite_weights_from_non_finite_ones():
    # the fused check reads each tensor's norm, which overflows for huge finite weights: those are looked at exactly
    from rlalign.train.updater import Updater

    layer = torch.nn.Linear(4, 4)
    updater = Updater(layer, torch.optim.SGD(layer.parameters(), lr=0.1), None, None)
    with torch.no_grad():
        layer.weight.fill_(1e30)  # a norm of 4e30: finite; squares of 1e30 overflow float32 inside a norm
        assert updater.finite_weights()
        layer.weight[0, 0] = float("inf")
        assert not updater.finite_weights()
        layer.weight[0, 0], layer.bias[1] = 0.0, float("nan")
        assert not updater.finite_weights()


def test_bad_inputs_get_one_message_and_exit_2(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max_steps: 3\noptim: {lr: 1e-3\n")
    cases = {
        "yaml": (["rm", "--config", str(bad_yaml)], f"{bad_yaml}.*line 2"),
        "empty output_dir": (["rm", "output_dir=''"], "output_dir is empty"),
        "not a checkpoint": (["rm", *RM, f"output_dir={tmp_path / 'x'}", "--resume", str(tmp_path)], "not a checkpoint directory"),
        "bad data file": (["rm", *RM, f"output_dir={tmp_path / 'y'}", f"data.train_file={bad_yaml}", f"data.eval_file={bad_yaml}"], str(bad_yaml)),
    }
    for name, (args, message) in cases.items():
        assert main(args) == 2, name
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") <= 6, (name, err)
        assert re.search(message, err), (name, err)


def test_a_tokenizer_without_eos_is_an_error_at_start(tmp_path):
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint

    path = tmp_path / "model"
    build_tiny_checkpoint(path, TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has no EOS token"):
        train(rm_cfg(tmp_path / "run", f"model.path={path}", "max_steps=1"))


def test_a_directory_that_is_not_a_model_or_has_corrupt_weights_is_named(tmp_path):
    from rlalign.lm.models import ModelLoadError, load_policy

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="'.*empty' is not a Hugging Face checkpoint directory: it has no config.json"):
        train(rm_cfg(tmp_path / "run", f"model.path={tmp_path / 'empty'}"))
    train(rm_cfg(tmp_path / "ok", "max_steps=1"))
    weights = tmp_path / "ok" / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(ModelLoadError, match="weights file .*final/model.safetensors is corrupt or truncated"):
        load_policy(tmp_path / "ok" / "final")


def test_prompts_that_do_not_fit_the_context_are_an_error_at_load(tmp_path):
    from rlalign.lm.data import DataError
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
    from rlalign.train import grpo

    path = build_tiny_checkpoint(tmp_path / "model", TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (path / "config.json").write_text(json.dumps(config))
    base = [f"model.path={path}", "progress=false", "plots=false", "steps=1", "prompts_per_step=2", "group_size=2", "rewards=[{function: exact_match}]"]
    cfg = load_config(grpo.GRPOConfig, None, [*base, f"output_dir={tmp_path / 'a'}", "sampling.max_new_tokens=8"])
    with pytest.raises(DataError, match="<in-memory records>, row 2: the prompt is 10 tokens, and with sampling.max_new_tokens=8 it exceeds the model's 16 positions"):
        grpo.train(cfg, prompts=[{"prompt": "1+1=", "answer": "2"}, {"prompt": "12+30+40=", "answer": "82"}])


def test_answers_and_tests_are_per_row_not_per_prompt_text(tmp_path):
    from rlalign.lm.data import DataError, PromptExample
    from rlalign.lm.models import load_tokenizer
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
    from rlalign.train import grpo, rollouts

    path = build_tiny_checkpoint(tmp_path / "model", TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)
    cfg = load_config(grpo.GRPOConfig, None, [f"model.path={path}", "rewards=[{function: exact_match}]"])
    records = [PromptExample("2+2=", {"answer": "4"}), PromptExample("2+2=", {"answer": "5"})]  # one prompt, two answers
    terms = rollouts.build_rewards(cfg.rewards, records, load_tokenizer(path), cfg.model)
    total, _, _ = rollouts.score_rollout(terms, ["2+2=", "2+2="], ["4", "4"], {"answer": ["4", "5"]})
    assert total.tolist() == [1.0, 0.0]  # each row against its own answer, not the last one of its prompt text
    with pytest.raises(DataError, match="prompt record 1: tests have no top-level assert"):
        cfg = load_config(grpo.GRPOConfig, None, [f"model.path={path}", "rewards=[{function: code_execution, allow_weak_sandbox: true}]"])
        rollouts.build_rewards(cfg.rewards, [PromptExample("f", {"tests": "assert f() == 1"}), PromptExample("g", {"tests": "x = 1"})], load_tokenizer(path), cfg.model)


def test_identical_preference_pairs_are_counted_and_dropped():
    from rlalign.lm.data import load_preferences

    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "same", "rejected": "same"}]
    with pytest.warns(UserWarning, match=r"1 of 2 preference pairs have chosen == rejected and were dropped \(first: .*2\)"):
        assert [ex.chosen for ex in load_preferences(rows)] == ["a"]


@pytest.mark.parametrize("code, text, said", [(28, "No space left on device", "cannot write"), (13, "Permission denied", "cannot access")],
                         ids=["disk full", "denied"])
def test_a_disk_full_or_a_directory_the_run_may_not_write_is_one_message_naming_the_path(tmp_path, monkeypatch, capsys, code, text, said):
    import rlalign.train.common as common

    def fails(obj, path, *args, **kwargs):
        raise OSError(code, text, str(path))  # ENOSPC, EACCES (a PermissionError)

    monkeypatch.setattr(common.torch, "save", fails)
    assert main(["rm", *RM, f"output_dir={tmp_path}", "max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"rlalign rm: {said} ") and err.endswith(f"optimizer.pt: {text}"), err


@pytest.mark.parametrize("error, free", [
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024 vs 0"), 0),  # torch.save on a full disk: no errno
    (Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })"), 10**9),
])
def test_a_full_disk_is_one_message_whatever_the_writer_raises(tmp_path, monkeypatch, capsys, error, free):
    import shutil as shutil_module

    import rlalign.train.checkpoints as checkpoints
    import rlalign.train.common as common

    def fails(*args, **kwargs):
        raise error

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(common.torch, "save", fails)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage._replace(free=free))
    assert main(["rm", *RM, f"output_dir={tmp_path / 'run'}", "max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"rlalign rm: cannot write {tmp_path / 'run' / 'checkpoints'}/.tmp_step_") and err.endswith(": No space left on device"), err
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # nothing half-written left
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage._replace(free=10**9))
    with pytest.raises(RuntimeError, match="^not the disk"):  # any other error, with room on the disk, is as it was
        checkpoints.save_checkpoint(tmp_path / "other", 1, _Failing(RuntimeError("not the disk")))
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage._replace(free=0))
    for other in (KeyboardInterrupt(), TypeError("a bug")):  # on a full disk too: an interrupt, or another kind of error, stays itself
        with pytest.raises(type(other)):
            checkpoints.save_checkpoint(tmp_path / "other", 1, _Failing(other))


class _Failing:
    def __init__(self, error):
        self.error = error

    def save_pretrained(self, path):
        raise self.error


def test_the_rlalign_script_imports_a_module_function_reward_from_the_current_directory(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "my_reward.py").write_text("def length(prompts, completions):\n    return [float(len(c)) for c in completions]\n")
    script = Path(sys.executable).parent / "rlalign"
    if not script.is_file():
        pytest.skip("no rlalign console script next to this Python")
    args = [str(script), "grpo", *TINY, "output_dir=run", "steps=1", "prompts_per_step=2", "group_size=2", "sampling.max_new_tokens=2",
            "plots=false", "rewards=[{function: 'my_reward:length'}]"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps_run"] == 1


def test_a_run_that_fails_lets_go_of_its_output_dir_at_once(tmp_path):
    from rlalign.train import grpo

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError):  # fails after taking the lock: no reward term
        grpo.train(load_config(grpo.GRPOConfig, None, [*TINY, f"output_dir={tmp_path / 'run'}", "rewards=[]"]))
    from rlalign.lm.rewards import RewardFunctionError

    with pytest.raises(RewardFunctionError):  # fails inside the step loop
        grpo.train(load_config(grpo.GRPOConfig, None, [*TINY, f"output_dir={tmp_path / 'run'}", "steps=1", "prompts_per_step=2", "group_size=2",
                                                        "sampling.max_new_tokens=2", "overwrite=true", "rewards=[]"]),
                   reward_functions=[grpo.RewardTerm("boom", 1.0, lambda p, c: [1 / 0 for _ in c])])
    result = grpo.train(load_config(grpo.GRPOConfig, None, [*TINY, f"output_dir={tmp_path / 'run'}", "steps=1", "prompts_per_step=2", "group_size=2",
                                                             "sampling.max_new_tokens=2", "overwrite=true", "plots=false", "rewards=[{function: arithmetic}]"]))
    assert len(result.history) == 1  # the failed runs' locks did not linger
