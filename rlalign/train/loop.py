"""One run lifecycle for every LM trainer (SFT, reward model, GRPO, PPO): start, resume, the step
loop, checkpoints, the final model.

    run = start_run(cfg, global_batch, "batch_size", resume)   # process group, seeds, run dir, base model, tokenizer, checkpoint
    updater = Updater.create(run.load_policy(cfg.model), cfg.optim, total_updates, run.world, sharding)
    state = resume_state(run.checkpoint, cfg.seed, {"policy": updater}, run.world)
    history, final_dir = run_steps(step_fn, cfg, run, state, SavedModels(updater.module), {"policy": updater}, ...)

A checkpoint after ``n`` steps is ``<output_dir>/checkpoints/step_<n>`` (weights and tokenizer in
``model/``, every updater's optimiser and schedule, the RNGs and the sampling generator, the
config, the fingerprints of the run's inputs); ``--resume DIR`` (a checkpoint, or a run directory: its latest)
continues with step ``n``, so a resumed run is the uninterrupted one. The trained model ends in ``<output_dir>/final``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlalign.config import Config, ConfigError, fields_help, load_config
from rlalign.errors import RLAlignError
from rlalign.lm.data import PromptExample
from rlalign.lm.model_modes import enable_gradient_checkpointing
from rlalign.lm.models import context_length, dropout_as_loaded, hold_matmul_weights, load_policy, load_reference, load_tokenizer, resolve_model_path
from rlalign.train import distributed
from rlalign.train.common import is_adapter_dir, prepare_model_path
from rlalign.train.checkpoints import Checkpoint, CheckpointError, disk_full, latest_checkpoint, load_checkpoint, replace_dir, save_checkpoint
from rlalign.train.metrics import MetricsLogger, plot_metrics, read_metrics
from rlalign.train.rl_eval import evaluate_policy, load_eval_prompts, tool_evaluator
from rlalign.train.rollouts import RewardTerm, build_rewards, check_prompt_lengths, load_prompt_set
from rlalign.train.run_config import ModelConfig
from rlalign.train.run_dir import claim_run_dir, run_inputs
from rlalign.train.seeding import restore_rng_state, rng_state, set_seed
from rlalign.train.updater import NonFiniteError, Updater

__all__ = [
    "Run",
    "start_run",
    "RLRun",
    "start_rl_run",
    "check_world",
    "TrainState",
    "resume_state",
    "SavedModels",
    "write_checkpoint",
    "save_final",
    "run_steps",
    "UpdateMeans",
    "step_timings",
    "RLResult",
    "add_run_arguments",
    "summary_line",
    "print_summary",
    "run_supervised_command",
]

StepFn = Callable[["TrainState"], tuple[dict[str, float], list[dict]]]


# ----------------------------------------------------------------------------------------------
# Start
# ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    """A run's place and start: this process among the others, its directory, the starting model,
    its tokenizer, and the checkpoint it resumes from (None for a fresh run)."""

    world: distributed.World
    run_dir: Path
    base_path: Path
    tokenizer: Any
    device: str  # this rank's device
    checkpoint: Checkpoint | None = None
    lock: Any = field(default=None, repr=False)  # the open lock file of run_dir (rank 0), held for the run's life
    adapter_path: Path | None = None  # a saved LoRA adapter the policy keeps training (model.adapter: train)
    inputs: dict[str, dict[str, str]] | None = None  # rank 0: the fingerprints of the run's inputs, kept in its checkpoints

    def load_policy(self, model_cfg: ModelConfig) -> nn.Module:
        """The trained causal LM: from the checkpoint when resuming (LoRA adapters included), else the
        start: the base with optional fresh LoRA, or the saved adapter to train on its base."""
        m = model_cfg
        path = self.checkpoint.model_dir if self.checkpoint else (self.adapter_path or self.base_path)
        lora = m.lora if self.checkpoint is None or is_adapter_dir(path) else None  # a resumed adapter keeps lora.dropout
        policy = load_policy(path, m.dtype, self.device, lora, m.gguf_file, m.attn_implementation)
        return enable_gradient_checkpointing(policy) if m.gradient_checkpointing else policy

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        """Let go of the output directory's lock (rank 0): the run is over, however it ended."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def load_reference(self, model_cfg: ModelConfig, path: str | None) -> nn.Module | None:
        """The frozen reference (sharded under FSDP2), or None for LoRA without ``path``: the base with adapters off serves.
        Under ``model.autocast: bfloat16`` its matmul weights are held in bfloat16 (:func:`hold_matmul_weights`: the values
        autocast would cast them to, so its log-probs equal the policy's at equal weights; no cast per forward, about half
        the memory, a faster reference pass)."""
        if (model_cfg.lora is not None and path is None) or self.world.producer is not None:  # a producer rank computes no KL
            return None
        reference = load_reference(path or self.base_path, model_cfg.dtype, self.device, model_cfg.gguf_file, model_cfg.attn_implementation)
        if model_cfg.autocast != "none":
            hold_matmul_weights(reference, model_cfg.autocast)
        return distributed.shard_frozen(reference, self.world, model_cfg.sharding)

    @property
    def model_path(self) -> Path:
        """Where the trained model's weights come from: the checkpoint's when resuming, else the start."""
        return self.checkpoint.model_dir if self.checkpoint else self.base_path


