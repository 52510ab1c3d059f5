"""Deep Q-learning: replay buffer, learning on the maze (hard-copy and EMA targets), determinism."""

import numpy as np
import pytest
import torch

from rlalign.classic.dqn import DQNConfig, ReplayBuffer, train
from rlalign.classic.maze import MAZE_ID, Maze2x3Env
from rlalign.classic.value_iteration import value_iteration
from rlalign.config import ConfigError, load_config

NON_TERMINAL = [0, 1, 3, 4]
MAZE = dict(total_steps=3_000, gamma=0.9, learning_starts=200, train_freq=1, gradient_steps=1, lr=1e-3,
            hidden=[32], exploration_fraction=0.5, eps_end=0.05, target_update_interval=100)


def test_replay_buffer_wraps_around():
    buf = ReplayBuffer(3, obs_dim=1, rng=np.random.default_rng(0))
    for i in range(5):  # 0, 1 are overwritten by 3, 4
        buf.add(np.array([i]), i % 2, float(i), np.array([i + 1]), i == 4)
    assert buf.size == 3 and buf.pos == 2
    assert sorted(buf.rewards.tolist()) == [2.0, 3.0, 4.0]
    obs, act, rew, nxt, term = buf.sample(64)
    np.testing.assert_array_equal(nxt.numpy(), obs.numpy() + 1)
    np.testing.assert_array_equal(term.numpy(), (rew.numpy() == 4.0).astype(np.float32))


def _q_table(net):
    with torch.no_grad():
        return net(torch.eye(6)).numpy()  # (S, A): one-hot observation of every state


@pytest.mark.slow
@pytest.mark.parametrize("target", ["hard", "ema"])
def test_learns_maze_q_values(target):
    # A flipped gradient sign climbs the TD error instead: Q diverges and the greedy policy is wrong.
    result = train(DQNConfig(**MAZE, target=target, tau=0.05), MAZE_ID)
    _, q_star, policy = value_iteration(Maze2x3Env().P, gamma=0.9)
    q = _q_table(result.agent)
    np.testing.assert_array_equal(q.argmax(1)[NON_TERMINAL], policy[NON_TERMINAL])
    np.testing.assert_allclose(q[NON_TERMINAL], q_star[NON_TERMINAL], atol=0.5)
    assert result.eval_return == 10.0


def test_same_seed_same_returns():
    cfg = DQNConfig(**{**MAZE, "total_steps": 600})
    a, b = train(cfg, MAZE_ID), train(cfg, MAZE_ID)
    c = train(cfg.model_copy(update={"seed": 2}), MAZE_ID)
    assert a.episode_returns == b.episode_returns
    assert a.episode_returns != c.episode_returns
    for pa, pb in zip(a.agent.parameters(), b.agent.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("learning_starts, train_freq, first", [
    (100, 1, 101),  # an update needs step > learning_starts: learning_starts = total_steps never trains
    (0, 101, 101),  # train_freq > total_steps
    (80, 60, 120),  # both below total_steps, but the first multiple of 60 past 80 is 120
])
def test_a_run_that_would_never_train_is_refused(learning_starts, train_freq, first):
    with pytest.raises(ConfigError) as err:
        load_config(DQNConfig, None, {"total_steps": 100, "learning_starts": learning_starts, "train_freq": train_freq})
    assert (f"learning_starts = {learning_starts} and train_freq = {train_freq}: the first update would come at env step {first}, "
            "after total_steps = 100, so the Q-network would never train") in str(err.value)


def test_the_first_update_at_the_last_step_is_allowed_and_happens():
    # learning_starts 10, train_freq 100: the first multiple of 100 past 10 is 100 = total_steps, one update there
    cfg = load_config(DQNConfig, None, {"total_steps": 100, "learning_starts": 10, "train_freq": 100, "gradient_steps": 1,
                                        "batch_size": 8, "hidden": [8], "eval_episodes": 1})
    assert [u["step"] for u in train(cfg, "CartPole-v1").log.updates] == [100]
