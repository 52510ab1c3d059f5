"""Examples as tokens: prompts rendered and encoded for sampling, and batches of the SFT and
preference examples that :mod:`rlalign.lm.data` reads.

    ids = encode_prompts(tokenizer, prompts)                       # for rlalign.lm.sampling.sample
    batch = collate_sft(tokenizer, examples, max_length=512)       # or pack_sft: examples end to end
    pairs = collate_preferences(tokenizer, pairs)                  # reward model: prompt + response rows
    pairs = collate_preference_completions(tokenizer, pairs)       # DPO: prompts and completions apart

A conversational prompt is rendered with the tokenizer's chat template (``add_generation_prompt``),
else as "role: content" lines followed by "assistant: "; a conversational completion is what the
template adds for it after the prompt (:func:`example_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlalign.core.masks import position_ids_from_mask
from rlalign.lm.data import DataError, Messages, PreferenceExample, Prompt, SFTExample

__all__ = [
    "render_prompt",
    "completion_text",
    "final_answer",
    "encode_prompts",
    "example_tokens",
    "SFTBatch",
    "collate_sft",
    "sft_row",
    "pack_sft",
    "PreferenceBatch",
    "collate_preferences",
    "explicit_prompt",
    "PreferenceCompletionBatch",
    "collate_preference_completions",
]


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


def final_answer(completion: str | Messages) -> str:
    """The answer a built-in reward scores: a text completion itself, else the contents of its last run of
    assistant messages joined (a single-turn completion's messages; a multi-turn episode's final turn, after
    its last tool reply; of an episode the environment ended after a tool reply, its last assistant turn)."""
    if isinstance(completion, str):
        return completion
    end = len(completion)
    while end > 0 and completion[end - 1].get("role") != "assistant":  # the environment's replies after the last turn (it set done)
        end -= 1
    start = end
    while start > 0 and completion[start - 1].get("role") == "assistant":
        start -= 1
    return "".join(m.get("content") or "" for m in completion[start:end])


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
    if prompt is None and isinstance(completion, str):  # closed by EOS unless it already ends with it (TRL's rule)
        ids = tokenizer(completion)["input_ids"]
        ids = ids if tokenizer.eos_token and completion.endswith(tokenizer.eos_token) else ids + [tokenizer.eos_token_id]
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
    return [sft_row(tokenizer, ex, max_length, completion_only)[:2] for ex in examples]


def sft_row(tokenizer: PreTrainedTokenizerBase, ex: SFTExample, max_length: int, completion_only: bool = True) -> tuple[list[int], list[int], int]:
    """The example's (ids, is_target) (:func:`example_tokens`) cut to ``max_length`` tokens, and its length before the cut.

    Raises:
        DataError: when the cut leaves the example none of its target tokens (it would train on nothing, silently).
    """
    ids, is_target = example_tokens(tokenizer, ex.prompt, ex.completion, completion_only)
    if any(is_target) and not any(is_target[:max_length]):
        raise DataError(f"max_length={max_length} cuts every target token of the example {_shown(ex)}: it has {len(ids)} tokens and its first target "
                        f"token is token {is_target.index(1) + 1}; raise max_length (data.max_length)")
    return ids[:max_length], is_target[:max_length], len(ids)


def _at(ex: SFTExample | PreferenceExample) -> str:
    """"FILE, line N: " for a message about an example read from a file, else ""."""
    return f"{ex.where}: " if ex.where else ""


def _shown(ex: SFTExample) -> str:
    """The example as a message names it: its file and line where it has them, with the start of its text."""
    text = repr(ex.prompt if ex.prompt is not None else ex.completion)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"at {ex.where} ({text})" if ex.where else text


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
    the restarts as sequence boundaries and keeps attention within each example, and an example's
    first token is no target (nothing of the example comes before it, as in a padded row), so the
    loss of a packed batch equals that of the unpacked one while wasting no compute on padding. The
    model must keep packed rows apart (:func:`rlalign.lm.logprobs.packs_rows`), and the forward must
    run with ``use_cache=False``: with a cache, transformers skips the packed-sequence check.
    """
    rows = _sft_rows(tokenizer, examples, max_length, completion_only)
    packed: list[tuple[list[int], list[int], list[int]]] = []  # (ids, targets, positions)
    for ids, target in rows:
        if not packed or len(packed[-1][0]) + len(ids) > max_length:
            packed.append(([], [], []))
        packed[-1][0].extend(ids)
        packed[-1][1].extend([0] + target[1:])  # an example's first token is no target: the one before it ends another example (TRL masks position 0)
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
    characters for texts (moved back before a space the responses differ after; one short of it where
    one response is the start of the other, as TRL's loop ends). A pair with a prompt is returned as it is.

    Raises:
        DataError: when chosen and rejected share no start, so there is no prompt to condition on.
    """
    if example.prompt is not None:
        return example
    chosen, rejected = example.chosen, example.rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == min(len(chosen), len(rejected)):
        shared -= 1  # one is the start of the other (or both the same): TRL's loop ends a character (a message) short of it
    elif isinstance(chosen, str) and shared > 0 and chosen[shared - 1] == " ":
        shared -= 1  # the responses start with the space (TRL's convention)
    if shared == 0:
        raise DataError(f"{_at(example)}a pair with no prompt column whose chosen and rejected responses share no start, so no prompt can be "
                        f"extracted: chosen {chosen!r:.60}, rejected {rejected!r:.60}")
    return PreferenceExample(chosen[:shared], chosen[shared:], rejected[shared:], example.margin, example.where)


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
            raise DataError(f"{_at(ex)}the prompt {ex.prompt!r:.60} has no token: give the tokenizer a BOS token or the pair a non-empty prompt")
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