def producer_ranks(cfg: Config) -> int:
    """How many torchrun ranks only make rollouts (``async_rollouts.producers``, when asynchronous)."""
    a = getattr(cfg, "async_rollouts", None)
    return a.producers if a is not None and a.enabled else 0


def start_run(cfg: Config, global_batch: int, batch_field: str, resume: str | Path | None = None) -> Run:
    """Join the process group (under torchrun), check that ``global_batch`` (the config's
    ``batch_field``) splits evenly across it, set threads and seeds, create the run directory, build
    or find the starting model (rank 0 first), load its tokenizer and the checkpoint ``resume``
    (a checkpoint dir, or a run dir: its latest). ``cfg`` has output_dir, seed, num_threads and model."""
    world = distributed.init(cfg.model.device, producer_ranks(cfg), cfg.ddp_timeout)  # one process unless launched by torchrun
    if global_batch % world.size:
        raise ConfigError(f"{batch_field}={global_batch} must be a multiple of the number of processes ({world.size})")
    if getattr(cfg, "save_merged", False) and cfg.model.lora is not None and cfg.model.sharding == "fsdp" and world.distributed:
        raise ConfigError("save_merged=true is not supported with model.sharding=fsdp: leave it false and merge the saved adapter afterwards")
    checkpoint = None if resume is None else load_checkpoint(resume)  # a bad path fails before anything is built
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    set_seed(cfg.seed)
    run_dir, lock, inputs = Path(cfg.output_dir), None, None
    try:
        with world.main_first():
            if world.is_main:
                lock = claim_run_dir(cfg, checkpoint)  # the run's lock, let go of by Run.__exit__
                inputs = run_inputs(cfg, checkpoint)  # before anything reads them
            base_path = prepare_model_path(cfg.model, run_dir)
        tokenizer = load_tokenizer(base_path, cfg.model.gguf_file)
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer of {base_path} has no EOS token, so no completion could end: set eos_token in its tokenizer_config.json")
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    adapter_path = resolve_model_path(cfg.model.path).resolve() if cfg.model.adapter == "train" and cfg.model.path and is_adapter_dir(resolve_model_path(cfg.model.path)) else None
    return Run(world, run_dir, base_path, tokenizer, world.device(cfg.model.device), checkpoint, lock, adapter_path, inputs)


