"""V^pi, Q^pi and A^pi of a given policy (seed 002, section 4.1): exact policy evaluation against values
derived by hand, and Monte-Carlo returns converging to them.

The maze (rlalign/classic/maze.py), states s = 3*row + col, actions 0 up, 1 down, 2 left, 3 right:

    +-----+-----+-----+
    | S 0 |  1  | T 2 |     entering T pays -10, entering G pays +10, both end the episode;
    |=====|     |     |     '=' is a wall between 0 and 3; bumping a wall or the border stays put.
    |  3  |  4  | G 5 |
    +-----+-----+-----+

The uniform random policy, gamma = 0.9, by hand. Swapping the rows maps 0 <-> 3, 1 <-> 4, T <-> G, up <->
down, keeps the wall and the uniform policy, and negates every reward, so V(3) = -V(0) and V(4) = -V(1).
    V(0) = 0.9 (3/4 V(0) + 1/4 V(1))   (up, down, left bump back; right to 1)   =>  V(0) = 0.225/0.325 V(1) = 9/13 V(1)
    so V(3) = 9/13 V(4) and V(1) = -V(4), and at 4 (right: the goal; up: 1; left: 3; down: bump):
    V(4) = 1/4 (10 + 0.9 V(1) + 0.9 V(3) + 0.9 V(4)) = 2.5 + 0.225 (-V(4) + 9/13 V(4) + V(4)) = 2.5 + 2.025/13 V(4)
         =>  V(4) = 2.5 * 13 / 10.975 = 1300/439 = 2.961276
    V(1) = -1300/439,  V(3) = 9/13 * 1300/439 = 900/439 = 2.050114,  V(0) = -900/439,  V(T) = V(G) = 0.
"""

import gymnasium as gym
import numpy as np
import pytest

from rlalign.classic.maze import Maze2x3Env
from rlalign.classic.policy_evaluation import (
    deterministic_policy,
    epsilon_greedy_policy,
    monte_carlo_evaluation,
    policy_evaluation,
    terminal_states,
    uniform_policy,
)
from rlalign.classic.value_iteration import policy_value, tabular_model, value_iteration

UP, DOWN, LEFT, RIGHT = 0, 1, 2, 3
GAMMA = 0.9
P = Maze2x3Env().P
V_UNIFORM = np.array([-900, -1300, 0, 900, 1300, 0]) / 439  # derived in the module docstring


def random_policy(seed: int, n_states: int = 6, n_actions: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.ones(n_actions), size=n_states)  # (S, A)


def test_uniform_policy_values_by_hand():
    pv = policy_evaluation(P, uniform_policy(6, 4), GAMMA)
    np.testing.assert_allclose(pv.v, V_UNIFORM, rtol=0, atol=1e-12)
    # Q^pi(s, a) = r + 0.9 V^pi(s'):
    assert pv.q[4, RIGHT] == pytest.approx(10.0, abs=1e-12)  # into the goal, nothing follows
    assert pv.q[1, RIGHT] == pytest.approx(-10.0, abs=1e-12)  # into the trap
    assert pv.q[1, DOWN] == pytest.approx(0.9 * 1300 / 439, abs=1e-12)  # to 4: 1170/439 = 2.665148
    np.testing.assert_allclose(pv.q[0], np.array([-810, -810, -810, -1170]) / 439, atol=1e-12)  # bump: 0.9 V(0); right: 0.9 V(1)
    np.testing.assert_array_equal(pv.q[[2, 5]], 0.0)  # terminal cells
    # A^pi = Q^pi - V^pi: at 4, going right is worth 10 - 1300/439 = 3090/439 = 7.038724 more than a random move
    assert pv.advantage[4, RIGHT] == pytest.approx(3090 / 439, abs=1e-12)
    assert pv.advantage[0, RIGHT] == pytest.approx((-1170 + 900) / 439, abs=1e-12)  # right from the start is worse than staying
    # V^pi = sum_a pi(a|s) Q^pi(s, a): the mean of the four actions
    np.testing.assert_allclose(pv.q.mean(axis=1), pv.v, atol=1e-12)


