"""Evaluation statistics of sampled completions.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples
of a prompt of which c pass, the unbiased estimate of the chance that at least one of k samples
passes is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(the product form of the paper's numerically stable code), averaged over prompts.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pass_at_k"]


def pass_at_k(passed: Tensor, k: int) -> Tensor:
    """Mean unbiased pass@k over prompts.

    Args:
        passed: whether each sample passes, n samples per prompt. Shape: (prompts, n), bool or 0/1.
        k: samples drawn, 1 <= k <= n.
    Returns:
        Shape: (), float64.
    """
    n = passed.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k} with n={n} samples per prompt")
    correct = passed.to(torch.int64).sum(dim=1)  # (prompts,)
    i = torch.arange(1, n + 1, dtype=torch.float64)  # (n,)
    # factor (1 - k / i) for i in (n - c, n], 1 elsewhere; all-fail prompts give 1 - 1 = 0, and n - c < k gives a factor 0
    in_product = i[None, :] > (n - correct)[:, None]  # (prompts, n)
    factors = torch.where(in_product, 1.0 - k / i[None, :], torch.ones((), dtype=torch.float64))  # (prompts, n)
    return (1.0 - factors.prod(dim=1)).mean()
