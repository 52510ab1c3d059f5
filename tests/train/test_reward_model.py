"""Reward model: Bradley-Terry training ranks held-out synthetic pairs; the saved RM reloads with its head."""

from __future__ import annotations

import pytest
import torch

from rlalign.cli import main
from rlalign.config import ConfigError, load_config
from rlalign.lm.data import load_preferences
from rlalign.lm.heads import load_reward_model
from rlalign.lm.models import load_tokenizer
from rlalign.tasks.preference import preference_records
from rlalign.train.metrics import read_metrics
from rlalign.train.reward_model import RMConfig, evaluate_pairs, train

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false"]


@pytest.mark.slow
def test_reward_model_ranks_held_out_pairs(tmp_path):
    cfg = load_config(RMConfig, None, TINY + [f"output_dir={tmp_path}", "max_steps=60", "eval_every=60", "data.num_train=2560", "data.num_eval=300",
                                              "optim.lr=2e-3", "center_coef=0.01", "use_margin=false"])
    result = train(cfg)
    assert result["eval/accuracy"] >= 0.9, result
    assert result["eval/accuracy"] > result["eval/accuracy_initial"]
    assert result["eval/margin"] > 0
    # the saved model reloads with its head and gives the same held-out accuracy
    rm, tok = load_reward_model(tmp_path / "final"), load_tokenizer(tmp_path / "final")
    held_out = load_preferences(preference_records("eval", 300, seed=0))
    assert evaluate_pairs(rm, tok, held_out, max_length=64)["eval/accuracy"] == pytest.approx(result["eval/accuracy"])


def test_cli_smoke_with_margin(tmp_path, capsys):
    assert main(["rm", f"output_dir={tmp_path}", *TINY, "max_steps=2", "eval_every=1", "data.num_train=16", "data.num_eval=8", "use_margin=true", "batch_size=4"]) == 0
    assert f'"final": "{tmp_path / "final"}"' in capsys.readouterr().out.strip().splitlines()[-1]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert {"loss/rm", "accuracy", "margin", "eval/accuracy", "eval/margin"} <= set(records[-1])
    assert torch.isfinite(torch.tensor(records[-1]["loss/rm"]))


def test_lora_is_rejected_for_reward_models():
    with pytest.raises(ConfigError, match="model.lora is not supported"):
        load_config(RMConfig, None, ["model.lora.r=4"])


def test_rm_saves_a_hugging_face_sequence_classifier_with_rlaligns_scores(tmp_path):
    from transformers import AutoModelForSequenceClassification

    cfg = load_config(RMConfig, None, TINY + [f"output_dir={tmp_path}", "max_steps=2", "save_every=1", "eval_every=2", "data.num_train=16",
                                              "data.num_eval=8", "batch_size=4", "center_coef=0.1"])
    train(cfg)
    tok = load_tokenizer(tmp_path / "final")
    assert tok.pad_token_id != tok.eos_token_id
    rows = [tok("Q: 1+1\nA:")["input_ids"] + tok(" 2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], tok("hi")["input_ids"] + [tok.eos_token_id]]
    width = max(map(len, rows))
    ids = torch.tensor([row + [tok.pad_token_id] * (width - len(row)) for row in rows])  # right padding, as transformers' classifier needs
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    for saved in (tmp_path / "final", max((tmp_path / "checkpoints").iterdir()) / "model"):
        hf, info = AutoModelForSequenceClassification.from_pretrained(saved, output_loading_info=True)
        assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1 and hf.config.pad_token_id == tok.pad_token_id
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        rm = load_reward_model(saved)
        assert rm.head.bias is None or rm.head.bias.item() == 0.0
        with torch.no_grad():
            torch.testing.assert_close(hf.eval()(input_ids=ids, attention_mask=mask).logits[:, 0], rm.sequence_scores(ids, mask), rtol=0, atol=1e-5)


def test_pairs_are_cut_at_trls_length_for_files_and_the_cut_is_reported():
    # TRL's RewardConfig and DPOConfig cut at 1024 tokens; 64 (the embedded task's length) cut real pairs' prompts away unannounced
    from rlalign.lm.data import PreferenceExample
    from rlalign.tasks.tiny_model import build_char_tokenizer
    from rlalign.train.dpo import DPOConfig
    from rlalign.train.reward_model import pair_cut_report

    for config in (RMConfig, DPOConfig):
        assert config().data.length_limit() == 64  # the embedded task
        files = {"data": {"train_file": "pairs.jsonl", "eval_file": "pairs.jsonl"}}
        assert config(**files).data.length_limit() == 1024
        assert config(data={**files["data"], "max_length": 100}).data.length_limit() == 100
    # each pair's length is its prompt with its longer response: BOS + "1+2=" + "45<eos>6" + EOS = 10, then 11, 8 and 6
    pairs = [PreferenceExample("1+2=", "3", "45<eos>6"), PreferenceExample("abcd", "xyz", "yy<eos>zz"), PreferenceExample("q", "hello", "h"),
             PreferenceExample("zz", "ab", "ba")]
    report = pair_cut_report(build_char_tokenizer(), pairs, 8)
    assert report == "data: max_length=8 cuts 2 of the 4 pairs checked (the longest has 11 tokens)"


def test_margins_are_used_when_the_data_has_them_as_in_trl():
    from rlalign.lm.data import PreferenceExample
    from rlalign.train.reward_model import margins_used

    with_margin, without = [PreferenceExample("p", "a", "b", 1.5), PreferenceExample("p", "a", "c")], [PreferenceExample("p", "a", "b")]
    assert margins_used(None, with_margin) and not margins_used(None, without)  # null: TRL's rule
    assert not margins_used(False, with_margin) and margins_used(True, with_margin)
    with pytest.raises(ConfigError, match="use_margin: true, but the training pairs have no 'margin' column"):
        margins_used(True, without)