def test_deterministic_policies_by_hand_and_against_policy_value():
    # always right: V(1) = -10 (trap), V(0) = 0.9 * -10 = -9, V(4) = 10, V(3) = 9
    always_right = np.full(6, RIGHT)
    pv = policy_evaluation(P, deterministic_policy(always_right, 4), GAMMA)
    np.testing.assert_allclose(pv.v, [-9.0, -10.0, 0.0, 9.0, 10.0, 0.0], atol=1e-12)
    assert pv.q[0, DOWN] == pytest.approx(0.9 * -9.0, abs=1e-12)  # bump the wall, then right, right
    assert pv.advantage[0, DOWN] == pytest.approx(-8.1 + 9.0, abs=1e-12)  # waiting a step costs less: the trap is discounted
    np.testing.assert_array_equal(pv.advantage[np.arange(6), always_right], 0.0)  # A^pi(s, pi(s)) = 0 for a deterministic pi
    for seed in range(5):
        actions = np.random.default_rng(seed).integers(4, size=6)
        np.testing.assert_allclose(policy_evaluation(P, deterministic_policy(actions, 4), GAMMA).v, policy_value(P, actions, GAMMA), atol=1e-12)


def test_policy_evaluation_is_the_fixed_point_of_the_bellman_expectation_backup():
    # iterate V <- sum_a pi(a|s) [r(s, a) + gamma sum_s' p_cont(s'|s, a) V(s')] to convergence
    _, reward, cont = tabular_model(P)
    for seed in range(3):
        pi = random_policy(seed)
        v = np.zeros(6)
        for _ in range(400):  # 0.9^400 ~ 5e-19
            v = (pi * (reward + GAMMA * cont @ v)).sum(axis=1)
        np.testing.assert_allclose(policy_evaluation(P, pi, GAMMA).v, v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("make_pi", [lambda: uniform_policy(6, 4), lambda: random_policy(0), lambda: random_policy(1),
                                     lambda: epsilon_greedy_policy(value_iteration(P, GAMMA)[1], 0.3)])
def test_advantage_averages_to_zero_under_the_policy(make_pi):
    # sum_a pi(a|s) A^pi(s, a) = sum_a pi(a|s) Q^pi(s, a) - V^pi(s) = 0
    pi = make_pi()
    pv = policy_evaluation(P, pi, GAMMA)
    np.testing.assert_allclose((pi * pv.advantage).sum(axis=1), 0.0, atol=1e-12)
    assert np.abs(pv.advantage).max() > 1.0  # and is not zero itself


def test_greedy_optimal_policy_has_the_optimal_values():
    v_star, q_star, greedy = value_iteration(P, GAMMA)
    pv = policy_evaluation(P, deterministic_policy(greedy, 4), GAMMA)
    np.testing.assert_allclose(pv.v, v_star, atol=1e-12)  # V^{pi*} = V*
    np.testing.assert_allclose(pv.q, q_star, atol=1e-12)  # Q^{pi*} = Q*
    assert (pv.advantage <= 1e-12).all()  # A* <= 0, with 0 at the greedy action: no action beats pi*
    np.testing.assert_array_equal(pv.advantage[np.arange(6), greedy], 0.0)
    np.testing.assert_array_equal(epsilon_greedy_policy(q_star, 0.0), deterministic_policy(greedy, 4))
    for seed in range(5):  # and every other policy is worth at most V*
        assert (policy_evaluation(P, random_policy(seed), GAMMA).v <= v_star + 1e-12).all()


def test_optimal_values_on_frozenlake():
    P_lake = gym.make("FrozenLake-v1").unwrapped.P  # slippery: stochastic transitions
    v_star, q_star, greedy = value_iteration(P_lake, 0.95)
    pv = policy_evaluation(P_lake, deterministic_policy(greedy, 4), 0.95)
    np.testing.assert_allclose(pv.v, v_star, atol=1e-8)
    np.testing.assert_allclose(pv.q, q_star, atol=1e-8)
    pi = random_policy(0, 16, 4)
    np.testing.assert_allclose((pi * policy_evaluation(P_lake, pi, 0.95).advantage).sum(axis=1), 0.0, atol=1e-12)


def test_epsilon_greedy_policy():
    q = np.array([[1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 0.0, 0.0]])  # (S=2, A=4), a tie in row 1 goes to action 0
    # eps = 0.2: 0.2 / 4 = 0.05 everywhere, plus 0.8 on the argmax
    np.testing.assert_allclose(epsilon_greedy_policy(q, 0.2), [[0.05, 0.85, 0.05, 0.05], [0.85, 0.05, 0.05, 0.05]], atol=1e-15)
    np.testing.assert_allclose(epsilon_greedy_policy(q, 1.0), uniform_policy(2, 4), atol=1e-15)
    with pytest.raises(ValueError):
        epsilon_greedy_policy(q, 1.5)
    # on the maze, epsilon-greedy around Q* loses value at the start as epsilon grows, from V* = 8.1 to the uniform V
    q_star = value_iteration(P, GAMMA)[1]
    start = [policy_evaluation(P, epsilon_greedy_policy(q_star, eps), GAMMA).v[0] for eps in np.linspace(0, 1, 11)]
    assert start[0] == pytest.approx(8.1) and start[-1] == pytest.approx(-900 / 439)
    assert np.all(np.diff(start) < 0)


def test_bad_policies_and_a_policy_that_never_ends():
    with pytest.raises(ValueError, match="shape"):
        policy_evaluation(P, uniform_policy(6, 3), GAMMA)
    with pytest.raises(ValueError, match="probability"):
        policy_evaluation(P, np.full((6, 4), 0.3), GAMMA)
    negative = uniform_policy(6, 4)
    negative[0] = [1.5, -0.5, 0.0, 0.0]  # sums to 1, but a probability below 0
    with pytest.raises(ValueError, match="probability"):
        policy_evaluation(P, negative, GAMMA)
    # always up never leaves 0 and 1: with gamma = 1 its return is a sum of infinitely many zeros, I - P_pi is singular
    with pytest.raises(np.linalg.LinAlgError):
        policy_evaluation(P, deterministic_policy(np.full(6, UP), 4), 1.0)
    np.testing.assert_array_equal(terminal_states(P), [0, 0, 1, 0, 0, 1])


def test_a_policy_that_always_ends_is_evaluated_with_gamma_one():
    # right, down, right from 0 and right from 3 reach the goal from every live cell: with gamma = 1
    # the return is the goal's +10 (V^pi = 10 there, 0 in the terminal cells); Q(0, up) = 0 + V(0) = 10
    # (a bump, then pi); Q(1, right) = -10 (the trap).
    values = policy_evaluation(P, deterministic_policy(np.array([RIGHT, DOWN, UP, RIGHT, RIGHT, UP]), 4), 1.0)
    np.testing.assert_allclose(values.v, [10.0, 10.0, 0.0, 10.0, 10.0, 0.0], atol=1e-12)
    assert values.q[0, UP] == pytest.approx(10.0, abs=1e-12) and values.q[1, RIGHT] == pytest.approx(-10.0, abs=1e-12)


# ---------------------------------------------------------------- Monte Carlo


@pytest.fixture(scope="module")
def mc_uniform():
    return monte_carlo_evaluation(P, uniform_policy(6, 4), GAMMA, n_episodes=20_000, seed=0)


def test_first_visit_monte_carlo_converges_within_a_shrinking_tolerance(mc_uniform):
    exact = policy_evaluation(P, uniform_policy(6, 4), GAMMA)
    live = [0, 1, 3, 4]
    se_max = []
    for n in (200, 2_000, 20_000):
        v, v_se = mc_uniform.v(n), mc_uniform.v_standard_error(n)
        q, q_se = mc_uniform.q(n), mc_uniform.q_standard_error(n)
        # 4 V and 16 Q estimates per n, each within 4.5 standard errors (a miss would be a bias, not chance)
        assert (np.abs(v[live] - exact.v[live]) <= 4.5 * v_se[live]).all(), (n, v - exact.v, v_se)
        random_pairs = q_se[live] > 0  # the two pairs into the goal or trap return exactly +-10
        assert (np.abs(q[live] - exact.q[live])[random_pairs] <= 4.5 * q_se[live][random_pairs]).all(), n
        np.testing.assert_array_equal(q[[1, 4], RIGHT], [-10.0, 10.0])
        se_max.append(v_se[live].max())
    # first-visit returns are independent across episodes, so the error bar shrinks as 1/sqrt(n): 10x episodes, /3.16
    np.testing.assert_allclose(np.array(se_max[1:]) / se_max[:-1], 10**-0.5, rtol=0.15)
    assert se_max[-1] < 0.06  # 20k episodes: V^pi to about +-0.2 of values up to 3
    assert np.isnan(mc_uniform.v()[[2, 5]]).all()  # terminal states are never visited
    np.testing.assert_array_equal(mc_uniform.v_visits.max(axis=0), [1, 1, 0, 1, 1, 0])  # at most one record per episode


def test_every_visit_monte_carlo_records_revisits_and_converges(mc_uniform):
    exact = policy_evaluation(P, uniform_policy(6, 4), GAMMA)
    every = monte_carlo_evaluation(P, uniform_policy(6, 4), GAMMA, n_episodes=20_000, seed=0, first_visit=False)
    assert every.v_visits.sum() > 1.5 * mc_uniform.v_visits.sum()  # a random walk bumps into walls and comes back
    live = [0, 1, 3, 4]
    assert (np.abs(every.v()[live] - exact.v[live]) < 5 * mc_uniform.v_standard_error()[live]).all()
    assert np.abs(every.q()[live] - exact.q[live]).max() < 0.25


def test_monte_carlo_of_the_optimal_policy_is_exact():
    # deterministic maze and policy: every return equals its value, whatever the number of episodes
    v_star, q_star, greedy = value_iteration(P, GAMMA)
    mc = monte_carlo_evaluation(P, deterministic_policy(greedy, 4), GAMMA, n_episodes=500, seed=1)
    live = [0, 1, 3, 4]
    np.testing.assert_allclose(mc.v()[live], v_star[live], rtol=0, atol=1e-12)
    np.testing.assert_allclose(mc.q()[live], q_star[live], rtol=0, atol=1e-12)  # exploring starts reach every pair
    assert (mc.q_visits.sum(axis=0)[live] >= 15).all()  # about 500 / 16 first visits each


def test_monte_carlo_on_a_stochastic_model_by_hand():
    # state 0: action 0 pays 1 and continues in 0 with prob 1/2, or pays 0 and ends (prob 1/2);
    #          action 1 pays 2 and ends. State 1 is terminal. Uniform pi, gamma = 0.8:
    # V(0) = 1/2 [1/2 (1 + 0.8 V(0)) + 1/2 * 0] + 1/2 * 2 = 1.25 + 0.2 V(0)  =>  V(0) = 1.25 / 0.8 = 1.5625
    # Q(0, 0) = 1/2 (1 + 0.8 * 1.5625) = 1.125,  Q(0, 1) = 2
    model = {0: {0: [(0.5, 0, 1.0, False), (0.5, 1, 0.0, True)], 1: [(1.0, 1, 2.0, True)]},
             1: {0: [(1.0, 1, 0.0, True)], 1: [(1.0, 1, 0.0, True)]}}
    pv = policy_evaluation(model, uniform_policy(2, 2), 0.8)
    np.testing.assert_allclose(pv.v, [1.5625, 0.0], atol=1e-15)
    np.testing.assert_allclose(pv.q[0], [1.125, 2.0], atol=1e-15)
    mc = monte_carlo_evaluation(model, uniform_policy(2, 2), 0.8, n_episodes=40_000, seed=2)
    assert abs(mc.v()[0] - 1.5625) <= 4.5 * mc.v_standard_error()[0] and mc.v_standard_error()[0] < 0.01
    assert abs(mc.q()[0, 0] - 1.125) <= 4.5 * mc.q_standard_error()[0, 0] and mc.q()[0, 1] == 2.0


def test_monte_carlo_is_reproducible_and_checks_its_arguments():
    a = monte_carlo_evaluation(P, uniform_policy(6, 4), GAMMA, n_episodes=50, seed=3)
    b = monte_carlo_evaluation(P, uniform_policy(6, 4), GAMMA, n_episodes=50, seed=3)
    np.testing.assert_array_equal(a.q_returns, b.q_returns)
    assert a.v_returns.shape == (50, 6) and a.q_returns.shape == (50, 6, 4)
    with pytest.raises(ValueError):
        monte_carlo_evaluation(P, uniform_policy(6, 4), GAMMA, n_episodes=0)
