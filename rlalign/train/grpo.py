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

    from rlalign.config import load_config
    from rlalign.train import grpo
    cfg = load_config(grpo.GRPOConfig, "configs/grpo_arithmetic.yaml", ["steps=20"])
    result = grpo.train(cfg)                     # result.history: one metrics dict per step

The pieces marked "shared" are imported by :mod:`rlalign.train.ppo`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from rlalign.config import Config, ConfigError, load_config
from rlalign.core.advantages import group_advantages, rloo_advantages
from rlalign.core.logprobs import token_logprobs, token_logprobs_and_entropy
from rlalign.core.losses import AGGREGATION_MODES, clipped_surrogate_loss, kl_penalty_loss
from rlalign.core.masks import masked_mean
from rlalign.lm.code_execution import code_execution
from rlalign.lm.data import PromptExample, encode_prompts, load_prompts, render_prompt
from rlalign.lm.logprobs import completion_logits as lm_completion_logits
from rlalign.lm.models import (
    attention_kernel,
    can_pack_linear,
    cast_copy,
    copy_weights,
    hold_matmul_weights,
    load_policy,
    load_reference,
    load_reward_model,
    load_tokenizer,
    pack_linear_layers,
    reference_policy,
    releasing_compiler_caches,
    repack_linear_layers,
)
from rlalign.lm.rewards import RewardModelReward, exact_match, format_check, math_answer, score_completions
from rlalign.lm.rollout import Rollout
from rlalign.lm.sampling import SamplingParams, sample
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.common import (
    Checkpoint,
    MetricsLogger,
    Run,
    forward_precision,
    ModelConfig,
    OptimConfig,
    batch_order,
    load_checkpoint,
    make_optimizer,
    plot_metrics,
    restore_rng_state,
    save_checkpoint,
    start_run,
)

__all__ = [
    "DataConfig",
    "RewardConfig",
    "SamplingConfig",
    "RLOptimConfig",
    "GRPOConfig",
    "GRPOResult",
    "RewardTerm",
    "Updater",
    "ADVANTAGE_ESTIMATORS",
    "load_prompt_set",
    "prompt_batch",
    "build_rewards",
    "score_rollout",
    "completion_logits",
    "compiled_completion_logits",
    "share_prompts",
    "COMPILE_HELP",
    "check_compile",
    "reference_logprobs",
    "loss_mask",
    "ratio_deviation",
    "logprob_mismatch",
    "grpo_loss",
    "grpo_step",
    "RunSetup",
    "setup_run",
    "run_steps",
    "sample_shard",
    "sampler_differs",
    "check_world",
    "train",
    "add_arguments",
    "run",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
if set(Aggregation.__args__) != set(AGGREGATION_MODES):  # keep the Literal in step with core
    raise ImportError(f"grpo.Aggregation {Aggregation.__args__} is out of date with core AGGREGATION_MODES {AGGREGATION_MODES}")


# ----------------------------------------------------------------------------------------------
# Config (DataConfig, RewardConfig, SamplingConfig are shared with ppo.py)
# ----------------------------------------------------------------------------------------------


class DataConfig(Config):
    """Where the training prompts come from: an embedded task or a file (exactly one)."""

    task: Literal["arithmetic", "preference"] | None = Field(None, description="embedded offline task (rlalign.tasks) giving the prompts")
    path: str | None = Field(None, description="JSONL / JSON / Parquet of prompt records (a 'prompt' column; other columns kept, e.g. 'answer')")
    num_prompts: int = Field(1024, ge=1, description="training prompts drawn from an embedded task")
    seed: int = Field(0, description="seed of the embedded task's prompt draw")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError(f"set exactly one of data.task or data.path (got task={self.task!r}, path={self.path!r})")
        return self


BUILTIN_REWARDS = ("arithmetic", "preference", "exact_match", "math_answer", "format", "code_execution")


class RewardConfig(Config):
    """One weighted term of the reward: a reward function or a reward model (exactly one)."""

    function: str | None = Field(
        None,
        description="arithmetic | preference (the task's reward) | exact_match | math_answer (vs the prompts' 'answer' column, "
        "math_answer through math-verify) | format (regex 'pattern') | code_execution (runs the completion's code with the prompts' "
        "'tests' column in a sandbox: time, memory and network limits) | 'package.module:function' taking (prompts, completions)",
    )
    reward_model: str | None = Field(None, description="reward-model checkpoint (backbone + value_head.safetensors); its score is the reward")
    pattern: str | None = Field(None, description="regular expression the whole completion must match (function: format)")
    weight: float = Field(1.0, description="coefficient of this term in the total reward")
    name: str | None = Field(None, description="metric name, reward/<name>/mean; defaults to the function name or 'rm'")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if (self.function is None) == (self.reward_model is None):
            raise ValueError(f"set exactly one of function or reward_model (got function={self.function!r}, reward_model={self.reward_model!r})")
        if self.function is not None and ":" not in self.function and self.function not in BUILTIN_REWARDS:
            raise ValueError(f"function {self.function!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'package.module:function'")
        if (self.function == "format") != (self.pattern is not None):
            raise ValueError("'pattern' goes with function: format, and format needs a pattern")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return "rm" if self.reward_model else str(self.function).split(":")[-1]


class SamplingConfig(Config):
    """How completions are drawn during training."""

    max_new_tokens: int = Field(32, ge=1, description="completion length cap; a completion without EOS by then is 'truncated'")
    temperature: float = Field(1.0, gt=0, description="softmax temperature (> 0: RL needs a stochastic policy); training log-probs use the same")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1 = off)")
    attn_implementation: str | None = Field(
        None, description="attention kernel for the decode loop only (null = model.attn_implementation); e.g. sdpa with eager for training on CPU"
    )
    dtype: Literal["bfloat16", "float16"] | None = Field(
        None,
        description="run the decode loop on a copy of the policy held in this dtype, refreshed after each update "
        "(half a policy of memory more; null = sample from the policy itself, under model.autocast if set)",
    )
    compile: bool = Field(
        False,
        description="torch.compile the decode step and the draw (static shapes; one compile per batch size and cache-length bucket, "
        "paid in the first steps; at most 64 versions per process, then eager with a warning); speed in benchmarks/RESULTS.md. "
        "Not under model.autocast without sampling.dtype, nor with model.sharding fsdp",
    )
    pack_weights: bool = Field(
        True,
        description="with sampling.dtype on a CPU, hold the copy's linear weights in oneDNN's blocked layout (the same values, "
        "read faster by the decode loop, for one more copy of those weights; figures in benchmarks/RESULTS.md)",
    )

    def params(self) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_k, self.top_p)

    @property
    def packed_copy(self) -> bool:
        """Whether the copy in ``dtype`` gets packed linear weights (``pack_weights``)."""
        return self.dtype is not None and self.pack_weights


