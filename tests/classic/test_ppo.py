"""PPO: ratio 1 before the first step, GAE across autoresets, learning, determinism."""

import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import TimeLimit
from torch import nn

from rlalign.classic.common import EpisodeTracker, RunLog, collect_rollout, make_vec_env
from rlalign.classic.ppo import PPOConfig, ratio_clip_frac, train
from rlalign.core.advantages import gae
from rlalign.core.losses import clipped_surrogate_loss


def test_clip_frac_counts_ratios_outside_the_range_whatever_the_advantage():
    # ratios 1.5, 0.5, 1.5, 0.5, 1.1 (old log-probs 0), eps 0.2, advantages 1, -1, -1, 1, 1:
    # |r - 1| > 0.2 for the first four: CleanRL's clipfrac 4/5. The clip is active only where it
    # zeroes the gradient, 1.5 with A > 0 and 0.5 with A < 0: 2/5 (ClipStats.clip_frac, unchanged).
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1]))
    old, adv = torch.zeros(5), torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    assert ratio_clip_frac(logp, old, 0.2).item() == pytest.approx(0.8, abs=1e-7)
    _, stats = clipped_surrogate_loss(logp, old, adv, eps_low=0.2)
    assert stats.clip_frac.item() == pytest.approx(0.4, abs=1e-7)


def test_the_value_clip_description_says_it_follows_the_annealed_clip_range():
    # the code clips V - V_old to the clip range in effect (test_composed pins clip_vloss with and
    # without anneal_clip); the field's help must say so, not a fixed +-clip_coef
    description = PPOConfig.model_fields["clip_vloss"].description
    assert "clip range in use" in description and "annealed" in description and "anneal_clip" in description


def test_gae_over_vector_rollout_with_truncation_and_termination(counter_env):
    # env 0 terminates after 3 steps; env 1 is truncated (TimeLimit) after 2. SAME_STEP autoreset.
    envs = SyncVectorEnv([lambda: counter_env(3), lambda: TimeLimit(counter_env(99), 2)], autoreset_mode=AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=0)
    critic = nn.Linear(1, 1)  # V(s) = 10 k + 1
    nn.init.constant_(critic.weight, 10.0)
    nn.init.constant_(critic.bias, 1.0)
    ro, _, step = collect_rollout(envs, obs, nn.Linear(1, 2), critic, 4, EpisodeTracker(2), RunLog(), 0)
    adv, ret = gae(ro.rewards, ro.values, ro.next_values, ro.terminated, ro.episode_ends, gamma=0.5, lam=0.5)
    # env 0: k = 0, 1, 2 | 0; V = 1, 11, 21, 1; step 2 terminates (its final obs k=3 is not used), the
    #   rollout's last obs is k=1 (V = 11). delta = r + 0.5 * (1 - term) * V' - V:
    #   5.5, 0.5, 1 - 21 = -20, 1 + 5.5 - 1 = 5.5.  A_3 = 5.5, A_2 = -20 (episode end),
    #   A_1 = 0.5 + 0.25 * -20 = -4.5, A_0 = 5.5 + 0.25 * -4.5 = 4.375.
    # env 1: k = 0, 1 | 0, 1; truncated at steps 1 and 3 with true final obs k=2 (V = 21), so they
    #   bootstrap: delta = 5.5, 1 + 10.5 - 11 = 0.5, 5.5, 0.5.  A = 5.625, 0.5, 5.625, 0.5.
    #   (Bootstrapping from the reset obs k=0 instead would give delta_1 = 1 + 0.5 - 11 = -9.5.)
    expected = torch.tensor([[4.375, 5.625], [-4.5, 0.5], [-20.0, 5.625], [5.5, 0.5]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, expected + ro.values, rtol=0, atol=1e-6)
    assert ro.terminated.T.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert ro.episode_ends.T.tolist() == [[0, 0, 1, 0], [0, 1, 0, 1]]
    assert step == 8


def test_vector_env_uses_same_step_autoreset():
    envs = make_vec_env("CartPole-v1", 2, seed=0)
    assert envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP


def test_first_minibatch_of_first_epoch_has_ratio_exactly_one():
    # The policy has not moved yet: log pi(a|s) recomputed on the minibatch equals the sampling one,
    # so the ratio is 1 (logged as the max |log ratio|) at every iteration. Not always bit for bit:
    # the rollout runs the MLP on 4 rows, the minibatch on 64, and the matmul kernels of the two
    # shapes may round differently (seen: 6e-8, one float32 ulp of log 0.5); a misaligned action or
    # observation would give ~0.1.
    result = train(PPOConfig(total_steps=1_024, num_envs=4, num_steps=64, num_minibatches=4, update_epochs=2), "CartPole-v1")
    devs = [u["ratio/first_minibatch_max_log_dev"] for u in result.log.updates]
    assert len(devs) == 4 and max(devs) <= 5e-7, devs
    assert all(u["approx_kl"] > 0 for u in result.log.updates)  # later minibatches did move


@pytest.mark.slow
def test_learns_cartpole():
    # random policy ~22, a flipped gradient sign ~9; 10k steps of PPO reach > 150 (seed 1).
    result = train(PPOConfig(total_steps=10_240, seed=1), "CartPole-v1")
    assert result.eval_return > 150
    assert np.mean(result.episode_returns[-20:]) > 3 * np.mean(result.episode_returns[:20])


def test_same_seed_same_returns():
    cfg = PPOConfig(total_steps=2_048, num_envs=4, num_steps=128, update_epochs=2, seed=5)
    a, b = train(cfg, "CartPole-v1"), train(cfg, "CartPole-v1")
    c = train(cfg.model_copy(update={"seed": 6}), "CartPole-v1")
    assert a.episode_returns == b.episode_returns and a.eval_returns == b.eval_returns
    assert a.episode_returns != c.episode_returns
    for pa, pb in zip(a.agent["actor"].parameters(), b.agent["actor"].parameters()):
        assert torch.equal(pa, pb)
