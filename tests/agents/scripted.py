"""Episodes whose sampled turns are scripted: each row draws its own ids in order, whatever the logits (the
recorded log-prob is still the model's), so a test knows every token an episode holds."""

from __future__ import annotations

from collections import deque

import torch

from rlalign.agents import episodes as ep


def script(monkeypatch, per_row: list[list[int]]) -> None:
    """Every row draws its own ids in order (whatever the logits); the log-prob is the model's."""
    queues = [deque(ids) for ids in per_row]

    def draw(logits, params, uniform, alive):
        tokens = torch.tensor([queues[r].popleft() if alive[r] and queues[r] else 0 for r in range(len(queues))])
        return tokens, torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)

    monkeypatch.setattr(ep, "_draw_token", draw)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def script_texts(monkeypatch, tokenizer, per_row: list[str]) -> None:
    """:func:`script` of each row's text, tokenized without special tokens added."""
    script(monkeypatch, [ids_of(tokenizer, text) for text in per_row])
