"""RLHF PPO on a causal LM: policy, frozen reference, reward model (or rule rewards), critic.

Per-token reward with the KL penalty inside it (Ziegler et al. 2019; InstructGPT, Ouyang et al.
2022, eq. 2; seed 003 sections 5-7):

    r_t = -beta * KL_t  (+ score(q, o) at the last completion token),  KL_t = k1 or k3 of (pi_old, pi_ref)
    A_t = GAE(gamma, lambda) over the policy's tokens with V from the critic   (Schulman et al. 2016; multi-turn:
          a tool's or environment's tokens are skipped, rlalign.core.advantages.sampled_token_gae)
    L_pi = aggregate(-min(r A, clip(r, 1-eps, 1+eps) A)) - c2 * aggregate(H)       (Schulman et al. 2017;
           loss_type: cispo | sapo swaps the per-token objective, rlalign.train.objectives)
    L_V  = 1/2 aggregate(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))

One step, top to bottom (:func:`ppo_step`):

    prompts --sample one completion each (policy, no grad)--> Rollout (+ sampling log-probs = log pi_old)
    Rollout --reward terms (reward model, rules)--> score (B,)   (- penalty when no EOS, optional)
    ref_logp (frozen reference or LoRA base), V_old (critic)   --> r_t, A_t, R_t   (:func:`ppo_advantages`)
    epochs x shuffled minibatches: policy step on L_pi, critic step on L_V (each clipped)
    beta <- KL controller (fixed, or adaptive towards a target KL)

Metrics (one metrics.jsonl line per step; minibatch statistics are means over the step's updates):
    score                 mean sequence score (reward terms minus the missing-EOS penalty)
    kl                    mean per-sequence sum of the KL estimator at pi_old, over the rows that are trained
                          (not those an on_error: skip term left out); beta: the coefficient used
    non_score_reward      mean per-sequence sum of -beta * KL_t
    approx_kl, clip_frac, ratio_mean, ratio_dev, ratio_dev/first   policy-update diagnostics
    loss/policy, loss/value, value_clip_frac, explained_variance, entropy, adv/std, returns/mean
    reward/mean|std, reward/<term>/mean|std, completion_len/*, grad_norm/policy|critic, lr, time/*, tokens_per_s

Deliberate simplifications, stated:
- the critic is a separate model with its own AdamW, so the value loss needs no coefficient c1:
  its learning rate (``critic.optim.lr``) plays that role.
- pi_old is the sampling policy: its log-probs come from the sampler (no extra forward pass), so
  the first minibatch of the first epoch has ratio 1 up to float round-off (logged as
  ``ratio_dev/first``, the largest |r - 1| there).
- the KL in the reward and in the metrics is measured once per rollout, at pi_old.
- with ``model.autocast: bfloat16`` or ``sampling.dtype: bfloat16``, pi_old is recomputed by the training forward (as in
  rlalign.train.grpo; ``logprob_mismatch`` logs how far the sampler's log-probs were from it).
- explained_variance is that of the rollout-time values V_old against the returns, over the whole
  rollout (as CleanRL's), so it does not depend on minibatches, micro-batches or ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from rlalign.config import Config, load_config
from rlalign.core.advantages import kl_shaped_rewards, sampled_token_gae
from rlalign.core.kl import AdaptiveKLController, FixedKLController, kl_k1, kl_k3, masked_token_kl
from rlalign.core.losses import Aggregation, entropy_loss, value_loss
from rlalign.core.masks import whiten as whiten_with
from rlalign.lm.heads import load_critic
from rlalign.lm.model_modes import enable_gradient_checkpointing
from rlalign.lm.rollout import Rollout
from rlalign.train import distributed
from rlalign.train.async_source import check_one_process, open_source
from rlalign.train.env_source import train_tools
from rlalign.train.common import forward_precision, memory_named
from rlalign.train.loop import RLResult, SavedModels, TrainState, UpdateMeans, add_run_arguments, print_summary, resume_state, run_steps, start_rl_run, step_timings
from rlalign.train.memory_plan import Pass, plan_rows
from rlalign.train.objectives import policy_objective, sampler_weights
from rlalign.train.passes import completion_logprobs, critic_values, logprob_mismatch, micro_batches, ratio_deviation, reference_logprobs, training_logprobs
from rlalign.train.rl_config import DataConfig, RLConfig, RLOptimConfig
from rlalign.train.rollouts import RewardTerm, completion_stats, sample_rows, scored_stats, trusted_rows
from rlalign.train.sources import RolloutSource
from rlalign.train.updater import Updater, minibatch_step

__all__ = [
    "CriticConfig", "PPOConfig", "KL_ESTIMATORS", "ppo_advantages", "policy_loss", "critic_loss", "ppo_step", "train",
    "add_arguments", "run",
]

KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}


class CriticConfig(Config):
    """The value model V(s_t): a backbone with a scalar head, trained alongside the policy."""

    path: str | None = Field(
        None, description="initialisation: a reward-model dir keeps its head, an SFT/base dir gets a fresh one; null = the first reward model, else the policy's start"
    )
    optim: RLOptimConfig = Field(
        default_factory=lambda: RLOptimConfig(lr=1e-4), description="the critic's own AdamW (its lr plays the role of the value-loss coefficient)"
    )


class PPOConfig(RLConfig):
    """``rlalign ppo``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/ppo", description="run directory: metrics.jsonl, samples.jsonl, checkpoints/, final/ (critic in final/critic), curves.png")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the value model and its optimiser")
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="preference"), description="training prompts")
    prompts_per_step: int = Field(16, ge=1, description="rollout size B (one completion per prompt)")
    ppo_epochs: int = Field(4, ge=1, description="passes over each rollout")
    num_minibatches: int = Field(2, ge=1, description="shuffled minibatches per pass, one policy and one critic update each; must divide prompts_per_step")
    eps: float = Field(0.2, gt=0, lt=1, description="policy ratio clip range: clip(r, 1 - eps, 1 + eps)")
    value_clip: float | None = Field(0.2, gt=0, description="clip V - V_old to +-value_clip in the value loss (null = unclipped)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount over completion tokens")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="whiten advantages over the rollout's completion tokens")
    kl_coef: float = Field(0.05, ge=0, description="beta: KL penalty coefficient in the per-token reward (the initial value when adaptive)")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="per-token KL in the reward: k1 = log pi - log pi_ref; k3 = e^x - x - 1, x = log pi_ref - log pi")
    kl_target: float | None = Field(None, gt=0, description="adaptive beta (Ziegler et al. 2019): steer the per-sequence KL to this target; null = fixed beta")
    kl_horizon: float = Field(10000.0, gt=0, description="adaptive controller horizon, in sequences (with kl_target)")
    missing_eos_penalty: float | None = Field(None, ge=0, description="subtract this from the score of completions without EOS; null = no penalty")
    entropy_coef: float = Field(0.0, ge=0, description="c2: weight of the entropy bonus")
    aggregation: Aggregation = Field("token-mean", description="token-loss reduction (as for GRPO)")

    @model_validator(mode="after")
    def _minibatches_fit(self) -> PPOConfig:
        if self.prompts_per_step % self.num_minibatches:  # minibatches are cut from every rank's rows together: the global count decides
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide prompts_per_step={self.prompts_per_step}, the rows of a step "
                             f"(all processes together), so that each of the {self.num_minibatches} updates a pass counts trains on as many rows")
        if self.dynamic_sampling:
            raise ValueError("dynamic_sampling drops groups whose G rewards all tie; PPO samples one completion per prompt, so it has no groups (use GRPO)")
        if self.kl_target is None and self.kl_horizon != type(self).model_fields["kl_horizon"].default:
            raise ValueError("kl_horizon paces the adaptive KL controller: set kl_target too, or leave kl_horizon at its default")
        if self.kl_target is not None and self.prompts_per_step >= 5 * self.kl_horizon:
            raise ValueError(f"kl_horizon={self.kl_horizon:g} must exceed prompts_per_step / 5 = {self.prompts_per_step / 5:g}: one controller update "
                             "below the target would take beta to 0 or below")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_coef=0 with kl_target: the adaptive controller multiplies beta, so it can never move it from 0; set kl_coef > 0 (the initial beta)")
        return self

    def kl_controller(self) -> FixedKLController | AdaptiveKLController:
        if self.kl_target is None:
            return FixedKLController(self.kl_coef)
        return AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon)


