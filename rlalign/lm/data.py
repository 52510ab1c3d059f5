"""Datasets of prompts, SFT examples and preference pairs, read through ``datasets`` and validated
at load; their tokens and batches are :mod:`rlalign.lm.encoding`.

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
    where: str = field(default="", compare=False, repr=False)  # "FILE, line N" (or row N) for messages; "" when not from a file


@dataclass(frozen=True)
class SFTExample:
    """A prompt and its completion; or, with ``prompt`` None, a whole text or conversation to model."""

    prompt: Prompt | None
    completion: str | Messages
    where: str = field(default="", compare=False, repr=False)  # "FILE, line N" (or row N) for messages; "" when not from a file


@dataclass(frozen=True)
class PreferenceExample:
    """Two responses to ``prompt``; with ``prompt`` None (implicit prompt) whole texts or conversations."""

    prompt: Prompt | None
    chosen: str | Messages
    rejected: str | Messages
    margin: float | None = None
    where: str = field(default="", compare=False, repr=False)  # "FILE, line N" (or row N) for messages; "" when not from a file


# ----------------------------------------------------------------------------------------------
# Reading rows
# ----------------------------------------------------------------------------------------------

_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars from ``datasets`` for the duration, and none of its error log lines (a file it cannot parse
    is named by rlalign's own message, with the line counted from 1; restored after)."""
    from datasets.utils import logging as datasets_logging

    was_enabled, level = datasets_logging.is_progress_bar_enabled(), datasets_logging.get_verbosity()
    datasets_logging.disable_progress_bar()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)
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
        empty = [c for c in missing if c in row]  # a JSON null, or a key other rows have and this one lacks (datasets fills None)
        found = sorted(c for c in row if row[c] is not None)
        raise DataError(f"{where}: missing or null column(s) {missing}; expected columns {list(columns)}, found {found}"
                        + (f" (null: {empty})" if empty else ""))
    return row


def _present(row: dict, column: str) -> bool:
    return row.get(column) is not None


_UNHONOURED = {  # columns TRL's trainers read that rlalign does not: what TRL does with them
    "images": "TRL feeds them to a vision-language model; rlalign trains text-only language models",
    "image": "TRL feeds it to a vision-language model; rlalign trains text-only language models",
    "tools": "TRL renders the row's tool schemas into its chat template; rlalign's SFT, reward model and DPO do not",
    "chat_template_kwargs": "TRL passes them to the row's chat template (e.g. enable_thinking); rlalign's SFT, reward model and DPO do not",
    "input_ids": "TRL trains a pre-tokenized row's ids as they are, skipping its own tokenization; rlalign tokenizes the row's text",
    **dict.fromkeys(("chosen_ids", "rejected_ids", "chosen_input_ids", "rejected_input_ids"),
                    "TRL's reward trainer takes a pre-tokenized pair's ids as they are; rlalign tokenizes the pair's texts"),
}


def _refuse_unhonoured(row: Any, where: str, columns: Sequence[str]) -> None:
    """A row with a column TRL would act on and rlalign would silently drop is an error naming it (a rename through
    ``data.columns`` keeps it as plain data)."""
    found = [c for c in columns if isinstance(row, dict) and _present(row, c)]
    if found:
        raise DataError(f"{where}: column {found[0]!r}: {_UNHONOURED[found[0]]}, so the row would not train as it does in TRL; "
                        f"remove the column, or rename it with data.columns to keep it as plain data")


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
        _refuse_unhonoured(row, where, ["images", "image"])
        row = _require(row, ["prompt"], where)
        out.append(PromptExample(_check_prompt(row["prompt"], where), {k: v for k, v in row.items() if k != "prompt"}, where))
    return _non_empty(out, name, "prompt")


def _sft_example(row: Any, where: str) -> SFTExample:
    _refuse_unhonoured(row, where, list(_UNHONOURED))
    if isinstance(row, dict) and not _present(row, "prompt") and _present(row, "messages"):
        messages = _messages(row["messages"])
        if messages is None:
            raise DataError(f"{where}: column 'messages' must be a list of {{'role': str, 'content': str}} messages, got {row['messages']!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: column 'messages' has no assistant message to learn from")
        return SFTExample(None, messages, where)
    if isinstance(row, dict) and not _present(row, "prompt") and _present(row, "text"):
        if not isinstance(row["text"], str) or not row["text"]:
            raise DataError(f"{where}: column 'text' must be a non-empty string, got {row['text']!r:.80}")
        return SFTExample(None, row["text"], where)
    if isinstance(row, dict) and not _present(row, "prompt"):
        raise DataError(f"{where}: expected the columns of one of TRL's SFT types ('text'; 'messages'; 'prompt' and 'completion'), found {sorted(row)}")
    row = _require(row, ["prompt", "completion"], where)
    prompt = _check_prompt(row["prompt"], where)
    return SFTExample(prompt, _check_response(row, "completion", where, prompt), where)


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
        _refuse_unhonoured(row, where, list(_UNHONOURED))
        row = _require(row, ["prompt", "chosen", "rejected"] if isinstance(row, dict) and "prompt" in row else ["chosen", "rejected"], where)
        margin = row.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)):
            raise DataError(f"{where}: column 'margin' must be a finite number or absent, got {margin!r}")
        prompt = _check_prompt(row["prompt"], where) if "prompt" in row else None
        chosen, rejected = _check_response(row, "chosen", where, prompt), _check_response(row, "rejected", where, prompt)
        if prompt is None and isinstance(chosen, str) != isinstance(rejected, str):
            raise DataError(f"{where}: with no 'prompt', 'chosen' and 'rejected' must both be texts or both be conversations")
        example = PreferenceExample(prompt, chosen, rejected, None if margin is None else float(margin), where)
        if example.chosen == example.rejected:
            same.append(where)
        else:
            out.append(example)
    if same:
        warnings.warn(f"{len(same)} of {len(same) + len(out)} preference pairs have chosen == rejected and were dropped (first: {same[0]})", UserWarning, stacklevel=2)
    return _non_empty(out, name, "preference")

