"""Packed rows: the real tokens of a padded batch laid end to end in as few rows as fit, padding-free.

A batch of B rows (left-padded prompt, right-padded completion) of widths P and C runs B x (P + C)
positions however short its rows are. Row i has p_i + c_i real tokens; first-fit decreasing puts
the rows, longest first, each into the first packed row with room for it, every packed row holding
at most W = max_i (p_i + c_i) tokens (the longest row alone fills one):

    N packed rows of W positions,   N <= B,   N x W <= B x (P + C)

so a packed pass never runs more positions, nor more attention per row, than the padded one.
Inside a packed row each original row keeps its own positions 0 .. p_i + c_i - 1; the position ids
restarting at 0 is how transformers' masks keep the rows apart (each attends to itself only), as
for ``DataCollatorWithFlattening``. The unused tail of a packed row is one more such row, of
padding. The hidden state at packed position ``predicting[i, t]`` predicts completion token t of
row i: the position of its previous token (p_i - 1 + t inside the row). A completion column past
c_i (padding, masked everywhere) points at the row's last such position, so every logit is finite.

Only rows whose masks are contiguous pack (prompt real at the right end, completion real at the
left end, at least one prompt token): that is every rollout rlalign makes; anything else runs padded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["PackedRows", "pack_rows", "first_fit_decreasing"]


class PackedRows(NamedTuple):
    """Where B padded rows of P + C columns sit in N packed rows of W positions."""

    tokens: Tensor  # (N, W): index into the flattened (B, P + C) prompt + completion of each packed token; -1 unused
    positions: Tensor  # (N, W): position id inside its own row (the unused tail counts from 0 again)
    predicting: Tensor  # (B, C): index into the flattened (N, W) of the hidden state that predicts each completion token

    @property
    def size(self) -> int:
        """Positions a packed pass runs, N x W."""
        return self.tokens.numel()

    def input_ids(self, prompt_ids: Tensor, completion_ids: Tensor) -> Tensor:
        """The packed rows' tokens; an unused position repeats the batch's first token (it attends
        within the unused tail only). Shapes: (B, P), (B, C) -> (N, W)."""
        return torch.cat([prompt_ids, completion_ids], dim=1).flatten()[self.tokens.clamp(min=0)]

    def pick(self, packed: Tensor) -> Tensor:
        """The values at the positions that predict each completion token. Shape: (N, W, ...) -> (B, C, ...)."""
        return packed.flatten(0, 1)[self.predicting.flatten()].view(*self.predicting.shape, *packed.shape[2:])


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """(bin, offset) of each item: items taken longest first (ties in order), each put into the
    first bin with ``capacity`` - used >= its length, else a new bin. Every length <= capacity."""
    used: list[int] = []  # tokens in each bin so far
    placed: dict[int, tuple[int, int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((b for b, filled in enumerate(used) if capacity - filled >= lengths[i]), len(used))
        if fit == len(used):
            used.append(0)
        placed[i] = (fit, used[fit])
        used[fit] += lengths[i]
    return [placed[i] for i in range(len(lengths))]


def pack_rows(prompt_mask: Tensor, completion_mask: Tensor) -> PackedRows | None:
    """The packed layout of a padded batch (module docstring), or None where its masks are not
    contiguous or a row has no prompt token (it then runs padded).

    Args:
        prompt_mask: 1 on real prompt tokens, left-padded. Shape: (B, P).
        completion_mask: 1 on real completion tokens, right-padded. Shape: (B, C).
    """
    (batch, prompt_width), completion_width = prompt_mask.shape, completion_mask.shape[1]
    device = prompt_mask.device
    p, c = prompt_mask.sum(1).long(), completion_mask.sum(1).long()  # (B,), (B,)
    columns_p, columns_c = torch.arange(prompt_width, device=device), torch.arange(completion_width, device=device)
    contiguous = torch.equal(prompt_mask.bool(), columns_p >= prompt_width - p[:, None]) and torch.equal(completion_mask.bool(), columns_c < c[:, None])
    if batch == 0 or not contiguous or bool((p == 0).any()):
        return None
    lengths = (p + c).tolist()
    width = max(lengths)
    placed = torch.tensor(first_fit_decreasing(lengths, width), device=device)  # (B, 2): bin, offset
    start = placed[:, 0] * width + placed[:, 1]  # (B,): flat packed index of each row's first token
    n_rows = int(placed[:, 0].max()) + 1
    length = p + c  # (B,)
    row = torch.repeat_interleave(torch.arange(batch, device=device), length)  # (T,): the row of each real token, T = sum of lengths
    within = torch.arange(len(row), device=device) - torch.repeat_interleave(length.cumsum(0) - length, length)  # (T,): 0 .. len - 1 per row
    tokens = torch.full((n_rows * width,), -1, dtype=torch.long, device=device)
    tokens[start[row] + within] = row * (prompt_width + completion_width) + prompt_width - p[row] + within
    positions = torch.zeros(n_rows * width, dtype=torch.long, device=device)
    positions[start[row] + within] = within
    unused = (tokens.view(n_rows, width) < 0).long()  # (N, W): the tail of each packed row, positions 0, 1, ... again
    positions = positions.view(n_rows, width) + (unused.cumsum(1) - 1) * unused
    last = (c - 1).clamp(min=0)[:, None]  # (B, 1): a completion column past c_i points at the row's last predicting position
    predicting = start[:, None] + p[:, None] - 1 + torch.minimum(columns_c[None, :], last)  # (B, C)
    return PackedRows(tokens.view(n_rows, width), positions, predicting)
