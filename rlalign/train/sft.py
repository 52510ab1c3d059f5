"""Supervised fine-tuning with a completion-only loss: ``rlalign sft --config configs/sft_arithmetic.yaml``.

    L = -1/|y| sum_t log pi(y_t | x, y_<t)      over completion tokens only (the prompt is masked)

(seed 003, section 1; ``rlalign.core.losses.sft_loss`` with token-mean aggregation over the batch).
Each step: a batch of (prompt, completion) pairs, one row each (or packed end to end with
``data.packing``), one forward, the loss on the completion positions, AdamW. Every
``eval_every`` steps: the eval loss, and ``eval/reward``, the task reward of completions of the
eval prompts (arithmetic: accuracy of greedy answers; preference: mean hidden score of completions
sampled at temperature 1, since greedy decoding of a random-word distribution collapses to one
word; files: exact match of greedy completions with the reference completions, where the eval rows
have prompts).

Data come from a built-in task (``data.task``) or from files, directories or Hub datasets
(``data.train_file`` / ``data.eval_file``) in TRL's SFT types (:mod:`rlalign.lm.data`): ``text``
and ``messages`` rows (language modelling: every token of a text, the assistant turns of a
conversation) or ``prompt`` + ``completion`` rows (the completion), each text or messages. With no ``model.path`` the tiny recipe
model is built in ``<output_dir>/base_model``. The trained model is saved to ``<output_dir>/final``
(an ordinary HF checkpoint directory, tokenizer included).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from rlalign.core.logprobs import token_logprobs
from rlalign.core.losses import sft_loss
from rlalign.lm.data import Prompt, SFTExample, load_sft
from rlalign.config import ConfigError
from rlalign.lm.encoding import collate_sft, completion_text, pack_sft, sft_row
from rlalign.lm.logprobs import PACKED_ROWS_KERNELS, PACKED_ROWS_MODEL_TYPES, packs_rows
from rlalign.lm.rewards import exact_match
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.common import generation_eval
from rlalign.train.loop import add_run_arguments, start_run, run_supervised_command
from rlalign.train.run_config import OptimConfig
from rlalign.train.supervised import SupervisedConfig, SupervisedDataConfig, supervised_loop

__all__ = ["SFTDataConfig", "SFTConfig", "train", "add_arguments", "run"]


class SFTDataConfig(SupervisedDataConfig):
    """Where the (prompt, completion) pairs come from."""

    task: Literal["arithmetic", "preference", "multiplication", "lookup", "lookup_value"] | None = Field("arithmetic", description="built-in task used when train_file is null")
    train_file: str | None = Field(
        None, description="TRL SFT data: {text} | {messages} (language modelling) | {prompt, completion}, text or messages; a file, directory or Hub name; overrides task"
    )
    eval_file: str | None = Field(None, description="held-out examples for eval loss and exact match of greedy completions (required with train_file)")
    num_train: int = Field(20000, ge=1, description="number of built-in training pairs")
    num_eval: int = Field(256, ge=1, description="number of built-in eval pairs")
    max_length: int | None = Field(
        None, ge=2, description="longest prompt + completion in tokens (longer rows are cut, the share cut printed; a row cut before its first "
        "target token is an error); null = 1024 for files (TRL's default), 256 for the built-in tasks"
    )
    packing: bool = Field(False, description="pack pairs end to end into rows of max_length tokens")
    completion_only_loss: bool = Field(
        True, description="learn only the completions (the assistant turns of 'messages' rows); false: every token; 'text' rows learn every token either way"
    )


class SFTConfig(SupervisedConfig):
    """``rlalign sft``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/sft_arithmetic", description="run directory: metrics.jsonl, checkpoints/, final/")
    data: SFTDataConfig = Field(default_factory=SFTDataConfig, description="training and eval pairs")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=20), description="AdamW and schedule")
    batch_size: int = Field(64, ge=1, description="examples per step (packed end to end into rows of max_length when packing)")
    max_steps: int = Field(1500, ge=1, description="optimizer steps")
    eval_every: int = Field(250, ge=1, description="evaluate every this many steps (and at the start and end)")
    eval_batch_size: int = Field(128, ge=1, description="pairs per forward / prompts per sampling batch at eval")
    max_new_tokens: int | None = Field(
        None, ge=1, description="tokens generated per eval prompt; null = the task's default (files: the longest eval reference's tokens and its EOS, at most data.max_length)"
    )


