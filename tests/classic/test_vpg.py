"""REINFORCE / VPG: the four Psi, which steps count, the loss, gradient variance, learning."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import nn
from torch.nn.utils import parameters_to_vector

from rlalign.classic import vpg
from rlalign.classic.common import EpisodeTracker, Rollout, RunLog, categorical_logp, make_vec_env
from rlalign.classic.maze import MAZE_ID
from rlalign.classic.vpg import (
    PSI_CHOICES,
    VPGConfig,
    bootstrapped_reward_to_go,
    collect_counted,
    complete_mask,
    compute_psi,
    counted_mask,
    gradient_variance,
    policy_loss,
    train,
    whole_episode_mask,
    window_mask,
)
from rlalign.config import ConfigError

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


# Three env columns, 7 rows: a rollout of 3 rows (the window) and 4 rows sampled after it.
#   column 0: ends at t1, t4, t6: the episode in progress at t2 began there and ends at t4;
#   column 1: ends at t2, the window's last row: nothing past the window belongs to its episodes;
#   column 2: ends at t5 only: its one episode runs from before t0 to t5.
WINDOW_ENDS = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.float32)


def test_window_mask_counts_the_window_and_the_episodes_in_progress_at_its_end():
    mask = window_mask(WINDOW_ENDS, 3)
    assert mask[:, 0].tolist() == [1, 1, 1, 1, 1, 0, 0]  # t5-t6 began after the window
    assert mask[:, 1].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert mask[:, 2].tolist() == [1, 1, 1, 1, 1, 1, 0]  # t6 begins the next episode
    assert window_mask(WINDOW_ENDS, 7).tolist() == [[1.0] * 3] * 7  # nothing sampled after the window: all of it


def test_counted_mask_by_psi():
    # row 0 continues an episode in column 0 (starts 0) and begins one in columns 1 and 2
    starts = torch.tensor([0.0, 1.0, 1.0])
    for psi in ("gae", "reward_to_go_baseline"):  # the cut bootstraps from V: every step
        assert counted_mask(psi, WINDOW_ENDS, starts, 3).tolist() == [[1.0] * 3] * 7
    assert torch.equal(counted_mask("reward_to_go", WINDOW_ENDS, starts, 3), window_mask(WINDOW_ENDS, 3))
    # total_return: also only the episodes begun inside the rollout; column 0's t0-t1 is the rest of
    # one begun before, so only t2-t4 counts there
    total = counted_mask("total_return", WINDOW_ENDS, starts, 3)
    assert total.T.tolist() == [[0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]]


def test_policy_loss_divides_by_the_rollouts_steps_not_the_count():
    # one row of two envs sampled (T N = 2), then a second row; the mask counts 3 of the 4 steps:
    # L = -(-1 * 2 + -2 * 1 + -0.5 * 4) / 2 = 3 (the mean over the counted steps would be 2), and
    # dL/dlogp = -Psi * mask / 2
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    psi, mask = torch.tensor([[2.0, 1.0], [4.0, 10.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss = policy_loss(logp, psi, mask, num_samples=2)
    assert loss.item() == 3.0
    loss.backward()
    assert logp.grad.tolist() == [[-1.0, -0.5], [-2.0, 0.0]]


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
    "psi, num_steps, masks",
    [
        # Episode e is steps 3e..3e+2 (0 -> 1 -> 4 -> 5), rewards 0, 0, +10. num_steps = 4: rollout 0
        # holds steps 0-3 and episode 1 (steps 3-5) is in progress at its end, so 4 more steps are
        # sampled (4-7): episodes 0 and 1 count, episode 2 (begun at step 6) does not. Rollout 1 (steps
        # 8-11) begins with the goal step of episode 2, begun before it (left out), and ends with
        # episode 3's end: nothing more sampled. Then the same again.
        ("total_return", 4, [[1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1]] * 3),
        # reward_to_go counts the rest of episode 2 as well, with G = 10 at its goal step
        ("reward_to_go", 4, [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1]] * 3),
        # num_steps = 2: steps 0-1 and 2 more (2-3); episode 0 ends at step 2; step 3 begins episode
        # 1, whose steps 4-5 fill the next rollout: total_return leaves them out, reward_to_go counts them.
        ("total_return", 2, [[1, 1, 1, 0], [0, 0]] * 3),
        ("reward_to_go", 2, [[1, 1, 1, 0], [1, 1]] * 3),
        # with a critic every step, nothing more sampled
        ("gae", 4, [[1, 1, 1, 1]] * 6),
    ],
)
def test_counted_steps_across_rollouts_on_the_maze(psi, num_steps, masks):
    gamma = 0.9
    cfg = VPGConfig(psi=psi, num_envs=1, num_steps=num_steps, gamma=gamma)
    envs = make_vec_env(MAZE_ID, 1, 0)
    obs, _ = envs.reset(seed=0)
    tracker, log, starts, step = EpisodeTracker(1), RunLog(), torch.ones(1), 0
    seen, steps = [], []
    for _ in range(len(masks)):
        ro, mask, _, obs, step = collect_counted(envs, MAZE_ID, obs, ShortestPath(), None, cfg, starts, tracker, log, step)
        starts = ro.episode_ends[-1]  # as train carries it
        psi_t, _ = compute_psi(psi, ro, gamma, 0.95)
        seen.append(mask[:, 0].tolist())
        steps.append(step)
        counted = psi_t[mask.bool()]
        if psi == "total_return":  # R(tau) = 0 + 0.9 * 0 + 0.9^2 * 10 = 8.1 on every counted step
            torch.testing.assert_close(counted, torch.full_like(counted, 8.1), rtol=0, atol=1e-5)
        if psi == "reward_to_go":  # 8.1, 9, 10 at an episode's first, second and goal step
            goal = ro.rewards[mask.bool()] == 10.0
            torch.testing.assert_close(counted[goal], torch.full_like(counted[goal], 10.0), rtol=0, atol=1e-5)
            assert all(min(abs(x - g) for g in (8.1, 9.0, 10.0)) < 1e-5 for x in counted.tolist())
    envs.close()
    assert seen == masks
    assert steps == np.cumsum([len(m) for m in masks]).tolist()  # the steps sampled after a rollout count too


def test_one_env_one_step_rollouts_update_once_per_episode():
    # One env, one step per rollout: without a critic the rollout runs on, one step at a time, to
    # its episode's end, and the next rollout begins the next episode. So every update is one whole
    # episode (counted_frac 1), logged at the step where the episode ended. With a critic every step
    # is an update.
    cfg = dict(total_steps=200, num_envs=1, num_steps=1, hidden=[8], eval_episodes=1)
    for psi in ("total_return", "reward_to_go"):
        result = train(VPGConfig(psi=psi, **cfg), MAZE_ID)
        assert len(result.log.updates) > 3
        assert [u["step"] for u in result.log.updates] == [step for step, _ in result.log.episodes]
        assert {u["counted_frac"] for u in result.log.updates} == {1.0}
    result = train(VPGConfig(psi="gae", **{**cfg, "total_steps": 50}), MAZE_ID)
    assert [u["step"] for u in result.log.updates] == list(range(1, 51)) and {u["counted_frac"] for u in result.log.updates} == {1.0}


class NeverEnds(gym.Env):
    """One float observation, two actions, reward 1, no end and no time limit."""

    observation_space = spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(1, dtype=np.float32), 1.0, False, False, {}


def test_an_episode_that_never_ends_is_a_config_error_without_a_critic(monkeypatch):
    env_id = "rlalign-test/NeverEnds-v0"
    if env_id not in gym.registry:
        gym.register(env_id, entry_point=NeverEnds)
    monkeypatch.setattr(vpg, "MAX_EXTENSION", 40)  # 100,000 steps in a run
    for psi in ("total_return", "reward_to_go"):
        with pytest.raises(ConfigError) as err:
            train(VPGConfig(psi=psi, total_steps=100, num_envs=2, num_steps=4, hidden=[8]), env_id)
        assert str(err.value) == (
            f"vpg: psi={psi} needs every episode to end (there is no critic to bootstrap from), but an episode of env {env_id} "
            "was still going 40 steps past the rollout; use psi=gae or psi=reward_to_go_baseline (they bootstrap from V at the "
            "rollout's end), or give the environment a time limit (max_episode_steps)"
        )
    # with a critic the cut bootstraps: 100 steps of 2 envs x 4 steps are 13 updates
    assert len(train(VPGConfig(psi="gae", total_steps=100, num_envs=2, num_steps=4, hidden=[8], eval_episodes=1), env_id).log.updates) == 13


class StopOrGoOn(gym.Env):
    """One state. Action 0 pays 15 and ends the episode; action 1 pays 1 and goes on (time limit 20)."""

    observation_space = spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.ones(1, dtype=np.float32), {}

    def step(self, action):
        return np.ones(1, dtype=np.float32), 15.0 if action == 0 else 1.0, bool(action == 0), False, {}


class ConstantLogits(nn.Module):
    """pi(a) = softmax(b), the same in every state; b = 0: stop and go on with probability 1/2 each."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, x):  # (..., 1) -> (..., 2)
        return self.b.expand(*x.shape[:-1], 2)


