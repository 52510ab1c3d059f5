"""The real CLI with tiny budgets (logs, weights, curves.png), every recipe in configs/classic validates,
and bad input (environments, settings, --out, numbers that blow up) is one message with exit 2."""

import importlib
import json
import re
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
    assert len(metrics) == 2 and {"approx_kl", "clip_frac", "clip_active_frac", "explained_variance", "entropy"} <= set(metrics[0])
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


# --------------------------------------------------------------------------------------------
# Bad input: one message, exit 2, nothing written or lost
# --------------------------------------------------------------------------------------------


def strict_json_lines(path: Path) -> list[dict]:
    """The lines of a JSONL file, read as strict JSON (a bare NaN or Infinity is an error)."""

    def refuse(constant):
        raise ValueError(f"{path.name} holds a bare {constant}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``rlalign classic ARGV``: (exit status, stderr)."""
    rc = main(["classic", *map(str, argv)])
    return rc, capsys.readouterr().err


TINY = {
    "dqn": ["total_steps=400", "learning_starts=20", "train_freq=10", "gradient_steps=2", "batch_size=8", "hidden=[8]", "eval_episodes=1"],
    "vpg": ["total_steps=200", "num_envs=1", "num_steps=100", "hidden=[8]", "eval_episodes=1"],
    "trpo": ["total_steps=200", "num_envs=1", "num_steps=100", "hidden=[8]", "eval_episodes=1"],
    "ppo": ["total_steps=200", "num_envs=1", "num_steps=100", "hidden=[8]", "update_epochs=2", "eval_episodes=1"],
}


@pytest.mark.parametrize("algo, setting, message", [
    ("dqn", "lr=1e30", r"dqn: the .* at the update at step \d+ \(lr=1e\+30 too high\?\)"),
    ("vpg", "critic_lr=1e30", r"vpg: the .* at the update at step \d+ \(critic_lr=1e\+30 too high\?\)"),
    ("ppo", "lr=1e30", r"ppo: the .* step \d+ \(lr=1e\+30 too high\?\)"),
    ("trpo", "critic_lr=1e30", r"trpo: the .* at the update at step \d+ \(critic_lr=1e\+30 too high\?\)"),
])
def test_a_learning_rate_that_blows_up_stops_the_run_with_no_weights_saved(algo, setting, message, tmp_path, capsys):
    # Before: dqn and trpo exited 0 with NaN weights saved, vpg and ppo died in torch.multinomial (a traceback).
    rc, err = run_cli(capsys, algo, "--env", "CartPole-v1", "--out", tmp_path, *TINY[algo], setting)
    assert rc == 2 and re.fullmatch(f"rlalign classic: {message}; stopped, no weights saved \\(the logs so far are in {re.escape(str(tmp_path))}\\)\n", err), err
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / "curves.png").exists()
    for name in ("metrics", "returns", "evals"):
        strict_json_lines(tmp_path / f"{name}.jsonl")


@pytest.mark.parametrize("algo", ["q_learning", "dqn", "vpg", "trpo", "ppo"])
def test_a_reward_infinite_in_float32_stops_the_run_naming_env_and_step(algo, huge_reward_envs, tmp_path, capsys):
    # Before: vpg and ppo raised from torch.multinomial; trpo saved a NaN critic; dqn logged "loss/td": Infinity; all but the two exited 0.
    vector, tabular = huge_reward_envs
    env = tabular if algo == "q_learning" else vector
    rc, err = run_cli(capsys, algo, "--env", env, "--out", tmp_path, *TINY.get(algo, ["total_steps=50"]))
    assert rc == 2 and err.startswith(
        f"rlalign classic: {algo}: env {env} returned the reward 1e+39 at step 1; rewards must be finite in float32 (|r| <= 3.4e+38); stopped, no weights saved"
    ), err
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / "table.npy").exists()


def test_metrics_lines_are_strict_json(tmp_path):
    from rlalign.classic.cli import CLILog

    log = CLILog(tmp_path, progress=None, task=None)
    log.update(3, {"loss": float("nan"), "kl": float("inf"), "ok": 0.5})
    log.close()
    assert strict_json_lines(tmp_path / "metrics.jsonl") == [{"step": 3, "loss": None, "kl": None, "ok": 0.5}]


