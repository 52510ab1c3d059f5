"""On-policy distillation on a causal LM: the student samples, a frozen teacher grades every token.

    reverse_kl   L = aggregate_t( -sg(A_t) * log pi_s(y_t) ),   A_t = -(log pi_s(y_t) - log pi_t(y_t)),   y ~ pi_s
                 (Lu & Thinking Machines Lab 2025, "On-Policy Distillation"; Agarwal et al. 2024; no critic, no reward)
    gkd          L = aggregate_t JSD_beta(pi_t(. | x, y_<t), pi_s(. | x, y_<t)) over the whole vocabulary, on the
                 student's samples on a share lmbda of the steps and on the data's completions on the others
                 (Agarwal et al. 2024, "On-Policy Distillation of Language Models", GKD; beta = 1: the exact reverse KL)

The maths lives in :mod:`rlalign.core.distillation`; this file composes it. One step, top to bottom
(:func:`distill_step`):

    batch = source.next(state)          the student's samples, from any rollout source (plain, tools, asynchronous);
                                        with lmbda < 1, on the steps on_policy_step(seed, step, lmbda) does not pick,
                                        the data's own completions (rlalign.train.sources.MixedSource)
    reverse_kl: teacher_logp = the teacher's log-probs of the batch's tokens (one no-grad pass, as a reference pass)
    minibatches: student forward (gkd: and the teacher's logits, no grad); loss; backward, clip, step
    publish the student's weights to the source

Deliberate simplifications, stated:
- the teacher shares the student's tokenizer (checked: the same vocabulary and EOS, else a ConfigError), and
  both distributions are softmax(logits / sampling.temperature); when the two models' output layers differ in
  size (one pads its vocabulary), gkd compares the first min(V_s, V_t) outputs.
- rewards are optional and never trained on: when set (or when the task has one), they score the student's
  samples and its held-out completions, so reward/* and eval/* show the task score the teacher passes on.
- one pass over each batch: with num_minibatches > 1 the later minibatches are slightly off-policy. tis_cap
  (required by asynchronous rollouts with max_staleness > 0; with tis_min, tis_mode, tis_level as in GRPO)
  weights each reverse-KL token by the sampler's importance weight pi_s / pi_sampler, truncated or masked;
  gkd's divergence is exact at every position whoever wrote the prefix, so it takes no weight.
- discount 0: each token's advantage is its own reverse-KL term, not the sum of those after it.

Metrics (one metrics.jsonl line per step):
    kl/reverse          mean per-token reverse KL: log pi_s(y_t) - log pi_t(y_t) (reverse_kl), exact (gkd)
    jsd                 mean per-token JSD_beta (gkd)
    adv/min, adv/max    extreme per-token advantages (reverse_kl)
    on_policy           1 on the student's samples, 0 on the data's completions
    reward/mean, reward/<term>/mean   the student's samples scored by the reward terms (on-policy steps, when set)
    loss/distill, entropy, completion_len/*, tis/*, grad_norm, lr, time/*, tokens_per_s

Python use:

    from rlalign.config import load_config
    from rlalign.train import distill
    cfg = load_config(distill.DistillConfig, "configs/distill_arithmetic.yaml", ["steps=20"])
    result = distill.train(cfg)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from rlalign.config import ConfigError, load_config
from rlalign.core.distillation import generalized_jsd_loss, head_divergences, jsd_loss, reverse_kl_loss
from rlalign.core.linear_logprobs import linear_token_logprobs
from rlalign.lm.data import load_prompts
from rlalign.lm.logprobs import completion_hidden, lm_head_of
from rlalign.lm.model_modes import evaluating
from rlalign.lm.models import load_tokenizer, resolve_model_path
from rlalign.lm.rollout import Rollout
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.async_source import check_one_process, open_source
from rlalign.train.common import autocast_context, forward_precision
from rlalign.train.memory_plan import Pass, plan_rows
from rlalign.train.objectives import sampler_weights
from rlalign.train.loop import RLResult, SavedModels, TrainState, UpdateMeans, add_run_arguments, print_summary, resume_state, run_steps, start_rl_run, step_timings
from rlalign.train.passes import completion_logits, completion_logprobs, logprobs_and_entropy, micro_batches, reference_logprobs
from rlalign.train.rl_config import RewardConfig, RLConfig
from rlalign.train.rollouts import RewardTerm, completion_stats, sample_rows, scored_stats
from rlalign.train.sources import MixedSource, OfflineSource, RolloutSource, make_source
from rlalign.train.updater import Updater, minibatch_step

__all__ = ["DistillConfig", "check_teacher_tokenizer", "distill_loss", "distill_step", "train", "add_arguments", "run"]

# RLConfig fields distillation has no use for (no reference, no reward-driven sampling, no clipped policy objective):
# they must keep their defaults, so that a setting is never silently ignored
UNUSED_FIELDS = ("reference", "dynamic_sampling", "max_sampling_rounds", "loss_type", "dual_clip", "cispo_eps_low", "cispo_eps_high",
                 "sapo_temperature_pos", "sapo_temperature_neg", "agent")  # agent: its rows' episode weights are GRPO's and PPO's


class DistillConfig(RLConfig):
    """``rlalign distill``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/distill", description="run directory: metrics.jsonl, samples.jsonl, checkpoints/, final/, curves.png")
    teacher: str | None = Field(
        None, description="the frozen teacher: a checkpoint directory or Hub id, whose tokenizer must be the student's (model.path); required"
    )
    objective: Literal["reverse_kl", "gkd"] = Field(
        "reverse_kl", description="reverse_kl: -sg(A_t) log pi_s(y_t) with A_t = log pi_t(y_t) - log pi_s(y_t) on the student's samples "
        "(on-policy distillation, a sampled token per position); gkd: the generalised JSD over the whole vocabulary (GKD)"
    )
    beta: float = Field(
        0.5, ge=0, le=1, description="gkd: JSD interpolation, M = beta pi_t + (1 - beta) pi_s; 0 = forward KL(teacher || student), "
        "1 = reverse KL(student || teacher) (TRL's convention)"
    )
    lmbda: float = Field(
        1.0, ge=0, le=1, description="gkd: share of the steps trained on the student's samples (GKD's lambda; TRL's default 0.5); the other "
        "steps train on the data's completions (a 'completion' or 'chosen' column; an embedded task: its SFT completions)"
    )

    @model_validator(mode="after")
    def _distillation_fields(self) -> DistillConfig:
        if self.objective == "reverse_kl" and self.lmbda < 1:
            raise ValueError("lmbda < 1 trains on the data's completions, where the reverse-KL policy gradient (on the student's own samples) "
                             "does not hold: set objective: gkd, or lmbda: 1")
        if self.objective == "reverse_kl" and self.beta != 0.5:
            raise ValueError("beta is gkd's JSD interpolation: set objective: gkd (objective reverse_kl has no beta)")
        unused = [name for name in UNUSED_FIELDS if getattr(self, name) != type(self).model_fields[name].default]
        if unused:
            raise ValueError(f"{', '.join(unused)}: not used by distillation (the teacher replaces the reference and the rewards); leave at the default")
        if self.prompts_per_step % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide prompts_per_step={self.prompts_per_step}")
        return self


