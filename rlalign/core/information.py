"""Information theory in bits: surprisal, entropy, cross-entropy and KL divergence of discrete distributions.

    surprisal      I(x)      = -log2 p(x)                                (Shannon 1948; seed 002, section 5.2:
                                                                          the optimal code length of x in bits)
    entropy        H(p)      = -sum_x p(x) log2 p(x)                     (Shannon 1948)
    cross-entropy  H(p, q)   = -sum_x p(x) log2 q(x)                     (bits per message when x ~ p is coded
                                                                          with the code that is optimal for q)
    KL divergence  KL(p||q)  =  sum_x p(x) (log2 p(x) - log2 q(x))  =  H(p, q) - H(p)
                                                                         (Kullback & Leibler 1951; seed 002,
                                                                          section 5.2: the bits wasted per message
                                                                          by coding p with q's code)

The inputs are probabilities (not logits) along the last dimension; they are not checked to sum to 1.
The usual limits hold exactly: a term with p(x) = 0 contributes 0 (0 log 0 = 0, whatever q(x) is), and
q(x) = 0 where p(x) > 0 makes H(p, q) and KL(p || q) +inf. Base-2 logarithms throughout: the nats of
:func:`rlalign.core.kl.categorical_kl` and ``torch.distributions`` are these values times ln 2.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["surprisal_bits", "entropy_bits", "cross_entropy_bits", "kl_bits"]

LN2 = math.log(2.0)


def surprisal_bits(p: Tensor) -> Tensor:
    """I = -log2 p: the bits an optimal code spends on an outcome of probability p (inf at p = 0).

    Shapes: (...) -> (...).
    """
    return -torch.log2(p)


def entropy_bits(p: Tensor) -> Tensor:
    """H(p) = -sum_x p(x) log2 p(x) = E_{x~p}[-log2 p(x)], with 0 log 0 = 0.

    Args:
        p: probabilities. Shape: (..., V).
    Returns:
        bits, in [0, log2 V]. Shape: (...).
    """
    return -torch.special.xlogy(p, p).sum(-1) / LN2  # xlogy(0, y) = 0


def cross_entropy_bits(p: Tensor, q: Tensor) -> Tensor:
    """H(p, q) = -sum_x p(x) log2 q(x): the mean code length, in bits, of x ~ p under q's optimal code.

    A term with p(x) = 0 is 0 even where q(x) = 0; q(x) = 0 where p(x) > 0 gives +inf.

    Args:
        p: the distribution the outcomes come from. Shape: (..., V).
        q: the distribution the code is built for. Shape: (..., V) (or broadcastable).
    Returns:
        bits, >= H(p). Shape: (...).
    """
    return -torch.special.xlogy(p, q).sum(-1) / LN2


def kl_bits(p: Tensor, q: Tensor) -> Tensor:
    """KL(p || q) = sum_x p(x) (log2 p(x) - log2 q(x)) = H(p, q) - H(p), in bits; >= 0 (Gibbs' inequality).

    Computed term by term (not as the difference of the two sums), so it is exactly 0 when p == q;
    +inf where q(x) = 0 < p(x). Shapes as :func:`cross_entropy_bits`.
    """
    terms = torch.special.xlogy(p, p) - torch.special.xlogy(p, q)  # (..., V) p log p - p log q, 0 where p = 0
    return terms.sum(-1) / LN2