@dataclass
class RLRun(Run):
    """What GRPO and PPO build before their first step (:func:`start_rl_run`): a :class:`Run` with the prompts and the reward terms."""

    prompts: list[PromptExample] = field(default_factory=list)
    rewards: list[RewardTerm] = field(default_factory=list)
    eval_prompts: list[PromptExample] = field(default_factory=list)  # held-out prompts; empty: no evaluation

    def evaluator(self, cfg, policy: nn.Module, environment: object | None = None, tools: Mapping[str, Callable] | None = None,
                  ) -> Callable[[int], tuple[dict[str, float], list[dict]]] | None:
        """``evaluate(step)`` for :func:`run_steps`: ``policy`` (unwrapped) on the held-out prompts
        (:func:`rlalign.train.rl_eval.evaluate_policy`; episodes with a ``tools:`` section, ``tools`` the
        functions given to ``train``, an ``environment:`` section, ``environment`` the object given to
        ``train``, or an ``agent:`` section); None without held-out prompts."""
        if not self.eval_prompts:
            return None
        if getattr(cfg, "tools", None) is not None:  # multi-turn episodes with the tools: success, pass@k, a table of episodes
            return tool_evaluator(cfg, policy, self.tokenizer, self.eval_prompts, self.rewards, tools)
        if getattr(cfg, "environment", None) is not None:  # episodes against the environment: success, pass@k, a table of episodes
            from rlalign.train.env_source import episode_evaluator

            return episode_evaluator(cfg, policy, self.tokenizer, self.eval_prompts, self.rewards, environment)
        if getattr(cfg, "agent", None) is not None:  # the agent's episodes against the policy served for evaluation
            from rlalign.agents.agent_source import agent_evaluator

            return agent_evaluator(cfg, policy, self.tokenizer, self.eval_prompts, self.rewards)
        return lambda step: evaluate_policy(
            policy, self.tokenizer, self.eval_prompts, self.rewards, cfg.eval, cfg.sampling.max_new_tokens, cfg.model, cfg.seed, self.world, step, cfg.steps
        )


def start_rl_run(cfg, resume: str | Path | None, prompts: Sequence[dict] | None, reward_functions: Sequence[RewardTerm], rows_per_step: int, minibatches: int,
                 rewards_required: bool = True) -> RLRun:
    """:func:`start_run`, then the prompts and the reward terms. Shared by GRPO, PPO and distillation (``cfg``: an
    :class:`rlalign.train.rl_config.RLConfig`); ``rewards_required`` False: a run without reward terms has none (distillation logs them only)."""
    check_world(distributed.init(cfg.model.device, producer_ranks(cfg), cfg.ddp_timeout), cfg.prompts_per_step, rows_per_step, minibatches,
                cfg.eval.num_prompts if cfg.eval.enabled else 0)  # before anything is built
    run = start_run(cfg, cfg.prompts_per_step, "prompts_per_step", resume)
    with contextlib.ExitStack() as on_error:
        on_error.push(run.__exit__)  # bad prompts or rewards: let go of the lock
        prompt_set = load_prompt_set(cfg.data, prompts)
        eval_prompts = load_eval_prompts(cfg.eval, cfg.data) if prompts is None or cfg.eval.data is not None else []  # Python prompts: eval.data or none
        context = context_length(run.base_path, cfg.model.gguf_file)
        check_prompt_lengths(prompt_set, run.tokenizer, context, cfg.sampling.max_new_tokens)
        check_prompt_lengths(eval_prompts, run.tokenizer, context, cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens)
        rewards_required = rewards_required and getattr(cfg, "environment", None) is None  # an environment may give the only reward
        wanted = rewards_required or cfg.rewards or reward_functions
        rewards = build_rewards(cfg.rewards, prompt_set, run.tokenizer, cfg.model, reward_functions, run.world) if wanted else []
        on_error.pop_all()
    return RLRun(**vars(run), prompts=prompt_set, rewards=rewards, eval_prompts=eval_prompts)


def check_world(world: distributed.World, prompts_per_step: int, rows_per_step: int, num_minibatches: int, eval_prompts: int = 0) -> None:
    """Under torchrun each rank takes an equal share of the prompts, and of every minibatch, and at least one held-out prompt."""
    if prompts_per_step % world.size:
        raise ConfigError(f"prompts_per_step={prompts_per_step} must be a multiple of the number of processes ({world.size})")
    if eval_prompts and eval_prompts < world.size:
        raise ConfigError(f"eval.num_prompts={eval_prompts} is fewer than the {world.size} processes: give it at least {world.size}, or 0 for no evaluation")
    local_rows = rows_per_step // world.size
    if local_rows % num_minibatches:
        raise ConfigError(
            f"num_minibatches={num_minibatches} must divide each process's {local_rows} rows ({rows_per_step} rows over {world.size} processes)"
        )


