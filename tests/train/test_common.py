"""Shared trainer pieces: seeding, schedule, data order, metrics and curves, atomic checkpoints, resume errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rlalign.train.common import make_optimizer
from rlalign.train.checkpoints import CheckpointError, fsync_tree, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from rlalign.train.metrics import MetricsLogger, ema, plot_metrics, read_metrics, smoothing_weight
from rlalign.train.run_config import OptimConfig
from rlalign.train.seeding import batch_order, restore_rng_state, rng_state, set_seed


class _Saveable(torch.nn.Module):
    """The smallest model with save_pretrained (what checkpoints need)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def save_pretrained(self, path):
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), str(path / "model.safetensors"))


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_set_seed_and_rng_state_round_trip():
    set_seed(7)
    first = _draws()
    set_seed(7)
    assert _draws() == first
    state = rng_state()
    after = _draws()
    restore_rng_state(state)
    assert _draws() == after


def test_schedule_warms_up_then_decays_to_the_floor():
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = make_optimizer(model.parameters(), OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1), total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # warm-up: 1/2, 2/2; then cosine over 4 steps: 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 0..3
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[3] == pytest.approx(0.1 + 0.9 * (1 + np.cos(np.pi / 4)) / 2)


def test_batch_order_depends_only_on_the_position():
    full = batch_order(10, 0, 25, seed=3)
    assert sorted(full[:10]) == list(range(10)) and sorted(full[10:20]) == list(range(10))  # each epoch is a permutation
    assert full[:10] != full[10:20]  # a new permutation per epoch
    assert batch_order(10, 7, 8, seed=3) == full[7:15]  # resuming at position 7 continues the same order


def test_metrics_logger_and_plot(tmp_path):
    with MetricsLogger(tmp_path, total_steps=3, progress=False) as log:
        for step in range(3):
            log.log(step, {"loss": 1.0 / (step + 1), "reward/mean": step})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and records[1]["loss"] == 0.5
    out = plot_metrics(tmp_path / "metrics.jsonl", ["loss", "reward/mean"], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="kl"):
        plot_metrics(tmp_path / "metrics.jsonl", ["kl"], tmp_path / "x.png")


def test_checkpoint_round_trip_and_keep_last(tmp_path):
    model = _Saveable()
    optimizer, scheduler = make_optimizer(model.parameters(), OptimConfig(), total_steps=10)
    model.linear(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, config={"lr": 0.1}, data_position=step * 4, extra={"best": torch.tensor(0.5)}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    ckpt = load_checkpoint(tmp_path)  # a run dir resolves to its latest checkpoint
    assert ckpt.step == 3 and ckpt.data_position == 12 and ckpt.config == {"lr": 0.1}
    assert ckpt.extra["best"].item() == 0.5 and (ckpt.model_dir / "model.safetensors").is_file()
    fresh, _ = make_optimizer(_Saveable().parameters(), OptimConfig(), total_steps=10)
    fresh.load_state_dict(ckpt.optimizer_state)
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_crash_mid_save_leaves_the_last_checkpoint_intact(tmp_path, monkeypatch):
    model = _Saveable()
    first = save_checkpoint(tmp_path, 1, model, data_position=4)
    before = {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    real_save = torch.save

    def crash_on_trainer_state(obj, path, *args, **kwargs):
        if str(path).endswith("trainer_state.pt"):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crash_on_trainer_state)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, data_position=8)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]  # no half-written step_2 or temp dir
    assert load_checkpoint(tmp_path).data_position == 4


def test_resume_from_a_non_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"not a checkpoint directory \(no checkpoint.json\)"):
        load_checkpoint(tmp_path)
    half = tmp_path / "checkpoints" / "step_00000005"
    half.mkdir(parents=True)
    (half / "optimizer.pt").write_bytes(b"")
    with pytest.raises(CheckpointError):
        load_checkpoint(half)


class _Gadget:
    """Any class that is not a tensor or a plain container: a pickle that would run code on load."""


def test_a_checkpoint_file_holding_other_objects_is_refused_unread(tmp_path):
    # state files load with weights_only=True: tensors and plain containers only, never a pickled class
    save_checkpoint(tmp_path, 1, _Saveable(), data_position=4)
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    torch.save({"optimizer": {}, "scheduler": {}, "gadget": _Gadget()}, ckpt / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt .*UnpicklingError"):
        load_checkpoint(ckpt)


def test_fsync_tree_flushes_every_file_and_folder(tmp_path, monkeypatch):
    import os

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "b.txt").write_text("b")
    synced, real_fsync = [], os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    fsync_tree(tmp_path)
    assert sorted(synced) == sorted(str(p) for p in (tmp_path, tmp_path / "a.txt", tmp_path / "sub", tmp_path / "sub" / "b.txt"))


