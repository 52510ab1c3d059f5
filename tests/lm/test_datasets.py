"""TRL's dataset types through ``datasets``: every file format and source, column renames, and the
tokens (and loss targets) of each type, standard and conversational."""

from __future__ import annotations

import copy
import json

import pytest
from datasets import Dataset, DatasetDict

from rlalign.lm.data import DataError, PreferenceExample, PromptExample, SFTExample, load_preferences, load_prompts, load_sft, read_rows
from rlalign.lm.encoding import collate_preferences, collate_sft, example_tokens

USER = [{"role": "user", "content": "hi"}]
REPLY = [{"role": "assistant", "content": "yo"}]
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _targets(tokenizer, ids, is_target) -> str:
    return tokenizer.decode([i for i, t in zip(ids, is_target) if t])


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow"])
def test_every_file_format_reads_the_same_rows(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    dataset = Dataset.from_list(ROWS)
    if suffix == ".jsonl":
        _jsonl(path, ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix in (".csv", ".tsv"):
        dataset.to_csv(str(path), sep="," if suffix == ".csv" else "\t", index=False)
    elif suffix == ".parquet":
        dataset.to_parquet(str(path))
    else:
        dataset.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    prompts = load_prompts(path)
    assert [ex.prompt for ex in prompts] == ["1+1=", "2+2="]
    assert [str(ex.metadata["answer"]) for ex in prompts] == ["2", "4"]  # CSV reads "2" as the number 2, as datasets does for TRL


def test_saved_datasets_directories_and_splits(tmp_path):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert [ex.prompt for ex in load_prompts(tmp_path / "one")] == ["1+1=", "2+2="]
    DatasetDict({"train": Dataset.from_list(ROWS[:1]), "test": Dataset.from_list(ROWS[1:])}).save_to_disk(str(tmp_path / "two"))
    assert [ex.prompt for ex in load_prompts(tmp_path / "two", split="test")] == ["2+2="]
    with pytest.raises(DataError, match=r"two: no split 'validation'; its splits are \['test', 'train'\]"):
        load_prompts(tmp_path / "two", split="validation")
    files = tmp_path / "files"
    files.mkdir()
    _jsonl(files / "train.jsonl", ROWS[:1])
    _jsonl(files / "test.jsonl", ROWS[1:])
    assert [ex.prompt for ex in load_prompts(files, split="train")] == ["1+1="]
    assert [ex.prompt for ex in load_prompts(files, split="test")] == ["2+2="]
    assert [ex.prompt for ex in load_prompts(DatasetDict({"train": Dataset.from_list(ROWS)}))] == ["1+1=", "2+2="]


def test_a_hub_name_with_no_cached_copy_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(DataError, match=r"'no-such-org/no-such-data' is neither a local file or directory nor a Hugging Face Hub dataset "
                                         r"in the local cache.*HF_HUB_OFFLINE=0"):
        load_prompts("no-such-org/no-such-data")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file or directory"):
        load_prompts("missing.jsonl")


def test_columns_are_renamed_before_reading(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "solution": "2"}])
    assert load_prompts(path, columns={"question": "prompt", "solution": "answer"}) == [PromptExample("1+1=", {"answer": "2"})]
    with pytest.raises(DataError, match=r"q\.jsonl, line 1: data.columns renames \['query'\], not columns of this dataset \(its columns: \['question', 'solution'\]\)"):
        load_prompts(path, columns={"query": "prompt"})
    both = _jsonl(tmp_path / "both.jsonl", [{"question": "a", "prompt": "b"}])
    with pytest.raises(DataError, match=r"renames a column to \['prompt'\], which the dataset already has"):
        load_prompts(both, columns={"question": "prompt"})


