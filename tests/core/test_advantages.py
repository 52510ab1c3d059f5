import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.core.advantages import (
    gae,
    group_advantages,
    tied_groups,
    kl_shaped_rewards,
    last_token_index,
    reinforce_plus_plus_advantages,
    reward_to_go,
    rloo_advantages,
    sampled_token_gae,
    td_residuals,
    token_gae,
    total_returns,
)


def col(*values):
    """A (T, 1) time-major column."""
    return torch.tensor(values, dtype=torch.float64)[:, None]


def test_reward_to_go_hand_values():
    # gamma = 0.5, episode ends after step 1, bootstrap 10 after the last (unfinished) step:
    # G3 = 4 + 0.5*10 = 9;  G2 = 3 + 0.5*9 = 7.5;  G1 = 2 (end);  G0 = 1 + 0.5*2 = 2
    rewards, ends = col(1, 2, 3, 4), col(0, 1, 0, 0)
    out = reward_to_go(rewards, ends, 0.5, bootstrap=torch.tensor([10.0], dtype=torch.float64))
    torch.testing.assert_close(out, col(2, 2, 7.5, 9))


def test_total_returns_gives_each_step_its_episode_return():
    # episode 1 = steps 0-1: 1 + 0.5*2 = 2; episode 2 = steps 2-3 (no bootstrap): 3 + 0.5*4 = 5
    out = total_returns(col(1, 2, 3, 4), col(0, 1, 0, 1), 0.5)
    torch.testing.assert_close(out, col(2, 2, 5, 5))


def test_total_returns_when_the_first_step_ends_an_episode():
    # episode 1 = step 0 alone: 1; episode 2 = steps 1-2: 2 + 3 = 5 (gamma 1)
    out = total_returns(col(1, 2, 3), col(1, 0, 1), 1.0)
    torch.testing.assert_close(out, col(1, 5, 5))


def test_td_residuals_hand_values():
    # delta0 = 1 + 0.9*2 - 0.5 = 2.3 ;  delta1 = 1 + 0 (terminated) - 0.5 = 0.5
    out = td_residuals(col(1, 1), col(0.5, 0.5), col(2, 7), col(0, 1), 0.9)
    torch.testing.assert_close(out, col(2.3, 0.5))


def gae_reference(rewards, values, next_values, terminated, ends, gamma, lam):
    """The definition, A_t = sum_l (gamma*lam)^l delta_{t+l} up to the episode end, as a plain loop."""
    T, N = rewards.shape
    out = torch.zeros_like(rewards)
    for n in range(N):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                delta = rewards[k, n] + gamma * (1 - terminated[k, n]) * next_values[k, n] - values[k, n]
                total += weight * delta
                if ends[k, n]:
                    break
                weight *= gamma * lam
            out[t, n] = total
    return out


def random_rollout(seed, T=12, N=3):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, generator=g, dtype=torch.float64)
    values = torch.randn(T, N, generator=g, dtype=torch.float64)
    next_values = torch.randn(T, N, generator=g, dtype=torch.float64)
    ends = (torch.rand(T, N, generator=g) < 0.25).to(torch.float64)
    truncated = ends * (torch.rand(T, N, generator=g) < 0.5).to(torch.float64)
    terminated = ends - truncated
    return rewards, values, next_values, terminated, ends


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.5, 0.7)])
def test_gae_equals_the_definition_with_terminations_and_truncations(seed, gamma, lam):
    r, v, nv, term, ends = random_rollout(seed)
    adv, ret = gae(r, v, nv, term, ends, gamma, lam)
    torch.testing.assert_close(adv, gae_reference(r, v, nv, term, ends, gamma, lam))
    torch.testing.assert_close(ret, adv + v)


def test_gae_lambda_zero_is_the_td_residual():
    r, v, nv, term, ends = random_rollout(7)
    adv, _ = gae(r, v, nv, term, ends, 0.97, 0.0)
    torch.testing.assert_close(adv, td_residuals(r, v, nv, term, 0.97))


