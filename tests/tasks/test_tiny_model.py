"""The tiny-model recipe saves an ordinary checkpoint that the Auto classes load."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_checkpoint


def test_char_tokenizer_round_trips_characters():
    tok = build_char_tokenizer()
    text = "12+35=47 word: cat\nok"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character after <bos>
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_checkpoint_loads_with_auto_classes(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM) and model.config.model_type == "llama"
    assert tok.decode(tok("7-3=")["input_ids"], skip_special_tokens=True) == "7-3="  # our tokenizer, not a swapped-in one
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == "user: hi\nassistant: "
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
