"""A generative judge as a reward function: an LM is asked a rubric per completion and its answer
parsed to a score in [0, 1].

    judge = JudgeReward.from_pretrained("models/judge", max_score=10)        # a local causal LM
    judge = JudgeReward.remote("http://127.0.0.1:8000/v1", "judge-model")     # an OpenAI-compatible server
    scores = judge(prompts=prompts, completions=completions)                  # list[float | None]
    judge.pop_stats()                                                         # {"parse_failed": 1.0, ...}

Per completion the judge is sent one conversation: an optional system message, then the user
message ``template.format(prompt=..., completion=..., **the row's columns it names)`` (a template
may use ``{answer}`` to show a reference; a literal brace is written ``{{``). A prompt given as chat
messages is shown as "role: content" lines; a completion given as messages, as their contents.

Its answer is parsed by ``pattern`` (default: "Score: 7", "score = 7.5", "7/10"): the first match's
first group that matched is the number x (the whole match when the pattern has no group); x in
[min_score, max_score] gives (x - min_score) / (max_score - min_score). An answer with no match, or
with x out of range, is a parse failure: that completion's reward is None (the term does not apply
to it and is left out of its sum), it is counted (``judge.failures``; :meth:`JudgeReward.pop_stats`
gives the count since the last call, for a trainer to log ``reward/<name>/parse_failed``) and
logged, and when more than ``max_failure_fraction`` of a call's answers fail, the call raises
:class:`RewardFunctionError` naming the judge, a prompt and the judge's raw answer: a judge that
cannot follow the format is broken, not a source of zeros. Never a silent 0.

Who answers is one seam, ``answer(conversations) -> list[str]`` (sync or ``async def``):

- :class:`LocalJudge`: a Hugging Face causal LM and its tokenizer, greedy. The conversation goes
  through the tokenizer's chat template when it has one (with the generation prompt), else its
  messages' contents joined by blank lines are the prompt text; decoding is rlalign's own sampler
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
from rlalign.lm.encoding import completion_text, encode_prompts
from rlalign.lm.model_modes import evaluating
from rlalign.lm.remote_reward import RETRY_STATUSES, post_json, run_sync
from rlalign.lm.rewards import RewardFunctionError

__all__ = ["JudgeReward", "LocalJudge", "ChatEndpoint", "DEFAULT_TEMPLATE", "DEFAULT_PATTERN", "parse_score"]

logger = logging.getLogger(__name__)

Conversation = list[dict[str, str]]

DEFAULT_TEMPLATE = (
    "Rate the response to the prompt below for correctness and helpfulness, "
    "on a scale from 0 (worst) to 10 (best).\n\n"
    "[Prompt]\n{prompt}\n\n[Response]\n{completion}\n\n"
    'Reply with your rating in the form "Score: N" and nothing else.'
)
DEFAULT_PATTERN = r"(?i)score[^\w-]{0,5}(-?\d+(?:\.\d+)?)|(-?\d+(?:\.\d+)?)\s*/\s*\d+"


def parse_score(answer: str, pattern: re.Pattern, min_score: float, max_score: float) -> float | None:
    """(x - min_score) / (max_score - min_score) for the number x that ``pattern`` finds first in
    ``answer`` (its first group that matched; the whole match without groups); None when nothing
    matches or x is outside [min_score, max_score]."""
    match = pattern.search(answer)
    if match is None:
        return None
    text = next((g for g in match.groups() if g is not None), None) if pattern.groups else match.group(0)
    try:
        x = float(text)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(x) and min_score <= x <= max_score):
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
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = sorted({*eos, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__

    def prompts(self, conversations: Sequence[Conversation]) -> list[str | Conversation]:
        """What the model is given: each conversation itself (rendered by the chat template), or without
        a template its messages' contents joined by blank lines."""
        if getattr(self.tokenizer, "chat_template", None):
            return list(conversations)
        return ["\n\n".join(m["content"] for m in conversation) for conversation in conversations]

    @torch.no_grad()
    def __call__(self, conversations: Sequence[Conversation]) -> list[str]:
        from rlalign.lm.sampling import sample

        ids = encode_prompts(self.tokenizer, self.prompts(conversations))
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        answers: list[str] = []
        with evaluating(self.model):
            for start in range(0, len(ids), self.batch_size):
                rollout = sample(self.model, ids[start : start + self.batch_size], params, self.pad_token_id, self.eos_token_ids)
                for row, mask in zip(rollout.completion_ids, rollout.completion_mask):  # (N,), (N,)
                    answers.append(self.tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True))
        return answers


class ChatEndpoint:
    """Answers from an OpenAI-compatible server: POST ``{base_url}/chat/completions`` with
    ``{"model", "messages", "temperature": 0, "max_tokens"}``, the answer read from
    ``choices[0].message.content``. ``base_url`` ends where OpenAI's does, e.g. ``http://127.0.0.1:8000/v1``."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, max_new_tokens: int = 16, timeout: float = 60.0,
        max_retries: int = 3, backoff: float = 0.5, max_concurrency: int = 8,
    ):
        self.url, self.model, self.max_new_tokens = base_url.rstrip("/") + "/chat/completions", model, max_new_tokens
        self.timeout, self.max_retries, self.backoff, self.max_concurrency = timeout, max_retries, backoff, max_concurrency
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = f"{model}@{base_url}"

    async def __call__(self, conversations: Sequence[Conversation]) -> list[str]:
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:

            async def one(conversation: Conversation) -> str:
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
                return content if isinstance(content, str) else ""

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
        pattern: a regular expression finding the score in the answer (first group that matched).
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
            text = self.template.format(prompt=_shown(p), completion=completion_text(c), **{k: columns[k][i] for k in self.columns})
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
        self.judged += len(answers)
        self.failures += len(failed)
        if failed:
            i = failed[0]
            example = f"prompt {prompts[i]!r:.200}: the judge answered {answers[i]!r:.300}"
            if len(failed) > self.max_failure_fraction * len(answers):
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
