"""REINFORCE / VPG: the four Psi, the complete-episode mask, gradient variance, learning."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from rlalign.classic.common import EpisodeTracker, Rollout, RunLog, collect_rollout, make_vec_env
from rlalign.classic.maze import MAZE_ID
from rlalign.classic.vpg import (
    PSI_CHOICES,
    VPGConfig,
    bootstrapped_reward_to_go,
    complete_mask,
    compute_psi,
    gradient_variance,
    train,
    whole_episode_mask,
)


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


def test_whole_episode_mask_needs_the_start_too():
    # ends 0 1 0 1 0: episodes t0-t1, t2-t3, t4 unfinished. Row 0 begins an episode: t0-t3 count;
    # row 0 continues one from the previous rollout: t0-t1 are its rest, only t2-t3 count.
    ends = _rollout().episode_ends
    assert whole_episode_mask(ends, torch.ones(1)).flatten().tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert whole_episode_mask(ends, torch.zeros(1)).flatten().tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]


def test_psi_choices_by_hand():
    ro = _rollout()
    # gamma = 0.5. Episode A: rewards 1, 2 -> reward-to-go 1 + 0.5*2 = 2, then 2; R(tau) = 2 at both.
    # Episode B: 3, 4 -> 3 + 0.5*4 = 5, then 4; R(tau) = 5 at both. Without a critic the truncated
    # episode B keeps the rewards it has.
    psi = {name: compute_psi(name, ro, gamma=0.5, lam=0.0)[0].flatten()[:4].tolist() for name in PSI_CHOICES}
    assert psi["total_return"] == [2.0, 2.0, 5.0, 5.0]
    assert psi["reward_to_go"] == [2.0, 2.0, 5.0, 4.0]
    # With the baseline, B's truncation at t3 bootstraps from V(final obs) = 1: G_3 = 4 + 0.5*1 = 4.5,
    # G_2 = 3 + 0.5*4.5 = 5.25; minus V = 1: 4.25, 3.5. A terminated at t1: 2 - 1, 2 - 1.
    assert psi["reward_to_go_baseline"] == [1.0, 1.0, 4.25, 3.5]
    # lam = 0: the TD residual r + 0.5 * (1 - terminated) * 1 - 1 (step 1 terminated, step 3 truncated bootstraps)
    assert psi["gae"] == [0.5, 1.0, 2.5, 3.5]


def test_reward_to_go_baseline_bootstraps_truncation_and_critic_target():
    # The baseline's regression target is the bootstrapped reward-to-go: A: 2, 2; B: 5.25, 4.5 (as
    # above); the unfinished t4 bootstraps at the cut: 5 + 0.5 * V(s_5) = 5 + 0.5 = 5.5.
    psi, target = compute_psi("reward_to_go_baseline", _rollout(), gamma=0.5, lam=0.0)
    assert target.flatten().tolist() == [2.0, 2.0, 5.25, 4.5, 5.5]
    assert psi.flatten().tolist() == [1.0, 1.0, 4.25, 3.5, 4.5]


def test_reward_to_go_baseline_is_gae_with_lambda_one():
    # G_t - V(s_t) = sum_l gamma^l delta_{t+l} (the TD residuals telescope), with truncations,
    # terminations and the cut, on random float64 values: Psi and the critic's target both.
    g = torch.Generator().manual_seed(0)
    T, N = 12, 3
    ends = torch.zeros(T, N, dtype=torch.float64)
    ends[[2, 6, 9], 0] = 1.0
    ends[[4, 11], 1] = 1.0
    ends[[0, 1, 7], 2] = 1.0
    terminated = ends.clone()
    terminated[6, 0] = terminated[11, 1] = terminated[1, 2] = 0.0  # truncated: bootstrap
    values = torch.randn(T, N, generator=g, dtype=torch.float64)  # (T, N) V(s_t)
    finals = torch.randn(T, N, generator=g, dtype=torch.float64)  # (T, N) V(final obs) at an end, V(s_T) on the last row
    next_values = torch.cat([values[1:], finals[-1:]])  # (T, N) V(s_{t+1}) as collect_rollout builds it
    next_values = torch.where(ends.bool(), finals, next_values)
    ro = Rollout(obs=None, actions=None, logp=None, values=values, next_values=next_values,
                 rewards=torch.randn(T, N, generator=g, dtype=torch.float64), terminated=terminated, episode_ends=ends)
    for gamma in (0.5, 0.9, 1.0):
        rtg_b, rtg_target = compute_psi("reward_to_go_baseline", ro, gamma, lam=0.3)
        gae1, gae_target = compute_psi("gae", ro, gamma, lam=1.0)
        torch.testing.assert_close(rtg_b, gae1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rtg_target, gae_target, rtol=1e-12, atol=1e-12)
    # and by hand, env 0's truncated episode t3-t6 with gamma = 1: G_6 = r_6 + V(final obs at t6)
    G = bootstrapped_reward_to_go(ro.rewards, ro.next_values, ro.terminated, ro.episode_ends, 1.0)
    assert G[6, 0].item() == pytest.approx(ro.rewards[6, 0].item() + ro.next_values[6, 0].item(), abs=1e-12)
    assert G[3, 0].item() == pytest.approx(ro.rewards[3:7, 0].sum().item() + ro.next_values[6, 0].item(), abs=1e-12)


class ShortestPath(nn.Module):
    """The maze's shortest path, deterministic: right in s0, down in s1, right in s4."""

    def forward(self, x):  # (..., 6) one-hot -> (..., 4) logits
        best = torch.tensor([3, 1, 0, 0, 3, 0])[x.argmax(-1)]  # (...)
        return torch.where(nn.functional.one_hot(best, 4).bool(), 0.0, -1e9)  # softmax is exactly one-hot