class RLOptimConfig(OptimConfig):
    """:class:`rlalign.train.common.OptimConfig` with RL defaults: a small, constant learning rate."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(1.0, ge=0, le=1, description="final learning rate as a fraction of lr (cosine decay); 1 = constant")


COMPILE_HELP = (
    "torch.compile the policy's training forward and backward, the pi_old recompute and the reference pass (dynamic shapes; compiled during "
    "the first step; the decode loop has sampling.compile). "
    "The compile time pays back only over a long run; figures in benchmarks/RESULTS.md. The compiled passes run every row's prompt (no shared prompts)"
)


def check_compile(compile: bool, model: ModelConfig, sampling: SamplingConfig) -> None:
    """torch 2.13's inductor fails on transformers' eager attention with dynamic shapes (ValueRangeError
    in its symbolic shapes, seen on Llama); SDPA compiles. The compiled decode step needs a StaticCache,
    which autocast rules out (keys and values reach the cache in different dtypes), and whole weights."""
    if compile and model.attn_implementation == "eager":
        raise ValueError("compile=true needs model.attn_implementation sdpa (or null): the eager attention does not compile with dynamic shapes")
    if sampling.compile and model.autocast != "none" and sampling.dtype is None:
        raise ValueError("sampling.compile=true does not work under model.autocast: also set sampling.dtype (e.g. bfloat16) to sample from a low-precision copy")
    if sampling.compile and model.sharding == "fsdp":
        raise ValueError("sampling.compile=true needs whole weights on every rank; with model.sharding=fsdp leave it false")


class GRPOConfig(Config):
    """``rlalign grpo``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/grpo", description="run directory: metrics.jsonl, samples.jsonl, checkpoints/, final/, curves.png")
    seed: int = Field(0, description="seeds Python, NumPy, torch, the prompt order and the sampling generator")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (null = torch's default)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy's starting checkpoint (e.g. an SFT run's final/), dtype, device, LoRA")
    reference: str | None = Field(None, description="frozen reference checkpoint for the KL term; null = the policy's start (LoRA: the base with adapters off)")
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="arithmetic"), description="training prompts")
    rewards: list[RewardConfig] = Field(default_factory=list, description="reward terms, summed with their weights (train() also takes Python reward functions)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling during training")
    optim: RLOptimConfig = Field(default_factory=RLOptimConfig, description="AdamW, schedule and gradient clipping")
    steps: int = Field(100, ge=1, description="RL steps (one rollout each)")
    prompts_per_step: int = Field(8, ge=1, description="prompts per rollout; the rollout has prompts_per_step * group_size completions")
    group_size: int = Field(8, ge=2, description="G completions per prompt; at least 2, a group's mean and std need two samples")
    mu: int = Field(1, ge=1, description="policy passes over each rollout (GRPO's mu); pi_old is the sampling policy for all of them")
    num_minibatches: int = Field(1, ge=1, description="optimiser steps per pass; the rollout is cut into this many row slices")
    advantage: Literal["group", "batch", "none", "rloo"] = Field(
        "group", description="group: (R - mean_g) / std_g (DeepSeekMath); batch: / std of the batch; none: R - mean_g (Dr.GRPO); rloo: leave-one-out"
    )
    eps_low: float = Field(0.2, gt=0, lt=1, description="clip the ratio below at 1 - eps_low")
    eps_high: float = Field(0.2, gt=0, description="clip the ratio above at 1 + eps_high (DAPO's clip-higher: 0.28)")
    beta: float = Field(0.04, ge=0, description="coefficient of the k3 KL to the reference in the loss; 0 loads no reference")
    aggregation: Aggregation = Field("seq-mean-token-mean", description=f"token-loss reduction, one of {', '.join(AGGREGATION_MODES)}")
    mask_truncated: bool = Field(False, description="leave completions that hit max_new_tokens without EOS out of the loss (DAPO overlong filtering)")
    sample_every: int = Field(10, ge=1, description="log a few completions with their rewards every N steps (samples.jsonl)")
    num_samples_logged: int = Field(4, ge=0, description="completions logged each time")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    keep_last: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    progress: bool = Field(True, description="show a progress bar with reward and KL")
    tensorboard: bool = Field(False, description="also write TensorBoard scalars when tensorboard is installed")
    plots: bool = Field(True, description="write curves.png (reward, KL, entropy, length, clip fraction) at the end")
    compile: bool = Field(False, description=COMPILE_HELP)

    @model_validator(mode="after")
    def _compile_needs_sdpa(self) -> GRPOConfig:
        check_compile(self.compile, self.model, self.sampling)
        return self

    @model_validator(mode="after")
    def _minibatches_divide(self) -> GRPOConfig:
        batch = self.prompts_per_step * self.group_size
        if batch % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide prompts_per_step * group_size = {batch}")
        return self


# ----------------------------------------------------------------------------------------------
# Prompts (shared)
# ----------------------------------------------------------------------------------------------


