"""A Hugging Face reward model scores in rlalign what it scores in transformers and TRL.

The oracle is transformers itself: ``AutoModelForSequenceClassification.from_pretrained(dir)`` on the
text TRL's GRPOTrainer builds (prompt + completion, or the reward tokenizer's chat template over the
conversation), tokenized with ``add_special_tokens=False``, one row at a time (no padding at all), and
``logits[0, 0]``. rlalign scores whole batches, right-padded whatever the tokenizer's padding side.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from rlalign.lm.heads import ScalarHeadModel, load_reward_model
from rlalign.lm.models import load_tokenizer
from rlalign.lm.rewards import RewardModelReward, reward_input_of
from rlalign.lm.reward_calls import RewardFunctionError
from rlalign.tasks.tiny_model import build_char_tokenizer

PROMPTS = ["12+7=", "What is 3*4? ", "Say hi.", "9-9="]
COMPLETIONS = ["19", " 12, since 3*4 = 12", "hi there!", ""]
CONVERSATIONS = [[{"role": "user", "content": p}] for p in PROMPTS]
EOT = "<|endoftext|>"


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer as GPT-2's, trained here on a few lines; no pad token of its own
    (its pad is its EOS, as for GPT-2 reward models), and merges that join prompt and completion."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [p + c for p, c in zip(PROMPTS, COMPLETIONS)] * 20 + ["the quick brown fox jumps over the lazy dog 0123456789 +-*/=?!"] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOT, bos_token=EOT, pad_token=EOT, padding_side="left")


def save_gpt2_rm(path, tokenizer):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, initializer_range=0.2)
    GPT2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_llama_rm(path, tokenizer):
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, num_labels=1, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, initializer_range=0.2)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def transformers_scores(path, prompts, completions) -> list[float]:
    """TRL's GRPOTrainer reward-model branch, one row at a time: the peer's number for each pair."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = load_tokenizer(path)
    scores = []
    for p, c in zip(prompts, completions):
        text = p + c if isinstance(p, str) else tokenizer.apply_chat_template(p + [{"role": "assistant", "content": c}], tokenize=False)
        with torch.no_grad():
            scores.append(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item())
    return scores


def rlalign_scores(path, prompts, completions, padding_side="left", batch_size=4) -> list[float]:
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = padding_side  # the reward model pads right whatever the tokenizer says
    completions = [c if isinstance(p, str) else [{"role": "assistant", "content": c}] for p, c in zip(prompts, completions)]  # as the trainers pass them
    return RewardModelReward(load_reward_model(path), tokenizer, reward_input_of(path), batch_size=batch_size)(prompts, completions)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_text_prompts_score_as_in_transformers(tmp_path, arch, padding_side):
    # gpt2: byte-level BPE whose pad is its EOS; llama: the character tokenizer, pad 0, a BOS it would add with special tokens
    path = save_gpt2_rm(tmp_path / "rm", bpe_tokenizer()) if arch == "gpt2" else save_llama_rm(tmp_path / "rm", build_char_tokenizer())
    assert reward_input_of(path) == "text"
    expected = transformers_scores(path, PROMPTS, COMPLETIONS)
    got = rlalign_scores(path, PROMPTS, COMPLETIONS, padding_side)
    assert len(set(round(e, 4) for e in expected)) == len(expected)  # varied scores: a wrong reading position shows
    assert got == pytest.approx(expected, abs=2e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_conversations_go_through_the_reward_models_own_chat_template(tmp_path, arch):
    tokenizer = bpe_tokenizer() if arch == "gpt2" else build_char_tokenizer()
    # the template closes every turn with EOS: with pad == EOS (gpt2), transformers reads the token before it, and so must rlalign
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}" + tokenizer.eos_token + "{% endfor %}"
    path = (save_gpt2_rm if arch == "gpt2" else save_llama_rm)(tmp_path / "rm", tokenizer)
    expected = transformers_scores(path, CONVERSATIONS, COMPLETIONS)
    assert rlalign_scores(path, CONVERSATIONS, COMPLETIONS) == pytest.approx(expected, abs=2e-5)
    assert rlalign_scores(path, CONVERSATIONS, COMPLETIONS, batch_size=1) == pytest.approx(expected, abs=2e-5)


