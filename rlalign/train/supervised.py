"""The step SFT and reward-model training share: minibatches of a fixed dataset, AdamW, evaluation.

    run = start_run(cfg, cfg.batch_size, "batch_size", resume)   # process group, seeds, run dir, starting model, tokenizer, checkpoint
    model = load(run.model_path)
    return supervised_loop(cfg, run, model, train_set, batch_loss, evaluate, "sft", "eval/reward", "tokens")

Each step: the next ``batch_size`` examples of a per-epoch permutation (this rank's share under
torchrun), ``batch_loss`` (the task's loss, stats, and the count its mean is over), backward,
gradient clipping, AdamW, schedule (:class:`rlalign.train.updater.Updater`). Every ``eval_every``
steps and at the end ``evaluate``. The run around the steps (checkpoints every ``save_every`` steps
and at the end, ``--resume``, the model in ``<output_dir>/final``) is :func:`rlalign.train.loop.run_steps`,
as for GRPO and PPO. :mod:`rlalign.train.sft` and :mod:`rlalign.train.reward_model` supply the task pieces.
"""

from __future__ import annotations

import time
from functools import partial
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from pydantic import Field, model_validator

from rlalign.config import Config
from rlalign.train import distributed
from rlalign.train.common import forward_precision, memory_named
from rlalign.train.loop import Run, SavedModels, TrainState, resume_state, run_steps
from rlalign.train.run_config import OptimConfig, RunConfig
from rlalign.train.seeding import batch_order
from rlalign.train.updater import Updater

__all__ = ["SupervisedDataConfig", "SupervisedConfig", "supervised_loop"]


class SupervisedDataConfig(Config):
    """Where the examples come from: a built-in task, or a training source and an eval source, each a
    local JSON / JSONL / CSV / TSV / Parquet / Arrow file, a directory of such files or one written by
    ``save_to_disk``, or a Hugging Face Hub dataset name (read through ``datasets``)."""

    task: str | None = Field(None, description="built-in task used when train_file is null")
    train_file: str | None = Field(None, description="training examples: a file, a directory or a Hub dataset name; overrides task")
    eval_file: str | None = Field(None, description="held-out examples (required with train_file; may name the same dataset as train_file, with eval_split)")
    subset: str | None = Field(None, description="configuration (subset) of a Hub dataset")
    train_split: str = Field("train", description="split of train_file to read when it has several (a single file has one)")
    eval_split: str = Field("test", description="split of eval_file to read when it has several (a single file has one)")
    columns: dict[str, str] = Field(default_factory=dict, description="columns to rename before reading, {name in the data: name rlalign reads}, e.g. {question: prompt}")

    @model_validator(mode="after")
    def _source(self) -> SupervisedDataConfig:
        if self.train_file is None and self.task is None:
            raise ValueError("give data.task or data.train_file")
        if self.train_file is not None and self.eval_file is None:
            raise ValueError("data.eval_file is required with data.train_file")
        return self

    def load_files(self, loader: Callable[..., list]) -> tuple[list, list]:
        """(training examples, eval examples) read from the files by ``loader`` (e.g. ``load_sft``)."""
        return (
            loader(self.train_file, split=self.train_split, subset=self.subset, columns=self.columns),
            loader(self.eval_file, split=self.eval_split, subset=self.subset, columns=self.columns),
        )


class SupervisedConfig(RunConfig):
    """The fields of every supervised run (SFT, reward model); each sets its own defaults for some."""

    output_dir: str = Field("runs/supervised", description="run directory: metrics.jsonl, checkpoints/, final/")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and schedule")
    batch_size: int = Field(32, ge=1, description="examples per step")
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    eval_every: int = Field(100, ge=1, description="evaluate every this many steps (and at the start and end)")
    eval_batch_size: int = Field(128, ge=1, description="examples per forward at eval")
    micro_batch_size: int | None = Field(
        None, ge=1, description="examples per forward and backward: each step accumulates its gradient over micro-batches of this many "
        "examples (the same update, less memory); null = the whole batch"
    )


BatchLoss = Callable[[nn.Module, list], tuple[Tensor, dict[str, float], float]]


