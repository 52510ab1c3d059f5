"""Token-exact, batched multi-turn episodes: the rows of a batch take their turns together, each row's
KV cache carries over between its turns, and the environment's tokens are the chat template's.

    out = run_episodes(policy, tokenizer, records, LookupEnvironment, SamplingParams(32), group_size=8, max_turns=4)
    out.rollout          # one Rollout row per (record, sample): the completion holds every turn and every tool reply
    out.assistant_mask   # (B, C) 1 on the tokens the policy sampled, 0 on the environment's tokens and padding
    out.final_texts      # the last assistant turn's text (what the built-in reward terms and env.reward score)
    out.completions      # a conversational row's episode after the prompt as messages: what TRL's reward functions get

One row (Qwen-style template, hermes calls):

    prompt:      <|im_start|>system ... tools ...<|im_end|>\\n<|im_start|>user\\nWhich is heavier ...<|im_end|>\\n<|im_start|>assistant\\n
    completion:  <tool_call>{"name": "lookup", ...}</tool_call><|im_end|>   \\n<|im_start|>user\\n<tool_response>...   brom<|im_end|>
    mask:        1 1 1 ... (sampled)                                          0 0 0 ... (the template's tokens)            1 1 1

Token exactness. The trained ids are the sampled ids as drawn (never decoded and encoded again: a
round trip may give other ids) plus, between turns, the environment's tokens: the conversation is
rendered by the chat template with and without the turn's tool messages (``add_generation_prompt``
after them), both renderings are tokenised, the one without must be a prefix of the one with
(:class:`TemplateError` otherwise), and the environment's tokens are the suffix, starting right after
the sampled turn's end: what the template writes after the turn's content (an end-of-turn token, a
newline) is the environment's, except the part the policy drew itself (matched token by token
against the whitespace and special tokens that end the sampled turn). A text prompt (``reset``
returns a string) has no template: a tool reply is written in the format's result tags.

Batching and the cache. One DynamicCache holds the batch; every forward appends the same number of
slots to every row (a turn's draws, or the environment's tokens left-padded to the longest row's),
and a 0/1 mask over the slots hides padding and the slots of rows that are not sampling, so a row
sees exactly its own tokens. Position ids count each row's real tokens, so the log-probs equal those
of the training forward over the unpadded sequence. A turn ends at an end-of-turn token (EOS, or the
family's ``<|im_end|>`` / ``<|eot_id|>`` / ``<|eom_id|>``), after the format's closing tag in a text
prompt (matched on token ids), or at ``max_new_tokens``; the ending token is fed too, so the cache
holds the whole sequence when the environment's tokens follow.

What reward functions get. TRL's GRPOTrainer hands a reward function, as ``completions[i]`` of a
conversational prompt, the whole episode after the prompt: each assistant turn as its ``parse_response``
gives it (``content`` the text outside the call markup, ``tool_calls`` the calls with their arguments
typed by the tool's schema), each tool reply ``{"role": "tool", "name": ..., "content": ...}``, then the
final turn. ``Episodes.completions`` is that list, built from the calls the environment ran
(:func:`rlalign.agents.tool_calls.parsed_turn`); a turn without calls keeps its text as sampled (special
tokens dropped: ``final_texts``), where parse_response trims its whitespace.

Episodes end at a turn without a call (the final answer: reward from ``env.reward`` and the reward
functions), when the environment sets ``done``, after ``max_turns`` turns (the last turn's calls are
not run; ``finished`` False), or past ``timeout_s`` seconds from the batch's start (``timed_out``).
The environments of a batch run their tools together on one event loop (:class:`EnvRunner`).

Deliberate simplifications: eager (no compiled step), one process; the prompts of a group are
prefilled once per row (not once per group); slots of rows that wait (finished, or shorter
environment replies) are allocated and masked, so the cache grows with the longest row's history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from rlalign.agents.environment import new_runner
from rlalign.agents.tool_calls import TAGS, CallFormat, call_format, parsed_reply, parsed_turn
from rlalign.lm.decode import SamplingParams, _draw
from rlalign.lm.models import cache_argument
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import left_pad

__all__ = ["TemplateError", "Episodes", "run_episodes", "end_of_turn_ids", "environment_tokens", "episode_metrics", "episode_sums", "metrics_of_sums"]

Message = dict[str, Any]
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class TemplateError(ValueError):
    """The chat template does not render a tool reply as a continuation of the conversation before it."""


@dataclass
class Episodes:
    """A batch of multi-turn episodes (rows of a group adjacent), tensors on the CPU."""

    rollout: Rollout
    assistant_mask: Tensor  # (B, C) 1 on sampled tokens, 0 on environment tokens and padding
    final_texts: list[str]  # (B,) the last assistant turn's text, special tokens dropped
    conversations: list[list[Message]]  # (B,) the episode as messages (prompt, turns, tool replies)
    completions: list[list[Message] | None]  # (B,) the episode after the prompt as TRL's reward functions get it; None: a text prompt
    environments: list[Any]  # (B,) each episode's environment object, as given (TRL's reward functions get them as `environments`)
    prompts: list[Any]  # (B,) each episode's prompt as its reset made it (text, or messages), what the policy saw
    env_rewards: list[float | None]  # (B,) the environment's reward, None when it gives none
    turns: Tensor  # (B,) assistant turns taken
    tool_calls: Tensor  # (B,) calls made (malformed included)
    malformed: Tensor  # (B,) malformed calls
    finished: Tensor  # (B,) bool: ended with a final answer that stopped on its own (or the environment's done); else truncated
    timed_out: Tensor  # (B,) bool: ended by the time limit


def end_of_turn_ids(tokenizer) -> list[int]:
    """EOS and the end-of-turn tokens of the common families that the vocabulary has."""
    ids = [tokenizer.eos_token_id]
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in _END_OF_TURN if t in vocab]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages: Sequence[Message], tools: list | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt)


def environment_tokens(tokenizer, conversation: Sequence[Message], replies: Sequence[Message], turn_ids: Sequence[int], tools: list | None) -> list[int]:
    """The tokens the chat template writes after a sampled assistant turn (``conversation[-1]``, whose
    sampled ids are ``turn_ids``) for the messages ``replies``, up to the next assistant header.

    Raises:
        TemplateError: the rendering without the replies is not a token prefix of the one with them, or
            the turn's content cannot be found in it.
    """
    before = _render(tokenizer, conversation, tools, False)
    after = _render(tokenizer, [*conversation, *replies], tools, True)
    before_ids, after_ids = _encode(tokenizer, before), _encode(tokenizer, after)
    if after_ids[: len(before_ids)] != before_ids:
        raise TemplateError("the chat template renders the conversation differently once tool messages follow it; "
                            f"its tokens before them are not a prefix: ...{before[-80:]!r}")
    content = str(conversation[-1]["content"]).strip()
    at = before.rfind(content) if content else -1
    if at < 0:
        raise TemplateError(f"the chat template does not write the assistant's turn as sampled: {content[:80]!r} not in {before[-200:]!r}")
    head = _encode(tokenizer, before[: at + len(content)])
    if before_ids[: len(head)] != head:
        raise TemplateError(f"the end of the assistant's turn is not a token boundary of the rendered conversation: {before[-80:]!r}")
    k = len(head)
    special = set(tokenizer.all_special_ids)
    extra = 0  # the sampled turn's trailing whitespace and special tokens: what the policy drew after the content
    while extra < len(turn_ids) and (turn_ids[-1 - extra] in special or not tokenizer.decode([turn_ids[-1 - extra]]).strip()):
        extra += 1
    for token in turn_ids[len(turn_ids) - extra:]:  # those the template writes after the content too are already there
        if k < len(before_ids) and before_ids[k] == token:
            k += 1
    return after_ids[k:]


class _BatchCache:
    """A batch's KV cache over shared slots with a 0/1 mask per row; ``logits`` (B, V): each row's next-token logits."""

    def __init__(self, model: nn.Module, batch: int, pad: int, device: torch.device):
        self.model, self.pad, self.device = model, pad, device
        self.keyword = cache_argument(model)
        self.cache = DynamicCache()
        self.mask = torch.zeros((batch, 0), dtype=torch.long, device=device)  # (B, L)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) next position of each row
        self.logits: Tensor | None = None  # (B, V)

    def forward(self, ids: Tensor, mask: Tensor) -> None:
        """Append (B, T) ``ids`` (``mask`` 1 on real tokens, left-padded); rows with a real last token get new logits."""
        positions = self.positions[:, None] + (mask.cumsum(1) - 1).clamp(min=0)  # (B, T)
        self.mask = torch.cat([self.mask, mask], 1)  # (B, L + T)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True, logits_to_keep=1, **{self.keyword: self.cache})
        last = out.logits[:, -1, :].float()  # (B, V)
        has = mask[:, -1].bool()[:, None]
        self.logits = last if self.logits is None else torch.where(has, last, self.logits)
        self.positions = self.positions + mask.sum(1)

    def extend(self, chunks: Sequence[Sequence[int]]) -> None:
        """Append each row's ``chunks[r]`` (possibly empty), left-padded to the longest."""
        width = max(len(c) for c in chunks)
        if width == 0:
            return
        ids = torch.full((len(chunks), width), self.pad, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(chunks), width), dtype=torch.long)  # (B, T)
        for r, chunk in enumerate(chunks):
            if chunk:
                ids[r, width - len(chunk):] = torch.tensor(list(chunk))
                mask[r, width - len(chunk):] = 1
        self.forward(ids.to(self.device), mask.to(self.device))