def test_forward_precision_runs_forwards_in_bfloat16_only_when_asked():
    from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_llama
    from rlalign.train.common import forward_precision
    from rlalign.train.run_config import ModelConfig

    model = build_tiny_llama(build_char_tokenizer(), TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64))
    ids = torch.tensor([[1, 14, 15, 16]])
    with forward_precision(ModelConfig(autocast="bfloat16"), model):
        assert model(input_ids=ids).logits.dtype == torch.bfloat16
    with forward_precision(ModelConfig(), model):
        assert model(input_ids=ids).logits.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32  # master weights untouched


_LOG_WITHOUT_A_BAR = """
import sys, tempfile
import rlalign.train.grpo, rlalign.train.ppo, rlalign.train.sft, rlalign.train.reward_model
from rlalign.train.metrics import MetricsLogger
with MetricsLogger(tempfile.mkdtemp(), total_steps=2, progress=False) as log:
    log.log(0, {"loss": 1.0})
print("without a bar, rich imported:", "rich" in sys.modules)
with MetricsLogger(tempfile.mkdtemp(), total_steps=2, progress=True) as log:
    log.log(0, {"loss": 1.0}, ("loss",))
print("with a bar, rich imported:", "rich.progress" in sys.modules)
print("trackers not asked for, imported:", "wandb" in sys.modules or "tensorboard" in sys.modules)
"""


def test_rich_is_imported_only_for_a_progress_bar():
    # a process that trains without a bar (a notebook, every rank but 0, a benchmark) never imports rich (~2 MB resident)
    import subprocess
    import sys

    bare = subprocess.run([sys.executable, "-c", "import sys, transformers.utils.hub; print('rich' in sys.modules)"], capture_output=True, text=True, timeout=300)
    if bare.stdout.strip() == "True":  # huggingface_hub 1.33 (transformers 5.17's) imports httpx's command line, which imports rich
        pytest.skip("this huggingface_hub imports rich itself")
    proc = subprocess.run([sys.executable, "-c", _LOG_WITHOUT_A_BAR], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = [line.rsplit(":", 1) for line in proc.stdout.splitlines() if "rich imported:" in line]
    assert [(what.strip(), imported.strip()) for what, imported in answers] == [("without a bar, rich imported", "False"), ("with a bar, rich imported", "True")]
    assert "trackers not asked for, imported: False" in proc.stdout  # wandb and tensorboard load only for report_to


def test_set_seed_takes_seeds_past_numpys_32_bits():
    # NumPy's legacy seed must be < 2**32: a larger seed is reduced modulo 2**32 (2**32 + 5 draws as 5 does)
    set_seed(2**32 + 5)
    large = np.random.rand(3)
    set_seed(5)
    five = np.random.rand(3)
    np.testing.assert_array_equal(large, five)
    set_seed(6)
    assert not np.array_equal(np.random.rand(3), five)  # and distinct seeds draw distinct numbers


def test_plot_metrics_labels_each_panel_and_titles_the_figure(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kwargs: saved.append(fig))
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "a": s * 1.0, "b": -s * 1.0}) + "\n" for s in range(3)))
    plot_metrics(path, ["a", "b"], tmp_path / "curves.png", title="SFT — runs/x")
    (fig,) = saved
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == ["a", "b"]
    assert [ax.get_xlabel() for ax in axes] == ["step", "step"]  # every panel names its axes
    assert fig.get_suptitle() == "SFT — runs/x"


def test_ema_is_debiased_and_weight_zero_is_the_identity():
    # w = 0.5 on [1, 3, 3]: m = 0.5, 1.75, 2.375; divided by 1 - 0.5^t = 0.5, 0.75, 0.875 -> 1, 7/3, 19/7
    assert ema([1.0, 3.0, 3.0], 0.5) == pytest.approx([1.0, 7 / 3, 19 / 7], rel=1e-12)
    assert ema([4.0, -2.0, 7.0], 0.0) == [4.0, -2.0, 7.0]
    assert ema([5.0] * 50, 0.9) == pytest.approx([5.0] * 50, rel=1e-12)  # a constant stays put from the first point (no pull to 0)
    with pytest.raises(ValueError, match="weight"):
        ema([1.0], 1.0)
    # the window is about n / 20 points: none for 20 points, w = 0.9 for 200, capped at 0.99
    assert [smoothing_weight(n) for n in (1, 20, 40, 200, 10**6)] == pytest.approx([0.0, 0.0, 0.5, 0.9, 0.99])


