"""Value iteration against values computed by hand, and the exact policy evaluation."""

import gymnasium as gym
import numpy as np
import pytest

from rlalign.classic.maze import MAZE_ID, Maze2x3Env
from rlalign.classic.value_iteration import ValueIterationConfig, policy_value, train, value_iteration
from rlalign.config import ConfigError, load_config

UP, DOWN, LEFT, RIGHT = 0, 1, 2, 3


def test_maze_values_match_hand_computation():
    # gamma = 0.9, states 0 1 2 / 3 4 5, trap 2, goal 5, wall between 0 and 3.
    # V*(4) = 10 (right into the goal)            V*(1) = 0 + 0.9 * V*(4) = 9 (down)
    # V*(3) = 0.9 * V*(4) = 9 (right)             V*(0) = 0.9 * V*(1) = 8.1 (right; down is the wall)
    # terminal states 2 and 5: 0.
    # Q*(1, right) = -10 (the trap ends the episode); Q*(0, up) = 0.9 * V*(0) = 7.29 (bump, stay).
    v, q, policy = value_iteration(Maze2x3Env().P, gamma=0.9)
    np.testing.assert_allclose(v, [8.1, 9.0, 0.0, 9.0, 10.0, 0.0], atol=1e-9)
    assert q[1, RIGHT] == -10.0
    np.testing.assert_allclose(q[0], [7.29, 7.29, 7.29, 8.1], atol=1e-9)
    np.testing.assert_allclose(q[4], [8.1, 9.0, 8.1, 10.0], atol=1e-9)
    assert [policy[s] for s in (0, 1, 3, 4)] == [RIGHT, DOWN, RIGHT, RIGHT]


def test_policy_value_by_hand():
    # "always right": V(1) = -10 (trap), V(0) = 0.9 * V(1) = -9, V(4) = 10, V(3) = 0.9 * 10 = 9.
    v = policy_value(Maze2x3Env().P, np.full(6, RIGHT), gamma=0.9)
    np.testing.assert_allclose(v, [-9.0, -10.0, 0.0, 9.0, 10.0, 0.0], atol=1e-9)
    # "always up" never moves from the top row's 0 and 1: value 0; from 3 and 4 it goes up to 0 / 1.
    np.testing.assert_allclose(policy_value(Maze2x3Env().P, np.full(6, UP), gamma=0.9), np.zeros(6), atol=1e-12)


def test_optimal_policy_value_is_the_fixed_point_on_frozenlake():
    P = gym.make("FrozenLake-v1").unwrapped.P
    v, q, policy = value_iteration(P, gamma=0.99)
    np.testing.assert_allclose(policy_value(P, policy, 0.99), v, atol=1e-8)
    np.testing.assert_allclose(q.max(axis=1), v, atol=1e-8)
    assert all(v[s] >= policy_value(P, np.full(16, a), 0.99)[s] - 1e-9 for a in range(4) for s in range(16))


def test_train_evaluates_the_greedy_policy():
    result = train(ValueIterationConfig(gamma=0.9, eval_episodes=3), MAZE_ID)
    assert result.eval_returns == [10.0, 10.0, 10.0]
    assert next(u for u in result.log.updates if "v_start" in u)["v_start"] == 8.1


def test_gamma_one_is_refused_its_greedy_policy_never_finishes():
    # gamma = 1: V* = 10 in every live cell (the goal is reachable from each), so bumping into a wall
    # (stay put, Q = 0 + V* = 10) ties with moving on, and argmax takes the first action, up,
    # everywhere: from 0 and 1 up bumps forever. The config refuses gamma = 1; just below is fine.
    v, q, policy = value_iteration(Maze2x3Env().P, gamma=1.0)
    np.testing.assert_allclose(v, [10.0, 10.0, 0.0, 10.0, 10.0, 0.0])
    np.testing.assert_allclose(q[0], [10.0, 10.0, 10.0, 10.0])
    assert policy.tolist() == [UP] * 6
    with pytest.raises(ConfigError, match=r"gamma = 1.0: Input should be less than 1"):
        load_config(ValueIterationConfig, None, {"gamma": 1.0})
    assert load_config(ValueIterationConfig, None, {"gamma": 0.999}).gamma == 0.999


def test_bellman_residuals_shrink_by_at_least_gamma_each_sweep():
    # the optimality backup is a gamma-contraction in the max norm: |V_{i+1} - V_i| <= gamma |V_i - V_{i-1}|
    residuals = []
    value_iteration(Maze2x3Env().P, gamma=0.9, tol=1e-8, on_sweep=lambda i, delta: residuals.append((i, delta)))
    assert [i for i, _ in residuals] == list(range(1, len(residuals) + 1))
    assert residuals[0][1] == 10.0  # the first sweep from V = 0: the goal's reward
    assert all(later <= 0.9 * earlier + 1e-12 for (_, earlier), (_, later) in zip(residuals, residuals[1:]))
    assert residuals[-1][1] < 1e-8 <= residuals[-2][1]  # stops at the first sweep below tol


def test_default_tolerance_stops_at_the_first_sweep_that_changes_nothing():
    # the maze's values are exact after 3 sweeps (paths of at most 3 moves): changes 10, 9, 8.1, then 0 < 1e-10
    residuals = []
    value_iteration(Maze2x3Env().P, gamma=0.9, on_sweep=lambda i, delta: residuals.append(delta))
    np.testing.assert_allclose(residuals, [10.0, 9.0, 8.1, 0.0], atol=1e-12)


def test_tolerance_zero_never_stops_early():
    # stop when the change is strictly below tol: a change of 0 is not below 0, so every sweep runs
    residuals = []
    value_iteration(Maze2x3Env().P, gamma=0.9, tol=0.0, max_iters=6, on_sweep=lambda i, delta: residuals.append(delta))
    np.testing.assert_allclose(residuals, [10.0, 9.0, 8.1, 0.0, 0.0, 0.0], atol=1e-12)
