"""Look-ups in an embedded catalogue: a question needs two ``lookup`` calls whose results decide the answer.

    question:  Which is heavier, the brom or the tiva?
    assistant: <tool>lookup: brom</tool>                 (a call; the format is the rollout's)
    tool:      weight=31 price=12
    assistant: <tool>lookup: tiva</tool>
    tool:      weight=8 price=40
    assistant: brom                                      (exact answer: reward 1)

    question:  What is the weight of the heavier of the brom and the tiva?     (``question="value"``)
    ... the same two look-ups ...
    assistant: 31                                        (the number copied from a tool result)

:data:`CATALOGUE` holds 32 fictional items, each with a weight and a price (distinct within each
attribute, so every comparison has one answer). Questions ask which of two items is heavier,
lighter, dearer or cheaper; the answer is one of the two names, so a policy that answers without
looking anything up is right half the time at best, and one that looks both up and compares is
always right. With ``question="value"`` the question asks for the attribute's value of the winning
item instead, so the answer is a number from 1 to 99 copied from a tool result: a guess is right
about 1 time in 99, and only the look-ups pay. ``question="single"`` asks for one item's value
("What is the weight of the brom?"): one look-up and a copied number, the quickest form to learn
(the CI learning test of tool use). :func:`lookup` is the tool (its typed signature and docstring give its JSON schema).

Records for RL (:func:`prompt_records`): ``{"prompt": [user message], "answer", "items", "kind"}``.
Demonstrations for SFT (:func:`sft_records`): whole conversations ``{"messages": [...]}`` in which a
share ``tool_share`` of the answers is found by two look-ups and the rest is a guess (one of the two
names, or for value questions a number from 1 to 99, at random, no look-up), so a model trained on them calls the tool only part of the time and RL
has room to raise the success rate. The assistant's calls are written by ``write_call`` (default: the
tag format ``<tool>lookup: NAME</tool>``, short enough for a character-level model); tool replies are
``role: tool`` messages, rendered by the chat template. :class:`LookupEnvironment` runs an episode
(the protocol of :mod:`rlalign.agents.environment`).

Splits are disjoint: a pair of items belongs to the eval split when a hash of the pair falls in the
eval fraction (whatever the question's kind, form or order). The task is ``TASKS["lookup"]`` (which)
and ``TASKS["lookup_value"]`` (value) in :mod:`rlalign.tasks`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = [
    "CATALOGUE", "KINDS", "Question", "lookup", "question", "problems", "prompt_records", "sft_records", "tag_call", "correct", "reward", "LookupEnvironment",
    "MAX_NEW_TOKENS",
]

MAX_NEW_TOKENS = 32  # one assistant turn: a call (<tool>lookup: NAME</tool>) or an answer, plus EOS

_NAMES = [
    "brom", "tiva", "quel", "dask", "mirn", "vosh", "pell", "ruga", "fenk", "lozo", "yarb", "cint", "huma", "jolt", "nebb", "opra",
    "sulk", "wemi", "zapo", "garn", "kilo", "trud", "bexa", "fimo", "plon", "reva", "sorm", "taku", "vund", "xemi", "yolt", "dupa",
]
_WEIGHTS = random.Random("lookup-weights").sample(range(1, 100), len(_NAMES))
_PRICES = random.Random("lookup-prices").sample(range(1, 100), len(_NAMES))
CATALOGUE: dict[str, dict[str, int]] = {n: {"weight": w, "price": p} for n, w, p in zip(_NAMES, _WEIGHTS, _PRICES)}

# kind -> (attribute, the larger value wins?)
KINDS: dict[str, tuple[str, bool]] = {"heavier": ("weight", True), "lighter": ("weight", False), "dearer": ("price", True), "cheaper": ("price", False)}

Question = Literal["which", "value", "single"]  # "which": the winning item's name; "value": its attribute's value; "single": one item's value


def lookup(name: str) -> str:
    """Look up an item of the catalogue by name and return its attributes.

    Args:
        name: The item's name, e.g. "brom".
    """
    item = CATALOGUE.get(name.strip().lower())
    if item is None:
        return f"error: no item named {name!r}"
    return " ".join(f"{k}={v}" for k, v in item.items())


def question(kind: str, a: str, b: str, form: Question = "which") -> str:
    if form == "single":
        return f"What is the {KINDS[kind][0]} of the {a}?"
    if form == "value":
        return f"What is the {KINDS[kind][0]} of the {kind} of the {a} and the {b}?"
    return f"Which is {kind}, the {a} or the {b}?"


def _answer(kind: str, a: str, b: str, form: Question = "which") -> str:
    attribute, larger = KINDS[kind]
    if form == "single":
        return str(CATALOGUE[a][attribute])
    a_wins = (CATALOGUE[a][attribute] > CATALOGUE[b][attribute]) == larger
    winner = a if a_wins else b
    return str(CATALOGUE[winner][attribute]) if form == "value" else winner


def _is_eval(a: str, b: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256("|".join(sorted((a, b))).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def problems(split: Literal["train", "eval"], n: int, seed: int = 0, eval_fraction: float = 0.15) -> list[tuple[str, str, str]]:
    """``n`` questions (kind, a, b) of ``split`` drawn with ``seed``; repeats possible."""
    rng = random.Random(f"lookup-{split}-{seed}")
    out: list[tuple[str, str, str]] = []
    while len(out) < n:
        a, b = rng.sample(_NAMES, 2)
        if _is_eval(a, b, eval_fraction) == (split == "eval"):
            out.append((rng.choice(sorted(KINDS)), a, b))
    return out


def prompt_records(split: Literal["train", "eval"], n: int, seed: int = 0, question_form: Question = "which") -> list[dict]:
    """RL records: ``{"prompt": [{"role": "user", ...}], "answer", "items", "kind"}``."""
    return [
        {"prompt": [{"role": "user", "content": question(k, a, b, question_form)}], "answer": _answer(k, a, b, question_form), "items": [a, b], "kind": k}
        for k, a, b in problems(split, n, seed)
    ]


def tag_call(name: str) -> str:
    """The tag-format call of ``lookup(name)``."""
    return f"<tool>lookup: {name}</tool>"


def sft_records(
    split: Literal["train", "eval"], n: int, seed: int = 0, tool_share: float = 1.0, write_call: Callable[[str], str] = tag_call,
    question_form: Question = "which",
) -> list[dict]:
    """SFT conversations ``{"messages": [...]}``: two look-ups then the answer in a share ``tool_share``,
    a guess (no look-up: either name, or a number from 1 to 99 for value questions) in the others."""
    rng = random.Random(f"lookup-sft-{split}-{seed}")
    out = []
    for kind, a, b in problems(split, n, seed):
        messages: list[dict[str, Any]] = [{"role": "user", "content": question(kind, a, b, question_form)}]
        if rng.random() < tool_share:
            for name in (a,) if question_form == "single" else (a, b):
                messages += [{"role": "assistant", "content": write_call(name)}, {"role": "tool", "name": "lookup", "content": lookup(name)}]
            messages.append({"role": "assistant", "content": _answer(kind, a, b, question_form)})
        else:
            guess = rng.choice([a, b]) if question_form == "which" else str(rng.randint(1, 99))
            messages.append({"role": "assistant", "content": guess})
        out.append({"messages": messages})
    return out


def correct(record: Mapping[str, Any], answer: str) -> float:
    """1.0 when ``answer`` (whitespace and case ignored) is the record's answer, else 0.0."""
    return 1.0 if answer.strip().lower() == record["answer"] else 0.0


def reward(prompts: list, completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    """Exact-answer reward in the reward-function protocol of :mod:`rlalign.lm.rewards` (the ``answer``
    column); a completion is text or messages (TRL's conversational form: the last message's content)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if t.strip().lower() == a else 0.0 for t, a in zip(texts, answer, strict=True)]


class LookupEnvironment:
    """One episode of the task: the question, the ``lookup`` tool, and the exact-answer reward of the
    final assistant turn (the protocol of :mod:`rlalign.agents.environment`)."""

    tools = ["lookup"]

    def reset(self, record: Mapping[str, Any]) -> list[dict]:
        self.record = record
        self.lookups = 0
        return list(record["prompt"])

    def lookup(self, name: str) -> str:
        """Look up an item of the catalogue by name and return its attributes.

        Args:
            name: The item's name, e.g. "brom".
        """
        self.lookups += 1
        return lookup(name)

    def reward(self, answer: str) -> float:
        return correct(self.record, answer)
