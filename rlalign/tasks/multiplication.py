"""Multiplication with a calculator: "37*48=" -> a call, the tool's result, then the answer.

    prompt:      37*48=
    completion:  <tool>calculator: 37*48</tool><result>1776</result>1776      (then EOS)

The tag format of :mod:`rlalign.lm.tools`: the policy writes the call and the final answer; the
``<result>...</result>`` part is what the calculator returns in a multi-turn rollout (GRPO with
``tools``), which the loss leaves out. A tiny model cannot multiply two-digit numbers after a short
SFT, but it can copy the operands into a call and the result into its answer, so the share of
right answers measures whether it calls the tool and uses what comes back.

``sft_records(..., tool_share=p)`` writes the call in a share ``p`` of the records and the bare
answer in the others ("37*48=" -> "1776"), so a model trained on them calls the tool only part of
the time and RL has room to raise the success rate. The reward is 1 when the final answer (the text
after the last ``</result>`` or ``</tool>``, else the whole completion; whitespace ignored) is the
product. Splits are disjoint as in :mod:`rlalign.tasks.arithmetic` (a hash of the prompt).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["MultiplicationSpec", "problems", "sft_records", "prompt_records", "final_answer", "correct", "reward", "MAX_NEW_TOKENS"]

_PROBLEM = re.compile(r"^(\d+)\*(\d+)=$")
MAX_NEW_TOKENS = 56  # the longest SFT completion (99*99: 51 characters) plus EOS, with room


@dataclass(frozen=True)
class MultiplicationSpec:
    """Operands from ``min_operand`` to ``max_operand``; share of problems held out for eval."""

    min_operand: int = 32  # 32 * 32 = 1024: every product has four digits
    max_operand: int = 99
    eval_fraction: float = 0.1


def _is_eval(prompt: str, eval_fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64 < eval_fraction


def problems(split: Literal["train", "eval"], n: int, seed: int = 0, spec: MultiplicationSpec = MultiplicationSpec()) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs of ``split`` drawn with ``seed`` (eval: distinct)."""
    rng = random.Random(f"multiplication-{split}-{seed}")
    out, seen = [], set()
    for _ in range(1000 * (n + 10)):
        if len(out) == n:
            return out
        a, b = rng.randint(spec.min_operand, spec.max_operand), rng.randint(spec.min_operand, spec.max_operand)
        prompt = f"{a}*{b}="
        if _is_eval(prompt, spec.eval_fraction) != (split == "eval") or (split == "eval" and prompt in seen):
            continue
        seen.add(prompt)
        out.append((prompt, str(a * b)))
    raise ValueError(f"cannot draw {n} distinct {split} problems from {spec}")


def tool_transcript(prompt: str, answer: str) -> str:
    """The completion that calls the calculator and copies its result."""
    return f"<tool>calculator: {prompt.removesuffix('=')}</tool><result>{answer}</result>{answer}"


def sft_records(split: Literal["train", "eval"], n: int, seed: int = 0, spec: MultiplicationSpec = MultiplicationSpec(), tool_share: float = 1.0) -> list[dict]:
    """SFT pairs ``{"prompt", "completion"}``: the tool transcript in a share ``tool_share`` of them, the bare answer in the others."""
    rng = random.Random(f"multiplication-tools-{split}-{seed}")
    return [{"prompt": p, "completion": tool_transcript(p, a) if rng.random() < tool_share else a} for p, a in problems(split, n, seed, spec)]


def prompt_records(split: Literal["train", "eval"], n: int, seed: int = 0, spec: MultiplicationSpec = MultiplicationSpec()) -> list[dict]:
    """Prompt records ``{"prompt", "answer"}`` for RL."""
    return [{"prompt": p, "answer": a} for p, a in problems(split, n, seed, spec)]


def final_answer(completion: str) -> str:
    """The text after the last ``</result>`` or ``</tool>`` (the whole completion when it has neither), stripped."""
    cut = max(completion.rfind(tag) + len(tag) if tag in completion else 0 for tag in ("</result>", "</tool>"))
    return completion[cut:].strip()


def correct(prompt: str, completion: str) -> float:
    """1.0 when the final answer of ``completion`` is the product of ``prompt``'s operands, else 0.0."""
    match = _PROBLEM.match(prompt.strip())
    if match is None:
        raise ValueError(f"not a multiplication prompt: {prompt!r}")
    return 1.0 if final_answer(completion) == str(int(match.group(1)) * int(match.group(2))) else 0.0


def reward(prompts: list[str], completions: list[str]) -> list[float]:
    """Batched :func:`correct`, in the reward-function protocol of :mod:`rlalign.lm.rewards`."""
    return [correct(p, c) for p, c in zip(prompts, completions, strict=True)]
