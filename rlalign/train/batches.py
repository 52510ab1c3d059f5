"""What travels between a producer and a learner: a scored batch as plain tensors and containers
(queues, point-to-point messages, and checkpoints read with ``weights_only=True``), the step a
producer samples, the tensors a learner publishes, and the producer's error."""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch import nn

from rlalign.config import ConfigError
from rlalign.errors import RLAlignError
from rlalign.lm.data import PromptExample
from rlalign.lm.rollout import Rollout
from rlalign.train.rollouts import ScoredRollout
from rlalign.train.sources import ScoredBatch

__all__ = ["RolloutProducerError", "StepState", "trainable", "to_bytes", "batch_state", "batch_from_state", "check_in_flight"]


class RolloutProducerError(RLAlignError, RuntimeError):
    """A rollout producer raised or died; the message names the step and what it was doing."""


@dataclass
class StepState:
    """What a source reads of the trainer's state in a producer: the step."""

    step: int


def trainable(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters a learner publishes (those it trains), in the module's order."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


_ROLLOUT_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "group_index", "truncated")


def to_bytes(state: dict) -> bytes:
    """A batch as bytes on the queue: its tensors travel in the message, not as shared-memory handles of a process that may be gone."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def batch_state(batch: ScoredBatch) -> dict:
    s = batch.scored
    return {
        "examples": [{"prompt": ex.prompt, "metadata": dict(ex.metadata)} for ex in batch.examples],
        "rollout": {name: getattr(batch.rollout, name) for name in _ROLLOUT_FIELDS},
        "scored": {
            "prompts": list(s.prompts), "completions": list(s.completions), "local_scores": s.local_scores, "local_per_term": dict(s.local_per_term),
            "scores": s.scores, "per_term": dict(s.per_term), "failed": dict(s.failed), "term_stats": dict(s.term_stats),
            "extra": dict(s.extra), "logged": dict(s.logged),
        },
        "token_mask": batch.token_mask, "metrics": dict(batch.metrics), "version": batch.version, "generate_s": batch.generate_s,
        "score_s": batch.score_s, "data_position": batch.data_position, "row_episode": batch.row_episode, "row_weight": batch.row_weight,
    }


def batch_from_state(state: dict) -> ScoredBatch:
    examples = [PromptExample(ex["prompt"], ex["metadata"]) for ex in state["examples"]]
    return ScoredBatch(
        examples, Rollout(**state["rollout"]), ScoredRollout(**state["scored"]), state["token_mask"], dict(state["metrics"]), state["version"],
        state["generate_s"], state["score_s"], state["data_position"], state.get("row_episode"), state.get("row_weight"),
    )


def check_in_flight(held: int, k: int, step: int, total_steps: int, checkpoint) -> None:
    """Refuse to resume from ``checkpoint`` (None: a fresh start, nothing to check) at ``step`` when it holds fewer
    rollouts in flight than steps step .. step + k - 1 need: those are sampled by the weights of steps before the
    checkpoint, which it does not hold (a run extended past the last step it was made for, whose checkpoint there
    has nothing in flight); a producer would sample them with newer weights than the run's k allows for."""
    needed = min(k, total_steps - step)
    if checkpoint is not None and held < needed:
        raise ConfigError(
            f"cannot resume from {checkpoint.path} to steps={total_steps}: with async_rollouts (max_staleness {k}) the next {needed} steps "
            f"are sampled by the weights of steps before it, and it holds {held} of those {needed} rollouts in flight "
            f"(the run it comes from was made for steps={checkpoint.config.get('steps')}); resume with that many steps, or start a new "
            "run from its weights (model.path set to its model/ directory)"
        )
