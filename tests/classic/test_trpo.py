"""TRPO: conjugate gradient, the KL-bounded line search, learning on CartPole."""

import numpy as np
import pytest
import torch
from torch import nn

from rlalign.classic.trpo import TRPOConfig, conjugate_gradient, line_search, train


def test_conjugate_gradient_solves_spd_system():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(12, 12, generator=g, dtype=torch.float64)
    A = m @ m.T + 0.5 * torch.eye(12, dtype=torch.float64)  # symmetric positive definite
    b = torch.randn(12, generator=g, dtype=torch.float64)
    x = conjugate_gradient(lambda v: A @ v, b, iters=12, residual_tol=1e-20)  # exact after n steps
    torch.testing.assert_close(x, torch.linalg.solve(A, b), rtol=0, atol=1e-9)


def _toy():
    """One parameter w = 0; surrogate(w) = w, 'KL'(w) = w^2 (a quadratic trust region)."""
    actor = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(actor.weight)
    w = lambda: actor.weight.item()  # noqa: E731
    return actor, lambda: (w(), w() ** 2)


def test_line_search_shrinks_until_kl_bound_holds():
    # full step 1 with shrink 0.5: KL of the trials 1, 0.25, 0.0625, 0.015625 > 0.01, then
    # 0.5^4 = 0.0625 gives KL 0.00390625 <= 0.01 and surrogate 0.0625 > 0: accepted.
    actor, surrogate_kl = _toy()
    accepted, surr, kl = line_search(actor, torch.zeros(1), torch.ones(1), surrogate_kl, max_kl=0.01, iters=10, shrink=0.5)
    assert accepted and surr == 0.0625 and kl == 0.00390625
    assert actor.weight.item() == 0.0625


def test_line_search_rejects_step_breaking_kl_bound():
    # only 4 trials (1, 0.5, 0.25, 0.125): every one has KL >= 0.015625 > 0.01, so nothing is
    # accepted and the old parameters come back.
    actor, surrogate_kl = _toy()
    accepted, _, _ = line_search(actor, torch.zeros(1), torch.ones(1), surrogate_kl, max_kl=0.01, iters=4, shrink=0.5)
    assert not accepted and actor.weight.item() == 0.0


def test_line_search_rejects_step_that_lowers_surrogate():
    # direction -1: the KL bound holds from the 5th trial on, but the surrogate w < 0 never improves.
    actor, surrogate_kl = _toy()
    accepted, _, _ = line_search(actor, torch.zeros(1), -torch.ones(1), surrogate_kl, max_kl=0.01, iters=10, shrink=0.5)
    assert not accepted and actor.weight.item() == 0.0


@pytest.mark.slow
def test_learns_cartpole():
    # The sampling policy starts near uniform (~22 a episode). With a flipped gradient sign every
    # line-search trial lowers the surrogate, nothing is accepted and the returns stay ~22. (The
    # untrained *greedy* policy of seed 1 already scores 215, so the eval bar is set above it.)
    result = train(TRPOConfig(total_steps=10_240, seed=1), "CartPole-v1")
    returns = np.array(result.episode_returns)
    assert returns[-20:].mean() > 5 * returns[:20].mean()
    assert result.eval_return > 400
    assert all(u["kl"] <= 0.01 for u in result.log.updates)  # the trust region held at every step
    assert sum(u["accepted"] for u in result.log.updates) >= len(result.log.updates) - 1