def supervised_loop(
    cfg: SupervisedConfig,
    run: Run,
    model: nn.Module,
    train_set: Sequence,
    batch_loss: BatchLoss,
    evaluate: Callable[[nn.Module], dict[str, float]],
    name: str,
    headline: str,
    count_name: str,
) -> dict[str, float]:
    """Train ``model`` on ``train_set``; returns ``<headline>_initial``, the final ``eval/*`` and ``time/total``.

    Args:
        cfg: an SFT or reward-model config (optim, batch_size, max_steps, eval_every, save_every,
            keep_last, progress, tensorboard, model.sharding).
        model: loaded from ``run.model_path`` (the checkpoint's weights when resuming).
        batch_loss: ``(model, examples) -> (loss, stats, count)``: the loss of this rank's
            examples, its statistics (``loss/<name>`` and means), and what the mean is over
            (tokens, pairs), which makes the loss global under torchrun (``loss_scale``).
        evaluate: held-out metrics of the (unwrapped) model; every rank runs it (FSDP2 forwards
            are collective) and gets the same numbers; rank 0 logs them.
        name: the task's name in its loss metric, ``loss/<name>``, shown next to the progress bar.
        headline: the ``evaluate`` metric recorded before training as ``<headline>_initial``.
        count_name: metric name of the global count per step (``tokens``, ``pairs``).
    """
    world = run.world
    updater = Updater.create(model, cfg.optim, cfg.max_steps, world, cfg.model.sharding)  # under torchrun: DDP, or sharded in place by FSDP2
    model = updater.module  # for evaluation and saving, which need no gradient sync
    state = resume_state(run.checkpoint, cfg.seed, {"model": updater}, world)
    initial = run.checkpoint.extra.get(f"{headline}_initial") if run.checkpoint else None
    if initial is None:
        with forward_precision(cfg.model, model):
            initial = evaluate(model)[headline]

    def step(state: TrainState) -> tuple[dict[str, float], list[dict]]:
        t0 = time.perf_counter()
        indices = batch_order(len(train_set), state.step * cfg.batch_size, cfg.batch_size, cfg.seed)  # the global batch
        examples = [train_set[i] for i in indices[world.shard(len(indices))]]  # this rank's share
        size = cfg.micro_batch_size or len(examples)
        parts: list[tuple[dict[str, float], float, float]] = []  # (stats, weight, count) per micro-batch

        def micro_loss(micro: list) -> Callable[[], tuple[Tensor, float]]:
            def run() -> tuple[Tensor, float]:
                with forward_precision(cfg.model, updater.model):  # bfloat16 autocast when model.autocast asks for it
                    loss, stats, count = batch_loss(updater.model, micro)
                parts.append((stats, count, count))
                return loss, count

            return run

        # the step's gradient accumulated over micro-batches of cfg.micro_batch_size examples (the same update, less memory)
        micro_batches = [micro_loss(examples[s : s + size]) for s in range(0, len(examples), size)]
        with memory_named("the update's forward and backward", min(size, len(examples)), None, head_split=False, planned=False):
            grad_norm, scale = updater.accumulated_step(micro_batches, partial(distributed.loss_scale, world=world),
                                                        partial(distributed.loss_share, world=world))  # the mean over every rank's count
        count = sum(c for _, _, c in parts)
        metrics = distributed.reduce_stats(distributed.merge_micro_stats(parts), count, scale, world)
        metrics.update({
            "grad_norm": grad_norm,
            "lr": updater.lr,
            count_name: float(distributed.all_sum(torch.tensor(float(count)), world)),
            "time/train": time.perf_counter() - t0,
        })
        if (state.step + 1) % cfg.eval_every == 0 or state.step == cfg.max_steps - 1:
            with forward_precision(cfg.model, model):
                metrics.update(evaluate(model))
        return metrics, []

    started = time.perf_counter()
    history, _ = run_steps(
        step, cfg, run, state, SavedModels(model), {"model": updater},
        total_steps=cfg.max_steps, batch_size=cfg.batch_size, summary_keys=(f"loss/{name}", headline),
        plot_keys=(f"loss/{name}", "eval/loss", headline, "eval/margin", "grad_norm") if cfg.plots else (),  # the eval/* ones at their evaluations
        checkpoint_extra=lambda: {f"{headline}_initial": initial}, first_record=None if run.checkpoint else {headline: initial},
    )
    result = {f"{headline}_initial": initial, "time/total": time.perf_counter() - started}
    result.update({k: v for k, v in (history[-1] if history else {}).items() if k.startswith("eval/")})
    return result
