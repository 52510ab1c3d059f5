"""Shared helpers: schedules, episode tracking, MLP initialisation, evaluation."""

import numpy as np
import pytest
import torch

from rlalign.classic.common import EpisodeTracker, evaluate, linear_schedule, mlp, state_index


def test_linear_schedule():
    # from 1 to 0.1 over 10 steps: slope -0.09; t=5 -> 0.55; past the end it stays at 0.1
    assert linear_schedule(1.0, 0.1, 10, 5) == 0.55
    assert linear_schedule(1.0, 0.1, 10, 50) == 0.1
    assert linear_schedule(0.0, 1.0, 4, 2) == 0.5
    # rising from 0.2 to 1.0 over 4 steps: slope 0.2; t=2 -> 0.6; past the end it stays at 1.0
    assert linear_schedule(0.2, 1.0, 4, 2) == pytest.approx(0.6)
    assert linear_schedule(0.2, 1.0, 4, 9) == 1.0


def test_episode_tracker_reports_and_resets_per_env():
    tr = EpisodeTracker(2)
    assert tr.step(np.array([1.0, 2.0]), np.array([False, False])) == []
    assert tr.step(np.array([1.0, 2.0]), np.array([False, True])) == [4.0]
    assert tr.step(np.array([1.0, 5.0]), np.array([True, True])) == [3.0, 5.0]


def test_mlp_orthogonal_init():
    torch.manual_seed(0)
    net = mlp([4, 64, 64, 2], out_gain=0.01)
    w0, w_last = net[0].weight, net[-1].weight
    # orthogonal rows of the (64, 4) matrix scaled by sqrt(2): W^T W = 2 I
    torch.testing.assert_close(w0.T @ w0, 2.0 * torch.eye(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(w_last @ w_last.T, 1e-4 * torch.eye(2), rtol=0, atol=1e-9)
    assert all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in net if isinstance(m, torch.nn.Linear))


def test_state_index_and_evaluate_on_the_maze():
    assert state_index(np.eye(6, dtype=np.float32)[4]) == 4 and state_index(7) == 7
    path = {0: 3, 1: 1, 4: 3}  # right, down, right
    assert evaluate(lambda obs: path[state_index(obs)], "rlalign/Maze2x3-v0", episodes=2, seed=0) == [10.0, 10.0]
    assert evaluate(lambda obs: 0, "rlalign/Maze2x3-v0", episodes=1, seed=0) == [0.0]  # truncated at 50 steps