@dataclass(frozen=True)
class _EvalSpec:
    reward_fn: Callable | None  # None: exact match with the eval pairs' completions
    max_new_tokens: int
    temperature: float  # 0 = greedy


def _datasets(cfg: SFTConfig, tokenizer) -> tuple[list[SFTExample], list[SFTExample], _EvalSpec]:
    """(train examples, eval examples, how generations are scored at eval)."""
    data = cfg.data
    if data.train_file is not None:
        train_set, eval_set = data.load_files(load_sft)
        longest = min(max(reference_tokens(tokenizer, eval_set), default=32), max_length(cfg))  # a reference past max_length is cut in training too
        return train_set, eval_set, _EvalSpec(None, cfg.max_new_tokens or longest, 0.0)
    task = TASKS[data.task]
    train_set = load_sft(task.sft_records("train", data.num_train, cfg.seed))
    eval_set = load_sft(task.sft_records("eval", data.num_eval, cfg.seed))
    return train_set, eval_set, _EvalSpec(task.reward, cfg.max_new_tokens or task.max_new_tokens, task.eval_temperature)


def max_length(cfg: SFTConfig) -> int:
    """``data.max_length``, or its default: 1024 tokens for files (TRL's), 256 for the built-in tasks (their longest rows, the look-up
    conversations, are about 210 tokens with the tiny character tokenizer)."""
    return cfg.data.max_length or (1024 if cfg.data.train_file is not None else 256)


def cut_report(tokenizer, examples: list[SFTExample], limit: int, completion_only: bool) -> str:
    """One line: how many of ``examples`` the cut at ``limit`` tokens shortens, and the longest.

    Raises:
        DataError: when the cut leaves an example none of its target tokens (:func:`rlalign.lm.encoding.sft_row`).
    """
    lengths = [sft_row(tokenizer, ex, limit, completion_only)[2] for ex in examples]
    cut = sum(n > limit for n in lengths)
    return f"data: max_length={limit} cuts {cut} of the {len(lengths)} rows checked (the longest has {max(lengths, default=0)} tokens)"


def reference_tokens(tokenizer, examples: list[SFTExample]) -> list[int]:
    """The tokens a greedy completion needs to equal each reference of ``examples`` (:func:`generation_pairs`): its text's and EOS."""
    return [len(tokenizer(reference, add_special_tokens=False)["input_ids"]) + 1 for _, reference in generation_pairs(examples)]


def length_report(tokenizer, examples: list[SFTExample], max_new_tokens: int) -> str | None:
    """A line when ``max_new_tokens`` is too few for some eval references to be generated whole (eval/reward cannot reach 1), else None."""
    lengths = reference_tokens(tokenizer, examples)
    short = sum(n > max_new_tokens for n in lengths)
    if not short:
        return None
    return (f"eval: max_new_tokens={max_new_tokens} is too few for {short} of the {len(lengths)} eval references (the longest needs {max(lengths)} "
            f"tokens with its EOS): they can never be matched, so eval/reward stays below 1; raise max_new_tokens")


def generation_pairs(examples: list[SFTExample]) -> list[tuple[Prompt, str]]:
    """(prompt, reference completion) of each example a greedy completion can be compared with: a
    prompt-completion pair, or a conversation ending with an assistant turn (the turns before it are
    the prompt); a plain text has no prompt and gives none."""
    pairs = []
    for ex in examples:
        if ex.prompt is not None:
            pairs.append((ex.prompt, completion_text(ex.completion)))
        elif isinstance(ex.completion, list) and len(ex.completion) > 1 and ex.completion[-1]["role"] == "assistant":
            pairs.append((ex.completion[:-1], ex.completion[-1]["content"]))
    return pairs


