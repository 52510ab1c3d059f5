"""Datasets of prompts, SFT pairs and preference pairs, validated at load, and their batches.

Sources: a ``.jsonl`` file (one JSON object a line), a ``.json`` file (a list of objects), a
``.parquet`` file (read through ``datasets``), a ``datasets.Dataset``, or a Python list of dicts.

    prompts = load_prompts("data/train.jsonl")                 # {"prompt": ...} rows, extra keys kept
    pairs = load_sft("data/sft.parquet")                        # {"prompt", "completion"}
    prefs = load_preferences(records)                           # {"prompt", "chosen", "rejected", "margin"?}

A prompt is plain text or chat messages (a list of {"role", "content"}). :func:`render_prompt`
turns messages into text with the tokenizer's chat template (``add_generation_prompt=True``) when
it has one, else as "role: content" lines followed by "assistant: ". Completions are text.

Every problem is a :class:`DataError` naming the source, the row (1-based line for JSONL, row
number otherwise) and what was expected; an empty dataset is an error, not a zero-step run.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlalign.core.masks import position_ids_from_mask
from rlalign.errors import RLAlignError

__all__ = [
    "DataError",
    "Prompt",
    "PromptExample",
    "SFTExample",
    "PreferenceExample",
    "load_prompts",
    "load_sft",
    "load_preferences",
    "render_prompt",
    "encode_prompts",
    "SFTBatch",
    "collate_sft",
    "pack_sft",
    "PreferenceBatch",
    "collate_preferences",
]

Prompt = str | list[dict[str, str]]
Source = str | Path | Sequence[dict] | Any  # Any: a datasets.Dataset


class DataError(RLAlignError, ValueError):
    """A dataset that cannot be used; the message names the source, the row and what was expected."""


@dataclass(frozen=True)
class PromptExample:
    prompt: Prompt
    metadata: dict[str, Any] = field(default_factory=dict)  # other columns (e.g. a reference answer)


@dataclass(frozen=True)
class SFTExample:
    prompt: Prompt
    completion: str


@dataclass(frozen=True)
class PreferenceExample:
    prompt: Prompt
    chosen: str
    rejected: str
    margin: float | None = None


def _rows(source: Source) -> tuple[str, list[tuple[str, Any]]]:
    """(source name, [(row label, row)]) for every supported source."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows = []
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}, line {number}: not valid JSON ({err.msg}); expected one JSON object per line") from None
            return str(path), rows
        if suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}); expected a list of objects") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
            return str(path), [(f"row {i}", row) for i, row in enumerate(data, start=1)]
        if suffix == ".parquet":
            from datasets import Dataset

            dataset = Dataset.from_parquet(str(path))
            return str(path), [(f"row {i}", row) for i, row in enumerate(dataset, start=1)]
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .jsonl, .json or .parquet")
    if isinstance(source, Iterable):
        return "<in-memory records>", [(f"row {i}", row) for i, row in enumerate(source, start=1)]
    raise DataError(f"cannot read records from a {type(source).__name__}; expected a path, a datasets.Dataset or a list of dicts")


def _check_prompt(value: Any, where: str, column: str = "prompt") -> Prompt:
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: column {column!r} is an empty string; expected text or chat messages")
        return value
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: column {column!r} must be a non-empty string or a list of {{'role': str, 'content': str}} messages, got {value!r:.80}")


def _check_text(row: dict, column: str, where: str) -> str:
    value = row[column]
    if not isinstance(value, str):
        raise DataError(f"{where}: column {column!r} must be a string, got {type(value).__name__} {value!r:.80}")
    return value


def _require(row: Any, columns: Sequence[str], where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with columns {list(columns)}, got {type(row).__name__}")
    missing = [c for c in columns if c not in row or row[c] is None]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}; expected columns {list(columns)}, found {sorted(row)}")
    return row


def _non_empty(examples: list, name: str, kind: str) -> list:
    if not examples:
        raise DataError(f"{name}: the {kind} dataset is empty")
    return examples


def load_prompts(source: Source) -> list[PromptExample]:
    """Rows with a ``prompt`` (text or messages); other columns are kept as metadata."""
    name, rows = _rows(source)
    out = []
    for label, row in rows:
        where = f"{name}, {label}"
        row = _require(row, ["prompt"], where)
        out.append(PromptExample(_check_prompt(row["prompt"], where), {k: v for k, v in row.items() if k != "prompt"}))
    return _non_empty(out, name, "prompt")


def load_sft(source: Source) -> list[SFTExample]:
    """Rows with ``prompt`` (text or messages) and ``completion`` (text)."""
    name, rows = _rows(source)
    out = []
    for label, row in rows:
        where = f"{name}, {label}"
        row = _require(row, ["prompt", "completion"], where)
        out.append(SFTExample(_check_prompt(row["prompt"], where), _check_text(row, "completion", where)))
    return _non_empty(out, name, "SFT")


