"""TRL's and transformers' config names, and what each is called here: the hint an unknown config key gets.

A TRL user's ``num_generations: 8`` is an unknown key here; the closest field by spelling would be
no help (``per_device_train_batch_size`` is nearest to ``micro_batch_size``, which it is not), so
:func:`trl_hint` names rlalign's field, or says that no setting matches. Sources: TRL 1.16's
``GRPOConfig``, ``DPOConfig``, ``SFTConfig`` and ``RewardConfig``, transformers' ``TrainingArguments``.
A hint is given only for the trainer whose config lacks the key (``beta`` and ``loss_type`` are rlalign
fields too; TRL's top-level ``max_length`` is ``data.max_length`` here), and only for rlalign's LM
trainers (:func:`trl_trainer`): a classic algorithm's config has other fields.
"""

from __future__ import annotations

__all__ = ["trl_hint", "trl_trainer"]

_BATCH_RL = ("the step's batch is prompts_per_step prompts x group_size completions over all processes (TRL's is per device "
             "and counts completions); micro_batch_size sets the rows per forward")
_BATCH = ("batch_size is the optimiser step's batch over all processes (TRL's per_device_train_batch_size x processes x "
          "gradient_accumulation_steps); micro_batch_size sets the rows per forward")

# TRL / transformers name -> what to set here (fields as a config writes them)
_COMMON = {
    "learning_rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.betas (a pair: [beta1, beta2])",
    "adam_beta2": "optim.betas (a pair: [beta1, beta2])",
    "adam_epsilon": "optim.eps",
    "max_grad_norm": "optim.grad_clip",
    "warmup_steps": "optim.warmup_steps",
    "warmup_ratio": "optim.warmup_steps (a number of steps, not a ratio)",
    "lr_scheduler_type": "optim.min_lr_ratio (1: constant; below 1: cosine decay to that fraction of optim.lr)",
    "num_train_epochs": "max_steps (optimiser steps of batch_size examples each)",
    "per_device_train_batch_size": _BATCH,
    "gradient_accumulation_steps": "micro_batch_size (rows per forward; the step's batch stays batch_size)",
    "per_device_eval_batch_size": "eval_batch_size",
    "eval_steps": "eval_every",
    "eval_strategy": "eval_every",
    "save_steps": "save_every",
    "save_strategy": "save_every (0: only at the end)",
    "save_total_limit": "keep_last",
    "logging_steps": "no such setting: every step is logged (metrics.jsonl)",
    "bf16": "model.autocast: bfloat16 (float32 weights, bfloat16 forwards), or model.dtype: bfloat16",
    "fp16": "no float16 here: model.autocast: bfloat16 (float32 weights, bfloat16 forwards), or model.dtype: bfloat16",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "resume_from_checkpoint": "the command's --resume DIR",
    "model_init_kwargs": "model.dtype, model.attn_implementation (the model section)",
    "torch_dtype": "model.dtype",
    "dtype": "model.dtype",
    "attn_implementation": "model.attn_implementation",
    "use_liger_kernel": "model.logits_limit_mb (log-probs from the hidden states in chunks, no full logits)",
    "disable_dropout": "no such setting: a model's dropout is always off",
    "trust_remote_code": "no such setting: remote code is not run",
    "push_to_hub": "no such setting: final/ is an ordinary checkpoint to upload",
}

_TOOL_TURNS = ("environment.max_turns = TRL's max_tool_calling_iterations + 1 (assistant turns, the last one's calls not run); TRL's "
               "tools=[fn, ...] is train(cfg, tools=[fn, ...]) with that section")

_RL = {  # GRPOConfig's names for what GRPO, PPO and distillation share
    "max_completion_length": "sampling.max_new_tokens (in multi-turn episodes each assistant turn's, where TRL's bounds the whole "
                             "episode, tool results included)",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k (0: off)",
    "min_p": "no such setting: sampling has temperature, top_k and top_p",
    "repetition_penalty": "no such setting: sampling has temperature, top_k and top_p",
    "generation_kwargs": "the sampling section (temperature, top_k, top_p, max_new_tokens)",
    "steps_per_generation": "num_minibatches = TRL's steps_per_generation / gradient_accumulation_steps (TRL counts micro-batches, "
                            "num_minibatches optimiser steps per pass over a rollout)",
    "generation_batch_size": "prompts_per_step (the prompts of a rollout)",
    "per_device_train_batch_size": "the step's batch is prompts_per_step prompts over all processes; micro_batch_size sets the rows per forward",
    "gradient_accumulation_steps": "micro_batch_size (rows per forward; auto by default)",
    "delta": "dual_clip (the same function for a delta above the upper clip bound)",
    "reward_weights": "each term's weight in the rewards list",
    "use_vllm": "no such setting: rlalign samples with its own sampler (the sampling section)",
    "vllm_importance_sampling_correction": "tis_cap (the sampler's importance weight; off when null)",
    "vllm_importance_sampling_cap": "tis_cap",
    "vllm_importance_sampling_mode": "tis_mode (truncate or mask) and tis_level (token or sequence)",
    "vllm_importance_sampling_clip_min": "tis_min",
    "vllm_importance_sampling_clip_max": "tis_cap",
    "sync_ref_model": "no such setting: the reference stays the starting policy (or reference)",
    "log_completions": "sample_every and num_samples_logged (samples.jsonl)",
    "num_completions_to_print": "num_samples_logged",
    "num_generations_eval": "eval.num_samples",
    "per_device_eval_batch_size": "eval.batch_size",
    "eval_steps": "eval.every",
    "eval_strategy": "eval.every (0: before the first step and after the last only), eval.enabled",
    "max_steps": "steps (one rollout and its updates each)",
    "num_train_epochs": "steps (one rollout and its updates each)",
}

