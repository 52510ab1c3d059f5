"""Embedded offline tasks and the tiny-model recipe, so demos and tests need no download.

- :mod:`rlalign.tasks.tiny_model`: character tokenizer + small LlamaForCausalLM, saved as an HF dir.
- :mod:`rlalign.tasks.arithmetic`: "12+35=" -> "47", reward = exact answer (accuracy).
- :mod:`rlalign.tasks.multiplication`: "37*48=" -> a calculator call, its result, "1776" (GRPO with tools).
- :mod:`rlalign.tasks.lookup`: "Which is heavier, the brom or the tiva?" -> two ``lookup`` calls, then the name (agents);
  ``lookup_value``: "What is the weight of the heavier of the brom and the tiva?" -> the same calls, then the number.
- :mod:`rlalign.tasks.preference`: pairs ranked by a hidden rule (vowel share), for reward models.

``TASKS[name]`` gives each task's record makers (in the formats of :mod:`rlalign.lm.data`) and its
reward function (the protocol of :mod:`rlalign.lm.rewards`), so trainers pick a task by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from rlalign.tasks import arithmetic, lookup, multiplication, preference

__all__ = ["Task", "TASKS"]


@dataclass(frozen=True)
class Task:
    """An embedded task. Record makers take (split, n, seed) with split "train" or "eval"."""

    name: str
    sft_records: Callable[..., list[dict]]
    prompt_records: Callable[..., list[dict]]
    reward: Callable[[list[str], list[str]], list[float]]
    reward_name: str  # what the mean reward means: "accuracy" or "hidden_score"
    max_new_tokens: int  # enough for any reference completion plus EOS
    preference_records: Callable[..., list[dict]] | None = None
    eval_temperature: float = 0.0  # 0 = greedy; 1 where references are random draws (greedy would collapse to one word)


TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", arithmetic.sft_records, arithmetic.prompt_records, arithmetic.reward, "accuracy", 6),
    "multiplication": Task(
        "multiplication", multiplication.sft_records, multiplication.prompt_records, multiplication.reward, "accuracy", multiplication.MAX_NEW_TOKENS
    ),
    "lookup": Task("lookup", lookup.sft_records, lookup.prompt_records, lookup.reward, "accuracy", lookup.MAX_NEW_TOKENS),
    "lookup_value": Task(
        "lookup_value", partial(lookup.sft_records, question_form="value"), partial(lookup.prompt_records, question_form="value"), lookup.reward,
        "accuracy", lookup.MAX_NEW_TOKENS,
    ),
    "preference": Task(
        "preference", preference.sft_records, preference.prompt_records, preference.hidden_reward, "hidden_score", 12, preference.preference_records, eval_temperature=1.0
    ),
}