def load_preferences(source: Source) -> list[PreferenceExample]:
    """Rows with ``prompt``, ``chosen``, ``rejected`` and an optional finite ``margin``. A pair whose
    chosen and rejected responses are the same text teaches nothing: such pairs are dropped, with a
    warning that counts them and names the first."""
    name, rows = _rows(source)
    out, same = [], []
    for label, row in rows:
        where = f"{name}, {label}"
        row = _require(row, ["prompt", "chosen", "rejected"], where)
        margin = row.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)):
            raise DataError(f"{where}: column 'margin' must be a finite number or absent, got {margin!r}")
        example = PreferenceExample(
            _check_prompt(row["prompt"], where), _check_text(row, "chosen", where), _check_text(row, "rejected", where), None if margin is None else float(margin)
        )
        if example.chosen == example.rejected:
            same.append(where)
        else:
            out.append(example)
    if same:
        warnings.warn(f"{len(same)} of {len(same) + len(out)} preference pairs have chosen == rejected and were dropped (first: {same[0]})", UserWarning, stacklevel=2)
    return _non_empty(out, name, "preference")


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """Prompt text: as is, or chat messages through the chat template (plain join when there is none)."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "


def _encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    # a chat template writes its own BOS; plain text gets the tokenizer's special tokens (e.g. BOS)
    add_special = isinstance(prompt, str) or not getattr(tokenizer, "chat_template", None)
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=add_special)["input_ids"]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of each rendered prompt (ready for :func:`rlalign.lm.sampling.sample`)."""
    return [_encode_prompt(tokenizer, p) for p in prompts]


def _encode_completion(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


@dataclass
class SFTBatch:
    """Right-padded prompt + completion rows with a completion-only loss mask.

    ``loss_mask[b, t] = 1`` when token t + 1 of row b is a completion token (EOS included), so
    ``logits[:, :-1]`` against ``input_ids[:, 1:]`` gives the completion-only loss.
    """

    input_ids: Tensor  # (B, T)
    attention_mask: Tensor | None  # (B, T); None for packed rows (position_ids separate the sequences)
    position_ids: Tensor  # (B, T)
    loss_mask: Tensor  # (B, T - 1)


def _sft_rows(tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_length: int) -> list[tuple[list[int], list[int]]]:
    rows = []
    for ex in examples:
        prompt = _encode_prompt(tokenizer, ex.prompt)
        completion = _encode_completion(tokenizer, ex.completion)
        ids = (prompt + completion)[:max_length]
        is_target = ([0] * len(prompt) + [1] * len(completion))[:max_length]
        rows.append((ids, is_target))
    return rows


def collate_sft(tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_length: int = 512) -> SFTBatch:
    """One row per example, right-padded, truncated to ``max_length`` tokens."""
    rows = _sft_rows(tokenizer, examples, max_length)
    length = max(len(ids) for ids, _ in rows)
    batch = len(rows)
    input_ids = torch.full((batch, length), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)  # (B, T)
    is_target = torch.zeros((batch, length), dtype=torch.long)  # (B, T)
    for b, (ids, target) in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention_mask[b, : len(ids)] = 1
        is_target[b, : len(ids)] = torch.tensor(target)
    return SFTBatch(input_ids, attention_mask, position_ids_from_mask(attention_mask), is_target[:, 1:])


def pack_sft(tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_length: int = 512) -> SFTBatch:
    """Pack examples end to end into rows of at most ``max_length`` tokens (first fit, in order).

    Position ids restart at 0 for each example and no attention mask is passed; transformers reads
    the restarts as sequence boundaries and keeps attention within each example, so the loss of a
    packed batch equals that of the unpacked one while wasting no compute on padding. The forward
    must run with ``use_cache=False``: with a cache, transformers skips the packed-sequence check.
    """
    rows = _sft_rows(tokenizer, examples, max_length)
    packed: list[tuple[list[int], list[int], list[int]]] = []  # (ids, targets, positions)
    for ids, target in rows:
        if not packed or len(packed[-1][0]) + len(ids) > max_length:
            packed.append(([], [], []))
        packed[-1][0].extend(ids)
        packed[-1][1].extend(target)
        packed[-1][2].extend(range(len(ids)))
    length = max(len(p[0]) for p in packed)
    batch = len(packed)
    input_ids = torch.full((batch, length), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    is_target = torch.zeros((batch, length), dtype=torch.long)  # (B, T)
    position_ids = torch.zeros((batch, length), dtype=torch.long)  # (B, T)
    for b, (ids, target, positions) in enumerate(packed):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        is_target[b, : len(ids)] = torch.tensor(target)
        # trailing padding continues the last sequence's positions (so it is not read as a new one); it is never a target
        tail = length - len(ids)
        position_ids[b] = torch.tensor(positions + list(range(positions[-1] + 1, positions[-1] + 1 + tail)))
    return SFTBatch(input_ids, None, position_ids, is_target[:, 1:])


@dataclass
class PreferenceBatch:
    """Chosen and rejected sequences (prompt + response + EOS), right-padded to one length.

    Rows 0..B-1 are the chosen responses and rows B..2B-1 the rejected ones, so one forward pass
    scores both; the reward is read at each row's last real token (the EOS).
    """

    input_ids: Tensor  # (2B, T)
    attention_mask: Tensor  # (2B, T)
    margin: Tensor | None  # (B,), None when no example has a margin

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def collate_preferences(tokenizer: PreTrainedTokenizerBase, examples: Sequence[PreferenceExample], max_length: int = 512) -> PreferenceBatch:
    """Encode pairs for a reward model; sequences longer than ``max_length`` keep their last tokens."""
    sequences = []
    for response in ("chosen", "rejected"):
        for ex in examples:
            ids = _encode_prompt(tokenizer, ex.prompt) + _encode_completion(tokenizer, getattr(ex, response))
            sequences.append(ids[-max_length:])
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), tokenizer.pad_token_id, dtype=torch.long)  # (2B, T)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)  # (2B, T)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    margins = [ex.margin for ex in examples]
    margin = None if all(m is None for m in margins) else torch.tensor([m or 0.0 for m in margins], dtype=torch.float32)
    return PreferenceBatch(input_ids, attention_mask, margin)
