"""The loop SFT and reward-model training share: minibatches of a fixed dataset, AdamW, evaluation.

    run = start_run(cfg, cfg.batch_size, "batch_size")      # process group, seeds, run dir, starting model, tokenizer
    resumed = load_checkpoint(cfg.resume_from) if cfg.resume_from else None
    model = load(resumed.model_dir if resumed else run.base_path)
    return supervised_loop(cfg, run, model, resumed, train_set, batch_loss, evaluate, "sft", "eval/reward", "tokens")

Each step: the next ``batch_size`` examples of a per-epoch permutation (this rank's share under
torchrun), ``batch_loss`` (the task's loss, stats, and the count its mean is over), backward,
gradient clipping, AdamW, schedule. Every ``eval_every`` steps and at the end ``evaluate``; every
``save_every`` steps and at the end a checkpoint; then the model in ``<output_dir>/final``.
:mod:`rlalign.train.sft` and :mod:`rlalign.train.reward_model` supply the three task pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from rlalign.config import Config
from rlalign.train import distributed
from rlalign.train.common import (
    Checkpoint,
    MetricsLogger,
    Run,
    batch_order,
    forward_precision,
    make_optimizer,
    restore_rng_state,
    save_checkpoint_from_ranks,
    save_model_from_ranks,
)

__all__ = ["supervised_loop"]


BatchLoss = Callable[[nn.Module, list], tuple[Tensor, dict[str, float], float]]


def supervised_loop(
    cfg: Config,
    run: Run,
    model: nn.Module,
    resumed: Checkpoint | None,
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
        model: loaded from ``resumed`` when resuming, else the starting model.
        batch_loss: ``(model, examples) -> (loss, stats, count)``: the loss of this rank's
            examples, its statistics (``loss/<name>`` and means), and what the mean is over
            (tokens, pairs), which makes the loss global under torchrun (``loss_scale``).
        evaluate: held-out metrics of the (unwrapped) model; every rank runs it (FSDP2 forwards
            are collective) and gets the same numbers; rank 0 logs them.
        headline: the ``evaluate`` metric recorded before training as ``<headline>_initial``.
        count_name: metric name of the global count per step (``tokens``, ``pairs``).
    """
    world = run.world
    trained = distributed.wrap(model, world, cfg.model.sharding)  # under torchrun: DDP, or sharded in place by FSDP2
    model = distributed.unwrap(trained)  # for evaluation and saving, which need no gradient sync
    optimizer, scheduler = make_optimizer(trained.parameters(), cfg.optim, cfg.max_steps)
    start_step, data_position = 0, 0
    if resumed is not None:
        distributed.load_optimizer_state(trained, optimizer, resumed.optimizer_state)
        scheduler.load_state_dict(resumed.scheduler_state)
        restore_rng_state(resumed.rng)
        start_step, data_position = resumed.step + 1, resumed.data_position
    initial = resumed.extra.get(f"{headline}_initial") if resumed else None
    if initial is None:
        with forward_precision(cfg.model, model):
            initial = evaluate(model)[headline]

    metrics: dict[str, float] = {}
    started = time.perf_counter()
    with MetricsLogger(run.run_dir, cfg.max_steps, cfg.progress, cfg.tensorboard, name, start_step, enabled=world.is_main) as log:
        log.log(start_step - 1, {headline: initial})
        for step in range(start_step, cfg.max_steps):
            t0 = time.perf_counter()
            indices = batch_order(len(train_set), data_position, cfg.batch_size, cfg.seed)  # the global batch
            data_position += cfg.batch_size
            with forward_precision(cfg.model, trained):  # bfloat16 autocast when model.autocast asks for it
                loss, stats, count = batch_loss(trained, [train_set[i] for i in indices[world.shard(len(indices))]])  # this rank's share
            scale = distributed.loss_scale(count, world)  # the mean over every rank's count; 1 in one process
            optimizer.zero_grad(set_to_none=True)
            (loss * scale).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trained.parameters(), cfg.optim.grad_clip or float("inf"))
            optimizer.step()
            scheduler.step()
            metrics = distributed.reduce_stats(stats, count, scale, world)
            metrics.update({
                "grad_norm": float(grad_norm),
                "lr": scheduler.get_last_lr()[0],
                count_name: float(distributed.all_sum(torch.tensor(float(count)), world)),
                "time/train": time.perf_counter() - t0,
            })
            last = step == cfg.max_steps - 1
            if (step + 1) % cfg.eval_every == 0 or last:
                with forward_precision(cfg.model, model):
                    metrics.update(evaluate(model))
            log.log(step, metrics, summary_keys=(f"loss/{name}", headline))
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or last:
                save_checkpoint_from_ranks(world, trained, model, optimizer, run.run_dir, step, scheduler=scheduler, tokenizer=run.tokenizer,
                                           config=cfg, data_position=data_position, extra={f"{headline}_initial": initial}, keep_last=cfg.keep_last)
    save_model_from_ranks(world, trained, model, run.tokenizer, run.run_dir / "final")
    result = {f"{headline}_initial": initial, "time/total": time.perf_counter() - started}
    result.update({k: v for k, v in metrics.items() if k.startswith("eval/")})
    return result