def test_gae_lambda_one_is_monte_carlo_return_minus_value():
    # every episode terminates (no truncation), so the bootstrap never enters; within an episode
    # V(s_{t+1}) is the next row's value, so the TD residuals telescope
    r, v, _, _, ends = random_rollout(3)
    ends[-1] = 1.0
    nv = torch.cat([v[1:], torch.zeros_like(v[:1])])
    adv, _ = gae(r, v, nv, ends, ends, 0.95, 1.0)
    torch.testing.assert_close(adv, reward_to_go(r, ends, 0.95) - v)


@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("lam", [1.0, 0.9])
def test_gae_closed_form_single_terminal_reward(gamma, lam):
    # r = (0, ..., 0, R), terminal at T-1. With n = T-1-t:
    # A_t = (gamma*lam)^n R - V_t + (1 - lam) * sum_{k=1..n} gamma^k lam^(k-1) V_{t+k}
    T, R = 6, 3.0
    values = torch.tensor([0.2, -0.4, 1.1, 0.3, 0.9, -0.7], dtype=torch.float64)
    rewards = torch.zeros(T, dtype=torch.float64)
    rewards[-1] = R
    ends = torch.zeros(T, dtype=torch.float64)
    ends[-1] = 1
    next_values = torch.cat([values[1:], torch.zeros(1, dtype=torch.float64)])
    adv, _ = gae(rewards[:, None], values[:, None], next_values[:, None], ends[:, None], ends[:, None], gamma, lam)
    for t in range(T):
        n = T - 1 - t
        expected = (gamma * lam) ** n * R - values[t].item()
        expected += (1 - lam) * sum(gamma**k * lam ** (k - 1) * values[t + k].item() for k in range(1, n + 1))
        assert adv[t, 0].item() == pytest.approx(expected, abs=1e-12)


def test_token_gae_hand_example():
    # gamma = 1, lam = 0.5, score 1 on the last valid token (index 2), padding at index 3:
    # delta2 = 1 - 0.7 = 0.3;  delta1 = 0 + 0.7 - 0.6 = 0.1;  delta0 = 0.6 - 0.5 = 0.1
    # A2 = 0.3;  A1 = 0.1 + 0.5*0.3 = 0.25;  A0 = 0.1 + 0.5*0.25 = 0.225
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = token_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.725, 0.85, 1.0, 0.0]], dtype=torch.float64))
    # lam = 1: A_t = 1 - V_t on valid tokens
    adv1, _ = token_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv1, torch.tensor([[0.5, 0.4, 0.3, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("tool_value", [0.0, 5.0, -5.0])
def test_sampled_token_gae_skips_the_environments_tokens_by_hand(tool_value):
    # completion: 2 model tokens, 3 tool tokens, 2 model tokens (the last ends it), score 1 there; gamma = 1, lam = 0.5.
    # The decisions s1..s4 at positions 0, 1, 5, 6 with V = 0.1, 0.2, 0.6, 0.8; the tool positions are not time steps:
    #   delta4 = 1 - 0.8 = 0.2;  delta3 = 0 + 0.8 - 0.6 = 0.2;  delta2 = 0 + 0.6 - 0.2 = 0.4 (s2 -> s3 across the tool reply);
    #   delta1 = 0 + 0.2 - 0.1 = 0.1
    #   A4 = 0.2;  A3 = 0.2 + 0.5*0.2 = 0.3;  A2 = 0.4 + 0.5*0.3 = 0.55;  A1 = 0.1 + 0.5*0.55 = 0.375;  R = A + V = [0.475, 0.75, 0.9, 1.0]
    # whatever V is at the tool positions (the critic is never trained there); 0 at the tool positions and the padding
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 0, 1, 0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, tool_value, tool_value, tool_value, 0.6, 0.8, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 1, 0]])
    sampled = torch.tensor([[1.0, 1, 0, 0, 0, 1, 1, 0]])
    adv, ret = sampled_token_gae(rewards, values, mask, sampled, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.375, 0.55, 0, 0, 0, 0.3, 0.2, 0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.475, 0.75, 0, 0, 0, 0.9, 1.0, 0]], dtype=torch.float64))


