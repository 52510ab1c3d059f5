"""rlalign's classic algorithms and Stable-Baselines3 side by side, in one process, one thread each.

For every task, framework and seed: train with the same hyperparameters, evaluate the greedy
(deterministic) policy every ``eval_every`` env steps on the same evaluation episodes (10, seeded
identically), and stop at the threshold. Reported: env steps and training wall-clock (evaluation
time excluded) to the first evaluation whose mean return reaches the threshold. Tabular tasks
compare Q-learning's greedy policy value with the value-iteration optimum (no SB3 counterpart).

Stable-Baselines3 (and sb3-contrib for TRPO) is a benchmark-only extra, never a dependency:

    .venv/bin/pip install stable-baselines3 sb3-contrib
    .venv/bin/python benchmarks/classic_vs_sb3.py --tasks cartpole-ppo cartpole-dqn cartpole-trpo --seeds 1 2 3
    .venv/bin/python benchmarks/classic_vs_sb3.py --tasks tabular --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from rlalign.classic.cli import ALGORITHMS
from rlalign.classic.common import RunLog, evaluate, state_index
from rlalign.classic.value_iteration import policy_value, value_iteration
from rlalign.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Task:
    env: str
    algo: str
    recipe: str
    threshold: float
    eval_every: int


TASKS = {
    "cartpole-ppo": Task("CartPole-v1", "ppo", "configs/classic/ppo_cartpole.yaml", 475.0, 5_000),
    "cartpole-dqn": Task("CartPole-v1", "dqn", "configs/classic/dqn_cartpole.yaml", 475.0, 5_000),
    "cartpole-trpo": Task("CartPole-v1", "trpo", "configs/classic/trpo_cartpole.yaml", 475.0, 5_000),
    "acrobot-ppo": Task("Acrobot-v1", "ppo", "configs/classic/ppo_acrobot.yaml", -100.0, 10_000),
    "acrobot-dqn": Task("Acrobot-v1", "dqn", "configs/classic/dqn_acrobot.yaml", -100.0, 5_000),
}
TABULAR = [  # (env, recipe, absolute tolerance on V(start) against the value-iteration optimum)
    ("rlalign/Maze2x3-v0", "configs/classic/q_learning_maze.yaml", 1e-9),
    ("FrozenLake-v1", "configs/classic/q_learning_frozenlake.yaml", 0.01),
    ("CliffWalking-v1", "configs/classic/q_learning_cliffwalking.yaml", 1e-9),
]


@dataclass
class Run:
    task: str
    framework: str
    seed: int
    steps_to_threshold: int | None = None  # env steps at the first evaluation >= threshold
    seconds_to_threshold: float | None = None  # training wall-clock then, evaluations excluded
    best_eval: float = float("-inf")
    total_steps: int = 0
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, mean return, train seconds)


class BenchLog(RunLog):
    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run

    def evaluation(self, step: int, mean_return: float) -> None:
        super().evaluation(step, mean_return)
        self.run.evals.append((step, mean_return, self.train_seconds()))

    def progress(self, step: int) -> None:
        self.run.total_steps = step


def run_rlalign(name: str, task: Task, seed: int) -> Run:
    run = Run(name, "rlalign", seed)
    module_name, cls_name = ALGORITHMS[task.algo]
    module = importlib.import_module(module_name)
    overrides = {"seed": seed, "eval_every": task.eval_every, "eval_episodes": 10, "target_return": task.threshold, "torch_threads": 1}
    cfg = load_config(getattr(module, cls_name), ROOT / task.recipe, overrides)
    log = BenchLog(run)
    module.train(cfg, task.env, log)
    return _finish(run, task)


def _finish(run: Run, task: Task) -> Run:
    for step, mean, seconds in run.evals:
        run.best_eval = max(run.best_eval, mean)
        if run.steps_to_threshold is None and mean >= task.threshold:
            run.steps_to_threshold, run.seconds_to_threshold = step, seconds
    return run


def _sb3_model(task: Task, seed: int):
    """The same hyperparameters as the rlalign recipe, in SB3's names (SB3's default MLPs: 64x64
    tanh actor and critic for PPO/TRPO, as rlalign's; DQN's net_arch from the recipe)."""
    from stable_baselines3 import DQN, PPO
    from stable_baselines3.common.env_util import make_vec_env

    cfg = load_config(getattr(importlib.import_module(ALGORITHMS[task.algo][0]), ALGORITHMS[task.algo][1]), ROOT / task.recipe)
    if task.algo == "ppo":
        lr, clip = cfg.lr, cfg.clip_coef
        return PPO(
            "MlpPolicy", make_vec_env(task.env, n_envs=cfg.num_envs, seed=seed), n_steps=cfg.num_steps,
            batch_size=cfg.num_envs * cfg.num_steps // cfg.num_minibatches, n_epochs=cfg.update_epochs,
            learning_rate=(lambda f: f * lr) if cfg.anneal_lr else lr, clip_range=(lambda f: f * clip) if cfg.anneal_clip else clip,
            gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, ent_coef=cfg.ent_coef, vf_coef=cfg.vf_coef / 2,  # SB3's value loss is (V-R)^2, core's 1/2 (V-R)^2
           
            max_grad_norm=cfg.max_grad_norm, seed=seed, device="cpu",
        ), cfg.total_steps
    if task.algo == "dqn":
        return DQN(
            "MlpPolicy", task.env, learning_rate=cfg.lr, buffer_size=cfg.buffer_size, batch_size=cfg.batch_size,
            learning_starts=cfg.learning_starts, gamma=cfg.gamma, train_freq=cfg.train_freq, gradient_steps=cfg.gradient_steps,
            target_update_interval=cfg.target_update_interval, exploration_fraction=cfg.exploration_fraction,
            exploration_final_eps=cfg.eps_end, max_grad_norm=cfg.max_grad_norm,
            policy_kwargs=dict(net_arch=list(cfg.hidden)), seed=seed, device="cpu",
        ), cfg.total_steps
    if task.algo == "trpo":
        from sb3_contrib import TRPO

        return TRPO(
            "MlpPolicy", make_vec_env(task.env, n_envs=cfg.num_envs, seed=seed), n_steps=cfg.num_steps, batch_size=cfg.critic_minibatch,
            gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, target_kl=cfg.max_kl, cg_max_steps=cfg.cg_iters, cg_damping=cfg.cg_damping,
            line_search_shrinking_factor=cfg.backtrack_coef, line_search_max_iter=cfg.backtrack_iters,
            n_critic_updates=cfg.critic_updates, learning_rate=cfg.critic_lr, seed=seed, device="cpu",
        ), cfg.total_steps
    raise ValueError(task.algo)


def run_sb3(name: str, task: Task, seed: int) -> Run:
    from stable_baselines3.common.callbacks import BaseCallback

    run = Run(name, "sb3", seed)
    start = time.perf_counter()
    eval_seconds = [0.0]

    class Eval(BaseCallback):
        last = 0

        def _on_step(self) -> bool:
            if self.num_timesteps - self.last < task.eval_every:
                return True
            self.last = self.num_timesteps
            t0 = time.perf_counter()
            act = lambda obs: int(self.model.predict(obs, deterministic=True)[0])  # noqa: E731
            mean = float(np.mean(evaluate(act, task.env, 10, seed=seed + 10_000)))
            eval_seconds[0] += time.perf_counter() - t0
            run.evals.append((self.num_timesteps, mean, time.perf_counter() - start - eval_seconds[0]))
            return mean < task.threshold

    model, total = _sb3_model(task, seed)
    model.learn(total_timesteps=total, callback=Eval())
    run.total_steps = model.num_timesteps
    return _finish(run, task)


def tabular(seeds: list[int]) -> list[dict]:
    rows = []
    for env_id, recipe, tol in TABULAR:
        from rlalign.classic import q_learning

        cfg = load_config(q_learning.QLearningConfig, ROOT / recipe)
        P = gym.make(env_id).unwrapped.P
        start = state_index(gym.make(env_id).reset(seed=0)[0])
        v_star, _, _ = value_iteration(P, cfg.gamma)
        for seed in seeds:
            t0 = time.perf_counter()
            result = q_learning.train(cfg.model_copy(update={"seed": seed}), env_id)
            v_pi = policy_value(P, result.agent.argmax(1), cfg.gamma)
            gap = float(v_star[start] - v_pi[start])
            rows.append(dict(env=env_id, seed=seed, steps=cfg.total_steps, v_star=float(v_star[start]), v_greedy=float(v_pi[start]),
                             gap=gap, tol=tol, within=gap <= tol, seconds=time.perf_counter() - t0))
            print(f"tabular {env_id} seed {seed}: V*(start) {v_star[start]:.6f}  V^greedy(start) {v_pi[start]:.6f}  gap {gap:.2e} (tol {tol})", flush=True)
    return rows


def _append(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def summary(runs: list[Run]) -> str:
    """Markdown table: per task and framework, the seeds that reached the threshold and the
    steps / seconds per seed."""
    lines = ["| task | framework | reached | env steps to threshold (per seed) | train seconds to threshold (per seed) |", "|---|---|---|---|---|"]
    for key in dict.fromkeys((r.task, r.framework) for r in runs):
        group = [r for r in runs if (r.task, r.framework) == key]
        steps = ", ".join("-" if r.steps_to_threshold is None else str(r.steps_to_threshold) for r in group)
        secs = ", ".join("-" if r.seconds_to_threshold is None else f"{r.seconds_to_threshold:.1f}" for r in group)
        reached = sum(r.steps_to_threshold is not None for r in group)
        lines.append(f"| {key[0]} | {key[1]} | {reached}/{len(group)} | {steps} | {secs} |")
    return "\n".join(lines)


def warm_up(frameworks: list[str]) -> None:
    """Pay the one-time import costs (SB3; torch._dynamo, which the first Adam() imports, ~3 s)
    before any clock starts, so the first timed run is not charged for them."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)], fused=True)
    if "sb3" in frameworks:
        import sb3_contrib  # noqa: F401
        import stable_baselines3  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS) + ["tabular"], choices=list(TASKS) + ["tabular"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--frameworks", nargs="+", default=["rlalign", "sb3"], choices=["rlalign", "sb3"])
    parser.add_argument("--json", default=None, help="append the raw results here (one JSON object a line)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warm_up(args.frameworks)
    runs: list[Run] = []
    for name in args.tasks:
        if name == "tabular":
            for row in tabular(args.seeds):
                _append(args.json, {"task": "tabular", **row})
            continue
        for seed in args.seeds:
            for framework in args.frameworks:
                run = (run_rlalign if framework == "rlalign" else run_sb3)(name, TASKS[name], seed)
                runs.append(run)
                _append(args.json, asdict(run))
                secs = "-" if run.seconds_to_threshold is None else f"{run.seconds_to_threshold:.1f}"
                print(f"{name:14} {framework:8} seed {seed}: steps to threshold {run.steps_to_threshold}, train seconds {secs}, "
                      f"best eval {run.best_eval:.1f}, steps run {run.total_steps}", flush=True)
    if runs:
        print(summary(runs))


if __name__ == "__main__":
    main()
