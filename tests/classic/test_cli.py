"""The real CLI with tiny budgets (logs, weights, curves.png), and every recipe in configs/classic validates."""

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
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_draws_returns_evals_and_update_metrics_against_env_steps(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kwargs: figures.append(fig))
    rc = main(["classic", "dqn", "--env", "CartPole-v1", "--out", str(tmp_path), "total_steps=600", "learning_starts=100", "eval_every=200",
               "eval_episodes=2"])
    assert rc == 0 and "logs and curves.png in" in capsys.readouterr().out
    (fig,) = figures
    assert fig.get_suptitle() == f"dqn on CartPole-v1 — {tmp_path}"
    assert [ax.get_ylabel() for ax in fig.axes] == ["episodic return", "eval return (greedy)", "loss/td", "q/mean"]
    assert all(ax.get_xlabel() == "env step" for ax in fig.axes)
    returns = [json.loads(x) for x in (tmp_path / "returns.jsonl").read_text().splitlines()]
    raw, smoothed = fig.axes[0].get_lines()  # many episodes: the raw returns, light, under their moving average
    assert list(raw.get_xdata()) == [r["step"] for r in returns] and list(raw.get_ydata()) == [r["return"] for r in returns]
    assert raw.get_alpha() < 0.5 and len(smoothed.get_ydata()) == len(returns)
    evals = [json.loads(x) for x in (tmp_path / "evals.jsonl").read_text().splitlines()]
    (points,) = fig.axes[1].get_lines()
    assert list(points.get_xdata()) == [e["step"] for e in evals] == [200, 400, 600]  # the final evaluation sits at 600 too: drawn once


def test_value_iteration_through_the_cli_draws_its_bellman_residual_per_sweep(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kwargs: figures.append(fig))
    assert main(["classic", "vi", "--env", "rlalign/Maze2x3-v0", "--out", str(tmp_path), "eval_episodes=1"]) == 0
    assert "1/1" in capsys.readouterr().out  # its one bar ends full
    (fig,) = figures
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("sweep", "bellman_residual")
    (line,) = ax.get_lines()  # exact values, drawn as they are
    residuals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "bellman_residual" in x]
    assert list(line.get_ydata()) == [r["bellman_residual"] for r in residuals] and list(line.get_xdata()) == list(range(1, len(residuals) + 1))


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
