"""Every explorer returns the known truth of its problem, and ``rlalign explore`` writes its figure and data.

Each ``compute()`` runs once per test process (default arguments, the ones the CLI uses) and is shared
by the tests of that explorer. Monte-Carlo checks use a stated number of standard errors.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from rlalign.cli import main
from rlalign.explore import EXPLORERS
from rlalign.explore import baseline_variance, entropy_collapse, gae_sweep, grpo_advantage, kl_divergence, kl_penalty, per_token_ratio, ppo_loss
from rlalign.explore._common import to_jsonable

torch.set_num_threads(1)

_CACHE: dict[str, object] = {}


def result_of(module):
    """compute() once per test process per explorer module."""
    if module.__name__ not in _CACHE:
        _CACHE[module.__name__] = module.compute()
    return _CACHE[module.__name__]


# ---------------------------------------------------------------- PPO loss decomposition


def test_ppo_objective_is_min_of_clipped_and_unclipped_and_flat_where_clipped():
    res = result_of(ppo_loss)
    eps, r = res.eps, res.ratio
    for a, obj, slope, clipped in zip(res.advantages, res.objective, res.slope, res.clipped):
        # hand formula: min(r A, clip(r, 0.8, 1.2) A)
        np.testing.assert_allclose(obj, np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a), rtol=0, atol=1e-12)
        flat_region = (r > 1 + eps + 1e-9) if a > 0 else (r < 1 - eps - 1e-9)
        assert flat_region.sum() > 50  # the grid reaches well into the clipped side
        assert np.all(slope[flat_region] == 0.0)  # no gradient at all where the clip is active
        np.testing.assert_allclose(slope[~flat_region & (np.abs(r - 1) != eps)], a, rtol=1e-12)  # slope A elsewhere
        np.testing.assert_array_equal(clipped > 0.5, flat_region)


# ---------------------------------------------------------------- per-token ratio


def test_per_token_ratio_follows_advantage_sign_and_clip_rule():
    res = result_of(per_token_ratio)
    a, r, eps = res.advantages, res.ratio, res.eps
    # one PG step on a position-wise softmax raises pi(o_t) exactly when A_t > 0
    np.testing.assert_array_equal(np.sign(r - 1.0), np.sign(a))
    np.testing.assert_allclose(r, res.new_prob / res.old_prob, rtol=1e-12)
    rule = ((a > 0) & (r > 1 + eps)) | ((a < 0) & (r < 1 - eps))
    np.testing.assert_array_equal(res.clip_active > 0.5, rule)
    assert rule.sum() >= 2 and (~rule).sum() >= 2  # the figure shows both kinds of token
    assert ((a > 0) & rule).any() and ((a < 0) & rule).any()  # and both sides of the clip
    np.testing.assert_allclose(res.clipped_objective, np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a), atol=1e-12)
    assert np.all(res.token_grad_norm[rule] == 0.0)  # a clipped token contributes no gradient
    assert np.all(res.token_grad_norm[~rule] > 1e-3)


def test_per_token_ratio_is_exactly_one_without_an_update():
    res = per_token_ratio.compute(lr=0.0)
    np.testing.assert_array_equal(res.ratio, np.ones_like(res.ratio))
    assert res.clip_active.sum() == 0


# ---------------------------------------------------------------- baseline variance


def test_every_baseline_is_unbiased():
    res = result_of(baseline_variance)
    se = res.mc_std / math.sqrt(res.n_batches)  # (4, C, K)
    z = np.abs(res.mc_mean - res.exact_gradient) / se
    assert z.max() < 5.0, z.max()  # 140 comparisons; a 5-SE miss would be a bias, not chance


def test_baseline_variance_matches_closed_form_and_shrinks():
    res = result_of(baseline_variance)
    constant = np.isfinite(res.exact_variance)
    # relative SE of a variance over 4000 batches is ~3%; 10% cannot be met by a wrong formula
    np.testing.assert_allclose(res.mc_variance[constant], res.exact_variance[constant], rtol=0.10)
    none, mean, best, rloo = res.mc_variance
    assert np.all(np.diff(res.exact_variance[0]) > 0)  # no baseline: variance grows with the offset
    assert np.all(res.exact_variance[2] <= res.exact_variance[1] + 1e-15)  # b* is the minimiser
    assert np.ptp(res.exact_variance[1]) < 1e-12  # centred baselines do not see the offset
    assert np.all(none[1:] > 3 * mean[1:])  # from c = 0.5 on, the baseline cuts variance >3x
    assert np.all(rloo < none[0])  # RLOO (a sample baseline) is close to the mean baseline
    assert np.all(rloo < 1.3 * mean)


# ---------------------------------------------------------------- GAE lambda sweep


def test_gae_exact_critic_is_unbiased_and_variance_grows_with_lambda():
    res = result_of(gae_sweep)
    assert res.max_abs_bias_z[0].max() < 4.5  # no (s, a) pair's bias beyond 4.5 SE, at any lambda
    assert np.all(res.bias_sq[0] < 0.01 * res.variance[0])
    assert np.all(np.diff(res.variance[0]) > 0)  # sum_l (gamma lam)^(2l) Var[delta]: increasing in lambda
    assert res.variance[0, -1] > 2.5 * res.variance[0, 0]


def test_gae_biased_critic_trade_off():
    res = result_of(gae_sweep)
    assert res.max_abs_bias_z[1, -1] < 4.5  # lambda = 1: Monte-Carlo return minus V_hat, unbiased
    assert res.bias_sq[1, 0] > 1.0  # lambda = 0 inherits gamma * E[V_hat - V](s')
    assert np.all(np.diff(res.bias_sq[1]) < 0)  # bias falls as lambda rises
    best = int(np.argmin(res.mse[1]))
    assert 0 < best < len(res.lambdas) - 1  # the MSE minimum is strictly inside (0, 1)
    # at lambda = 1, A_hat = G - V_hat(s): its spread given (s, a) does not depend on the critic
    assert res.variance[0, -1] == pytest.approx(res.variance[1, -1], rel=1e-9)


def test_gae_chain_values_solve_bellman():
    P, R, V, Q = gae_sweep.chain_mdp(8, 0.95)
    # V(s) = mean_a Q(s, a) under the uniform policy; terminal transitions pay the goal reward
    np.testing.assert_allclose(V, Q.mean(1), atol=1e-12)
    np.testing.assert_allclose(P.sum(-1), 1.0)
    assert R[7, 0] == pytest.approx(-0.1 + 2.0)  # walking from the last state reaches the goal


# ---------------------------------------------------------------- entropy collapse


def test_entropy_collapses_without_bonus_and_settles_at_gibbs_entropy_with_it():
    res = result_of(entropy_collapse)
    final = res.entropy[:, -1]
    no_bonus = res.coefs == 0
    assert final[no_bonus].item() < 0.1  # from log 6 = 1.79 nats to near 0
    assert res.expected_reward[no_bonus, -1].item() > 0.89  # on the best arm (0.9)
    np.testing.assert_allclose(final[~no_bonus], res.target_entropy[~no_bonus], atol=0.05)  # H(softmax(mu/c2))
    np.testing.assert_allclose(res.expected_reward[~no_bonus, -1], res.target_reward[~no_bonus], atol=0.01)
    assert np.all(np.diff(final) > 0.2)  # more bonus, clearly more entropy


# ---------------------------------------------------------------- GRPO advantages


def test_grpo_advantages_match_closed_forms():
    res = result_of(grpo_advantage)
    for G, p, correct, wrong in zip(res.group_sizes, res.p_hat, res.adv_correct, res.adv_wrong):
        # z-score with the unbiased std sqrt(p(1-p) G/(G-1))
        np.testing.assert_allclose(correct, np.sqrt((1 - p) / p * (G - 1) / G), rtol=1e-9)
        np.testing.assert_allclose(wrong, -np.sqrt(p / (1 - p) * (G - 1) / G), rtol=1e-9)
    G, p = res.scales_group_size, res.scale_p_hat
    n = 16 * G  # the batch of 16 identical groups
    sc = res.scale_correct
    np.testing.assert_allclose(sc['group_advantages(scale="none")'], 1 - p, rtol=1e-12)
    np.testing.assert_allclose(sc["rloo_advantages"], G / (G - 1) * (1 - p), rtol=1e-12)
    np.testing.assert_allclose(sc['group_advantages(scale="batch")'], (1 - p) / np.sqrt(p * (1 - p) * n / (n - 1)), rtol=1e-9)


def test_tied_group_fraction_is_p_to_the_G_plus_q_to_the_G():
    res = result_of(grpo_advantage)
    exact = res.tie_exact
    se = np.sqrt(exact * (1 - exact) / res.n_groups)
    assert np.all(np.abs(res.tie_fraction - exact) <= 5 * se + 1e-12)
    assert np.all(res.tie_fraction[:, [0, -1]] == 1.0)  # p = 0 or 1: every group ties


# ---------------------------------------------------------------- KL penalty trade-off


def test_k1_in_reward_ascent_reaches_the_closed_form_optimum():
    res = result_of(kl_penalty)
    assert res.tv_k1_reward.max() < 1e-3  # pi* = ref exp(r / beta) / Z at every beta


def test_k3_in_loss_optimises_forward_kl_instead():
    res = result_of(kl_penalty)
    assert res.tv_k3_loss_forward.max() < 1e-3  # lands on argmax E[r] - beta KL(ref || pi)
    assert np.all(res.tv_k3_loss[res.betas <= 0.6] > 0.05)  # which is visibly not pi*
    # pi* has the better regularised objective E[r] - beta KL(pi||ref) at every beta
    score = lambda reward, kl: reward - res.betas * kl  # noqa: E731
    best = score(res.expected_reward["k1 in reward"], res.kl["k1 in reward"])
    assert np.all(best >= score(res.expected_reward["k3 in loss"], res.kl["k3 in loss"]) - 1e-9)


# ---------------------------------------------------------------- KL divergence


def test_forward_kl_fit_matches_moments_and_reverse_fit_seeks_a_mode():
    res = result_of(kl_divergence)
    np.testing.assert_allclose(res.q_forward_moments, res.p_moments, atol=1e-3)  # E[x], E[x^2]
    mu, sigma = res.reverse_params
    assert abs(mu - 2.5) < 0.05 and abs(sigma - 0.7) < 0.03
    assert res.reverse_kl_values[1] == pytest.approx(math.log(2), abs=0.01)  # half of p's mass is missed
    assert res.forward_kl_values[0] < res.forward_kl_values[1]  # each fit wins its own divergence
    assert res.reverse_kl_values[1] < res.reverse_kl_values[0]


def test_kl_fits_hold_at_the_far_end_of_the_page_sliders():
    # modes at +-4 of width 0.3, the page's 120 Adam steps at lr 0.15. On a grid ending at +-6 the forward fit had no
    # optimum (E_p[x^2] = 16.09 > 12.2, the grid's uniform second moment: sigma ran off to 11.6, E_q[x^2] = 11.8) and the
    # reverse fit stalled on a flat q with KL(q||p) = 20.2 nats, both drawn as the "argmin"
    res = kl_divergence.compute(mode_distance=4.0, mode_sigma=0.3, n_fit_steps=120, lr=0.15, n_samples=500)
    assert abs(res.q_forward_moments[0]) < 0.1 and res.q_forward_moments[1] == pytest.approx(res.p_moments[1], rel=0.03)
    assert res.reverse_kl_values[1] == pytest.approx(math.log(2), abs=0.01)  # on one mode, missing the other's half
    assert abs(res.reverse_params[0]) == pytest.approx(4.0, abs=0.05) and res.reverse_params[1] == pytest.approx(0.3, abs=0.02)


def test_kl_estimators_bias_and_spread():
    res = result_of(kl_divergence)
    kl = res.true_kl
    for name in ("k1", "k3"):  # unbiased, exactly
        # exact expectations in float64 against core.categorical_kl in float64
        np.testing.assert_allclose(res.estimator_mean[name], kl, rtol=1e-9)
    for name in ("k1", "k2", "k3"):  # sampled means agree with the exact ones
        z = np.abs(res.mc_mean[name] - res.estimator_mean[name]) / res.mc_se[name]
        assert z.max() < 4.5, (name, z.max())
    k2_rel_bias = (res.estimator_mean["k2"] - kl) / kl
    assert abs(k2_rel_bias[0]) < 0.02 and abs(k2_rel_bias[-1]) > 0.1  # second-order exact, then biased
    rel_std = {k: res.estimator_std[k] / kl for k in ("k1", "k3")}
    assert rel_std["k1"][0] > 10 and rel_std["k3"][0] < 3  # near KL = 0, k1 is noise, k3 is not


# ---------------------------------------------------------------- the CLI


@pytest.mark.parametrize("name", list(EXPLORERS))
def test_cli_writes_png_and_data(name, tmp_path, capsys):
    assert main(["explore", name, "--out", str(tmp_path)]) == 0
    png, data = tmp_path / f"{name}.png", tmp_path / f"{name}.json"
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 20_000  # a real, non-trivial figure
    numbers = json.loads(data.read_text())
    assert numbers and all(v is not None for v in numbers.values())
    module = EXPLORERS[name].load()
    if module.__name__ in _CACHE:  # deterministic: the file holds exactly what compute() returns
        assert numbers == json.loads(json.dumps(to_jsonable(_CACHE[module.__name__])))
    assert name in capsys.readouterr().out


def test_cli_list_and_errors(tmp_path, capsys):
    assert main(["explore", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPLORERS) and len(listed.splitlines()) == len(EXPLORERS)
    assert main(["explore", "no-such-explorer", "--out", str(tmp_path)]) == 2
    assert "unknown explorer" in capsys.readouterr().err
    assert main(["explore", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


# each explorer's compute() called directly with one bad argument: (explorer, keyword, value, what the message says it must be)
BAD_ARGUMENTS = [
    ("gae-lambda-sweep", "gamma", 1.5, "a number in [0, 1]"), ("gae-lambda-sweep", "lambdas", (0.5, 1.2), "numbers in [0, 1]"),
    ("gae-lambda-sweep", "n_states", 0, "a whole number >= 1"), ("gae-lambda-sweep", "seed", -1, "a whole number >= 0"),
    ("baseline-variance", "batch_size", 1, "a whole number >= 2"), ("baseline-variance", "sigma", -1.0, "a number >= 0"),
    ("baseline-variance", "n_batches", 2.5, "a whole number >= 2"), ("entropy-collapse", "lr", 0.0, "a number > 0"),
    ("entropy-collapse", "coefs", (), "a non-empty sequence"), ("grpo-advantage", "group_sizes", (1, 4), "whole numbers >= 2"),
    ("kl-penalty-tradeoff", "betas", (0.0,), "numbers > 0"), ("kl-divergence", "start", (1.0,), "two finite numbers"),
    ("kl-divergence", "mode_sigma", math.nan, "a number > 0"), ("maze-values", "gamma", 1.5, "a number in [0, 1]"),
    ("maze-values", "sweeps", 0, "a whole number >= 1"), ("ppo-loss-decomposition", "n_points", True, "a whole number >= 2"),
    ("ppo-surrogates", "n_actions", 1, "a whole number >= 2"), ("per-token-ratio", "eps", 0, "a number in (0, 1]"),
]


@pytest.mark.parametrize(("name", "keyword", "value", "must"), BAD_ARGUMENTS)
def test_compute_called_directly_names_a_bad_argument_and_what_it_must_be(name, keyword, value, must):
    # before, gamma=1.5 returned a meaningless sweep and batch_size=1 failed deep in torch
    from rlalign.explore.params import ParamError

    with pytest.raises(ParamError, match=rf"^{name}: {keyword}=.* must be .*{re.escape(must)}"):
        EXPLORERS[name].load().compute(**{keyword: value})


def test_every_explorer_accepts_its_own_defaults_and_page_ranges(monkeypatch):
    # the checks must not refuse what the page offers: each declared parameter at both ends of its range
    from rlalign.explore.params import keywords, require

    def checks_only(where, **checks):
        require(where, **checks)  # raises ParamError on a refused value, which fails the test
        raise _Checked  # nothing computed

    for explorer in EXPLORERS.values():
        module = explorer.load()
        monkeypatch.setattr(module, "require", checks_only)
        for param in (p for p in explorer.params if p.stage == "compute"):
            for value in ((param.low, param.high) if param.kind != "choice" else param.choices):
                values = {p.name: p.default for p in explorer.params}
                values[param.name] = int(value) if param.kind == "int" else value
                with pytest.raises(_Checked):
                    module.compute(**keywords(explorer.params, values, "compute"))


class _Checked(Exception):
    pass