def load_prompt_set(data: DataConfig, records: Sequence[dict] | None = None) -> list[PromptExample]:
    """Validated prompt examples from ``records`` when given, else the embedded task or the file."""
    if records is not None:
        return load_prompts(list(records))
    if data.task is not None:
        return load_prompts(TASKS[data.task].prompt_records("train", data.num_prompts, data.seed))
    return load_prompts(data.path)


def prompt_batch(prompts: Sequence[PromptExample], step: int, batch_size: int, seed: int) -> list[PromptExample]:
    """The prompts of RL step ``step`` (0-based): data positions [step * n, (step + 1) * n) of a
    per-epoch permutation, so a resumed run draws exactly the prompts of the uninterrupted one."""
    return [prompts[i] for i in batch_order(len(prompts), step * batch_size, batch_size, seed)]


# ----------------------------------------------------------------------------------------------
# Rewards (shared)
# ----------------------------------------------------------------------------------------------


@dataclass
class RewardTerm:
    """One weighted reward term, ``fn(prompts, completions) -> list[float]`` (rlalign.lm.rewards protocol)."""

    name: str
    weight: float
    fn: Callable[[list[str], list[str]], Sequence[float]]


def _references(prompts: Sequence[PromptExample], tokenizer, function: str, column: str = "answer") -> dict[str, str]:
    missing = [i for i, ex in enumerate(prompts) if column not in ex.metadata]
    if missing:
        raise ConfigError(f"reward function {function!r} needs a {column!r} column in the prompts; prompt record {missing[0]} has none")
    return {render_prompt(tokenizer, ex.prompt): str(ex.metadata[column]) for ex in prompts}


def _reward_function(spec: RewardConfig, prompts: Sequence[PromptExample], tokenizer) -> Callable[[list[str], list[str]], Sequence[float]]:
    name = spec.function
    if name in TASKS:
        return TASKS[name].reward
    if name == "exact_match":
        return exact_match(_references(prompts, tokenizer, name))
    if name == "math_answer":
        return math_answer(_references(prompts, tokenizer, name))
    if name == "format":
        return format_check(spec.pattern)
    if name == "code_execution":
        return code_execution(_references(prompts, tokenizer, name, column="tests"))
    module_name, attr = name.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward function {name!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"reward function {name!r} is not callable")
    return fn


def _reward_model(spec: RewardConfig, model_cfg: ModelConfig, tokenizer, world: distributed.World) -> RewardModelReward:
    model = load_reward_model(spec.reward_model, model_cfg.dtype, world.device(model_cfg.device), attn_implementation=model_cfg.attn_implementation)
    model = distributed.shard_frozen(model, world, model_cfg.sharding)
    try:
        rm_tokenizer = load_tokenizer(spec.reward_model)
    except (OSError, ValueError):  # a reward model saved without its tokenizer shares the policy's
        rm_tokenizer = tokenizer
    return RewardModelReward(model, rm_tokenizer)


def build_rewards(
    specs: Sequence[RewardConfig],
    prompts: Sequence[PromptExample],
    tokenizer,
    model_cfg: ModelConfig,
    extra: Sequence[RewardTerm] = (),
    world: distributed.World = distributed.World(),
) -> list[RewardTerm]:
    """Reward terms of the config (functions resolved, reward models loaded frozen) plus ``extra``."""
    terms = [
        RewardTerm(spec.label, spec.weight, _reward_model(spec, model_cfg, tokenizer, world) if spec.reward_model else _reward_function(spec, prompts, tokenizer))
        for spec in specs
    ]
    terms.extend(extra)
    if not terms:
        raise ConfigError("no reward: add at least one term under 'rewards' (a function or a reward_model)")
    names = [t.name for t in terms]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward names must be unique (set 'name' on a reward term), got {names}")
    return terms