def test_sampled_token_gae_gives_a_reward_on_an_environment_token_to_the_choice_before_it():
    # decisions at 0 and 2, environment tokens at 1 and 3 carrying rewards 0.5 and 2 (e.g. the score on a trailing tool
    # token); gamma = 0.5, lam = 1, V = 0.4, 0.2 at the decisions:  r' = [0 + 0.5, 0 + 2] = [0.5, 2]
    #   delta2 = 2 - 0.2 = 1.8;  delta1 = 0.5 + 0.5*0.2 - 0.4 = 0.2;  A2 = 1.8;  A1 = 0.2 + 0.5*1.8 = 1.1
    # Row 2: an environment token before the first decision (its reward 3 follows no choice: dropped), one decision (V 0.4)
    # with an environment token after it (reward 0.5), then padding (its 9 ignored): A = 0.5 - 0.4 = 0.1
    rewards = torch.tensor([[0.0, 0.5, 0.0, 2.0], [3.0, 0.0, 0.5, 9.0]], dtype=torch.float64)
    values = torch.tensor([[0.4, 7.0, 0.2, -7.0], [5.0, 0.4, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    adv, _ = sampled_token_gae(rewards, values, mask, torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 0]]), gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.1, 0, 1.8, 0], [0, 0.1, 0, 0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", range(4))
def test_sampled_token_gae_is_token_gae_with_the_other_tokens_deleted(seed):
    # each row's sampled positions picked out by a plain loop (rewards on the other tokens added to the decision before
    # them), token_gae on that row alone, and put back; rows whose tokens are all sampled (single-turn) are bit-identical
    g = torch.Generator().manual_seed(seed)
    B, C = 6, 9
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    mask = (torch.arange(C) < lengths[:, None]).double()  # (B, C)
    sampled = mask * (torch.rand(B, C, generator=g) < 0.6).double()
    sampled[:, 0] = 1.0  # a completion starts with the policy's token
    sampled[:2] = mask[:2]  # rows 0 and 1: single-turn
    rewards, values = torch.randn(B, C, generator=g, dtype=torch.float64) * mask, torch.randn(B, C, generator=g, dtype=torch.float64)
    adv, ret = sampled_token_gae(rewards, values, mask, sampled, gamma=0.9, lam=0.8)
    for b in range(B):
        keep = sampled[b].nonzero().flatten().tolist()
        folded = [sum(rewards[b, t].item() for t in range(k, (keep + [C])[i + 1])) for i, k in enumerate(keep)]
        a, r = token_gae(torch.tensor([folded], dtype=torch.float64), values[b, keep][None], torch.ones(1, len(keep)), 0.9, 0.8)
        expected_a, expected_r = torch.zeros(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
        expected_a[keep], expected_r[keep] = a[0], r[0]
        torch.testing.assert_close(adv[b], expected_a, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[b], expected_r, rtol=0, atol=1e-12)
    single_adv, single_ret = token_gae(rewards[:2], values[:2], mask[:2], 0.9, 0.8)
    assert torch.equal(adv[:2], single_adv) and torch.equal(ret[:2], single_ret)


def test_token_gae_equals_env_gae_per_sequence():
    g = torch.Generator().manual_seed(0)
    B, C = 5, 9
    lengths = torch.tensor([9, 1, 4, 6, 2])
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    rewards = torch.randn(B, C, generator=g, dtype=torch.float64)
    values = torch.randn(B, C, generator=g, dtype=torch.float64)
    adv, _ = token_gae(rewards, values, mask, gamma=0.97, lam=0.9)
    for b in range(B):
        n = lengths[b].item()
        r, v = rewards[b, :n, None], values[b, :n, None]
        nv = torch.cat([v[1:], torch.zeros(1, 1, dtype=torch.float64)])
        end = torch.zeros(n, 1, dtype=torch.float64)
        end[-1] = 1
        expected, _ = gae(r, v, nv, end, end, 0.97, 0.9)
        torch.testing.assert_close(adv[b, :n], expected[:, 0])
        assert (adv[b, n:] == 0).all()


def test_kl_shaped_rewards_hand_example():
    # beta = 0.5: r_t = -0.5*KL_t, plus the score on the last valid token
    # row 0 (2 tokens): [-0.05, -0.1 + 2, 0];  row 1 (3 tokens): [-0.2, -0.25, -0.3 + 5]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = kl_shaped_rewards(torch.tensor([2.0, 5.0]), kl, mask, beta=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.9, 0.0], [-0.2, -0.25, 4.7]], dtype=torch.float64))
    assert last_token_index(mask).tolist() == [1, 2]


def test_group_advantages_hand_values_and_ties():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    # group 1: mean 2, unbiased std sqrt((1 + 0 + 1)/2) = 1 -> (-1, 0, 1); group 2 ties -> 0
    torch.testing.assert_close(group_advantages(scores, 3, "group"), torch.tensor([-1.0, 0, 1, 0, 0, 0]))
    torch.testing.assert_close(group_advantages(scores, 3, "none"), torch.tensor([-1.0, 0, 1, 0, 0, 0]))
    # batch std: mean 3.5, squared deviations 6.25+2.25+0.25+3*2.25 = 15.5, /5 = 3.1
    expected = torch.tensor([-1.0, 0, 1, 0, 0, 0]) / math.sqrt(3.1)
    torch.testing.assert_close(group_advantages(scores, 3, "batch"), expected)
    assert not group_advantages(torch.full((8,), 0.1), 4).isnan().any()


def test_rloo_hand_values():
    # A_i = r_i - mean of the others: 1 - 2.5, 2 - 2, 3 - 1.5
    torch.testing.assert_close(rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), 3), torch.tensor([-1.5, 0.0, 1.5]))
    assert (rloo_advantages(torch.tensor([4.0, 4.0]), 2) == 0).all()


