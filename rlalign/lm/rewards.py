"""Reward functions: ``fn(prompts: list[str], completions: list[str]) -> list[float]``, one score a pair.

Rule-based (verifiable) rewards and a wrapper that turns a reward model into a reward function:

    reward_fns = [math_answer({"What is 2+2?": "4"}), format_check(r"\\d+")]
    scores = score_completions(reward_fns, prompts, completions, weights=[1.0, 0.1])   # (B,)

How functions are called (TRL's keywords, ``async def`` concurrently) and checked (a failure is an
error naming the function and the prompt, never a silent 0): :mod:`rlalign.lm.reward_calls`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlalign.lm.data import Messages, Prompt, PreferenceExample
from rlalign.lm.encoding import collate_preferences, example_tokens
from rlalign.lm.heads import HEAD_FILE, REWARD_INPUT_KEY
from rlalign.lm.models import resolve_model_path
from rlalign.lm.reward_calls import RewardFunctionError, call_reward, check_finite, reward_fn_name, score_completions

__all__ = [
    "RewardFn",
    "RewardFunctionError",
    "exact_match",
    "math_answer",
    "format_check",
    "RewardModelReward",
    "RewardInput",
    "reward_input_of",
    "reward_fn_name",
    "score_completions",
    "call_reward",
    "check_finite",
]


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]: ...


def row_references(references: Mapping[str, str] | None, prompts: list[str], columns: Mapping[str, Sequence], column: str, name: str) -> list[str]:
    """Each row's reference: its own ``column`` value when the rows' columns are passed (as keywords),
    else the ``references`` value of its prompt text (None there: the prompt has several)."""
    if column in columns:
        return [str(value) for value in columns[column]]
    if references is None:
        raise KeyError(f"{name}: no {column!r} column for these prompts")
    for p in prompts:
        if references.get(p) is None:
            raise KeyError(f"{name}: no {column!r} for prompt {p!r}" if p not in references else f"{name}: prompt {p!r} has several {column!r} values; pass the rows' {column!r} column")
    return [references[p] for p in prompts]


def exact_match(references: Mapping[str, str] | None = None, strip: bool = True) -> RewardFn:
    """1.0 when the completion equals its reference (whitespace-stripped), else 0.0. The reference is
    the row's ``answer`` column (``references`` None), or the ``references`` value of its prompt."""

    def exact_match_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
        refs = row_references(references, prompts, columns, "answer", "exact_match")
        return [float(c.strip() == r.strip()) if strip else float(c == r) for c, r in zip(completions, refs, strict=True)]

    return exact_match_reward


def math_answer(references: Mapping[str, str] | None = None) -> RewardFn:
    """1.0 when ``math_verify`` finds the completion's answer equal to its reference (e.g. "1/2" vs
    "0.5", "\\boxed{4}" vs "4"), else 0.0; None where the reference itself does not parse (as TRL's
    ``accuracy_reward``: the term leaves those completions' sum); the reference as in :func:`exact_match`.

    The completion is parsed with math-verify's defaults (LaTeX and plain expressions, a bare number
    counts: "The answer is 4" scores 1 against "4"), where TRL's ``accuracy_reward`` takes only LaTeX: an
    answer in ``\\boxed{}``, or in ``$...$`` after an anchor such as "The answer is", and scores "4" or "$4$" 0. Off the
    main thread (async rollouts' scoring, a term's ``timeout_s``) math-verify's own time limits, which
    need ``signal.alarm``, are off, as TRL turns them off there."""
    from math_verify import parse, verify

    def math_answer_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        main = threading.current_thread() is threading.main_thread()
        parse_s, verify_s = (10, 5) if main else (None, None)  # TRL's limits; signal.alarm raises off the main thread
        if not main:  # its warning that the limits are off, once a call: TRL quiets it too
            for logger in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(logger).setLevel(logging.ERROR)
        out: list[float | None] = []
        for c, r in zip(completions, row_references(references, prompts, columns, "answer", "math_answer"), strict=True):
            gold = parse(r, parsing_timeout=parse_s)
            if not gold:
                out.append(None)
                continue
            answer = parse(c, parsing_timeout=parse_s)
            out.append(1.0 if answer and verify(gold, answer, timeout_seconds=verify_s) else 0.0)
        return out

    return math_answer_reward


def format_check(pattern: str, full_match: bool = True) -> RewardFn:
    """1.0 when the completion matches the regular expression ``pattern`` (whole string by default)."""
    regex = re.compile(pattern, re.DOTALL)
    match = regex.fullmatch if full_match else regex.search

    def format_reward(prompts: list[str], completions: list[str]) -> list[float]:
        return [1.0 if match(c) else 0.0 for c in completions]

    return format_reward


RewardInput = Literal["text", "eos"]


def reward_input_of(path) -> RewardInput:
    """How the reward model at ``path`` was trained to read prompt + completion: what its config.json
    records under ``rlalign_reward_input`` (``rlalign rm`` writes "eos"); "eos" for the older rlalign
    format (backbone + value_head.safetensors); else "text", the convention of Hugging Face reward models."""
    path = resolve_model_path(path)
    config_file = path / "config.json"
    recorded = json.loads(config_file.read_text()).get(REWARD_INPUT_KEY) if config_file.is_file() else None
    if recorded is not None:
        if recorded not in ("text", "eos"):
            raise ValueError(f"{config_file}: {REWARD_INPUT_KEY} is {recorded!r}, expected 'text' or 'eos'")
        return recorded
    return "eos" if (path / HEAD_FILE).is_file() else "text"


