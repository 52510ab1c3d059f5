"""Rollouts made by agent code written against the ``openai`` client: a rollout source
(:mod:`rlalign.train.sources`) whose episodes are the user's agent function run against the policy
served at a local OpenAI-compatible endpoint (:mod:`rlalign.agents.openai_server`).

    agent:
      function: my_agents:solve        # def solve(base_url, record): client = OpenAI(base_url=base_url, ...) ...
      timeout_s: 120
      max_calls: 8

Per step: the step's n prompt records, G episodes each (E = n G), run at once (at most
``max_concurrency``; async agents on one event loop, sync ones on threads), each with its own base URL
``http://127.0.0.1:PORT/episodes/ID/v1`` so the server records its calls, each within ``timeout_s``.
An agent returns its final answer (text), a dict with ``answer`` and/or ``reward``, or None (the
last reply's content is the answer; so is an ``answer`` of None); anything else (another type, a
dict with another key) is an error naming the agent and the prompt, as a reward function's wrong
return is. The reward terms score the answer against the record's
columns (as the last completion of a single-turn rollout); a returned ``reward`` is added as the term
"agent"; one that is not a number or not finite is an error naming the agent and the prompt
(:func:`rlalign.agents.env_calls.checked_reward`). An episode that raises, times out or passes
``max_calls`` fails (metric agent/failed): it is marked :data:`AGENT_FAILED` and leaves training like
an unscored row (advantage 0, no loss tokens, not in its group's baseline), never scored as a 0.
The endpoint samples every call at the run's ``sampling`` settings (a request asking for another
temperature, top_p or top_k gets a 400), so the rows' log-probs are those of the policy they are
trained as; a call whose client left before its reply (a timeout, then the client's retry) is not
recorded (metric agent/abandoned_calls).

How an episode's calls are trained. Episode e of the step made k_e calls (choices of a call with n > 1
are calls too), c = 1..k_e, each with the prompt ids p_c it was rendered to and the completion ids
o_c the sampler drew (token-exact: as recorded by the server, never re-tokenised; EOS kept). Each
call is one row of the rollout (prompt p_c, completion o_c, the sampler's log-probs), and every row of
episode e gets the episode's advantage: GRPO's A_e from the scores R of the G episodes of its prompt
(the group is the episode group, not the rows), PPO's per-row GAE with the episode's score R_e at the
row's last token. Rows count so that an episode counts once, whatever its number of calls: with the
sequence aggregations each row weighs w_c = 1 / k_e (``ScoredBatch.row_weight``), so for
seq-mean-token-mean

    L = 1 / E' * sum_e 1 / k_e * sum_{c in e} 1 / |o_c| * sum_t l_{c,t},    E' = the episodes with a call,

the mean over episodes of the mean over their calls of each call's token mean (with one call an
episode is a single-turn row); with token-mean every token counts once (w = 1: an episode of k calls
weighs its tokens, as one row of the same tokens would). Tokens the agent's code wrote into later
prompts (tool results, its own edits of the transcript) are prompt tokens of later rows and never
get gradient. Since rows, not tokens, carry the weights, the weights enter the loss masks only
(:func:`rlalign.core.losses.aggregate`, row weights).

Under torchrun each rank runs its share of the step's episodes, named by their index in the step, against
an endpoint of its own; GRPO with DDP only (the ranks hold different numbers of rows). Deliberate simplifications: the
sampling batches depend on when requests arrive, so only each call's uniforms, not the batch
shapes, are fixed by (seed, step, episode, call); every turn prefills its whole prompt again (the
agent may rewrite the history, so no KV cache is kept across calls); a sync agent that times out
keeps its thread until its next request, which the server refuses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlalign.agents.agent_config import AgentConfig
from rlalign.agents.env_calls import checked_reward
from rlalign.agents.openai_server import CallRecord, PolicyServer
from rlalign.config import ConfigError
from rlalign.lm.data import PromptExample
from rlalign.lm.model_modes import attention_kernel, evaluating
from rlalign.lm.reward_calls import RewardFunctionError, is_async_reward
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import sample
from rlalign.lm.models import stop_token_ids
from rlalign.train import distributed
from rlalign.train.common import forward_precision
from rlalign.train.rl_eval import pass_at_ks
from rlalign.train.rollouts import RewardTerm, add_score_term, prompt_batch, score_shard
from rlalign.train.sources import ScoredBatch, Scorer, make_scorer

__all__ = ["AgentConfig", "AGENT_FAILED", "Episode", "load_agent", "episode_rows", "row_weights", "AgentSource", "make_agent_source", "agent_evaluator"]

AGENT_FAILED = "agent_failed"  # the failed rows' entry of episodes that raised, timed out or passed max_calls (reward/agent_failed/failed)


def load_agent(spec: str) -> Callable:
    """``package.module:function`` imported, the current directory importable.

    Raises:
        ConfigError: naming ``spec`` when it cannot be imported or is not callable.
    """
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"agent.function {spec!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"agent.function {spec!r} is not callable")
    return fn


@dataclass
class Episode:
    """One episode's outcome: its recorded calls, its answer and optional reward, and why it failed."""

    calls: list[CallRecord]
    answer: str
    reward: Any = None  # a float once checked (AgentSource._episodes); None: no reward of its own
    error: str | None = None  # None: the agent returned
    misuse: str | None = None  # what it returned is no answer (_outcome): the agent's code is wrong, and the run stops
    seconds: float = 0.0