def _batch_loss(model, tokenizer, examples: list[SFTExample], max_length: int, packing: bool, completion_only: bool = True):
    """The loss of one batch on its target tokens (:func:`rlalign.lm.encoding.example_tokens`) and its stats (mean nll, counted tokens)."""
    device = next(model.parameters()).device
    batch = (pack_sft if packing else collate_sft)(tokenizer, examples, max_length, completion_only)
    logits = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=None if batch.attention_mask is None else batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
    ).logits  # (B, T, V)
    targets = batch.input_ids[:, 1:].to(device)  # (B, T - 1)
    logp = token_logprobs(logits[:, :-1], targets)  # (B, T - 1)
    return sft_loss(logp, batch.loss_mask.to(device))


@torch.no_grad()
def _eval_loss(model, tokenizer, examples: list[SFTExample], cfg: SFTConfig) -> float:
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0.0
    for start in range(0, len(examples), cfg.eval_batch_size):
        chunk = examples[start : start + cfg.eval_batch_size]
        _, stats = _batch_loss(model, tokenizer, chunk, max_length(cfg), False, cfg.data.completion_only_loss)
        total += float(stats.nll) * float(stats.tokens)
        tokens += float(stats.tokens)
    model.train(was_training)
    return total / max(tokens, 1.0)


def _evaluate(model, tokenizer, eval_set: list[SFTExample], spec: _EvalSpec, cfg: SFTConfig) -> dict[str, float]:
    metrics = {"eval/loss": _eval_loss(model, tokenizer, eval_set, cfg)}
    pairs = generation_pairs(eval_set)
    if pairs:
        reward_fn = spec.reward_fn or exact_match()  # each eval pair against its own completion
        with distributed.gathered(model):  # FSDP2: full parameters for the decode loops
            metrics["eval/reward"], _ = generation_eval(model, tokenizer, [p for p, _ in pairs], reward_fn, spec.max_new_tokens, spec.temperature,
                                                        cfg.eval_batch_size, cfg.seed, columns={"answer": [a for _, a in pairs]})
    return metrics


def train(cfg: SFTConfig, resume: str | Path | None = None) -> dict[str, float]:
    """Run SFT; returns the final metrics (``eval/reward_initial``, ``eval/reward``, ``eval/loss``, ``time/total``)."""
    run = start_run(cfg, cfg.batch_size, "batch_size", resume)
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        train_set, eval_set, eval_spec = _datasets(cfg, run.tokenizer)
        if run.world.is_main:
            print(cut_report(run.tokenizer, train_set[:2048] + eval_set, max_length(cfg), cfg.data.completion_only_loss))
            if eval_spec.reward_fn is None and (report := length_report(run.tokenizer, eval_set, eval_spec.max_new_tokens)):
                print(report)
        model = run.load_policy(cfg.model)
        if cfg.data.packing and not packs_rows(model):
            config = model.config
            raise ConfigError(f"data.packing: true needs a model whose attention keeps packed examples apart ({', '.join(sorted(PACKED_ROWS_MODEL_TYPES))} "
                              f"under {' or '.join(sorted(PACKED_ROWS_KERNELS))} attention); this model is {config.model_type!r} under "
                              f"{config._attn_implementation!r}, where packed examples would attend to each other: set data.packing=false")

        def batch_loss(trained, examples: list[SFTExample]):
            loss, stats = _batch_loss(trained, run.tokenizer, examples, max_length(cfg), cfg.data.packing, cfg.data.completion_only_loss)
            return loss, {"loss/sft": float(loss.detach())}, float(stats.tokens)  # a mean over completion tokens

        def evaluate(model) -> dict[str, float]:
            return _evaluate(model, run.tokenizer, eval_set, eval_spec, cfg)

        headline = "eval/reward" if generation_pairs(eval_set) else "eval/loss"  # plain texts have no prompt to complete
        return supervised_loop(cfg, run, model, train_set, batch_loss, evaluate, "sft", headline, "tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "configs/sft_arithmetic.yaml", "optim.lr=1e-3 max_steps=50", SFTConfig)


def run(args: argparse.Namespace) -> int:
    return run_supervised_command(SFTConfig, train, args)
