"""Bradley-Terry reward-model training: ``rlalign rm --config configs/rm_preference.yaml``.

    P(chosen > rejected) = sigmoid(r(x, y_c) - r(x, y_r))
    L = -mean log sigmoid(r_c - r_r - m) + c * mean((r_c + r_r)^2)

(seed 003, section 4; ``rlalign.core.losses.bradley_terry_loss``). r is a scalar head on the
backbone's last hidden state read at the EOS closing prompt + response (:class:`ScalarHeadModel`).
The margin m is the pair's ``margin`` column (Llama 2, Touvron et al. 2023) when the data has one, as in TRL (``use_margin``);
c > 0 is reward centring (Eisenstein et al. 2023), which pins the mean reward near 0 so later PPO
sees rewards on a stable scale. Chosen and rejected responses go through one forward pass.

Held-out metrics: ``eval/accuracy`` (fraction of pairs with r_c > r_r) and ``eval/margin``
(mean r_c - r_r).

The head r = w . h has no bias: Bradley-Terry's gradient with respect to a constant added to every
reward is exactly zero (it cancels in r_c - r_r; only centring would move it), so nothing is lost,
and the model saves as an exact Hugging Face sequence-classification checkpoint. ``<output_dir>/final``
(and each checkpoint's ``model/``) holds ``config.json`` with ``architectures:
["<Arch>ForSequenceClassification"]`` (e.g. ``LlamaForSequenceClassification``), ``num_labels: 1`` and
the tokenizer's ``pad_token_id``, the weights with the backbone under the class's prefix (``model.``,
``transformer.``, ...) and the head as ``score.weight`` (1, H), and the tokenizer. It loads with
``AutoModelForSequenceClassification.from_pretrained`` as well as with
:func:`rlalign.lm.heads.load_reward_model` (PPO's ``reward_model:``, GRPO's reward-model term) and
``load_critic`` (PPO's critic starts from it, with a bias of 0 that it then trains).

Transformers' classifier reads the score at the last token that is not ``pad_token_id``; rlalign
reads it at the last attention-mask position, the EOS that closes prompt + response. The two agree
when the tokenizer has a pad token of its own. When its pad token is its EOS (``load_tokenizer``
makes it so for a tokenizer without one), transformers reads the token before that EOS, and saving
warns about it. Transformers' classifier also numbers positions 0..T-1 whatever the padding, so give
it right-padded batches (rlalign derives positions from the mask, so either padding gives the same
scores there).

Reward models saved by older versions (backbone + ``value_head.safetensors``) still load; training
from one drops its head's bias with a warning (every reward moves by that constant).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from rlalign.config import ConfigError
from rlalign.core.losses import bradley_terry_loss
from rlalign.lm.data import PreferenceExample, load_preferences
from rlalign.lm.encoding import collate_preferences, example_tokens, explicit_prompt
from rlalign.lm.heads import ScalarHeadModel, last_token_values, load_reward_model
from rlalign.lm.model_modes import enable_gradient_checkpointing
from rlalign.tasks import TASKS
from rlalign.train.loop import add_run_arguments, start_run, run_supervised_command
from rlalign.train.run_config import ModelConfig, OptimConfig
from rlalign.train.supervised import SupervisedConfig, SupervisedDataConfig, supervised_loop

__all__ = ["RMDataConfig", "RMConfig", "pair_rewards", "evaluate_pairs", "train", "add_arguments", "run"]


class RMDataConfig(SupervisedDataConfig):
    """Where the preference pairs come from."""

    task: Literal["preference"] | None = Field("preference", description="built-in task used when train_file is null")
    train_file: str | None = Field(
        None, description="TRL preference data: {prompt, chosen, rejected} or {chosen, rejected} (implicit prompt), text or messages, margin?; "
        "a file, directory or Hub name; overrides task"
    )
    eval_file: str | None = Field(None, description="held-out pairs (required with train_file)")
    num_train: int = Field(4000, ge=1, description="number of built-in training pairs")
    num_eval: int = Field(500, ge=1, description="number of built-in held-out pairs")
    max_length: int | None = Field(
        None, ge=2, description="longest prompt + response in tokens (longer ones keep their end; the share cut printed); null = 1024 for files "
        "(TRL's default), 64 for the built-in task"
    )

    def length_limit(self) -> int:
        """``max_length``, or its default: 1024 tokens for files (TRL's RewardConfig and DPOConfig), 64 for the built-in task (its pairs are
        about 30 tokens with the tiny character tokenizer)."""
        return self.max_length or (1024 if self.train_file is not None else 64)


class RMConfig(SupervisedConfig):
    """``rlalign rm``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/rm_preference", description="run directory: metrics.jsonl, checkpoints/, final/")
    model: ModelConfig = Field(default_factory=ModelConfig, description="backbone checkpoint (e.g. the SFT model), dtype, device")
    data: RMDataConfig = Field(default_factory=RMDataConfig, description="training and held-out pairs")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20), description="AdamW and schedule")
    batch_size: int = Field(32, ge=1, description="pairs per step")
    max_steps: int = Field(150, ge=1, description="optimizer steps")
    use_margin: bool | None = Field(
        None, description="subtract each pair's margin inside the sigmoid; null = when the data has a 'margin' column (TRL's rule), true = it must"
    )
    center_coef: float = Field(0.0, ge=0, description="reward centring: weight of mean((r_c + r_r)^2)")
    eval_every: int = Field(100, ge=1, description="evaluate on held-out pairs every this many steps (and at the end)")
    eval_batch_size: int = Field(128, ge=1, description="pairs per forward at eval")

    @model_validator(mode="after")
    def _no_lora(self) -> RMConfig:
        if self.model.lora is not None:
            raise ValueError("model.lora is not supported for reward models (the head and backbone are trained in full)")
        if self.model.adapter == "train":
            raise ValueError("model.adapter: train is not supported for reward models: an adapter given as model.path is merged into its base (adapter: merge)")
        return self


