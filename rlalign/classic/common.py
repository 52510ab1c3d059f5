"""What the classic algorithms share: seeding, the config fields every run has, small MLPs with
orthogonal initialisation, episode-return tracking, the greedy evaluation loop, the on-policy
rollout collector (VPG, TRPO and PPO), and the run log that the CLI and the benchmark listen to.

Deliberate simplifications: discrete action spaces only; the deep algorithms need Box (vector)
observations, the tabular ones Discrete observations or the maze's one-hot vectors.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from rlalign.config import Config

__all__ = [
    "ClassicConfig",
    "Result",
    "RunLog",
    "Rollout",
    "EpisodeTracker",
    "seed_everything",
    "mlp",
    "make_vec_env",
    "obs_size",
    "state_index",
    "evaluate",
    "collect_rollout",
    "linear_schedule",
    "maybe_evaluate",
    "finish",
    "torch_act",
    "categorical_logp",
]

ActFn = Callable[[np.ndarray], int]  # one observation -> one action


class ClassicConfig(Config):
    """Fields every classic run has; each algorithm's config derives from this."""

    seed: int = Field(1, description="seeds Python, NumPy, torch and the environments")
    total_steps: int = Field(100_000, ge=1, description="environment steps to train for (all envs together)")
    eval_every: int = Field(0, ge=0, description="evaluate the greedy policy every this many env steps (0: only at the end)")
    eval_episodes: int = Field(10, ge=1, description="episodes per evaluation")
    target_return: float | None = Field(None, description="stop early once an evaluation's mean return reaches this")
    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads; small MLPs are fastest on one thread")


@dataclass
class Result:
    """What ``train`` returns: the trained agent, the episodic returns seen while training, the
    final evaluation, and the run log (per-update metrics, evaluations, timings)."""

    agent: Any
    episode_returns: list[float]
    eval_return: float
    eval_returns: list[float]
    log: "RunLog"


class RunLog:
    """Collects what a run reports. Subclass it to print or write as well (the CLI and the
    benchmark do); ``stop`` set to True ends training at the next check."""

    def __init__(self) -> None:
        self.episodes: list[tuple[int, float]] = []  # (env step, episodic return)
        self.updates: list[dict[str, float]] = []  # per-update metrics, each with "step"
        self.evals: list[tuple[int, float]] = []  # (env step, mean greedy return)
        self.eval_seconds = 0.0  # time spent evaluating, to subtract from wall-clock
        self.start = time.perf_counter()
        self.stop = False

    def episode(self, step: int, ret: float) -> None:
        self.episodes.append((step, ret))

    def update(self, step: int, stats: dict[str, float]) -> None:
        self.updates.append({"step": step, **stats})

    def evaluation(self, step: int, mean_return: float) -> None:
        self.evals.append((step, mean_return))

    def progress(self, step: int) -> None:
        """Called as env steps go by (the CLI advances its progress bar here)."""

    def train_seconds(self) -> float:
        """Wall-clock since the start, evaluations excluded."""
        return time.perf_counter() - self.start - self.eval_seconds

    @property
    def returns(self) -> list[float]:
        return [r for _, r in self.episodes]


