"""Deep Q-learning: a Q-network trained on minibatches from a replay buffer against a target network.

    y = r + gamma * (1 - terminated) * max_a' Q_target(s', a')
    L = mean( huber(Q(s, a) - y) )         (or the squared error, as in the seed)

Mnih et al. (2015), "Human-level control through deep reinforcement learning"; seed 002, section 3.2.
The target network is either a hard copy of the Q-network every ``target_update_interval`` env
steps, or the seed's "mean teacher" (Tarvainen & Valpola 2017): an exponential moving average
theta_target <- tau * theta + (1 - tau) * theta_target after every gradient step.

One environment (as CleanRL's dqn.py). A truncated episode bootstraps from its true final
observation; only termination zeroes the target's future term.
"""

from __future__ import annotations

import copy
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from rlalign.core.bellman import polyak_update_, q_learning_target
from rlalign.classic.common import (
    ClassicConfig,
    EpisodeTracker,
    FiniteGuard,
    Hidden,
    Result,
    RunLog,
    finish,
    linear_schedule,
    maybe_evaluate,
    mlp,
    num_actions,
    obs_size,
    seed_everything,
    torch_act,
)

__all__ = ["DQNConfig", "ENV_KIND", "ReplayBuffer", "train"]

ENV_KIND = "vector"  # what common.check_env asks of the environment


class DQNConfig(ClassicConfig):
    """Deep Q-learning. Defaults: the SB3 zoo's CartPole-v1 recipe."""

    total_steps: int = Field(50_000, ge=1, description="environment steps to train for")
    lr: float = Field(2.3e-3, gt=0.0, description="Adam learning rate")
    buffer_size: int = Field(100_000, ge=1, description="replay buffer capacity (transitions)")
    batch_size: int = Field(64, ge=1, description="transitions per gradient step")
    gamma: float = Field(0.99, gt=0.0, le=1.0, description="discount factor")
    learning_starts: int = Field(1_000, ge=0, description="env steps of pure collection before the first update")
    train_freq: int = Field(256, ge=1, description="update every this many env steps")
    gradient_steps: int = Field(128, ge=1, description="gradient steps per update")
    target: Literal["hard", "ema"] = Field("hard", description="target network: hard copy or EMA 'mean teacher'")
    target_update_interval: int = Field(10, ge=1, description="env steps between hard copies (target=hard)")
    tau: float = Field(0.005, gt=0.0, le=1.0, description="EMA rate per gradient step (target=ema)")
    eps_start: float = Field(1.0, ge=0.0, le=1.0, description="initial exploration probability")
    eps_end: float = Field(0.04, ge=0.0, le=1.0, description="final exploration probability")
    exploration_fraction: float = Field(0.16, gt=0.0, le=1.0, description="fraction of the run over which epsilon decays")
    loss: Literal["huber", "mse"] = Field("huber", description="TD-error loss (the seed uses mse)")
    hidden: Hidden = Field([256, 256], description="hidden layer sizes of the Q-network (ReLU), each >= 1")
    max_grad_norm: float = Field(10.0, gt=0.0, description="global gradient-norm clip")

    @model_validator(mode="after")
    def _trains_at_least_once(self) -> DQNConfig:
        first = (self.learning_starts // self.train_freq + 1) * self.train_freq  # the first step > learning_starts that train_freq divides
        if first > self.total_steps:
            raise ValueError(
                f"learning_starts = {self.learning_starts} and train_freq = {self.train_freq}: the first update would come at env step "
                f"{first}, after total_steps = {self.total_steps}, so the Q-network would never train; lower learning_starts or "
                "train_freq, or raise total_steps"
            )
        return self


class ReplayBuffer:
    """A ring buffer of transitions (s, a, r, s', terminated), sampled uniformly."""

    def __init__(self, capacity: int, obs_dim: int, rng: np.random.Generator) -> None:
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)  # (B, obs_dim)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=np.float32)  # (B, obs_dim)
        self.actions = np.zeros(capacity, dtype=np.int64)  # (B,)
        self.rewards = np.zeros(capacity, dtype=np.float32)  # (B,)
        self.terminated = np.zeros(capacity, dtype=np.float32)  # (B,)
        self.capacity, self.size, self.pos, self.rng = capacity, 0, 0, rng

    def add(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, terminated: bool) -> None:
        i = self.pos
        self.obs[i], self.actions[i], self.rewards[i], self.next_obs[i], self.terminated[i] = obs, action, reward, next_obs, terminated
        self.pos = (self.pos + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = self.rng.integers(self.size, size=batch_size)
        return tuple(torch.as_tensor(x[idx]) for x in (self.obs, self.actions, self.rewards, self.next_obs, self.terminated))


def train(cfg: DQNConfig, env_id: str, log: RunLog | None = None) -> Result:
    """Train a Q-network on ``env_id``; the agent is the Q-network (obs -> Q-values (A,))."""
    import rlalign.classic.maze  # noqa: F401  (registers the maze)

    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    log = log or RunLog()
    rng = np.random.default_rng(cfg.seed)
    env = gym.make(env_id)
    n_actions = num_actions(env.action_space)
    guard = FiniteGuard("dqn", env_id, {"q-network": f"lr={cfg.lr:g} too high?"})
    q_net = mlp([obs_size(env.observation_space), *cfg.hidden, n_actions], activation=nn.ReLU)
    target_net = copy.deepcopy(q_net).requires_grad_(False)
    optimizer = torch.optim.Adam(q_net.parameters(), lr=cfg.lr, fused=True)
    buffer = ReplayBuffer(cfg.buffer_size, obs_size(env.observation_space), rng)
    tracker, last_eval, greedy = EpisodeTracker(1), 0, torch_act(q_net)
    td_loss = F.smooth_l1_loss if cfg.loss == "huber" else F.mse_loss

    obs, _ = env.reset(seed=cfg.seed)
    for step in range(1, cfg.total_steps + 1):
        eps = linear_schedule(cfg.eps_start, cfg.eps_end, int(cfg.exploration_fraction * cfg.total_steps), step)
        action = int(rng.integers(n_actions)) if rng.random() < eps else greedy(obs)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        guard.rewards(step, reward)
        buffer.add(obs, action, float(reward), next_obs, terminated)
        for ret in tracker.step(np.array([reward]), np.array([terminated or truncated])):
            log.episode(step, ret)
        obs = env.reset()[0] if terminated or truncated else next_obs

        if step > cfg.learning_starts and step % cfg.train_freq == 0:
            for _ in range(cfg.gradient_steps):
                b_obs, b_act, b_rew, b_next, b_term = buffer.sample(cfg.batch_size)  # (B, ...) each
                with torch.no_grad():
                    target = q_learning_target(b_rew, target_net(b_next), b_term, cfg.gamma)  # (B,)
                q = q_net(b_obs).gather(1, b_act[:, None]).squeeze(1)  # (B,)
                loss = td_loss(q, target)
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(q_net.parameters(), cfg.max_grad_norm)
                optimizer.step()
                if cfg.target == "ema":
                    polyak_update_(target_net.parameters(), q_net.parameters(), cfg.tau)
            guard.update(step, "q-network", q_net, {"TD loss": loss}, b_obs)
            log.update(step, {"loss/td": loss.item(), "q/mean": q.mean().item(), "epsilon": eps})
            log.progress(step)
        if cfg.target == "hard" and step % cfg.target_update_interval == 0:
            target_net.load_state_dict(q_net.state_dict())
        last_eval = maybe_evaluate(cfg, env_id, greedy, log, step, last_eval)
        if log.stop:
            break
    log.progress(step)
    return finish(cfg, env_id, q_net, greedy, log)