# ----------------------------------------------------------------------------------------------
# State, checkpoints, final model
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Restored by a checkpoint besides weights and optimisers: steps done (the data position is
    step * batch) and the generator that draws samples and minibatch orders (in step on every
    rank). ``world``: this process's place under torchrun (one process by default)."""

    step: int
    generator: torch.Generator
    world: distributed.World = field(default_factory=distributed.World)
    data_position: int | None = None  # examples drawn so far, when a step may draw more than its batch (dynamic sampling); None: step * batch

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), **({"data_position": self.data_position} if self.data_position is not None else {})}


def resume_state(ckpt: Checkpoint | None, seed: int, updaters: dict[str, Updater], world: distributed.World = distributed.World()) -> TrainState:
    """A fresh TrainState, or the checkpoint's: optimisers, schedules, RNGs, generator, step."""
    state = TrainState(step=0, generator=torch.Generator().manual_seed(seed), world=world)
    if ckpt is not None:
        missing = [name for name in updaters if f"updater/{name}" not in ckpt.extra]
        if missing:
            raise CheckpointError(
                f"cannot resume from {ckpt.path}: it holds no optimiser state for {', '.join(missing)} (a checkpoint of another "
                "trainer, or of an rlalign older than this run lifecycle); to start from its weights instead, set model.path to its model/ directory"
            )
        for name, updater in updaters.items():
            updater.load_state_dict(ckpt.extra[f"updater/{name}"])
        ranks = ckpt.extra.get("rng/ranks")  # each learner's own RNGs (its LoRA dropout drew as many numbers as its rows' tokens)
        restore_rng_state(ranks[world.rank] if ranks and len(ranks) == world.size and world.producer is None else ckpt.rng)
        state.generator.set_state(ckpt.extra["generator"])
        state.step = ckpt.step
        state.data_position = ckpt.extra.get("data_position")
    return state


class SavedModels:
    """What a checkpoint's ``model/`` holds: the policy, and other models in named subdirectories
    (PPO's critic), so one atomic :func:`rlalign.train.checkpoints.save_checkpoint` writes them all."""

    def __init__(self, policy: nn.Module, **others: nn.Module):
        self.policy, self.others = policy, others
        self.states: dict[str, dict | None] = {}  # full weights gathered by gathered() (FSDP2), else empty

    @contextlib.contextmanager
    def gathered(self) -> Iterator[SavedModels]:
        """Inside the block, every model's full weights gathered when FSDP2 shards it (collective: call
        on every rank), for :meth:`save_pretrained`; let go of after it."""
        self.states = {"policy": distributed.model_state(self.policy), **{name: distributed.model_state(m) for name, m in self.others.items()}}
        try:
            yield self
        finally:
            self.states = {}

    def save_pretrained(self, path: str | Path, merged: bool = False) -> None:
        """Every model's weights; a LoRA policy as its adapter, or with ``merged`` as the full model
        (a merged copy: the trained policy keeps its adapters)."""
        with dropout_as_loaded(self.policy, *self.others.values()):  # config.json as loaded: training zeroes its dropout
            if merged and hasattr(self.policy, "merge_and_unload"):
                if self.states.get("policy") is not None:
                    raise ConfigError("save_merged is not supported with sharding: fsdp; merge the saved adapter afterwards")
                copy.deepcopy(self.policy).merge_and_unload().save_pretrained(path)
            else:
                self.policy.save_pretrained(path, state_dict=self.states.get("policy"))
            for name, model in self.others.items():
                model.save_pretrained(Path(path) / name, state_dict=self.states.get(name))


def write_checkpoint(run_dir: Path, cfg: Config, state: TrainState, models: SavedModels, updaters: dict[str, Updater], tokenizer,
                     data_position: int, extra: dict[str, Any], inputs: dict[str, dict[str, str]] | None = None) -> None:
    """Checkpoint after ``state.step`` steps (named by it): weights, optimisers and schedules of
    every updater, RNGs (under torchrun every learner's: each restores its own), the generator, ``extra`` (e.g. the KL controller) and ``inputs`` (:attr:`Run.inputs`).
    Rank 0 writes (every rank holds the same weights and optimiser state under DDP); the others wait."""
    with models.gathered():  # collective under FSDP2, like the optimiser states below
        ranks = {"rng/ranks": distributed.gather_objects([rng_state()], state.world)} if state.world.distributed else {}  # every learner's RNGs
        extra = {**extra, **ranks, **state.state_dict(), **{f"updater/{name}": u.state_dict() for name, u in updaters.items()}}
        with state.world.main_first(learners_only=True):  # the others wait, and stop with one message if rank 0 cannot write
            if state.world.is_main:
                save_checkpoint(run_dir, state.step, models, None, None, tokenizer, cfg, data_position, extra, cfg.keep_last, inputs)


