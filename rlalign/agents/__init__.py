"""Agents and environments: multi-turn rollouts through chat-template tool calls, Python environments,
and agent code written against the ``openai`` client (:mod:`rlalign.agents.openai_server`)."""
