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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rlalign.core.evaluation import pass_at_k
from rlalign.lm.data import PromptExample, load_prompts
from rlalign.lm.encoding import encode_prompts
from rlalign.lm.model_modes import evaluating
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.common import forward_precision
from rlalign.train.rl_config import DataConfig, EvalConfig
from rlalign.train.rollouts import RewardTerm, reward_stats, sample_rows, score_shard
from rlalign.train.run_config import ModelConfig

__all__ = ["load_eval_prompts", "evaluate_policy"]


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
    model_cfg: ModelConfig, seed: int, world: distributed.World = distributed.World(), step: int = 0,
) -> tuple[dict[str, float], list[dict]]:
    """The ``eval/*`` metrics of ``policy`` (unwrapped) on ``prompts`` and the samples table (this rank's
    first rows; rank 0's are the table). Collective under torchrun: every rank calls it and gets the same metrics.

    Args:
        max_new_tokens: the training's, used when ``cfg.max_new_tokens`` is unset.
        step: the step the evaluation follows (-1: before the first), in the table and (at least 0) to rewards taking ``trainer_state``.
    """
    n = cfg.num_samples
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens or max_new_tokens, temperature=cfg.temperature)
    usable = len(prompts) - len(prompts) % world.size  # every rank an equal share
    generator = torch.Generator().manual_seed(seed)
    scores, per_term, failed, counters, lengths, truncated, rows = [], {}, {}, {}, [], [], []
    for start in range(0, usable, cfg.batch_size * world.size):
        batch = list(prompts[start : start + cfg.batch_size * world.size])
        shard = world.shard(len(batch))
        noise = torch.rand((params.max_new_tokens, len(batch) * n), generator=generator)  # (N, B global): the same draws on any world size
        ids = encode_prompts(tokenizer, [ex.prompt for ex in batch[shard]])
        with distributed.gathered(policy), forward_precision(model_cfg, policy), evaluating(policy):
            rollout = sample(policy, ids, params, tokenizer.pad_token_id, [tokenizer.eos_token_id], n, noise=noise[:, shard.start * n : shard.stop * n])
        rollout = rollout.to("cpu")
        scored = score_shard(rewards, tokenizer, batch, rollout, rollout.decode_completions(tokenizer), n, world, step=max(step, 0))
        scores.append(scored.scores)
        for name, values in scored.per_term.items():
            per_term.setdefault(name, []).append(values)
        for name, values in scored.failed.items():
            failed.setdefault(name, []).append(values)
        for key, value in scored.term_stats.items():
            counters[key] = counters.get(key, 0.0) + value
        lengths.append(distributed.gather_rows(rollout.completion_lengths().float(), world))  # (B global,)
        truncated.append(distributed.gather_rows(rollout.truncated.float(), world))  # (B global,)
        if len(rows) < cfg.num_samples_logged:
            rows.extend(sample_rows(step, scored, cfg.num_samples_logged - len(rows)))
    if not scores:
        return {}, []
    total = torch.cat(scores)  # (prompts x n,) prompt-major, groups adjacent
    stats = reward_stats(total, {k: torch.cat(v) for k, v in per_term.items()}, {k: torch.cat(v) for k, v in failed.items()}) | counters
    metrics = {f"eval/{key}": value for key, value in stats.items()}
    all_lengths = torch.cat(lengths)  # (prompts x n,)
    metrics["eval/completion_len/mean"] = all_lengths.mean().item()
    metrics["eval/completion_len/max"] = all_lengths.max().item()
    metrics["eval/completion_len/clipped_frac"] = torch.cat(truncated).mean().item()
    if n > 1:
        passed = (total >= cfg.pass_threshold).view(-1, n)  # (prompts, n)
        k = 1
        while k <= n:
            metrics[f"eval/pass@{k}"] = float(pass_at_k(passed, k))
            k *= 2
    return metrics, rows
