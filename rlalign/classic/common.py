"""What the classic algorithms share: seeding, the config fields every run has, small MLPs with
orthogonal initialisation, episode-return tracking, the greedy evaluation loop, the on-policy
rollout collector (VPG, TRPO and PPO), the run log that the CLI and the benchmark listen to, the
check that an environment suits an algorithm (:func:`check_env`), and the guard that stops a run
at the first reward, loss, parameter or network output that is not finite (:class:`FiniteGuard`).

Deliberate simplifications: discrete action spaces only; the deep algorithms need Box (vector)
observations, the tabular ones Discrete observations or the maze's one-hot vectors.
"""

from __future__ import annotations

import importlib
import math
import random
import time
from dataclasses import dataclass, fields
from typing import Annotated, Any, Callable, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import AfterValidator, Field, field_validator
from torch import Tensor, nn

from rlalign.config import Config, ConfigError
from rlalign.errors import NonFiniteError

__all__ = [
    "ClassicConfig",
    "Hidden",
    "FLOAT32_MAX",
    "NonFiniteError",
    "FiniteGuard",
    "EnvKind",
    "check_env",
    "num_actions",
    "num_states",
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
    "cat_rollouts",
    "linear_schedule",
    "maybe_evaluate",
    "finish",
    "torch_act",
    "categorical_logp",
]

ActFn = Callable[[np.ndarray], int]  # one observation -> one action
FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4e38: networks, rollouts and the replay buffer hold float32


def _hidden_sizes(sizes: list[int]) -> list[int]:
    if any(n < 1 for n in sizes):
        raise ValueError("every hidden layer size must be >= 1 (a 0-wide layer cuts the output off from the input); [] is a linear network")
    return sizes


Hidden = Annotated[list[int], AfterValidator(_hidden_sizes)]  # hidden layer sizes of an MLP


class ClassicConfig(Config):
    """Fields every classic run has; each algorithm's config derives from this. Every float must
    lie in float32's range, in which the networks compute (clip_coef=1e40 would overflow)."""

    seed: int = Field(1, ge=0, lt=2**32, description="seeds Python, NumPy, torch and the environments; NumPy takes 0 <= seed < 2**32")
    total_steps: int = Field(100_000, ge=1, description="environment steps to train for (all envs together)")
    eval_every: int = Field(0, ge=0, description="evaluate the greedy policy every this many env steps (0: only at the end)")
    eval_episodes: int = Field(10, ge=1, description="episodes per evaluation")
    target_return: float | None = Field(None, description="stop early once an evaluation's mean return reaches this")
    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads; small MLPs are fastest on one thread")

    @field_validator("*")
    @classmethod
    def _in_float32_range(cls, value: Any) -> Any:
        if isinstance(value, float) and abs(value) > FLOAT32_MAX:
            raise ValueError(f"beyond float32's range (|x| <= {FLOAT32_MAX:.3g}), in which the networks compute")
        return value


@dataclass(frozen=True)
class FiniteGuard:
    """Stops a run at the first number that is not finite, naming the algorithm, the env step and
    the quantity. ``hints`` maps each network ("actor", "critic", "q-network") to what to suspect
    when it goes non-finite, e.g. ``{"critic": "critic_lr=1e+30 too high?"}``.

    Checked: every reward as it arrives (finite in float32, as the rollouts and the replay buffer
    store it), the returns and advantages computed from a rollout, the policy's logits before an
    action is sampled and the critic's values, and after every update its losses, the network's
    parameters and its outputs on the update's observations (parameters can be finite and still so
    large that the outputs overflow).
    """

    algo: str
    env_id: str
    hints: dict[str, str]

    def rewards(self, step: int, rewards: float | np.ndarray) -> None:
        """Rewards of env step ``step``, one per environment."""
        r = np.atleast_1d(np.asarray(rewards, dtype=np.float64))
        bad = ~(np.abs(r) <= FLOAT32_MAX)  # NaN compares False
        if bad.any():
            raise NonFiniteError(
                f"{self.algo}: env {self.env_id} returned the reward {float(r[bad][0]):g} at step {step}; "
                f"rewards must be finite in float32 (|r| <= {FLOAT32_MAX:.3g})"
            )

    def returns(self, step: int, quantities: dict[str, Tensor]) -> None:
        """Returns, advantages or Psi computed from the rollout that ended at ``step``."""
        for name, value in quantities.items():
            if not torch.isfinite(value).all():
                raise NonFiniteError(
                    f"{self.algo}: the {name} of the rollout ending at step {step} are not finite "
                    f"(env {self.env_id}'s rewards overflow float32 when summed?)"
                )

    def outputs(self, step: int, net: str, values: Tensor, when: str = "at") -> None:
        """``net``'s outputs ``values``, computed at (or after the update at) env step ``step``."""
        if not torch.isfinite(values).all():
            raise NonFiniteError(f"{self.algo}: the {net}'s outputs are not finite {when} step {step} ({self.hints[net]})")

    def update(self, step: int, net_name: str, net: nn.Module, losses: dict[str, Tensor | float], inputs: Tensor | None = None) -> None:
        """After the update at env step ``step``: its ``losses``, ``net``'s parameters, and its
        outputs on ``inputs`` (the update's observations), all finite."""
        hint = self.hints[net_name]
        for name, value in losses.items():
            value = value.item() if isinstance(value, Tensor) else float(value)
            if not math.isfinite(value):
                raise NonFiniteError(f"{self.algo}: the {name} is {value} at the update at step {step} ({hint})")
        if not all(bool(torch.isfinite(p).all()) for p in net.parameters()):
            raise NonFiniteError(f"{self.algo}: the {net_name}'s parameters are not finite after the update at step {step} ({hint})")
        if inputs is not None:
            with torch.no_grad():
                self.outputs(step, net_name, net(inputs), when="after the update at")


