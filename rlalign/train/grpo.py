"""GRPO on a causal LM: G completions per prompt, group-relative advantages, no critic.

    J(theta) = E_q 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
                                              - beta * k3(pi_theta, pi_ref)_it ]
    r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),     A_i = (R_i - mean(R_group)) / std(R_group)

Shao et al. 2024 (DeepSeekMath), eq. 3-4; seeds 003 (section 8) and 004. The maths lives in
:mod:`rlalign.core`; this file composes it. One step, top to bottom (:func:`grpo_step`):

    prompts --sample G each (policy, KV cache, no grad)--> Rollout (+ sampling log-probs = log pi_old)
    Rollout --weighted reward functions / reward models--> scores (B,)
    scores  --group z-score | batch std | mean only (Dr.GRPO) | RLOO--> A (B,), broadcast to tokens
    ref_logp = frozen reference, or the LoRA base with adapters off; none when beta = 0
    mu passes x minibatches: logp = policy(prompt + completion) at completion positions only
        (each group's prompt run once, its KV cache shared by the group's G rows);
        loss = aggregate(clipped surrogate) + beta * aggregate(k3); backward, clip, step

Deliberate simplifications, stated:
- pi_old is the sampling policy for all mu passes. With one update per rollout (mu = 1, one
  minibatch: the default) it is the very policy being updated, so log pi_old = logp.detach() from
  the update's own forward (r = 1 exactly) and no pass is made for it; ``logprob_mismatch`` logs
  the largest |sampler log-prob - training log-prob|. With several updates the old log-probs are
  the sampler's (``Rollout.logprobs``, same temperature): on CPU float32 they match the training
  pass to ~5e-7 (``ratio_dev/first`` logs the largest |r - 1| of the first minibatch, before any
  update); with ``model.autocast: bfloat16`` or ``sampling.dtype: bfloat16`` the sampler's bfloat16
  numerics differ by more than that (0.2-0.5 nats/token measured on SmolLM2-135M), so pi_old is recomputed by the training
  forward, minibatch by minibatch (one extra forward pass, no grad), and the first ratio is 1 again.
- advantages are computed once per rollout over the whole batch, so a minibatch need not hold
  whole groups: minibatch k of M takes rows k, k + M, k + 2M, ... (interleaved, so every rank
  under torchrun holds an equal share of every minibatch; see rlalign.train.distributed).
- one optimiser step per minibatch, learning-rate schedule per optimiser step.

Metrics (one metrics.jsonl line per step; minibatch statistics are means over the step's updates):
    reward/mean, reward/std, reward/<term>/mean|std   total and per-term (unweighted) rewards
    kl                    mean per-token k3 to the reference (absent when beta = 0)
    clip_frac, clip_frac/low, clip_frac/high, approx_kl, ratio_mean   clipped-surrogate diagnostics
    logprob_mismatch      max |sampler log-prob - training log-prob| (one update per rollout, or model.autocast)
    ratio_dev, ratio_dev/first   max |r - 1|: over each update / on the first minibatch only (~0)
    entropy               mean per-token entropy of softmax(logits / temperature)
    completion_len/mean|max, completion_len/clipped_frac   lengths; share without EOS
    frac_zero_std_groups  share of groups whose rewards all tie (they carry no gradient)
    adv/std, loss/policy, grad_norm, lr
    time/generate, time/score, time/train (= time/reference + time/old_logp + time/update), tokens_per_s

Python use (see also the README):

    from rlalign.config import ConfigError, load_config
    from rlalign.train import grpo
    cfg = load_config(grpo.GRPOConfig, "configs/grpo_arithmetic.yaml", ["steps=20"])
    result = grpo.train(cfg)                     # result.history: one metrics dict per step

The runtime GRPO shares with PPO (config pieces, rollouts, forward passes, updater, run loop) lives
in :mod:`rlalign.train.rl_config`, :mod:`~rlalign.train.rollouts`, :mod:`~rlalign.train.passes`,
:mod:`~rlalign.train.updater` and :mod:`~rlalign.train.loop`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
import torch
from torch import Tensor, nn

from rlalign.config import ConfigError, load_config
from rlalign.core.advantages import group_advantages, overlong_penalty, rloo_advantages
from rlalign.core.kl import kl_k1, kl_k2, kl_k3
from rlalign.core.losses import clipped_surrogate_loss, entropy_loss, kl_penalty_loss, truncated_is_weights
from rlalign.lm.data import PromptExample
from rlalign.lm.rollout import Rollout
from rlalign.lm.tools import ToolRegistry
from rlalign.train import distributed
from rlalign.train.common import forward_precision
from rlalign.train.loop import RLResult, SavedModels, TrainState, UpdateMeans, add_run_arguments, resume_state, run_steps, start_rl_run, step_timings
from rlalign.train.passes import completion_logits, logprobs_and_entropy, logprob_mismatch, loss_mask, micro_batches, ratio_deviation, reference_logprobs, training_logprobs
from rlalign.train.rl_config import DataConfig, RLConfig
from rlalign.train.rollouts import (
    RewardTerm, ScoredRollout, add_score_term, completion_stats, concat_scored, prompt_batch, scored_stats, sample_rows, sample_shard, score_shard, select_rows,
)
from rlalign.train.seeding import batch_order
from rlalign.train.tool_rollout import ToolRollout, ToolsConfig, sample_tool_shard, tool_registry
from rlalign.train.updater import Updater, minibatch_step

__all__ = ["GRPOConfig", "ADVANTAGE_ESTIMATORS", "grpo_loss", "grpo_step", "train", "add_arguments", "run"]


class GRPOConfig(RLConfig):
    """``rlalign grpo``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/grpo", description="run directory: metrics.jsonl, samples.jsonl, checkpoints/, final/, curves.png")
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="arithmetic"), description="training prompts")
    prompts_per_step: int = Field(8, ge=1, description="prompts per rollout; the rollout has prompts_per_step * group_size completions")
    group_size: int = Field(8, ge=2, description="G completions per prompt; at least 2, a group's mean and std need two samples")
    mu: int = Field(1, ge=1, description="policy passes over each rollout (GRPO's mu); pi_old is the sampling policy for all of them")
    num_minibatches: int = Field(1, ge=1, description="optimiser steps per pass; the rollout is cut into this many row slices")
    advantage: Literal["group", "batch", "none", "rloo"] = Field(
        "group", description="group: (R - mean_g) / std_g (DeepSeekMath); batch: / std of the batch; none: R - mean_g (Dr.GRPO); rloo: leave-one-out"
    )
    eps_low: float = Field(0.2, gt=0, lt=1, description="clip the ratio below at 1 - eps_low")
    eps_high: float = Field(0.2, gt=0, description="clip the ratio above at 1 + eps_high (DAPO's clip-higher: 0.28)")
    beta: float = Field(0.04, ge=0, description="coefficient of the KL to the reference (in the loss, or in the reward); 0 loads no reference")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="per-token KL estimator: k1 = log pi - log pi_ref, k2 = x^2 / 2, k3 = e^x - x - 1 (x = log pi_ref - log pi)")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="loss: beta * aggregate(KL) in the loss (GRPO); reward: each completion's reward minus beta * its summed KL at pi_old, before the advantages"
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token (GRPO); sequence: one per completion, exp of its mean token log-ratio, clipped as a whole (GSPO)"
    )
    dual_clip: float | None = Field(None, gt=1, description="cap the loss of negative-advantage tokens at -c * A (dual clip, c > 1); null = off")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus: the loss gains -entropy_coef * aggregate(entropy)")
    tis_cap: float | None = Field(
        None, gt=0, description="truncated importance sampling: weight each token's loss by min(pi_old / pi_sampler, tis_cap) for the sampler/trainer "
        "mismatch (bfloat16 sampling; e.g. 2.0); null = off"
    )
    overlong_buffer: int | None = Field(
        None, ge=1, description="DAPO soft overlong punishment: a reward from 0 down to -overlong_penalty over the last this many tokens of max_new_tokens; null = off"
    )
    overlong_penalty: float = Field(1.0, ge=0, description="the overlong punishment's largest penalty (at max_new_tokens)")
    mask_truncated: bool = Field(False, description="leave completions that hit max_new_tokens without EOS out of the loss (DAPO overlong filtering)")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards all tie and draw more prompts until the step holds prompts_per_step "
        "informative groups (one process only)"
    )
    max_sampling_rounds: int = Field(4, ge=1, description="dynamic sampling: at most this many draws of prompts_per_step prompts per step; then tied groups fill the step")
    tools: ToolsConfig | None = Field(
        None, description="multi-turn tool use (rlalign.train.tool_rollout): tool results appended between turns and left out of the loss; "
        "rewards score the last turn; one process only; null = single-turn"
    )

    @model_validator(mode="after")
    def _minibatches_divide(self) -> GRPOConfig:
        batch = self.prompts_per_step * self.group_size
        if batch % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide prompts_per_step * group_size = {batch}")
        if self.overlong_buffer is not None and self.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} exceeds sampling.max_new_tokens={self.sampling.max_new_tokens}")
        if self.tools is not None and (self.dynamic_sampling or self.overlong_buffer is not None):
            raise ValueError("tools: dynamic_sampling and overlong_buffer are not supported with multi-turn rollouts")
        return self