def test_group_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.arange(4.0), 2, "bogus")


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_group_advantages_have_mean_zero_std_one_per_group(group_size, n_groups, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (group_size * n_groups,), generator=g).to(torch.float64)
    adv = group_advantages(scores, group_size).view(n_groups, group_size)
    grouped = scores.view(n_groups, group_size)
    for row, raw in zip(adv, grouped):
        if raw.std() == 0:
            assert (row == 0).all()
        else:
            assert abs(row.mean().item()) < 1e-12
            assert abs(row.std().item() - 1.0) < 1e-12


def test_rloo_gives_a_tied_group_exactly_zero():
    # r_i - mean of the other G - 1 is 0 in exact arithmetic for a tie, but not in float32: three
    # rewards of 0.1 give (0.3 - 0.1) / 2 - 0.1 = -7.5e-9. A tied group carries no signal: exactly 0.
    scores = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 2.0])
    advantages = rloo_advantages(scores, group_size=3)
    assert (advantages[:3] == 0).all()
    torch.testing.assert_close(advantages[3:], torch.tensor([-1.5, 0.0, 1.5]))  # 0 - 1.5, 1 - 1, 2 - 0.5


def test_reinforce_plus_plus_normalises_over_the_batch_without_a_group_baseline():
    # R = [3, 1, 0, 0]: batch mean 1, centred [2, 0, -1, -1], unbiased var (4 + 0 + 1 + 1) / 3 = 2
    # -> A = [2, 0, -1, -1] / sqrt(2); the tied group (0, 0) keeps a negative advantage (no group baseline)
    scores = torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    root2 = math.sqrt(2.0)
    expected = torch.tensor([2 / root2, 0.0, -1 / root2, -1 / root2], dtype=torch.float64)
    torch.testing.assert_close(reinforce_plus_plus_advantages(scores, 2), expected)