def _outcome(result: Any, calls: list[CallRecord]) -> tuple[str, Any]:
    """(answer, reward as returned: checked by :func:`checked_reward`) of what an agent returned (module docstring)."""
    last = calls[-1].text if calls else ""
    if result is None:
        return last, None
    if isinstance(result, str):
        return result, None
    if isinstance(result, dict):
        unknown = sorted(map(str, set(result) - {"answer", "reward"}))
        if unknown:
            raise TypeError(f"the agent returned a dict with {', '.join(map(repr, unknown))}; its keys are 'answer' and 'reward'")
        answer = last if result.get("answer") is None else result["answer"]  # None: the last reply's, as a None return
        return (answer if isinstance(answer, str) else str(answer)), result.get("reward")
    raise TypeError(f"the agent returned {type(result).__name__}; expected text, a dict with 'answer' / 'reward', or None")


def row_weights(calls_per_episode: Sequence[int], aggregation: str) -> torch.Tensor:
    """w_c = 1 / k_e on each of episode e's k_e rows (sequence aggregations), 1 under token-mean. Shape: (sum k,)."""
    if aggregation == "token-mean":
        return torch.ones(sum(calls_per_episode))
    return torch.tensor([1.0 / k for k in calls_per_episode for _ in range(k)])


def _rollout(rows: Sequence[tuple[list[int], list[int], list[float], bool]], pad: int, group_index: Sequence[int]) -> Rollout:
    """(prompt ids, completion ids, log-probs, truncated) rows as a Rollout: prompts left-padded, completions right-padded."""
    width_p, width_c = max(len(r[0]) for r in rows), max(max(len(r[1]) for r in rows), 1)
    return Rollout(
        torch.tensor([[pad] * (width_p - len(p)) + p for p, _, _, _ in rows]),  # (B, P)
        torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p, _, _, _ in rows]),  # (B, P)
        torch.tensor([c + [pad] * (width_c - len(c)) for _, c, _, _ in rows]),  # (B, C)
        torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c, _, _ in rows]),  # (B, C)
        torch.tensor([lp + [0.0] * (width_c - len(lp)) for _, _, lp, _ in rows], dtype=torch.float32),  # (B, C)
        torch.tensor(list(group_index)),
        torch.tensor([t for _, _, _, t in rows]),
    )


def episode_rows(episodes: Sequence[Episode], pad: int) -> tuple[Rollout, torch.Tensor]:
    """Every call of every episode as one row, episodes in order (an episode group's rows adjacent), and
    each row's episode index; ``group_index`` numbers the distinct prompts (the training forward runs
    each once). Shapes: B = sum_e k_e rows; (B,).

    Raises:
        RuntimeError: when no episode made a call.
    """
    rows, episode_of, prompts = [], [], {}
    for e, episode in enumerate(episodes):
        for call in episode.calls:
            rows.append((call.prompt_ids, call.completion_ids, call.logprobs, call.truncated))
            episode_of.append(e)
            prompts.setdefault(tuple(call.prompt_ids), len(prompts))
    groups = [prompts[tuple(row[0])] for row in rows]  # rows with one prompt (e.g. the G episodes' first calls) share its forward
    if not rows:
        errors = sorted({ep.error for ep in episodes if ep.error})
        raise RuntimeError(f"no episode of the step called the endpoint; the agents' errors: {errors[:3] or 'none (they returned without a call)'}")
    return _rollout(rows, pad, groups), torch.tensor(episode_of)