def _ascent_per_rollout(env_id: str, psi: str, num_steps: int, rollouts: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``rollouts`` rollouts of 8 envs through collect_counted, compute_psi and
    policy_loss (gamma = 1): the ascent direction of -L on t = b_go_on - b_stop, i.e.
    d(-L)/db_1 - d(-L)/db_0, and the number of counted steps."""
    torch.manual_seed(0)
    policy, n = ConstantLogits(), 8
    cfg = VPGConfig(psi=psi, num_envs=n, num_steps=num_steps, gamma=1.0)
    envs = make_vec_env(env_id, n, 0)
    obs, _ = envs.reset(seed=0)
    starts, step, tracker, log = torch.ones(n), 0, EpisodeTracker(n), RunLog()
    ascent, counted = [], []
    for _ in range(rollouts):
        ro, mask, _, obs, step = collect_counted(envs, env_id, obs, policy, None, cfg, starts, tracker, log, step)
        starts = ro.episode_ends[-1]
        psi_t, _ = compute_psi(psi, ro, 1.0, 1.0)
        logp, _ = categorical_logp(policy, ro.obs, ro.actions)
        (grad,) = torch.autograd.grad(policy_loss(logp, psi_t, mask, num_steps * n), [policy.b])
        ascent.append((grad[0] - grad[1]).item())
        counted.append(mask.sum().item())
    envs.close()
    return np.array(ascent), np.array(counted)


@pytest.mark.parametrize("psi", ["reward_to_go", "total_return"])
def test_short_rollouts_estimate_the_gradient_without_bias(psi):
    # J(p) = sum_{k<20} p^k (15 (1 - p) + p) with p = P(go on) = sigmoid(t): at p = 1/2,
    # dJ/dp = sum_k k p^(k-1) (15 - 14 p) - 14 sum_k p^k = 8 * 4 - 14 * 2 = 4 (to 1e-4), and dp/dt = 1/4,
    # so dJ/dt = 1 per episode: going on more pays. Per step (E[length] = sum_k 2^-k = 2) the ascent
    # on b_1 - b_0, 2 dJ/dt, is 1. Counting only the episodes that end inside 5-step rollouts, as
    # vpg did, gave -3.1 +- 0.09: short episodes (stop: +15) in, long ones out.
    env_id = "rlalign-test/StopOrGoOn-v0"
    if env_id not in gym.registry:
        gym.register(env_id, entry_point=StopOrGoOn, max_episode_steps=20)
    short, short_counted = _ascent_per_rollout(env_id, psi, num_steps=5, rollouts=1000)
    # the trainer's own estimate, one per rollout, points the right way: well above 0
    assert short.mean() > 5 * short.std() / np.sqrt(len(short)) > 0
    # per counted step (sum of the rollouts' sums / their counted steps, standard error by the delta
    # method), it agrees with 200-step rollouts, which hardly need steps past them, and with the exact 1
    per_step, errors = [], []
    for ascent, counted, num_steps in [(short, short_counted, 5), (*_ascent_per_rollout(env_id, psi, 200, 25), 200)]:
        sums = ascent * num_steps * 8  # L divides by the rollout's T N = num_steps * 8 steps
        ratio = sums.mean() / counted.mean()
        per_step.append(ratio)
        errors.append(np.std(sums - ratio * counted) / np.sqrt(len(sums)) / counted.mean())
    assert abs(per_step[0] - per_step[1]) < 3 * np.hypot(*errors), (per_step, errors)
    assert abs(per_step[0] - 1.0) < 3 * errors[0] and abs(per_step[1] - 1.0) < 3 * errors[1], (per_step, errors)


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
    # into the trap (-10). With a critic, 4 envs, lr 0.02 and 3,000 steps learn on seeds 1-10.
    # Without one the gradient is noisier, and at first it points s0 away from "right" (under the
    # uniform policy A(s0, right) = -0.095 at gamma 0.99: s1 lies next to the trap) until s1 and s4
    # have learned; a run can push s0's policy onto the wall, whose episodes then all return 0 and
    # give no gradient. 8 envs, lr 0.03 and 10,000 steps learn on seeds 1-10 (reward_to_go) and
    # 1-2, 4-10 (total_return).
    critic_free = psi in ("total_return", "reward_to_go")
    budget = dict(total_steps=10_000, num_envs=8, lr=0.03) if critic_free else dict(total_steps=3_000, num_envs=4, lr=0.02)
    result = train(VPGConfig(psi=psi, num_steps=50, **budget), MAZE_ID)
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