@pytest.mark.parametrize(
    "num_steps, masks",
    [
        # Episode e is steps 3e..3e+2 (0 -> 1 -> 4 -> 5), rewards 0, 0, +10. Rollout r covers steps
        # 4r..4r+3; e is whole inside r for (r, e) = (0, 0), (2, 3), (3, 4), (5, 7). Rollout 1 holds the
        # rest of episode 1 (steps 4, 5: the goal step) and the start of episode 2: left out.
        (4, [[1, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 1]]),
        # 2 steps per rollout never hold a whole 3-step episode: the goal step of rollout 1 (the
        # episode began in rollout 0) must not count with R = 10 from the cut instead of 8.1.
        (2, [[0, 0]] * 6),
    ],
)
def test_total_return_is_the_whole_episodes_return_across_rollouts(num_steps, masks):
    gamma = 0.9
    envs = make_vec_env(MAZE_ID, 1, 0)
    obs, _ = envs.reset(seed=0)
    tracker, log, starts, step = EpisodeTracker(1), RunLog(), torch.ones(1), 0
    seen = []
    for _ in range(len(masks)):
        ro, obs, step = collect_rollout(envs, obs, ShortestPath(), None, num_steps, tracker, log, step)
        mask = whole_episode_mask(ro.episode_ends, starts)  # as train carries it
        starts = ro.episode_ends[-1]
        psi, _ = compute_psi("total_return", ro, gamma, 0.95)
        seen.append(mask[:, 0].tolist())
        # R(tau) = 0 + 0.9 * 0 + 0.9^2 * 10 = 8.1 on every counted step
        torch.testing.assert_close(psi[mask.bool()], torch.full_like(psi[mask.bool()], 8.1), rtol=0, atol=1e-5)
    envs.close()
    assert seen == masks


def test_total_return_trains_on_whole_episodes_only():
    # One step per rollout: a whole episode would have to last one step, and the maze's shortest
    # lasts two (into the trap), so train counts nothing for total_return (no loss, no step) once it
    # carries each env's episode start across rollouts; reward_to_go counts each episode's last step.
    cfg = dict(total_steps=400, num_envs=4, num_steps=1, hidden=[8], eval_episodes=1)
    total = train(VPGConfig(psi="total_return", **cfg), MAZE_ID).log.updates
    assert len(total) == 100
    assert {u["counted_frac"] for u in total} == {0.0} and {u["loss/policy"] for u in total} == {0.0}
    to_go = train(VPGConfig(psi="reward_to_go", **cfg), MAZE_ID).log.updates
    assert sum(u["counted_frac"] for u in to_go) > 0


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
    # into the trap (-10). lr 0.02 learns on seeds 1-6 with every Psi; at 0.05 a run can push s0's
    # policy onto the wall (down), whose episodes then all have return 0 and so no gradient.
    result = train(VPGConfig(psi=psi, total_steps=3_000, num_envs=4, num_steps=50, lr=0.02), MAZE_ID)
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
