"""The Rollout: sampled completions and everything a GRPO/PPO step needs about them, aligned.

Shapes: B = number of sequences (prompts x group size G), P = prompt length, C = completion length.

    prompt_ids       (B, P) long     left-padded with the pad id
    prompt_mask      (B, P) long     1 on real prompt tokens
    completion_ids   (B, C) long     right-padded with the pad id
    completion_mask  (B, C) long     1 on generated tokens up to and including EOS
    logprobs         (B, C) float32  log pi(y_t) under softmax(logits / temperature) at sampling
                                     time (before top-k / top-p truncation); 0 on padding
    group_index      (B,)   long     which prompt a row was sampled for (rows of a group are adjacent)
    truncated        (B,)   bool     True when no EOS came within max_new_tokens

``input_ids()`` concatenates prompt and completion to (B, P + C); because the prompt is left-padded
and the completion right-padded, every row's real tokens are contiguous, and
``position_ids()`` numbers them from 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlalign.core.masks import position_ids_from_mask

__all__ = ["Rollout"]


@dataclass
class Rollout:
    """Aligned tensors of one batch of sampled completions (shapes in the module docstring)."""

    prompt_ids: Tensor  # (B, P)
    prompt_mask: Tensor  # (B, P)
    completion_ids: Tensor  # (B, C)
    completion_mask: Tensor  # (B, C)
    logprobs: Tensor  # (B, C)
    group_index: Tensor  # (B,)
    truncated: Tensor  # (B,)

    def __post_init__(self) -> None:
        b, p = self.prompt_ids.shape
        c = self.completion_ids.shape[1]
        expected = {
            "prompt_mask": (b, p),
            "completion_mask": (b, c),
            "logprobs": (b, c),
            "group_index": (b,),
            "truncated": (b,),
        }
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"Rollout.{name} has shape {actual}, expected {shape} (B={b}, P={p}, C={c})")

    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return int(self.group_index.max().item()) + 1 if self.batch_size else 0

    def input_ids(self) -> Tensor:
        """Prompt then completion. Shape: (B, P + C)."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    def attention_mask(self) -> Tensor:
        """1 on real prompt and completion tokens. Shape: (B, P + C)."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def position_ids(self) -> Tensor:
        """0, 1, ... over each row's real tokens (0 on padding), as HF generate numbers them. Shape: (B, P + C)."""
        return position_ids_from_mask(self.attention_mask())

    def completion_lengths(self) -> Tensor:
        """Number of completion tokens (EOS included). Shape: (B,)."""
        return self.completion_mask.sum(-1)

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select(self, index: Tensor | slice) -> Rollout:
        """The rows ``index`` (a slice, an index tensor or a boolean mask over B)."""
        return Rollout(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def minibatches(self, size: int) -> Iterator[Rollout]:
        """Consecutive row slices of ``size`` (the last may be smaller); groups stay together when
        ``size`` is a multiple of the group size."""
        for start in range(0, self.batch_size, size):
            yield self.select(slice(start, start + size))

    @classmethod
    def concat(cls, rollouts: list[Rollout], pad_token_id: int) -> Rollout:
        """The rows of ``rollouts`` in order: prompts left-padded and completions right-padded to the
        longest, groups renumbered so that each rollout's follow the previous one's."""
        width_p = max(r.prompt_ids.shape[1] for r in rollouts)
        width_c = max(r.completion_ids.shape[1] for r in rollouts)

        def pad(x: Tensor, width: int, value: float, left: bool) -> Tensor:
            extra = width - x.shape[1]
            return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value)

        offsets = [0]
        for r in rollouts[:-1]:
            offsets.append(offsets[-1] + r.num_groups)
        return cls(
            torch.cat([pad(r.prompt_ids, width_p, pad_token_id, True) for r in rollouts]),
            torch.cat([pad(r.prompt_mask, width_p, 0, True) for r in rollouts]),
            torch.cat([pad(r.completion_ids, width_c, pad_token_id, False) for r in rollouts]),
            torch.cat([pad(r.completion_mask, width_c, 0, False) for r in rollouts]),
            torch.cat([pad(r.logprobs, width_c, 0.0, False) for r in rollouts]),
            torch.cat([r.group_index + offset for r, offset in zip(rollouts, offsets)]),
            torch.cat([r.truncated for r in rollouts]),
        )

    def decode_completions(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        """Completion texts without EOS and padding."""
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(self.completion_ids, self.completion_mask)]
        return tokenizer.batch_decode(rows, skip_special_tokens=True)

    def decode_prompts(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        """Prompt texts without padding and special tokens."""
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(self.prompt_ids, self.prompt_mask)]
        return tokenizer.batch_decode(rows, skip_special_tokens=True)