def save_final(run_dir: Path, models: SavedModels, tokenizer, world: distributed.World = distributed.World(), merged: bool = False) -> Path:
    """The trained model(s) in ``run_dir/final`` with the tokenizer (rank 0 writes), atomically like a
    checkpoint: written beside it, fsynced, renamed into place. A full model is an ordinary HF
    checkpoint; a LoRA policy is its adapter (peft format, naming its base), or with ``merged`` the
    full model with the adapter merged."""
    final = run_dir / "final"
    with models.gathered(), world.main_first(learners_only=True):  # the others wait, and stop with one message if rank 0 cannot write
        if world.is_main:
            tmp = run_dir / f".tmp_final_{os.getpid()}"
            try:
                models.save_pretrained(tmp, merged)
                tokenizer.save_pretrained(tmp)
                replace_dir(tmp, final)
            except BaseException as err:
                full = disk_full(err, tmp)
                shutil.rmtree(tmp, ignore_errors=True)
                if full is not None:
                    raise full from err
                raise
    return final


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def run_steps(
    step_fn: StepFn,
    cfg: Config,
    run: Run,
    state: TrainState,
    models: SavedModels,
    updaters: dict[str, Updater],
    *,
    total_steps: int,
    batch_size: int,
    summary_keys: tuple[str, ...],
    plot_keys: tuple[str, ...] = (),
    sample_every: int = 1,
    checkpoint_extra: Callable[[], dict[str, Any]] = dict,
    first_record: dict[str, float] | None = None,
    evaluate: Callable[[int], tuple[dict[str, float], list[dict]]] | None = None,
    eval_every: int = 0,
    source=None,
) -> tuple[list[dict[str, float]], Path]:
    """The outer loop of every trainer: ``step_fn`` until ``total_steps``, each step's metrics
    logged (``first_record`` before the first, as step ``state.step - 1``), the samples it returns
    every ``sample_every`` steps, a checkpoint every ``cfg.save_every`` steps and at the end, then
    the final model and the curves of ``plot_keys``. ``batch_size``: examples (prompts) per step, for
    the checkpoint's data position. ``evaluate(step)`` -> (eval metrics, sample rows) runs before the
    first step of a fresh run (logged as step -1), after every ``eval_every``-th step (0: none between)
    and after the last; its rows go to ``eval_samples.jsonl`` and the trackers' table ``eval/samples``.
    ``source``: the rollout source the steps read (:mod:`rlalign.train.sources`), closed when the
    steps end, however they end (an asynchronous one stops its producer).
    On a producer rank (``async_rollouts.producers``) the steps are the learners': it makes rollouts
    (``source.produce()``) and returns no metrics and no final dir.
    Returns (this call's metrics, final dir)."""
    try:
        if run.world.producer is not None:
            source.produce()
            return [], None
        return _run_steps(step_fn, cfg, run, state, models, updaters, total_steps, batch_size, summary_keys, plot_keys, sample_every, checkpoint_extra,
                          first_record, evaluate, eval_every)
    finally:
        if source is not None:
            source.close()


