"""The real CLI with tiny budgets, and every recipe in configs/classic validates."""

import importlib
import json
from pathlib import Path

import pytest

from rlalign.classic.cli import ALGORITHMS
from rlalign.cli import main
from rlalign.config import load_config

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs" / "classic").glob("*.yaml"))


def test_q_learning_on_the_maze_through_the_cli(tmp_path, capsys):
    rc = main(["classic", "q_learning", "--env", "rlalign/Maze2x3-v0", "--seed", "2", "--out", str(tmp_path), "total_steps=2000"])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "returns.jsonl").read_text().splitlines()]
    assert len(lines) > 100 and {r["return"] for r in lines} <= {-10.0, 0.0, 10.0}
    assert "final evaluation 10.00" in capsys.readouterr().out
    assert (tmp_path / "table.npy").is_file() and "seed: 2" in (tmp_path / "config.yaml").read_text()


def test_ppo_through_the_cli_writes_metrics_and_weights(tmp_path):
    rc = main(["classic", "ppo", "--env", "CartPole-v1", "--out", str(tmp_path), "total_steps=512", "num_envs=2", "num_steps=128", "update_epochs=1", "eval_every=256"])
    assert rc == 0
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and {"approx_kl", "clip_frac", "explained_variance", "entropy"} <= set(metrics[0])
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "actor.safetensors").is_file()


def test_unknown_key_is_an_error_naming_it(tmp_path, capsys):
    rc = main(["classic", "dqn", "--env", "CartPole-v1", "--out", str(tmp_path), "lrr=1e-3"])
    assert rc == 2
    assert "unknown key 'lrr'. Did you mean 'lr'?" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_validate(recipe):
    algo = max((a for a in ALGORITHMS if recipe.stem.startswith(a + "_")), key=len)
    module, cls = ALGORITHMS[algo]
    cfg = load_config(getattr(importlib.import_module(module), cls), recipe)
    assert cfg.model_dump()  # every key was known and every value in range