def _last_calls(episodes: Sequence[Episode], group_size: int, pad: int) -> Rollout:
    """One row per episode, its last call (what the reward terms see as the completion: its ids, its
    truncation); an episode without a call is one pad token of prompt, no completion, truncated."""
    rows = [
        (ep.calls[-1].prompt_ids, ep.calls[-1].completion_ids, ep.calls[-1].logprobs, ep.calls[-1].truncated) if ep.calls else ([pad], [], [], True)
        for ep in episodes
    ]
    return _rollout(rows, pad, [e // group_size for e in range(len(episodes))])


@dataclass
class AgentSource:
    """The rollout source of an ``agent:`` config (module docstring): ``next(state)`` runs the step's
    episodes against ``server`` (started on the first call: a producer process starts its own)."""

    agent: Callable
    cfg: AgentConfig
    scorer: Scorer
    prompts: Sequence[PromptExample]
    n: int
    seed: int
    aggregation: str
    make_server: Callable[[], PolicyServer]
    server: PolicyServer | None = None
    pipelined = False
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def _serve(self) -> PolicyServer:
        if self.server is None:
            self.server = self._stack.enter_context(self.make_server())
            self._pool = self._stack.enter_context(concurrent.futures.ThreadPoolExecutor(self.cfg.max_concurrency, thread_name_prefix="rlalign-agent"))
        return self.server

    async def _episode(self, server: PolicyServer, episode_id: str, record: dict, gate: asyncio.Semaphore) -> Episode:
        async with gate:
            server.open_episode(episode_id)
            t0 = time.perf_counter()
            result, error = None, None
            try:
                if is_async_reward(self.agent):
                    call = self.agent(server.url(episode_id), record)
                else:
                    call = asyncio.get_running_loop().run_in_executor(self._pool, self.agent, server.url(episode_id), record)
                result = await asyncio.wait_for(call, self.cfg.timeout_s)
            except asyncio.TimeoutError:
                error = f"timed out after {self.cfg.timeout_s} s"
            except Exception as err:  # the agent's own failure (or the endpoint's 400 past max_calls, raised by its client)
                error = f"{type(err).__name__}: {str(err)[:300]}"
            calls = server.close_episode(episode_id)
            answer, reward, misuse = "", None, None
            if error is None:
                try:
                    answer, reward = _outcome(result, calls)
                except TypeError as err:
                    misuse = str(err)
            return Episode(calls, answer, reward, error, seconds=time.perf_counter() - t0, misuse=misuse)

    async def _episodes(self, server: PolicyServer, step: int, records: list[dict], G: int, prefix: str = "s", first: int = 0) -> list[Episode]:
        """G episodes of each record; ``first``: the step's index of ``records[0]`` (a rank's share), which names the episodes
        (and so their calls' uniforms)."""
        gate = asyncio.Semaphore(self.cfg.max_concurrency)
        ids = [f"{prefix}{step}-p{first + i}-g{j}" for i in range(len(records)) for j in range(G)]
        episodes = list(await asyncio.gather(*(self._episode(server, ids[e], records[e // G], gate) for e in range(len(ids)))))
        for e, episode in enumerate(episodes):  # once every episode has ended: an error stops the step, not the others' episodes
            if episode.misuse is not None:  # a return no episode can be scored by, as a reward function's wrong return stops the run
                raise RewardFunctionError(f"agent {self.cfg.function}: {episode.misuse} (prompt {records[e // G].get('prompt')!r})")
            episode.reward = checked_reward(episode.reward, f"agent {self.cfg.function}", records[e // G].get("prompt"))
        return episodes

    def next(self, state) -> ScoredBatch:
        t0 = time.perf_counter()
        server, G = self._serve(), self.scorer.group_size
        server.seed = self.seed
        examples = prompt_batch(self.prompts, state.step, self.n, self.seed)
        world = self.scorer.world
        share = world.shard(len(examples), "prompts_per_step")  # this rank's prompts; its endpoint is its own
        records = [{**ex.metadata, "prompt": ex.prompt} for ex in examples[share]]
        batches, abandoned = server.batches, server.abandoned
        episodes = asyncio.run(self._episodes(server, state.step, records, G, first=share.start))
        pad = self.scorer.tokenizer.pad_token_id
        rollout, row_episode = episode_rows(episodes, pad)
        t1 = time.perf_counter()
        failed = {AGENT_FAILED: torch.tensor([ep.error is not None for ep in episodes])}  # left out of training, as an environment's timeouts
        scored = self.scorer(examples, _last_calls(episodes, G, pad), [ep.answer for ep in episodes], state.step, failed=failed)
        if distributed.any_rank(any(ep.reward is not None for ep in episodes), self.scorer.world):  # the agent's own reward: the term "agent"
            scored = add_score_term(scored, "agent", torch.tensor([0.0 if ep.reward is None else ep.reward for ep in episodes]), self.scorer.world,
                                    torch.tensor([ep.reward is not None for ep in episodes]))
        calls = [len(ep.calls) for ep in episodes]
        sums = torch.tensor([sum(calls), sum(ep.error is not None for ep in episodes), sum(ep.seconds for ep in episodes), len(episodes),
                             max(server.batches - batches, 1), server.abandoned - abandoned], dtype=torch.float64)
        n_calls, failed, seconds, n_episodes, n_batches, n_abandoned = distributed.all_sum(sums, world).tolist()  # every rank's episodes
        metrics = {
            "agent/calls": n_calls / n_episodes,
            "agent/calls_max": distributed.all_max(float(max(calls)), world),
            "agent/failed": failed / n_episodes,
            "agent/seconds": seconds / n_episodes,
            "agent/calls_per_batch": n_calls / n_batches,  # requests an endpoint sampled together
            "agent/abandoned_calls": n_abandoned / n_episodes,  # calls whose client left before the reply: not trained
        }
        if world.view:  # a producer's view of a learner's share: the learner weighs the shards' ratio by its batches
            metrics["weight/agent/calls_per_batch"] = n_batches
        return ScoredBatch(
            examples, rollout, scored, rollout.completion_mask.clone(), metrics, state.step, t1 - t0, time.perf_counter() - t1,
            row_episode=row_episode, row_weight=row_weights(calls, self.aggregation),
        )

    def publish(self, policy, version: int) -> float:
        return 0.0  # the endpoint samples from the live policy

    def state_dict(self) -> dict:
        return {}

    def close(self) -> None:
        self._stack.close()
        self.server = None


def policy_generate(updater, tokenizer, sampling, model_cfg):
    """The endpoint's :data:`rlalign.agents.openai_server.Generate`: ``updater``'s policy (or its copy in
    ``sampling.dtype``), in eval mode, under ``model_cfg.autocast``, as :func:`rlalign.train.rollouts.sample_shard` samples."""

    def generate(prompts, params, noise):
        policy, sampler = updater.module, updater.sampler()
        precision = forward_precision(model_cfg, policy) if sampler is policy else contextlib.nullcontext()
        with precision, evaluating(sampler), attention_kernel(sampler, sampling.attn_implementation):
            return sample(sampler, prompts, params, tokenizer.pad_token_id, stop_token_ids(policy, tokenizer), noise=noise, compile=sampling.compile,
                          cuda_graphs=sampling.cuda_graphs).to("cpu")

    return generate


def make_agent_source(
    cfg, sampler, tokenizer, rewards: Sequence[RewardTerm], prompts: Sequence[PromptExample], world: distributed.World = distributed.World(),
) -> AgentSource:
    """The source of a GRPO or PPO config with an ``agent:`` section (``sampler``: the run's Updater).

    Under torchrun each rank (or the producer making a rank's share) runs its share of the episodes
    against an endpoint of its own; the ranks then hold different numbers of rows (calls).

    Raises:
        ConfigError: under torchrun with PPO or FSDP2 (they need equal rows on every rank), or when the agent cannot be imported.
    """
    if world.size > 1:
        unequal = [name for name, on in (("PPO", getattr(cfg, "critic", None) is not None), ("model.sharding: fsdp", cfg.model.sharding == "fsdp")) if on]
        if unequal:
            raise ConfigError(f"agent under torchrun: each rank trains its own number of calls, which {', '.join(unequal)} cannot take "
                              "(they need equal rows on every rank); run GRPO with DDP, or one process")
    agent_cfg: AgentConfig = cfg.agent
    model_config = getattr(sampler.module, "config", None)
    context = getattr(model_config, "max_position_embeddings", None)

    def make_server() -> PolicyServer:
        s = cfg.sampling
        return PolicyServer(
            tokenizer, policy_generate(sampler, tokenizer, s, cfg.model), s.max_new_tokens, s.temperature, s.top_p, s.top_k,
            max_calls=agent_cfg.max_calls, max_context=context, batch_wait_s=agent_cfg.batch_wait_ms / 1000, seed=cfg.seed,
            serve_without_effect=tuple(agent_cfg.serve_without_effect),
        )

    return AgentSource(
        load_agent(agent_cfg.function), agent_cfg, make_scorer(cfg, tokenizer, rewards, world), prompts, cfg.prompts_per_step, cfg.seed, cfg.aggregation, make_server,
    )


def agent_evaluator(cfg, policy, tokenizer, prompts: Sequence[PromptExample], rewards: Sequence[RewardTerm]) -> Callable[[int], tuple[dict, list]]:
    """``evaluate(step)`` of a run with an ``agent:`` section: the agent's episodes, ``eval.num_samples``
    per held-out prompt, against ``policy`` (unwrapped, in eval mode) served on an endpoint of its own
    whose requests that leave ``temperature`` out get ``eval.temperature`` (0: greedy) and ``max_tokens``
    up to ``eval.max_new_tokens``; the uniforms come from (seed, "eval" step, episode, call), never
    from training's. An episode passes when its total reward (the terms on its answer, plus the
    agent's own) reaches ``eval.pass_threshold``. Metrics: ``eval/success``, ``eval/pass@k`` (k = 1,
    2, 4, ... <= num_samples, unbiased), ``eval/reward/mean``, ``eval/calls``, ``eval/failed``; a table
    of the first episodes (the last call's prompt and reply as the model saw them: the conversation
    the agent built; its calls, answer, reward and error)."""
    eval_cfg, agent_cfg, G = cfg.eval, cfg.agent, cfg.eval.num_samples
    agent = load_agent(agent_cfg.function)
    context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)

    def generate(batch, params, noise):
        with forward_precision(cfg.model, policy), evaluating(policy), attention_kernel(policy, cfg.sampling.attn_implementation):
            return sample(policy, batch, params, tokenizer.pad_token_id, stop_token_ids(policy, tokenizer), noise=noise).to("cpu")

    def make_server() -> PolicyServer:
        return PolicyServer(tokenizer, generate, eval_cfg.max_new_tokens or cfg.sampling.max_new_tokens, eval_cfg.temperature, 1.0, 0,
                            max_calls=agent_cfg.max_calls, max_context=context, batch_wait_s=agent_cfg.batch_wait_ms / 1000, seed=cfg.seed,
                            sampling_from_requests=True, serve_without_effect=tuple(agent_cfg.serve_without_effect))  # not trained: a request's own temperature is served

    def evaluate(step: int) -> tuple[dict, list]:
        runner = AgentSource(agent, agent_cfg, None, prompts, len(prompts), cfg.seed, cfg.aggregation, make_server)
        try:
            records = [{**ex.metadata, "prompt": ex.prompt} for ex in prompts]
            episodes = asyncio.run(runner._episodes(runner._serve(), step, records, G, prefix="eval"))
        finally:
            runner.close()
        last = _last_calls(episodes, G, tokenizer.pad_token_id)
        scored = score_shard(rewards, tokenizer, list(prompts), last, [ep.answer for ep in episodes], G, distributed.World(), step=step + 1,
                             max_steps=cfg.steps)
        total = scored.scores + torch.tensor([0.0 if ep.reward is None else ep.reward for ep in episodes])  # (prompts x G,)
        passed = (total >= eval_cfg.pass_threshold).view(-1, G)  # (prompts, G)
        metrics = {
            "eval/success": passed.float().mean().item(), "eval/reward/mean": total.mean().item(),
            "eval/calls": sum(len(ep.calls) for ep in episodes) / len(episodes), "eval/failed": sum(ep.error is not None for ep in episodes) / len(episodes),
        }
        metrics.update(pass_at_ks(passed))
        table = [
            {"step": step, "episode": tokenizer.decode(ep.calls[-1].prompt_ids + ep.calls[-1].completion_ids) if ep.calls else "", "calls": len(ep.calls),
             "final": ep.answer, "reward": float(total[e]), "error": ep.error or ""}
            for e, ep in enumerate(episodes[: eval_cfg.num_samples_logged])
        ]
        return metrics, table

    return evaluate
