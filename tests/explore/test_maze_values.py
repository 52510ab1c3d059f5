"""MazeValueIteration: the 2x3 maze's V*, Q*, greedy policy and value-iteration sweeps against hand-derived numbers,
and V^pi, Q^pi, A^pi of the policy the page selects (exact, and by Monte Carlo).

The maze (rlalign/classic/maze.py), states s = 3*row + col, actions 0 up, 1 down, 2 left, 3 right:

    +-----+-----+-----+
    | S 0 |  1  | T 2 |     entering T pays -10, entering G pays +10, both end the episode;
    |=====|     |     |     every other move pays 0; '=' is a wall between 0 and 3; bumping a
    |  3  |  4  | G 5 |     wall or the border leaves the agent where it is.
    +-----+-----+-----+

By hand with gamma = 0.9 (terminal cells are worth 0: nothing follows the end of an episode):
    V*(4) = max(right: 10 + 0,  anything else: 0 + 0.9 * V*(.) <= 0.9 * 10)  = 10
    V*(1) = down into 4:  0 + 0.9 * V*(4) = 0.9 * 10                          = 9
            (right into the trap would be -10)
    V*(3) = right into 4: 0 + 0.9 * 10                                        = 9
    V*(0) = right into 1: 0 + 0.9 * V*(1) = 0.9 * 9                           = 8.1
            (down is the wall: 0 + 0.9 * V*(0) = 7.29)
Value iteration from V_0 = 0 reaches these in 3 sweeps, one step of the path per sweep:
    V_1 = (0, 0, 0, 0, 10, 0),  V_2 = (0, 9, 0, 9, 10, 0),  V_3 = (8.1, 9, 0, 9, 10, 0) = V*
so the Bellman residuals max_s |V_{k+1} - V_k| are 10, 9, 8.1, 0, 0, ...
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlalign.classic.maze import _next_state
from rlalign.explore import maze_values
from rlalign.explore.registry import EXPLORERS, run_explorer

GAMMA = 0.9
UP, DOWN, LEFT, RIGHT = 0, 1, 2, 3


@pytest.fixture(scope="module")
def res():
    return maze_values.compute()


def test_defaults_and_registration(res):
    assert res.gamma == GAMMA and res.sweeps == 30
    assert res.values.shape == (31, 6) and res.bellman_residual.shape == (31,)
    assert res.q_star.shape == (6, 4) and res.v_star.shape == (6,) and res.policy.shape == (6,)
    assert EXPLORERS["maze-values"].seed_name == "MazeValueIteration"
    assert list(EXPLORERS).index("maze-values") == list(EXPLORERS).index("kl-divergence") + 1


def test_v_star_matches_hand_derivation(res):
    np.testing.assert_allclose(res.v_star, [8.1, 9.0, 0.0, 9.0, 10.0, 0.0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.values[-1], res.v_star, rtol=0, atol=1e-12)


def test_sweeps_match_hand_derivation(res):
    np.testing.assert_array_equal(res.values[0], np.zeros(6))  # V_0 = 0
    np.testing.assert_allclose(res.values[1], [0, 0, 0, 0, 10, 0], atol=1e-12)
    np.testing.assert_allclose(res.values[2], [0, 9, 0, 9, 10, 0], atol=1e-12)
    np.testing.assert_allclose(res.values[3:], np.broadcast_to(res.v_star, (28, 6)), atol=1e-12)
    np.testing.assert_allclose(res.bellman_residual[:4], [10.0, 9.0, 8.1, 0.0], atol=1e-12)


def test_residual_shrinks_by_at_least_gamma_per_sweep(res):
    r = res.bellman_residual
    assert np.all(r[1:] <= GAMMA * r[:-1] + 1e-12)
    assert np.all(r[3:] == 0.0)  # exact after the 3 steps of the longest optimal path
    # and every V_k is within gamma^k of V* (from ||V_0 - V*|| = 10)
    err = np.abs(res.values - res.v_star).max(axis=1)
    assert np.all(err <= 10.0 * GAMMA ** np.arange(len(err)) + 1e-12)


def test_q_star_is_reward_plus_discounted_v_star_of_next_state(res):
    goal_trap = {5: 10.0, 2: -10.0}
    for s in range(6):
        for a in range(4):
            if s in goal_trap:  # terminal cells absorb with reward 0
                assert res.q_star[s, a] == 0.0
                continue
            s2 = _next_state(s, a)
            r = goal_trap.get(s2, 0.0)
            bootstrap = 0.0 if s2 in goal_trap else GAMMA * res.v_star[s2]
            assert res.q_star[s, a] == pytest.approx(r + bootstrap, abs=1e-12), (s, a)
            assert res.next_state[s, a] == s2 and res.reward[s, a] == r
    # a few by hand: the wall and the border bounce back, the trap costs 10
    assert res.q_star[0, DOWN] == pytest.approx(0.9 * 8.1)  # 7.29
    assert res.q_star[0, UP] == pytest.approx(7.29)
    assert res.q_star[1, RIGHT] == pytest.approx(-10.0)
    assert res.q_star[4, RIGHT] == pytest.approx(10.0)
    assert res.q_star[4, LEFT] == pytest.approx(0.9 * 9)  # to 3


def test_greedy_policy_is_argmax_q_star(res):
    np.testing.assert_array_equal(res.policy, res.q_star.argmax(axis=1))
    nonterminal = res.terminal == 0
    np.testing.assert_array_equal(np.flatnonzero(~nonterminal), [2, 5])
    # right, down, right from the start; right from 3 and 4
    assert [int(res.policy[s]) for s in (0, 1, 3, 4)] == [RIGHT, DOWN, RIGHT, RIGHT]
    np.testing.assert_allclose(res.q_star.max(axis=1), res.v_star, atol=1e-12)


def test_other_gamma_and_early_sweep():
    res = maze_values.compute(gamma=0.5, sweeps=2)
    np.testing.assert_allclose(res.v_star, [2.5, 5.0, 0.0, 5.0, 10.0, 0.0], atol=1e-12)  # 10, 0.5*10, 0.5*5
    np.testing.assert_allclose(res.values[-1], [0.0, 5.0, 0.0, 5.0, 10.0, 0.0], atol=1e-12)  # not yet converged
    assert res.bellman_residual[-1] == pytest.approx(2.5)


def test_plot_sweep_parameter(res, tmp_path):
    for sweep in (None, 0, 2):
        png = maze_values.plot(res, tmp_path / f"m{sweep}.png", sweep=sweep)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        maze_values.plot(res, tmp_path / "bad.png", sweep=res.sweeps + 1)


def test_run_explorer_writes_figure_and_json(tmp_path):
    png, data = run_explorer("maze-values", tmp_path)
    assert png == tmp_path / "maze-values.png" and data == tmp_path / "maze-values.json"
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 20_000
    numbers = json.loads(data.read_text())
    assert numbers["gamma"] == GAMMA and numbers["sweeps"] == 30
    np.testing.assert_allclose(numbers["v_star"], [8.1, 9.0, 0.0, 9.0, 10.0, 0.0], atol=1e-12)
    assert len(numbers["values"]) == 31 and numbers["values"][0] == [0.0] * 6
    assert np.asarray(numbers["q_star"]).shape == (6, 4)
    assert numbers["policy"] == [RIGHT, DOWN, 0, RIGHT, RIGHT, 0]
    assert numbers["pi_name"] == "uniform" and np.asarray(numbers["a_pi"]).shape == (6, 4)
    np.testing.assert_allclose(numbers["v_pi"], np.array([-900, -1300, 0, 900, 1300, 0]) / 439, atol=1e-12)
    assert numbers["mc_v"][-1][2] is None  # the trap is never visited: nan is written as null


# ---------------------------------------------------------------- the values of a chosen policy pi

LIVE = [0, 1, 3, 4]
V_UNIFORM = np.array([-900, -1300, 0, 900, 1300, 0]) / 439  # by hand in tests/classic/test_policy_evaluation.py


def test_default_policy_is_uniform_with_its_hand_derived_values(res):
    assert res.pi_name == "uniform" and res.pi.shape == (6, 4)
    np.testing.assert_array_equal(res.pi, np.full((6, 4), 0.25))
    np.testing.assert_allclose(res.v_pi, V_UNIFORM, rtol=0, atol=1e-12)
    # Q^pi(4, right) = 10 (the goal), Q^pi(1, right) = -10 (the trap), Q^pi(1, down) = 0.9 V^pi(4) = 1170/439
    assert res.q_pi[4, RIGHT] == pytest.approx(10.0) and res.q_pi[1, RIGHT] == pytest.approx(-10.0)
    assert res.q_pi[1, DOWN] == pytest.approx(1170 / 439, abs=1e-12)
    np.testing.assert_allclose(res.a_pi, res.q_pi - res.v_pi[:, None], atol=0)
    np.testing.assert_allclose((res.pi * res.a_pi).sum(axis=1), 0.0, atol=1e-12)  # sum_a pi(a|s) A^pi(s, a) = 0


@pytest.mark.parametrize("policy, extra", [("uniform", {}), ("greedy", {}), ("epsilon-greedy", {"epsilon": 0.35}),
                                           ("arrows", {"arrow_0": "down", "arrow_1": "left", "arrow_4": "up"})])
def test_advantage_averages_to_zero_under_every_policy(policy, extra):
    r = maze_values.compute(policy=policy, episodes=200, **extra)
    np.testing.assert_allclose(r.pi.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose((r.pi * r.a_pi).sum(axis=1), 0.0, atol=1e-12)
    assert (r.v_pi <= r.v_star + 1e-12).all()  # no policy beats V*


def test_greedy_policy_has_the_optimal_values():
    r = maze_values.compute(policy="greedy", episodes=300)
    np.testing.assert_allclose(r.v_pi, r.v_star, atol=1e-12)  # V^{pi*} = V*
    np.testing.assert_allclose(r.q_pi, r.q_star, atol=1e-12)  # Q^{pi*} = Q*
    assert (r.a_pi <= 1e-12).all()
    np.testing.assert_allclose(r.mc_v[-1, LIVE], r.v_star[LIVE], atol=1e-12)  # deterministic returns: Monte Carlo is exact
    np.testing.assert_allclose(r.mc_error, 0.0, atol=1e-12)
    np.testing.assert_array_equal(maze_values.maze_policy("greedy", r.q_star), maze_values.maze_policy("epsilon-greedy", r.q_star, 0.0))


def test_epsilon_greedy_and_arrows_policies_by_hand():
    q_star = maze_values.compute(episodes=100).q_star
    # eps = 0.2 around Q*: 0.05 on each action plus 0.8 on the greedy one (right at the start)
    np.testing.assert_allclose(maze_values.maze_policy("epsilon-greedy", q_star, 0.2)[0], [0.05, 0.05, 0.05, 0.85], atol=1e-15)
    np.testing.assert_allclose(maze_values.maze_policy("epsilon-greedy", q_star, 1.0), np.full((6, 4), 0.25), atol=1e-15)
    # right at 0 and right at 1 walks into the trap: V^pi(1) = -10, V^pi(0) = -9; the bottom row keeps its greedy arrows
    r = maze_values.compute(policy="arrows", arrow_0="right", arrow_1="right", episodes=100)
    np.testing.assert_allclose(r.v_pi, [-9.0, -10.0, 0.0, 9.0, 10.0, 0.0], atol=1e-12)
    assert r.a_pi[1, DOWN] == pytest.approx(0.9 * 10.0 + 10.0)  # down to 4 (then right into the goal) instead of the trap
    with pytest.raises(ValueError, match="policy must be one of"):
        maze_values.maze_policy("softmax", q_star)


def test_monte_carlo_estimate_converges_to_v_pi(res):
    n = res.mc_episodes
    assert n[0] == 10 and n[-1] == 2000 and np.all(np.diff(n) > 0)
    se = res.mc_v_se[:, LIVE]
    # 2000 first-visit episodes: each live cell within 4.5 standard errors of V^pi, and the error bar about 1/sqrt(n)
    assert (np.abs(res.mc_v[-1, LIVE] - res.v_pi[LIVE]) <= 4.5 * se[-1]).all()
    i200 = int(np.argmin(np.abs(n - 200)))
    np.testing.assert_allclose(se[-1] / se[i200], np.sqrt(n[i200] / n[-1]), rtol=0.25)
    assert res.mc_error[-1] < 0.5 and res.mc_error[-1] < res.mc_error[0] / 4
    np.testing.assert_allclose(res.mc_error, np.abs(res.mc_v[:, LIVE] - res.v_pi[LIVE]).max(axis=1), atol=0)
    # exploring starts give a Monte-Carlo Q^pi for every live pair; the pairs into the goal and the trap are exact
    assert np.abs(res.mc_q[LIVE] - res.q_pi[LIVE]).max() < 1.0
    assert res.mc_q[4, RIGHT] == 10.0 and res.mc_q[1, RIGHT] == -10.0


def test_more_episodes_shrink_the_error():
    small, large = (maze_values.compute(episodes=e, seed=5) for e in (200, 20_000))
    assert large.mc_episodes[-1] == 20_000
    assert np.nanmax(large.mc_v_se[-1, LIVE]) < np.nanmax(small.mc_v_se[-1, LIVE]) / 8  # 1/sqrt(100) = 1/10
    assert large.mc_error[-1] < 0.15