def score_rollout(terms: Sequence[RewardTerm], prompts: list[str], completions: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
    """Total reward sum_k w_k R_k per completion (B,) and each term's unweighted values.

    Every call goes through :func:`rlalign.lm.rewards.score_completions`, so a function that
    raises or returns NaN is an error naming it and the prompt.
    """
    per_term = {t.name: score_completions([t.fn], prompts, completions) for t in terms}  # name -> (B,)
    total = torch.zeros(len(prompts))
    for t in terms:
        total = total + t.weight * per_term[t.name]
    return total, per_term


# ----------------------------------------------------------------------------------------------
# Log-probs, masks and statistics (shared)
# ----------------------------------------------------------------------------------------------


def completion_logits(model: nn.Module, rollout: Rollout, compiled: bool = False) -> Tensor:
    """:func:`rlalign.lm.logprobs.completion_logits` of a rollout (the trainer needs the logits
    themselves for the entropy), on the model's device, each group's prompt run once when
    :func:`share_prompts`; ``compiled``: through :func:`compiled_completion_logits` (one forward). Shape: (B, C, V)."""
    device = next(model.parameters()).device
    r = rollout.to(device)
    if compiled:
        with releasing_compiler_caches():
            return compiled_completion_logits()(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    return lm_completion_logits(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.group_index if share_prompts() else None)


def share_prompts() -> bool:
    """Whether the training and reference passes run each group's prompt once (rlalign.lm.logprobs):
    in one process. Under torchrun they make one forward per pass, since DDP and FSDP2 expect one
    forward per backward; the logits are the same to float round-off either way."""
    return not torch.distributed.is_initialized()


@functools.cache
def compiled_completion_logits() -> Callable[..., Tensor]:
    """:func:`rlalign.lm.logprobs.completion_logits` under ``torch.compile`` with dynamic shapes, so
    one compilation serves every (B, P, C) of a run (the ``compile`` option of GRPO and PPO: the
    training forward and its backward, the pi_old recompute and the reference pass; with and
    without grad are separate graphs, and a model of another structure or dtype compiles another;
    the decode loop is ``sampling.compile``). The compiled forward runs every row's prompt (no
    shared prompts), which for long prompts and large G can cost more than it saves."""
    return torch.compile(lm_completion_logits, dynamic=True)


def rollout_token_logprobs(model: nn.Module, rollout: Rollout, temperature: float, compiled: bool = False) -> Tensor:
    """log pi(y_t | x, y_<t) of a rollout's completion tokens by :func:`completion_logits` (compiled
    or not), 0 on padding; float32, on the CPU. Shape: (B, C)."""
    logits = completion_logits(model, rollout, compiled)  # (B, C, V)
    completion_ids, completion_mask = rollout.completion_ids.to(logits.device), rollout.completion_mask.to(logits.device)
    return token_logprobs(logits, completion_ids, temperature).masked_fill(completion_mask == 0, 0.0).float().cpu()


@torch.no_grad()
def reference_logprobs(
    policy: nn.Module,
    reference: nn.Module | None,
    rollout: Rollout,
    temperature: float,
    batch_size: int,
    model_cfg: ModelConfig | None = None,
    compiled: bool = False,
) -> Tensor:
    """Completion log-probs under the frozen reference (or the LoRA base, adapters off), by the same
    forward as the updates (compiled when they are). Shape: (B, C)."""
    with reference_policy(policy, reference) as ref, distributed.gathered(ref), forward_precision(model_cfg or ModelConfig(), ref):
        return torch.cat([rollout_token_logprobs(ref, mb, temperature, compiled) for mb in rollout.minibatches(batch_size)])


@torch.no_grad()
def training_logprobs(
    policy: nn.Module, rollout: Rollout, temperature: float, minibatches: Sequence[Tensor | slice], model_cfg: ModelConfig, compiled: bool = False
) -> Tensor:
    """log pi_old recomputed by the training forward (:func:`completion_logits`, compiled or not as
    the updates are), on the same minibatches (same shapes, so the same kernels) as the updates that
    follow: with autocast the sampler's numerics differ. Shape: (B, C)."""
    logprobs = torch.zeros_like(rollout.logprobs)  # (B, C)
    for rows in minibatches:
        with forward_precision(model_cfg, policy):
            logprobs[rows] = rollout_token_logprobs(policy, rollout.select(rows), temperature, compiled)
    return logprobs


def sampler_differs(cfg: GRPOConfig) -> bool:
    """Whether the sampler's log-probs may differ from the training forward's by more than float32
    round-off (bfloat16 autocast, or a low-precision sampling copy): then log pi_old is recomputed."""
    return cfg.model.autocast != "none" or cfg.sampling.dtype is not None


def loss_mask(rollout: Rollout, mask_truncated: bool) -> Tensor:
    """1 on completion tokens that count in the loss; rows without EOS zeroed when ``mask_truncated``. Shape: (B, C)."""
    mask = rollout.completion_mask.float()  # (B, C)
    if mask_truncated:
        mask = mask * (~rollout.truncated).float()[:, None]
    return mask


def logprob_mismatch(logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> Tensor:
    """max |training log-prob - sampler log-prob| over counted tokens (detached); 0 for no tokens."""
    with torch.no_grad():
        gap = (logp - sampler_logp).abs() * mask  # (B, C)
        return gap.max() if gap.numel() else gap.new_zeros(())


def ratio_deviation(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """max |pi / pi_old - 1| over counted tokens (detached). On the first minibatch, before any
    update, it is the mismatch between the sampler's log-probs and the training pass's."""
    with torch.no_grad():
        deviation = (torch.exp(logp - old_logp) - 1.0).abs() * mask  # (B, C)
        return deviation.max() if deviation.numel() else deviation.new_zeros(())


def completion_stats(rollout: Rollout, world: distributed.World = distributed.World()) -> dict[str, float]:
    """completion_len/mean, completion_len/max, completion_len/clipped_frac (share without EOS), over every rank's rows."""
    lengths = distributed.gather_rows(rollout.completion_lengths().float(), world)  # (B global,)
    truncated = distributed.gather_rows(rollout.truncated.float(), world)  # (B global,)
    return {
        "completion_len/mean": lengths.mean().item(),
        "completion_len/max": lengths.max().item(),
        "completion_len/clipped_frac": truncated.mean().item(),
        "tokens": lengths.sum().item(),
    }


def step_timings(t0: float, t1: float, t2: float, t3: float, tokens: float, t_ref: float, t_old: float) -> dict[str, float]:
    """time/generate (t0..t1), time/score (t1..t2), time/train (t2..t3: all of the rest), and inside it
    time/reference (t2..t_ref: advantages and the reference pass), time/old_logp (t_ref..t_old: the
    pi_old recompute, 0 when none) and time/update (t_old..t3); tokens_per_s is completion tokens over t0..t3."""
    return {
        "time/generate": t1 - t0,
        "time/score": t2 - t1,
        "time/train": t3 - t2,
        "time/reference": t_ref - t2,
        "time/old_logp": t_old - t_ref,
        "time/update": t3 - t_old,
        "tokens_per_s": tokens / max(t3 - t0, 1e-9),
    }


def reward_stats(total: Tensor, per_term: dict[str, Tensor]) -> dict[str, float]:
    """reward/mean, reward/std and reward/<name>/mean|std of each term."""
    std = lambda x: x.std().item() if x.numel() > 1 else 0.0  # noqa: E731
    stats = {"reward/mean": total.mean().item(), "reward/std": std(total)}
    for name, values in per_term.items():
        stats[f"reward/{name}/mean"] = values.mean().item()
        stats[f"reward/{name}/std"] = std(values)
    return stats


def sample_rows(step: int, prompts: list[str], completions: list[str], per_term: dict[str, Tensor], total: Tensor, n: int) -> list[dict]:
    """The first ``n`` completions with their rewards (seed 003: watch the outputs, not only the reward)."""
    return [
        {"step": step, "prompt": prompts[i], "completion": completions[i], "reward": total[i].item(), **{k: v[i].item() for k, v in per_term.items()}}
        for i in range(min(n, len(prompts)))
    ]


def write_samples(run_dir: Path, rows: list[dict]) -> None:
    """Append to ``samples.jsonl``."""
    with (run_dir / "samples.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------------------------
# Optimisation and checkpoints (shared)
# ----------------------------------------------------------------------------------------------


@dataclass
class Updater:
    """A trainable model with its AdamW, schedule and gradient clipping: one call, one update."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float | None
    sampling_dtype: str | None = None  # sampler() runs on a copy in this dtype (SamplingConfig.dtype)
    pack_sampler: bool = False  # that copy's linear layers are PackedLinear (SamplingConfig.pack_weights)
    updates: int = 0
    _sampling_copy: nn.Module | None = field(default=None, repr=False)
    _copy_at: int = -1  # the value of ``updates`` when the copy was last refreshed

    @classmethod
    def create(
        cls, model: nn.Module, cfg: OptimConfig, total_updates: int, world: distributed.World = distributed.World(), sharding: str = "ddp",
        sampling_dtype: str | None = None, pack_sampler: bool = False,
    ) -> Updater:
        """``model`` under torchrun in DDP or sharded by FSDP2 (gradients averaged over ranks), with its AdamW."""
        if sampling_dtype is not None and sharding == "fsdp":
            raise ConfigError("sampling.dtype needs whole weights on every rank; with model.sharding=fsdp leave it null")
        model = distributed.wrap(model, world, sharding)
        optimizer, scheduler = make_optimizer(model.parameters(), cfg, total_updates)
        return cls(model, optimizer, scheduler, cfg.grad_clip, sampling_dtype, pack_sampler)

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper: for sampling, reference passes, evaluation, saving."""
        return distributed.unwrap(self.model)

    def sampler(self) -> nn.Module:
        """The model the decode loop runs on: :attr:`module`, or its copy held in ``sampling_dtype``
        (:func:`rlalign.lm.models.cast_copy`), whose weights are refreshed when an update moved them;
        with ``pack_sampler`` on a CPU its linear layers read their weights in oneDNN's blocked layout
        (:class:`rlalign.lm.models.PackedLinear`: the same values, faster)."""
        if self.sampling_dtype is None:
            return self.module
        if self._sampling_copy is None:
            self._sampling_copy = cast_copy(self.module, self.sampling_dtype)
            if self.pack_sampler and can_pack_linear(self._sampling_copy):
                pack_linear_layers(self._sampling_copy)
        elif self._copy_at != self.updates:
            copy_weights(self._sampling_copy, self.module)
            repack_linear_layers(self._sampling_copy)
        self._copy_at = self.updates
        return self._sampling_copy

    def step(self, loss: Tensor) -> float:
        """zero_grad, backward, clip, step; returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or float("inf")) if params else torch.zeros(())
        self.optimizer.step()
        self.scheduler.step()
        self.updates += 1
        return float(norm)

    def state_dict(self) -> dict:
        """Optimiser (full, gathered from every rank under FSDP2: call it on every rank) and schedule."""
        return {"optimizer": distributed.optimizer_state(self.model, self.optimizer), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class SavedModels:
    """What a checkpoint's ``model/`` holds: the policy, and other models in named subdirectories
    (PPO's critic), so one atomic :func:`rlalign.train.common.save_checkpoint` writes them all."""

    def __init__(self, policy: nn.Module, **others: nn.Module):
        self.policy, self.others = policy, others

    def states(self) -> dict[str, dict | None]:
        """Every model's full weights when FSDP2 shards it (collective: call on every rank), else None."""
        return {"policy": distributed.model_state(self.policy), **{name: distributed.model_state(m) for name, m in self.others.items()}}

    def save_pretrained(self, path: str | Path, states: dict[str, dict | None] | None = None) -> None:
        states = states or {}
        self.policy.save_pretrained(path, state_dict=states.get("policy"))
        for name, model in self.others.items():
            model.save_pretrained(Path(path) / name, state_dict=states.get(name))


@dataclass
class TrainState:
    """Restored by a checkpoint besides weights and optimisers: steps done (the data position is
    step * prompts_per_step) and the generator that draws samples and minibatch orders (in step on
    every rank). ``world``: this process's place under torchrun (one process by default)."""

    step: int
    generator: torch.Generator
    world: distributed.World = field(default_factory=distributed.World)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}


def open_checkpoint(resume: str | Path | None) -> Checkpoint | None:
    """The checkpoint to resume from (a checkpoint dir, or a run dir's latest), or None."""
    return None if resume is None else load_checkpoint(resume)


def _plain(obj: Any) -> Any:
    """NumPy scalars -> Python numbers, recursively, so ``torch.load(weights_only=True)`` reads it back.

    Private workaround, to move into rlalign.train.common: its ``make_optimizer`` schedule returns
    NumPy floats, which LambdaLR stores in its state_dict and a weights-only load then refuses.
    """
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj.item() if isinstance(obj, np.generic) else obj


def resume_state(ckpt: Checkpoint | None, seed: int, updaters: dict[str, Updater], world: distributed.World = distributed.World()) -> TrainState:
    """A fresh TrainState, or the checkpoint's: optimisers, schedules, RNGs, generator, step."""
    state = TrainState(step=0, generator=torch.Generator().manual_seed(seed), world=world)
    if ckpt is not None:
        for name, updater in updaters.items():
            updater.load_state_dict(ckpt.extra[f"updater/{name}"])
        restore_rng_state(ckpt.rng)
        state.generator.set_state(ckpt.extra["generator"])
        state.step = ckpt.step
    return state


def write_checkpoint(run_dir: Path, cfg: Config, state: TrainState, models: SavedModels, updaters: dict[str, Updater], tokenizer, extra: dict[str, Any]) -> None:
    """Checkpoint after ``state.step`` steps (named by it): weights, optimisers and schedules of
    every updater, RNGs, the generator, and ``extra`` (e.g. the KL controller). Rank 0 writes
    (every rank holds the same weights and optimiser state under DDP); the others wait."""
    states = models.states()  # collective under FSDP2, like the optimiser states below
    extra = {**extra, **state.state_dict(), **{f"updater/{name}": _plain(u.state_dict()) for name, u in updaters.items()}}
    if state.world.is_main:
        save_checkpoint(run_dir, state.step, _WithStates(models, states), None, None, tokenizer, cfg, state.step * cfg.prompts_per_step, extra, cfg.keep_last)
    state.world.barrier()


def save_final(run_dir: Path, models: SavedModels, tokenizer, world: distributed.World = distributed.World()) -> Path:
    """The trained policy as an ordinary HF checkpoint (safetensors, tokenizer) in ``run_dir/final`` (rank 0 writes)."""
    final = run_dir / "final"
    states = models.states()
    if world.is_main:
        models.save_pretrained(final, states)
        tokenizer.save_pretrained(final)
    world.barrier()
    return final


@dataclass
class _WithStates:
    """SavedModels with their gathered weights, for :func:`rlalign.train.common.save_checkpoint`."""

    models: SavedModels
    states: dict[str, dict | None]

    def save_pretrained(self, path: str | Path, state_dict: None = None) -> None:
        self.models.save_pretrained(path, self.states)


def check_world(world: distributed.World, prompts_per_step: int, rows_per_step: int, num_minibatches: int) -> None:
    """Under torchrun each rank takes an equal share of the prompts, and of every minibatch."""
    if prompts_per_step % world.size:
        raise ConfigError(f"prompts_per_step={prompts_per_step} must be a multiple of the number of processes ({world.size})")
    local_rows = rows_per_step // world.size
    if local_rows % num_minibatches:
        raise ConfigError(
            f"num_minibatches={num_minibatches} must divide each process's {local_rows} rows ({rows_per_step} rows over {world.size} processes)"
        )


def sample_shard(updater: Updater, tokenizer, prompts: Sequence, cfg: GRPOConfig, group_size: int, state: TrainState) -> Rollout:
    """This rank's rollout of the step's global prompt batch: its share of the prompts, G completions
    each, with the uniforms drawn for the global batch (so the rows do not depend on the world size).
    Drawn by the policy (under model.autocast if set), or by its copy in ``sampling.dtype``."""
    world = state.world
    shard = world.shard(len(prompts), "prompts_per_step")
    noise = torch.rand((cfg.sampling.max_new_tokens, len(prompts) * group_size), generator=state.generator)  # (N, B global)
    rows = slice(shard.start * group_size, shard.stop * group_size)
    ids = encode_prompts(tokenizer, list(prompts[shard]))
    policy, sampler = updater.module, updater.sampler()
    precision = forward_precision(cfg.model, policy) if sampler is policy else contextlib.nullcontext()  # a copy is already low-precision
    with distributed.gathered(policy), precision, attention_kernel(sampler, cfg.sampling.attn_implementation):
        rollout = sample(
            sampler, ids, cfg.sampling.params(), tokenizer.pad_token_id, [tokenizer.eos_token_id], group_size, noise=noise[:, rows], compile=cfg.sampling.compile
        )
    return rollout.to("cpu")


def write_plots(run_dir: Path, keys: Sequence[str]) -> Path:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    present = [k for k in keys if any(k in r for r in records)]
    return plot_metrics(run_dir / "metrics.jsonl", present, run_dir / "curves.png")


# ----------------------------------------------------------------------------------------------
# The GRPO loss and step
# ----------------------------------------------------------------------------------------------

ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "group": partial(group_advantages, scale="group"),
    "batch": partial(group_advantages, scale="batch"),
    "none": partial(group_advantages, scale="none"),
    "rloo": rloo_advantages,
}


def grpo_loss(
    policy: nn.Module, rollout: Rollout, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None, cfg: GRPOConfig, on_policy: bool = False
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = aggregate(clipped surrogate) + beta * aggregate(k3(logp, ref_logp)) on one minibatch.

    Args:
        rollout: the minibatch; ``rollout.logprobs`` is log pi_old, or the sampler's log-probs when
            ``on_policy``. Shapes: (B, C).
        advantages: one per completion, broadcast over its tokens. Shape: (B,).
        mask: 1 on tokens that count. Shape: (B, C).
        ref_logp: reference log-probs, or None when beta = 0. Shape: (B, C).
        on_policy: this is the only update of the rollout, so pi_old is the policy being updated:
            log pi_old = logp.detach() (r = 1 exactly, as TRL does with num_iterations = 1), and
            ``logprob_mismatch`` reports how far the sampler's log-probs were from it.
    Returns:
        (loss, stats): detached loss/policy, clip fractions, approx_kl, ratio stats, kl, entropy.
    """
    with forward_precision(cfg.model, policy):
        logits = completion_logits(policy, rollout, cfg.compile)  # (B, C, V), bfloat16 under autocast
    device = logits.device
    logp, entropy = token_logprobs_and_entropy(logits, rollout.completion_ids.to(device), cfg.sampling.temperature)  # (B, C) each, float32; entropy detached
    sampler_logp, mask = rollout.logprobs.to(device), mask.to(device)
    old_logp = logp.detach() if on_policy else sampler_logp  # (B, C)
    max_len = cfg.sampling.max_new_tokens  # the fixed L of seq-mean-token-sum-norm (Dr.GRPO), not this batch's C
    pg_loss, clip = clipped_surrogate_loss(logp, old_logp, advantages.to(device), mask, cfg.eps_low, cfg.eps_high, mode=cfg.aggregation, max_len=max_len)
    loss = pg_loss
    stats = {
        "loss/policy": pg_loss.detach(),
        "clip_frac": clip.clip_frac,
        "clip_frac/low": clip.clip_frac_low,
        "clip_frac/high": clip.clip_frac_high,
        "approx_kl": clip.approx_kl,
        "ratio_mean": clip.ratio_mean,
        "ratio_dev": ratio_deviation(logp, old_logp, mask),
    }
    if on_policy:
        stats["logprob_mismatch"] = logprob_mismatch(logp, sampler_logp, rollout.completion_mask.to(device))  # every sampled token, as the recompute path
    if ref_logp is not None:
        kl_loss, kl = kl_penalty_loss(logp, ref_logp.to(device), mask, "k3", mode=cfg.aggregation, max_len=max_len)
        loss = loss + cfg.beta * kl_loss
        stats["kl"] = kl.kl
    stats["entropy"] = masked_mean(entropy, mask)
    return loss, stats


def grpo_step(
    updater: Updater, reference: nn.Module | None, tokenizer, rewards: Sequence[RewardTerm], prompts: Sequence[PromptExample], state: TrainState, cfg: GRPOConfig
) -> tuple[dict[str, float], list[dict]]:
    """One GRPO step (0-based ``state.step``): sample, score, advantages, mu x minibatch updates.

    Returns:
        (metrics, a few samples with their rewards).
    """
    world = state.world  # one process, or this rank under torchrun: B below is this rank's share of the rows
    # 1. sample G completions per prompt (no grad, KV cache); the sampling log-probs are log pi_old
    t0 = time.perf_counter()
    batch = [ex.prompt for ex in prompt_batch(prompts, state.step, cfg.prompts_per_step, cfg.seed)]  # the global batch
    rollout = sample_shard(updater, tokenizer, batch, cfg, cfg.group_size, state)
    shard = world.shard(len(batch))  # this rank's prompts, and below its rows
    rows = slice(shard.start * cfg.group_size, shard.stop * cfg.group_size)
    prompt_texts = [render_prompt(tokenizer, p) for p in batch[shard] for _ in range(cfg.group_size)]  # (B,), groups adjacent
    completions = rollout.decode_completions(tokenizer)
    t1 = time.perf_counter()

    # 2. score: the weighted sum of the reward terms; gathered from every rank for the statistics
    local_scores, local_per_term = score_rollout(rewards, prompt_texts, completions)  # (B,)
    scores = distributed.gather_rows(local_scores, world)  # (B global,)
    per_term = {name: distributed.gather_rows(values, world) for name, values in local_per_term.items()}
    t2 = time.perf_counter()

    # 3. group-relative advantages, one per completion (broadcast over its tokens by the loss)
    all_advantages = ADVANTAGE_ESTIMATORS[cfg.advantage](scores, cfg.group_size)  # (B global,)
    advantages = all_advantages[rows]  # (B,)
    mask = loss_mask(rollout, cfg.mask_truncated)  # (B, C)
    m = cfg.num_minibatches
    minibatches = [slice(k, None, m) for k in range(m)]  # rows k, k + m, ...: an equal share of every rank's rows in each
    ref_logp = reference_logprobs(updater.module, reference, rollout, cfg.sampling.temperature, rollout.batch_size // m, cfg.model, cfg.compile) if cfg.beta > 0 else None
    t_ref = time.perf_counter()
    on_policy = cfg.mu * m == 1  # one update: pi_old is the policy being updated, no pass needed for it
    mismatch = None
    if sampler_differs(cfg) and not on_policy:  # bfloat16 sampling numerics are not the training forward's
        old_logp = training_logprobs(updater.module, rollout, cfg.sampling.temperature, minibatches, cfg.model, cfg.compile)  # (B, C)
        mismatch = float(logprob_mismatch(old_logp, rollout.logprobs, rollout.completion_mask))
        rollout = dataclasses.replace(rollout, logprobs=old_logp)
    t_old = time.perf_counter()

    # 4. mu passes x minibatches of clipped-surrogate updates against log pi_old
    sums: dict[str, float] = {}
    updates, first_ratio_dev = 0, None
    for _ in range(cfg.mu):
        for mb in minibatches:
            loss, stats = grpo_loss(updater.model, rollout.select(mb), advantages[mb], mask[mb], None if ref_logp is None else ref_logp[mb], cfg, on_policy)
            scale = distributed.loss_scale(distributed.aggregation_count(mask[mb], cfg.aggregation), world)  # 1 in one process
            stats = distributed.reduce_stats({key: float(v) for key, v in stats.items()}, float(mask[mb].sum()), scale, world)
            stats["grad_norm"] = updater.step(loss * scale)
            first_ratio_dev = stats["ratio_dev"] if first_ratio_dev is None else first_ratio_dev
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            updates += 1
    t3 = time.perf_counter()

    metrics = {key: value / updates for key, value in sums.items()}
    metrics.update(reward_stats(scores, per_term))
    metrics.update(completion_stats(rollout, world))
    metrics["frac_zero_std_groups"] = (scores.view(-1, cfg.group_size).std(dim=1) <= 1e-6).float().mean().item()
    metrics["adv/std"] = all_advantages.std().item()
    metrics["ratio_dev/first"] = first_ratio_dev
    if mismatch is not None:
        metrics["logprob_mismatch"] = distributed.all_max(mismatch, world)
    metrics["lr"] = float(updater.scheduler.get_last_lr()[0])
    metrics.update(step_timings(t0, t1, t2, t3, metrics["tokens"], t_ref, t_old))
    return metrics, sample_rows(state.step, prompt_texts, completions, local_per_term, local_scores, cfg.num_samples_logged)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


@dataclass
class RunSetup(Run):
    """What GRPO and PPO build before their first step (:func:`setup_run`): a :class:`Run` with
    the prompts, the checkpoint to resume from, and the reward terms."""

    prompts: list[PromptExample] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    rewards: list[RewardTerm] = field(default_factory=list)

    def load_policy(self, model_cfg: ModelConfig) -> nn.Module:
        """The policy: from the checkpoint when resuming (LoRA adapters included), else the start with optional fresh LoRA."""
        m, ckpt = model_cfg, self.checkpoint
        return load_policy(ckpt.model_dir if ckpt else self.base_path, m.dtype, self.device, None if ckpt else m.lora, m.gguf_file, m.attn_implementation)

    def load_reference(self, model_cfg: ModelConfig, path: str | None) -> nn.Module | None:
        """The frozen reference (sharded under FSDP2), or None for LoRA without ``path``: the base with adapters off serves.
        Under ``model.autocast: bfloat16`` its matmul weights are held in bfloat16 (:func:`hold_matmul_weights`: the values
        autocast would cast them to, so its log-probs equal the policy's at equal weights; no cast per forward, about half
        the memory, a faster reference pass)."""
        if model_cfg.lora is not None and path is None:
            return None
        reference = load_reference(path or self.base_path, model_cfg.dtype, self.device, model_cfg.gguf_file, model_cfg.attn_implementation)
        if model_cfg.autocast != "none":
            hold_matmul_weights(reference, model_cfg.autocast)
        return distributed.shard_frozen(reference, self.world, model_cfg.sharding)


def setup_run(cfg: GRPOConfig, resume: str | Path | None, prompts: Sequence[dict] | None, reward_functions: Sequence[RewardTerm], rows_per_step: int, minibatches: int) -> RunSetup:
    """:func:`rlalign.train.common.start_run` (process group, seeds, run directory, starting model,
    tokenizer), then the prompts, the checkpoint to resume from and the reward terms. Shared by GRPO and PPO."""
    check_world(distributed.init(cfg.model.device), cfg.prompts_per_step, rows_per_step, minibatches)  # before anything is built
    run = start_run(cfg, cfg.prompts_per_step, "prompts_per_step")
    prompt_set = load_prompt_set(cfg.data, prompts)
    rewards = build_rewards(cfg.rewards, prompt_set, run.tokenizer, cfg.model, reward_functions, run.world)
    return RunSetup(**vars(run), prompts=prompt_set, checkpoint=open_checkpoint(resume), rewards=rewards)


def run_steps(
    step_fn: Callable[[TrainState], tuple[dict[str, float], list[dict]]],
    cfg: GRPOConfig,
    run: RunSetup,
    state: TrainState,
    models: SavedModels,
    updaters: dict[str, Updater],
    checkpoint_extra: Callable[[], dict[str, Any]],
    summary_keys: tuple[str, ...],
    plot_keys: tuple[str, ...],
) -> tuple[list[dict[str, float]], Path]:
    """The outer loop GRPO and PPO share: ``step_fn`` until ``cfg.steps``, each step's metrics
    logged, a few samples every ``sample_every`` steps, a checkpoint every ``save_every`` steps and
    at the end, then the final model and the curves. Returns (this call's metrics, final dir)."""
    history: list[dict[str, float]] = []
    is_main = state.world.is_main
    with MetricsLogger(run.run_dir, cfg.steps, cfg.progress, cfg.tensorboard, run.run_dir.name, state.step, enabled=is_main) as log:
        while state.step < cfg.steps:
            metrics, samples = step_fn(state)
            log.log(state.step, metrics, summary_keys=summary_keys)
            if (state.step + 1) % cfg.sample_every == 0 and is_main:
                write_samples(run.run_dir, samples)
            history.append({"step": state.step, **metrics})
            state.step += 1
            if (cfg.save_every and state.step % cfg.save_every == 0) or state.step == cfg.steps:
                write_checkpoint(run.run_dir, cfg, state, models, updaters, run.tokenizer, checkpoint_extra())
    final_dir = save_final(run.run_dir, models, run.tokenizer, state.world)
    if cfg.plots and is_main:
        write_plots(run.run_dir, plot_keys)
    return history, final_dir


@dataclass
class GRPOResult:
    """What :func:`train` returns."""

    policy: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)  # one metrics dict per step run by this call
    output_dir: Path | None = None
    final_dir: Path | None = None


def train(cfg: GRPOConfig, resume: str | Path | None = None, reward_functions: Sequence[RewardTerm] = (), prompts: Sequence[dict] | None = None) -> GRPOResult:
    """Run GRPO, or continue the run of checkpoint ``resume`` (a checkpoint dir or a run dir).

    Args:
        reward_functions: extra reward terms from Python, added to ``cfg.rewards``.
        prompts: prompt records (``{"prompt": ..., "answer"?: ...}``) to use instead of ``cfg.data``.
    """
    run = setup_run(cfg, resume, prompts, reward_functions, cfg.prompts_per_step * cfg.group_size, cfg.num_minibatches)
    policy = run.load_policy(cfg.model)
    reference = run.load_reference(cfg.model, cfg.reference) if cfg.beta > 0 else None  # beta = 0: no KL term, no reference
    updater = Updater.create(policy, cfg.optim, cfg.steps * cfg.mu * cfg.num_minibatches, run.world, cfg.model.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy)
    state = resume_state(run.checkpoint, cfg.seed, {"policy": updater}, run.world)

    def step(state: TrainState) -> tuple[dict[str, float], list[dict]]:
        return grpo_step(updater, reference, run.tokenizer, run.rewards, run.prompts, state, cfg)

    history, final_dir = run_steps(
        step, cfg, run, state, SavedModels(policy), {"policy": updater}, dict,
        summary_keys=("reward/mean", "kl", "completion_len/mean"),
        plot_keys=("reward/mean", "kl", "entropy", "completion_len/mean", "clip_frac", "frac_zero_std_groups"),
    )
    return GRPOResult(policy=policy, history=history, output_dir=run.run_dir, final_dir=final_dir)


# ----------------------------------------------------------------------------------------------
# CLI: rlalign grpo --config configs/grpo_arithmetic.yaml steps=50 optim.lr=1e-4 [--resume DIR]
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML recipe, e.g. configs/grpo_arithmetic.yaml")
    parser.add_argument("--resume", metavar="DIR", help="checkpoint directory (or run directory: its latest checkpoint) to continue from")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, e.g. optim.lr=1e-4 steps=50")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(GRPOConfig, args.config, args.overrides)
    result = train(cfg, resume=args.resume)
    last = result.history[-1] if result.history else {}
    summary = {"output_dir": str(result.output_dir), "final": str(result.final_dir), "steps_run": len(result.history)}
    summary.update({k: round(last[k], 4) for k in ("reward/mean", "kl", "completion_len/mean") if k in last})
    print(json.dumps(summary))
    return 0
