"""GRPO on a causal LM: G completions per prompt, group-relative advantages, no critic.

    J(theta) = E_q 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
                                              - beta * k3(pi_theta, pi_ref)_it ]
    r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),     A_i = (R_i - mean(R_group)) / std(R_group)

Shao et al. 2024 (DeepSeekMath), eq. 3-4; seeds 003 (section 8) and 004. The maths lives in
:mod:`rlalign.core`; this file composes it. One step, top to bottom (:func:`grpo_step`):

    prompts --sample G each (policy, KV cache, no grad)--> Rollout (+ sampling log-probs = log pi_old)
    Rollout --weighted reward functions / reward models--> scores (B,)
    scores  --group z-score | batch std | mean only (Dr.GRPO) | RLOO | REINFORCE++(-baseline)--> A (B,), broadcast to tokens
    ref_logp = frozen reference, or the LoRA base with adapters off; none when beta = 0
    mu passes x minibatches: logp = policy(prompt + completion) at completion positions only
        (each group's prompt run once, its KV cache shared by the group's G rows);
        loss = aggregate(clipped surrogate | CISPO | SAPO, times the sampler's importance weight when tis_* is set)
               + beta * aggregate(k3); backward, clip, step  (the policy term: rlalign.train.objectives)

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
    clip_frac, clip_frac/low, clip_frac/high, approx_kl, ratio_mean   clipped-surrogate (or CISPO) diagnostics; SAPO: sapo/gate_mean
    tis/weight_mean|weight_min|truncated_frac|masked_frac|low_frac|high_frac   the sampler's importance weights (tis_cap / tis_min)
    logprob_mismatch      max |sampler log-prob - training log-prob| (one update per rollout, or model.autocast)
    ratio_dev, ratio_dev/first   max |r - 1|: over each update / on the first minibatch only (~0)
    entropy               mean per-token entropy of softmax(logits / temperature)
    completion_len/mean|max, completion_len/clipped_frac   lengths; share without EOS
    frac_zero_std_groups  share of groups whose rewards all tie over the rows that count (they carry no gradient)
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

from rlalign.config import load_config
from rlalign.core.advantages import group_advantages, reinforce_plus_plus_advantages, rloo_advantages, tied_groups
from rlalign.core.kl import kl_k1, kl_k2, kl_k3, masked_token_kl
from rlalign.core.losses import entropy_loss, kl_penalty_loss
from rlalign.lm.rollout import Rollout
from rlalign.train import distributed
from rlalign.train.async_source import check_one_process, open_source
from rlalign.train.env_source import train_tools
from rlalign.train.common import forward_precision
from rlalign.train.loop import RLResult, SavedModels, TrainState, UpdateMeans, add_run_arguments, print_summary, resume_state, run_steps, start_rl_run, step_timings
from rlalign.train.memory_plan import Pass, plan_rows
from rlalign.train.objectives import policy_objective, sampler_weights
from rlalign.train.passes import completion_logprobs, logprob_mismatch, loss_mask, micro_batches, ratio_deviation, reference_logprobs, training_logprobs
from rlalign.train.rl_config import DataConfig, RLConfig
from rlalign.train.rollouts import RewardTerm, add_score_term, completion_stats, sample_rows, scored_stats, trusted_rows
from rlalign.train.sources import RolloutSource
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
    advantage: Literal["group", "batch", "none", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = Field(
        "group", description="group: (R - mean_g) / std_g (DeepSeekMath); batch: / std of the batch; none: R - mean_g (Dr.GRPO); rloo: leave-one-out; "
        "reinforce_plus_plus: (R - mean_batch) / std_batch (REINFORCE++); reinforce_plus_plus_baseline: R - mean_g, then / its std over the batch"
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
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus: the loss gains -entropy_coef * aggregate(entropy)")
    overlong_buffer: int | None = Field(
        None, ge=1, description="DAPO soft overlong punishment: a reward from 0 down to -overlong_penalty over the last this many tokens of max_new_tokens; null = off"
    )
    overlong_penalty: float = Field(1.0, ge=0, description="the overlong punishment's largest penalty (at max_new_tokens)")
    mask_truncated: bool = Field(False, description="leave completions that hit max_new_tokens without EOS out of the loss (DAPO overlong filtering)")
    @model_validator(mode="after")
    def _minibatches_divide(self) -> GRPOConfig:
        batch = self.prompts_per_step * self.group_size
        if batch % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide prompts_per_step * group_size = {batch}")
        if self.overlong_buffer is not None and self.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} exceeds sampling.max_new_tokens={self.sampling.max_new_tokens}")
        for section in ("tools", "environment"):  # a completion there holds several turns and the environment's tokens: its length is no turn's
            if getattr(self, section) is not None and self.overlong_buffer is not None:
                raise ValueError(f"{section}: overlong_buffer is not supported with multi-turn rollouts (the limit is per turn; a completion "
                                 "holds several turns and the environment's tokens)")
        if self.importance_sampling == "sequence" and self.loss_type != "clip":
            raise ValueError(f"importance_sampling: sequence (GSPO) clips the sequence ratio; loss_type={self.loss_type} works on token ratios")
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
    "reinforce_plus_plus": partial(reinforce_plus_plus_advantages, baseline=False),
    "reinforce_plus_plus_baseline": partial(reinforce_plus_plus_advantages, baseline=True),
}


def grpo_loss(
    policy: nn.Module, rollout: Rollout, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None, cfg: GRPOConfig, on_policy: bool = False,
    sampler_logp: Tensor | None = None, sampled_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = aggregate(w * l) + beta * aggregate(KL(logp, ref_logp)) - entropy_coef * aggregate(H) on one minibatch, l the
    ``loss_type`` objective (clipped surrogate, CISPO or SAPO) and w the sampler's importance weight (``tis_*``; else 1).

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
            (for the sampler's importance weights); None: they are ``rollout.logprobs``. Shape: (B, C).
        sampled_mask: 1 on the tokens the sampler drew, for ``logprob_mismatch`` (multi-turn rollouts:
            not the tool tokens, whose sampler log-probs are 0); None: ``rollout.completion_mask``. Shape: (B, C).
    Returns:
        (loss, stats): detached loss/policy, clip fractions, approx_kl, ratio stats, kl, entropy, tis/*.
    """
    with forward_precision(cfg.model, policy):  # the head's matmul under autocast too, as the logits' would be
        entropy_mode = "gradient" if cfg.entropy_coef > 0 else "statistic"
        logp, entropy = completion_logprobs(policy, rollout, cfg.sampling.temperature, entropy_mode, cfg.compile, cfg.model.logits_limit_mb)  # (B, C) each, float32
    device = logp.device
    mask = mask.to(device)
    old_logp = logp.detach() if on_policy else rollout.logprobs.to(device)  # (B, C)
    sampler = (rollout.logprobs if sampler_logp is None or on_policy else sampler_logp).to(device)  # (B, C)
    weights, stats = sampler_weights(cfg, old_logp, sampler, mask)  # (B, C) pi_old / pi_sampler truncated or masked, or None
    max_len = cfg.sampling.max_new_tokens  # the fixed L of seq-mean-token-sum-norm (Dr.GRPO), not this batch's C
    pg_loss, pg_stats = policy_objective(cfg, logp, old_logp, advantages.to(device), mask, cfg.eps_low, cfg.eps_high, max_len, weights, cfg.importance_sampling)
    loss = pg_loss
    stats.update(pg_stats)
    stats["ratio_dev"] = ratio_deviation(logp, old_logp, mask)
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


