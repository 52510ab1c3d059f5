"""Multi-turn rollouts with tools: the policy samples a turn, the environment answers its tool calls,
the answer is appended and sampling continues, up to ``max_turns`` assistant turns per row.

    out = tool_rollout(policy, tokenizer, records, lambda: ToolEnvironment(registry, TAG, 3), TAG, params, group_size=8)
    out.rollout          # one Rollout row per (prompt, sample): completion = every turn, tool results included
    out.assistant_mask   # (B, C) 1 on the tokens the policy sampled, 0 on tool / environment tokens and padding
    out.final_texts      # (B,) the last assistant turn's text: what the reward functions score

One row, laid out in its completion (tag format, :mod:`rlalign.lm.tools`):

    prompt: "37*48="
    completion: "<tool>calculator: 37*48</tool>" "<result>1776</result>" "1776" <eos>
    assistant_mask:  1 1 1 ... 1 1                0 0 0 ... 0 0          1 1 1 1  1
    logprobs:        sampler's log-probs          0                      sampler's

How the mask travels: ``Rollout.completion_mask`` stays 1 on every real token (tool results
included: the training forward must attend to them, as the sampler did), and the loss mask is
``loss_mask(rollout) * assistant_mask`` (:func:`rlalign.train.grpo.grpo_step`), so tool tokens get
no gradient and count in no aggregate. The training forward recomputes log-probs over the whole
completion; the sampler's log-probs of assistant tokens equal them (ratio 1 before the first update),
those of tool tokens are 0 and never read.

A turn ends at EOS (the final answer: the row is done), right after the format's closing tag
(sampling stops at the tag's token when it is a single token, else the turn is cut after the first
closing tag and what was drawn after it dropped), or at ``max_new_tokens``. Every turn goes to
``env.step`` (for its reward, and unless it ended at EOS for its messages: a turn cut at
``max_new_tokens`` inside a call gets the "malformed call" error); a row that ends without EOS
(the environment said done, or ``max_turns``) is ``truncated``. Each turn after the first is sampled with the
row's prompt plus its completion so far as the prompt (prefilled again: no KV cache is kept across
turns), one row per prompt; each turn draws its uniforms from ``generator`` (with ``shard``: those of the
whole step, so under torchrun each rank runs its share and draws what one process would).

Deliberate simplifications: sampling is eager (``sampling.compile`` is not used: every turn has
new shapes); tool results are written by the format's result tags as plain text, not by the
chat template; a row's completion may grow to max_turns x (max_new_tokens + result length).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from rlalign.config import Config
from rlalign.lm.encoding import encode_prompts
from rlalign.lm.model_modes import attention_kernel, evaluating
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import SamplingParams, left_pad, sample
from rlalign.lm.tools import Environment, ToolEnvironment, ToolFormat, ToolRegistry, format_for, render_observation
from rlalign.lm.models import stop_token_ids
from rlalign.train import distributed
from rlalign.train.common import forward_precision

__all__ = ["ToolsConfig", "ToolRollout", "tool_rollout", "tool_registry", "sample_tool_shard"]


class ToolsConfig(Config):
    """Multi-turn tool use in the rollout (GRPO ``tools``)."""

    enabled: list[str] = Field(default_factory=lambda: ["calculator"], description="tools: built-ins (calculator, python) or module:function of one string argument")
    max_turns: int = Field(3, ge=1, description="assistant turns per completion; the last turn's tool calls are not run")
    format: Literal["auto", "tag", "hermes"] = Field(
        "auto", description="tool-call format: tag = <tool>NAME: ARG</tool>, hermes = JSON in <tool_call>; auto = hermes if the chat template has it"
    )
    max_result_chars: int = Field(500, ge=1, description="a tool result is cut to this many characters")
    allow_weak_sandbox: bool = Field(False, description="let the python tool run without bubblewrap isolation (unsafe)")


def tool_registry(cfg: ToolsConfig, extra: Mapping[str, Callable[[str], Any]] | None = None) -> ToolRegistry:
    """The registry of ``cfg.enabled`` (built-ins by name, others imported as module:function) plus ``extra``."""
    import importlib

    from rlalign.config import ConfigError

    builtin = [name for name in cfg.enabled if ":" not in name]
    try:
        registry = ToolRegistry.builtin(builtin, cfg.allow_weak_sandbox)
    except ValueError as err:
        raise ConfigError(f"tools.enabled: {err}") from None
    for name in cfg.enabled:
        if ":" in name:
            module, attr = name.split(":", 1)
            try:
                registry.register_tool(attr, getattr(importlib.import_module(module), attr))
            except (ImportError, AttributeError, TypeError) as err:
                raise ConfigError(f"tool {name!r} cannot be imported: {err}") from None
    for name, fn in (extra or {}).items():
        registry.register_tool(name, fn)
    return registry


@dataclass
class ToolRollout:
    """A multi-turn rollout: the Rollout, which of its tokens the policy sampled, and per-row episode facts."""

    rollout: Rollout
    assistant_mask: Tensor  # (B, C) 1 on sampled tokens (assistant turns, EOS included), 0 on tool tokens and padding
    final_texts: list[str]  # (B,) text of the last assistant turn
    turns: Tensor  # (B,) assistant turns taken
    tool_messages: Tensor  # (B,) tool / environment messages received
    env_rewards: list[float | None]  # (B,) the environment's last reward, None when it gave none


def _stop_token(tokenizer, fmt: ToolFormat) -> list[int]:
    """The closing tag's id when the tokenizer has it as one token (e.g. Qwen's </tool_call>), else none."""
    ids = tokenizer(fmt.close, add_special_tokens=False)["input_ids"]
    return ids if len(ids) == 1 else []


def _cut_after_close(tokenizer, ids: list[int], close: str) -> int | None:
    """The number of leading tokens of ``ids`` whose text first contains ``close``; None if it never does."""
    if close not in tokenizer.decode(ids, skip_special_tokens=True):
        return None
    for j in range(1, len(ids) + 1):
        if close in tokenizer.decode(ids[:j], skip_special_tokens=True):
            return j
    return None


@torch.no_grad()
def tool_rollout(
    model: nn.Module, tokenizer, records: Sequence[Mapping[str, Any]], make_env: Callable[[], Environment], fmt: ToolFormat, params: SamplingParams,
    group_size: int = 1, max_turns: int = 3, generator: torch.Generator | None = None, shard: tuple[slice, int] | None = None,
) -> ToolRollout:
    """Sample ``group_size`` multi-turn episodes per record (rows of a group adjacent), each with its own
    environment from ``make_env``, at most ``max_turns`` assistant turns (the environment may end sooner).

    Args:
        records: prompt records; ``env.reset(record)`` gives each row's prompt (text or chat messages).
        params: sampling parameters of one turn (``max_new_tokens`` per turn).
        shard: (rows, total): these episodes are rows ``rows`` of a step of ``total`` rows (a rank's
            share); each turn draws the uniforms of all ``total`` rows from ``generator`` and takes
            its own, so a row's tokens do not depend on how the step is split. None: its own draws.
    Returns:
        :class:`ToolRollout`, tensors on the CPU.
    """
    pad, ends = tokenizer.pad_token_id, stop_token_ids(model, tokenizer)  # EOS and the generation config's end of turn
    stop = [*ends, *_stop_token(tokenizer, fmt)]
    rows = [record for record in records for _ in range(group_size)]  # (B,)
    envs = [make_env() for _ in rows]
    prompts = encode_prompts(tokenizer, [env.reset(record) for env, record in zip(envs, rows)])
    B = len(rows)
    ids: list[list[int]] = [[] for _ in range(B)]
    sampled: list[list[int]] = [[] for _ in range(B)]  # 1 = the policy's token
    logps: list[list[float]] = [[] for _ in range(B)]
    final = [""] * B
    done, truncated = [False] * B, [False] * B
    turns, messages_in, rewards = [0] * B, [0] * B, [None] * B
    for _ in range(max_turns):
        active = [r for r in range(B) if not done[r]]
        if not active:
            break
        if shard is None:
            out = sample(model, [prompts[r] + ids[r] for r in active], params, pad, stop, 1, generator)
        else:
            noise = torch.rand((params.max_new_tokens, shard[1]), generator=generator)[:, shard[0]]  # (N, B): this shard's columns
            out = sample(model, [prompts[r] + ids[r] for r in active], params, pad, stop, 1, noise=noise[:, active])
        for i, r in enumerate(active):
            new = out.completion_ids[i][out.completion_mask[i].bool()].tolist()
            logp = out.logprobs[i][: len(new)].tolist()
            ended = bool(new) and new[-1] in ends
            cut = None if ended else _cut_after_close(tokenizer, new, fmt.close)
            if cut is not None:
                new, logp = new[:cut], logp[:cut]
            ids[r] += new
            sampled[r] += [1] * len(new)
            logps[r] += logp
            turns[r] += 1
            text = tokenizer.decode(new, skip_special_tokens=True)
            final[r] = text
            messages, env_done, reward = envs[r].step(text)
            rewards[r] = reward if reward is not None else rewards[r]
            if ended or env_done:
                done[r], truncated[r] = True, not ended
                continue
            observation = tokenizer(render_observation(messages, fmt), add_special_tokens=False)["input_ids"]
            ids[r] += observation
            sampled[r] += [0] * len(observation)
            logps[r] += [0.0] * len(observation)
            messages_in[r] += len(messages)
    for r in range(B):
        truncated[r] = truncated[r] or not done[r]  # still waiting for a turn after max_turns
    width = max(1, max(len(x) for x in ids))

    def right_pad(values: list[list], fill, dtype) -> Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype)  # (B, C)

    prompt_ids, prompt_mask = left_pad(prompts, pad)  # (B, P)
    completion_mask = right_pad([[1] * len(x) for x in ids], 0, torch.long)  # (B, C)
    rollout = Rollout(
        prompt_ids, prompt_mask, right_pad(ids, pad, torch.long), completion_mask, right_pad(logps, 0.0, torch.float32),
        torch.arange(len(records)).repeat_interleave(group_size), torch.tensor(truncated),
    )
    return ToolRollout(rollout, right_pad(sampled, 0, torch.long), final, torch.tensor(turns), torch.tensor(messages_in), rewards)


def sample_tool_shard(updater, tokenizer, records: Sequence[Mapping[str, Any]], sampling, model_cfg, group_size: int, generator: torch.Generator,
                      cfg: ToolsConfig, registry: ToolRegistry, world: distributed.World = distributed.World()) -> ToolRollout:
    """:func:`tool_rollout` of this rank's share of a step's prompt ``records`` (all of them, as
    ``rlalign.train.rollouts.sample_shard`` takes them) by ``updater``'s policy (or its sampling
    copy), in the contexts ``sample_shard`` samples in; the rows' tokens do not depend on the world size."""
    share = world.shard(len(records), "prompts_per_step")
    records = list(records[share])
    rows = slice(share.start * group_size, share.stop * group_size)
    fmt = format_for(cfg.format, tokenizer)
    policy, sampler = updater.module, updater.sampler()
    precision = forward_precision(model_cfg, policy) if sampler is policy else contextlib.nullcontext()
    with distributed.gathered(policy), precision, evaluating(sampler), attention_kernel(sampler, sampling.attn_implementation):
        return tool_rollout(
            sampler, tokenizer, records, lambda: ToolEnvironment(registry, fmt, cfg.max_turns, cfg.max_result_chars), fmt, sampling.params(),
            group_size, cfg.max_turns, generator, (rows, len(records) * group_size * world.size),
        )

