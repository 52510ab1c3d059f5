import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.core.masks import masked_mean, masked_sum, masked_var, masked_whiten, whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
M = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_and_mean_ignore_padding():
    # counted: 1 + 2 + 3 + 4 = 10 over 4 positions
    assert masked_sum(X, M).item() == 10.0
    assert masked_mean(X, M).item() == 2.5
    # per row: (1+2+3)/3 = 2, 4/1 = 4
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([2.0, 4.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0
    # also when the positions it leaves out hold inf or NaN (log-probs of padding): 0 * inf would be NaN
    bad = torch.tensor([[float("-inf"), float("nan")], [1.0, 2.0]])
    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    torch.testing.assert_close(masked_mean(bad, mask, dim=-1), torch.tensor([0.0, 1.0]))


def test_masked_var_hand_values():
    # values 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    assert masked_var(X, M).item() == pytest.approx(5.0 / 3.0, rel=1e-7)
    assert masked_var(X, M, unbiased=False).item() == 5.0 / 4.0
    assert masked_var(torch.tensor([7.0]), None).item() == 0.0  # one value: unbiased var defined as 0


def test_masked_whiten_hand_values():
    # (x - 2.5) / sqrt(5/3): x = 1 -> -1.5 / 1.2910 = -1.161895
    out = masked_whiten(X, M, eps=0.0)
    torch.testing.assert_close(out[0, 0], torch.tensor(-1.5 / (5.0 / 3.0) ** 0.5))
    assert out[1, 1].item() == 0.0 and out[1, 2].item() == 0.0  # padding comes back as 0
    kept = masked_whiten(X, M, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept[0, 0], torch.tensor(-1.5 / (5.0 / 3.0) ** 0.5 + 2.5))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=3, max_size=40), st.integers(0, 2**31 - 1))
def test_whitened_values_have_mean_zero_and_unit_std(values, seed):
    x = torch.tensor(values, dtype=torch.float64)
    mask = (torch.rand(len(values), generator=torch.Generator().manual_seed(seed)) < 0.7).to(torch.float64)
    mask[:2] = 1.0
    if masked_var(x, mask) < 1e-6:
        return
    w = masked_whiten(x, mask, eps=0.0)
    assert abs(masked_mean(w, mask).item()) < 1e-9
    assert abs(masked_var(w, mask).item() - 1.0) < 1e-9


def test_fractional_weights_give_the_weighted_mean():
    # weights 0.2 and 0.3 (sum 0.5 < 1): (0.2*1 + 0.3*3) / 0.5 = 2.2
    assert masked_mean(torch.tensor([1.0, 3.0]), torch.tensor([0.2, 0.3])).item() == pytest.approx(2.2)


def test_masked_mean_of_an_empty_row_is_zero_with_a_zero_gradient():
    # row 1 has no counted position: its mean is 0 and its gradient 0, never NaN (no 0 / 0 in
    # either branch of the where: autograd would carry 0 x inf = NaN back from the unused one)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    means = masked_mean(x, mask, dim=-1)
    torch.testing.assert_close(means, torch.tensor([1.5, 0.0]))
    means.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.5, 0.5], [0.0, 0.0]]))


def test_whiten_with_given_statistics_centres_by_default():
    # (x - mean) / sqrt(var + eps), 0 on padding; shift_mean=False adds the mean back (only the scale changes)
    x = torch.tensor([1.0, 3.0, 9.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    mean, var = torch.tensor(2.0), torch.tensor(4.0)
    torch.testing.assert_close(whiten(x, mean, var, mask), torch.tensor([-0.5, 0.5, 0.0]))
    torch.testing.assert_close(whiten(x, mean, var, mask, shift_mean=False), torch.tensor([1.5, 2.5, 0.0]))


def test_a_broadcast_mask_counts_every_position_it_covers():
    # mask (2, 1) over x (2, 3): row 0 counts all three values, row 1 none -> mean (1 + 2 + 3) / 3 = 2, not 6 / 1
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    mask = torch.tensor([[1.0], [0.0]])
    assert masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, mask, dim=-1).tolist() == [2.0, 0.0]