def _draw_token(logits: Tensor, params: SamplingParams, uniform: Tensor | None, alive: Tensor) -> tuple[Tensor, Tensor]:
    """The next token of every row (B,) and its log-prob (B,); ``alive`` (B,): the rows that keep it (tests script it)."""
    return _draw(logits, params, uniform)


def _sample_turn(
    state: _BatchCache, active: list[bool], params: SamplingParams, stop_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]],
    generator: torch.Generator | None, shard: tuple[slice, int] | None = None,
) -> tuple[list[list[int]], list[list[float]], list[bool]]:
    """One turn of every active row: (ids, log-probs, ended at a stop) per row (empty for inactive rows).
    ``shard`` (rows, total): the rows are rows ``rows`` of ``total``, and the turn draws every row's uniforms."""
    B, N = len(active), params.max_new_tokens
    rows, total = shard or (slice(0, B), B)
    uniforms = None if params.greedy else torch.rand((N, total), generator=generator)[:, rows]  # (N, B)
    ids: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    stopped = [False] * B
    alive = torch.tensor(active, device=state.device)  # (B,)
    stop = torch.as_tensor(list(stop_ids), device=state.device)
    for t in range(N):
        token, logp = _draw_token(state.logits, params, None if uniforms is None else uniforms[t].to(state.device), alive)  # (B,), (B,)
        ended = torch.isin(token, stop)  # (B,)
        tokens, values = token.tolist(), logp.tolist()
        for r in alive.nonzero().flatten().tolist():
            ids[r].append(tokens[r])
            logps[r].append(values[r])
            if any(len(s) <= len(ids[r]) and ids[r][-len(s):] == list(s) for s in stop_sequences):
                ended[r] = True
        state.forward(torch.where(alive, token, state.pad)[:, None], alive.long()[:, None])  # the drawn token enters the cache
        for r in (alive & ended).nonzero().flatten().tolist():
            stopped[r] = True
        alive = alive & ~ended
        if not bool(alive.any()):
            break
    return ids, logps, stopped


