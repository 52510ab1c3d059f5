"""A generative judge as a reward function: an LM is asked a rubric per completion and its answer
parsed to a score in [0, 1].

    judge = JudgeReward.from_pretrained("models/judge", max_score=10)        # a local causal LM
    judge = JudgeReward.remote("http://127.0.0.1:8000/v1", "judge-model")     # an OpenAI-compatible server
    scores = judge(prompts=prompts, completions=completions)                  # list[float | None]
    judge.pop_stats()                                                         # {"parse_failed": 1.0, ...}

Per completion the judge is sent one conversation: an optional system message, then the user
message ``template.format(prompt=..., completion=..., **the row's columns it names)`` (a template
may use ``{answer}`` to show a reference; a literal brace is written ``{{``). A prompt given as chat
messages is shown as "role: content" lines; a completion given as messages, as the contents of its
trailing assistant messages (a multi-turn episode's final answer: :func:`rlalign.lm.encoding.final_answer`).

Its answer is parsed by ``pattern`` (default: "Score: 7", "score = 7.5", "Score: 7/10", "7/10"; "score"
as a word, so ``best_score = 0`` is no verdict, and "Score: .5", "Score: −3" or "Score: 1e3" none):
judges reason first and give their verdict last, so of the pattern's matches the last one counts,
with two refinements. A group named ``of``, when it matched, is the scale the number is given on
("7/8"): such a match counts only when ``of`` equals ``max_score`` (else it is a quoted fraction, not
a verdict, and is passed over). And the pattern's alternatives are in order of preference: a match
whose number is in an earlier group wins over one whose number is in a later group, wherever they
are (so the default prefers an explicit "Score: N" to a bare "N/10"). The number x is the match's
first group that matched (the whole match when the pattern has no group but ``of``); x in
[min_score, max_score] gives (x - min_score) / (max_score - min_score). An answer with no such
match, or whose chosen match has x out of range, is a parse failure (never an earlier match): that
completion's reward is None (the term does not apply to it and is left out of its sum), it is
counted (``judge.failures``; :meth:`JudgeReward.pop_stats` gives the count since the last call, for
a trainer to log ``reward/<name>/parse_failed``) and logged, and when more than
``max_failure_fraction`` of a call's answers fail, the call raises :class:`RewardFunctionError`
naming the judge, a prompt and the judge's raw answer: a judge that cannot follow the format is
broken, not a source of zeros. Never a silent 0. An answer cut at the judge's token limit (no EOS, or
``finish_reason: length``; :class:`CutAnswer`) gives no number it ends in: "Score: 1" may be "Score: 10".

What the judge reads is never taken from the policy as control tokens: a completion (or a prompt,
a column) containing the literal text "<|im_end|>" reaches a local judge as those characters, not
as its end-of-turn token (:meth:`LocalJudge.encode`). A ``base_url`` judge gets the text as a
message's content, which that server tokenises as it does; the common marker shapes are defused
before they are sent (:class:`ChatEndpoint`).

Who answers is one seam, ``answer(conversations) -> list[str]`` (sync or ``async def``):

- :class:`LocalJudge`: a Hugging Face causal LM and its tokenizer, greedy. The conversation goes
  through the tokenizer's chat template when it has one (with the generation prompt), else its
  messages' contents joined by blank lines are the prompt text; the template's own text is
  tokenised with its control tokens, each message's content as plain text; decoding is rlalign's own sampler
  (:func:`rlalign.lm.sampling.sample` at temperature 0, which gives ``generate(do_sample=False)``'s
  tokens), ``batch_size`` conversations at a time, at most ``max_new_tokens`` tokens each. Prompts
  longer than the model's context are not truncated: keep the template and completions short enough.
- :class:`ChatEndpoint`: an OpenAI-compatible ``/chat/completions`` endpoint (vLLM, SGLang, llama.cpp,
  OpenAI), called with httpx (no ``openai`` package needed), temperature 0, one request per
  completion, ``max_concurrency`` in flight, retried as :class:`rlalign.lm.remote_reward.RemoteReward`
  retries.
- any function: a test's scripted judge, or another backend.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import torch
from transformers import PreTrainedTokenizerBase

from rlalign.lm.decode import SamplingParams
from rlalign.lm.encoding import final_answer
from rlalign.lm.model_modes import evaluating
from rlalign.lm.models import stop_token_ids
from rlalign.lm.remote_reward import RETRY_STATUSES, post_json, run_sync
from rlalign.lm.rewards import RewardFunctionError

__all__ = ["JudgeReward", "LocalJudge", "ChatEndpoint", "CutAnswer", "DEFAULT_TEMPLATE", "DEFAULT_PATTERN", "parse_score", "defuse_markers"]

logger = logging.getLogger(__name__)

Conversation = list[dict[str, str]]

DEFAULT_TEMPLATE = (
    "Rate the response to the prompt below for correctness and helpfulness, "
    "on a scale from 0 (worst) to 10 (best).\n\n"
    "[Prompt]\n{prompt}\n\n[Response]\n{completion}\n\n"
    'Reply with your rating in the form "Score: N" and nothing else.'
)
# "score" as a word (not best_score's), then a separator that takes no sign or point ("Score: .5", "Score: −3" never read
# as 5 or 3), and a whole number no exponent follows ("Score: 12e3" is no 1, "Score: 7.5e1" no 7)
DEFAULT_PATTERN = (r"(?i)(?:\bscore[^\w.\-\u2212]{0,5}(-?\d+(?:\.\d+)?)(?!\d|\.\d|[eE][-+]?\d)|(-?\d+(?:\.\d+)?)(?=\s*/\s*\d))"
                   r"(?:\s*/\s*(?P<of>\d+(?:\.\d+)?))?")


class CutAnswer(str):
    """A judge's answer that ended at its token limit, not on its own (no EOS; ``finish_reason: length``):
    a number at its end may be cut short ("Score: 1" of "Score: 10"), so :func:`parse_score` does not read one there."""


_MAY_GO_ON = re.compile(r"[\s\d.,/\-]*")  # what may follow a number that a cut ended: more of it


def _number(text: str | None) -> float | None:
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def parse_score(answer: str, pattern: re.Pattern, min_score: float, max_score: float) -> float | None:
    """(x - min_score) / (max_score - min_score) for the judge's verdict x in ``answer``: of the matches
    of ``pattern`` whose group ``of`` (if the pattern has one and it matched) equals ``max_score``,
    those whose number is in the earliest group, and of these the last (the module docstring); x is
    that group (the whole match without groups). None when there is no such match or x is not a
    number in [min_score, max_score].

    With the default pattern on a 0-10 scale: "The answer 7/8 is wrong. Score: 1" gives 0.1 (the
    explicit score; 7/8 is on another scale), "Score: 4/10, then Score: 9" 0.9 (the last), "3/5" None.
    """
    of = pattern.groupindex.get("of")
    numbers = [g for g in range(1, pattern.groups + 1) if g != of]
    chosen: tuple[int, str] | None = None  # (the group of its number, that number's text)
    for match in pattern.finditer(answer):
        if of is not None and match.group(of) is not None and _number(match.group(of)) != max_score:
            continue  # a fraction on another scale: not a verdict
        if isinstance(answer, CutAnswer) and _MAY_GO_ON.fullmatch(answer, match.end()):
            continue  # the answer was cut right after it: its number (or its scale) may be cut short
        if numbers:
            group = next((g for g in numbers if match.group(g) is not None), None)
            if group is None:
                continue
            text = match.group(group)
        else:
            group, text = 0, match.group(0)
        if chosen is None or group <= chosen[0]:
            chosen = (group, text)
    x = _number(chosen[1]) if chosen is not None else None
    if x is None or not (math.isfinite(x) and min_score <= x <= max_score):
        return None
    return (x - min_score) / (max_score - min_score)


def _shown(prompt: str | Conversation) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


class LocalJudge:
    """Greedy answers of a local causal LM (see the module docstring). Returns one text per conversation."""

    def __init__(self, model, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 16, batch_size: int = 8):
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
            raise ValueError("the judge's tokenizer has neither a pad nor an EOS token")
        self.model, self.tokenizer, self.max_new_tokens, self.batch_size = model, tokenizer, max_new_tokens, batch_size
        self.eos_token_ids = sorted(stop_token_ids(model, tokenizer))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__

    def prompts(self, conversations: Sequence[Conversation]) -> list[str | Conversation]:
        """The model's prompt before tokenising: each conversation itself (rendered by the chat template),
        or without a template its messages' contents joined by blank lines (:meth:`encode` tokenises it)."""
        if getattr(self.tokenizer, "chat_template", None):
            return list(conversations)
        return ["\n\n".join(m["content"] for m in conversation) for conversation in conversations]

    def encode(self, conversation: Conversation) -> list[int]:
        """The token ids the model reads for one conversation: the chat template's rendering tokenised,
        except that where a content writes a control token's text ("<|im_end|>"), the template's own text
        (its control tokens included) and each content are tokenised apart, the contents as plain text
        (``split_special_tokens``), so the literal stays characters. Without a chat template the whole
        prompt is contents: plain text after the tokenizer's special tokens (BOS).

        Raises:
            RewardFunctionError: when the chat template alters contents in a way other than stripping
                them (they cannot be told apart from its own text), or the tokenizer still reads a
                control token in plain text.
        """
        tokenizer = self.tokenizer
        marks = {*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)} - {tokenizer.unk_token, None}
        if getattr(tokenizer, "chat_template", None) and not any(mark in m["content"] for m in conversation for mark in marks):
            # no content writes a control token: the whole rendering tokenised at once, as the template's own text is (a
            # SentencePiece tokenizer gives a piece tokenised apart a leading space the whole string does not have)
            rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            return tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if getattr(tokenizer, "chat_template", None):
            pieces = [(_plain_ids(tokenizer, text) if content else tokenizer(text, add_special_tokens=False)["input_ids"], content)
                      for text, content in _template_pieces(tokenizer, conversation) if text]
            ids, contents = [i for piece, _ in pieces for i in piece], [piece for piece, content in pieces if content]
        else:
            text = "\n\n".join(m["content"] for m in conversation)
            ids, contents = tokenizer(text, split_special_tokens=True)["input_ids"], [_plain_ids(tokenizer, text)]
        control = {*tokenizer.all_special_ids, *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)} - {tokenizer.unk_token_id}
        if any(control.intersection(piece) for piece in contents):
            raise RewardFunctionError(
                f"judge {self.name}: its tokenizer read a control token in a message's plain text (it ignores split_special_tokens), "
                "so a completion could forge the judge's turns"
            )
        return ids

    @torch.no_grad()
    def __call__(self, conversations: Sequence[Conversation]) -> list[str]:
        from rlalign.lm.sampling import sample

        ids = [self.encode(c) for c in conversations]
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        answers: list[str] = []
        with evaluating(self.model):
            for start in range(0, len(ids), self.batch_size):
                rollout = sample(self.model, ids[start : start + self.batch_size], params, self.pad_token_id, self.eos_token_ids)
                for row, mask, cut in zip(rollout.completion_ids, rollout.completion_mask, rollout.truncated):  # (N,), (N,), ()
                    text = self.tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True)
                    answers.append(CutAnswer(text) if bool(cut) else text)  # no EOS within max_new_tokens
        return answers


