"""Shared by the classic tests: a counting environment whose rollouts are known by hand."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces


class CounterEnv(gym.Env):
    """obs = [k], the steps taken in this episode; reward 1 per step; terminates when k == term_at."""

    observation_space = spaces.Box(0.0, 100.0, shape=(1,), dtype=np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, term_at: int) -> None:
        self.term_at, self.k = term_at, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.k = 0
        return np.array([0.0], dtype=np.float32), {}

    def step(self, action):
        self.k += 1
        return np.array([self.k], dtype=np.float32), 1.0, self.k == self.term_at, False, {}


@pytest.fixture
def counter_env() -> type[CounterEnv]:
    return CounterEnv


class ConstantRewardEnv(gym.Env):
    """Pays ``reward`` every step; 4 float observations (or a Discrete(3) state), 2 actions, 10 steps."""

    action_space = spaces.Discrete(2)

    def __init__(self, reward: float = 1e39, tabular: bool = False) -> None:
        self.reward, self.tabular, self.t = reward, tabular, 0
        self.observation_space = spaces.Discrete(3) if tabular else spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)

    def _obs(self):
        return self.t % 3 if self.tabular else np.full(4, 0.1 * (self.t % 3), dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), self.reward, self.t >= 10, False, {}


HUGE_REWARD_ID, HUGE_REWARD_TABULAR_ID = "rlalign-test/HugeReward-v0", "rlalign-test/HugeRewardTabular-v0"


@pytest.fixture
def huge_reward_envs() -> tuple[str, str]:
    """Registered ids of ConstantRewardEnv paying 1e39 (infinite in float32): vector and tabular observations."""
    if HUGE_REWARD_ID not in gym.registry:
        gym.register(HUGE_REWARD_ID, entry_point=ConstantRewardEnv, max_episode_steps=10)
        gym.register(HUGE_REWARD_TABULAR_ID, entry_point=ConstantRewardEnv, kwargs={"tabular": True}, max_episode_steps=10)
    return HUGE_REWARD_ID, HUGE_REWARD_TABULAR_ID


ENV_MODULE = '''
import gymnasium as gym
gym.register("{env_id}", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv", max_episode_steps=20)
'''


@pytest.fixture
def env_module(tmp_path, monkeypatch) -> tuple[str, str]:
    """An importable module (on sys.path for this test) that registers a CartPole with a 20-step
    limit when imported, as Gymnasium's ``module:EnvId`` form expects: (module name, env id)."""
    name = f"rlalign_test_envs_{tmp_path.name}".replace("-", "_")
    env_id = f"ModuleCartPole{abs(hash(tmp_path.name))}-v0"
    (tmp_path / f"{name}.py").write_text(ENV_MODULE.format(env_id=env_id))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, env_id