def _with_deadline(coro, deadline: float | None):
    if deadline is None:
        return coro
    return asyncio.wait_for(coro, max(deadline - time.monotonic(), 1e-3))


async def _gather(jobs: Mapping[int, Any], deadlines: Sequence[float | None]) -> dict[int, tuple[Any, bool]]:
    """Each row's awaited job: (result, timed out)."""
    rows = list(jobs)
    results = await asyncio.gather(*(_with_deadline(jobs[r], deadlines[r]) for r in rows), return_exceptions=True)
    out = {}
    for r, result in zip(rows, results):
        if isinstance(result, (asyncio.TimeoutError, TimeoutError)):
            out[r] = (None, True)
        elif isinstance(result, BaseException):
            raise result
        else:
            out[r] = (result, False)
    return out


@torch.no_grad()
def run_episodes(
    model: nn.Module, tokenizer, records: Sequence[Mapping[str, Any]], make_env: Callable[[], Any], params: SamplingParams, *,
    group_size: int = 1, max_turns: int = 3, fmt: CallFormat | str = "auto", generator: torch.Generator | None = None,
    timeout_s: float | None = None, max_result_chars: int = 1000, shard: tuple[slice, int] | None = None,
) -> Episodes:
    """``group_size`` episodes per record (rows of a group adjacent), each against its own environment
    from ``make_env``, at most ``max_turns`` assistant turns of at most ``params.max_new_tokens`` tokens.

    Args:
        records: the rows' records, handed to ``env.reset``.
        fmt: a :class:`CallFormat`, or its name ("auto": the chat template's).
        timeout_s: seconds an episode may last from the batch's start (None: no limit).
        shard: (rows, total): these episodes are rows ``rows`` of a step's ``total`` (a rank's share);
            each turn draws the uniforms of all ``total`` rows and takes its own, so a row's tokens do
            not depend on how the step is split. None: the rows are the whole step.
    """
    fmt = call_format(fmt, tokenizer) if isinstance(fmt, str) else fmt
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = end_of_turn_ids(tokenizer)
    rows = [record for record in records for _ in range(group_size)]  # (B,)
    B = len(rows)
    runners = [new_runner(make_env, max_result_chars) for _ in rows]
    loop = asyncio.new_event_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=min(32, B)))
    start = time.monotonic()
    deadlines = [None if timeout_s is None else start + timeout_s] * B
    try:
        resets = loop.run_until_complete(_gather({r: runners[r].reset(rows[r]) for r in range(B)}, deadlines))
        if any(timed for _, timed in resets.values()):
            raise TimeoutError(f"an environment's reset took longer than the episode time limit ({timeout_s} s)")
        schemas: dict[tuple, list] = {}  # one environment class and set of tools, one set of schemas
        for runner in runners:
            if fmt is not TAGS and runner.schema_key not in schemas:
                schemas[runner.schema_key] = runner.schemas()
        tools = [schemas.get(runner.schema_key) for runner in runners]
        chat = [isinstance(resets[r][0], list) for r in range(B)]
        conversations: list[list[Message]] = [list(resets[r][0]) if chat[r] else [{"role": "user", "content": resets[r][0]}] for r in range(B)]
        reset_prompts = [list(resets[r][0]) if chat[r] else resets[r][0] for r in range(B)]  # as reset made them: an environment may grow the list it returned
        completions: list[list[Message]] = [[] for _ in range(B)]  # TRL's view of each row's episode after the prompt
        special = list(tokenizer.all_special_tokens)
        prompts = [_encode(tokenizer, _render(tokenizer, conversations[r], tools[r], True)) if chat[r] else tokenizer(resets[r][0])["input_ids"] for r in range(B)]
        close = _encode(tokenizer, fmt.close) if fmt.close else []
        text_stops = [close] if close else []
        state = _BatchCache(model, B, pad, device)
        state.extend(prompts)  # the prefill
        ids, sampled, logps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
        final, rewards = [""] * B, [None] * B
        done, finished, timed_out = [False] * B, [False] * B, [False] * B
        turns, n_calls, n_bad = [0] * B, [0] * B, [0] * B
        for turn in range(max_turns):
            active = [not d for d in done]
            if not any(active):
                break
            # text prompts stop after the closing tag; chat turns at the end-of-turn token
            stops = text_stops if not all(chat[r] for r in range(B) if active[r]) else []
            new, new_logps, stopped = _sample_turn(state, active, params, stop_ids, stops, generator, shard)
            jobs, env_chunks = {}, [[] for _ in range(B)]
            for r in range(B):
                if not active[r]:
                    continue
                ids[r] += new[r]
                sampled[r] += [1] * len(new[r])
                logps[r] += new_logps[r]
                turns[r] += 1
                body = new[r][:-1] if new[r] and new[r][-1] in stop_ids else new[r]
                text = tokenizer.decode(body, skip_special_tokens=False)
                final[r] = tokenizer.decode(body, skip_special_tokens=True)
                conversations[r].append({"role": "assistant", "content": text.rstrip()})  # trailing whitespace: the template's (matched below)
                calls = fmt.parse(text)
                completions[r].append(parsed_turn(text, final[r], calls, fmt, tools[r], special))
                n_calls[r] += len(calls)
                n_bad[r] += sum(c.error is not None for c in calls)
                if not calls:  # the final answer: finished where it ended, truncated (as a completion with no EOS) where max_new_tokens cut it
                    done[r], finished[r] = True, stopped[r]
                elif turn == max_turns - 1:
                    done[r] = True  # the last turn's calls are not run
                else:
                    jobs[r] = runners[r].respond(calls, r, turn)
            replies = loop.run_until_complete(_gather(jobs, deadlines))
            for r, (messages, timed) in replies.items():
                if timed:
                    done[r] = timed_out[r] = True
                    continue
                if chat[r]:
                    env_chunks[r] = environment_tokens(tokenizer, conversations[r], messages, new[r], tools[r])
                else:
                    env_chunks[r] = _encode(tokenizer, "".join(fmt.render_result(str(m["content"])) if m.get("role") == "tool" else str(m["content"]) for m in messages))
                conversations[r] += messages
                completions[r] += [parsed_reply(m) for m in messages]
                if runners[r].done:
                    done[r] = finished[r] = True
                    env_chunks[r] = []
                    continue
                ids[r] += env_chunks[r]
                sampled[r] += [0] * len(env_chunks[r])
                logps[r] += [0.0] * len(env_chunks[r])
            if any(env_chunks) and not all(done):
                state.extend([env_chunks[r] if not done[r] else [] for r in range(B)])
        scored = {r: runners[r].reward(final[r]) for r in range(B) if not timed_out[r]}
        for r, (value, timed) in loop.run_until_complete(_gather(scored, deadlines)).items():
            rewards[r] = value
            timed_out[r] = timed_out[r] or timed
    finally:
        loop.close()  # its thread pool is shut down without waiting: a tool past the time limit finishes on its own
    completions = [completions[r] if chat[r] else None for r in range(B)]
    environments = [runner.given for runner in runners]
    return _collect(prompts, ids, sampled, logps, pad, group_size, len(records), final, conversations, completions, environments,
                    reset_prompts, rewards, turns, n_calls, n_bad, finished, timed_out)