def test_curves_draw_a_long_metric_smoothed_over_its_raw_values_and_sparse_evals_as_points(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kwargs: saved.append(fig))
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float((-1) ** s), **({"eval/loss": 10.0 - s / 50} if s % 50 == 49 else {})} for s in range(100)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics(path, ["loss", "eval/loss"], tmp_path / "curves.png")
    (fig,) = saved
    loss_ax, eval_ax = fig.axes
    raw, smoothed = loss_ax.get_lines()
    assert list(raw.get_ydata()) == [r["loss"] for r in rows] and raw.get_alpha() < 0.5  # raw points, light, behind
    assert list(smoothed.get_ydata()) == pytest.approx(ema([r["loss"] for r in rows], smoothing_weight(100)), rel=1e-12)
    assert max(abs(y) for y in smoothed.get_ydata()[20:]) < 0.2  # +-1 alternating averages out
    (points,) = eval_ax.get_lines()  # only the steps where the eval ran, as markers
    assert list(points.get_xdata()) == [49, 99] and list(points.get_ydata()) == [10.0 - 49 / 50, 10.0 - 99 / 50] and points.get_marker() == "o"


def test_rng_restore_leaves_cuda_alone_when_the_state_has_none(monkeypatch):
    from rlalign.train.seeding import restore_rng_state, rng_state

    state = rng_state()
    state.pop("cuda", None)  # saved on a machine without CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("no CUDA state was saved"))
    restore_rng_state(state)


def test_schedule_with_one_step_after_warmup_reaches_its_floor():
    from rlalign.train.common import make_optimizer
    from rlalign.train.run_config import OptimConfig

    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    optimizer, scheduler = make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg, total_steps=3)
    lrs = []
    for _ in range(3):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    lrs.append(scheduler.get_last_lr()[0])
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.1])  # warm-up 1/2, 2/2; then progress 0, then 1/1: the floor


def test_a_checkpoint_saved_without_a_data_position_reads_back_zero(tmp_path):
    from rlalign.train.checkpoints import load_checkpoint, save_checkpoint

    class Weights:
        def save_pretrained(self, path):
            import pathlib

            pathlib.Path(path).mkdir(parents=True)

    save_checkpoint(tmp_path, 1, Weights())
    assert load_checkpoint(tmp_path).data_position == 0


def test_generation_eval_passes_each_prompts_own_columns(tmp_path):
    from rlalign.lm.models import load_policy, load_tokenizer
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
    from rlalign.train.common import generation_eval

    path = build_tiny_checkpoint(tmp_path, TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)
    seen = []

    def answer_is_a(completions, answer, **kwargs):
        seen.extend(answer)
        return [float(a == "a") for a in answer]

    score, _ = generation_eval(load_policy(path), load_tokenizer(path), ["1+1=", "1+1="], answer_is_a, 2, columns={"answer": ["a", "b"]})
    assert seen == ["a", "b"] and score == 0.5  # the same prompt twice, each row with its own answer
    # a row the reward cannot score is no 0: the mean is over the scored rows (1.0, not 0.5)
    score, _ = generation_eval(load_policy(path), load_tokenizer(path), ["1+1=", "1+1="], lambda completions, answer, **kwargs:
                               [1.0 if a == "a" else None for a in answer], 2, columns={"answer": ["a", "b"]})
    assert score == 1.0
    # it stops where the model's generation config says (an end of turn beside the EOS): every id listed, one token each
    policy = load_policy(path)
    policy.generation_config.eos_token_id = list(range(policy.config.vocab_size))
    _, completions = generation_eval(policy, load_tokenizer(path), ["1+1=", "2+2="], answer_is_a, 4, columns={"answer": ["a", "b"]})
    assert all(len(c) <= 1 for c in completions), completions


def test_greedy_eval_is_generation_eval_at_temperature_zero(tmp_path):
    from rlalign.lm.models import load_policy, load_tokenizer
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
    from rlalign.train.common import generation_eval, greedy_eval

    path = build_tiny_checkpoint(tmp_path, TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=0)
    model, tokenizer = load_policy(path), load_tokenizer(path)
    first_char = lambda prompts, completions, **kw: [float(c[:1] == "1") for c in completions]  # noqa: E731
    prompts = ["1+1=", "2+3=", "7+8="]
    assert greedy_eval(model, tokenizer, prompts, first_char, 4) == generation_eval(model, tokenizer, prompts, first_char, 4, temperature=0.0)
    assert greedy_eval(model, tokenizer, prompts, first_char, 4) == greedy_eval(model, tokenizer, prompts, first_char, 4, batch_size=1)  # no draw: deterministic
