"""A synthetic preference task: completions ranked by a hidden rule, the stand-in for annotators.

Prompts are "word: <topic>\n"; completions are short lowercase words. The hidden rule prefers
words with a larger share of vowels:

    hidden_score(completion) = (# of a, e, i, o, u) / max(1, # of letters)     in [0, 1]

A pair (chosen, rejected) always has hidden scores at least ``min_gap`` apart, so the ranking is
unambiguous. A transformer reads the rule off with one uniform attention head (it is an average of
a per-character feature), so a tiny reward model learns it, and a policy can raise it (more vowels)
under PPO. Demos report ``hidden_score`` as the ground truth the reward model approximates.

SFT completions are drawn with the natural vowel share of random letters (5/26 per letter on
average, a hidden score around 0.2), which leaves room for RL to raise it towards 1.
"""

from __future__ import annotations

import random
import string
from typing import Literal

__all__ = ["VOWELS", "hidden_score", "hidden_reward", "prompt_records", "sft_records", "preference_records"]

VOWELS = frozenset("aeiou")
_TOPICS = ["cat", "sun", "tree", "river", "stone", "cloud", "bird", "fire", "moon", "road", "rain", "wind", "seed", "star", "leaf", "hill"]


def hidden_score(completion: str) -> float:
    """Share of vowels among the letters of ``completion`` (0 when it has no letters)."""
    letters = [c for c in completion.lower() if c in string.ascii_lowercase]
    return sum(c in VOWELS for c in letters) / max(1, len(letters))


def hidden_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """:func:`hidden_score` in the reward-function protocol of :mod:`rlalign.lm.rewards`."""
    return [hidden_score(c) for c in completions]


def _prompt(rng: random.Random) -> str:
    # train and eval prompts share topics; completions (what the reward model judges) are fresh draws
    return f"word: {rng.choice(_TOPICS)}\n"


def _word(rng: random.Random, vowel_share: float | None = None) -> str:
    length = rng.randint(4, 10)
    share = rng.random() if vowel_share is None else vowel_share
    vowels, consonants = sorted(VOWELS), sorted(set(string.ascii_lowercase) - VOWELS)
    return "".join(rng.choice(vowels) if rng.random() < share else rng.choice(consonants) for _ in range(length))


def prompt_records(split: Literal["train", "eval"], n: int, seed: int = 0) -> list[dict]:
    """Prompt records ``{"prompt"}`` for RL."""
    rng = random.Random(f"preference-prompts-{split}-{seed}")
    return [{"prompt": _prompt(rng)} for _ in range(n)]


def sft_records(split: Literal["train", "eval"], n: int, seed: int = 0) -> list[dict]:
    """SFT pairs: a prompt and a random word with the natural vowel share of uniform letters."""
    rng = random.Random(f"preference-sft-{split}-{seed}")
    return [{"prompt": _prompt(rng), "completion": _word(rng, vowel_share=5 / 26)} for _ in range(n)]


def preference_records(split: Literal["train", "eval"], n: int, seed: int = 0, min_gap: float = 0.15) -> list[dict]:
    """Preference pairs ``{"prompt", "chosen", "rejected", "margin"}`` ranked by the hidden rule.

    ``margin`` is the hidden-score gap scaled to [0, 4] (usable as Llama 2's per-pair margin).
    """
    rng = random.Random(f"preference-pairs-{split}-{seed}")
    out: list[dict] = []
    while len(out) < n:
        a, b = _word(rng), _word(rng)
        gap = hidden_score(a) - hidden_score(b)
        if abs(gap) < min_gap:
            continue
        chosen, rejected = (a, b) if gap > 0 else (b, a)
        out.append({"prompt": _prompt(rng), "chosen": chosen, "rejected": rejected, "margin": round(4 * abs(gap), 4)})
    return out