_SLOT = "\ue000rlalign-judge-content-{}\ue000"  # a private-use character: no template writes it, none strips it
_SLOTS = re.compile("\ue000rlalign-judge-content-(\\d+)\ue000")


def _plain_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _template_pieces(tokenizer: PreTrainedTokenizerBase, conversation: Conversation) -> list[tuple[str, bool]]:
    """The rendered conversation (generation prompt included) as (text, is a message's content) pieces:
    the template is rendered around a placeholder per message, and the pieces must join to what it
    renders with the real contents (contents as given, or stripped, as Gemma's and Llama 3's templates do)."""
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    skeleton = tokenizer.apply_chat_template(
        [{**m, "content": _SLOT.format(i)} for i, m in enumerate(conversation)], tokenize=False, add_generation_prompt=True
    )
    parts = _SLOTS.split(skeleton)  # template text, message index, template text, ...
    for shown in (lambda text: text, str.strip):
        pieces = [(part, False) if k % 2 == 0 else (shown(conversation[int(part)]["content"]), True) for k, part in enumerate(parts)]
        if "".join(text for text, _ in pieces) == rendered:
            return pieces
    raise RewardFunctionError(
        "the judge's chat template changes message contents beyond stripping them, so its own text cannot be told apart from "
        f"the contents, which must be tokenised as plain text (rendered: {rendered[:200]!r})"
    )


