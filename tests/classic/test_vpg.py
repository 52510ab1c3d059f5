"""REINFORCE / VPG: the four Psi, the complete-episode mask, gradient variance, learning."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from rlalign.classic.common import Rollout
from rlalign.classic.maze import MAZE_ID
from rlalign.classic.vpg import PSI_CHOICES, VPGConfig, complete_mask, compute_psi, gradient_variance, train


def _rollout():
    """One env column, T = 5: episode A = steps 0-1 (terminated), episode B = steps 2-3
    (truncated), step 4 unfinished. Rewards 1, 2, 3, 4, 5; V(s_t) = 1 everywhere."""
    T = 5
    ends = torch.tensor([[0.0], [1.0], [0.0], [1.0], [0.0]])
    return Rollout(
        obs=torch.arange(T, dtype=torch.float32).view(T, 1, 1),
        actions=torch.tensor([[0], [1], [0], [1], [0]]),
        logp=torch.zeros(T, 1),
        values=torch.ones(T, 1),
        next_values=torch.ones(T, 1),
        rewards=torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]]),
        terminated=torch.tensor([[0.0], [1.0], [0.0], [0.0], [0.0]]),
        episode_ends=ends,
    )


def test_complete_mask_drops_the_unfinished_tail():
    assert complete_mask(_rollout().episode_ends).flatten().tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_psi_choices_by_hand():
    ro = _rollout()
    # gamma = 0.5. Episode A: rewards 1, 2 -> reward-to-go 1 + 0.5*2 = 2, then 2; R(tau) = 2 at both.
    # Episode B: 3, 4 -> 3 + 0.5*4 = 5, then 4; R(tau) = 5 at both.
    psi = {name: compute_psi(name, ro, gamma=0.5, lam=0.0)[0].flatten()[:4].tolist() for name in PSI_CHOICES}
    assert psi["total_return"] == [2.0, 2.0, 5.0, 5.0]
    assert psi["reward_to_go"] == [2.0, 2.0, 5.0, 4.0]
    assert psi["reward_to_go_baseline"] == [1.0, 1.0, 4.0, 3.0]
    # lam = 0: the TD residual r + 0.5 * (1 - terminated) * 1 - 1 (step 1 terminated, step 3 truncated bootstraps)
    assert psi["gae"] == [0.5, 1.0, 2.5, 3.5]


def test_gradient_variance_is_the_trace_of_the_per_episode_covariance():
    ro = _rollout()
    torch.manual_seed(0)
    actor = nn.Linear(1, 2)
    psi = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    mask = complete_mask(ro.episode_ends)

    def episode_grad(sl):  # g_i = sum_t grad log pi(a_t | s_t) psi_t over one episode
        logp = torch.log_softmax(actor(ro.obs[sl, 0]), -1).gather(1, ro.actions[sl, 0, None]).squeeze(1)
        return parameters_to_vector(torch.autograd.grad((logp * psi[sl, 0]).sum(), list(actor.parameters())))

    g1, g2 = episode_grad(slice(0, 2)), episode_grad(slice(2, 4))
    expected = ((g1 - g2) ** 2 / 2).sum().item()  # unbiased variance of two samples, summed over coordinates
    assert gradient_variance(actor, ro, psi, mask) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("psi", PSI_CHOICES)
def test_every_psi_learns_the_maze(psi):
    # The greedy policy walks right, down, right to the goal (+10); a flipped gradient sign walks
    # into the trap (-10).
    result = train(VPGConfig(psi=psi, total_steps=3_000, num_envs=4, num_steps=50, lr=0.05), MAZE_ID)
    assert result.eval_return == 10.0
    with torch.no_grad():
        probs = torch.softmax(result.agent["actor"](torch.eye(6)), -1)
    assert [probs[s].argmax().item() for s in (0, 1, 4)] == [3, 1, 3]
    assert probs[0, 3] > 0.5  # uniform is 0.25


def test_baseline_and_gae_reduce_gradient_variance():
    result = train(VPGConfig(total_steps=2_000, num_envs=4, num_steps=500, measure_variance=True), "CartPole-v1")
    var = result.log.updates[0]
    # same rollout, same policy: R(tau) > reward-to-go > reward-to-go - V > GAE (a measured ordering, seed 1)
    assert var["grad_var/total_return"] > var["grad_var/reward_to_go"] > var["grad_var/reward_to_go_baseline"] > var["grad_var/gae"]
