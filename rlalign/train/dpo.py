"""Direct preference optimisation: ``rlalign dpo --config configs/dpo_preference.yaml``.

    rho = log pi(y | x) - log pi_ref(y | x)                   summed over the response's tokens
    dpo     L = -log sigmoid(beta (rho_c - rho_r))             Rafailov et al. 2023
    cDPO    the same with label_smoothing eps > 0              Mitchell 2023
    ipo     L = (rho_c / |y_c| - rho_r / |y_r| - 1 / (2 beta))^2   Azar et al. 2023
    simpo   L = -log sigmoid(beta log pi(y_c) / |y_c| - beta log pi(y_r) / |y_r| - gamma)   Meng et al. 2024

(the pure functions and their conventions: :mod:`rlalign.core.preference`). Each step: a batch of
preference pairs, one forward of the policy over the 2B rows prompt + chosen and prompt + rejected
(each pair's prompt run once when not under torchrun, :func:`rlalign.lm.logprobs.completion_logprobs`,
the LM head only at response positions), the reference log-probs of the same rows, the loss, AdamW
(the step loop, micro-batches, checkpoints and ``--resume`` of :func:`rlalign.train.supervised.supervised_loop`).

The reference pi_ref: a frozen copy of the starting model (``reference: null``) or of the checkpoint
``reference`` names; with ``model.lora`` and no ``reference``, the policy's own base with its adapters
off (no second copy). ``precompute_ref_logprobs: true`` runs the reference once over the training and
held-out pairs before the first step (on every process, in batches of ``eval_batch_size``), keeps the
two numbers per pair and drops the reference model, so no reference is held or run while training.
SimPO loads none.

Data: TRL's preference type, as ``rlalign rm`` reads it (:func:`rlalign.lm.data.load_preferences`):
``{prompt, chosen, rejected}`` or ``{chosen, rejected}`` with an implicit prompt (the shared start is
the prompt, as TRL's ``extract_prompt`` splits it), text or messages; or the built-in preference task.
A response's tokens end with EOS; a pair longer than ``data.max_length`` loses the start of its prompt
first (:func:`rlalign.lm.encoding.collate_preference_completions`).

Metrics per step: ``loss/dpo`` (whichever loss), ``rewards/chosen`` and ``rewards/rejected`` (mean
implicit rewards beta * rho; SimPO: beta / |y| log pi(y)), ``rewards/margin`` (mean r_c - r_r),
``rewards/accuracy`` (fraction with r_c > r_r), ``logps/chosen`` and ``logps/rejected`` (mean summed
log pi(y)). Every ``eval_every`` steps, before the first and after the last: the same on the held-out
pairs as ``eval/loss``, ``eval/rewards/*`` and ``eval/logps/*``, and on the built-in task ``eval/reward``,
the mean hidden score of completions sampled at temperature 1 for the held-out pairs' prompts (the
ground truth the pairs were ranked by; the headline; with files the headline is ``eval/rewards/accuracy``).

Simplifications: no length-desensitised (LD-DPO) or weighted (WPO) variants, no reference-model
syncing (TR-DPO); precomputation does not shard the pairs over processes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from rlalign.core.preference import PreferenceStats, dpo_loss, ipo_loss, simpo_loss
from rlalign.lm.data import PreferenceExample, load_preferences
from rlalign.lm.encoding import PreferenceCompletionBatch, collate_preference_completions
from rlalign.lm.logprobs import completion_logprobs
from rlalign.lm.model_modes import evaluating
from rlalign.lm.models import reference_policy
from rlalign.tasks import TASKS
from rlalign.train import distributed
from rlalign.train.common import forward_precision, generation_eval
from rlalign.train.loop import add_run_arguments, start_run, run_supervised_command
from rlalign.train.passes import share_prompts
from rlalign.train.reward_model import RMDataConfig, pair_cut_report
from rlalign.train.run_config import OptimConfig
from rlalign.train.supervised import SupervisedConfig, supervised_loop

__all__ = ["DPODataConfig", "DPOConfig", "Pair", "sequence_logps", "reference_logps", "pair_logps", "preference_loss", "train", "add_arguments", "run"]


class DPODataConfig(RMDataConfig):
    """Where the preference pairs come from: as for the reward model (the same formats and sources)."""

    train_file: str | None = Field(
        None, description="TRL preference data: {prompt, chosen, rejected} or {chosen, rejected} (implicit prompt: their shared start), text or messages; "
        "a file, directory or Hub name; overrides task"
    )
    num_eval: int = Field(200, ge=1, description="number of built-in held-out pairs (their prompts are also the prompts of the eval/reward generations)")
    max_length: int | None = Field(
        None, ge=2, description="longest prompt + response in tokens (a longer pair loses the start of its prompt, then the ends of its responses; "
        "the share cut printed); null = 1024 for files (TRL's default), 64 for the built-in task"
    )


class DPOConfig(SupervisedConfig):
    """``rlalign dpo``: every field can be overridden on the command line as key.sub=value."""

    output_dir: str = Field("runs/dpo_preference", description="run directory: metrics.jsonl, checkpoints/, final/")
    data: DPODataConfig = Field(default_factory=DPODataConfig, description="training and held-out pairs")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10), description="AdamW and schedule")
    batch_size: int = Field(32, ge=1, description="pairs per step")
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    eval_every: int = Field(50, ge=1, description="evaluate on the held-out pairs every this many steps (and at the start and end)")
    eval_batch_size: int = Field(64, ge=1, description="pairs per forward at eval and when precomputing; prompts per sampling batch at eval")
    loss: Literal["dpo", "ipo", "simpo"] = Field(
        "dpo", description="dpo: -log sigmoid(beta h) (TRL's 'sigmoid'; conservative DPO with label_smoothing, which TRL 1.16's sigmoid ignores); ipo: (h_avg - 1/(2 beta))^2 on "
        "per-token average log-ratios; simpo: reference-free, length-normalised, with target margin gamma"
    )
    beta: float = Field(0.1, gt=0, description="inverse temperature of the implicit reward beta * log(pi / pi_ref) (IPO: the paper's tau; SimPO papers use 2-2.5)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="loss: dpo only: probability eps that a label is flipped (conservative DPO); 0 = plain DPO")
    gamma: float = Field(0.5, description="loss: simpo only: target reward margin gamma (absolute, not gamma / beta)")
    reference: str | None = Field(None, description="frozen reference checkpoint; null = the policy's start (LoRA: the base with adapters off); unused by simpo")
    precompute_ref_logprobs: bool = Field(
        False, description="run the reference once over the training and held-out pairs before training, keep their log-probs and drop the reference model"
    )
    max_new_tokens: int | None = Field(None, ge=1, description="tokens generated per held-out prompt for eval/reward (built-in task); null = the task's default")

    @model_validator(mode="after")
    def _options(self) -> DPOConfig:
        if self.label_smoothing and self.loss != "dpo":
            raise ValueError(f"label_smoothing (conservative DPO) applies to loss: dpo only, not loss: {self.loss}; set label_smoothing: 0")
        if self.loss == "simpo" and (self.reference is not None or self.precompute_ref_logprobs):
            raise ValueError("loss: simpo is reference-free: leave reference null and precompute_ref_logprobs false")
        return self


class Pair(NamedTuple):
    """A preference pair and, when precomputed, its reference log-probs (chosen, rejected). Shape: (2,)."""

    example: PreferenceExample
    ref_logps: Tensor | None = None


def sequence_logps(model: nn.Module, batch: PreferenceCompletionBatch, layout_from: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """(log pi(y | x) summed over each response's tokens, response lengths |y|) of the 2B rows,
    chosen first; each pair's prompt runs once where :func:`rlalign.train.passes.share_prompts` of
    ``layout_from`` (default ``model``; the policy for its reference) says so. ``model`` may be
    DDP-wrapped (the forward goes through it). Shape: (2B,), (2B,)."""
    device = next(model.parameters()).device
    mask = batch.completion_mask.to(device)  # (2B, C)
    share = share_prompts(model if layout_from is None else layout_from)
    pair_index = torch.arange(batch.num_pairs, device=device).repeat(2) if share else None  # (2B,): row b and row B + b share a prompt
    logp = completion_logprobs(model, batch.prompt_ids.to(device), batch.prompt_mask.to(device), batch.completion_ids.to(device), mask, 1.0, pair_index)  # (2B, C)
    return logp.sum(-1), mask.sum(-1).to(logp.dtype)


@torch.no_grad()
def reference_logps(policy: nn.Module, reference: nn.Module | None, batch: PreferenceCompletionBatch) -> Tensor:
    """Summed response log-probs under the frozen ``reference``, or ``policy``'s LoRA base (adapters off); ``policy`` as
    the updates run it (in DDP or not), whose layout the pass follows. Shape: (2B,)."""
    with reference_policy(distributed.unwrap(policy), reference) as ref, evaluating(ref), distributed.gathered(ref):
        return sequence_logps(ref, batch, policy)[0]  # laid out as the policy's: at equal weights, equal log-probs


def pair_logps(cfg: DPOConfig, tokenizer, model: nn.Module, reference: nn.Module | None, pairs: list[Pair]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(policy log-probs, response lengths, reference log-probs) of the pairs' 2B rows, chosen first:
    the reference's are the precomputed ones (``cfg.precompute_ref_logprobs``), the live ``reference``'s
    or, when it is None, those of ``model``'s LoRA base (adapters off); None for SimPO. Shape: (2B,) each."""
    batch = collate_preference_completions(tokenizer, [p.example for p in pairs], cfg.data.length_limit())
    logps, lengths = sequence_logps(model, batch)
    if cfg.loss == "simpo":
        return logps, lengths, None
    if cfg.precompute_ref_logprobs:
        return logps, lengths, torch.stack([p.ref_logps for p in pairs], dim=1).flatten().to(logps)  # (2, B) -> chosen, then rejected
    return logps, lengths, reference_logps(model, reference, batch).to(logps)


def preference_loss(cfg: DPOConfig, logps: Tensor, lengths: Tensor, ref_logps: Tensor | None) -> tuple[Tensor, PreferenceStats]:
    """``cfg.loss`` of the 2B rows (chosen first) from their summed log-probs and lengths (:mod:`rlalign.core.preference`)."""
    (chosen, rejected), (chosen_len, rejected_len) = logps.chunk(2), lengths.chunk(2)
    if cfg.loss == "simpo":
        return simpo_loss(chosen, rejected, chosen_len, rejected_len, cfg.beta, cfg.gamma)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    if cfg.loss == "ipo":
        return ipo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, cfg.beta)
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta, cfg.label_smoothing)