def test_the_old_reading_differs_from_transformers(tmp_path):
    """The bug this guards: an EOS appended to text that does not hold one moves every score."""
    path = save_gpt2_rm(tmp_path / "rm", bpe_tokenizer())
    tokenizer = load_tokenizer(path)
    appended = RewardModelReward(load_reward_model(path), tokenizer, "eos")(PROMPTS, COMPLETIONS)
    expected = transformers_scores(path, PROMPTS, COMPLETIONS)
    assert all(abs(a - e) > 1e-3 for a, e in zip(appended, expected))


def test_a_conversation_without_a_chat_template_is_a_clear_error(tmp_path):
    tokenizer = bpe_tokenizer()
    path = save_gpt2_rm(tmp_path / "rm", tokenizer)
    with pytest.raises(RewardFunctionError, match="no chat template.*input_format: eos"):
        rlalign_scores(path, CONVERSATIONS[:1], COMPLETIONS[:1])


def test_a_text_longer_than_the_reward_models_positions_names_the_prompt(tmp_path):
    path = save_llama_rm(tmp_path / "rm", build_char_tokenizer())
    with pytest.raises(RewardFunctionError, match=r"over the reward model's 128 positions \(prompt 'long"):
        rlalign_scores(path, ["short", "long" + "x" * 200], ["a", "b"])


def test_a_reward_model_saved_by_rlalign_records_and_keeps_its_eos_format(tmp_path):
    tokenizer = build_char_tokenizer()
    base = save_llama_rm(tmp_path / "base", tokenizer)
    rm = load_reward_model(base, trainable=True)  # what `rlalign rm` trains from
    rm.save_pretrained(tmp_path / "trained")
    tokenizer.save_pretrained(tmp_path / "trained")
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["rlalign_reward_input"] == "eos"
    assert reward_input_of(tmp_path / "trained") == "eos"
    # scored as trained: <bos> prompt completion <eos>, read at the EOS
    reloaded = load_reward_model(tmp_path / "trained")
    got = RewardModelReward(reloaded, load_tokenizer(tmp_path / "trained"), reward_input_of(tmp_path / "trained"))(PROMPTS, COMPLETIONS)
    for p, c, s in zip(PROMPTS, COMPLETIONS, got):
        ids = torch.tensor([tokenizer(p + c)["input_ids"] + [tokenizer.eos_token_id]])
        assert s == pytest.approx(reloaded.sequence_scores(ids, torch.ones_like(ids)).item(), abs=1e-5)


def test_the_old_rlalign_format_reads_as_eos(tmp_path):
    base = save_llama_rm(tmp_path / "base", build_char_tokenizer())
    critic = ScalarHeadModel.from_pretrained(base)  # a head with a bias saves as backbone + value_head.safetensors
    critic.save_pretrained(tmp_path / "old")
    assert reward_input_of(tmp_path / "old") == "eos"


@pytest.mark.parametrize("input_format", ["text", "eos"])
def test_more_prompts_than_completions_is_an_error_not_a_shorter_list(tmp_path, input_format):
    path = save_llama_rm(tmp_path / "rm", build_char_tokenizer())
    reward = RewardModelReward(load_reward_model(path), load_tokenizer(path), input_format)
    with pytest.raises(ValueError, match="zip"):
        reward(["ab", "c"], ["x"])


def test_a_two_label_head_in_torchs_format_scores_label_0_as_trl_does(tmp_path):
    # TRL's GRPOTrainer reads a reward model's logits[:, 0] whatever its labels; a checkpoint saved as pytorch_model.bin
    # (no safetensors) loads too. Both were errors.
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128, num_labels=2, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, initializer_range=0.2)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")  # an older checkpoint: torch's format only
    (tmp_path / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match="2 labels; the reward is label 0's logit"):
        ours = rlalign_scores(tmp_path, PROMPTS, COMPLETIONS)
    assert ours == pytest.approx(transformers_scores(tmp_path, PROMPTS, COMPLETIONS), abs=1e-5)
