"""Synthetic preference task: the hidden rule ranks every pair, with the stated gap."""

from __future__ import annotations

from rlalign.tasks.preference import hidden_reward, hidden_score, preference_records, prompt_records, sft_records


def test_hidden_score_is_the_vowel_share():
    assert hidden_score("aeio") == 1.0 and hidden_score("bcd") == 0.0 and hidden_score("abcd") == 0.25
    assert hidden_score("") == 0.0 and hidden_score("a-b!") == 0.5  # non-letters are ignored
    assert hidden_reward(["p", "p"], ["ab", "aa"]) == [0.5, 1.0]


def test_pairs_are_ranked_by_the_hidden_rule():
    pairs = preference_records("train", 500, seed=0)
    assert all(hidden_score(p["chosen"]) - hidden_score(p["rejected"]) >= 0.15 for p in pairs)
    assert all(p["margin"] == round(4 * (hidden_score(p["chosen"]) - hidden_score(p["rejected"])), 4) for p in pairs)
    assert preference_records("eval", 20, seed=0) != preference_records("train", 20, seed=0)
    assert preference_records("eval", 20, seed=3) == preference_records("eval", 20, seed=3)


def test_sft_and_prompt_records():
    sft = sft_records("train", 400, seed=0)
    mean = sum(hidden_score(r["completion"]) for r in sft) / len(sft)
    assert 0.1 < mean < 0.3  # the natural vowel share of random letters, 5/26 ~ 0.19: room for RL
    assert all(r["prompt"].startswith("word: ") for r in prompt_records("eval", 10))
