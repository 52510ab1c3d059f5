"""Tabular Q-learning recovers the value-iteration optimum."""

import gymnasium as gym
import numpy as np
import pytest

from rlalign.classic.maze import MAZE_ID, Maze2x3Env
from rlalign.classic.q_learning import QLearningConfig, train
from rlalign.classic.value_iteration import policy_value, value_iteration
from rlalign.config import ConfigError, load_config

NON_TERMINAL = [0, 1, 3, 4]


def test_recovers_optimal_maze_policy_and_q_values():
    # alpha = 1 (the seed's update) is exact on a deterministic maze: Q converges to Q* itself.
    result = train(QLearningConfig(total_steps=5_000, gamma=0.9), MAZE_ID)
    _, q_star, policy = value_iteration(Maze2x3Env().P, gamma=0.9)
    np.testing.assert_allclose(result.agent[NON_TERMINAL], q_star[NON_TERMINAL], atol=1e-9)
    np.testing.assert_array_equal(result.agent.argmax(1)[NON_TERMINAL], policy[NON_TERMINAL])
    assert result.eval_return == 10.0


def test_cliffwalking_greedy_policy_is_optimal():
    cfg = QLearningConfig(total_steps=50_000, gamma=0.99, alpha=0.5, alpha_end=0.1, eps_end=0.0)
    result = train(cfg, "CliffWalking-v1")
    P = gym.make("CliffWalking-v1").unwrapped.P
    v_star, _, _ = value_iteration(P, gamma=0.99)
    v_learned = policy_value(P, result.agent.argmax(1), gamma=0.99)
    assert abs(v_learned[36] - v_star[36]) < 1e-9  # start state 36: the 13-step path along the cliff
    assert result.eval_return == -13.0


def test_same_seed_same_returns():
    a = train(QLearningConfig(total_steps=1_000, seed=3), MAZE_ID)
    b = train(QLearningConfig(total_steps=1_000, seed=3), MAZE_ID)
    c = train(QLearningConfig(total_steps=1_000, seed=4), MAZE_ID)
    assert a.episode_returns == b.episode_returns
    assert a.episode_returns != c.episode_returns


def test_evaluates_every_eval_every_steps_from_the_start():
    # eval_every = 5 over 20 steps: greedy evaluations after steps 5, 10, 15 and 20, none earlier
    result = train(QLearningConfig(total_steps=20, eval_every=5, eval_episodes=1), MAZE_ID)
    assert [step for step, _ in result.log.evals] == [5, 10, 15, 20]


def test_gamma_one_is_refused():
    # with gamma = 1 the maze's Q* ties bumping into a wall with moving on (test_value_iteration), so
    # a greedy policy on a converged table can bump forever
    with pytest.raises(ConfigError, match=r"gamma = 1.0: Input should be less than 1"):
        load_config(QLearningConfig, None, {"gamma": 1.0})
    assert load_config(QLearningConfig, None, {"gamma": 0.999}).gamma == 0.999