def test_jsonl_rows_keep_their_line_numbers_and_malformed_lines_are_named(tmp_path):
    path = _jsonl(tmp_path / "gaps.jsonl", [{"prompt": "a"}, "", {"prompt": ""}])  # a blank line between rows
    with pytest.raises(DataError, match=r"gaps\.jsonl, line 3: column 'prompt' is an empty string"):
        load_prompts(path)
    bad = _jsonl(tmp_path / "bad.json", ['[{"prompt": "a"}, {"prompt": }]'])
    with pytest.raises(DataError, match=r"bad\.json, not valid JSON"):
        load_prompts(bad)
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "text"}, {"prompt": USER}])  # text and messages in one file
    assert [ex.prompt for ex in load_prompts(mixed)] == ["text", USER]
    read_rows(mixed)  # and read_rows itself is public
    assert read_rows([{"a": 1}], columns={"a": "b"}) == ("<in-memory records>", [("row 1", {"b": 1})])


# ---------------------------------------------------------------------------------------------
# SFT types and their targets
# ---------------------------------------------------------------------------------------------


def test_sft_types_standard_and_conversational(tmp_path):
    rows = [
        {"text": "hello"},
        {"messages": USER + REPLY},
        {"prompt": "1+1=", "completion": "2"},
        {"prompt": USER, "completion": REPLY},
        {"prompt": USER, "completion": "yo"},
    ]
    assert load_sft(_jsonl(tmp_path / "sft.jsonl", rows)) == [
        SFTExample(None, "hello"), SFTExample(None, USER + REPLY), SFTExample("1+1=", "2"), SFTExample(USER, REPLY), SFTExample(USER, "yo"),
    ]
    with pytest.raises(DataError, match=r"line 1: expected the columns of one of TRL's SFT types .* found \['question'\]"):
        load_sft(_jsonl(tmp_path / "q.jsonl", [{"question": "x"}]))
    with pytest.raises(DataError, match=r"line 1: column 'messages' has no assistant message"):
        load_sft(_jsonl(tmp_path / "m.jsonl", [{"messages": USER}]))
    with pytest.raises(DataError, match=r"line 1: column 'completion' must be a string"):
        load_sft(_jsonl(tmp_path / "c.jsonl", [{"prompt": "text", "completion": REPLY}]))  # a text prompt takes a text completion


