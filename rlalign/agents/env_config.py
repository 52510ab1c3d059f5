"""The ``environment:`` section of a GRPO or PPO config (:class:`rlalign.train.env_source.EnvironmentSource`)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from rlalign.config import Config

__all__ = ["EnvironmentConfig"]


class EnvironmentConfig(Config):
    """Multi-turn episodes against a Python environment (rlalign.agents.environment), token-exact and batched."""

    model_config = ConfigDict(populate_by_name=True)

    cls: str | None = Field(None, alias="class", description="the environment as module:Class (one object per episode); null: the object given to train(environment=...)")
    max_turns: int = Field(4, ge=1, description="assistant turns per episode (the last turn's calls are not run)")
    max_new_tokens: int | None = Field(None, ge=1, description="tokens per assistant turn; null: sampling.max_new_tokens")
    timeout_s: float | None = Field(None, gt=0, description="seconds an episode may last from its batch's start (past it the episode ends, counted in agents/timed_out); null: no limit")
    tool_format: Literal["auto", "hermes", "llama3", "mistral", "tags"] = Field(
        "auto", description="how calls are written and parsed: auto = the chat template's (hermes, llama3, mistral), tags (<tool>NAME: ARG</tool>) without one"
    )
    max_result_chars: int = Field(1000, ge=1, description="a tool result (each message of a step() reply) is cut to this many characters")
