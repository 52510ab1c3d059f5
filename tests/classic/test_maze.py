"""The seed's 2x3 maze: Gymnasium API, layout and model."""

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

from rlalign.classic.maze import GOAL, MAZE_ID, START, TRAP, Maze2x3Env

UP, DOWN, LEFT, RIGHT = 0, 1, 2, 3


def test_passes_gymnasium_env_checker():
    check_env(Maze2x3Env(), skip_render_check=True)


def test_registered_with_time_limit_and_one_hot_observation():
    env = gym.make(MAZE_ID)
    obs, _ = env.reset(seed=0)
    assert env.spec.max_episode_steps == 50
    np.testing.assert_array_equal(obs, np.eye(6, dtype=np.float32)[START])
    for t in range(50):  # bumping into the top border forever: truncated at step 50, never terminated
        obs, reward, terminated, truncated, _ = env.step(UP)
        assert (reward, terminated) == (0.0, False)
    assert truncated


def test_shortest_path_reaches_goal_and_shortcut_hits_trap():
    env = Maze2x3Env()
    env.reset(seed=0)
    # right, down, right: 0 -> 1 -> 4 -> 5 (goal), rewards 0, 0, +10
    steps = [env.step(a) for a in (RIGHT, DOWN, RIGHT)]
    assert [s[1] for s in steps] == [0.0, 0.0, 10.0]
    assert [s[2] for s in steps] == [False, False, True]
    assert steps[-1][0].argmax() == GOAL
    env.reset()
    env.step(RIGHT)
    obs, reward, terminated, _, _ = env.step(RIGHT)  # 1 -> 2: the trap
    assert (obs.argmax(), reward, terminated) == (TRAP, -10.0, True)


def test_walls_and_borders_block_moves():
    P = Maze2x3Env().P
    assert P[0][DOWN] == [(1.0, 0, 0.0, False)]  # the wall between 0 and 3
    assert P[3][UP] == [(1.0, 3, 0.0, False)]
    assert P[0][LEFT] == [(1.0, 0, 0.0, False)]  # left border
    assert P[4][DOWN] == [(1.0, 4, 0.0, False)]  # bottom border
    assert P[3][RIGHT] == [(1.0, 4, 0.0, False)]
    assert P[4][RIGHT] == [(1.0, 5, 10.0, True)]
    assert P[GOAL][UP] == [(1.0, GOAL, 0.0, True)]  # terminal states absorb


def test_render_draws_the_layout_and_the_agent():
    # 2 rows x 3 columns: start (0, 0), trap (0, 2), goal (1, 2) (the seed's layout); A = the agent
    env = Maze2x3Env()
    env.reset(seed=0)
    assert env.render() == "A . T\n. . G\n"
    env.step(RIGHT)
    assert env.render() == "S A T\n. . G\n"