def _run_steps(step_fn, cfg, run, state, models, updaters, total_steps, batch_size, summary_keys, plot_keys, sample_every, checkpoint_extra,
               first_record, evaluate, eval_every) -> tuple[list[dict[str, float]], Path]:
    history: list[dict[str, float]] = []
    is_main = state.world.is_main
    if run.checkpoint is not None and state.step >= total_steps and is_main:  # a checkpoint past the end was refused (run_dir.check_resumable)
        print(f"{run.checkpoint.path} is at step {state.step}, this run's end: no steps to run; its weights are written to "
              f"{run.run_dir / 'final'}", file=sys.stderr, flush=True)

    def evaluation(step: int, log: MetricsLogger) -> dict[str, float]:
        metrics, rows = evaluate(step)
        if rows and is_main:
            with (run.run_dir / "eval_samples.jsonl").open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            log.log_samples(step, "eval/samples", rows)
        return metrics

    with StopRequests() as stops, MetricsLogger(run.run_dir, total_steps, cfg.progress, cfg.report_to, run.run_dir.name, state.step, enabled=is_main, config=cfg.model_dump(mode="json")) as log:
        if evaluate is not None and state.step == 0:
            first_record = {**(first_record or {}), **evaluation(-1, log)}
        if first_record is not None:
            log.log(state.step - 1, first_record)
        gpu = torch.device(cfg.model.device) if torch.device(cfg.model.device).type == "cuda" else None
        gpu = torch.device("cuda", torch.cuda.current_device()) if gpu is not None and gpu.index is None else gpu  # this rank's (torchrun set it)
        while state.step < total_steps:
            if gpu is not None:
                torch.cuda.reset_peak_memory_stats(gpu)
            try:
                metrics, samples = step_fn(state)
                if gpu is not None:  # the step's peak on this process's GPU: sampling, passes and updates
                    metrics["memory/peak_mb"] = torch.cuda.max_memory_allocated(gpu) / 2**20
            except NonFiniteError as err:
                last = latest_checkpoint(run.run_dir)
                raise NonFiniteError(
                    f"step {state.step} stopped: {err}; no weights of this step were written. "
                    f"The last good checkpoint is {last if last else 'none (the run has not saved one)'}"
                ) from None
            if evaluate is not None and ((eval_every and (state.step + 1) % eval_every == 0) or state.step + 1 == total_steps):
                metrics.update(evaluation(state.step, log))
            log.log(state.step, metrics, summary_keys=summary_keys)
            if (state.step + 1) % sample_every == 0:  # the first rows of the global batch: every rank's share, in order
                samples = distributed.gather_objects(samples or [], state.world)[: getattr(cfg, "num_samples_logged", None)]
                if samples and is_main:
                    with (run.run_dir / "samples.jsonl").open("a") as f:
                        f.writelines(json.dumps(row) + "\n" for row in samples)
            history.append({"step": state.step, **metrics})
            state.step += 1
            stop = distributed.all_max(float(stops.signal is not None), state.world) > 0  # every rank stops at the same step
            if (cfg.save_every and state.step % cfg.save_every == 0) or state.step == total_steps or stop:
                position = state.step * batch_size if state.data_position is None else state.data_position
                write_checkpoint(run.run_dir, cfg, state, models, updaters, run.tokenizer, position, checkpoint_extra(), run.inputs)
            if stop:
                raise RunStopped(
                    f"stopped by {stops.signal or 'a signal to another process'} after step {state.step - 1}, saved in "
                    f"{latest_checkpoint(run.run_dir)}; continue with --resume {run.run_dir}", stops.exit_code
                )
    final_dir = save_final(run.run_dir, models, run.tokenizer, state.world, getattr(cfg, "save_merged", False))
    if plot_keys and is_main:  # rank 0 draws; each panel from the steps its metric was logged at (eval metrics: the evaluations)
        records = read_metrics(run.run_dir / "metrics.jsonl")
        present = [k for k in dict.fromkeys(plot_keys) if any(r.get(k) is not None for r in records)]
        if present:
            plot_metrics(run.run_dir / "metrics.jsonl", present, run.run_dir / "curves.png", f"{type(cfg).__name__.removesuffix('Config')} — {run.run_dir}")
    return history, final_dir