def check_teacher_tokenizer(student, teacher, teacher_path: str) -> None:
    """The teacher grades the student's token ids, so both must mean the same text by them.

    Raises:
        ConfigError: when the vocabularies (token -> id) or the EOS ids differ, naming a token that differs.
    """
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differing = sorted(tok for tok in s_vocab.keys() | t_vocab.keys() if s_vocab.get(tok) != t_vocab.get(tok))
        tok = differing[0]
        raise ConfigError(
            f"the teacher {teacher_path} has another tokenizer than the student: {len(differing)} tokens differ (e.g. {tok!r} is id "
            f"{s_vocab.get(tok)} in the student's and {t_vocab.get(tok)} in the teacher's; vocabularies {len(s_vocab)} and {len(t_vocab)}). "
            "Distillation compares their distributions token by token: use a teacher of the student's family (same tokenizer)"
        )
    if student.eos_token_id != teacher.eos_token_id:
        raise ConfigError(f"the teacher {teacher_path} ends completions with token {teacher.eos_token_id}, the student with {student.eos_token_id}: "
                          "they must share EOS")


# ----------------------------------------------------------------------------------------------
# The loss and the step
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_logits(teacher: nn.Module, rollout: Rollout, autocast: str = "none", compiled: bool = False) -> Tensor:
    """The frozen teacher's logits at the rollout's completion positions (gkd). Shape: (B, C, V_t)."""
    with evaluating(teacher), distributed.gathered(teacher), autocast_context(autocast, teacher):
        return completion_logits(teacher, rollout, compiled)


