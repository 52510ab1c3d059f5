"""Entropy, cross-entropy and KL in bits (seed 002, section 5.2) against values computed by hand."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from rlalign.core import cross_entropy_bits, entropy_bits, kl_bits, surprisal_bits
from rlalign.core.kl import categorical_kl

LOG2_3 = math.log2(3.0)  # 1.5849625007211562


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_surprisal_by_hand():
    # -log2 1 = 0 (a certain event costs nothing), -log2 1/2 = 1, -log2 1/8 = 3, -log2 0 = inf
    torch.testing.assert_close(surprisal_bits(t(1.0, 0.5, 0.125)), t(0.0, 1.0, 3.0), rtol=0, atol=0)
    assert surprisal_bits(t(0.0)).item() == math.inf


def test_entropy_by_hand():
    # fair coin: 2 * (1/2 * 1) = 1 bit;  uniform over 8: 8 * (1/8 * 3) = 3 bits
    assert entropy_bits(t(0.5, 0.5)).item() == pytest.approx(1.0, abs=1e-15)
    assert entropy_bits(torch.full((8,), 1 / 8, dtype=torch.float64)).item() == pytest.approx(3.0, abs=1e-15)
    # (1/2, 1/4, 1/4): 1/2 * 1 + 2 * (1/4 * 2) = 1.5 bits
    assert entropy_bits(t(0.5, 0.25, 0.25)).item() == pytest.approx(1.5, abs=1e-15)
    # a certain outcome: 1 * log2 1 = 0, and the 0 log 0 terms are 0 (not nan)
    assert entropy_bits(t(1.0, 0.0, 0.0)).item() == 0.0
    # a biased coin (1/4, 3/4): 1/4 * 2 + 3/4 * (2 - log2 3) = 2 - 3/4 log2 3 = 0.811278
    assert entropy_bits(t(0.25, 0.75)).item() == pytest.approx(2 - 0.75 * LOG2_3, abs=1e-15)
    assert entropy_bits(t(0.25, 0.75)).item() == pytest.approx(0.8112781245, abs=1e-10)


def test_cross_entropy_and_kl_by_hand():
    # p = (1/2, 1/2) coded for q = (1/4, 3/4): code lengths 2 and log2(4/3) = 2 - log2 3 bits,
    # H(p, q) = 1/2 * 2 + 1/2 * (2 - log2 3) = 2 - 1/2 log2 3 = 1.207519;  H(p) = 1,
    # so KL(p || q) = 1 - 1/2 log2 3 = 0.207519 bits (= 0.143841 nats / ln 2, the value of test_kl)
    p, q = t(0.5, 0.5), t(0.25, 0.75)
    assert cross_entropy_bits(p, q).item() == pytest.approx(2 - 0.5 * LOG2_3, abs=1e-15)
    assert kl_bits(p, q).item() == pytest.approx(1 - 0.5 * LOG2_3, abs=1e-15)
    assert kl_bits(p, q).item() == pytest.approx(0.1438410 / math.log(2), abs=1e-6)
    # the other way round: H(q, p) = 1/4 * 1 + 3/4 * 1 = 1 bit, KL(q || p) = 1 - H(q) = 3/4 log2 3 - 1 = 0.188722
    assert cross_entropy_bits(q, p).item() == pytest.approx(1.0, abs=1e-15)
    assert kl_bits(q, p).item() == pytest.approx(0.75 * LOG2_3 - 1, abs=1e-15)
    # p = (1/2, 1/4, 1/4, 0) coded with the uniform code over 4 (2 bits each): H(p, q) = 2, H(p) = 1.5, KL = 0.5
    p4, u4 = t(0.5, 0.25, 0.25, 0.0), torch.full((4,), 0.25, dtype=torch.float64)
    assert cross_entropy_bits(p4, u4).item() == pytest.approx(2.0, abs=1e-15)
    assert kl_bits(p4, u4).item() == pytest.approx(0.5, abs=1e-15)


def test_zero_probability_conventions():
    # p(x) = 0 terms count 0 even where q(x) = 0: p = (1, 0), q = (1/2, 0) -> H(p, q) = -log2 1/2 = 1, KL = 1
    assert cross_entropy_bits(t(1.0, 0.0), t(0.5, 0.0)).item() == pytest.approx(1.0, abs=1e-15)
    assert kl_bits(t(1.0, 0.0), t(0.5, 0.0)).item() == pytest.approx(1.0, abs=1e-15)
    assert kl_bits(t(1.0, 0.0), t(1.0, 0.0)).item() == 0.0
    # q(x) = 0 where p(x) > 0: the code has no word for x, infinitely many bits
    assert cross_entropy_bits(t(0.5, 0.5), t(1.0, 0.0)).item() == math.inf
    assert kl_bits(t(0.5, 0.5), t(1.0, 0.0)).item() == math.inf
    assert not torch.isnan(entropy_bits(t(0.0, 1.0))).any()


def test_shapes_batch_over_leading_dims():
    p = torch.softmax(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)), -1)  # (3, 5, V=7)
    q = torch.softmax(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1)), -1)
    assert entropy_bits(p).shape == cross_entropy_bits(p, q).shape == kl_bits(p, q).shape == (3, 5)
    assert cross_entropy_bits(p, q[0, 0]).shape == (3, 5)  # q broadcasts
    torch.testing.assert_close(cross_entropy_bits(p, q[0, 0]), cross_entropy_bits(p, q[0, 0].expand(3, 5, 7)), rtol=0, atol=0)


def _random_pair(seed: int, shape=(64, 10)):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(shape, generator=g, dtype=torch.float64), -1)  # (B, V)
    p = p * (torch.rand(shape, generator=g, dtype=torch.float64) > 0.3)  # exact zeros in p
    p[:, 0] += 1e-3  # no row all zero
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(3 * torch.randn(shape, generator=g, dtype=torch.float64), -1)  # (B, V), q > 0
    return p, q


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cross_entropy_is_entropy_plus_kl(seed):
    # H(p, q) = H(p) + KL(p || q) (seed 002, section 5.2), Gibbs: KL >= 0, so H(p, q) >= H(p); H <= log2 V
    p, q = _random_pair(seed)
    h, hpq, kl = entropy_bits(p), cross_entropy_bits(p, q), kl_bits(p, q)
    torch.testing.assert_close(hpq, h + kl, rtol=0, atol=1e-12)
    assert (kl > 0).all() and (hpq > h).all()
    assert (h >= 0).all() and (h <= math.log2(10) + 1e-12).all()
    assert (kl_bits(p, p) == 0).all() and (kl_bits(q, q) == 0).all()
    torch.testing.assert_close(cross_entropy_bits(p, p), h, rtol=0, atol=1e-12)  # H(p, p) = H(p)
    # entropy is the expected surprisal: sum_x p(x) * (-log2 p(x)) over the x with p(x) > 0
    torch.testing.assert_close(h, torch.where(p > 0, p * surprisal_bits(p), 0.0).sum(-1), rtol=0, atol=1e-12)


def test_bits_are_torch_nats_over_ln2():
    p, q = _random_pair(3)
    p_dist, q_dist = Categorical(probs=p), Categorical(probs=q)
    ln2 = math.log(2.0)
    torch.testing.assert_close(entropy_bits(p), p_dist.entropy() / ln2, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl_bits(p, q), kl_divergence(p_dist, q_dist) / ln2, rtol=0, atol=1e-12)
    positive = torch.softmax(q.log() * 0.5, -1)  # (B, V), no zeros: categorical_kl takes logits
    torch.testing.assert_close(kl_bits(positive, q), categorical_kl(positive.log(), q.log()) / ln2, rtol=0, atol=1e-12)
    # soft-target cross-entropy of torch (nats, from logits log q) is -sum p log q
    torch.testing.assert_close(cross_entropy_bits(p, q), F.cross_entropy(q.log(), p, reduction="none") / ln2, rtol=0, atol=1e-12)


def test_float32_inputs_stay_float32():
    p = torch.tensor([0.5, 0.25, 0.25])
    assert entropy_bits(p).dtype == torch.float32 and entropy_bits(p).item() == pytest.approx(1.5, abs=1e-6)
