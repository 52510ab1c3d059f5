"""Trackers (``report_to``): TensorBoard events and a Weights & Biases run hold what metrics.jsonl
holds; sample tables reach both; the legacy ``tensorboard`` key still loads; a missing package is a
clear error before anything is written; every LM trainer ends with curves.png."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlalign.cli import main
from rlalign.config import ConfigError, load_config
from rlalign.train.metrics import MetricsLogger, markdown_table, read_metrics
from rlalign.train.reward_model import RMConfig
from rlalign.train.reward_model import train as train_rm
from rlalign.train.run_dir import config_differences
from rlalign.train.sft import SFTConfig
from rlalign.train.sft import train as train_sft

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "progress=false"]
SFT_RUN = TINY + ["max_steps=3", "eval_every=2", "data.num_train=16", "data.num_eval=4", "batch_size=4", "max_new_tokens=4"]
ROWS = [{"prompt": "1+1=", "completion": "2", "reward": 1.0}, {"prompt": "a | b", "completion": "line one\nline two", "reward": 0.0, "note": "x"}]


def _event_accumulator(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    acc.Reload()
    return acc


def _captured_figures(monkeypatch) -> list:
    """Every figure saved from now on (still written to disk)."""
    import matplotlib.figure

    figures, save = [], matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return figures


def test_sft_tensorboard_scalars_equal_metrics_jsonl_and_curves_are_drawn(tmp_path, monkeypatch):
    figures = _captured_figures(monkeypatch)
    run = tmp_path / "sft_tb"
    train_sft(load_config(SFTConfig, None, SFT_RUN + [f"output_dir={run}", "report_to=[jsonl, tensorboard]"]))
    records = read_metrics(run / "metrics.jsonl")
    acc = _event_accumulator(run / "tensorboard")
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for key, value in r.items():
            if key not in ("step", "time"):
                expected.setdefault(key, []).append((r["step"], value))
    assert set(acc.Tags()["scalars"]) == set(expected)  # every metric, nothing else
    assert {"loss/sft", "grad_norm", "lr", "eval/loss", "eval/reward"} <= set(expected)
    for key, points in expected.items():
        events = [(e.step, e.value) for e in acc.Scalars(key)]
        # TensorBoard stores float32: each value is the jsonl value rounded to float32, at the same step
        assert events == [(step, float(np.float32(value))) for step, value in points], key
    assert [e.step for e in acc.Scalars("eval/reward")] == [-1, 1, 2]  # before training, every eval_every=2 steps, at the end

    # curves.png: titled by trainer and run, loss every step, eval metrics at their evaluations
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    assert fig.get_suptitle() == f"SFT — {run}"
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss/sft", "eval/loss", "eval/reward", "grad_norm"]
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)
    eval_line = fig.axes[2].get_lines()[-1]
    assert list(eval_line.get_xdata()) == [-1, 1, 2]


def test_reward_model_runs_end_with_curves(tmp_path, monkeypatch):
    figures = _captured_figures(monkeypatch)
    run = tmp_path / "rm"
    train_rm(load_config(RMConfig, None, TINY + [f"output_dir={run}", "max_steps=2", "eval_every=1", "data.num_train=8", "data.num_eval=4", "batch_size=4"]))
    assert (run / "curves.png").is_file()
    (fig,) = figures
    assert fig.get_suptitle() == f"RM — {run}"
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss/rm", "eval/loss", "eval/accuracy", "eval/margin", "grad_norm"]


def test_plots_false_writes_no_curves(tmp_path):
    run = tmp_path / "no_plots"
    train_sft(load_config(SFTConfig, None, SFT_RUN + [f"output_dir={run}", "max_steps=1", "plots=false"]))
    assert (run / "metrics.jsonl").is_file() and not (run / "curves.png").exists()


def test_log_samples_reaches_tensorboard_as_a_markdown_table(tmp_path):
    with MetricsLogger(tmp_path, total_steps=4, progress=False, report_to=["jsonl", "tensorboard"]) as log:
        log.log(3, {"loss": 0.5})
        log.log_samples(3, "eval/samples", ROWS)
    table = markdown_table(["prompt", "completion", "reward", "note"], ROWS)
    assert table.splitlines() == [
        "| prompt | completion | reward | note |",
        "|---|---|---|---|",
        "| 1+1= | 2 | 1.0 |  |",  # a missing cell is empty
        "| a \\| b | line one<br>line two | 0.0 | x |",  # a pipe is escaped, a line break kept as <br>
    ]
    acc = _event_accumulator(tmp_path / "tensorboard")
    (event,) = acc.Tensors("eval/samples/text_summary")
    assert event.step == 3
    assert event.tensor_proto.string_val[0].decode() == table
    assert [set(r) for r in read_metrics(tmp_path / "metrics.jsonl")] == [{"step", "time", "loss"}]  # the rows stay out of metrics.jsonl


def test_a_resumed_runs_tensorboard_hides_the_steps_it_redoes(tmp_path):
    with MetricsLogger(tmp_path, total_steps=4, progress=False, report_to=["tensorboard"]) as log:
        for step in range(4):
            log.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, total_steps=4, progress=False, report_to=["tensorboard"], start_step=2) as log:  # resumed after step 1
        for step in range(2, 4):
            log.log(step, {"loss": 10.0 + step})
    assert [(e.step, e.value) for e in _event_accumulator(tmp_path / "tensorboard").Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def _wandb_records(path: Path) -> list:
    """The records of a .wandb file (W&B's transaction log: a 7-byte header, then leveldb-log records
    in 32 KiB blocks, each chunk a 7-byte header (crc32c, length, type) and its bytes), as wandb's protos."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, records, chunks = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _finished_wandb_records(path: Path, timeout: float = 30.0) -> list:
    """The records of a finished run's .wandb file: W&B's service process writes it and may still be
    flushing when ``finish()`` returns, so wait for its exit record."""
    deadline = time.monotonic() + timeout
    while True:
        records = _wandb_records(path) if path.is_file() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _wandb_history(run_file: Path) -> list[dict]:
    rows = []
    for record in _finished_wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key or [item.key]): json.loads(item.value_json) for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_metrics_config_and_tables_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'rlalign[wandb]')")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": tmp_path, "WANDB_CONFIG_DIR": tmp_path / "config",
                        "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run_dir = tmp_path / "my_run"
    with MetricsLogger(run_dir, total_steps=3, progress=False, report_to=["jsonl", "wandb"], config={"optim": {"lr": 0.01}, "seed": 3}) as log:
        log.log(-1, {"eval/reward": 0.25})
        for step in range(2):
            log.log(step, {"loss": 1.0 / (step + 1), "lr": 0.01})
        log.log_samples(1, "samples", ROWS)
    run_id = (run_dir / "wandb_id").read_text().strip()
    (first,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    records = _finished_wandb_records(first / f"run-{run_id}.wandb")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "rlalign", "my_run")
    assert {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"} == {"optim": {"lr": 0.01}, "seed": 3}
    history = _wandb_history(first / f"run-{run_id}.wandb")
    scalars = [{k: v for k, v in row.items() if not k.startswith("_") and not k.startswith("samples")} for row in history]
    jsonl = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(run_dir / "metrics.jsonl")]
    assert scalars[:3] == jsonl  # the same steps and values, the step as a metric of its own
    assert scalars[3] == {"step": 1} and history[3]["samples/_type"] == "table-file"
    (table_file,) = (first / "files" / "media" / "table").glob("samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "note"]
    assert table["data"] == [["1+1=", "2", 1.0, None], ["a | b", "line one\nline two", 0.0, "x"]]

    # a resumed run (same run dir) continues the same W&B run
    with MetricsLogger(run_dir, total_steps=3, progress=False, report_to=["wandb"], start_step=2) as log:
        log.log(2, {"loss": 1.0 / 3})
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    second = [d for d in (run_dir / "wandb").glob(f"offline-run-*-{run_id}*") if d != first]  # "-1" appended when started in the same second
    assert len(second) == 1
    assert [(row["step"], row["loss"]) for row in _wandb_history(second[0] / f"run-{run_id}.wandb")] == [(2, 1.0 / 3)]


def test_legacy_tensorboard_key_still_loads(tmp_path):
    assert load_config(SFTConfig, None, {"tensorboard": True}).report_to == ["jsonl", "tensorboard"]
    assert load_config(SFTConfig, None, {"tensorboard": False}).report_to == ["jsonl"]
    assert load_config(SFTConfig, None, ["tensorboard=true", "report_to=[tensorboard]"]).report_to == ["tensorboard"]  # no duplicate
    recipe = tmp_path / "old.yaml"
    recipe.write_text("tensorboard: true\nmax_steps: 3\n")
    assert load_config(SFTConfig, recipe).report_to == ["jsonl", "tensorboard"]
    # a checkpoint written before report_to: its config validates, and resuming from it is not a config change
    saved = SFTConfig().model_dump(mode="json")
    del saved["report_to"]
    saved["tensorboard"] = True
    assert SFTConfig.model_validate(saved).report_to == ["jsonl", "tensorboard"]
    assert config_differences(saved, load_config(SFTConfig, None, {"report_to": ["jsonl", "tensorboard"]}).model_dump(mode="json")) == []


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_a_config_error_before_anything_is_written(tracker, tmp_path, monkeypatch, capsys):
    for module in (tracker, "torch.utils.tensorboard") if tracker == "tensorboard" else (tracker,):
        monkeypatch.setitem(sys.modules, module, None)  # import fails, find_spec answers None
    install = f"pip install 'rlalign\\[{tracker}\\]'"
    with pytest.raises(ConfigError, match=f"report_to includes '{tracker}' but the {tracker} package is not installed: {install}"):
        load_config(SFTConfig, None, {"report_to": ["jsonl", tracker]})
    with pytest.raises(ConfigError, match=install):
        MetricsLogger(tmp_path / "logger", total_steps=1, progress=False, report_to=[tracker])
    # through the CLI: one message, exit code 2, the output directory untouched
    out = tmp_path / "cli_run"
    assert main(["sft", f"output_dir={out}", f"report_to=[{tracker}]", *TINY]) == 2
    assert f"pip install 'rlalign[{tracker}]'" in capsys.readouterr().err
    assert not out.exists()


def test_an_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match="report_to"):
        load_config(SFTConfig, None, ["report_to=[mlflow]"])


