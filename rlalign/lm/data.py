"""Datasets of prompts, SFT examples and preference pairs, read through ``datasets``, validated at
load, and their batches.

Sources (:func:`read_rows`): a local JSON, JSONL, CSV, TSV, Parquet or Arrow file, a directory of
such files or one written by ``Dataset.save_to_disk``, a Hugging Face Hub dataset name (with
``subset`` and ``split``; read from the local cache, downloaded only when ``HF_HUB_OFFLINE=0``), a
``datasets.Dataset`` / ``DatasetDict``, or a Python list of dicts. ``columns`` renames columns
(``{"question": "prompt"}``) before anything is read.

The dataset types are TRL's, standard (text) or conversational (lists of ``{"role", "content"}``
messages):

    load_sft(src)          # {"text"} | {"messages"} (language modelling) | {"prompt", "completion"}
    load_preferences(src)  # {"prompt", "chosen", "rejected"} | {"chosen", "rejected"} (implicit prompt); "margin"?
    load_prompts(src)      # {"prompt"}; every other column is kept (a reference "answer", "tests", ...)

A conversational prompt is rendered with the tokenizer's chat template (``add_generation_prompt``),
else as "role: content" lines followed by "assistant: "; a conversational completion is what the
template adds for it after the prompt (:func:`example_tokens`).

Every problem is a :class:`DataError` naming the source, the row (the line of a JSONL file, the
row number otherwise), the column and what was expected; an empty dataset is an error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
    "Messages",
    "PromptExample",
    "SFTExample",
    "PreferenceExample",
    "read_rows",
    "load_prompts",
    "load_sft",
    "load_preferences",
    "render_prompt",
    "completion_text",
    "encode_prompts",
    "example_tokens",
    "SFTBatch",
    "collate_sft",
    "pack_sft",
    "PreferenceBatch",
    "collate_preferences",
    "explicit_prompt",
    "PreferenceCompletionBatch",
    "collate_preference_completions",
]

Messages = list[dict[str, Any]]  # [{"role": str, "content": str, ...}, ...]
Prompt = str | Messages
Source = str | Path | Sequence[dict] | Any  # Any: a datasets.Dataset or DatasetDict


class DataError(RLAlignError, ValueError):
    """A dataset that cannot be used; the message names the source, the row and what was expected."""


@dataclass(frozen=True)
class PromptExample:
    prompt: Prompt
    metadata: dict[str, Any] = field(default_factory=dict)  # other columns (e.g. a reference answer)


@dataclass(frozen=True)
class SFTExample:
    """A prompt and its completion; or, with ``prompt`` None, a whole text or conversation to model."""

    prompt: Prompt | None
    completion: str | Messages


@dataclass(frozen=True)
class PreferenceExample:
    """Two responses to ``prompt``; with ``prompt`` None (implicit prompt) whole texts or conversations."""

    prompt: Prompt | None
    chosen: str | Messages
    rejected: str | Messages
    margin: float | None = None


# ----------------------------------------------------------------------------------------------
# Reading rows
# ----------------------------------------------------------------------------------------------

_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars from ``datasets`` for the duration (restored after)."""
    from datasets.utils import logging as datasets_logging

    was_enabled = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            datasets_logging.enable_progress_bar()


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` in offline mode (local cache only) for the duration."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _pick_split(dataset: Any, split: str, name: str) -> Any:
    from datasets import DatasetDict

    if not isinstance(dataset, DatasetDict):
        return dataset
    if split not in dataset:
        raise DataError(f"{name}: no split {split!r}; its splits are {sorted(dataset)}")
    return dataset[split]


def _numbered(dataset: Any, labels: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    rows = dataset.to_list()
    if labels is None or len(labels) != len(rows):
        labels = [f"row {i}" for i in range(1, len(rows) + 1)]
    return list(zip(labels, rows))


def _json_problem(path: Path) -> str | None:
    """Where a JSON / JSONL file is not what ``datasets`` reads, in words (None: nothing found)."""
    text = path.read_text()
    if path.suffix.lower() == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return f"line {number}: not valid JSON ({err.msg}); expected one JSON object per line"
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at line {err.lineno}); expected a list of objects"
    if not isinstance(data, list):
        return f"expected a JSON list of objects, got {type(data).__name__}"
    bad = next((i for i, row in enumerate(data, start=1) if not isinstance(row, dict)), None)
    return None if bad is None else f"row {bad}: expected an object, got {type(data[bad - 1]).__name__}"


def _json_rows(path: Path) -> list[tuple[str, Any]]:
    """The rows of a JSON / JSONL file read by the json module (a JSONL row named by its line)."""
    if path.suffix.lower() == ".jsonl":
        return [(f"line {n}", json.loads(line)) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    return [(f"row {i}", row) for i, row in enumerate(json.loads(path.read_text()), start=1)]


def _read_file(path: Path) -> list[tuple[str, Any]]:
    from datasets import load_dataset

    suffix = path.suffix.lower()
    if suffix not in _BUILDERS:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(_BUILDERS)}")
    builder = _BUILDERS[suffix]
    if builder == "json" and not path.read_text().strip():
        return []
    try:
        with _quiet():
            dataset = load_dataset(builder, data_files=str(path), split="train", **({"delimiter": "\t"} if suffix == ".tsv" else {}))
    except Exception as err:  # find the line at fault where we can
        problem = _json_problem(path) if builder == "json" else None
        if problem:
            raise DataError(f"{path}, {problem}") from None
        if builder != "json":
            raise DataError(f"{path}: cannot be read as {suffix[1:]} ({type(err).__name__}: {err})") from None
        return _json_rows(path)  # valid JSON that pyarrow's reader refuses (e.g. blank lines between JSONL rows)
    if builder == "json" and "Json(" in repr(dataset.features):
        # a column of mixed types (text in some rows, messages in others) becomes datasets' Json
        # feature, which reads a text "2" back as the number 2: such files are read as JSON instead
        return _json_rows(path)
    lines = None
    if suffix == ".jsonl":  # name each row by its line, blank lines skipped
        lines = [f"line {n}" for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    return _numbered(dataset, lines)


def _read_dir(path: Path, split: str) -> list[tuple[str, Any]]:
    from datasets import load_dataset, load_from_disk

    try:
        with _quiet():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                dataset = load_from_disk(str(path))
            else:
                dataset = load_dataset(str(path))
    except Exception as err:
        raise DataError(f"{path}: neither a dataset saved with save_to_disk nor a directory of data files datasets can read "
                        f"({type(err).__name__}: {err})") from None
    return _numbered(_pick_split(dataset, split, str(path)))


def _read_hub(name: str, subset: str | None, split: str) -> list[tuple[str, Any]]:
    from datasets import load_dataset

    download = os.environ.get("HF_HUB_OFFLINE") == "0"
    try:
        with _hub_offline(not download), _quiet():
            dataset = load_dataset(name, subset)
    except Exception as err:
        if not download:
            raise DataError(
                f"{name!r} is neither a local file or directory nor a Hugging Face Hub dataset in the local cache, and rlalign "
                "downloads nothing unless asked: set HF_HUB_OFFLINE=0 to let it download, or give a local file"
            ) from None
        raise DataError(f"{name!r}: loading it from the Hugging Face Hub failed ({type(err).__name__}: {str(err)[:300]})") from None
    return _numbered(_pick_split(dataset, split, name))


def _rename(row: Any, columns: Mapping[str, str], where: str) -> Any:
    if not isinstance(row, dict):
        return row
    missing = [source for source in columns if source not in row]
    if missing:
        raise DataError(f"{where}: data.columns renames {missing}, not columns of this dataset (its columns: {sorted(row)})")
    taken = [target for target in columns.values() if target in row and target not in columns]
    if taken:
        raise DataError(f"{where}: data.columns renames a column to {taken}, which the dataset already has")
    return {columns.get(key, key): value for key, value in row.items()}


def read_rows(source: Source, split: str = "train", subset: str | None = None, columns: Mapping[str, str] | None = None) -> tuple[str, list[tuple[str, Any]]]:
    """(source name, [(row label, row)]): the rows of a file, a directory, a Hub dataset, a
    ``datasets.Dataset`` / ``DatasetDict`` or a list of dicts, with ``columns`` renamed
    ({old name: new name}). ``split`` picks a split where the source has several (a single file has
    one); ``subset`` is a Hub dataset's configuration.

    Raises:
        DataError: naming the source (and the line, for a malformed JSON file).
    """
    from datasets import Dataset, DatasetDict

    if isinstance(source, (Dataset, DatasetDict)):
        name, rows = f"<{type(source).__name__}>", _numbered(_pick_split(source, split, f"<{type(source).__name__}>"))
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_file():
            name, rows = str(path), _read_file(path)
        elif path.is_dir():
            name, rows = str(path), _read_dir(path, split)
        elif _HUB_NAME.match(str(source)) and path.suffix.lower() not in _BUILDERS:
            name, rows = str(source), _read_hub(str(source), subset, split)
        else:
            raise DataError(f"{path}: no such file or directory")
    elif isinstance(source, Iterable):
        name, rows = "<in-memory records>", [(f"row {i}", row) for i, row in enumerate(source, start=1)]
    else:
        raise DataError(f"cannot read records from a {type(source).__name__}; expected a path, a Hub dataset name, a datasets.Dataset or a list of dicts")
    if columns:
        rows = [(label, _rename(row, columns, f"{name}, {label}")) for label, row in rows]
    return name, rows


# ----------------------------------------------------------------------------------------------
# Validating rows
# ----------------------------------------------------------------------------------------------


def _messages(value: Any) -> Messages | None:
    """``value`` as chat messages (keys with None values, which Arrow adds to align rows, dropped), or None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        return None
    return [{key: item for key, item in m.items() if item is not None} for m in value]


def _check_prompt(value: Any, where: str, column: str = "prompt") -> Prompt:
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: column {column!r} is an empty string; expected text or chat messages")
        return value
    messages = _messages(value)
    if messages is None:
        raise DataError(f"{where}: column {column!r} must be a non-empty string or a list of {{'role': str, 'content': str}} messages, got {value!r:.80}")
    return messages


def _check_response(row: dict, column: str, where: str, prompt: Prompt | None) -> str | Messages:
    """A completion / chosen / rejected value: text, or messages (not after a text prompt)."""
    value = row[column]
    if isinstance(value, str):
        return value
    messages = _messages(value)
    if messages is None or isinstance(prompt, str):
        expected = "a string" if isinstance(prompt, str) else "a string or a list of {'role': str, 'content': str} messages"
        raise DataError(f"{where}: column {column!r} must be {expected}, got {type(value).__name__} {value!r:.80}")
    return messages


def _require(row: Any, columns: Sequence[str], where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with columns {list(columns)}, got {type(row).__name__}")
    missing = [c for c in columns if c not in row or row[c] is None]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}; expected columns {list(columns)}, found {sorted(row)}")
    return row


def _present(row: dict, column: str) -> bool:
    return row.get(column) is not None


def _non_empty(examples: list, name: str, kind: str) -> list:
    if not examples:
        raise DataError(f"{name}: the {kind} dataset is empty")
    return examples


def load_prompts(source: Source, split: str = "train", subset: str | None = None, columns: Mapping[str, str] | None = None) -> list[PromptExample]:
    """TRL's prompt-only type: rows with a ``prompt`` (text or messages); other columns are kept as metadata."""
    name, rows = read_rows(source, split, subset, columns)
    out = []
    for label, row in rows:
        where = f"{name}, {label}"
        row = _require(row, ["prompt"], where)
        out.append(PromptExample(_check_prompt(row["prompt"], where), {k: v for k, v in row.items() if k != "prompt"}))
    return _non_empty(out, name, "prompt")


def _sft_example(row: Any, where: str) -> SFTExample:
    if isinstance(row, dict) and not _present(row, "prompt") and _present(row, "messages"):
        messages = _messages(row["messages"])
        if messages is None:
            raise DataError(f"{where}: column 'messages' must be a list of {{'role': str, 'content': str}} messages, got {row['messages']!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: column 'messages' has no assistant message to learn from")
        return SFTExample(None, messages)
    if isinstance(row, dict) and not _present(row, "prompt") and _present(row, "text"):
        if not isinstance(row["text"], str) or not row["text"]:
            raise DataError(f"{where}: column 'text' must be a non-empty string, got {row['text']!r:.80}")
        return SFTExample(None, row["text"])
    if isinstance(row, dict) and not _present(row, "prompt"):
        raise DataError(f"{where}: expected the columns of one of TRL's SFT types ('text'; 'messages'; 'prompt' and 'completion'), found {sorted(row)}")
    row = _require(row, ["prompt", "completion"], where)
    prompt = _check_prompt(row["prompt"], where)
    return SFTExample(prompt, _check_response(row, "completion", where, prompt))


def load_sft(source: Source, split: str = "train", subset: str | None = None, columns: Mapping[str, str] | None = None) -> list[SFTExample]:
    """TRL's SFT types: language modelling (``text``, or ``messages``: the assistant turns are learnt)
    or prompt-completion (``prompt`` and ``completion``, text or messages)."""
    name, rows = read_rows(source, split, subset, columns)
    return _non_empty([_sft_example(row, f"{name}, {label}") for label, row in rows], name, "SFT")


def load_preferences(source: Source, split: str = "train", subset: str | None = None, columns: Mapping[str, str] | None = None) -> list[PreferenceExample]:
    """TRL's preference type: ``chosen`` and ``rejected`` (text or messages) after an explicit
    ``prompt``, or whole texts / conversations (implicit prompt); an optional finite ``margin``. A pair
    whose chosen and rejected responses are the same teaches nothing: such pairs are dropped, with a
    warning that counts them and names the first."""
    name, rows = read_rows(source, split, subset, columns)
    out, same = [], []
    for label, row in rows:
        where = f"{name}, {label}"
        row = _require(row, ["prompt", "chosen", "rejected"] if isinstance(row, dict) and "prompt" in row else ["chosen", "rejected"], where)
        margin = row.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)):
            raise DataError(f"{where}: column 'margin' must be a finite number or absent, got {margin!r}")
        prompt = _check_prompt(row["prompt"], where) if "prompt" in row else None
        chosen, rejected = _check_response(row, "chosen", where, prompt), _check_response(row, "rejected", where, prompt)
        if prompt is None and isinstance(chosen, str) != isinstance(rejected, str):
            raise DataError(f"{where}: with no 'prompt', 'chosen' and 'rejected' must both be texts or both be conversations")
        example = PreferenceExample(prompt, chosen, rejected, None if margin is None else float(margin))
        if example.chosen == example.rejected:
            same.append(where)
        else:
            out.append(example)
    if same:
        warnings.warn(f"{len(same)} of {len(same) + len(out)} preference pairs have chosen == rejected and were dropped (first: {same[0]})", UserWarning, stacklevel=2)
    return _non_empty(out, name, "preference")


# ----------------------------------------------------------------------------------------------
# Rendering and tokenising
# ----------------------------------------------------------------------------------------------


def _has_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _chat(tokenizer: PreTrainedTokenizerBase, messages: Messages, generation_prompt: bool) -> str:
    """Messages as text: the chat template, or "role: content" lines (then "assistant: " to prompt a reply)."""
    if _has_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if generation_prompt else "")


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """Prompt text: as is, or chat messages through the chat template (plain join when there is none)."""
    return prompt if isinstance(prompt, str) else _chat(tokenizer, prompt, generation_prompt=True)


def completion_text(completion: str | Messages) -> str:
    """A completion's text: itself, or the contents of its messages joined."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def _encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    # a chat template writes its own BOS; plain text gets the tokenizer's special tokens (e.g. BOS)
    add_special = isinstance(prompt, str) or not _has_template(tokenizer)
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=add_special)["input_ids"]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of each rendered prompt (ready for :func:`rlalign.lm.sampling.sample`)."""
    return [_encode_prompt(tokenizer, p) for p in prompts]


def _turn_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokens of a response's text, closed by EOS unless the text already ends with it (a chat
    template's end-of-turn token may be the EOS; trailing whitespace after it is kept)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if tokenizer.eos_token and text.rstrip().endswith(tokenizer.eos_token) else ids + [tokenizer.eos_token_id]


def _continuation(before: str, after: str, what: str) -> str:
    if not after.startswith(before):
        raise DataError(f"the chat template does not render {what} as a continuation of what comes before it "
                        f"({before[-60:]!r} is not a prefix of {after[:len(before) + 20][-80:]!r}); give prompt-completion rows instead")
    return after[len(before):]


def _conversation_tokens(tokenizer: PreTrainedTokenizerBase, messages: Messages, completion_only: bool) -> tuple[list[int], list[int]]:
    """A whole conversation's tokens; targets: the assistant turns' contents and ends (all tokens unless ``completion_only``)."""
    pieces: list[tuple[str, bool]] = []  # (text, is an assistant turn)
    done = ""
    for i, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant:  # the assistant header is prompt, not target
            header = _chat(tokenizer, messages[:i], generation_prompt=True)
            pieces.append((_continuation(done, header, f"turn {i}'s header"), False))
            done = header
        upto = _chat(tokenizer, messages[: i + 1], generation_prompt=False)
        pieces.append((_continuation(done, upto, f"turn {i}"), assistant))
        done = upto
    ids, is_target = [], []
    for n, (text, assistant) in enumerate(pieces):
        if assistant:
            piece = _turn_ids(tokenizer, text)
        else:
            piece = tokenizer(text, add_special_tokens=n == 0 and not _has_template(tokenizer))["input_ids"] if text else []
        ids += piece
        is_target += [int(assistant or not completion_only)] * len(piece)
    return ids, is_target


def _completion_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, completion: str | Messages) -> list[int]:
    """A completion's tokens after ``prompt``: text closed by EOS, or what the chat template writes for
    the completion's messages after the rendered prompt (closed by EOS if it does not already end with it)."""
    if isinstance(prompt, str):
        return _turn_ids(tokenizer, completion)
    messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    full = _chat(tokenizer, prompt + messages, generation_prompt=False)
    return _turn_ids(tokenizer, _continuation(render_prompt(tokenizer, prompt), full, "the completion"))


def example_tokens(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt | None, completion: str | Messages, completion_only: bool = True
) -> tuple[list[int], list[int]]:
    """(token ids, is_target) of one example: prompt + completion (targets: the completion), a whole
    text (targets: all of it) or a whole conversation (targets: its assistant turns). With
    ``completion_only`` False every token is a target."""
    if prompt is None and isinstance(completion, str):
        ids = tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]
        return ids, [1] * len(ids)
    if prompt is None:
        return _conversation_tokens(tokenizer, completion, completion_only)
    prompt_ids, completion_ids = _encode_prompt(tokenizer, prompt), _completion_ids(tokenizer, prompt, completion)
    return prompt_ids + completion_ids, [int(not completion_only)] * len(prompt_ids) + [1] * len(completion_ids)


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


def _sft_rows(tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_length: int, completion_only: bool) -> list[tuple[list[int], list[int]]]:
    rows = []
    for ex in examples:
        ids, is_target = example_tokens(tokenizer, ex.prompt, ex.completion, completion_only)
        rows.append((ids[:max_length], is_target[:max_length]))
    return rows


def collate_sft(tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_length: int = 512, completion_only: bool = True) -> SFTBatch:
    """One row per example, right-padded, truncated to ``max_length`` tokens; the loss mask covers
    the completions (:func:`example_tokens`), or every token unless ``completion_only``."""
    rows = _sft_rows(tokenizer, examples, max_length, completion_only)
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


def pack_sft(tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_length: int = 512, completion_only: bool = True) -> SFTBatch:
    """Pack examples end to end into rows of at most ``max_length`` tokens (first fit, in order).

    Position ids restart at 0 for each example and no attention mask is passed; transformers reads
    the restarts as sequence boundaries and keeps attention within each example, so the loss of a
    packed batch equals that of the unpacked one while wasting no compute on padding. The forward
    must run with ``use_cache=False``: with a cache, transformers skips the packed-sequence check.
    """
    rows = _sft_rows(tokenizer, examples, max_length, completion_only)
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
    """Encode pairs for a reward model (:func:`example_tokens`: prompt + response, or the whole text
    or conversation of an implicit prompt); sequences longer than ``max_length`` keep their last tokens."""
    sequences = []
    for response in ("chosen", "rejected"):
        for ex in examples:
            ids, _ = example_tokens(tokenizer, ex.prompt, getattr(ex, response))
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


def explicit_prompt(example: PreferenceExample) -> PreferenceExample:
    """``example`` with its prompt made explicit: a pair with an implicit prompt (whole texts or
    conversations) becomes the shared start of chosen and rejected plus the two remainders, as TRL's
    ``extract_prompt`` splits them: the longest common prefix of messages for conversations, of
    characters for texts (moved back before a space the responses differ after). A pair with a prompt
    is returned as it is.

    Raises:
        DataError: when chosen and rejected share no start, so there is no prompt to condition on.
    """
    if example.prompt is not None:
        return example
    chosen, rejected = example.chosen, example.rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if isinstance(chosen, str) and 0 < shared < min(len(chosen), len(rejected)) and chosen[shared - 1] == " ":
        shared -= 1  # the responses start with the space (TRL's convention)
    if shared == 0:
        raise DataError(f"a pair with no prompt column whose chosen and rejected responses share no start, so no prompt can be extracted: "
                        f"chosen {chosen!r:.60}, rejected {rejected!r:.60}")
    return PreferenceExample(chosen[:shared], chosen[shared:], rejected[shared:], example.margin)


@dataclass
class PreferenceCompletionBatch:
    """Preference pairs as prompts and completions, for log-probs of the responses (DPO and its family).

    Rows 0..B-1 hold the chosen responses and rows B..2B-1 the rejected ones; row b and row B + b
    have the same prompt (so one forward of 2B rows scores both, and a pair's prompt can run once).
    Prompts are left-padded and completions right-padded, the layout of a
    :class:`rlalign.lm.rollout.Rollout` (:func:`rlalign.lm.logprobs.completion_logprobs`).
    """

    prompt_ids: Tensor  # (2B, P)
    prompt_mask: Tensor  # (2B, P)
    completion_ids: Tensor  # (2B, C), a response's tokens and its EOS
    completion_mask: Tensor  # (2B, C)

    @property
    def num_pairs(self) -> int:
        return self.prompt_ids.shape[0] // 2


def collate_preference_completions(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[PreferenceExample], max_length: int = 512
) -> PreferenceCompletionBatch:
    """Encode pairs as prompt + chosen and prompt + rejected (:func:`example_tokens`; an implicit prompt
    is extracted first, :func:`explicit_prompt`). A pair longer than ``max_length`` (prompt plus its
    longer response) loses the start of its prompt first (one token at least is kept) and then the ends
    of its responses, so both responses keep the same prompt.

    Raises:
        DataError: a pair whose prompt has no token (nothing to predict the first response token from).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a prompt token and a response token), got {max_length}")
    rows: list[tuple[list[int], list[int], list[int]]] = []  # (prompt, chosen, rejected) token ids
    for ex in map(explicit_prompt, examples):
        prompt = _encode_prompt(tokenizer, ex.prompt)
        if not prompt:
            raise DataError(f"the prompt {ex.prompt!r:.60} has no token: give the tokenizer a BOS token or the pair a non-empty prompt")
        chosen, rejected = (_completion_ids(tokenizer, ex.prompt, response) for response in (ex.chosen, ex.rejected))
        keep = max(1, max_length - max(len(chosen), len(rejected)))  # prompt tokens kept
        prompt = prompt[-keep:]
        rows.append((prompt, chosen[: max_length - len(prompt)], rejected[: max_length - len(prompt)]))
    prompts = [p for p, _, _ in rows] * 2
    completions = [c for _, c, _ in rows] + [r for _, _, r in rows]
    width, length = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)  # (2B, P)
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (2B, P)
    completion_ids = torch.full((len(prompts), length), tokenizer.pad_token_id, dtype=torch.long)  # (2B, C)
    completion_mask = torch.zeros((len(prompts), length), dtype=torch.long)  # (2B, C)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        prompt_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, width - len(prompt) :] = 1
        completion_ids[row, : len(completion)] = torch.tensor(completion)
        completion_mask[row, : len(completion)] = 1
    return PreferenceCompletionBatch(prompt_ids, prompt_mask, completion_ids, completion_mask)