def seed_everything(seed: int) -> None:
    """One seed sets Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def linear_schedule(start: float, end: float, duration: int, t: int) -> float:
    """Linear from ``start`` at t=0 to ``end`` at t=duration, then constant (CleanRL's epsilon)."""
    slope = (end - start) / max(duration, 1)
    return max(slope * t + start, end) if end <= start else min(slope * t + start, end)


def mlp(sizes: list[int], activation: type[nn.Module] = nn.Tanh, out_gain: float = 1.0) -> nn.Sequential:
    """Linear layers of ``sizes`` with ``activation`` between them, orthogonal init with gain
    sqrt(2) on hidden layers and ``out_gain`` on the last, biases 0 (CleanRL's layer_init;
    PPO uses out_gain 0.01 for the policy so its first policy is near uniform)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        linear = nn.Linear(n_in, n_out)
        nn.init.orthogonal_(linear.weight, out_gain if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(activation())
    return nn.Sequential(*layers)


def obs_size(space: gym.Space) -> int:
    """Length of a flat Box observation; the deep algorithms need one."""
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
        raise ValueError(f"deep classic algorithms need a flat Box observation space, got {space}")
    return int(space.shape[0])


def state_index(obs: Any) -> int:
    """Tabular state of an observation: a Discrete int as is, a one-hot vector (the maze) by argmax."""
    if isinstance(obs, np.ndarray) and obs.ndim == 1:
        return int(obs.argmax())
    return int(obs)


def make_vec_env(env_id: str, num_envs: int, seed: int) -> gym.vector.VectorEnv:
    """Synchronous vector env with SAME_STEP autoreset: when an episode ends, ``step`` returns the
    reset observation and puts the true last one in ``info["final_obs"]``, so no transition across
    a reset is ever built."""
    import rlalign.classic.maze  # noqa: F401  (registers rlalign/Maze2x3-v0)

    envs = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    envs.action_space.seed(seed)
    return envs


class EpisodeTracker:
    """Running undiscounted return per environment; ``step`` returns the returns of episodes that
    just ended."""

    def __init__(self, num_envs: int) -> None:
        self.running = np.zeros(num_envs)

    def step(self, rewards: np.ndarray, dones: np.ndarray) -> list[float]:
        self.running += rewards
        finished = self.running[dones].tolist()
        self.running[dones] = 0.0
        return finished


def evaluate(act: ActFn, env_id: str, episodes: int, seed: int) -> list[float]:
    """Undiscounted return of ``episodes`` episodes of ``act`` (usually greedy), env seeded once."""
    import rlalign.classic.maze  # noqa: F401

    spec = gym.spec(env_id)
    env = gym.make(env_id, max_episode_steps=None if spec.max_episode_steps else 1000)  # CliffWalking has no limit
    returns = []
    obs, _ = env.reset(seed=seed)
    for _ in range(episodes):
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
        obs, _ = env.reset()
    env.close()
    return returns


def maybe_evaluate(cfg: ClassicConfig, env_id: str, act: ActFn, log: RunLog, step: int, last: int) -> int:
    """Evaluate when ``eval_every`` steps have passed since ``last``; sets ``log.stop`` at the
    target. Returns the step of the latest evaluation."""
    if cfg.eval_every == 0 or step - last < cfg.eval_every:
        return last
    t0 = time.perf_counter()
    mean = float(np.mean(evaluate(act, env_id, cfg.eval_episodes, seed=cfg.seed + 10_000)))
    log.eval_seconds += time.perf_counter() - t0
    log.evaluation(step, mean)
    if cfg.target_return is not None and mean >= cfg.target_return:
        log.stop = True
    return step


def finish(cfg: ClassicConfig, env_id: str, agent: Any, act: ActFn, log: RunLog) -> Result:
    """The final evaluation and the Result."""
    returns = evaluate(act, env_id, cfg.eval_episodes, seed=cfg.seed + 20_000)
    return Result(agent, log.returns, float(np.mean(returns)), returns, log)


def torch_act(net: nn.Module) -> ActFn:
    """Greedy action of a network mapping observations to logits or Q-values."""

    def act(obs: np.ndarray) -> int:
        with torch.no_grad():
            return int(net(torch.as_tensor(obs, dtype=torch.float32)).argmax())

    return act


@dataclass
class Rollout:
    """T steps of N environments, time-major. ``next_values[t]`` is V(s_{t+1}) with the true final
    observation where an episode ended (SAME_STEP autoreset), so truncation bootstraps correctly."""

    obs: Tensor  # (T, N, obs_dim)
    actions: Tensor  # (T, N) long
    logp: Tensor  # (T, N) log pi_old(a_t | s_t)
    values: Tensor  # (T, N) V(s_t), zeros without a critic
    next_values: Tensor  # (T, N) V(s_{t+1})
    rewards: Tensor  # (T, N)
    terminated: Tensor  # (T, N) 1 where s_{t+1} is terminal: no bootstrap
    episode_ends: Tensor  # (T, N) 1 where terminated or truncated: the recursion stops


def collect_rollout(
    envs: gym.vector.VectorEnv,
    obs: np.ndarray,
    policy: nn.Module,
    value: nn.Module | None,
    num_steps: int,
    tracker: EpisodeTracker,
    log: RunLog,
    step: int,
) -> tuple[Rollout, np.ndarray, int]:
    """Sample ``num_steps`` steps from every env with pi(a|s) = softmax(policy(s)).

    Returns the rollout, the observation to continue from and the env-step counter.
    """
    n = envs.num_envs
    obs_buf, act_buf, logp_buf = [], [], []
    rewards, terminateds, dones = (np.zeros((num_steps, n), dtype=np.float32) for _ in range(3))  # (T, N)
    finals: list[tuple[int, int, np.ndarray]] = []  # (t, env, true final observation)
    for t in range(num_steps):
        obs_t = torch.as_tensor(obs, dtype=torch.float32)  # (N, obs_dim)
        with torch.no_grad():
            logp_all = torch.log_softmax(policy(obs_t), dim=-1)  # (N, A), as categorical_logp computes it
            action = torch.multinomial(logp_all.exp(), 1)  # (N, 1)
        obs, reward, terminated, truncated, info = envs.step(action.squeeze(1).numpy())
        done = terminated | truncated
        for i in np.flatnonzero(done):
            finals.append((t, int(i), info["final_obs"][i]))
        for ret in tracker.step(reward, done):
            log.episode(step + (t + 1) * n, ret)
        obs_buf.append(obs_t)
        act_buf.append(action.squeeze(1))
        logp_buf.append(logp_all.gather(1, action).squeeze(1))
        rewards[t], terminateds[t], dones[t] = reward, terminated, done
    step += num_steps * n
    log.progress(step)
    obs_all = torch.stack(obs_buf)  # (T, N, obs_dim)
    with torch.no_grad():
        if value is None:
            values = torch.zeros(num_steps, n)
            next_values = torch.zeros(num_steps, n)
        else:
            values = value(obs_all).squeeze(-1)  # (T, N)
            last = value(torch.as_tensor(obs, dtype=torch.float32)).squeeze(-1)  # (N,)
            next_values = torch.cat([values[1:], last[None]])  # (T, N)
            for t, i, final in finals:
                next_values[t, i] = value(torch.as_tensor(final, dtype=torch.float32)).squeeze(-1)
    rollout = Rollout(
        obs=obs_all,
        actions=torch.stack(act_buf),
        logp=torch.stack(logp_buf),
        values=values,
        next_values=next_values,
        rewards=torch.from_numpy(rewards),
        terminated=torch.from_numpy(terminateds),
        episode_ends=torch.from_numpy(dones),
    )
    return rollout, obs, step


def categorical_logp(policy: nn.Module, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
    """log pi(a|s) of the taken actions and the logits. Shapes: obs (..., obs_dim), actions (...)."""
    logits = policy(obs)  # (..., A)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)  # (...)
    return logp, logits