def grpo_step(updater: Updater, reference: nn.Module | None, source: RolloutSource, state: TrainState, cfg: GRPOConfig) -> tuple[dict[str, float], list[dict]]:
    """One GRPO step (0-based ``state.step``): the next scored rollout, reference and pi_old passes,
    advantages, mu x minibatch updates, and the new weights published to the source.

    Returns:
        (metrics, a few samples with their rewards).
    """
    world, G = state.world, cfg.group_size  # one process, or this rank under torchrun: B below is this rank's share of the rows
    # 1-2. the step's rollout from its source (sampled by the policy of version batch.version, scored by the reward terms),
    #      G completions per prompt, groups adjacent; the sampling log-probs are log pi_old unless recomputed below
    t0 = time.perf_counter()
    batch = source.next(state)
    rollout, scored = batch.rollout, batch.scored
    state.data_position = batch.data_position
    t2 = time.perf_counter()

    # 3. reference log-probs, pi_old (recomputed when the sampler's numerics or weights differ: the proximal policy), optional KL in the reward
    sampled_mask = rollout.completion_mask * batch.token_mask  # (B, C) tokens the sampler drew (not tool tokens)
    mask = batch.weighted(loss_mask(rollout, cfg.mask_truncated) * batch.token_mask)  # (B, C) tool tokens get no gradient; an agent's k calls weigh 1/k each
    m = cfg.num_minibatches
    minibatches = distributed.minibatch_rows(rollout.batch_size, m, world)  # rows k, k + m, ... of all ranks' rows, as one process cuts them
    temperature, autocast = cfg.sampling.temperature, cfg.model.autocast
    passes = [Pass(updater.module, updater.optimizer, runner=updater.model, head_copies=5.0 if cfg.entropy_coef > 0 else 3.0)]
    passes += [Pass(reference, None, group=None)] if reference is not None and cfg.beta > 0 else []  # a reference of its own: no-grad passes
    rows = plan_rows(passes, rollout, cfg.micro_batch_size, -(-rollout.batch_size // m), cfg.model, world, updater.row_costs, cfg.compile)
    update_rows = [micro for mb in minibatches for micro in micro_batches(torch.arange(rollout.batch_size)[mb], rows.update)]
    ref_batches = update_rows if rows.no_grad >= max(len(r) for r in update_rows) else rows.no_grad  # the updates' row batches, where they fit
    ref_logp = reference_logprobs(updater.model, reference, rollout, temperature, ref_batches, autocast, cfg.compile,
                                  cfg.model.logits_limit_mb) if cfg.beta > 0 else None  # (B, C)
    t_ref = time.perf_counter()
    on_policy = cfg.mu * m == 1  # one update: pi_old is the policy being updated (the proximal policy), no pass needed for it
    mismatch, sampler_logp = None, rollout.logprobs  # (B, C) the sampler's (behaviour policy's) log-probs
    if cfg.recompute_old_logprobs and not on_policy:  # bfloat16 sampling numerics, or an older policy, are not the training forward's
        old_logp = training_logprobs(updater.model, rollout, temperature, update_rows, autocast, cfg.compile, cfg.model.logits_limit_mb)  # (B, C), on the updates' row batches
        mismatch = float(logprob_mismatch(old_logp, rollout.logprobs, sampled_mask))
        rollout = dataclasses.replace(rollout, logprobs=old_logp)
    kl_metrics = {}
    if ref_logp is not None and cfg.kl_in == "reward":  # R_i - beta * sum_t KL_t at pi_old; the loss then has no KL term
        # (one update: pi_old is the learner's policy, not the sampler's (an older one, another precision): recomputed for the KL alone)
        fresh = cfg.recompute_old_logprobs and on_policy
        old_logp = training_logprobs(updater.model, rollout, temperature, update_rows, autocast, cfg.compile, cfg.model.logits_limit_mb) if fresh else rollout.logprobs
        token_kl = masked_token_kl(KL_ESTIMATORS[cfg.kl_estimator], old_logp, ref_logp, sampled_mask)  # (B, C)
        scored = add_score_term(scored, "kl_penalty", -cfg.beta * token_kl.sum(-1), world)
        kl_metrics["kl"] = float(distributed.global_mean_var(token_kl, sampled_mask, world)[0])
        ref_logp = None
    t_old = time.perf_counter()

    # 4. group-relative advantages, one per completion (broadcast over its tokens by the loss), over the
    #    completions every reward term could score; the rest (a failed call, a code run that never ended) are left out
    trusted = trusted_rows(scored)  # (B global,)
    all_advantages = ADVANTAGE_ESTIMATORS[cfg.advantage](scored.scores, G, valid=None if trusted.all() else trusted)  # (B global,)
    shard = world.shard(len(batch.examples))
    advantages = batch.row_values(all_advantages[shard.start * G : shard.stop * G])  # (B,) this rank's rows (an agent's calls: their episode's)
    mask = mask * batch.row_values(trusted[shard.start * G : shard.stop * G].float())[:, None]  # (B, C)

    # 5. mu passes x minibatches of clipped-surrogate updates against log pi_old
    #    (each one's gradient accumulated over micro-batches of rows.update rows: the same update, less memory)
    updates = UpdateMeans()
    for _ in range(cfg.mu):
        for mb in minibatches:
            def loss_of(micro: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                ref = None if ref_logp is None else ref_logp[micro]
                return grpo_loss(updater.model, rollout.select(micro), advantages[micro], mask[micro], ref, cfg, on_policy, sampler_logp[micro], sampled_mask[micro])

            micro_rows = micro_batches(torch.arange(rollout.batch_size)[mb], rows.update)
            stats, grad_norm = minibatch_step(updater, loss_of, micro_rows, mask, cfg.aggregation, world)
            updates.add({**stats, "grad_norm": grad_norm})
    sync_s = source.publish(updater.module, state.step + 1)  # the weights after this step's updates
    t3 = time.perf_counter()

    metrics = updates.means()
    metrics.update(kl_metrics)
    metrics.update(rows.metrics())
    metrics.update(batch.metrics)
    metrics.update(scored_stats(scored))
    metrics.update(completion_stats(rollout, world))
    metrics["frac_zero_std_groups"] = tied_groups(scored.scores, G, trusted_rows(scored)).float().mean().item()  # over the rows that count
    metrics["adv/std"] = all_advantages.std().item()
    metrics["ratio_dev/first"] = updates.first_ratio_dev
    if mismatch is not None:
        metrics["logprob_mismatch"] = distributed.all_max(mismatch, world)
    metrics["lr"] = updater.lr
    metrics.update(step_timings(batch.generate_s, batch.score_s, t0, t2, t3, metrics["tokens"], t_ref, t_old, sync_s))
    return metrics, sample_rows(state.step, scored, cfg.num_samples_logged)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def train(
    cfg: GRPOConfig, resume: str | Path | None = None, reward_functions: Sequence[RewardTerm] = (), prompts: Sequence[dict] | None = None,
    tools: Mapping[str, Callable[[str], object]] | Sequence[Callable] | None = None, environment: object | None = None,
) -> RLResult:
    """Run GRPO, or continue the run of checkpoint ``resume`` (a checkpoint dir or a run dir).

    Args:
        reward_functions: extra reward terms from Python, added to ``cfg.rewards``: :class:`RewardTerm` objects or plain
            functions (TRL's ``reward_len(completions, **kwargs)``; named by the function, weight 1).
        prompts: prompt records (``{"prompt": ..., "answer"?: ...}``) to use instead of ``cfg.data``.
        tools: Python functions of one string to register as tools, by name, next to ``cfg.tools.enabled``; or TRL's
            list of typed functions with docstrings, run in episodes of ``cfg.environment`` (:func:`rlalign.train.env_source.train_tools`).
        environment: a Python environment (a class or zero-argument maker, rlalign.agents.environment) for ``cfg.environment``.
    """
    tools, environment = train_tools(cfg, tools, environment)
    run = start_rl_run(cfg, resume, prompts, reward_functions, cfg.prompts_per_step * cfg.group_size, cfg.num_minibatches)
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        check_one_process(cfg, run.world)
        policy = run.load_policy(cfg.model)
        reference = run.load_reference(cfg.model, cfg.reference) if cfg.beta > 0 else None  # beta = 0: no KL term, no reference
        updater = Updater.create(policy, cfg.optim, cfg.steps * cfg.mu * cfg.num_minibatches, run.world, cfg.model.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy)
        state = resume_state(run.checkpoint, cfg.seed, {"policy": updater}, run.world)
        source = open_source(cfg, run, updater, state, tools, environment=environment)

        def step(state: TrainState) -> tuple[dict[str, float], list[dict]]:
            return grpo_step(updater, reference, source, state, cfg)

        history, final_dir = run_steps(
            step, cfg, run, state, SavedModels(policy), {"policy": updater}, checkpoint_extra=source.state_dict, source=source,
            evaluate=run.evaluator(cfg, updater.module, environment, tools), eval_every=cfg.eval.every,
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
    print_summary(train(cfg, resume=args.resume).summary(("reward/mean", "kl", "completion_len/mean")))
    return 0