def _metrics(loss: Tensor, stats: PreferenceStats, logps: Tensor, prefix: str = "") -> dict[str, float]:
    """The step's metrics (``loss/dpo``, ``rewards/*``, ``logps/*``), or with ``prefix`` "eval/" the held-out ones (``eval/loss``, ...)."""
    chosen, rejected = logps.detach().chunk(2)
    return {
        "eval/loss" if prefix else "loss/dpo": float(loss.detach()),
        f"{prefix}rewards/chosen": float(stats.chosen_reward),
        f"{prefix}rewards/rejected": float(stats.rejected_reward),
        f"{prefix}rewards/margin": float(stats.margin),
        f"{prefix}rewards/accuracy": float(stats.accuracy),
        f"{prefix}logps/chosen": float(chosen.mean()),
        f"{prefix}logps/rejected": float(rejected.mean()),
    }


def _join(chunks: tuple[Tensor, ...]) -> Tensor:
    """Chunks of pairs' rows (each its chosen rows, then its rejected rows) as one: every chosen row, then every rejected row. Shape: (2B,)."""
    return torch.cat([torch.cat([chunk.chunk(2)[i] for chunk in chunks]) for i in (0, 1)])


def _datasets(cfg: DPOConfig) -> tuple[list[PreferenceExample], list[PreferenceExample]]:
    data = cfg.data
    if data.train_file is not None:
        return data.load_files(load_preferences)
    task = TASKS[data.task]
    return (
        load_preferences(task.preference_records("train", data.num_train, cfg.seed)),
        load_preferences(task.preference_records("eval", data.num_eval, cfg.seed)),
    )