_MARKERS = re.compile(r"<(?=[|\uff5c][^\s<>|\uff5c]{1,64}[|\uff5c]>|(?:start|end)_of_turn>)")  # <|im_end|>, <｜end▁of▁sentence｜>, <end_of_turn>


def defuse_markers(text: str) -> str:
    """``text`` with a WORD JOINER (U+2060, invisible) after the "<" of each chat control marker written
    as text: ChatML's and Llama 3's ``<|...|>``, DeepSeek's ``<｜...｜>``, Gemma's ``<start_of_turn>`` and
    ``<end_of_turn>``. A server's tokenizer then reads characters there, not its control token."""
    return _MARKERS.sub("<\u2060", text)


class ChatEndpoint:
    """Answers from an OpenAI-compatible server: POST ``{base_url}/chat/completions`` with
    ``{"model", "messages", "temperature": 0, "max_tokens"}``, the answer read from
    ``choices[0].message.content``. ``base_url`` ends where OpenAI's does, e.g. ``http://127.0.0.1:8000/v1``.

    The server renders the messages with its chat template and tokenises them, control tokens and all
    (vLLM and SGLang read a literal "<|im_end|>" in a content as the control token), which rlalign
    cannot change from here. With ``defuse_markers`` (the default) each content goes through
    :func:`defuse_markers`, so a completion cannot close the judge's turn with the common marker
    shapes; a template whose markers are plain words (Llama 2's ``[INST]``) stays forgeable, and a
    local judge (:class:`LocalJudge`) is the one that rules it out."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, max_new_tokens: int = 16, timeout: float = 60.0,
        max_retries: int = 3, backoff: float = 0.5, max_concurrency: int = 8, defuse_markers: bool = True,
    ):
        self.defuse_markers = defuse_markers
        self.url, self.model, self.max_new_tokens = base_url.rstrip("/") + "/chat/completions", model, max_new_tokens
        self.timeout, self.max_retries, self.backoff, self.max_concurrency = timeout, max_retries, backoff, max_concurrency
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = f"{model}@{base_url}"

    async def __call__(self, conversations: Sequence[Conversation]) -> list[str]:
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:

            async def one(conversation: Conversation) -> str:
                if self.defuse_markers:
                    conversation = [{**m, "content": defuse_markers(m["content"])} for m in conversation]
                body = json.dumps({"model": self.model, "messages": conversation, "temperature": 0, "max_tokens": self.max_new_tokens}).encode()
                what = f"judge {self.name}, message {conversation[-1]['content']!r:.200}"
                async with limit:
                    answer = await post_json(
                        client, self.url, body, max_retries=self.max_retries, backoff=self.backoff, what=what, timeout=self.timeout, retry_statuses=RETRY_STATUSES,
                    )
                try:
                    content = answer["choices"][0]["message"]["content"]
                except (KeyError, IndexError, TypeError):
                    raise RewardFunctionError(f"POST {self.url} answered without choices[0].message.content: {str(answer)[:200]} ({what})") from None
                content = content if isinstance(content, str) else ""
                return CutAnswer(content) if answer["choices"][0].get("finish_reason") == "length" else content  # cut at max_tokens

            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(c)) for c in conversations]
            except ExceptionGroup as errors:
                raise errors.exceptions[0] from None
        return [task.result() for task in tasks]


class JudgeReward:
    """A generative judge as a reward function (see the module docstring).

    Args:
        answer: who answers: ``answer(conversations) -> list[str]``, sync or async (:class:`LocalJudge`,
            :class:`ChatEndpoint`, a scripted function). :meth:`local`, :meth:`from_pretrained` and
            :meth:`remote` build one.
        template: the user message; ``{prompt}``, ``{completion}`` and any row column by name.
        pattern: a regular expression finding the verdict in the answer: its last match counts, a match
            in an earlier group before one in a later group, a group named ``of`` being the scale
            (the module docstring); x is the match's first group that matched.
        max_score, min_score: the score's range; x maps to (x - min_score) / (max_score - min_score).
        system_prompt: a system message before the user message (None: none).
        max_failure_fraction: the largest fraction of a call's answers that may fail to parse; above
            it the call raises (1.0: never raises; failures are still None and counted).
        name: the reward's name in logs and errors.

    Counters since construction: ``judged`` (answers read) and ``failures`` (answers that did not
    parse); ``last_answers``: the raw answers of the last call.
    """

    def __init__(
        self,
        answer: Callable[[list[Conversation]], Any],
        template: str = DEFAULT_TEMPLATE,
        pattern: str = DEFAULT_PATTERN,
        max_score: float = 10.0,
        min_score: float = 0.0,
        system_prompt: str | None = None,
        max_failure_fraction: float = 0.5,
        name: str = "judge",
    ):
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        if "completion" not in fields:
            raise ValueError("the judge's template has no {completion} field, so the judge would not see what it rates")
        if any(not f.isidentifier() for f in fields):
            raise ValueError(f"the judge's template fields must be plain names (prompt, completion, a column): got {sorted(fields)}")
        if not max_score > min_score:
            raise ValueError(f"max_score ({max_score}) must be greater than min_score ({min_score})")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError(f"max_failure_fraction must be in [0, 1], got {max_failure_fraction}")
        self.answer, self.template, self.pattern = answer, template, re.compile(pattern)
        self.max_score, self.min_score, self.system_prompt = float(max_score), float(min_score), system_prompt
        self.max_failure_fraction, self.name = max_failure_fraction, name
        self.columns = sorted(fields - {"prompt", "completion"})
        self.judged = self.failures = 0
        self.last_answers: list[str] = []
        self._logged = (0, 0)

    @classmethod
    def local(cls, model, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 16, batch_size: int = 8, **kwargs) -> JudgeReward:
        """A judge answered by ``model`` with ``tokenizer`` (:class:`LocalJudge`); ``kwargs`` go to the constructor."""
        return cls(LocalJudge(model, tokenizer, max_new_tokens, batch_size), **kwargs)

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: str = "float32", device: str = "cpu", max_new_tokens: int = 16, batch_size: int = 8,
        attn_implementation: str | None = None, **kwargs,
    ) -> JudgeReward:
        """A judge loaded from a causal-LM checkpoint (frozen: :func:`rlalign.lm.models.load_reference`)."""
        from rlalign.lm.models import load_reference, load_tokenizer

        model = load_reference(path, dtype, device, attn_implementation=attn_implementation)
        return cls.local(model, load_tokenizer(path), max_new_tokens, batch_size, **kwargs)

    @classmethod
    def remote(
        cls, base_url: str, model: str, api_key: str | None = None, max_new_tokens: int = 16, timeout: float = 60.0,
        max_retries: int = 3, max_concurrency: int = 8, **kwargs,
    ) -> JudgeReward:
        """A judge answered by an OpenAI-compatible server (:class:`ChatEndpoint`); ``kwargs`` go to the constructor."""
        endpoint = ChatEndpoint(base_url, model, api_key, max_new_tokens, timeout, max_retries, max_concurrency=max_concurrency)
        return cls(endpoint, **kwargs)

    def conversations(self, prompts: Sequence, completions: Sequence, columns: dict[str, Sequence]) -> list[Conversation]:
        """The conversation sent to the judge for each row."""
        missing = [c for c in self.columns if c not in columns]
        if missing:
            raise RewardFunctionError(f"judge {self.name}: its template needs the column {missing[0]!r}, which the rows do not have (prompt {prompts[0]!r:.200})")
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            text = self.template.format(prompt=_shown(p), completion=final_answer(c), **{k: columns[k][i] for k in self.columns})
            out.append(([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [{"role": "user", "content": text}])
        return out

    def __call__(self, prompts: list, completions: list, **columns: Sequence) -> list[float | None]:
        """One score in [0, 1] per completion, None where the judge's answer did not parse."""
        return run_sync(self.acall(prompts, completions, **columns))

    async def acall(self, prompts: list, completions: list, **columns: Sequence) -> list[float | None]:
        """As the call; a synchronous ``answer`` runs on a worker thread, so an event loop is not blocked."""
        if not prompts:
            return []
        conversations = self.conversations(prompts, completions, columns)
        if inspect.iscoroutinefunction(self.answer) or inspect.iscoroutinefunction(getattr(self.answer, "__call__", None)):
            answers = await self.answer(conversations)
        else:
            answers = await asyncio.to_thread(self.answer, conversations)
        answers = list(answers)
        if len(answers) != len(prompts) or not all(isinstance(a, str) for a in answers):
            raise RewardFunctionError(f"judge {self.name} gave {len(answers)} answers for {len(prompts)} completions, or answers that are not text (prompt {prompts[0]!r:.200})")
        self.last_answers = answers
        scores = [parse_score(a, self.pattern, self.min_score, self.max_score) for a in answers]
        failed = [i for i, s in enumerate(scores) if s is None]
        over = len(failed) / len(answers) > self.max_failure_fraction
        if not over or len(answers) == 1:  # a call of several rows that raises is re-run a row at a time (reward_calls), which counts them once
            self.judged += len(answers)
            self.failures += len(failed)
        if failed:
            i = failed[0]
            example = f"prompt {prompts[i]!r:.200}: the judge answered {str(answers[i])!r:.300}"
            if over:
                raise RewardFunctionError(
                    f"judge {self.name}: {len(failed)} of {len(answers)} answers have no score in [{self.min_score:g}, {self.max_score:g}] "
                    f"matching {self.pattern.pattern!r} (more than max_failure_fraction={self.max_failure_fraction:g}); e.g. {example}"
                )
            logger.warning("judge %s: %d of %d answers did not parse (reward None for them); e.g. %s", self.name, len(failed), len(answers), example)
        return scores

    def pop_stats(self) -> dict[str, float]:
        """{"parse_failed": answers that did not parse, "parse_failed_fraction": their share} since the last call."""
        judged, failures = self.judged - self._logged[0], self.failures - self._logged[1]
        self._logged = (self.judged, self.failures)
        return {"parse_failed": float(failures), "parse_failed_fraction": failures / judged if judged else 0.0}