def pair_rewards(model: ScalarHeadModel, tokenizer, examples: list[PreferenceExample], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(r_chosen (B,), r_rejected (B,), margin (B,) or None) from one forward over 2B sequences
    (``model`` may be DDP-wrapped: the forward goes through it)."""
    device = next(model.parameters()).device
    batch = collate_preferences(tokenizer, examples, max_length)
    mask = batch.attention_mask.to(device)
    rewards = last_token_values(model(batch.input_ids.to(device), mask), mask)  # (2B,)
    n = batch.num_pairs
    margin = None if batch.margin is None else batch.margin.to(device)
    return rewards[:n], rewards[n:], margin


@torch.no_grad()
def evaluate_pairs(
    model: ScalarHeadModel, tokenizer, examples: list[PreferenceExample], max_length: int, batch_size: int = 128, use_margin: bool = False,
    center_coef: float = 0.0,
) -> dict[str, float]:
    """Held-out ``eval/accuracy`` (r_c > r_r) and ``eval/margin`` (mean r_c - r_r) and ``eval/loss``, the training loss
    (with the pairs' margins if ``use_margin``, and the centring term) on the held-out pairs."""
    was_training = model.training
    model.eval()
    chosen, rejected, margins = [], [], []
    for start in range(0, len(examples), batch_size):
        r_c, r_r, margin = pair_rewards(model, tokenizer, examples[start : start + batch_size], max_length)
        chosen.append(r_c)
        rejected.append(r_r)
        margins.append(torch.zeros_like(r_c) if margin is None else margin)  # a batch of pairs without margins: 0 (collate_preferences' rule)
    model.train(was_training)
    loss, stats = bradley_terry_loss(torch.cat(chosen), torch.cat(rejected), torch.cat(margins) if use_margin else None, center_coef)
    return {"eval/accuracy": float(stats.accuracy), "eval/margin": float(stats.margin_mean), "eval/loss": float(loss), "eval/reward_mean": float(stats.reward_mean)}


def margins_used(use_margin: bool | None, pairs: list[PreferenceExample]) -> bool:
    """Whether the loss subtracts the pairs' margins: ``use_margin``, or (None) whether any pair has one, as TRL's
    RewardTrainer does.

    Raises:
        ConfigError: ``use_margin`` true for pairs without a margin column.
    """
    has = any(ex.margin is not None for ex in pairs)
    if use_margin and not has:
        raise ConfigError("use_margin: true, but the training pairs have no 'margin' column; set use_margin: null or false")
    return has if use_margin is None else use_margin


def pair_cut_report(tokenizer, examples: list[PreferenceExample], limit: int, split_prompt: bool = False) -> str:
    """One line: how many of the pairs ``examples`` the cut at ``limit`` tokens shortens (a pair's length: its prompt and its
    longer response, the prompt first made explicit if ``split_prompt``, as DPO encodes it), and the longest."""
    lengths = [
        max(len(example_tokens(tokenizer, ex.prompt, response)[0]) for response in (ex.chosen, ex.rejected))
        for ex in (map(explicit_prompt, examples) if split_prompt else examples)
    ]
    cut = sum(n > limit for n in lengths)
    return f"data: max_length={limit} cuts {cut} of the {len(lengths)} pairs checked (the longest has {max(lengths, default=0)} tokens)"


def _datasets(cfg: RMConfig) -> tuple[list[PreferenceExample], list[PreferenceExample]]:
    data = cfg.data
    if data.train_file is not None:
        return data.load_files(load_preferences)
    task = TASKS[data.task]
    return (
        load_preferences(task.preference_records("train", data.num_train, cfg.seed)),
        load_preferences(task.preference_records("eval", data.num_eval, cfg.seed)),
    )


def train(cfg: RMConfig, resume: str | Path | None = None) -> dict[str, float]:
    """Train the reward model; returns the final held-out metrics and ``eval/accuracy_initial``, ``time/total``."""
    run = start_run(cfg, cfg.batch_size, "batch_size", resume)
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        train_set, eval_set = _datasets(cfg)
        use_margin = margins_used(cfg.use_margin, train_set)
        limit = cfg.data.length_limit()
        if run.world.is_main:
            print(pair_cut_report(run.tokenizer, train_set[:2048] + eval_set, limit))
        m = cfg.model
        model = load_reward_model(run.model_path, m.dtype, run.device, True, m.gguf_file, m.attn_implementation)  # a head without bias
        if m.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model.pad_token_id, model.eos_token_id = run.tokenizer.pad_token_id, run.tokenizer.eos_token_id  # for the saved classifier's config
        model.train()

        def batch_loss(trained, pairs: list[PreferenceExample]):
            r_c, r_r, margin = pair_rewards(trained, run.tokenizer, pairs, limit)
            loss, stats = bradley_terry_loss(r_c, r_r, margin if use_margin else None, cfg.center_coef)
            local = {"loss/rm": float(loss.detach()), "accuracy": float(stats.accuracy), "margin": float(stats.margin_mean), "reward/mean": float(stats.reward_mean)}
            return loss, local, float(len(pairs))  # a mean over pairs

        def evaluate(model) -> dict[str, float]:
            return evaluate_pairs(model, run.tokenizer, eval_set, limit, cfg.eval_batch_size, use_margin, cfg.center_coef)

        return supervised_loop(cfg, run, model, train_set, batch_loss, evaluate, "rm", "eval/accuracy", "pairs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "configs/rm_preference.yaml", "optim.lr=1e-3 max_steps=50", RMConfig)


def run(args: argparse.Namespace) -> int:
    return run_supervised_command(RMConfig, train, args)
