"""Datasets: formats, validation errors naming file and line, chat rendering, SFT masks, packing."""

from __future__ import annotations

import json

import pytest
import torch

from rlalign.core.logprobs import token_logprobs
from rlalign.core.losses import sft_loss
from rlalign.lm.data import DataError, PreferenceExample, SFTExample, load_preferences, load_prompts, load_sft
from rlalign.lm.encoding import collate_preferences, collate_sft, encode_prompts, pack_sft, render_prompt

CHAT = [{"role": "user", "content": "hi"}]


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_text_and_chat_prompts(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, "", {"prompt": CHAT}])
    prompts = load_prompts(path)
    assert prompts[0].prompt == "1+1=" and prompts[0].metadata == {"answer": "2"}
    assert prompts[1].prompt == CHAT


def test_missing_column_names_file_line_and_expectation(tmp_path):
    path = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "answer": "d"}])
    with pytest.raises(DataError, match=r"sft\.jsonl, line 2: missing or null column\(s\) \['completion'\]; expected columns \['prompt', 'completion'\]"):
        load_sft(path)
    # datasets fills a key other rows have with None: that row was said to miss 'completion' while "found" listing it
    with pytest.raises(DataError, match=r"row 2: missing or null column\(s\) \['completion'\]; .* found \['answer', 'prompt'\] \(null: \['completion'\]\)"):
        load_sft([{"prompt": "a", "completion": "b"}, {"prompt": "c", "answer": "d", "completion": None}])


def test_malformed_rows_are_errors(tmp_path, capfd):
    bad_json = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, "{not json"])
    capfd.readouterr()
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: not valid JSON"):
        load_prompts(bad_json)
    assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' own line ("in row 1", 0-based) was printed before ours
    wrong_type = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "chosen": "b", "rejected": 3}])
    with pytest.raises(DataError, match=r"t\.jsonl, line 1: column 'rejected' must be a string"):
        load_preferences(wrong_type)
    bad_margin = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}])
    with pytest.raises(DataError, match=r"m\.jsonl, line 1: column 'margin' must be a finite number"):
        load_preferences(bad_margin)
    bad_chat = _jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"c\.jsonl, line 1: column 'prompt' must be"):
        load_prompts(bad_chat)
    with pytest.raises(DataError, match=r"<in-memory records>, row 2: expected an object"):
        load_prompts([{"prompt": "a"}, "b"])


def test_empty_dataset_is_an_error(tmp_path):
    with pytest.raises(DataError, match=r"empty\.jsonl: the SFT dataset is empty"):
        load_sft(_jsonl(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(DataError, match="the preference dataset is empty"):
        load_preferences([])
    with pytest.raises(DataError, match="no such file"):
        load_sft(tmp_path / "missing.jsonl")


def test_parquet_through_datasets(tmp_path):
    from datasets import Dataset

    rows = [{"prompt": "a", "chosen": "bb", "rejected": "c", "margin": 1.5}, {"prompt": "d", "chosen": "e", "rejected": "f", "margin": None}]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "prefs.parquet"))
    prefs = load_preferences(tmp_path / "prefs.parquet")
    assert prefs == [PreferenceExample("a", "bb", "c", 1.5), PreferenceExample("d", "e", "f", None)]
    Dataset.from_list([{"prompt": "a"}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad\.parquet, row 1: missing or null column\(s\) \['completion'\]"):
        load_sft(tmp_path / "bad.parquet")


def test_render_prompt_with_and_without_chat_template(tokenizer):
    assert render_prompt(tokenizer, CHAT) == "user: hi\nassistant: "  # the tiny tokenizer's template
    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", eos_token="<eos>")  # no template
    assert not tok.chat_template and render_prompt(tok, [{"role": "system", "content": "s"}] + CHAT) == "system: s\nuser: hi\nassistant: "
    assert encode_prompts(tokenizer, ["ab"]) == [[tokenizer.bos_token_id, 14, 15]]


def test_sft_loss_mask_covers_completion_and_eos_only(tokenizer):
    batch = collate_sft(tokenizer, [SFTExample("1+2=", "3"), SFTExample("10+20=", "30")])
    # row 0: <bos> 1 + 2 = 3 <eos> <pad> <pad>; targets are input_ids[:, 1:], so "3" and <eos> count
    assert batch.input_ids.shape == (2, 10)
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert batch.loss_mask[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    targets = batch.input_ids[:, 1:][batch.loss_mask.bool()]
    assert tokenizer.decode(targets.tolist()) == "3<eos>30<eos>"


def test_packing_gives_the_same_loss_as_padding(tokenizer):
    from .conftest import make_llama

    model = make_llama(vocab=len(tokenizer))
    examples = [SFTExample("1+2=", "3"), SFTExample("10+20=", "30"), SFTExample("99-1=", "98"), SFTExample("7=", "7")]

    def loss(batch):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False).logits
        return sft_loss(token_logprobs(logits[:, :-1], batch.input_ids[:, 1:]), batch.loss_mask)[0]

    packed = pack_sft(tokenizer, examples, max_length=20)
    assert packed.input_ids.shape[0] == 2 and packed.attention_mask is None
    assert packed.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]  # the second example restarts at 0
    torch.testing.assert_close(loss(packed), loss(collate_sft(tokenizer, examples)), rtol=0, atol=1e-5)


def test_preference_batch_puts_chosen_then_rejected(tokenizer):
    batch = collate_preferences(tokenizer, [PreferenceExample("a", "bb", "c", 2.0), PreferenceExample("d", "e", "fff")])
    assert batch.num_pairs == 2 and batch.input_ids.shape == (4, 6)
    assert tokenizer.decode(batch.input_ids[0][batch.attention_mask[0].bool()].tolist()) == "<bos>abb<eos>"
    assert tokenizer.decode(batch.input_ids[3][batch.attention_mask[3].bool()].tolist()) == "<bos>dfff<eos>"
    assert batch.margin.tolist() == [2.0, 0.0]


def test_an_example_the_cut_or_the_tokenizer_leaves_nothing_of_is_named_by_file_and_line(tokenizer, tmp_path):
    from rlalign.lm.encoding import explicit_prompt

    sft = load_sft(_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1234567890" * 3, "completion": "x"}]))
    collate_sft(tokenizer, sft[:1], max_length=8)
    with pytest.raises(DataError, match=r"max_length=8 cuts every target token of the example at .*sft\.jsonl, line 2 \('1234567890"):
        collate_sft(tokenizer, sft, max_length=8)
    pairs = load_preferences(_jsonl(tmp_path / "pairs.jsonl", [{"chosen": "Q: a", "rejected": "Q: b"}, {"chosen": "abc", "rejected": "xyz"}]))
    assert explicit_prompt(pairs[0]).where.endswith("pairs.jsonl, line 1")  # the extracted prompt keeps its place
    with pytest.raises(DataError, match=r"pairs\.jsonl, line 2: a pair with no prompt column whose chosen and rejected responses share no start"):
        explicit_prompt(pairs[1])
