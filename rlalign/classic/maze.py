"""The seed's 2x3 maze (seed 002, section 2.2) as a Gymnasium environment.

Layout (row, col); states are numbered s = 3*row + col and observed as one-hot vectors (6,):

    +-------+-------+-------+
    | S  0  |   1   | T  2  |      S: start (0, 0)
    |=======|       |       |      T: trap  (0, 2), reward -10, episode ends
    |   3   |   4   | G  5  |      G: goal  (1, 2), reward +10, episode ends
    +-------+-------+-------+      =: wall between 0 and 3 (and the outer border)

Actions: 0 up, 1 down, 2 left, 3 right. A move into a wall or off the grid leaves the agent
where it is. Every other move gives reward 0. Deterministic transitions.

The shortest path to the goal is right, down, right (0 -> 1 -> 4 -> 5); the tempting
right, right (0 -> 1 -> 2) walks into the trap, and the wall stops the agent going down first.
Registered as ``rlalign/Maze2x3-v0`` with a 50-step time limit.

``P[s][a] = [(prob, next_state, reward, terminated)]`` in the toy-text format (FrozenLake,
CliffWalking), so value iteration treats all of them alike.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["Maze2x3Env", "MAZE_ID", "ROWS", "COLS", "START", "TRAP", "GOAL", "WALLS"]

MAZE_ID = "rlalign/Maze2x3-v0"
ROWS, COLS = 2, 3
START, TRAP, GOAL = 0, 2, 5
WALLS = {frozenset({0, 3})}  # pairs of states with a wall between them
MOVES = {0: (-1, 0), 1: (1, 0), 2: (0, -1), 3: (0, 1)}  # up, down, left, right
REWARDS = {GOAL: 10.0, TRAP: -10.0}


def _next_state(s: int, a: int) -> int:
    row, col = divmod(s, COLS)
    dr, dc = MOVES[a]
    r2, c2 = row + dr, col + dc
    if not (0 <= r2 < ROWS and 0 <= c2 < COLS):
        return s
    s2 = r2 * COLS + c2
    return s if frozenset({s, s2}) in WALLS else s2


def _model() -> dict[int, dict[int, list[tuple[float, int, float, bool]]]]:
    P: dict[int, dict[int, list[tuple[float, int, float, bool]]]] = {}
    for s in range(ROWS * COLS):
        P[s] = {}
        for a in MOVES:
            if s in REWARDS:  # terminal states absorb with reward 0 (toy-text convention)
                P[s][a] = [(1.0, s, 0.0, True)]
                continue
            s2 = _next_state(s, a)
            P[s][a] = [(1.0, s2, REWARDS.get(s2, 0.0), s2 in REWARDS)]
    return P


class Maze2x3Env(gym.Env):
    """The 2x3 maze; see the module docstring for the layout."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, render_mode: str | None = None) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, shape=(ROWS * COLS,), dtype=np.float32)
        self.action_space = spaces.Discrete(4)
        self.P = _model()
        self.render_mode = render_mode
        self.s = START

    def _obs(self) -> np.ndarray:
        obs = np.zeros(ROWS * COLS, dtype=np.float32)
        obs[self.s] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.s = START
        return self._obs(), {}

    def step(self, action: int):
        ((_, s2, reward, terminated),) = self.P[self.s][int(action)]
        self.s = s2
        return self._obs(), reward, terminated, False, {}

    def render(self) -> str:
        cells = ["S" if s == START else "T" if s == TRAP else "G" if s == GOAL else "." for s in range(ROWS * COLS)]
        cells[self.s] = "A"
        return "\n".join(" ".join(cells[r * COLS : (r + 1) * COLS]) for r in range(ROWS)) + "\n"


if MAZE_ID not in gym.registry:
    gym.register(id=MAZE_ID, entry_point=Maze2x3Env, max_episode_steps=50)