def _precompute(policy: nn.Module, reference: nn.Module | None, tokenizer, examples: list[PreferenceExample], cfg: DPOConfig) -> list[Pair]:
    """Each example with its reference log-probs (chosen, rejected), in batches of ``cfg.eval_batch_size``."""
    pairs: list[Pair] = []
    with forward_precision(cfg.model, policy):
        for start in range(0, len(examples), cfg.eval_batch_size):
            chunk = examples[start : start + cfg.eval_batch_size]
            ref = reference_logps(policy, reference, collate_preference_completions(tokenizer, chunk, cfg.data.length_limit())).float().cpu()  # (2b,)
            pairs.extend(Pair(ex, torch.stack([c, r])) for ex, c, r in zip(chunk, *ref.chunk(2)))
    return pairs


def train(cfg: DPOConfig, resume: str | Path | None = None) -> dict[str, float]:
    """Run DPO (or IPO, cDPO, SimPO); returns the final held-out metrics, ``<headline>_initial`` and ``time/total``."""
    run = start_run(cfg, cfg.batch_size, "batch_size", resume)
    with run:  # the output_dir lock is let go of when the run ends, however it ends
        train_examples, eval_examples = _datasets(cfg)
        if run.world.is_main:
            print(pair_cut_report(run.tokenizer, train_examples[:2048] + eval_examples, cfg.data.length_limit(), split_prompt=True))
        model = run.load_policy(cfg.model)
        # the frozen reference (None: SimPO, or LoRA's base with adapters off)
        reference = None if cfg.loss == "simpo" else run.load_reference(cfg.model, cfg.reference)
        if cfg.precompute_ref_logprobs:
            train_set, eval_set = (_precompute(model, reference, run.tokenizer, examples, cfg) for examples in (train_examples, eval_examples))
            reference = None  # nothing of the reference is held while training
        else:
            train_set, eval_set = [Pair(ex) for ex in train_examples], [Pair(ex) for ex in eval_examples]
        task = TASKS[cfg.data.task] if cfg.data.train_file is None else None

        def batch_loss(trained: nn.Module, pairs: list[Pair]):
            logps, lengths, ref = pair_logps(cfg, run.tokenizer, trained, reference, pairs)
            loss, stats = preference_loss(cfg, logps, lengths, ref)
            return loss, _metrics(loss, stats, logps), float(len(pairs))  # a mean over pairs

        def evaluate(model: nn.Module) -> dict[str, float]:
            with torch.no_grad(), evaluating(model):
                parts = [pair_logps(cfg, run.tokenizer, model, reference, eval_set[s : s + cfg.eval_batch_size]) for s in range(0, len(eval_set), cfg.eval_batch_size)]
            logps, lengths, ref = zip(*parts)
            logps = _join(logps)
            loss, stats = preference_loss(cfg, logps, _join(lengths), None if ref[0] is None else _join(ref))
            metrics = _metrics(loss, stats, logps, prefix="eval/")
            if task is not None:
                prompts = [p.example.prompt for p in eval_set]
                with distributed.gathered(model):  # FSDP2: full parameters for the decode loop
                    metrics["eval/reward"], _ = generation_eval(model, run.tokenizer, prompts, task.reward, cfg.max_new_tokens or task.max_new_tokens,
                                                                task.eval_temperature, cfg.eval_batch_size, cfg.seed)
            return metrics

        headline = "eval/reward" if task is not None else "eval/rewards/accuracy"
        return supervised_loop(cfg, run, model, train_set, batch_loss, evaluate, "dpo", headline, "pairs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "configs/dpo_preference.yaml", "loss=ipo beta=0.5 max_steps=50", DPOConfig)


def run(args: argparse.Namespace) -> int:
    return run_supervised_command(DPOConfig, train, args)