def test_reinforce_plus_plus_baseline_centres_each_group_then_divides_by_the_batch_std():
    # group means [2, 0]: centred [1, -1, 0, 0], unbiased std sqrt(2 / 3) -> A = [1, -1, 0, 0] * sqrt(3 / 2)
    # GRPO's "batch" scale divides the same centred rewards by std of the raw R (sqrt 2), not of the centred ones
    scores = torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    s = math.sqrt(1.5)
    torch.testing.assert_close(reinforce_plus_plus_advantages(scores, 2, baseline=True), torch.tensor([s, -s, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(group_advantages(scores, 2, "batch"), torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64) / math.sqrt(2.0))


def test_reinforce_plus_plus_on_a_tied_batch_is_zero_and_shapes_are_checked():
    assert (reinforce_plus_plus_advantages(torch.full((4,), 0.7), 2) == 0).all()
    assert (reinforce_plus_plus_advantages(torch.tensor([1.0, 1.0, 3.0, 3.0]), 2, baseline=True) == 0).all()  # every group tied
    torch.testing.assert_close(reinforce_plus_plus_advantages(torch.tensor([0, 2]), 2), torch.tensor([-1.0, 1.0]) / math.sqrt(2.0))  # ints
    with pytest.raises(ValueError, match="1-D"):
        reinforce_plus_plus_advantages(torch.ones(2, 2), 2)
    with pytest.raises(ValueError, match="divisible"):
        reinforce_plus_plus_advantages(torch.ones(5), 2, baseline=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 5), st.booleans(), st.integers(0, 2**31 - 1))
def test_reinforce_plus_plus_has_batch_mean_zero_and_std_one(group_size, n_groups, baseline, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (group_size * n_groups,), generator=g).to(torch.float64)
    adv = reinforce_plus_plus_advantages(scores, group_size, baseline=baseline)
    if (adv == 0).all():
        return  # a tied batch (or, with the baseline, every group tied)
    assert abs(adv.mean().item()) < 1e-12 and abs(adv.std().item() - 1.0) < 1e-12


# ----------------------------------------------------------------------------------------------
# Completions whose reward could not be computed: left out of every mean and std, advantage 0
# ----------------------------------------------------------------------------------------------

MASKED_SCORES = torch.tensor([1.0, 2.0, 3.0, 10.0, 4.0, 4.0, 6.0, 0.0])  # G = 4; 10, 6 and 0 unscored
MASKED_VALID = torch.tensor([True, True, True, False, True, True, False, False])


def test_group_advantages_over_the_valid_completions_by_hand():
    # group 0's valid [1, 2, 3]: mean 2, unbiased std 1; group 1's valid [4, 4] tie: 0
    torch.testing.assert_close(group_advantages(MASKED_SCORES, 4, "group", valid=MASKED_VALID), torch.tensor([-1.0, 0, 1, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(group_advantages(MASKED_SCORES, 4, "none", valid=MASKED_VALID), torch.tensor([-1.0, 0, 1, 0, 0, 0, 0, 0]))
    # batch: / std of the valid scores [1, 2, 3, 4, 4] = sqrt(6.8 / 4)
    batch_std = math.sqrt(6.8 / 4)
    torch.testing.assert_close(group_advantages(MASKED_SCORES, 4, "batch", valid=MASKED_VALID),
                               torch.tensor([-1 / batch_std, 0, 1 / batch_std, 0, 0, 0, 0, 0]))
    # one valid completion in a group: nothing to compare it with
    one = torch.tensor([True, False, False, False, True, True, True, True])
    assert group_advantages(MASKED_SCORES, 4, "group", valid=one)[:4].tolist() == [0.0] * 4


def test_rloo_and_reinforce_plus_plus_over_the_valid_completions_by_hand():
    # RLOO, group 0: 1 - (2 + 3) / 2 = -1.5, 2 - (1 + 3) / 2 = 0, 3 - (1 + 2) / 2 = 1.5; group 1 ties
    torch.testing.assert_close(rloo_advantages(MASKED_SCORES, 4, valid=MASKED_VALID), torch.tensor([-1.5, 0, 1.5, 0, 0, 0, 0, 0]))
    # REINFORCE++: valid [1, 2, 3, 4, 4], mean 2.8, std sqrt(6.8 / 4)
    std = math.sqrt(6.8 / 4)
    expected = torch.tensor([-1.8, -0.8, 0.2, 0, 1.2, 1.2, 0, 0]) / std
    torch.testing.assert_close(reinforce_plus_plus_advantages(MASKED_SCORES, 4, valid=MASKED_VALID), expected)
    # REINFORCE++-baseline: R - its group's valid mean = [-1, 0, 1, ., 0, 0, ., .], over their std sqrt(2 / 4)
    torch.testing.assert_close(reinforce_plus_plus_advantages(MASKED_SCORES, 4, baseline=True, valid=MASKED_VALID),
                               torch.tensor([-1.0, 0, 1, 0, 0, 0, 0, 0]) / math.sqrt(0.5))


@pytest.mark.parametrize("estimator", ["group", "batch", "none", "rloo", "rpp", "rpp-baseline"])
def test_every_completion_valid_is_the_unmasked_estimator(estimator):
    scores = torch.randn(12, generator=torch.Generator().manual_seed(5))
    fn = {"group": lambda **k: group_advantages(scores, 4, "group", **k), "batch": lambda **k: group_advantages(scores, 4, "batch", **k),
          "none": lambda **k: group_advantages(scores, 4, "none", **k), "rloo": lambda **k: rloo_advantages(scores, 4, **k),
          "rpp": lambda **k: reinforce_plus_plus_advantages(scores, 4, **k),
          "rpp-baseline": lambda **k: reinforce_plus_plus_advantages(scores, 4, baseline=True, **k)}[estimator]
    torch.testing.assert_close(fn(valid=torch.ones(12, dtype=torch.bool)), fn(), rtol=1e-5, atol=1e-6)


def test_tied_groups_are_judged_on_the_completions_that_count():
    # [0, 1, 1, 1] looks informative, but its 0 is a completion no reward could score: over the rest, 1, 1, 1 tie (DAPO's
    # dynamic sampling kept such a group, which carries no gradient); a group with one countable completion ties too
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 5.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([False, True, True, True, True, True, True, True, True, False, False, False])
    assert tied_groups(scores, 4).tolist() == [False, False, False]
    assert tied_groups(scores, 4, valid).tolist() == [True, False, True]
    assert group_advantages(scores, 4, valid=valid)[[0, 1, 2, 3, 8]].tolist() == [0.0] * 5  # the groups it calls tied get 0
    assert tied_groups(torch.tensor([2.0, 2.0 + 1e-7, 3.0, 3.0]), 2).tolist() == [True, True]
    # no valid completion (a prompt no reward could score at all) ties; two valid ones that differ do not; eps 0: exact ties only
    none_valid = tied_groups(torch.tensor([1.0, 2.0, 1.0, 2.0, 3.0, 5.0]), 3, torch.tensor([False, False, False, True, True, False]))
    assert none_valid.tolist() == [True, False]
    assert group_advantages(torch.tensor([1.0, 2.0, 1.0, 2.0]), 2, valid=torch.tensor([False, False, True, True])).tolist() == [0, 0, -0.7071067690849304, 0.7071067690849304]
    assert tied_groups(torch.tensor([4.0, 4.0, 4.0, 4.5]), 2, eps=0.0).tolist() == [True, False]
    ties = group_advantages(torch.tensor([4.0, 4.0, 4.0, 4.5]), 2, eps=0.0, valid=torch.ones(4, dtype=torch.bool))  # 0, not 0 / 0
    assert ties.tolist() == [0.0, 0.0, -0.7071067690849304, 0.7071067690849304]