_GRPO = {
    "num_generations": "group_size",
    "generation_batch_size": "prompts_per_step = TRL's generation_batch_size / num_generations (TRL counts completions; a rollout "
                             "here is prompts_per_step x group_size completions)",
    "per_device_train_batch_size": _BATCH_RL,
    "num_iterations": "mu",
    "epsilon": "eps_low and eps_high (TRL's epsilon sets both, epsilon_high defaulting to it)",
    "epsilon_high": "eps_high",
    "scale_rewards": "advantage: group (TRL's true / 'group'), batch ('batch'), or none (false; Dr. GRPO)",
    "importance_sampling_level": "importance_sampling (token or sequence)",
    "mask_truncated_completions": "mask_truncated",
    "max_tool_calling_iterations": _TOOL_TURNS,
}

_PPO = {  # TRL's last PPOConfig (0.x), and GRPOConfig's names for PPO's fields
    "num_iterations": "ppo_epochs",
    "epsilon": "eps",
    "beta": "kl_coef",
    "num_ppo_epochs": "ppo_epochs",
    "num_mini_batches": "num_minibatches",
    "cliprange": "eps",
    "cliprange_value": "value_clip",
    "vf_coef": "no such setting: the critic has its own optimiser (critic.optim)",
    "response_length": "sampling.max_new_tokens",
    "total_episodes": "steps (each one rollout of prompts_per_step prompts)",
    "local_rollout_forward_batch_size": "micro_batch_size (rows per forward; auto by default)",
    "num_generations": "no such setting: PPO samples one completion per prompt (GRPO has group_size)",
    "max_tool_calling_iterations": _TOOL_TURNS,
}

_DPO = {
    "precompute_ref_log_probs": "precompute_ref_logprobs",
    "ref_model": "reference",
    "max_prompt_length": "data.max_length (prompt and response together)",
    "max_completion_length": "data.max_length (prompt and response together)",
    "max_length": "data.max_length",
}

_SFT = {
    "assistant_only_loss": "data.completion_only_loss (on messages: the assistant turns are learnt; false: every token)",
    "completion_only_loss": "data.completion_only_loss",
    "packing": "data.packing",
    "max_seq_length": "data.max_length",
    "max_length": "data.max_length",
    "dataset_text_field": "data.columns, {name in the data: text} (e.g. {content: text})",
}

_RM = {
    "center_rewards_coefficient": "center_coef",
    "max_length": "data.max_length",
}

_BY_TRAINER = {
    "GRPOConfig": {**_COMMON, **_RL, **_GRPO},
    "PPOConfig": {**_COMMON, **_RL, **_PPO},
    "DistillConfig": {**_COMMON, **_RL},
    "DPOConfig": {**_COMMON, **_DPO},
    "SFTConfig": {**_COMMON, **_SFT},
    "RMConfig": {**_COMMON, **_RM},
}


def trl_trainer(cls: type) -> str | None:
    """The trainer whose hints a config class gets: the first of its classes that is one of rlalign's LM trainer configs
    (a subclass of GRPOConfig gets GRPO's); None for any other config (the classic algorithms' ``PPOConfig`` shares a
    name with the LM trainer's but has neither its fields nor an ``optim`` section)."""
    return next((c.__name__ for c in cls.__mro__ if c.__module__.startswith("rlalign.train.") and c.__name__ in _BY_TRAINER), None)


def trl_hint(trainer: str | None, key: str, allowed: list[str] | None = None) -> str | None:
    """What TRL's or transformers' ``key`` is called here, for the trainer config named ``trainer`` (:func:`trl_trainer`), as
    one phrase (None when ``key`` is no TRL name, names a field this config has: ``allowed``, or ``trainer`` is none of them)."""
    if allowed is not None and key in allowed:
        return None
    target = _BY_TRAINER.get(trainer, {}).get(key)
    return None if target is None else f"TRL's {key}: {target}"
