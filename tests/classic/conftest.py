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
