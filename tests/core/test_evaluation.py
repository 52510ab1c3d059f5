"""pass@k against hand-derived values and against its definition by enumeration."""

from __future__ import annotations

import itertools
from math import comb

import pytest
import torch

from rlalign.core.evaluation import pass_at_k


def test_pass_at_k_hand_values():
    # n = 4 samples of 2 prompts; prompt 0 has c = 1 pass, prompt 1 has c = 2:
    #   pass@1 = c / n:                    (1/4 + 2/4) / 2 = 0.375
    #   pass@2 = 1 - C(n-c, 2) / C(4, 2):  (1 - 3/6 + 1 - 1/6) / 2 = (0.5 + 5/6) / 2 = 2/3
    #   pass@4: any pass among all four:   (1 + 1) / 2 = 1
    passed = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 1]])
    assert pass_at_k(passed, 1).item() == pytest.approx(0.375)
    assert pass_at_k(passed, 2).item() == pytest.approx(2 / 3)
    assert pass_at_k(passed, 4).item() == pytest.approx(1.0)
    assert pass_at_k(torch.zeros(3, 5, dtype=torch.bool), 3).item() == 0.0


@pytest.mark.parametrize("n, c, k", [(5, 2, 3), (6, 1, 2), (6, 4, 3), (4, 4, 1)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n, c, k):
    # the definition: draw k of the n samples without replacement; pass when one of them passed
    row = torch.tensor([1] * c + [0] * (n - c))
    subsets = list(itertools.combinations(range(n), k))
    share = sum(any(row[i] for i in s) for s in subsets) / len(subsets)
    assert share == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    assert pass_at_k(row[None], k).item() == pytest.approx(share)


def test_pass_at_k_needs_k_within_the_samples():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(torch.ones(2, 3), 4)