REWARD_INPUT_TEXT = {
    "text": "prompt + completion as its tokenizer encodes the text (no special tokens added; conversations through its chat template), "
    "read at the last token that is not padding: as transformers and TRL score it",
    "eos": "rlalign's training format: the prompt as the policy reads it, then the completion closed by EOS, read at that EOS",
}


class RewardModelReward:
    """A reward model as a reward function: r(x, y), one forward pass per batch of ``batch_size`` pairs, no gradients.

    ``input_format`` says how prompt + completion reach the model (:func:`reward_input_of` reads it
    from a checkpoint):

    - ``"text"``: as transformers / TRL's ``GRPOTrainer`` score a Hugging Face sequence classifier, and
      as public reward models are meant to be used. A text prompt and its completion are joined as
      text (``prompt + completion``); a conversation (prompt messages + the assistant's completion) is
      rendered by the reward tokenizer's chat template (``tokenize=False``, no generation prompt).
      The text is tokenized with ``add_special_tokens=False``, right-padded, positions 0..T-1, and
      the score is read at the last token whose id is not the pad id (the tokenizer's pad token, its
      EOS when it has none, as TRL sets it): transformers' ``*ForSequenceClassification`` rule.
    - ``"eos"``: how ``rlalign rm`` trains (:func:`rlalign.lm.encoding.collate_preferences`): the prompt
      encoded as the policy reads it, the completion's tokens closed by EOS, the score read at that
      EOS; sequences longer than ``max_length`` (default: the model's positions) keep their last
      tokens, as ``rlalign rm`` trains them, and are counted (:meth:`pop_stats`: ``cut``).

    ``prompts`` are the data's prompts (text or messages) and ``completions`` the completions' texts
    (or their assistant messages), as the trainers pass them.
    """

    def __init__(
        self, model, tokenizer: PreTrainedTokenizerBase, input_format: RewardInput = "text", batch_size: int = 32, max_length: int | None = None
    ):
        if input_format not in ("text", "eos"):
            raise ValueError(f"input_format must be 'text' or 'eos', got {input_format!r}")
        self.model, self.tokenizer, self.input_format = model, tokenizer, input_format
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None) if hasattr(model, "config") else None
        self.batch_size, self.max_length = batch_size, max_length or context or 1024  # a fixed 1024 cut longer rows' prompts away silently
        self.cut = self._cut_logged = 0  # eos rows longer than max_length (their first tokens dropped)
        self.name = f"RewardModelReward({getattr(model.config, 'name_or_path', '') or type(model).__name__})"
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list) -> list[float]:
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            batch = slice(start, start + self.batch_size)
            score = self._text_scores if self.input_format == "text" else self._eos_scores
            scores.extend(score(prompts[batch], completions[batch], device).tolist())
        return scores

    def pop_stats(self) -> dict[str, float]:
        """{"cut": eos rows longer than ``max_length`` scored on their last tokens} since the last call (``reward/<name>/cut``)."""
        cut, self._cut_logged = self.cut - self._cut_logged, self.cut
        return {"cut": float(cut)} if self.input_format == "eos" else {}

    def _eos_scores(self, prompts: list, completions: list, device) -> Tensor:
        pairs = [PreferenceExample(p, c, c) for p, c in zip(prompts, completions, strict=True)]
        self.cut += sum(len(example_tokens(self.tokenizer, p, c)[0]) > self.max_length for p, c in zip(prompts, completions))
        batch = collate_preferences(self.tokenizer, pairs, self.max_length)
        n = batch.num_pairs
        ids, mask = batch.input_ids[:n].to(device), batch.attention_mask[:n].to(device)  # (n, T): the "chosen" half
        return self.model.sequence_scores(ids, mask)  # (n,)

    def text(self, prompt: Prompt, completion: str | Messages) -> str:
        """The text the model scores in the "text" format (TRL's ``prompt + completion``, or the chat template's rendering)."""
        if isinstance(prompt, str):
            return prompt + (completion if isinstance(completion, str) else "".join(m["content"] for m in completion))
        if not getattr(self.tokenizer, "chat_template", None):
            raise RewardFunctionError(
                f"{self.name}: the prompt is a conversation but the reward model's tokenizer has no chat template, so it cannot be "
                f"scored as TRL scores it; give its tokenizer a chat template or set input_format: eos (prompt {prompt!r})"
            )
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(list(prompt) + list(messages), tokenize=False)

    def _text_scores(self, prompts: list, completions: list, device) -> Tensor:
        if self.pad_id is None:
            raise RewardFunctionError(f"{self.name}: its tokenizer has neither a pad nor an EOS token, so a batch has no padding to read past")
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        encoded = self.tokenizer(texts, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt")
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)  # (n, T)
        context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and ids.shape[1] > context:
            longest = int(mask.sum(1).argmax())
            raise RewardFunctionError(f"{self.name}: prompt + completion is {int(mask[longest].sum())} tokens, over the reward model's {context} positions (prompt {prompts[longest]!r})")
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)  # (n, T): transformers numbers them so whatever the padding
        values = self.model(ids, mask, position_ids=positions)  # (n, T)
        last = (positions * (ids != self.pad_id)).argmax(-1)  # (n,): transformers' last non-pad token
        return values.gather(1, last[:, None]).squeeze(1)  # (n,)