def chunked_heads(policy: nn.Module, teacher: nn.Module, rollout: Rollout, cfg: DistillConfig) -> tuple[nn.Linear, nn.Linear] | None:
    """(student head, teacher head) when gkd should read both models' hidden states in chunks: both
    heads allow it (:func:`rlalign.lm.logprobs.lm_head_of`), the forward is not compiled, and the
    larger float32 logits pass ``model.logits_limit_mb``; else None."""
    heads = lm_head_of(policy), lm_head_of(teacher)
    if heads[0] is None or heads[1] is None or cfg.compile:
        return None
    logits_mb = rollout.completion_ids.numel() * max(h.out_features for h in heads) * 4 / 2**20
    return heads if logits_mb > cfg.model.logits_limit_mb else None


def _gkd_from_hidden(policy: nn.Module, teacher: nn.Module, rollout: Rollout, mask: Tensor, cfg: DistillConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`distill_loss`'s gkd from the two models' hidden states and heads in chunks (rlalign.core.distillation.head_divergences)."""
    student_head, teacher_head = chunked_heads(policy, teacher, rollout, cfg)
    r = rollout.to(student_head.weight.device)
    with evaluating(teacher), autocast_context(cfg.model.autocast, teacher), torch.no_grad():
        teacher_hidden = completion_hidden(teacher, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.group_index)  # (B, C, H_t)
    with forward_precision(cfg.model, policy):
        hidden = completion_hidden(policy, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.group_index)  # (B, C, H)
        per_position, reverse = head_divergences(hidden, student_head, teacher_hidden.to(hidden.device), teacher_head, cfg.beta, cfg.sampling.temperature)
        with torch.no_grad():
            _, entropy = linear_token_logprobs(hidden, student_head.weight, r.completion_ids, cfg.sampling.temperature, student_head.bias, "statistic")
    mask = mask.to(per_position.device)
    loss, js = jsd_loss(per_position, reverse, mask, cfg.aggregation, cfg.sampling.max_new_tokens)
    stats = {"jsd": js.jsd, "kl/reverse": js.reverse_kl, "loss/distill": loss.detach(), "entropy": (entropy * mask).sum() / mask.sum().clamp(min=1.0)}
    return loss, stats


def distill_loss(
    policy: nn.Module, teacher: nn.Module, rollout: Rollout, mask: Tensor, teacher_logp: Tensor | None, cfg: DistillConfig, on_policy: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation loss of one micro-batch: reverse_kl on ``teacher_logp``, or gkd on the teacher's logits.

    Args:
        rollout: the rows; ``rollout.logprobs`` are the sampler's (for the importance weights). Shapes: (B, C).
        mask: 1 on tokens that count. Shape: (B, C).
        teacher_logp: log pi_t(y_t) (reverse_kl), None for gkd. Shape: (B, C).
        on_policy: the rows are the student's samples (tis_cap weights them), not the data's.
    Returns:
        (loss, stats): detached loss/distill, kl/reverse, jsd or adv/min and adv/max, entropy, tis/*.
    """
    temperature, logits = cfg.sampling.temperature, None
    if cfg.objective == "gkd" and chunked_heads(policy, teacher, rollout, cfg) is not None:  # both heads in chunks, no logits
        return _gkd_from_hidden(policy, teacher, rollout, mask, cfg)
    with forward_precision(cfg.model, policy):
        if cfg.objective == "reverse_kl":  # the sampled tokens' log-probs: no (B, C, V) logits needed
            logp, entropy = completion_logprobs(policy, rollout, temperature, "statistic", cfg.compile, cfg.model.logits_limit_mb)  # (B, C) each, float32
        else:  # the full distributions, for the JSD over the vocabulary
            logits = completion_logits(policy, rollout, cfg.compile)  # (B, C, V)
    if logits is not None:
        logp, entropy = logprobs_and_entropy(logits, rollout.completion_ids.to(logits.device), temperature, False)  # (B, C) each, float32
    device = logp.device
    mask = mask.to(device)
    max_len = cfg.sampling.max_new_tokens  # the fixed L of seq-mean-token-sum-norm
    stats: dict[str, Tensor] = {}
    if cfg.objective == "reverse_kl":
        weights = None
        if on_policy:  # tis_*: the samples' policy (older, or lower-precision) against the student's own, pi_s / pi_sampler
            weights, tis = sampler_weights(cfg, logp.detach(), rollout.logprobs.to(device), mask)
            stats.update(tis)
        loss, rk = reverse_kl_loss(logp, teacher_logp.to(device), mask, cfg.aggregation, max_len, weights)
        stats.update({"kl/reverse": rk.reverse_kl, "adv/min": rk.advantage_min, "adv/max": rk.advantage_max})
    else:
        t_logits = teacher_logits(teacher, rollout, cfg.model.autocast, cfg.compile).to(device)  # (B, C, V_t)
        vocab = min(logits.shape[-1], t_logits.shape[-1])  # outputs past a padded vocabulary left out
        loss, js = generalized_jsd_loss(logits[..., :vocab], t_logits[..., :vocab], mask, cfg.beta, temperature, cfg.aggregation, max_len)
        stats.update({"jsd": js.jsd, "kl/reverse": js.reverse_kl})
    stats["loss/distill"] = loss.detach()
    stats["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, stats


def distill_step(updater: Updater, teacher: nn.Module, source: RolloutSource, state: TrainState, cfg: DistillConfig) -> tuple[dict[str, float], list[dict]]:
    """One distillation step (0-based ``state.step``): the next batch (the student's samples or the data's
    completions), the teacher's log-probs (reverse_kl), the minibatch updates, the new weights published.

    Returns:
        (metrics, a few samples).
    """
    world = state.world
    # 1. the step's batch: the student's samples (scored by the reward terms, when there are any), or the data's completions
    t0 = time.perf_counter()
    batch = source.next(state)
    rollout = batch.rollout
    on_policy = batch.metrics.get("on_policy", 1.0) == 1.0
    t2 = time.perf_counter()

    # 2. the teacher's log-probs of the batch's tokens (reverse_kl; gkd runs the teacher in each micro-batch, for its logits)
    mask = rollout.completion_mask.float() * batch.token_mask  # (B, C) tool tokens get no gradient
    m = cfg.num_minibatches
    minibatches = distributed.minibatch_rows(rollout.batch_size, m, world)  # rows k, k + m, ... of all ranks' rows, as one process cuts them
    teacher_logp = None
    gkd = cfg.objective == "gkd"  # the teacher in each micro-batch, both models' full-vocabulary logits; reverse_kl: the teacher in a no-grad pass
    passes = [Pass(updater.module, updater.optimizer, runner=updater.model, head_copies=9.0 if gkd else 3.0), Pass(teacher, None, group=0 if gkd else None)]
    rows = plan_rows(passes, rollout, cfg.micro_batch_size, -(-rollout.batch_size // m), cfg.model, world, updater.row_costs, cfg.compile)
    if cfg.objective == "reverse_kl":
        teacher_logp = reference_logprobs(updater.model, teacher, rollout, cfg.sampling.temperature, rows.no_grad, cfg.model.autocast, cfg.compile,
                                          cfg.model.logits_limit_mb)  # (B, C)
    t_ref = time.perf_counter()

    # 3. one pass of minibatch updates, each one's gradient accumulated over micro-batches
    updates = UpdateMeans()
    for mb in minibatches:
        def loss_of(micro: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            return distill_loss(updater.model, teacher, rollout.select(micro), mask[micro], None if teacher_logp is None else teacher_logp[micro], cfg, on_policy)

        micro_rows = micro_batches(torch.arange(rollout.batch_size)[mb], rows.update)
        stats, grad_norm = minibatch_step(updater, loss_of, micro_rows, mask, cfg.aggregation, world)
        updates.add({**stats, "grad_norm": grad_norm})
    sync_s = source.publish(updater.module, state.step + 1)  # the student after this step's updates
    t3 = time.perf_counter()

    metrics = updates.means()
    metrics.update(rows.metrics())
    metrics.update(batch.metrics)
    metrics["on_policy"] = float(on_policy)
    if on_policy:  # the reward terms judge the student's samples, not the data's completions
        metrics.update(scored_stats(batch.scored))
    metrics.update(completion_stats(rollout, world))
    metrics["lr"] = updater.lr
    metrics.update(step_timings(batch.generate_s, batch.score_s, t0, t2, t3, metrics["tokens"], t_ref, t_ref, sync_s))
    return metrics, sample_rows(state.step, batch.scored, cfg.num_samples_logged)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def open_distill_source(cfg: DistillConfig, run, updater: Updater, state: TrainState, prompts: Sequence[dict] | None, tools) -> RolloutSource:
    """The student's rollout source (:func:`rlalign.train.sources.make_source`), mixed with the data's completions
    when lmbda < 1 (an embedded task's SFT completions, else the prompt records' own), run asynchronously when asked."""
    if cfg.lmbda < 1:
        task = cfg.data.task is not None and prompts is None
        examples = load_prompts(TASKS[cfg.data.task].sft_records("train", cfg.data.num_prompts, cfg.data.seed)) if task else run.prompts

    def build(world):
        inner = make_source(cfg, updater, run.tokenizer, run.rewards, run.prompts, world, tools, state.data_position)
        if cfg.lmbda < 1:
            inner = MixedSource(inner, OfflineSource(examples, run.tokenizer, cfg.prompts_per_step, cfg.seed, cfg.sampling.max_new_tokens, world), cfg.lmbda, cfg.seed)
        return inner

    return open_source(cfg, run, updater, state, tools, build=build)


def train(
    cfg: DistillConfig, resume: str | Path | None = None, reward_functions: Sequence[RewardTerm] = (), prompts: Sequence[dict] | None = None,
    tools: Mapping[str, Callable[[str], object]] | None = None,
) -> RLResult:
    """Distil ``cfg.teacher`` into the student ``cfg.model``, or continue the run of checkpoint ``resume``.

    Args:
        reward_functions: Python reward terms to score (and log) the student's samples by, next to ``cfg.rewards``;
            an embedded task without any gets its own reward.
        prompts: prompt records (``{"prompt": ..., "completion"?: ...}``) to use instead of ``cfg.data``.
        tools: Python functions of one string to register as tools (multi-turn rollouts, ``cfg.tools``).
    """
    if cfg.teacher is None:
        raise ConfigError("distillation needs a teacher: set teacher to a checkpoint directory or Hub id")
    if tools and cfg.tools is None:
        raise ConfigError("tools were given but cfg.tools is null: set tools (e.g. tools.max_turns=3) to use them")
    if not cfg.rewards and not reward_functions and cfg.data.task is not None and prompts is None:
        cfg = cfg.model_copy(update={"rewards": [RewardConfig(function=cfg.data.task)]})  # the task's own score, logged
    run = start_rl_run(cfg, resume, prompts, reward_functions, cfg.prompts_per_step, cfg.num_minibatches, rewards_required=False)
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        check_one_process(cfg, run.world)
        teacher_path = resolve_model_path(cfg.teacher)
        check_teacher_tokenizer(run.tokenizer, load_tokenizer(teacher_path), cfg.teacher)
        policy = run.load_policy(cfg.model)
        teacher = run.load_reference(cfg.model, str(teacher_path))
        updater = Updater.create(policy, cfg.optim, cfg.steps * cfg.num_minibatches, run.world, cfg.model.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy)
        state = resume_state(run.checkpoint, cfg.seed, {"policy": updater}, run.world)
        source = open_distill_source(cfg, run, updater, state, prompts, tools)

        def step(state: TrainState) -> tuple[dict[str, float], list[dict]]:
            return distill_step(updater, teacher, source, state, cfg)

        history, final_dir = run_steps(
            step, cfg, run, state, SavedModels(policy), {"policy": updater}, checkpoint_extra=source.state_dict, source=source,
            evaluate=run.evaluator(cfg, updater.module) if run.rewards else None, eval_every=cfg.eval.every,
            total_steps=cfg.steps, batch_size=cfg.prompts_per_step, sample_every=cfg.sample_every,
            summary_keys=("kl/reverse", "reward/mean", "completion_len/mean"),
            plot_keys=("kl/reverse", "jsd", "reward/mean", "eval/reward/mean", "entropy", "completion_len/mean") if cfg.plots else (),
        )
        return RLResult(policy, history, run.run_dir, final_dir)


# ----------------------------------------------------------------------------------------------
# CLI: rlalign distill --config configs/distill_arithmetic.yaml teacher=runs/grpo_arithmetic/final [--resume DIR]
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "configs/distill_arithmetic.yaml", "teacher=runs/grpo_arithmetic/final steps=50", DistillConfig)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(DistillConfig, args.config, args.overrides)
    print_summary(train(cfg, resume=args.resume).summary(("kl/reverse", "reward/mean", "completion_len/mean")))
    return 0
