"""The Rollout container: shape checks, concatenation, positions, slicing, decoding."""

from __future__ import annotations

import pytest
import torch

from rlalign.lm.rollout import Rollout


def _rollout() -> Rollout:
    # row 0: prompt "ab" (left-padded by one), completion "c" EOS; row 1: prompt "xyz", completion "d" then truncation
    return Rollout(
        prompt_ids=torch.tensor([[0, 1, 14, 15], [1, 37, 38, 39]]),
        prompt_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
        completion_ids=torch.tensor([[16, 2, 0], [17, 17, 17]]),
        completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        logprobs=torch.tensor([[-0.5, -0.1, 0.0], [-1.0, -1.0, -1.0]]),
        group_index=torch.tensor([0, 0]),
        truncated=torch.tensor([False, True]),
    )


def test_input_ids_mask_and_positions():
    r = _rollout()
    assert r.input_ids().shape == (2, 7)
    # row 0: pad, bos, a, b, c, EOS, pad -> positions 0 (pad), 0, 1, 2, 3, 4, then 4 (clamped, padding)
    assert r.position_ids()[0].tolist() == [0, 0, 1, 2, 3, 4, 4]
    assert r.position_ids()[1].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert r.completion_lengths().tolist() == [2, 3]
    assert r.num_groups == 1


def test_select_and_minibatches_keep_rows_aligned():
    r = _rollout()
    second = r.select(torch.tensor([1]))
    assert second.completion_ids.tolist() == [[17, 17, 17]] and second.truncated.tolist() == [True]
    assert [m.batch_size for m in r.minibatches(1)] == [1, 1]


def test_decode_drops_eos_and_padding(tokenizer):
    r = _rollout()
    assert r.decode_completions(tokenizer) == ["c", "ddd"]
    assert r.decode_prompts(tokenizer) == ["ab", "xyz"]


def test_wrong_shapes_are_errors():
    fields = vars(_rollout()) | {"logprobs": torch.zeros(2, 4)}
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 4\), expected \(2, 3\)"):
        Rollout(**fields)
