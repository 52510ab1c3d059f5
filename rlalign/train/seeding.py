"""Seeds, RNG states and the data order: what makes a resumed run draw what the uninterrupted run
would have drawn (the RNG states are saved in each checkpoint, :mod:`rlalign.train.checkpoints`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = [
    "set_seed",
    "rng_state",
    "reseed_for_step",
    "restore_rng_state",
    "batch_order",
]


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and all CUDA devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def reseed_for_step(seed: int, step: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs from (``seed``, ``step``): a rollout producer does so before it
    samples or scores a step, so a reward function drawing from them draws the same numbers in a resumed run (whose
    producer starts anew, its RNG state in no checkpoint) as in the uninterrupted one."""
    set_seed(seed * 1_000_003 + step)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors and plain containers (``weights_only``-loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def batch_order(num_examples: int, position: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the examples at data positions [position, position + batch_size).

    Epoch e = position // N visits the examples in a permutation drawn from seed + e, so the
    order depends only on the position: a resumed run continues where the original stopped.
    """
    permutations: dict[int, list[int]] = {}
    out = []
    for p in range(position, position + batch_size):
        epoch, offset = divmod(p, num_examples)
        if epoch not in permutations:
            permutations[epoch] = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        out.append(permutations[epoch][offset])
    return out
