"""Arithmetic task: correct answers, disjoint seeded splits, the reward."""

from __future__ import annotations

import pytest

from rlalign.tasks.arithmetic import ArithmeticSpec, answer_of, correct, problems, reward, sft_records


def test_answer_and_reward():
    assert answer_of("12+35=") == 47 and answer_of("47-12+30=") == 65 and answer_of("3-40=") == -37
    assert answer_of("hello") is None
    assert correct("12+35=", "47") == 1.0 and correct("12+35=", " 47 ") == 1.0 and correct("12+35=", "46") == 0.0
    assert reward(["3-40=", "1+1="], ["-37", "3"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        correct("hi", "2")


def test_splits_are_disjoint_and_seeded():
    train = {p.prompt for p in problems("train", 3000, seed=0)}
    evals = problems("eval", 200, seed=0)
    assert not train & {p.prompt for p in evals}
    assert len({p.prompt for p in evals}) == 200  # eval problems are distinct
    assert problems("eval", 50, seed=0) == evals[:50]  # same seed, same problems
    assert problems("eval", 50, seed=1) != evals[:50]
    assert all(correct(p.prompt, p.answer) == 1.0 for p in evals)


def test_records_have_the_sft_format():
    rec = sft_records("train", 3, seed=0, spec=ArithmeticSpec(min_operands=3, max_operands=3))
    assert all(set(r) == {"prompt", "completion"} and r["prompt"].count("+") + r["prompt"].count("-") == 2 for r in rec)