def _collect(prompts, ids, sampled, logps, pad, group_size, n_records, final, conversations, completions, environments, reset_prompts, rewards, turns,
             n_calls, n_bad, finished, timed_out) -> Episodes:
    width = max(1, max(len(x) for x in ids))

    def right_pad(values: list[list], fill, dtype) -> Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype)  # (B, C)

    prompt_ids, prompt_mask = left_pad(prompts, pad)  # (B, P)
    unfinished = torch.tensor([not f for f in finished])
    rollout = Rollout(
        prompt_ids, prompt_mask, right_pad(ids, pad, torch.long), right_pad([[1] * len(x) for x in ids], 0, torch.long), right_pad(logps, 0.0, torch.float32),
        torch.arange(n_records).repeat_interleave(group_size), unfinished,
    )
    return Episodes(
        rollout, right_pad(sampled, 0, torch.long), final, conversations, completions, environments, reset_prompts, rewards, torch.tensor(turns), torch.tensor(n_calls),
        torch.tensor(n_bad),
        torch.tensor(finished), torch.tensor(timed_out),
    )


def episode_sums(episodes: Episodes) -> dict[str, float]:
    """The sums behind :func:`episode_metrics` (ranks add theirs up, then :func:`metrics_of_sums`)."""
    return {
        "turns": float(episodes.turns.sum()), "tool_calls": float(episodes.tool_calls.sum()), "malformed_calls": float(episodes.malformed.sum()),
        "finished": float(episodes.finished.sum()), "timed_out": float(episodes.timed_out.sum()), "rows": float(episodes.turns.numel()),
        "assistant_tokens": float(episodes.assistant_mask.sum()), "tokens": float(episodes.rollout.completion_mask.sum()),
    }


def metrics_of_sums(sums: dict[str, float]) -> dict[str, float]:
    rows = sums["rows"]
    out = {f"agents/{k}": sums[k] / rows for k in ("turns", "tool_calls", "malformed_calls", "finished", "timed_out")}
    out["agents/env_tokens_frac"] = 1.0 - sums["assistant_tokens"] / max(sums["tokens"], 1.0)
    return out


def episode_metrics(episodes: Episodes) -> dict[str, float]:
    """agents/turns, tool_calls, malformed_calls (per episode), finished and timed_out (shares), env_tokens_frac."""
    return metrics_of_sums(episode_sums(episodes))