EnvKind = Literal["vector", "tabular", "model"]  # what an algorithm needs: vector observations, tabular states, a model


def check_env(env_id: str, kind: EnvKind) -> str:
    """The registered id of ``env_id``, after checking that it exists and has what an algorithm of
    ``kind`` needs; one ConfigError naming the env and what is allowed otherwise. Gymnasium's
    ``module:EnvId`` form imports ``module`` (which registers EnvId) and returns ``EnvId``, so that
    training and evaluation make the same environment by the same id."""
    import rlalign.classic.maze  # noqa: F401  (registers rlalign/Maze2x3-v0)

    env_name = env_id
    if ":" in env_id:
        module, env_name = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"--env {env_id!r}: cannot import module {module!r}, which should register {env_name!r} ({err})") from err
    try:
        gym.spec(env_name)
        env = gym.make(env_name)
    except (gym.error.Error, ImportError) as err:
        raise ConfigError(f"--env {env_id!r}: {err}") from err
    try:
        if kind == "vector":
            obs_size(env.observation_space)
        elif kind == "tabular":
            num_states(env)
        elif not hasattr(env.unwrapped, "P"):
            raise ConfigError("value_iteration needs the environment's model env.unwrapped.P (toy-text: FrozenLake, CliffWalking, Taxi, the maze); this one has none")
        num_actions(env.action_space)
    except ConfigError as err:
        raise ConfigError(f"--env {env_id!r}: {err}") from None
    finally:
        env.close()
    return env_name


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
        raise ConfigError(f"dqn, vpg, trpo and ppo need vector observations (a flat Box), not {_space(space)}; q_learning and value_iteration take Discrete ones")
    return int(space.shape[0])


def num_actions(space: gym.Space) -> int:
    """Number of actions of a Discrete action space; every classic algorithm needs one."""
    if not isinstance(space, gym.spaces.Discrete):
        raise ConfigError(f"the classic algorithms need a Discrete action space, not {_space(space)} (continuous actions are not supported)")
    return int(space.n)


def _space(space: gym.Space) -> str:
    """A space in a few characters: Box(4,) (its shape), Discrete(16)."""
    return f"Box{space.shape}" if isinstance(space, gym.spaces.Box) else str(space)


def num_states(env: gym.Env) -> int:
    """Number of tabular states: the model's (the maze's one-hot observations), else a Discrete observation space's."""
    if hasattr(env.unwrapped, "P"):
        return len(env.unwrapped.P)
    if not isinstance(env.observation_space, gym.spaces.Discrete):
        raise ConfigError(
            f"q_learning needs Discrete observations (or a model env.unwrapped.P, as the maze has), not {_space(env.observation_space)}; "
            "dqn, vpg, trpo and ppo take vector ones"
        )
    return int(env.observation_space.n)


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

    env = gym.make(env_id)  # the same call as training (the module:EnvId form included)
    if env.spec is None or env.spec.max_episode_steps is None:  # CliffWalking has no limit
        env = gym.wrappers.TimeLimit(env, max_episode_steps=1000)
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
    guard: FiniteGuard | None = None,
) -> tuple[Rollout, np.ndarray, int]:
    """Sample ``num_steps`` steps from every env with pi(a|s) = softmax(policy(s)).

    ``guard`` checks the logits before each action is sampled, every reward and the critic's values.
    Returns the rollout, the observation to continue from and the env-step counter.
    """
    n = envs.num_envs
    obs_buf, act_buf, logp_buf = [], [], []
    rewards, terminateds, dones = (np.zeros((num_steps, n), dtype=np.float32) for _ in range(3))  # (T, N)
    finals: list[tuple[int, int, np.ndarray]] = []  # (t, env, true final observation)
    for t in range(num_steps):
        obs_t = torch.as_tensor(obs, dtype=torch.float32)  # (N, obs_dim)
        with torch.no_grad():
            logits = policy(obs_t)  # (N, A)
            if guard is not None:
                guard.outputs(step + t * n, "actor", logits)
            logp_all = torch.log_softmax(logits, dim=-1)  # (N, A), as categorical_logp computes it
            action = torch.multinomial(logp_all.exp(), 1)  # (N, 1)
        obs, reward, terminated, truncated, info = envs.step(action.squeeze(1).numpy())
        if guard is not None:
            guard.rewards(step + (t + 1) * n, reward)
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
            if guard is not None:
                guard.outputs(step, "critic", torch.cat([values, next_values]))
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


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Rollouts sampled one after the other, as one: every field concatenated on time. Shapes: (T_i, N, ...) -> (sum T_i, N, ...)."""
    return Rollout(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Rollout)})


def categorical_logp(policy: nn.Module, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
    """log pi(a|s) of the taken actions and the logits. Shapes: obs (..., obs_dim), actions (...)."""
    logits = policy(obs)  # (..., A)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)  # (...)
    return logp, logits