def test_a_run_that_raises_finishes_its_wandb_run_as_failed(tmp_path):
    # W&B marks a run by its exit code: 0 when the training loop ends normally, 1 when it raised
    class FakeRun:
        def __init__(self):
            self.exit_codes = []

        def finish(self, exit_code):
            self.exit_codes.append(exit_code)

    runs = []
    for fails in (False, True):
        run = FakeRun()
        runs.append(run)
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            with MetricsLogger(tmp_path / str(fails), total_steps=1, progress=False, report_to=["jsonl"]) as log:
                log._wandb = run
                if fails:
                    raise RuntimeError("boom")
    assert [r.exit_codes for r in runs] == [[0], [1]]


def test_a_new_wandb_run_records_its_id_and_a_later_run_continues_it(tmp_path, monkeypatch):
    # without the wandb package: a stand-in module records what wandb.init is asked
    import types

    from rlalign.train import metrics

    calls = []

    class FakeRun:
        def define_metric(self, *args, **kwargs):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    metrics._wandb_run(tmp_path, {"seed": 3})
    run_id = (tmp_path / "wandb_id").read_text()
    assert run_id.endswith("\n") and len(run_id.strip()) == 12 and run_id.strip().isalnum()
    metrics._wandb_run(tmp_path, None)  # the same run directory: the same W&B run, resumed
    assert [(c["id"], c["resume"], c["config"]) for c in calls] == [(run_id.strip(), "allow", {"seed": 3}), (run_id.strip(), "allow", {})]


def test_wandb_table_cells_keep_plain_values_and_write_the_rest_as_json():
    from rlalign.train.metrics import _table_cell

    assert [_table_cell(v) for v in (None, "a", 2, 0.5, True)] == [None, "a", 2, 0.5, True]
    assert _table_cell([1, {"b": None}]) == '[1, {"b": null}]'


def test_a_wandb_that_fails_to_import_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    # found by find_spec but broken on import (a half-installed package): the run's own start says how to install it
    from rlalign.train import metrics

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install 'rlalign\[wandb\]'"):
        metrics._wandb_run(tmp_path, None)
    assert not (tmp_path / "wandb_id").exists()
