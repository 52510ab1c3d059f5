"""``rlalign demo`` end to end with a toy budget (seconds, not minutes): every stage runs through the
real trainers, the table and summary.json come out, the KL of the SFT rows to themselves is ~0.

The full-budget numbers (GRPO above SFT, PPO raising the hidden score at bounded KL) are measured
by running ``rlalign demo`` itself; they are recorded in the README and benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json

import torch

from rlalign.cli import main
from rlalign.demo import format_table

torch.set_num_threads(1)


def test_demo_runs_every_stage_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", f"output_dir={out}", "num_threads=1", "hidden_size=32", "num_layers=1", "sft_arithmetic_steps=20", "grpo_steps=2",
            "grpo_prompts_per_step=4", "sft_preference_steps=20", "rm_steps=10", "ppo_steps=2", "ppo_prompts_per_step=4", "eval_prompts=16",
            "progress=false"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "hidden score" in printed and "KL to SFT" in printed

    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]
    assert [(r["task"], r["stage"]) for r in rows] == [("arithmetic", "SFT"), ("arithmetic", "GRPO"), ("preference", "SFT"), ("preference", "PPO")]
    for r in rows:
        assert ("accuracy" in r) == (r["task"] == "arithmetic") and ("hidden_score" in r) == (r["task"] == "preference")
        score = r.get("accuracy", r.get("hidden_score"))
        assert 0.0 <= score <= 1.0
    # the SFT model against itself: sampler log-probs minus a fresh forward's, ~0 per sequence
    assert abs(rows[0]["kl_to_sft"]) < 1e-3 and abs(rows[2]["kl_to_sft"]) < 1e-3
    assert abs(rows[3]["kl_to_sft"]) > 1e-3  # PPO moved the policy (GRPO may not: with this budget every reward is 0)
    assert set(summary["seconds"]) >= {"sft_arithmetic", "grpo", "sft_preference", "reward_model", "ppo", "evaluation", "total"}
    for stage in ("sft_arithmetic", "grpo_arithmetic", "rm_preference", "ppo_preference"):
        assert (out / stage / "metrics.jsonl").is_file()
    assert (out / "grpo_arithmetic" / "curves.png").is_file() and (out / "ppo_preference" / "curves.png").is_file()


def test_format_table_marks_columns_that_do_not_apply():
    table = format_table([{"stage": "SFT", "task": "arithmetic", "accuracy": 0.25, "kl_to_sft": 0.0},
                          {"stage": "PPO", "task": "preference", "hidden_score": 0.7, "kl_to_sft": 3.5}])
    lines = table.splitlines()
    assert lines[2].split() == ["arithmetic", "SFT", "0.250", "-", "0.000"]
    assert lines[3].split() == ["preference", "PPO", "-", "0.700", "3.500"]