class RunStopped(RLAlignError):
    """SIGTERM or SIGINT stopped the run between two steps, after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequests:
    """Inside the block, SIGTERM and a first SIGINT (Ctrl-C) ask the run to stop after the current
    step (:func:`run_steps` then saves a checkpoint and raises :class:`RunStopped`); a second SIGINT
    interrupts at once. Outside the main thread signals cannot be caught: the block changes nothing."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.exit_code = 128 + signal.SIGTERM  # when another rank got the signal: stopped all the same
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal, self.exit_code = signal.Signals(signum).name, 128 + signum

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class UpdateMeans:
    """Means of the updates' statistics over one step, and the first update's ``ratio_dev``."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0
        self.first_ratio_dev: float | None = None

    def add(self, stats: dict[str, float]) -> None:
        if self.first_ratio_dev is None:
            self.first_ratio_dev = stats.get("ratio_dev")
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.count += 1

    def means(self) -> dict[str, float]:
        return {key: value / self.count for key, value in self.sums.items()}


def step_timings(generate_s: float, score_s: float, t0: float, t2: float, t3: float, tokens: float, t_ref: float, t_old: float, sync_s: float = 0.0) -> dict[str, float]:
    """time/generate and time/score (the source's sampling and scoring of the batch: in a producer
    process under asynchronous rollouts, overlapped with training), time/rollout (t0..t2: the learner's
    wait for its batch; synchronous: the sampling and scoring themselves), time/train (t2..t3: all of the
    rest), and inside it time/reference (t2..t_ref: the reference pass), time/old_logp (t_ref..t_old: the
    pi_old recompute, 0 when none), time/update (t_old..t3) and time/weight_sync (``sync_s``: publishing
    the new weights to a producer); tokens_per_s is completion tokens over t0..t3."""
    return {
        "time/generate": generate_s,
        "time/score": score_s,
        "time/rollout": t2 - t0,
        "time/train": t3 - t2,
        "time/reference": t_ref - t2,
        "time/old_logp": t_old - t_ref,
        "time/update": t3 - t_old,
        "time/weight_sync": sync_s,
        "tokens_per_s": tokens / max(t3 - t0, 1e-9),
    }


@dataclass
class RLResult:
    """What :func:`rlalign.train.grpo.train` and :func:`rlalign.train.ppo.train` return."""

    policy: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)  # one metrics dict per step run by this call
    output_dir: Path | None = None
    final_dir: Path | None = None
    critic: nn.Module | None = None  # PPO's value model

    def summary(self, keys: Sequence[str]) -> str:
        """One JSON line: the run and final directories, the steps run, and the last step's ``keys`` (a producer rank
        trains nothing: no final directory, no steps)."""
        last = self.history[-1] if self.history else {}
        summary = {"output_dir": str(self.output_dir), "final": str(self.final_dir) if self.final_dir else None, "steps_run": len(self.history)}
        summary.update({k: round(last[k], 4) if math.isfinite(last[k]) else None for k in keys if k in last})
        return json.dumps(summary, allow_nan=False)


def add_run_arguments(parser, recipe: str, example: str, config_cls: type[Config] | None = None) -> None:
    """The command line of every LM trainer: ``--config RECIPE``, ``--resume DIR`` and dotted
    overrides; ``--help`` lists every field of ``config_cls``."""
    parser.add_argument("--config", help=f"YAML recipe, e.g. {recipe}")
    parser.add_argument("--resume", metavar="DIR", help="checkpoint directory (or run directory: its latest checkpoint) to continue from")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help=f"dotted overrides, e.g. {example}")
    if config_cls is not None:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        command = parser.prog.removeprefix("rlalign ")
        parser.epilog = (
            f"config fields (set them in the --config YAML, or override them as key.sub=value; "
            f"'rlalign config {command}' prints them all as a YAML file):\n{fields_help(config_cls)}"
        )


def summary_line(output_dir: str | Path, metrics: dict[str, float]) -> str:
    """One JSON line ending a supervised run: its run and final directories and its final ``metrics``."""
    summary = {"output_dir": str(output_dir), "final": str(Path(output_dir) / "final")}
    summary.update({k: round(v, 4) if math.isfinite(v) else None for k, v in metrics.items()})
    return json.dumps(summary, allow_nan=False)


def run_supervised_command(config_cls: type[Config], train: Callable[..., dict[str, float]], args: argparse.Namespace) -> int:
    """The command of a supervised trainer (SFT, RM, DPO): load the config, train (or resume), print :func:`summary_line`."""
    cfg = load_config(config_cls, args.config, args.overrides)
    print_summary(summary_line(cfg.output_dir, train(cfg, resume=args.resume)))
    return 0


def print_summary(line: str) -> None:
    """Print a run's closing JSON line, once: in a process group global rank 0 alone prints it (torchrun's
    ranks share one standard output, where N copies would interleave and the last line would not parse)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0:
        print(line, flush=True)
