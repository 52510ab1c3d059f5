"""The ``agent:`` section of a GRPO or PPO config: agent code behind an OpenAI-compatible endpoint
(:mod:`rlalign.agents.agent_source`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlalign.config import Config

__all__ = ["AgentConfig"]


class AgentConfig(Config):
    """Rollouts made by an agent function written against the ``openai`` client."""

    function: str | None = Field(
        None, description="the agent, 'package.module:function' (sync or async), called as f(base_url, record) for each episode: base_url is the "
        "policy's OpenAI-compatible endpoint for this episode, record the prompt row (its 'prompt' and other columns); it returns the "
        "final answer (text), or a dict with 'answer' and/or 'reward', or None (the last reply's content is the answer)"
    )
    timeout_s: float = Field(120.0, gt=0, description="time limit of one episode; past it the episode fails (its calls so far are kept, its answer is empty)")
    max_calls: int = Field(8, ge=1, description="chat-completion requests one episode may make; past that the endpoint answers 400 and the episode fails")
    max_concurrency: int = Field(64, ge=1, description="episodes run at once (threads for synchronous agents)")
    batch_wait_ms: float = Field(5.0, ge=0, description="how long the endpoint waits for more requests to sample together after the first")
    serve_without_effect: list[Literal["seed", "tool_choice"]] = Field(
        default_factory=list, description="request fields the endpoint serves without their effect instead of a 400, for agent frameworks that "
        "always send them: seed (the draws stay the run's), tool_choice \"required\" or a named function (served as \"auto\": the policy may "
        "answer without a call; smolagents' ToolCallingAgent sends \"required\")"
    )

    @model_validator(mode="after")
    def _module_function(self) -> AgentConfig:
        module, sep, attr = (self.function or "").partition(":")
        if not (module and sep and attr):
            raise ValueError(f"agent.function {self.function!r}: expected 'package.module:function' (the agent to run)")
        return self
