"""A reward model saves as a Hugging Face sequence-classification checkpoint that transformers loads
whole and that scores what rlalign scores; the old format (backbone + value_head.safetensors) still loads."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel

from rlalign.lm import heads
from rlalign.lm.heads import HEAD_FILE, ScalarHeadModel, load_critic, load_reward_model
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint

# right-padded after each row's EOS (2); the character tokenizer's pad is 0, not its EOS
IDS = torch.tensor([[1, 40, 41, 42, 43, 2], [1, 50, 51, 2, 0, 0], [1, 60, 2, 0, 0, 0]])
MASK = (IDS != 0).long()


def _tiny_llama(path, tokenizer):
    build_tiny_checkpoint(path, TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64))
    return path


def _tiny_gpt2(path, tokenizer):
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(params=["llama", "gpt2"])
def base(request, tmp_path, tokenizer):
    make = _tiny_llama if request.param == "llama" else _tiny_gpt2
    return request.param, make(tmp_path / f"base_{request.param}", tokenizer)


def _trained_rm(path) -> ScalarHeadModel:
    """What ``rlalign rm`` trains: a head without bias, here with weights moved off their init."""
    rm = load_reward_model(path, trainable=True).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        rm.head.weight.normal_(std=1.0)
        for p in rm.backbone.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return rm


def _tensor_names(path) -> set[str]:
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("gathered", [False, True], ids=["live", "state_dict"])
def test_a_reward_model_saves_as_a_hugging_face_sequence_classifier(base, tmp_path, tokenizer, gathered):
    arch, path = base
    rm = _trained_rm(path)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    out = tmp_path / "final"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pad != eos: nothing to warn about
        # state_dict: what FSDP gathers (keys backbone.*, head.weight)
        rm.save_pretrained(out, state_dict=rm.state_dict() if gathered else None)
    tokenizer.save_pretrained(out)

    config = json.loads((out / "config.json").read_text())
    cls_name, prefix = ("LlamaForSequenceClassification", "model") if arch == "llama" else ("GPT2ForSequenceClassification", "transformer")
    assert config["architectures"] == [cls_name] and config["pad_token_id"] == tokenizer.pad_token_id
    assert len(config["id2label"]) == 1 and AutoConfig.from_pretrained(out).num_labels == 1  # transformers 5 writes num_labels as id2label
    assert not (out / HEAD_FILE).exists()
    names = _tensor_names(out)
    assert "score.weight" in names and "score.bias" not in names
    assert all(name == "score.weight" or name.startswith(f"{prefix}.") for name in names)

    hf, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == cls_name
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected = rm.sequence_scores(IDS, MASK)
    with torch.no_grad():
        hf_scores = hf.eval()(input_ids=IDS, attention_mask=MASK).logits[:, 0]
        torch.testing.assert_close(hf_scores, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(load_reward_model(out).sequence_scores(IDS, MASK), expected, rtol=0, atol=1e-5)
        critic = load_critic(out)  # PPO's critic starts from the reward model: same scores, a bias of 0 to train
        assert critic.head.bias.item() == 0.0 and critic.head.bias.requires_grad
        torch.testing.assert_close(critic.sequence_scores(IDS, MASK), expected, rtol=0, atol=1e-5)
        again = load_reward_model(out, trainable=True)  # training on from it (resume) keeps the head, still without bias
        assert again.head.bias is None
        torch.testing.assert_close(again.sequence_scores(IDS, MASK), expected, rtol=0, atol=1e-5)


def test_pad_equal_to_eos_warns_that_transformers_reads_one_token_earlier(tmp_path, tokenizer):
    rm = _trained_rm(_tiny_llama(tmp_path / "base", tokenizer))
    rm.pad_token_id = rm.eos_token_id = tokenizer.eos_token_id  # what load_tokenizer gives a tokenizer without a pad token
    with pytest.warns(UserWarning, match="pad token .* is its EOS token.*one token before the closing EOS"):
        rm.save_pretrained(tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / "config.json").read_text())["pad_token_id"] == tokenizer.eos_token_id


def test_the_old_format_still_loads_as_reward_model_and_critic(tmp_path, tokenizer):
    base = _tiny_llama(tmp_path / "base", tokenizer)
    old = tmp_path / "old_rm"
    backbone = AutoModel.from_pretrained(base)
    backbone.save_pretrained(old)
    tokenizer.save_pretrained(old)
    torch.manual_seed(2)
    weight, bias = torch.randn(1, 32), torch.tensor([0.75])
    save_file({"weight": weight, "bias": bias}, str(old / HEAD_FILE), metadata={"format": "rlalign-scalar-head"})
    with torch.no_grad():
        hidden = backbone.eval()(input_ids=IDS, attention_mask=MASK).last_hidden_state  # right padding: default positions agree
        expected = (hidden @ weight.T).squeeze(-1)[torch.arange(3), MASK.sum(1) - 1] + bias
        torch.testing.assert_close(load_reward_model(old).sequence_scores(IDS, MASK), expected, rtol=0, atol=1e-5)
        critic = load_critic(old)
        assert critic.head.bias.item() == 0.75
        torch.testing.assert_close(critic.sequence_scores(IDS, MASK), expected, rtol=0, atol=1e-5)
        # training on from an old reward model: the bias goes (Bradley-Terry cannot see it), with a warning
        with pytest.warns(UserWarning, match="bias 0.75 is dropped"):
            trainable = load_reward_model(old, trainable=True)
        assert trainable.head.bias is None
        torch.testing.assert_close(trainable.sequence_scores(IDS, MASK), expected - 0.75, rtol=0, atol=1e-5)


def test_without_a_sequence_classification_class_the_head_goes_to_value_head_file(tmp_path, tokenizer, monkeypatch):
    rm = _trained_rm(_tiny_llama(tmp_path / "base", tokenizer))

    def no_class(config, **kwargs):
        raise ValueError(f"Unrecognized configuration class {type(config)}")

    monkeypatch.setattr(heads.AutoModelForSequenceClassification, "from_config", no_class)
    with pytest.warns(UserWarning, match="no sequence-classification model"):
        rm.save_pretrained(tmp_path / "rm")
    assert (tmp_path / "rm" / HEAD_FILE).is_file()
    torch.testing.assert_close(load_reward_model(tmp_path / "rm").sequence_scores(IDS, MASK), rm.sequence_scores(IDS, MASK), rtol=0, atol=1e-5)


def test_the_load_report_about_the_classifier_head_alone_is_dropped():
    report_filter = heads._ScoreOnlyLoadReport()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1, message, None, None)

    score_only = "LlamaModel LOAD REPORT from: x\nKey          | Status     |  | \n-------------+------------+--+-\nscore.weight | UNEXPECTED |  | \n"
    missing = score_only + "model.norm.weight | MISSING |  | \n"
    assert not report_filter.filter(record(score_only))
    assert report_filter.filter(record(missing))  # anything else keeps the whole report
    assert report_filter.filter(record("some other warning"))