# ----------------------------------------------------------------------------------------------
# The GRPO loss and step
# ----------------------------------------------------------------------------------------------

KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "group": partial(group_advantages, scale="group"),
    "batch": partial(group_advantages, scale="batch"),
    "none": partial(group_advantages, scale="none"),
    "rloo": rloo_advantages,
}


def grpo_loss(
    policy: nn.Module, rollout: Rollout, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None, cfg: GRPOConfig, on_policy: bool = False,
    sampler_logp: Tensor | None = None, sampled_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = aggregate(clipped surrogate) + beta * aggregate(KL(logp, ref_logp)) - entropy_coef * aggregate(H) on one minibatch.

    Args:
        rollout: the minibatch; ``rollout.logprobs`` is log pi_old, or the sampler's log-probs when
            ``on_policy``. Shapes: (B, C).
        advantages: one per completion, broadcast over its tokens. Shape: (B,).
        mask: 1 on tokens that count. Shape: (B, C).
        ref_logp: reference log-probs, or None without a KL term in the loss. Shape: (B, C).
        on_policy: this is the only update of the rollout, so pi_old is the policy being updated:
            log pi_old = logp.detach() (r = 1 exactly, as TRL does with num_iterations = 1), and
            ``logprob_mismatch`` reports how far the sampler's log-probs were from it.
        sampler_logp: the sampler's log-probs when ``rollout.logprobs`` holds a recomputed pi_old
            (for truncated importance sampling); None: they are ``rollout.logprobs``. Shape: (B, C).
        sampled_mask: 1 on the tokens the sampler drew, for ``logprob_mismatch`` (multi-turn rollouts:
            not the tool tokens, whose sampler log-probs are 0); None: ``rollout.completion_mask``. Shape: (B, C).
    Returns:
        (loss, stats): detached loss/policy, clip fractions, approx_kl, ratio stats, kl, entropy, tis/*.
    """
    with forward_precision(cfg.model, policy):
        logits = completion_logits(policy, rollout, cfg.compile)  # (B, C, V), bfloat16 under autocast
    device = logits.device
    completion_ids = rollout.completion_ids.to(device)
    logp, entropy = logprobs_and_entropy(logits, completion_ids, cfg.sampling.temperature, cfg.entropy_coef > 0)  # (B, C) each, float32
    mask = mask.to(device)
    old_logp = logp.detach() if on_policy else rollout.logprobs.to(device)  # (B, C)
    sampler = (rollout.logprobs if sampler_logp is None or on_policy else sampler_logp).to(device)  # (B, C)
    stats = {}
    weights = None
    if cfg.tis_cap is not None:  # min(pi_old / pi_sampler, C) per token
        weights, tis = truncated_is_weights(old_logp, sampler, cfg.tis_cap, mask)
        stats.update({"tis/weight_mean": tis.weight_mean, "tis/weight_min": tis.weight_min, "tis/truncated_frac": tis.truncated_frac})
    max_len = cfg.sampling.max_new_tokens  # the fixed L of seq-mean-token-sum-norm (Dr.GRPO), not this batch's C
    pg_loss, clip = clipped_surrogate_loss(
        logp, old_logp, advantages.to(device), mask, cfg.eps_low, cfg.eps_high, cfg.dual_clip, cfg.aggregation, max_len, cfg.importance_sampling, weights
    )
    loss = pg_loss
    stats.update({
        "loss/policy": pg_loss.detach(),
        "clip_frac": clip.clip_frac,
        "clip_frac/low": clip.clip_frac_low,
        "clip_frac/high": clip.clip_frac_high,
        "approx_kl": clip.approx_kl,
        "ratio_mean": clip.ratio_mean,
        "ratio_dev": ratio_deviation(logp, old_logp, mask),
    })
    if cfg.dual_clip is not None:
        stats["clip_frac/dual"] = clip.dual_clip_frac
    if on_policy:
        sampled = rollout.completion_mask if sampled_mask is None else sampled_mask
        stats["logprob_mismatch"] = logprob_mismatch(logp, sampler, sampled.to(device))  # every sampled token, as the recompute path
    if ref_logp is not None:
        kl_loss, kl = kl_penalty_loss(logp, ref_logp.to(device), mask, cfg.kl_estimator, mode=cfg.aggregation, max_len=max_len)
        loss = loss + cfg.beta * kl_loss
        stats["kl"] = kl.kl
    ent_loss, ent = entropy_loss(entropy, mask, mode=cfg.aggregation, max_len=max_len)
    if cfg.entropy_coef > 0:
        loss = loss + cfg.entropy_coef * ent_loss
    stats["entropy"] = ent.entropy
    return loss, stats


def grpo_step(
    updater: Updater, reference: nn.Module | None, tokenizer, rewards: Sequence[RewardTerm], prompts: Sequence[PromptExample], state: TrainState, cfg: GRPOConfig,
    tools: ToolRegistry | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """One GRPO step (0-based ``state.step``): sample, score, advantages, mu x minibatch updates.

    With ``cfg.tools`` the rollout is multi-turn (:func:`rlalign.train.tool_rollout.tool_rollout`, with
    ``tools``, or the registry of ``cfg.tools``): the reward terms score each row's last assistant turn,
    and the loss mask is also 0 on tool tokens (``ToolRollout.assistant_mask``).

    Returns:
        (metrics, a few samples with their rewards).
    """
    world, G = state.world, cfg.group_size  # one process, or this rank under torchrun: B below is this rank's share of the rows
    # 1-2. sample G completions per prompt (no grad, KV cache; the sampling log-probs are log pi_old) and score them:
    #      the weighted reward terms (+ DAPO's overlong punishment), gathered from every rank. Dynamic sampling
    #      draws again until the step holds prompts_per_step groups whose rewards do not all tie.
    t0 = time.perf_counter()
    assistant_mask = None  # (B, C) with tools: 0 on tool tokens
    if cfg.tools is not None:
        examples = prompt_batch(prompts, state.step, cfg.prompts_per_step, cfg.seed)
        registry = tools if tools is not None else tool_registry(cfg.tools)
        records = [{**ex.metadata, "prompt": ex.prompt} for ex in examples]
        episodes = sample_tool_shard(updater, tokenizer, records, cfg.sampling, cfg.model, G, state, cfg.tools, registry)
        rollout, assistant_mask = episodes.rollout, episodes.assistant_mask
        t1 = time.perf_counter()
        scored, sampling_metrics = score_groups(rewards, tokenizer, examples, rollout, state, cfg, episodes), tool_metrics(episodes)
    elif cfg.dynamic_sampling:
        examples, rollout, scored, sampling_metrics, sampling_seconds = informative_rollout(updater, tokenizer, rewards, prompts, state, cfg)
        t1 = t0 + sampling_seconds  # time/generate: the draws' sampling; time/score: their scoring
    else:
        examples = prompt_batch(prompts, state.step, cfg.prompts_per_step, cfg.seed)  # the global batch, with each record's columns
        rollout = sample_shard(updater, tokenizer, [ex.prompt for ex in examples], cfg.sampling, cfg.model, G, state)
        t1 = time.perf_counter()
        scored, sampling_metrics = score_groups(rewards, tokenizer, examples, rollout, state, cfg), {}
    batch = [ex.prompt for ex in examples]
    t2 = time.perf_counter()

    # 3. reference log-probs, pi_old (recomputed when the sampler's numerics differ), optional KL in the reward
    mask = loss_mask(rollout, cfg.mask_truncated)  # (B, C)
    sampled_mask = rollout.completion_mask if assistant_mask is None else rollout.completion_mask * assistant_mask  # (B, C) tokens the sampler drew
    if assistant_mask is not None:
        mask = mask * assistant_mask  # tool tokens get no gradient
    m = cfg.num_minibatches
    minibatches = [slice(k, None, m) for k in range(m)]  # rows k, k + m, ...: an equal share of every rank's rows in each
    temperature, autocast = cfg.sampling.temperature, cfg.model.autocast
    ref_logp = reference_logprobs(updater.module, reference, rollout, temperature, cfg.micro_batch_size or rollout.batch_size // m, autocast, cfg.compile) if cfg.beta > 0 else None
    t_ref = time.perf_counter()
    on_policy = cfg.mu * m == 1  # one update: pi_old is the policy being updated, no pass needed for it
    mismatch, sampler_logp = None, rollout.logprobs  # (B, C) the sampler's log-probs
    if cfg.recompute_old_logprobs and not on_policy:  # bfloat16 sampling numerics are not the training forward's
        update_rows = [rows for mb in minibatches for rows in micro_batches(torch.arange(rollout.batch_size)[mb], cfg.micro_batch_size)]
        old_logp = training_logprobs(updater.module, rollout, temperature, update_rows, autocast, cfg.compile)  # (B, C), on the updates' row batches
        mismatch = float(logprob_mismatch(old_logp, rollout.logprobs, sampled_mask))
        rollout = dataclasses.replace(rollout, logprobs=old_logp)
    t_old = time.perf_counter()
    kl_metrics = {}
    if ref_logp is not None and cfg.kl_in == "reward":  # R_i - beta * sum_t KL_t at pi_old; the loss then has no KL term
        token_kl = KL_ESTIMATORS[cfg.kl_estimator](rollout.logprobs, ref_logp) * rollout.completion_mask  # (B, C)
        scored = add_score_term(scored, "kl_penalty", -cfg.beta * token_kl.sum(-1), world)
        kl_metrics["kl"] = float(distributed.global_mean_var(token_kl, rollout.completion_mask, world)[0])
        ref_logp = None

    # 4. group-relative advantages, one per completion (broadcast over its tokens by the loss)
    all_advantages = ADVANTAGE_ESTIMATORS[cfg.advantage](scored.scores, G)  # (B global,)
    shard = world.shard(len(batch))
    advantages = all_advantages[shard.start * G : shard.stop * G]  # (B,) this rank's rows

    # 5. mu passes x minibatches of clipped-surrogate updates against log pi_old
    #    (each one's gradient accumulated over micro-batches of cfg.micro_batch_size rows: the same update, less memory)
    updates = UpdateMeans()
    for _ in range(cfg.mu):
        for mb in minibatches:
            def loss_of(micro: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                ref = None if ref_logp is None else ref_logp[micro]
                return grpo_loss(updater.model, rollout.select(micro), advantages[micro], mask[micro], ref, cfg, on_policy, sampler_logp[micro], sampled_mask[micro])

            micro_rows = micro_batches(torch.arange(rollout.batch_size)[mb], cfg.micro_batch_size)
            stats, grad_norm = minibatch_step(updater, loss_of, micro_rows, mask, cfg.aggregation, world)
            updates.add({**stats, "grad_norm": grad_norm})
    t3 = time.perf_counter()

    metrics = updates.means()
    metrics.update(kl_metrics)
    metrics.update(sampling_metrics)
    metrics.update(scored_stats(scored))
    metrics.update(completion_stats(rollout, world))
    metrics["frac_zero_std_groups"] = (scored.scores.view(-1, G).std(dim=1) <= 1e-6).float().mean().item()
    metrics["adv/std"] = all_advantages.std().item()
    metrics["ratio_dev/first"] = updates.first_ratio_dev
    if mismatch is not None:
        metrics["logprob_mismatch"] = distributed.all_max(mismatch, world)
    metrics["lr"] = updater.lr
    metrics.update(step_timings(t0, t1, t2, t3, metrics["tokens"], t_ref, t_old))
    return metrics, sample_rows(state.step, scored, cfg.num_samples_logged)


def score_groups(
    rewards: Sequence[RewardTerm], tokenizer, examples: list[PromptExample], rollout: Rollout, state: TrainState, cfg: GRPOConfig, episodes: ToolRollout | None = None,
) -> ScoredRollout:
    """The weighted reward terms of every completion (``score_shard``), plus DAPO's overlong punishment when set.
    Multi-turn ``episodes``: the terms score each row's last assistant turn, and the environment's
    rewards, where it gave any, are the term "environment" (0 for rows without one)."""
    if episodes is not None:
        scored = score_shard(rewards, tokenizer, examples, rollout, episodes.final_texts, cfg.group_size, state.world, step=state.step)
        if any(r is not None for r in episodes.env_rewards):
            scored = add_score_term(scored, "environment", torch.tensor([r or 0.0 for r in episodes.env_rewards]), state.world)
        return scored
    scored = score_shard(rewards, tokenizer, examples, rollout, rollout.decode_completions(tokenizer), cfg.group_size, state.world, step=state.step)
    if cfg.overlong_buffer is None:
        return scored
    penalty = cfg.overlong_penalty * overlong_penalty(rollout.completion_lengths(), cfg.sampling.max_new_tokens, cfg.overlong_buffer)  # (B,)
    return add_score_term(scored, "overlong", penalty, state.world)


def tool_metrics(episodes: ToolRollout) -> dict[str, float]:
    """tools/turns (assistant turns per completion), tools/messages (tool results per completion), tools/tokens_frac (share of tool tokens)."""
    tokens = episodes.rollout.completion_mask.sum().clamp(min=1)
    return {
        "tools/turns": episodes.turns.float().mean().item(),
        "tools/messages": episodes.tool_messages.float().mean().item(),
        "tools/tokens_frac": 1.0 - (episodes.assistant_mask.sum() / tokens).item(),
    }


def informative_rollout(
    updater: Updater, tokenizer, rewards: Sequence[RewardTerm], prompts: Sequence[PromptExample], state: TrainState, cfg: GRPOConfig
) -> tuple[list[PromptExample], Rollout, ScoredRollout, dict[str, float], float]:
    """DAPO dynamic sampling (Yu et al. 2025, section 3.2): a group whose G rewards all tie has zero
    advantages and carries no gradient, so it is dropped, and prompts_per_step more prompts are drawn
    (the next data positions) until the step holds prompts_per_step informative groups, at most
    ``max_sampling_rounds`` draws; past that, tied groups fill the step in draw order (they add
    nothing to the gradient, and keep the step's shape). ``state.data_position`` counts the prompts drawn.

    Returns:
        (the kept groups' prompt records, rollout and scores, dynamic/* metrics, the seconds spent sampling).
    """
    n, G = cfg.prompts_per_step, cfg.group_size
    position = state.step * n if state.data_position is None else state.data_position
    draws: list[tuple[list[PromptExample], Rollout, ScoredRollout, Tensor]] = []  # (records, rollout, scores, informative (n,)) per draw
    sampling_time = 0.0
    while len(draws) < cfg.max_sampling_rounds and sum(int(d[3].sum()) for d in draws) < n:
        start = time.perf_counter()
        examples = [prompts[i] for i in batch_order(len(prompts), position, n, cfg.seed)]
        position += n
        rollout = sample_shard(updater, tokenizer, [ex.prompt for ex in examples], cfg.sampling, cfg.model, G, state)
        sampling_time += time.perf_counter() - start
        scored = score_groups(rewards, tokenizer, examples, rollout, state, cfg)
        draws.append((examples, rollout, scored, scored.scores.view(-1, G).std(dim=1) > 1e-6))
    state.data_position = position
    # informative groups in draw order, then tied ones to fill: (draw, group) pairs
    order = [(d, g) for want in (True, False) for d, draw in enumerate(draws) for g in range(n) if bool(draw[3][g]) == want][:n]
    kept_examples, kept_rollouts, kept_scored = [], [], []
    for d, (examples, rollout, scored, _) in enumerate(draws):
        groups = [g for dd, g in order if dd == d]
        if groups:
            rows = torch.tensor([g * G + j for g in groups for j in range(G)])
            kept_examples.extend(examples[g] for g in groups)
            kept_rollouts.append(rollout.select(rows))
            kept_scored.append(select_rows(scored, rows))
    informative = sum(int(d[3].sum()) for d in draws)
    metrics = {
        "dynamic/draws": float(len(draws)),
        "dynamic/prompts_drawn": float(len(draws) * n),
        "dynamic/tied_groups": float(len(draws) * n - informative),  # dropped, bar those filling the step
        "dynamic/filled_groups": float(max(n - informative, 0)),
    }
    return kept_examples, Rollout.concat(kept_rollouts, tokenizer.pad_token_id), concat_scored(kept_scored), metrics, sampling_time


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def train(
    cfg: GRPOConfig, resume: str | Path | None = None, reward_functions: Sequence[RewardTerm] = (), prompts: Sequence[dict] | None = None,
    tools: Mapping[str, Callable[[str], object]] | None = None,
) -> RLResult:
    """Run GRPO, or continue the run of checkpoint ``resume`` (a checkpoint dir or a run dir).

    Args:
        reward_functions: extra reward terms from Python, added to ``cfg.rewards``: :class:`RewardTerm` objects or plain
            functions (TRL's ``reward_len(completions, **kwargs)``; named by the function, weight 1).
        prompts: prompt records (``{"prompt": ..., "answer"?: ...}``) to use instead of ``cfg.data``.
        tools: Python functions of one string to register as tools, by name, next to ``cfg.tools.enabled``.
    """
    if tools and cfg.tools is None:
        raise ConfigError("tools were given but cfg.tools is null: set tools (e.g. tools.max_turns=3) to use them")
    run = start_rl_run(cfg, resume, prompts, reward_functions, cfg.prompts_per_step * cfg.group_size, cfg.num_minibatches)
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        if cfg.dynamic_sampling and run.world.distributed:
            raise ConfigError("dynamic_sampling runs in one process: under torchrun the ranks would keep unequal numbers of groups")
        if cfg.tools is not None and run.world.distributed:
            raise ConfigError("tools run in one process: under torchrun the ranks would take different numbers of turns")
        registry = tool_registry(cfg.tools, tools) if cfg.tools is not None else None
        policy = run.load_policy(cfg.model)
        reference = run.load_reference(cfg.model, cfg.reference) if cfg.beta > 0 else None  # beta = 0: no KL term, no reference
        updater = Updater.create(policy, cfg.optim, cfg.steps * cfg.mu * cfg.num_minibatches, run.world, cfg.model.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy)
        state = resume_state(run.checkpoint, cfg.seed, {"policy": updater}, run.world)

        def step(state: TrainState) -> tuple[dict[str, float], list[dict]]:
            return grpo_step(updater, reference, run.tokenizer, run.rewards, run.prompts, state, cfg, registry)

        history, final_dir = run_steps(
            step, cfg, run, state, SavedModels(policy), {"policy": updater},
            evaluate=run.evaluator(cfg, updater.module), eval_every=cfg.eval.every,
            total_steps=cfg.steps, batch_size=cfg.prompts_per_step, sample_every=cfg.sample_every,
            summary_keys=("reward/mean", "kl", "completion_len/mean"),
            plot_keys=("reward/mean", "eval/reward/mean", "kl", "entropy", "completion_len/mean", "clip_frac", "frac_zero_std_groups") if cfg.plots else (),
        )
        return RLResult(policy, history, run.run_dir, final_dir)


# ----------------------------------------------------------------------------------------------
# CLI: rlalign grpo --config configs/grpo_arithmetic.yaml steps=50 optim.lr=1e-4 [--resume DIR]
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "configs/grpo_arithmetic.yaml", "optim.lr=1e-4 steps=50", GRPOConfig)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(GRPOConfig, args.config, args.overrides)
    print(train(cfg, resume=args.resume).summary(("reward/mean", "kl", "completion_len/mean")))
    return 0