# ----------------------------------------------------------------------------------------------
# The pieces of a step
# ----------------------------------------------------------------------------------------------


def ppo_advantages(
    scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    values: Tensor,
    mask: Tensor,
    beta: float,
    estimator: Literal["k1", "k3"],
    gamma: float,
    lam: float,
    whiten: bool,
    world: distributed.World = distributed.World(),
    sampled: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """KL-shaped per-token rewards, then token GAE, then optional whitening (over every rank's tokens).

    Args:
        scores: sequence scores. Shape: (B,).
        logp, ref_logp: log pi_old and log pi_ref of the completion tokens. Shape: (B, C).
        values: V_old(s_t) for each completion token's state. Shape: (B, C).
        mask: 1 on completion tokens. Shape: (B, C).
        sampled: 1 on the tokens the policy chose (multi-turn: not the tool tokens, which are the
            environment's move: no KL there, and no advantage to whiten); None: ``mask``. Shape: (B, C).
    Returns:
        (rewards, advantages, returns, kl), each (B, C) and 0 on padding; advantages and returns (the value
        targets, A + V before whitening) are 0 off ``sampled`` too.
    """
    sampled = mask if sampled is None else sampled
    kl = masked_token_kl(KL_ESTIMATORS[estimator], logp, ref_logp, sampled)  # (B, C), 0 off the sampled tokens
    rewards = kl_shaped_rewards(scores, kl, mask, beta)  # (B, C)
    advantages, returns = sampled_token_gae(rewards, values, mask, sampled, gamma, lam)  # (B, C) over the policy's tokens, 0 elsewhere
    if whiten:
        mean, var = distributed.global_mean_var(advantages, sampled, world)
        advantages = whiten_with(advantages, mean, var, sampled)
    return rewards, advantages, returns, kl


def policy_loss(
    policy: nn.Module, rollout: Rollout, advantages: Tensor, mask: Tensor, cfg: PPOConfig, sampler_logp: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """L_pi = aggregate(w * l) + c2 * L_H on one minibatch, l the ``loss_type`` objective (clipped surrogate, CISPO or
    SAPO) and w the sampler's importance weight (``tis_*``; else 1); ``rollout.logprobs`` = log pi_old, ``sampler_logp``:
    the sampler's log-probs when they are not pi_old's."""
    with forward_precision(cfg.model, policy):  # the head's matmul under autocast too, as the logits' would be
        entropy_mode = "gradient" if cfg.entropy_coef > 0 else "statistic"
        logp, entropy = completion_logprobs(policy, rollout, cfg.sampling.temperature, entropy_mode, cfg.compile, cfg.model.logits_limit_mb)  # (B, C) each, float32
    device = logp.device
    old_logp, mask = rollout.logprobs.to(device), mask.to(device)
    max_len = cfg.sampling.max_new_tokens  # the fixed L of seq-mean-token-sum-norm
    weights, stats = sampler_weights(cfg, old_logp, old_logp if sampler_logp is None else sampler_logp.to(device), mask)  # (B, C) or None
    pg_loss, pg_stats = policy_objective(cfg, logp, old_logp, advantages.to(device), mask, cfg.eps, cfg.eps, max_len, weights)
    ent_loss, ent = entropy_loss(entropy, mask, mode=cfg.aggregation, max_len=max_len)
    loss = pg_loss + cfg.entropy_coef * ent_loss if cfg.entropy_coef > 0 else pg_loss
    return loss, {**stats, **pg_stats, "ratio_dev": ratio_deviation(logp, old_logp, mask), "entropy": ent.entropy}


def critic_loss(critic: nn.Module, rollout: Rollout, returns: Tensor, old_values: Tensor, mask: Tensor, cfg: PPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """L_V on one minibatch, clipped around the rollout-time values when ``value_clip`` is set."""
    with forward_precision(cfg.model, critic):
        values = critic_values(critic, rollout)  # (B, C), float32 (the head is)
    device = values.device
    loss, stats = value_loss(
        values, returns.to(device), mask.to(device), old_values.to(device), cfg.value_clip, mode=cfg.aggregation, max_len=cfg.sampling.max_new_tokens
    )
    return loss, {"loss/value": loss.detach(), "value_clip_frac": stats.clip_frac}


def ppo_step(
    policy: Updater,
    critic: Updater,
    reference: nn.Module | None,
    kl_ctl: FixedKLController | AdaptiveKLController,
    source: RolloutSource,
    state: TrainState,
    cfg: PPOConfig,
) -> tuple[dict[str, float], list[dict]]:
    """One PPO step (0-based ``state.step``): the next scored rollout, KL-shaped rewards + GAE,
    epochs x minibatches, and the new weights published to the source.

    Returns:
        (metrics, a few samples with their scores).
    """
    world = state.world  # one process, or this rank under torchrun: B below is this rank's share of the rows
    # 1-2. the step's rollout from its source: one completion per prompt (the sampling log-probs are log pi_old unless
    #      recomputed below), scored by the reward terms minus a penalty when the completion never ended
    t0 = time.perf_counter()
    batch = source.next(state)
    rollout, scored = batch.rollout, batch.scored  # local rows (B,), scores (B global,)
    state.data_position = batch.data_position
    t2 = time.perf_counter()

    # 3. reference log-probs and old values -> KL-shaped per-token rewards -> GAE advantages, returns
    mask = rollout.completion_mask.float()  # (B, C) the episode's tokens
    trusted = batch.row_values(trusted_rows(scored)[world.shard(len(scored.scores))].float())  # (B,) 0 where a reward term could not score: left out
    sampled = mask * batch.token_mask * trusted[:, None]  # (B, C) the tokens the policy chose (not tool tokens): they alone are trained
    n = len(batch.examples) if batch.row_episode is None else rollout.batch_size  # global rows (an agent's calls: one process)
    minibatch = -(-n // cfg.num_minibatches)  # global rows per minibatch (n / num_minibatches; an agent's calls: the largest)
    temperature, autocast = cfg.sampling.temperature, cfg.model.autocast
    passes = [Pass(policy.module, policy.optimizer, runner=policy.model, head_copies=5.0 if cfg.entropy_coef > 0 else 3.0),
              Pass(critic.module, critic.optimizer, critic_values, runner=critic.model, group=1)]  # the critic's update after the policy's
    passes += [Pass(reference, None, group=None)] if reference is not None else []
    rows_plan = plan_rows(passes, rollout, cfg.micro_batch_size, minibatch, cfg.model, world, policy.row_costs, cfg.compile)
    pass_rows = rows_plan.no_grad  # rows per no-grad forward
    ref_logp = reference_logprobs(policy.model, reference, rollout, temperature, pass_rows, autocast, cfg.compile, cfg.model.logits_limit_mb)  # (B, C)
    with torch.no_grad(), forward_precision(cfg.model, critic.module), memory_named("the critic's value pass", min(pass_rows, n), rollout.completion_ids.shape[1], False):
        old_values = torch.cat([critic_values(critic.module, mb).cpu() for mb in rollout.minibatches(pass_rows)])  # (B, C)
    t_ref = time.perf_counter()
    mismatch, sampler_logp = None, rollout.logprobs  # (B, C) the sampler's log-probs
    if cfg.recompute_old_logprobs:  # bfloat16 sampling numerics are not the training forward's: recompute log pi_old
        # (also for one update per rollout: log pi_old enters the KL-shaped rewards before any update)
        chunks = [slice(s, s + pass_rows) for s in range(0, rollout.batch_size, pass_rows)]
        old_logp = training_logprobs(policy.model, rollout, temperature, chunks, autocast, cfg.compile, cfg.model.logits_limit_mb)  # (B, C)
        mismatch = float(logprob_mismatch(old_logp, rollout.logprobs, sampled))
        rollout = dataclasses.replace(rollout, logprobs=old_logp)
    t_old = time.perf_counter()
    beta = kl_ctl.value
    _, advantages, returns, kl = ppo_advantages(
        batch.row_values(scored.local_scores), rollout.logprobs, ref_logp, old_values, mask, beta, cfg.kl_estimator, cfg.gamma, cfg.lam, cfg.whiten_advantages, world, sampled
    )  # (B, C) each

    # 4. ppo_epochs x shuffled minibatches: one policy update and one critic update each. The
    #    permutation is of the global batch (the same on every rank); each rank trains on its rows
    #    of the minibatch, or on one row weighted 0 when it has none (DDP needs every rank's backward).
    shard = world.shard(n)  # this rank's rows
    updates = UpdateMeans()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=state.generator)  # (B global,)
        for mb_rows in order.tensor_split(cfg.num_minibatches):  # n / num_minibatches rows each (an agent's calls: sizes within one row)
            rows = distributed.rows_of(mb_rows, shard)  # this rank's rows of the minibatch
            present = float(rows.numel() > 0)
            rows = rows if present else torch.zeros(1, dtype=torch.long)
            micro_rows = micro_batches(rows, rows_plan.update)  # each update accumulates its gradient over these
            mb_mask = batch.weighted(sampled) * present  # (B, C); an agent's k calls weigh 1/k each

            def actor_loss(micro: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                return policy_loss(policy.model, rollout.select(micro), advantages[micro], mb_mask[micro], cfg, sampler_logp[micro])

            def value_loss_of(micro: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                return critic_loss(critic.model, rollout.select(micro), returns[micro], old_values[micro], mb_mask[micro], cfg)

            stats, grad_norm_pi = minibatch_step(policy, actor_loss, micro_rows, mb_mask, cfg.aggregation, world, present)
            value_stats, grad_norm_v = minibatch_step(critic, value_loss_of, micro_rows, mb_mask, cfg.aggregation, world, present)
            stats.update(value_stats)
            stats["grad_norm/policy"], stats["grad_norm/critic"] = grad_norm_pi, grad_norm_v
            updates.add(stats)
    sync_s = source.publish(policy.module, state.step + 1)  # the weights after this step's updates
    t3 = time.perf_counter()

    # 5. the KL coefficient for the next step (adaptive: towards kl_target), from the global batch
    seq_kl = distributed.gather_rows(kl.sum(-1), world)  # (B global,)
    counted = distributed.gather_rows((sampled.sum(-1) > 0).float(), world)  # (B global,) the rows trained on (not left out by on_error: skip)
    mean_kl = ((seq_kl * counted).sum() / counted.sum()).item() if counted.any() else None
    sequences = int(counted.sum()) if batch.row_episode is None else batch.row_episode[counted.bool()].unique().numel()  # an agent's: episodes
    if mean_kl is not None:  # no row trained on: no KL measured, beta stays
        kl_ctl.update(mean_kl, sequences)

    metrics = updates.means()
    metrics.update(rows_plan.metrics())
    metrics.update(batch.metrics)
    metrics.update(scored_stats(scored))
    metrics.update(completion_stats(rollout, world))
    adv_mean, adv_var = distributed.global_mean_var(advantages, sampled, world)
    metrics["score"] = scored.scores.mean().item()
    if mean_kl is not None:
        metrics["kl"], metrics["non_score_reward"] = mean_kl, -beta * mean_kl
    metrics["beta"] = beta
    metrics["ratio_dev/first"] = updates.first_ratio_dev
    if mismatch is not None:
        metrics["logprob_mismatch"] = distributed.all_max(mismatch, world)
    metrics["adv/std"] = adv_var.sqrt().item()
    returns_mean, returns_var = distributed.global_mean_var(returns, sampled, world)  # over the critic's targets (the trained tokens)
    metrics["returns/mean"] = returns_mean.item()
    residual_var = distributed.global_mean_var(returns - old_values, sampled, world)[1]  # 1 - Var[R - V_old] / Var[R] over the rollout's trained tokens
    metrics["explained_variance"] = (1.0 - residual_var / returns_var).item() if returns_var > 0 else 0.0
    metrics["lr"] = policy.lr
    metrics.update(step_timings(batch.generate_s, batch.score_s, t0, t2, t3, metrics["tokens"], t_ref, t_old, sync_s))
    return metrics, sample_rows(state.step, scored, cfg.num_samples_logged)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _critic_init(cfg: PPOConfig, base_path: Path) -> str | Path:
    if cfg.critic.path is not None:
        return cfg.critic.path
    reward_models = [r.reward_model for r in cfg.rewards if r.reward_model is not None]
    return reward_models[0] if reward_models else base_path


def train(
    cfg: PPOConfig, resume: str | Path | None = None, reward_functions: Sequence[RewardTerm] = (), prompts: Sequence[dict] | None = None,
    tools: Mapping[str, Callable[[str], object]] | Sequence[Callable] | None = None, environment: object | None = None,
) -> RLResult:
    """Run PPO, or continue the run of checkpoint ``resume`` (a checkpoint dir or a run dir).

    Args:
        reward_functions: extra score terms from Python, added to ``cfg.rewards``: :class:`RewardTerm` objects or plain
            functions (TRL's ``reward_len(completions, **kwargs)``; named by the function, weight 1).
        prompts: prompt records to use instead of ``cfg.data``.
        tools: Python functions of one string to register as tools, by name, next to ``cfg.tools.enabled``; or TRL's
            list of typed functions with docstrings, run in episodes of ``cfg.environment`` (:func:`rlalign.train.env_source.train_tools`).
        environment: a Python environment (a class or zero-argument maker, rlalign.agents.environment) for ``cfg.environment``.
    """
    tools, environment = train_tools(cfg, tools, environment)
    run = start_rl_run(cfg, resume, prompts, reward_functions, cfg.prompts_per_step, 1)  # minibatches may hold any share of a rank's rows
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        check_one_process(cfg, run.world)
        m, ckpt = cfg.model, run.checkpoint
        policy = run.load_policy(m)
        reference = run.load_reference(m, cfg.reference)
        critic = load_critic(ckpt.model_dir / "critic" if ckpt else _critic_init(cfg, run.base_path), m.dtype, run.device, attn_implementation=m.attn_implementation)
        if m.gradient_checkpointing:
            enable_gradient_checkpointing(critic)
        updates = cfg.steps * cfg.ppo_epochs * cfg.num_minibatches
        updaters = {
            "policy": Updater.create(policy, cfg.optim, updates, run.world, m.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy),
            "critic": Updater.create(critic, cfg.critic.optim, updates, run.world, m.sharding),
        }
        state = resume_state(ckpt, cfg.seed, updaters, run.world)
        kl_ctl = cfg.kl_controller()
        if ckpt is not None:
            kl_ctl.load_state_dict(ckpt.extra["kl_controller"])

        source = open_source(cfg, run, updaters["policy"], state, tools, environment=environment)

        def step(state: TrainState) -> tuple[dict[str, float], list[dict]]:
            return ppo_step(updaters["policy"], updaters["critic"], reference, kl_ctl, source, state, cfg)

        history, final_dir = run_steps(
            step, cfg, run, state, SavedModels(policy, critic=critic), updaters,
            evaluate=run.evaluator(cfg, updaters["policy"].module, environment, tools), eval_every=cfg.eval.every,
            total_steps=cfg.steps, batch_size=cfg.prompts_per_step, sample_every=cfg.sample_every,
            checkpoint_extra=lambda: {"kl_controller": kl_ctl.state_dict(), **source.state_dict()}, source=source,
            summary_keys=("score", "kl", "beta"),
            plot_keys=("score", "eval/reward/mean", "kl", "beta", "entropy", "loss/value", "explained_variance", "clip_frac") if cfg.plots else (),
        )
        return RLResult(policy, history, run.run_dir, final_dir, critic)


# ----------------------------------------------------------------------------------------------
# CLI: rlalign ppo --config configs/ppo_preference.yaml steps=50 kl_coef=0.1 [--resume DIR]
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "configs/ppo_preference.yaml", "kl_coef=0.1 steps=50", PPOConfig)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(PPOConfig, args.config, args.overrides)
    print_summary(train(cfg, resume=args.resume).summary(("score", "kl", "beta")))
    return 0
