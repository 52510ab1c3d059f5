"""Evaluation during GRPO and PPO: the policy's completions of held-out prompts, scored by every
reward term of the run.

    prompts = load_eval_prompts(cfg.eval, cfg.data)               # the task's eval split, or eval.data; [] = none
    metrics, rows = evaluate_policy(policy, tokenizer, prompts, rewards, cfg.eval, cfg.sampling.max_new_tokens, cfg.model, seed, world)

Each evaluation draws ``eval.num_samples`` completions per prompt (greedy when ``eval.temperature``
is 0) from the policy in eval mode, with uniforms from a generator of its own seeded by the run's
seed: it consumes nothing of the training's random state (a resumed run stays the uninterrupted
one), the same policy gives the same evaluation, and the rows do not depend on the number of
processes. Metrics (:func:`rlalign.train.loop.run_steps` logs them with the step):

    eval/reward/mean|std, eval/reward/<term>/mean|std   total and per-term (unweighted) rewards
    eval/pass@k           k = 1, 2, 4, ... <= num_samples (num_samples > 1): unbiased pass@k, a
                          completion passing when its total reward >= eval.pass_threshold
    eval/completion_len/mean|max, eval/completion_len/clipped_frac   lengths; share without EOS

and a table of the first ``eval.num_samples_logged`` rows: prompt, completion, total and per-term rewards.
A run with ``tools`` is evaluated on whole episodes (:func:`tool_evaluator`); runs with an environment
or an agent by ``rlalign.train.env_source.episode_evaluator`` and ``rlalign.agents.agent_source.agent_evaluator``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from rlalign.core.evaluation import pass_at_k
from rlalign.lm.reward_calls import check_finite
from rlalign.lm.data import PromptExample, load_prompts
from rlalign.lm.encoding import encode_prompts
from rlalign.lm.model_modes import attention_kernel, evaluating
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.lm.tools import ToolEnvironment, format_for
from rlalign.lm.models import stop_token_ids
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.common import forward_precision
from rlalign.train.rl_config import DataConfig, EvalConfig
from rlalign.train.rollouts import RewardTerm, logged_means, reward_stats, sample_rows, score_shard
from rlalign.train.run_config import ModelConfig
from rlalign.train.tool_rollout import tool_registry, tool_rollout

__all__ = ["load_eval_prompts", "evaluate_policy", "eval_batches", "pass_at_ks", "tool_evaluator"]


def load_eval_prompts(cfg: EvalConfig, train_data: DataConfig) -> list[PromptExample]:
    """The held-out prompts: ``cfg.data`` (a task's eval split, or a file's ``split``), else the training
    task's eval split; the first ``cfg.num_prompts``. Empty when evaluation is off or the training
    prompts come from a file and ``cfg.data`` is unset."""
    data = cfg.data or (train_data if train_data.task is not None else None)
    if not cfg.enabled or data is None:
        return []
    if data.task is not None:
        return load_prompts(TASKS[data.task].prompt_records("eval", cfg.num_prompts, data.seed))
    return load_prompts(data.path, data.split, data.subset, data.columns)[: cfg.num_prompts]


@torch.no_grad()
def evaluate_policy(
    policy: nn.Module, tokenizer, prompts: Sequence[PromptExample], rewards: Sequence[RewardTerm], cfg: EvalConfig, max_new_tokens: int,
    model_cfg: ModelConfig, seed: int, world: distributed.World = distributed.World(), step: int = 0, max_steps: int = 0,
) -> tuple[dict[str, float], list[dict]]:
    """The ``eval/*`` metrics of ``policy`` (unwrapped) on ``prompts`` and the samples table (this rank's
    first rows; rank 0's are the table). Collective under torchrun: every rank calls it and gets the same metrics.

    Args:
        max_new_tokens: the training's, used when ``cfg.max_new_tokens`` is unset.
        step: the step the evaluation follows (-1: before the first), in the table and (at least 0) to rewards taking ``trainer_state``.
        max_steps: the run's steps, the rewards' ``trainer_state.max_steps``.
    """
    n = cfg.num_samples
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens or max_new_tokens, temperature=cfg.temperature)
    if not prompts:
        return {}, []
    if len(prompts) < world.size:
        raise ValueError(f"evaluation has {len(prompts)} prompts, fewer than the {world.size} processes: give eval.num_prompts at least {world.size}")
    # every row's uniforms drawn up front, by its place among all rows: a row's draws depend on neither the world size nor batch_size
    noise = torch.rand((params.max_new_tokens, len(prompts) * n), generator=torch.Generator().manual_seed(seed))  # (N, prompts x n)
    scores, per_term, failed, counters, lengths, truncated, rows, logged = [], {}, {}, {}, [], [], [], {}
    for start, stop in eval_batches(len(prompts), cfg.batch_size, world.size):
        batch = list(prompts[start:stop])
        shard = world.split(len(batch))  # every prompt evaluated: ranks may differ by one
        ids = encode_prompts(tokenizer, [ex.prompt for ex in batch[shard]])
        columns = slice((start + shard.start) * n, (start + shard.stop) * n)
        with distributed.gathered(policy), forward_precision(model_cfg, policy), evaluating(policy):
            rollout = sample(policy, ids, params, tokenizer.pad_token_id, stop_token_ids(policy, tokenizer), n, noise=noise[:, columns])
        rollout = rollout.to("cpu")
        scored = score_shard(rewards, tokenizer, batch, rollout, rollout.decode_completions(tokenizer), n, world, step=step + 1, uneven=True,
                             max_steps=max_steps)
        scores.append(scored.scores)
        for name, values in scored.per_term.items():
            per_term.setdefault(name, []).append(values)
        for name, values in scored.failed.items():
            failed.setdefault(name, []).append(values)
        for key, value in scored.term_stats.items():
            counters[key] = counters.get(key, 0.0) + value
        for name, values in scored.logged.items():
            logged.setdefault(name, []).extend(values)
        lengths.append(distributed.gather_rows(rollout.completion_lengths().float(), world, uneven=True))  # (B global,)
        truncated.append(distributed.gather_rows(rollout.truncated.float(), world, uneven=True))  # (B global,)
        if len(rows) < cfg.num_samples_logged:  # the batch's first rows: every rank's share, in order (the same on every rank)
            need = cfg.num_samples_logged - len(rows)
            rows.extend(distributed.gather_objects(sample_rows(step, scored, need), world)[:need])
    if not scores:
        return {}, []
    total = torch.cat(scores)  # (prompts x n,) prompt-major, groups adjacent
    stats = reward_stats(total, {k: torch.cat(v) for k, v in per_term.items()}, {k: torch.cat(v) for k, v in failed.items()}) | counters | logged_means(logged)
    metrics = {f"eval/{key}": value for key, value in stats.items()}
    all_lengths = torch.cat(lengths)  # (prompts x n,)
    metrics["eval/completion_len/mean"] = all_lengths.mean().item()
    metrics["eval/completion_len/max"] = all_lengths.max().item()
    metrics["eval/completion_len/clipped_frac"] = torch.cat(truncated).mean().item()
    if n > 1:
        metrics.update(pass_at_ks((total >= cfg.pass_threshold).view(-1, n)))
    return metrics, rows


def eval_batches(prompts: int, batch_size: int, world_size: int) -> list[tuple[int, int]]:
    """(start, stop) of the evaluation's global batches: as few as hold ``batch_size`` prompts a rank, of sizes that
    differ by at most one, and at least one prompt a rank in each (then, with ``batch_size`` 1, a rank may take 2).
    E.g. 9 prompts, batch_size 4, 2 ranks: batches of 4 and 5 (2 and 2, then 3 and 2 a rank); 20, 4, 2: 6, 7 and 7."""
    count = max(1, min(-(-prompts // (batch_size * world_size)), prompts // world_size))
    bounds = [k * prompts // count for k in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def pass_at_ks(passed: torch.Tensor) -> dict[str, float]:
    """``eval/pass@k`` for k = 1, 2, 4, ... up to n, unbiased (:func:`rlalign.core.evaluation.pass_at_k`),
    of ``passed``: whether each of a prompt's n completions or episodes passed. Shape: (prompts, n)."""
    metrics, k = {}, 1
    while k <= passed.shape[1]:
        metrics[f"eval/pass@{k}"] = float(pass_at_k(passed, k))
        k *= 2
    return metrics


def tool_evaluator(cfg, policy: nn.Module, tokenizer, prompts: Sequence[PromptExample], rewards: Sequence[RewardTerm], tools: Mapping[str, Callable] | None = None):
    """``evaluate(step)`` of a run with a ``tools:`` section: :func:`tool_rollout` episodes of every
    held-out prompt (``eval.num_samples`` each) by ``policy`` (unwrapped, in eval mode) at
    ``eval.temperature`` (0: greedy), ``eval.max_new_tokens`` per turn, uniforms from a generator of
    their own seeded by the run's seed. The reward terms score each episode's last assistant turn and
    the environment's reward is added, as in training; an episode passes when that total reaches
    ``eval.pass_threshold``. Metrics: ``eval/success``, ``eval/pass@k`` (k = 1, 2, 4, ... <= num_samples,
    unbiased), ``eval/reward/mean``, ``eval/turns``, ``eval/tool_messages``; a table of the first
    episodes (the prompt, the whole completion with the tool results, the final turn, the reward)."""
    eval_cfg, tools_cfg, n = cfg.eval, cfg.tools, cfg.eval.num_samples
    registry, fmt = tool_registry(tools_cfg, tools), format_for(tools_cfg.format, tokenizer)
    params = SamplingParams(eval_cfg.max_new_tokens or cfg.sampling.max_new_tokens, eval_cfg.temperature)

    def evaluate(step: int) -> tuple[dict[str, float], list[dict]]:
        generator = torch.Generator().manual_seed(cfg.seed)
        totals, turns, messages, table = [], [], [], []
        for start in range(0, len(prompts), eval_cfg.batch_size):
            batch = list(prompts[start : start + eval_cfg.batch_size])
            records = [{**ex.metadata, "prompt": ex.prompt} for ex in batch]
            with forward_precision(cfg.model, policy), evaluating(policy), attention_kernel(policy, cfg.sampling.attn_implementation):
                out = tool_rollout(policy, tokenizer, records, lambda: ToolEnvironment(registry, fmt, tools_cfg.max_turns, tools_cfg.max_result_chars),
                                   fmt, params, n, tools_cfg.max_turns, generator)
            scored = score_shard(rewards, tokenizer, batch, out.rollout, out.final_texts, n, distributed.World(), step=step + 1, max_steps=cfg.steps)
            env = torch.tensor([0.0 if r is None else r for r in out.env_rewards], dtype=torch.float32)  # (B,)
            check_finite(env, "the environment's reward is", scored.prompts, "not a finite number in float32")
            total = scored.scores + env  # (B,)
            totals.append(total)
            turns.append(out.turns.float())
            messages.append(out.tool_messages.float())
            completions = out.rollout.decode_completions(tokenizer)
            for r in range(min(eval_cfg.num_samples_logged - len(table), len(total))):
                table.append({"step": step, "prompt": str(batch[r // n].prompt), "completion": completions[r], "final": out.final_texts[r], "reward": float(total[r])})
        total = torch.cat(totals)  # (prompts x n,) groups adjacent
        passed = (total >= eval_cfg.pass_threshold).view(-1, n)  # (prompts, n)
        return {
            "eval/success": passed.float().mean().item(), "eval/reward/mean": total.mean().item(), **pass_at_ks(passed),
            "eval/turns": torch.cat(turns).mean().item(), "eval/tool_messages": torch.cat(messages).mean().item(),
        }, table

    return evaluate
