"""The tiny-model recipe: a character-level tokenizer and a small LlamaForCausalLM, built offline.

    path = build_tiny_checkpoint("runs/tiny", TinyModelSpec(hidden_size=128, num_layers=4))
    model = AutoModelForCausalLM.from_pretrained(path); tokenizer = AutoTokenizer.from_pretrained(path)

The tokenizer is a ``tokenizers`` WordLevel model whose vocabulary is one token per printable ASCII
character (plus newline) and four special tokens (<pad>, <bos>, <eos>, <unk>); a ``Split`` pre-
tokenizer cuts the text into single characters and the ``Fuse`` decoder joins them back without
spaces. A prompt gets <bos> prepended (``add_special_tokens=True``); completions are encoded without
it. A minimal chat template ("role: content" lines, then "assistant: ") is attached, so chat-message
datasets work with the tiny model too.

The model type is ``llama``: with a custom tokenizer a ``qwen2`` config would make transformers 5's
AutoTokenizer swap in Qwen2's byte-level tokenizer.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "PAD_TOKEN",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "UNK_TOKEN",
    "CHAT_TEMPLATE",
    "TinyModelSpec",
    "build_char_tokenizer",
    "build_tiny_llama",
    "build_tiny_checkpoint",
]

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
_SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
_CHARACTERS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")  # 95 printable + "\n"

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Llama. Defaults: about 0.4M parameters, a few ms per forward on one core."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ids 0..3 are <pad>, <bos>, <eos>, <unk>."""
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    for char in _CHARACTERS:
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_llama(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM sized by ``spec`` for ``tokenizer``'s vocabulary."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_tiny_checkpoint(path: str | Path, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> Path:
    """Build the tokenizer and a random tiny Llama and save both to ``path`` (an ordinary HF dir).

    Returns ``path``; ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)`` load it.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(tokenizer, spec, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_on_conversations(tokenizer: PreTrainedTokenizerFast, records: list[dict], steps: int, seed: int = 0, lr: float = 3e-3,
                           spec: TinyModelSpec = TinyModelSpec(hidden_size=128, num_layers=2, intermediate_size=256), batch_size: int = 32) -> LlamaForCausalLM:
    """A fresh tiny Llama trained on whole conversations (``{"messages": [...]}``), the loss on the
    assistant turns only (each closed by EOS, as the chat template renders them): :func:`train_on_rows`.
    The quick SFT start of the agent learning tests and benchmarks; ``rlalign sft`` is the trainer for real use."""
    from rlalign.lm.encoding import example_tokens

    rows = []
    for record in records:
        ids, target = example_tokens(tokenizer, None, record["messages"])
        rows.append((ids, [i if t else -100 for i, t in zip(ids, target)]))
    return train_on_rows(tokenizer, rows, steps, seed, lr, spec, batch_size)


def train_on_rows(tokenizer: PreTrainedTokenizerFast, rows: list[tuple[list[int], list[int]]], steps: int, seed: int = 0, lr: float = 3e-3,
                  spec: TinyModelSpec = TinyModelSpec(hidden_size=128, num_layers=2, intermediate_size=256), batch_size: int = 32) -> LlamaForCausalLM:
    """A fresh tiny Llama (``spec``, weights drawn with ``seed``) trained on ``rows`` of (token ids,
    labels; -100 where no loss): ``steps`` AdamW steps of ``batch_size`` rows drawn with ``seed``,
    right-padded, gradients clipped at 1. Returns the model in eval mode."""
    import random

    model = build_tiny_llama(tokenizer, spec, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(rows, batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in batch])  # (B, T)
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])  # (B, T)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model.eval()