def test_targets_of_each_sft_type(tokenizer):
    # the tiny tokenizer's template writes "role: content\n" per message and "assistant: " to prompt a reply
    ids, target = example_tokens(tokenizer, None, "hi")
    assert tokenizer.decode(ids) == "<bos>hi<eos>" and all(target)
    ids, target = example_tokens(tokenizer, USER, REPLY)
    assert tokenizer.decode(ids) == "user: hi\nassistant: yo\n<eos>" and _targets(tokenizer, ids, target) == "yo\n<eos>"
    assert example_tokens(tokenizer, USER, "yo") == (ids, target)  # a text completion of a conversational prompt is the assistant's turn
    conversation = [{"role": "system", "content": "s"}, *USER, *REPLY, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ids, target = example_tokens(tokenizer, None, conversation)
    assert tokenizer.decode(ids) == "system: s\nuser: hi\nassistant: yo\n<eos>user: q\nassistant: a\n<eos>"
    assert _targets(tokenizer, ids, target) == "yo\n<eos>a\n<eos>"  # the assistant turns, not their headers
    ids, target = example_tokens(tokenizer, None, conversation, completion_only=False)
    assert all(target)
    ids, target = example_tokens(tokenizer, "1+1=", "2", completion_only=False)
    assert tokenizer.decode(ids) == "<bos>1+1=2<eos>" and all(target)
    batch = collate_sft(tokenizer, [SFTExample(USER, REPLY), SFTExample(None, "ab")])
    assert tokenizer.decode(batch.input_ids[:, 1:][batch.loss_mask.bool()].tolist()) == "yo\n<eos>ab<eos>"


def test_a_template_whose_turns_end_with_eos_gets_no_second_eos(tokenizer):
    chatml = copy.deepcopy(tokenizer)
    chatml.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<eos>\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ids, target = example_tokens(chatml, USER, REPLY)
    assert chatml.decode(ids) == "[user]hi<eos>\n[assistant]yo<eos>\n" and _targets(chatml, ids, target) == "yo<eos>\n"


def test_a_template_that_rewrites_earlier_turns_is_an_error(tokenizer):
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(DataError, match="does not render .* as a continuation"):
        example_tokens(odd, None, USER + REPLY)


# ---------------------------------------------------------------------------------------------
# Preference types
# ---------------------------------------------------------------------------------------------


def test_preference_types_explicit_and_implicit_prompt(tmp_path, tokenizer):
    no = [{"role": "assistant", "content": "no"}]
    rows = [
        {"prompt": "q", "chosen": "a", "rejected": "bb"},
        {"prompt": USER, "chosen": REPLY, "rejected": no},
        {"chosen": "q a", "rejected": "q bb"},
        {"chosen": USER + REPLY, "rejected": USER + no, "margin": 1.0},
    ]
    Dataset.from_list(rows[3:]).to_parquet(str(tmp_path / "implicit.parquet"))
    pairs = load_preferences(_jsonl(tmp_path / "p.jsonl", rows[:3])) + load_preferences(tmp_path / "implicit.parquet")
    assert pairs == [
        PreferenceExample("q", "a", "bb"), PreferenceExample(USER, REPLY, no), PreferenceExample(None, "q a", "q bb"),
        PreferenceExample(None, USER + REPLY, USER + no, 1.0),
    ]
    batch = collate_preferences(tokenizer, pairs)
    texts = [tokenizer.decode(ids[mask.bool()].tolist()) for ids, mask in zip(batch.input_ids, batch.attention_mask)]
    assert texts[:4] == ["<bos>qa<eos>", "user: hi\nassistant: yo\n<eos>", "<bos>q a<eos>", "user: hi\nassistant: yo\n<eos>"]
    assert texts[5] == "user: hi\nassistant: no\n<eos>"
    with pytest.raises(DataError, match="with no 'prompt', 'chosen' and 'rejected' must both be texts or both be conversations"):
        load_preferences([{"chosen": "x", "rejected": USER + no}])


def test_a_text_that_already_ends_with_eos_gets_no_second_one():
    # TRL appends EOS to a text only when it is missing; "hello<eos>" gave [BOS h e l l o EOS EOS] before
    from rlalign.tasks.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    hello = tokenizer("hello", add_special_tokens=False)["input_ids"]
    for text in ("hello", "hello<eos>"):
        ids, targets = example_tokens(tokenizer, None, text)
        assert ids == [bos, *hello, eos] and targets == [1] * 7
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert example_tokens(tokenizer, None, "hello<eos>\n")[0] == [bos, *hello, eos, *newline, eos]  # TRL's test: the text ends otherwise


@pytest.mark.parametrize("column,value,loader", [
    ("images", ["a.png"], load_prompts), ("image", "a.png", load_sft), ("tools", [{"type": "function"}], load_sft),
    ("chat_template_kwargs", {"enable_thinking": False}, load_preferences),
    # pre-tokenized rows: TRL trains their ids (its own masks) and skips tokenizing the text beside them
    ("input_ids", [1, 2, 3], load_sft), ("chosen_ids", [1, 2], load_preferences), ("rejected_input_ids", [1, 2], load_preferences),
])
def test_a_column_trl_acts_on_and_rlalign_would_drop_is_an_error_naming_it(column, value, loader):
    # TRL feeds images to a vision-language model and renders per-row tools and chat_template_kwargs through the template:
    # rlalign dropped them silently (no tool schemas in the prompt, an empty think block trained as a target)
    row = {"prompt": "2+2=", "completion": "4", "chosen": "4", "rejected": "5", column: value}
    with pytest.raises(DataError, match=rf"row 1: column '{column}': .*remove the column, or rename it with data.columns"):
        loader([row])
    assert loader([{k: v for k, v in row.items() if k != column}])  # without it the row loads
    renamed = loader([row], columns={column: f"my_{column}"})  # renamed: plain data
    assert renamed
