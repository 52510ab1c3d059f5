"""``rlalign classic ALGO --env ID [--config recipe.yaml] [--seed N] [--out DIR] [key=value ...]``

Trains one classic algorithm with a progress bar, writes the episodic returns, per-update metrics
and evaluations as JSONL under ``--out`` (returns.jsonl, metrics.jsonl, evals.jsonl, config.yaml,
and the networks as safetensors), curves.png (episodic return against env step, smoothed; the
greedy evaluations; a few of the algorithm's update metrics), and prints the final evaluation.

    rlalign classic ppo --env CartPole-v1 --config configs/classic/ppo_cartpole.yaml --seed 2
    rlalign classic q_learning --env rlalign/Maze2x3-v0 total_steps=2000

Before anything is written: the config is validated, the environment is made once and checked
against the algorithm (``common.check_env``; the ``module:EnvId`` form imports ``module``), and an
``--out`` that already holds a run is refused unless ``overwrite=true`` is given (then that run's
files go first; other files stay). A run that meets a non-finite number stops with one message
(``common.FiniteGuard``) and saves no weights and no curves.png; its logs so far stay in ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shutil
from pathlib import Path
from typing import IO, Any

import numpy as np
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlalign.classic.common import NonFiniteError, RunLog, check_env
from rlalign.config import ConfigError, load_config

# algorithm -> (module, config class)
ALGORITHMS: dict[str, tuple[str, str]] = {
    "value_iteration": ("rlalign.classic.value_iteration", "ValueIterationConfig"),
    "q_learning": ("rlalign.classic.q_learning", "QLearningConfig"),
    "dqn": ("rlalign.classic.dqn", "DQNConfig"),
    "vpg": ("rlalign.classic.vpg", "VPGConfig"),
    "trpo": ("rlalign.classic.trpo", "TRPOConfig"),
    "ppo": ("rlalign.classic.ppo", "PPOConfig"),
}
ALIASES = {"vi": "value_iteration", "q": "q_learning", "reinforce": "vpg"}
# what a run writes in --out: a directory holding any of them (or what an LM trainer writes) holds a run
RUN_FILES = ("config.yaml", "returns.jsonl", "metrics.jsonl", "evals.jsonl", "curves.png", "table.npy",
             "q_network.safetensors", "actor.safetensors", "critic.safetensors")
# update metrics drawn in curves.png besides the returns (those an algorithm logs; Q-learning logs none)
CURVE_METRICS: dict[str, tuple[str, ...]] = {
    "value_iteration": ("bellman_residual",),  # max_s |V_new(s) - V(s)| against the sweep: no env steps, no episodes
    "q_learning": (),
    "dqn": ("loss/td", "q/mean"),
    "vpg": ("loss/policy",),
    "trpo": ("kl", "loss/value", "explained_variance"),
    "ppo": ("approx_kl", "entropy", "loss/value", "explained_variance"),
}


class CLILog(RunLog):
    """RunLog that also writes JSONL lines and drives a rich progress bar."""

    def __init__(self, out: Path, progress: Progress, task: Any) -> None:
        super().__init__()
        self.files: dict[str, IO[str]] = {name: open(out / f"{name}.jsonl", "w") for name in ("returns", "metrics", "evals")}
        self.bar, self.task = progress, task
        self.last_step = 0  # env steps done, as last reported

    def _write(self, name: str, record: dict[str, Any]) -> None:
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}  # NaN/inf as null: strict JSON
        self.files[name].write(json.dumps(strict, allow_nan=False) + "\n")

    def episode(self, step: int, ret: float) -> None:
        super().episode(step, ret)
        self._write("returns", {"step": step, "return": ret})

    def update(self, step: int, stats: dict[str, float]) -> None:
        super().update(step, stats)
        self._write("metrics", {"step": step, **stats})

    def evaluation(self, step: int, mean_return: float) -> None:
        super().evaluation(step, mean_return)
        self._write("evals", {"step": step, "mean_return": mean_return, "train_seconds": self.train_seconds()})

    def progress(self, step: int) -> None:
        recent = self.returns[-20:]
        text = f"return(last 20) {np.mean(recent):8.2f}" if recent else "no episode yet"
        self.bar.update(self.task, completed=step, description=text)
        self.last_step = step

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-command per algorithm, so ``key=value`` overrides may follow the options."""
    sub = parser.add_subparsers(dest="algo", required=True, metavar="ALGO")
    for name in sorted(ALGORITHMS) + sorted(ALIASES):
        canonical = ALIASES.get(name, name)
        p = sub.add_parser(
            name,
            help=canonical if name in ALIASES else importlib.import_module(ALGORITHMS[name][0]).__doc__.splitlines()[0],
            epilog="config keys (key=value):\n" + _describe(canonical)
            + f"\n  {'overwrite':<24} start afresh in an --out that holds a run, deleting that run's files first (default false: an error)",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--env", required=True, help="Gymnasium id, e.g. CartPole-v1, FrozenLake-v1, rlalign/Maze2x3-v0")
        p.add_argument("--config", default=None, help="YAML recipe (configs/classic/*.yaml)")
        p.add_argument("--seed", type=int, default=None, help="overrides the recipe's seed")
        p.add_argument("--out", default=None, help="output folder (default runs/classic/ALGO_ENV_sSEED)")
        p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. lr=3e-4 hidden=[128,128]")


def _describe(algo: str) -> str:
    module_name, cls_name = ALGORITHMS[algo]
    cls = getattr(importlib.import_module(module_name), cls_name)
    return "\n".join(f"  {k:<24} {f.description} (default {f.default})" for k, f in cls.model_fields.items())


def run(args: argparse.Namespace) -> int:
    algo = ALIASES.get(args.algo, args.algo)
    module_name, cls_name = ALGORITHMS[algo]
    module = importlib.import_module(module_name)
    overwrite, overrides = _take_overwrite(list(args.overrides))
    overrides += [f"seed={args.seed}"] if args.seed is not None else []
    cfg = load_config(getattr(module, cls_name), args.config, overrides)
    env_id = check_env(args.env, module.ENV_KIND)  # made once here: a bad id or space fails before anything is written
    safe_env = args.env.replace("/", "_").replace(":", "_")
    out = Path(args.out or f"runs/classic/{algo}_{safe_env}_s{cfg.seed}")
    _claim_out(out, overwrite)
    (out / "config.yaml").write_text(yaml.safe_dump({"algo": algo, "env": args.env, **cfg.model_dump()}))

    console = Console()
    total = getattr(cfg, "total_steps", None)  # None: value iteration sweeps the model, no env steps
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        log = CLILog(out, progress, progress.add_task("starting" if total else algo, total=total))
        try:
            result = module.train(cfg, env_id, log)
        except NonFiniteError as err:
            raise NonFiniteError(f"{err}; stopped, no weights saved (the logs so far are in {out})") from err
        finally:
            log.close()
        seconds = result.log.train_seconds()
        if total is None:
            progress.update(log.task, total=1, completed=1)
    _save_agent(result.agent, out)
    final_eval = None if total is None else (log.last_step, result.eval_return)  # value iteration: a model sweep, no learning curve to end
    write_curves(out / "curves.png", f"{algo} on {args.env} — {out}", log, CURVE_METRICS[algo], final_eval, "env step" if total else "sweep")
    evals = ", ".join(f"{s}: {m:.1f}" for s, m in result.log.evals)
    if evals:
        console.print(f"evaluations (step: mean return): {evals}")
    console.print(
        f"[bold]{algo} on {args.env}[/bold]: final evaluation {result.eval_return:.2f} "
        f"(mean of {len(result.eval_returns)} greedy episodes), {len(result.episode_returns)} training episodes, "
        f"{seconds:.1f}s training; logs and curves.png in {out}"
    )
    return 0


def _take_overwrite(overrides: list[str]) -> tuple[bool, list[str]]:
    """``overwrite=true|false`` out of the key=value overrides (a choice of this invocation, not of the
    recipe, so not a config key), and the other overrides."""
    overwrite, rest = False, []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() != "overwrite":
            rest.append(item)
            continue
        parsed = yaml.safe_load(value) if value.strip() else None
        if not isinstance(parsed, bool):
            raise ConfigError(f"overwrite = {value!r}: must be true or false")
        overwrite = parsed
    return overwrite, rest


def _claim_out(out: Path, overwrite: bool) -> None:
    """Make ``out`` ready for a fresh run: refuse it when it holds a run (a classic one or an LM
    trainer's), unless ``overwrite``; then delete that run's files (only those: other files stay)."""
    from rlalign.train.run_dir import RUN_FILES as LM_RUN_FILES

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory; choose another --out")
    used = [name for name in dict.fromkeys(RUN_FILES + LM_RUN_FILES) if (out / name).exists()]
    if used and not overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already holds a run ({', '.join(used)}); choose another --out, "
            "or add overwrite=true to delete that run's files first"
        )
    for name in used:
        path = out / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def write_curves(out: Path, title: str, log: RunLog, metrics: tuple[str, ...], final_eval: tuple[int, float] | None, xlabel: str = "env step") -> Path:
    """curves.png of a run: the episodic return against env step (smoothed), the greedy evaluations
    and ``final_eval`` ((env step, mean return) of the final one), and the update ``metrics`` it logged."""
    from rlalign.train.metrics import plot_curves  # matplotlib and the plotting code, loaded once the run is over

    series: dict[str, tuple[list[float], list[float]]] = {}
    if log.episodes:
        series["episodic return"] = ([s for s, _ in log.episodes], [r for _, r in log.episodes])
    evals = log.evals + [final_eval] * (final_eval is not None and (not log.evals or log.evals[-1][0] != final_eval[0]))  # unless a periodic one sits at its step
    if evals:
        series["eval return (greedy)"] = ([s for s, _ in evals], [m for _, m in evals])
    for key in metrics:
        points = [(u["step"], u[key]) for u in log.updates if u.get(key) is not None]
        if points:
            series[key] = ([s for s, _ in points], [v for _, v in points])
    return plot_curves(series, out, title, xlabel, smooth=bool(log.episodes))  # value iteration's residuals are exact: drawn as they are


def _save_agent(agent: Any, out: Path) -> None:
    """Networks as safetensors, tables as .npy."""
    from safetensors.torch import save_file
    from torch import nn

    if isinstance(agent, np.ndarray):
        np.save(out / "table.npy", agent)
        return
    nets = agent if isinstance(agent, dict) else {"q_network": agent}
    for name, net in nets.items():
        if isinstance(net, nn.Module):
            save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(out / f"{name}.safetensors"))
