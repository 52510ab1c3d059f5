"""The packed layout (rlalign.core.packing) by hand: bins, token indices, positions, predicting positions."""

from __future__ import annotations

import pytest
import torch

from rlalign.core.packing import first_fit_decreasing, pack_rows


def test_first_fit_decreasing_by_hand():
    # capacity 5, lengths 5 2 3 4: 5 fills bin 0; 4 opens bin 1 (1 left); 3 does not fit there, opens
    # bin 2 (2 left); 2 fits neither bin 0 (0 left) nor bin 1 (1 left), goes to bin 2 at offset 3
    assert first_fit_decreasing([5, 2, 3, 4], 5) == [(0, 0), (2, 3), (2, 0), (1, 0)]
    assert first_fit_decreasing([2, 2, 2], 4) == [(0, 0), (0, 2), (1, 0)]  # ties in order


def test_pack_rows_by_hand():
    # rows (prompt + completion real tokens): 3 + 2, 2 + 0, 1 + 2, 2 + 2; width P + C = 3 + 2 = 5 a row
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1], [0, 0], [1, 1], [1, 1]])
    layout = pack_rows(prompt_mask, completion_mask)
    # lengths 5 2 3 4, W = 5: packed rows [row 0], [row 3, unused], [row 2, row 1] (test above)
    # tokens index the flattened (4, 5) rows: row r's real tokens are columns P - p_r .. P + c_r - 1
    assert layout.tokens.tolist() == [[0, 1, 2, 3, 4], [16, 17, 18, 19, -1], [12, 13, 14, 6, 7]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    # completion token t of row r is predicted at packed start + p_r - 1 + t; row 1 has no completion:
    # both its columns point at its last prompt token (packed 10 + 3 + 1 = 14)
    assert layout.predicting.tolist() == [[2, 3], [14, 14], [10, 11], [6, 7]]
    assert layout.size == 15  # against 4 x 5 = 20 padded


@pytest.mark.parametrize("prompt_mask, completion_mask", [
    ([[1, 0, 1]], [[1, 1]]),  # a hole in the prompt
    ([[0, 1, 1]], [[1, 0, 1]]),  # a hole in the completion
    ([[1, 1, 0]], [[1, 1]]),  # right-padded prompt
    ([[0, 0, 0], [0, 1, 1]], [[1, 1, 0], [1, 0, 0]]),  # no prompt token: nothing predicts the first completion token
])
def test_pack_rows_leaves_other_masks_padded(prompt_mask, completion_mask):
    assert pack_rows(torch.tensor(prompt_mask), torch.tensor(completion_mask)) is None


def test_no_rows_nothing_to_pack():
    assert pack_rows(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long)) is None


def test_packed_input_ids_and_picked_positions_by_hand():
    # the batch of test_pack_rows_by_hand with token ids 10 * row + column, so each says where it came from
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1], [0, 0], [1, 1], [1, 1]])
    ids = 10 * torch.arange(4)[:, None] + torch.arange(5)  # (4, 5): prompt columns 0-2, completion 3-4
    layout = pack_rows(prompt_mask, completion_mask)
    packed = layout.input_ids(ids[:, :3], ids[:, 3:])
    # packed row 1's unused last position repeats the batch's first token (0); row 1 (11, 12) follows row 2 (22, 23, 24)
    assert packed.tolist() == [[0, 1, 2, 3, 4], [31, 32, 33, 34, 0], [22, 23, 24, 11, 12]]
    hidden = packed[..., None].expand(-1, -1, 2) * torch.tensor([1, -1])  # (N, W, 2): a "hidden state" naming its token
    picked = layout.pick(hidden)  # (B, C, 2): the token before each completion token (row 1: its last prompt token, twice)
    assert picked[..., 0].tolist() == [[2, 3], [12, 12], [22, 23], [32, 33]] and picked[..., 1].tolist() == [[-2, -3], [-12, -12], [-22, -23], [-32, -33]]
    assert layout.pick(packed).tolist() == [[2, 3], [12, 12], [22, 23], [32, 33]]  # (N, W) -> (B, C)


def test_one_row_packs_into_itself():
    layout = pack_rows(torch.tensor([[0, 1, 1]]), torch.tensor([[1, 0]]))
    assert layout.tokens.tolist() == [[1, 2, 3]] and layout.positions.tolist() == [[0, 1, 2]] and layout.predicting.tolist() == [[1, 1]]


def test_the_unused_tail_counts_from_0_again():
    # rows of 2 + 0 and 1 + 3 tokens (P = 2, C = 3), W = 4: [row 1], [row 0, two unused]. Row 0's
    # first token is the batch's token 0; the unused tail's positions restart at 0 (never -1, never
    # continuing from the row before)
    layout = pack_rows(torch.tensor([[1, 1], [0, 1]]), torch.tensor([[0, 0, 0], [1, 1, 1]]))
    assert layout.tokens.tolist() == [[6, 7, 8, 9], [0, 1, -1, -1]]
    assert layout.positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    assert layout.predicting.tolist() == [[5, 5, 5], [0, 1, 2]]  # row 0 has no completion: its last prompt token, thrice