@pytest.mark.parametrize("argv, message", [
    (["ppo", "--env", "NoSuchEnv-v0"], "--env 'NoSuchEnv-v0': Environment `NoSuchEnv` doesn't exist"),
    (["ppo", "--env", "CartPole-v99"], "--env 'CartPole-v99': Environment version `v99` for environment `CartPole` doesn't exist"),
    (["ppo", "--env", "nosuchmodule:Foo-v0"], "--env 'nosuchmodule:Foo-v0': cannot import module 'nosuchmodule'"),
    (["q_learning", "--env", "CartPole-v1"], "--env 'CartPole-v1': q_learning needs Discrete observations"),
    (["dqn", "--env", "FrozenLake-v1"], "--env 'FrozenLake-v1': dqn, vpg, trpo and ppo need vector observations (a flat Box), not Discrete(16)"),
    (["ppo", "--env", "Pendulum-v1"], "--env 'Pendulum-v1': the classic algorithms need a Discrete action space, not Box(1,)"),
    (["vi", "--env", "CartPole-v1"], "--env 'CartPole-v1': value_iteration needs the environment's model"),
    (["ppo", "--env", "CartPole-v1", "hidden=[0]"], "hidden = [0]: every hidden layer size must be >= 1"),
    (["trpo", "--env", "CartPole-v1", "hidden=[0]"], "hidden = [0]: every hidden layer size must be >= 1"),
    (["trpo", "--env", "CartPole-v1", "hidden=[64,-3]"], "hidden = [64, -3]: every hidden layer size must be >= 1"),
    (["vi", "--env", "rlalign/Maze2x3-v0", "gamma=1"], "gamma = 1: Input should be less than 1"),
    (["dqn", "--env", "CartPole-v1", "total_steps=1000"],
     "learning_starts = 1000 and train_freq = 256: the first update would come at env step 1024, after total_steps = 1000"),
    (["ppo", "--env", "CartPole-v1", "--seed", "-1"], "seed = -1: Input should be greater than or equal to 0"),
    (["dqn", "--env", "CartPole-v1", "seed=4294967296"], "seed = 4294967296: Input should be less than 4294967296"),
    (["vi", "--env", "rlalign/Maze2x3-v0", "--seed", "4294967296"], "seed = 4294967296: Input should be less than 4294967296"),
    (["q_learning", "--env", "rlalign/Maze2x3-v0", "seed=-5"], "seed = -5: Input should be greater than or equal to 0"),
    (["q_learning", "--env", "rlalign/Maze2x3-v0", "gamma=1.0"], "gamma = 1.0: Input should be less than 1"),
    (["ppo", "--env", "CartPole-v1", "num_minibatches=1000", "num_envs=1", "num_steps=10"], "num_minibatches = 1000 is more than the batch"),
    (["ppo", "--env", "CartPole-v1", "clip_coef=1e40"], "clip_coef = '1e40': beyond float32's range"),
    (["ppo", "--env", "CartPole-v1", "overwrite=maybe"], "overwrite = 'maybe': must be true or false"),
])
def test_bad_envs_and_settings_are_one_message_before_anything_is_written(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = run_cli(capsys, argv[0], "--out", out, *argv[1:])
    assert rc == 2 and err.startswith("rlalign classic: ") and message in err and "Traceback" not in err, err
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# --out: one run per directory unless overwrite=true
# --------------------------------------------------------------------------------------------


PPO_TINY = ["ppo", "--env", "CartPole-v1", "total_steps=64", "num_envs=1", "num_steps=32", "update_epochs=1", "hidden=[8]", "eval_episodes=1"]


def test_the_largest_seed_numpy_takes_runs(tmp_path, capsys):
    # seeds are 0 <= seed < 2**32 (np.random.seed's range): the last one trains, evaluates and saves
    assert run_cli(capsys, *PPO_TINY, "--seed", 2**32 - 1, "--out", tmp_path / "ppo")[0] == 0
    assert run_cli(capsys, "vi", "--env", "rlalign/Maze2x3-v0", "--seed", 2**32 - 1, "eval_episodes=1", "--out", tmp_path / "vi")[0] == 0


def test_a_second_run_into_an_out_that_holds_a_run_is_refused_and_changes_nothing(tmp_path, capsys):
    assert run_cli(capsys, *PPO_TINY, "--out", tmp_path)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rc, err = run_cli(capsys, *PPO_TINY, "seed=7", "--out", tmp_path)
    assert rc == 2 and err == (
        f"rlalign classic: --out '{tmp_path}' already holds a run (config.yaml, returns.jsonl, metrics.jsonl, evals.jsonl, curves.png, "
        "actor.safetensors, critic.safetensors); choose another --out, or add overwrite=true to delete that run's files first\n"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_overwrite_true_replaces_the_old_run_whole_and_keeps_other_files(tmp_path, capsys):
    assert run_cli(capsys, *PPO_TINY, "--out", tmp_path)[0] == 0
    (tmp_path / "notes.txt").write_text("mine")
    rc, _ = run_cli(capsys, "dqn", "--env", "CartPole-v1", "--out", tmp_path, "overwrite=true", *TINY["dqn"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml", "curves.png", "evals.jsonl", "metrics.jsonl", "notes.txt", "q_network.safetensors", "returns.jsonl"
    ]  # no actor or critic of the ppo run left beside the q-network
    assert "algo: dqn" in (tmp_path / "config.yaml").read_text() and (tmp_path / "notes.txt").read_text() == "mine"


def test_an_out_with_only_other_files_is_used(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert run_cli(capsys, *PPO_TINY, "--out", tmp_path)[0] == 0
    assert (tmp_path / "actor.safetensors").is_file() and (tmp_path / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------------
# Gymnasium's module:EnvId form, end to end
# --------------------------------------------------------------------------------------------


def test_the_module_env_form_trains_evaluates_and_saves(env_module, tmp_path, capsys):
    # Before: trained, then the evaluation's gym.spec raised NameNotFound: exit 1, no network saved.
    module, env_id = env_module
    out = tmp_path / "out"
    rc, _ = run_cli(capsys, "dqn", "--env", f"{module}:{env_id}", "--out", out, *TINY["dqn"])
    assert rc == 0 and (out / "q_network.safetensors").is_file()
    assert f"env: {module}:{env_id}" in (out / "config.yaml").read_text()  # recorded as given, so the command reruns
