"""Arithmetic with a verifiable answer: "47-12+30=" -> "65" then EOS. Reward = 1 if correct else 0.

Problems have ``min_operands``..``max_operands`` integers in [0, ``max_operand``] joined by "+" or
"-"; the answer may be negative. The default (two operands of up to two digits: "57-83=" -> "-26")
is hard enough that a short SFT on the tiny model gets only part of the answers right (0% -> 27% in
1500 steps, benchmarks/RESULTS.md), which leaves room for RL to improve. Three operands
(``ArithmeticSpec(max_operands=3)``) is a harder variant.

Splits are disjoint by construction: a problem belongs to the eval split when a hash of its text
falls in the eval fraction, so ``problems("train", ...)`` never yields an eval problem, whatever the
seeds (the seed only picks which problems of a split are drawn and in what order).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["ArithmeticSpec", "Problem", "make_problem", "problems", "sft_records", "prompt_records", "answer_of", "correct", "reward"]

_PROBLEM = re.compile(r"^(\d+(?:[+-]\d+)+)=$")
_TERM = re.compile(r"([+-]?)(\d+)")


@dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty: operand count range, largest operand, operators, share of problems held out."""

    min_operands: int = 2
    max_operands: int = 2
    max_operand: int = 99
    operators: str = "+-"
    eval_fraction: float = 0.1


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "47-12+30="
    answer: str  # e.g. "65"


def answer_of(prompt: str) -> int | None:
    """The value of ``prompt`` ("12+35=" -> 47), or None when the prompt is not a problem."""
    match = _PROBLEM.match(prompt.strip())
    if match is None:
        return None
    return sum(int(digits) * (-1 if sign == "-" else 1) for sign, digits in _TERM.findall(match.group(1)))


def _is_eval(prompt: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def make_problem(rng: random.Random, spec: ArithmeticSpec) -> Problem:
    count = rng.randint(spec.min_operands, spec.max_operands)
    text = str(rng.randint(0, spec.max_operand))
    for _ in range(count - 1):
        text += rng.choice(spec.operators) + str(rng.randint(0, spec.max_operand))
    prompt = text + "="
    return Problem(prompt, str(answer_of(prompt)))


def problems(split: Literal["train", "eval"], n: int, seed: int = 0, spec: ArithmeticSpec = ArithmeticSpec()) -> list[Problem]:
    """``n`` problems of ``split`` drawn with ``seed`` (repeats possible in train, not in eval)."""
    rng = random.Random(f"arithmetic-{split}-{seed}")
    want_eval = split == "eval"
    out: list[Problem] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 1000 * (n + 10):
            raise ValueError(f"cannot draw {n} distinct {split} problems from {spec}")
        problem = make_problem(rng, spec)
        if _is_eval(problem.prompt, spec.eval_fraction) != want_eval:
            continue
        if want_eval and problem.prompt in seen:
            continue
        seen.add(problem.prompt)
        out.append(problem)
    return out


def sft_records(split: Literal["train", "eval"], n: int, seed: int = 0, spec: ArithmeticSpec = ArithmeticSpec()) -> list[dict]:
    """SFT pairs ``{"prompt", "completion"}`` (the format of :mod:`rlalign.lm.data`)."""
    return [{"prompt": p.prompt, "completion": p.answer} for p in problems(split, n, seed, spec)]


def prompt_records(split: Literal["train", "eval"], n: int, seed: int = 0, spec: ArithmeticSpec = ArithmeticSpec()) -> list[dict]:
    """Prompt records ``{"prompt", "answer"}`` for RL (the answer is metadata; the reward recomputes it)."""
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems(split, n, seed, spec)]


def correct(prompt: str, completion: str) -> float:
    """1.0 when ``completion`` (surrounding whitespace ignored) is the value of ``prompt``, else 0.0."""
    value = answer_of(prompt)
    if value is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    return 1.0 if completion.strip() == str(value) else 0.0


def reward(prompts: list[str], completions: list[str]) -> list[float]:
    """Batched :func:`correct`, in the reward-function protocol of :mod:`rlalign.lm.rewards`."""
    return [correct(p, c) for p, c in zip(prompts, completions, strict=True)]
