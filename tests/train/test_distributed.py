"""Two processes under torchrun (gloo, CPU) compute what one process computes.

SFT, the reward model, GRPO (token-mean loss, batch-scaled advantages, mu = 2, two minibatches, a
reference model) and PPO (adaptive KL, four shuffled minibatches of two rows, so a rank often holds
none of a minibatch) run for a few steps through the real CLI, under
``torchrun --nproc-per-node 2`` with DDP and with FSDP2 (reference and critic sharded too), and in
this process, with the same global batch and seed.
The final weights agree to float32 round-off and so do the logged metrics; a GRPO run resumed from
a checkpoint the two processes wrote ends bit-identical to their uninterrupted run (SFT with LoRA dropout too:
each rank restores its own RNG states).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import distributed
from tests.train.run_records import compared_metrics, launch, load_script

RUNS = Path(__file__).with_name("distributed_runs.py")
NOT_COMPARED = ("time", "tokens_per_s", "memory/")  # wall-clock metrics; rows per forward (a process's own)


def _load_runs():
    return load_script(RUNS)


def _weights(final: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(final.rglob("*.safetensors")):
        out.update({f"{file.relative_to(final)}:{k}": v for k, v in load_file(str(file)).items()})
    return out


def _metrics(run: Path) -> list[dict[str, float]]:
    return compared_metrics(run, NOT_COMPARED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    tiny = build_tiny_checkpoint(root / "tiny", TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RUNS), str(root / "two"), str(tiny)]
    done = launch(cmd, env, 600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (root / "two.stdout").write_text(done.stdout)
    for argv in _load_runs().commands(str(root / "one"), str(tiny)):
        from rlalign.cli import main

        assert main(argv) == 0, argv
    return root, tiny


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
@pytest.mark.parametrize("run", ["sft", "rm", "grpo", "ppo"])
def test_two_processes_give_the_weights_and_metrics_of_one(runs, run, sharding):
    root, tiny = runs
    tag = "" if sharding == "ddp" else f"_{sharding}"
    one, two = _weights(root / "one" / run / "final"), _weights(root / "two" / f"{run}{tag}" / "final")
    assert one.keys() == two.keys() and one
    for name in one:
        # measured: largest difference 1e-7..1e-6 (round-off of sums split across two processes, through a few Adam steps)
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{run} {name}: {m}")
    if run in ("grpo", "ppo"):  # the runs really trained: the weights left the starting model
        start = _weights(tiny)
        assert max((one[k] - v).abs().max().item() for k, v in start.items()) > 1e-3

    m1, m2 = _metrics(root / "one" / run), _metrics(root / "two" / f"{run}{tag}")
    assert [r["step"] for r in m1] == [r["step"] for r in m2]
    for r1, r2 in zip(m1, m2):
        assert r1.keys() == r2.keys()
        for key in r1:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-5), (run, r1["step"], key)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_log_the_samples_of_one(runs, sharding):
    # rank 0 alone wrote its own share before: 8 of the 12 training rows, 3 of the 5 evaluation rows (prompt 1 skipped)
    root, _ = runs
    tag = "" if sharding == "ddp" else f"_{sharding}"
    for name, rows in (("samples.jsonl", 3 * 12), ("eval_samples.jsonl", 2 * 5)):  # 3 steps; before the first and after the last
        one = [json.loads(line) for line in (root / "one" / "grpo" / name).read_text().splitlines()]
        two = [json.loads(line) for line in (root / "two" / f"grpo{tag}" / name).read_text().splitlines()]
        assert len(one) == len(two) == rows, name
        for a, b in zip(one, two):
            assert (a["step"], a["prompt"], a["completion"]) == (b["step"], b["prompt"], b["completion"]), name
            assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)


@pytest.mark.parametrize("run", ["grpo", "grpo_fsdp"])
def test_resume_from_a_two_process_checkpoint_equals_the_straight_run(runs, run):
    # FSDP2: the checkpoint holds full weights and optimiser state gathered from both ranks
    root, _ = runs
    straight, resumed = _weights(root / "two" / run / "final"), _weights(root / "two" / f"{run}_resumed" / "final")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    steps = _metrics(root / "two" / f"{run}_resumed")
    assert [r["step"] for r in steps] == [2]
    assert steps[0] == next(r for r in _metrics(root / "two" / run) if r["step"] == 2)


def test_a_resumed_two_process_run_with_lora_dropout_draws_each_ranks_own_masks(tmp_path):
    # LoRA dropout draws from each rank's global torch RNG, as many numbers as its batch's padded tokens (SFT pads each
    # rank's share to its own longest pair), so the ranks' RNGs part; the checkpoint held rank 0's alone, every rank
    # restored it, and rank 1's masks after the resume were other than the uninterrupted run's (weights off by 1e-2)
    tiny = build_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)
    argv = ["sft", f"model.path={tiny}", "data.num_train=64", "data.num_eval=4", "batch_size=4", "max_steps=4", "eval_every=100", "progress=false",
            "plots=false", "num_threads=1", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.3", "save_every=2", "optim.lr=1e-2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlalign", *argv]
    step2 = tmp_path / "straight" / "checkpoints" / "step_00000002"
    for extra in ([f"output_dir={tmp_path / 'straight'}"], [f"output_dir={tmp_path / 'resumed'}", "--resume", str(step2)]):
        done = launch(torchrun + extra, {**os.environ, "OMP_NUM_THREADS": "1"}, 300)
        assert done.returncode == 0, done.stderr[-3000:]
    straight, resumed = _weights(tmp_path / "straight" / "final"), _weights(tmp_path / "resumed" / "final")
    before = _weights(step2 / "model")
    assert max((straight[k] - before[k]).abs().max().item() for k in straight) > 1e-3  # steps 2-3 moved the adapters
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "straight")[-2:]
    ranks = torch.load(step2 / "trainer_state.pt", weights_only=True)["extra"]["rng/ranks"]
    assert not torch.equal(ranks[0]["torch"], ranks[1]["torch"])  # the premise: the ranks' RNGs had parted by the checkpoint


def test_a_resume_rank_0_refuses_stops_every_rank_with_one_message(runs):
    # rank 0 checks the resume alone while the others wait: they used to die on gloo's "Connection closed by peer" traceback
    root, tiny = runs
    argv = [a for a in _load_runs().commands(str(root / "refused"), str(tiny))[2] if not a.startswith("data.num_prompts")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlalign", *argv,
           "data.num_prompts=80", "--resume", str(root / "two" / "grpo" / "checkpoints" / "step_00000002")]
    done = launch(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, 300)
    assert done.returncode != 0
    assert "data.num_prompts: 64 in the checkpoint, 80 now" in done.stderr
    assert "rlalign grpo: stopped because learner rank 0 failed (its message is above)" in done.stderr
    # torchrun's own report of the failed ranks is a traceback of torch's launcher; no rank printed one
    assert "Connection closed" not in done.stderr and 'cli.py", line' not in done.stderr, done.stderr[-3000:]


def test_a_reward_that_fails_on_rank_0_alone_leaves_the_others_one_line_each(runs, tmp_path):
    # rank 0 stops with the reward's error while rank 1 waits in the scores' all-gather: it printed gloo's traceback
    root, tiny = runs
    (tmp_path / "picky.py").write_text("import os\n\ndef picky(completions, **kwargs):\n    if os.environ['RANK'] == '0':\n"
                                       "        raise ValueError('a row rank 0 holds')\n    return [0.0] * len(completions)\n")
    argv = [a for a in _load_runs().commands(str(tmp_path / "run"), str(tiny))[2] if not a.startswith(("rewards=", "output_dir="))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlalign", *argv,
           "rewards=[{function: 'picky:picky'}]", f"output_dir={tmp_path / 'run'}", "steps=1"]
    done = launch(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, 300, cwd=tmp_path)
    assert done.returncode != 0
    assert "rlalign grpo: reward function picky raised ValueError: a row rank 0 holds" in done.stderr
    assert "rlalign grpo: rank 1 stopped: a collective with the other processes failed, most likely because one of them ended first" in done.stderr
    assert 'cli.py", line' not in done.stderr, done.stderr[-3000:]


def test_one_process_world_is_the_identity():
    world = distributed.init()
    assert not world.distributed and world.is_main and world.shard(8) == slice(0, 8)
    x = torch.arange(4.0)
    assert distributed.gather_rows(x, world) is x
    assert distributed.loss_scale(torch.tensor(3.0), world) == 1.0
    assert distributed.reduce_stats({"a": 2.0, "ratio_dev": 0.5}, 3.0, 1.0, world) == {"a": 2.0, "ratio_dev": 0.5}


def test_uneven_shares_are_clear_errors():
    from rlalign.config import ConfigError
    from rlalign.train.loop import check_world

    world = distributed.World(rank=0, size=2)
    with pytest.raises(ValueError, match="cannot be split evenly across 2 processes"):
        world.shard(7, "batch_size")
    with pytest.raises(ConfigError, match="prompts_per_step=3 must be a multiple of the number of processes"):
        check_world(world, 3, 12, 1)
    with pytest.raises(ConfigError, match="num_minibatches=3 must divide each process's 8 rows"):
        check_world(world, 4, 16, 3)
    with pytest.raises(ConfigError, match="eval.num_prompts=1 is fewer than the 2 processes"):  # was a ValueError at the first evaluation
        check_world(world, 4, 16, 1, eval_prompts=1)
    check_world(world, 4, 16, 1, eval_prompts=2)


def test_ddp_timeout_is_the_process_groups_timeout(monkeypatch, tmp_path):
    # fixed at 1800 s before: a reward or a checkpoint slower than that on one rank stopped the run, with no setting to raise it
    import datetime

    from rlalign.config import load_config
    from rlalign.train import grpo, loop

    class Joined(Exception):
        pass

    seen = []

    def init_process_group(backend, timeout):
        seen.append(timeout)
        raise Joined

    monkeypatch.setattr(distributed.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(grpo.GRPOConfig, None, {"ddp_timeout": 7200, "output_dir": str(tmp_path)})
    with pytest.raises(Joined):
        loop.start_run(cfg, 8, "prompts_per_step")
    assert seen == [datetime.timedelta(seconds=7200)]


@pytest.mark.parametrize(("settings", "message"), [
    ({"batch": 7}, "batch_size=7 must be a multiple of the number of processes \\(2\\)"),  # SFT, RM, DPO: was a traceback on every rank
    ({"save_merged": True, "lora": {"r": 4}, "sharding": "fsdp"}, "save_merged=true is not supported with model.sharding=fsdp"),  # was after training
])
def test_settings_that_cannot_split_across_processes_fail_before_anything_is_built(monkeypatch, tmp_path, settings, message):
    from types import SimpleNamespace

    from rlalign.config import ConfigError
    from rlalign.train import loop

    monkeypatch.setattr(loop.distributed, "init", lambda device, producers=None, timeout_s=None: distributed.World(rank=0, size=2))
    model = SimpleNamespace(device="cpu", lora=settings.get("lora"), sharding=settings.get("sharding", "ddp"))
    cfg = SimpleNamespace(model=model, save_merged=settings.get("save_merged", False), output_dir=str(tmp_path / "run"), ddp_timeout=1800.0)
    with pytest.raises(ConfigError, match=message):
        loop.start_run(cfg, settings.get("batch", 8), "batch_size")
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("newer_torch", [True, False])
def test_ddp_is_asked_not_to_sync_buffers_by_the_argument_this_torch_has(monkeypatch, newer_torch):
    # newer torch names it forward_sync_buffers (broadcast_buffers deprecated, with a FutureWarning); older torch has only broadcast_buffers
    seen = {}

    def newer(module, device_ids=None, broadcast_buffers=None, process_group=None, forward_sync_buffers=None):
        seen.update(broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers, process_group=process_group)
        return module

    def older(module, device_ids=None, broadcast_buffers=True, process_group=None):
        seen.update(broadcast_buffers=broadcast_buffers, process_group=process_group)
        return module

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", newer if newer_torch else older)
    model = torch.nn.Linear(2, 2)
    learners = object()  # the learners' process group, with producer ranks
    assert distributed.wrap(model, distributed.World(rank=0, size=2, group=learners)) is model
    expected = {"broadcast_buffers": None, "forward_sync_buffers": False} if newer_torch else {"broadcast_buffers": False}
    assert seen == {**expected, "process_group": learners}


def test_shard_frozen_leaves_a_missing_model_and_non_fsdp_runs_alone():
    # no reference (beta = 0) stays None under FSDP; under DDP or in one process a frozen model is returned as it is
    two = distributed.World(rank=0, size=2)
    assert distributed.shard_frozen(None, two, "fsdp") is None
    model = torch.nn.Linear(2, 2)
    assert distributed.shard_frozen(model, two, "ddp") is model
    assert distributed.shard_frozen(model, distributed.World(), "fsdp") is model


def test_each_command_prints_one_summary_line_of_its_own(runs):
    # both ranks share torchrun's standard output: rank 0 alone prints, so the line a script reads parses
    root, tiny = runs
    lines = [line for line in (root / "two.stdout").read_text().splitlines() if line.startswith("{")]
    commands = [argv for sharding in ("ddp", "fsdp") for argv in _load_runs().commands(str(root / "two"), str(tiny), sharding)]
    assert [json.loads(line)["output_dir"] for line in lines] == [next(a for a in argv if a.startswith("output_dir=")).removeprefix("output_dir=") for argv in commands]
