"""The PPO paper's surrogates along the update line: the known truths of the figure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlalign.explore import ppo_surrogates
from rlalign.explore.registry import run_explorer


@pytest.fixture(scope="module")
def result():
    return ppo_surrogates.compute(n_points=51)


def test_at_theta_old_every_ratio_is_one(result):
    # alpha = 0: r = 1 for every sample, so KL = 0 and L^CPI = E[clip(1) A] = L^CLIP = E[A]
    assert result.alpha[0] == 0.0 and result.kl[0] == pytest.approx(0.0, abs=1e-12)
    for curve in (result.cpi, result.clipped_term, result.clip_objective):
        assert curve[0] == pytest.approx(result.advantage_mean, abs=1e-12)
    assert result.clip_frac[0] == 0.0


def test_clipped_objective_is_a_pessimistic_bound_that_stops_rising(result):
    # min(rA, clip(r)A) <= rA everywhere; past the update L^CPI keeps rising while L^CLIP flattens
    assert np.all(result.clip_objective <= result.cpi + 1e-12)
    assert np.all(result.kl >= -1e-15) and np.all(np.diff(result.kl) > 0)  # the KL grows along the line
    end, one = -1, int(np.argmin(abs(result.alpha - 1.0)))
    assert result.cpi[end] - result.cpi[one] > 0.1
    assert result.clip_objective[end] - result.clip_objective[one] < 0.01
    assert result.clip_objective[one] > result.clip_objective[0]  # the update improved its own objective


def test_curves_equal_a_direct_computation_at_one_point():
    # the ratio, the KL and both surrogates recomputed by hand at alpha = 0.5 for a tiny policy
    r = ppo_surrogates.compute(n_states=2, n_actions=3, n_samples=16, epochs=5, lr=0.1, alpha_max=1.0, n_points=3, seed=3)
    theta_old, states, actions, adv = ppo_surrogates._policy_samples(2, 3, 16, 3)
    theta = theta_old.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=0.1)
    for _ in range(5):
        ratio = torch.softmax(theta[states], -1).gather(-1, actions[:, None]).squeeze(-1) / torch.softmax(theta_old[states], -1).gather(-1, actions[:, None]).squeeze(-1)
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    mid = theta_old + 0.5 * (theta.detach() - theta_old)
    p_old, p_mid = torch.softmax(theta_old[states], -1), torch.softmax(mid[states], -1)
    ratio = p_mid.gather(-1, actions[:, None]).squeeze(-1) / p_old.gather(-1, actions[:, None]).squeeze(-1)
    assert r.kl[1] == pytest.approx((p_old * (p_old.log() - p_mid.log())).sum(-1).mean().item(), rel=1e-9)
    assert r.cpi[1] == pytest.approx((ratio * adv).mean().item(), rel=1e-9)
    assert r.clip_objective[1] == pytest.approx(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean().item(), rel=1e-9)


def test_writes_the_figure_and_its_numbers(tmp_path):
    png, data = run_explorer("ppo-surrogates", tmp_path)
    assert png.stat().st_size > 10_000 and "clip_objective" in data.read_text()
