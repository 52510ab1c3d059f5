"""Tools, environments and agents under torchrun (gloo, CPU), with and without a producer rank.

GRPO with multi-turn tool calls, with the lookup task's Python environment, and with an ``openai``
agent making one or two calls an episode (so the ranks hold unequal numbers of rows) runs for two
steps as two learner processes, as two learners and a producer rank, and in this process: the final
weights agree to float32 round-off and so do the logged metrics (bar wall-clock and the endpoint's
batching). Each rank runs its share of the episodes, named and drawn by their place in the step, so
a shard's rows are the rows the whole step makes in one process: pinned here on the multi-turn
sampler with a stand-in whose replies follow each row's uniforms.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlalign.lm.models import load_tokenizer
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import SamplingParams
from rlalign.lm.tools import TAG, ToolEnvironment, ToolRegistry
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import tool_rollout as tr
from tests.train.run_records import compared_metrics, launch

RUNS = Path(__file__).with_name("episode_runs.py")
ROOT = Path(__file__).resolve().parents[2]
NOT_COMPARED = ("time", "tokens_per_s", "agent/seconds", "agent/calls_per_batch", "memory/")  # wall clock; how requests happened to batch; rows per forward


def _metrics(run: Path) -> list[dict[str, float]]:
    return compared_metrics(run, NOT_COMPARED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    tiny = build_tiny_checkpoint(root / "tiny", TinyModelSpec(hidden_size=32, num_layers=2, intermediate_size=64), seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    names = ["tools", "environment", "agent"]
    for out, procs, producers in (("two", 2, 0), ("producer", 3, 1)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), str(RUNS), str(root / out), str(tiny), str(producers), *names]
        done = launch(cmd, env, 300, ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    sys.path.insert(0, str(ROOT))
    from tests.train import episode_runs

    for name in names:
        episode_runs.run(str(root / "one"), str(tiny), 0, name)
    return root


@pytest.mark.parametrize("world", ["two", "producer"])
@pytest.mark.parametrize("name", ["tools", "environment", "agent"])
def test_episodes_under_torchrun_train_as_one_process(runs, name, world):
    one, other = load_file(str(runs / "one" / name / "final" / "model.safetensors")), load_file(str(runs / world / name / "final" / "model.safetensors"))
    assert one.keys() == other.keys()
    for key in one:
        # measured: largest difference ~6e-6 (two layers, lr 3e-3: round-off of sums split across ranks, through Adam)
        torch.testing.assert_close(other[key], one[key], rtol=1e-4, atol=5e-5, msg=lambda m: f"{name} {world} {key}: {m}")
    m1, m2 = _metrics(runs / "one" / name), _metrics(runs / world / name)
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [0, 1]
    for r1, r2 in zip(m1, m2):
        assert r1.keys() <= r2.keys()
        for key in r1:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-5), (name, world, r1["step"], key)
    if name == "agent":  # the ranks held unequal rows: episodes of one and of two calls
        assert all(1.0 < r["agent/calls"] < 2.0 and r["agent/calls_max"] == 2.0 for r in m1)


def test_a_shard_of_multi_turn_episodes_is_those_rows_of_the_whole_step(tmp_path, monkeypatch):
    # a stand-in sampler whose reply follows each row's first uniform: a calculator call, or an answer;
    # after a result it answers. Rows 2..3 of 4 sampled alone, drawing the step's uniforms, are rows 2..3 of the whole.
    tiny = build_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)
    tokenizer = load_tokenizer(tiny)

    def scripted(model, prompts, params, pad, stop, group_size, generator=None, noise=None):
        texts = ["42<eos>" if "<result>" in tokenizer.decode(p) else ("<tool>calculator: 6*7</tool>" if u < 0.5 else f"{int(u * 100)}<eos>")
                 for p, u in zip(prompts, noise[0].tolist())]
        rows = [tokenizer(t.removesuffix("<eos>"), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * t.endswith("<eos>") for t in texts]
        width = max(len(r) for r in rows)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        return Rollout(torch.ones((len(rows), 1), dtype=torch.long), torch.ones((len(rows), 1), dtype=torch.long), ids, mask, -0.5 * mask.float(),
                       torch.arange(len(rows)), torch.zeros(len(rows), dtype=torch.bool))

    monkeypatch.setattr(tr, "sample", scripted)
    registry = ToolRegistry.builtin(["calculator"])
    records = [{"prompt": f"6*7= ({i})"} for i in range(2)]

    def episodes(part: list, shard: tuple[slice, int]):
        env = lambda: ToolEnvironment(registry, TAG, 3, 500)  # noqa: E731
        return tr.tool_rollout(None, tokenizer, part, env, TAG, SamplingParams(8), 2, 3, torch.Generator().manual_seed(7), shard)

    whole = episodes(records, (slice(0, 4), 4))
    second = episodes(records[1:], (slice(2, 4), 4))
    assert whole.turns.tolist()[2:] == second.turns.tolist() and whole.final_texts[2:] == second.final_texts
    assert sorted(set(whole.turns.tolist())) == [1, 2]  # some rows called the tool and answered after its result
    width = second.rollout.completion_ids.shape[1]
    assert torch.equal(whole.rollout.completion_ids[2:, :width], second.rollout.completion_ids)
