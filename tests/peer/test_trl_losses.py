"""Peer equivalence: each loss both TRL and rlalign offer, computed by TRL 1.16's own code and by rlalign's on the same tensors.

House rule: where TRL defines what a number means (a loss, an advantage, a logged ratio), the test runs the
peer's code, not a transcription of it. TRL computes its losses in trainer methods, so each is called here on a
bare trainer object (``Trainer.__new__`` plus the attributes the method reads) whose model forward returns fixed
tensors; rlalign's side is the composed function its trainer calls (``grpo.grpo_loss``, ``dpo.preference_loss``,
``bradley_terry_loss``, ``sft._batch_loss``), its own forward patched to return the same tensors.

GRPO runs TRL's whole step on the tensors: ``_generate_and_score_completions`` (its generation and reward calls
stubbed) builds the advantages, the completion mask (``mask_truncated_completions``), the old and reference
log-probs and the vLLM importance-sampling ratios with TRL's code, and ``_compute_loss`` turns them into the loss
and the logged clip ratios. rlalign's ``grpo_loss`` gets TRL's advantages (so a loss test compares losses only;
the advantages are compared on their own).

Where the two disagree, a test either pins the difference the README documents (citing it) or asserts equality
under ``xfail(strict=True)`` naming the disagreement. Float64 throughout except SFT (a float32 model): value and
gradient agree to 1e-12 (float64) or 2e-6 (float32).
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

pytest.importorskip("trl", reason="TRL is not installed (the test and bench extras have it)")
with warnings.catch_warnings():  # "You are importing from 'trl.experimental'": SimPO lives in its CPOTrainer
    warnings.simplefilter("ignore")
    from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.reward_trainer import RewardTrainer  # noqa: E402
from trl.trainer.sft_trainer import SFTTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from rlalign.core.losses import bradley_terry_loss  # noqa: E402
from rlalign.train import dpo, grpo, sft  # noqa: E402
from rlalign.train.passes import loss_mask  # noqa: E402
from rlalign.train.rl_config import TRL_AGGREGATIONS  # noqa: E402

F64 = torch.float64
TAU_NEG = float(torch.tensor(1.05, dtype=torch.float32))  # TRL's SAPO temperature for A <= 0, as its float32 tensor holds it


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class OneProcessAccelerator:
    """accelerate's Accelerator in one CPU process: gathers, reductions and padding across processes are the identity."""

    num_processes, process_index, sync_gradients, is_main_process = 1, 0, True, True
    device = torch.device("cpu")
    parallelism_config = None

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def unwrap_model(self, model):
        return model


def bare(cls, **attributes):
    """A ``cls`` trainer without its __init__: only the attributes its loss method reads."""
    trainer = cls.__new__(cls)
    vars(trainer).update(accelerator=OneProcessAccelerator(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, **attributes)
    return trainer


def logged(trainer, key: str) -> float:
    return trainer._metrics["train"][key][-1]


def agree(mine: Tensor, theirs: Tensor, dtype: torch.dtype = F64) -> None:
    """Round-off agreement: float64 1e-12 relative, float32 2e-6."""
    rtol, atol = (1e-12, 1e-14) if dtype == F64 else (2e-6, 1e-7)
    torch.testing.assert_close(mine, theirs, rtol=rtol, atol=atol)


def value_and_grads(loss_of, leaves: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """loss_of(*fresh leaves) and its gradient with respect to each (0 where it does not depend on one)."""
    fresh = [x.detach().clone().requires_grad_(True) for x in leaves]
    loss = loss_of(*fresh)
    grads = torch.autograd.grad(loss, fresh, allow_unused=True)
    return loss.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(fresh, grads)]


def compare(ours, theirs, leaves: list[Tensor], dtype: torch.dtype = F64) -> tuple[Tensor, Tensor]:
    """Value and gradients of two losses of the same leaves agree to round-off; returns both values."""
    mine, g_mine = value_and_grads(ours, leaves)
    trl, g_trl = value_and_grads(theirs, leaves)
    agree(mine, trl, dtype)
    for a, b in zip(g_mine, g_trl):
        agree(a, b, dtype)
    assert float(g_trl[0].abs().max()) > 1e-3  # a real gradient
    return mine, trl


# ----------------------------------------------------------------------------------------------
# GRPO: TRL's whole step (_generate_and_score_completions, _compute_loss) against rlalign's grpo_loss
# ----------------------------------------------------------------------------------------------

B, G, C, MAX_LEN, EOS = 8, 4, 6, 8, 2  # rows, group size, padded completion width, max_completion_length, EOS id
LENGTHS = [6, 3, 5, 1, 6, 2, 4, 6]  # ragged rows, right-padded to C
TRUNCATED = 4  # row 4 runs to C without EOS (mask_truncated drops it); rows 0 and 7 end on EOS at C
SCORES = [1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.7, 0.3]  # one reward function, two groups of G = 4


@dataclass
class Rollout:
    logp: Tensor  # log pi_theta, the leaf the losses differentiate. Shape: (B, C)
    old: Tensor  # log pi_old (TRL: its old-log-prob pass; rlalign: rollout.logprobs)
    ref: Tensor  # log pi_ref
    sampler: Tensor  # the sampler's (vLLM's) log-probs
    entropy: Tensor  # per-token entropy of the training forward
    scores: Tensor  # one reward per completion. Shape: (B,)
    lengths: list[int]  # completion lengths, right-padded to C

    @property
    def mask(self) -> Tensor:
        return (torch.arange(C) < torch.tensor(self.lengths)[:, None]).to(F64)  # (B, C)


def make_rollout(spread: float = 0.9, scores: list[float] = SCORES, lengths: list[int] = LENGTHS, shift: list[float] | None = None) -> Rollout:
    """Ratios r = pi / pi_old in [e^-spread, e^spread] (0.41-2.46: both clip edges, the CISPO cap) times e^shift_i for row i,
    sampler ratios in [0.55, 1.8], KL to the reference of both signs, random values on the padding (both sides must ignore them)."""
    g = torch.Generator().manual_seed(0)

    def uniform(lo: float, hi: float) -> Tensor:
        return torch.empty(len(lengths), C, dtype=F64).uniform_(lo, hi, generator=g)

    old = -uniform(0.05, 3.0)
    sampler = (old + uniform(-0.6, 0.6)).float().to(F64)  # TRL builds the sampler's log-probs as float32 (torch.tensor of lists)
    offset = torch.zeros(len(lengths), 1, dtype=F64) if shift is None else torch.tensor(shift, dtype=F64)[:, None]  # (B, 1)
    return Rollout(old + uniform(-spread, spread) + offset, old, old + uniform(-0.5, 0.5), sampler, uniform(0.1, 2.0), torch.tensor(scores, dtype=F64),
                   list(lengths))


def trl_grpo(t: Rollout, loss_type: str = "grpo", beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.28,
             level: str = "token", scale_rewards: str = "group", is_mode: str | None = None, is_min: float | None = None,
             is_max: float | None = None, delta: float | None = None, entropy_coef: float = 0.0, mask_truncated: bool = False,
             on_policy: bool = False, group_size: int = G, accumulation: int = 1):
    """A bare GRPOTrainer and the batch its ``_generate_and_score_completions`` builds from ``t``; its ``_compute_loss``
    then reads the leaves in ``trainer.leaves``. ``is_mode``: TRL's vllm_importance_sampling_mode (None: no vLLM);
    ``on_policy``: num_iterations = 1 and no vLLM, so TRL skips the old-log-prob pass (old = logp.detach()); ``accumulation``:
    gradient_accumulation_steps = steps_per_generation (the generation batch is one optimizer step of that many micro-batches)."""
    policy = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    reference = SimpleNamespace(training=False, is_gradient_checkpointing=False)
    rows = len(t.lengths)
    completion_ids = [[7] * (n - 1) + ([7] if i == TRUNCATED else [EOS]) for i, n in enumerate(t.lengths)]

    def forward(model, *args, **kwargs):  # the model's per-token log-probs and entropies: the leaves in the loss's (grad) pass
        if torch.is_grad_enabled():
            return trainer.leaves[0], trainer.leaves[1], None
        return (t.ref if model is reference else t.old).clone(), None, None

    trainer = bare(
        GRPOTrainer, model=policy, ref_model=reference, _get_per_token_logps_and_entropies=forward,
        _generate=lambda prompts: ([[1, 5]] * rows, completion_ids, None, ["c"] * rows, [t.sampler[i, :n].tolist() for i, n in enumerate(t.lengths)], {}, None, None),
        _calculate_rewards=lambda inputs, prompts, completions, ids: t.scores[:, None],  # (B, 1): one reward function
        args=SimpleNamespace(steps_per_generation=accumulation, gradient_accumulation_steps=accumulation, per_device_train_batch_size=rows, gradient_checkpointing_kwargs=None,
                             delta=delta, use_bias_correction_kl=False, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
        environment_factories=None, tools=None, environments=None, _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        mask_truncated_completions=mask_truncated, eos_token_ids=[EOS], num_iterations=1 if on_policy else 2,
        use_vllm=is_mode is not None, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=is_mode,
        vllm_importance_sampling_clip_min=is_min, vllm_importance_sampling_clip_max=is_max,
        beta=beta, num_generations=group_size, multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1, dtype=F64),
        scale_rewards=scale_rewards, reward_func_names=["score"], log_multimodal=False, _pending_extra_logs={}, _pending_metrics={},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": defaultdict(list), "images": []},
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, loss_type=loss_type,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, max_completion_length=MAX_LEN, current_gradient_accumulation_steps=accumulation,
        aux_loss_enabled=False, entropy_coef=entropy_coef, _entropy_bonus_enabled=entropy_coef != 0.0, use_adaptive_entropy=False,
    )
    batch = GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "q"}] * rows)
    return trainer, batch


def trl_grpo_loss(trainer, batch):
    def loss(logp: Tensor, entropy: Tensor) -> Tensor:
        trainer.leaves = (logp, entropy)
        return GRPOTrainer._compute_loss(trainer, trainer.model, batch)

    return loss


def rlalign_grpo_loss(monkeypatch, cfg: grpo.GRPOConfig, t: Rollout, advantages: Tensor, mask: Tensor, on_policy: bool = False, stats: dict | None = None):
    """rlalign's composed minibatch loss, ``grpo.grpo_loss``, its policy forward returning the leaves; ``stats`` receives its statistics."""
    holder = {}
    monkeypatch.setattr(grpo, "completion_logprobs", lambda *args, **kwargs: holder["leaves"])
    rollout = SimpleNamespace(logprobs=t.sampler if on_policy else t.old, completion_mask=t.mask)
    sampler = t.sampler if cfg.sampler_correction else None  # with tis_*: rollout.logprobs is pi_old, the sampler's apart

    def loss(logp: Tensor, entropy: Tensor) -> Tensor:
        holder["leaves"] = (logp, entropy)
        value, s = grpo.grpo_loss(torch.nn.Identity(), rollout, advantages, mask, t.ref if cfg.beta > 0 else None, cfg, on_policy, sampler)
        if stats is not None:
            stats.update({k: float(v) for k, v in s.items()})
        return value

    return loss


def config(**fields) -> grpo.GRPOConfig:
    return grpo.GRPOConfig.model_validate({"sampling": {"max_new_tokens": MAX_LEN}, "eps_low": 0.2, "eps_high": 0.28, **fields})


@pytest.fixture
def rollout() -> Rollout:
    return make_rollout()


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "k3"])
@pytest.mark.parametrize("loss_type", sorted(TRL_AGGREGATIONS))
def test_clipped_loss_with_trls_aggregation_equals_trls_loss_type(monkeypatch, rollout, loss_type, beta):
    # TRL: GRPOTrainer._compute_loss, loss_type grpo / bnpo / dr_grpo (over B * max_completion_length) / dapo (over
    # num_items_in_batch), clip 0.2 / 0.28, k3 KL added per token before the reduction; rlalign: loss_type clip with the
    # aggregation rl_config.TRL_AGGREGATIONS maps it to, max_len = sampling.max_new_tokens. Off-policy (num_iterations 2).
    trainer, batch = trl_grpo(rollout, loss_type, beta=beta)
    cfg = config(aggregation=TRL_AGGREGATIONS[loss_type], beta=beta)
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask), trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    r = torch.exp(rollout.logp - rollout.old)[rollout.mask > 0]
    assert (r < 0.8).any() and (r > 1.28).any() and ((r > 0.8) & (r < 1.28)).any()  # both clip edges and the inside


def test_on_policy_loss_equals_trls_single_iteration(monkeypatch, rollout):
    # TRL with num_iterations = 1 skips the old-log-prob pass and takes old = logp.detach() (r = 1); rlalign's grpo_loss
    # with on_policy (mu = 1, one minibatch) does the same. The gradient is then the plain policy gradient plus beta * k3's.
    trainer, batch = trl_grpo(rollout, "grpo", beta=0.04, on_policy=True)
    assert "old_per_token_logps" not in batch
    cfg = config(beta=0.04)
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask, on_policy=True), trl_grpo_loss(trainer, batch),
            [rollout.logp, rollout.entropy])


GSPO_SHIFT = [0.5, -0.5, 0.0, 0.0, 0.5, 0.5, -0.5, 0.0]  # advantages +, -, +, -, ...: rows 0, 1, 4 clipped, rows 5, 6 past the edge on the unclipped side


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_ratio_equals_trls_gspo(monkeypatch, loss_type):
    # TRL: importance_sampling_level="sequence": s_i = exp(sum_t m (log pi - log pi_old) / |o_i|), shape (B, 1), clipped
    # as a whole and broadcast over the tokens by the reduction; rlalign: importance_sampling: sequence.
    t = make_rollout(spread=0.3, shift=GSPO_SHIFT)
    trainer, batch = trl_grpo(t, loss_type, beta=0.04, level="sequence")
    cfg = config(aggregation=TRL_AGGREGATIONS[loss_type], beta=0.04, importance_sampling="sequence")
    compare(rlalign_grpo_loss(monkeypatch, cfg, t, batch["advantages"], t.mask), trl_grpo_loss(trainer, batch), [t.logp, t.entropy])
    s = torch.exp(((t.logp - t.old) * t.mask).sum(-1) / t.mask.sum(-1))
    assert ((s < 0.8) | (s > 1.28)).any() and ((s > 0.8) & (s < 1.28)).any()


@pytest.mark.parametrize("cap", [1.3, 5.0])
def test_cispo_equals_trls_cispo(monkeypatch, rollout, cap):
    # TRL: loss_type="cispo": -sg(min(r, epsilon_high)) A log pi over num_items_in_batch (token-mean), epsilon_high the cap
    # itself; rlalign: loss_type: cispo with cispo_eps_high = cap - 1, aggregation left to its default (token-mean for cispo).
    trainer, batch = trl_grpo(rollout, "cispo", beta=0.04, epsilon_high=cap)
    cfg = config(loss_type="cispo", cispo_eps_high=cap - 1.0, beta=0.04)
    assert cfg.aggregation == "token-mean"
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask), trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])


def test_sapo_equals_trls_sapo(monkeypatch, rollout):
    # TRL: loss_type="sapo": -(4 / tau) sigmoid(tau (r - 1)) A, tau 1.0 for A > 0 and 1.05 otherwise, seq-mean-token-mean.
    # TRL's torch.where(advantages > 0, 1.0, 1.05) holds the temperatures in float32: rlalign is given 1.05 so rounded
    # (1.0499999523), which makes the float64 comparison exact (with 1.05 itself the losses differ by ~1e-6 relative).
    trainer, batch = trl_grpo(rollout, "sapo", beta=0.04)
    cfg = config(loss_type="sapo", beta=0.04, sapo_temperature_neg=TAU_NEG)
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask), trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])


def test_dual_clip_equals_trls_two_sided_delta(monkeypatch, rollout):
    # TRL: args.delta caps the unclipped ratio, -min(min(r, delta) A, clip(r) A) (INTELLECT-2); rlalign: dual_clip c caps a
    # negative-advantage token's loss at -c A. For delta = c > 1 + eps_high the two are the same function: A < 0 gives
    # -A min(max(r, clip(r)), c) either way, A > 0 is untouched (clip(r) <= 1 + eps_high < c). Ratios up to 2.46 > c = 1.5.
    trainer, batch = trl_grpo(rollout, "grpo", beta=0.04, delta=1.5)
    cfg = config(beta=0.04, dual_clip=1.5)
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask), trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    capped = (torch.exp(rollout.logp - rollout.old) > 1.5) & (batch["advantages"][:, None] < 0) & (rollout.mask > 0)
    assert capped.any()


IS_CASES = [("token", "truncate", 0.7, 1.5), ("token", "mask", 0.7, 1.5), ("sequence", "truncate", 0.5, 2.0), ("sequence", "mask", 0.5, 2.0),
            ("token", "mask", None, 1.5), ("sequence", "truncate", None, 2.0)]


@pytest.mark.parametrize("level, mode, low, high", IS_CASES, ids=[f"{a}_{b}-{c}" for a, b, c, _ in IS_CASES])
def test_sampler_weights_equal_trls_vllm_importance_sampling(monkeypatch, rollout, level, mode, low, high):
    # TRL: _generate_and_score_completions builds importance_sampling_ratio = exp((old - sampler) * mask), summed over the
    # row for sequence_*, clamped into [clip_min, clip_max] (truncate) or 0 outside it (mask); _compute_loss multiplies each
    # token's policy loss by it. rlalign: tis_cap / tis_min / tis_mode / tis_level, the sampler's log-probs apart from pi_old.
    trainer, batch = trl_grpo(rollout, "dapo", beta=0.04, is_mode=f"{level}_{mode}", is_min=low, is_max=high)
    cfg = config(aggregation="token-mean", beta=0.04, tis_cap=high, tis_min=low, tis_mode=mode, tis_level=level)
    stats = {}
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask, stats=stats), trl_grpo_loss(trainer, batch),
            [rollout.logp, rollout.entropy])
    weights = batch["importance_sampling_ratio"].expand(B, C)[rollout.mask > 0]
    assert (weights != 1).any() and ((weights == high) | (weights == low) | (weights == 0)).any()  # the bounds act
    if level == "token":  # TRL's sampling/importance_sampling_ratio/* are over the counted tokens, as rlalign's tis/*
        assert stats["tis/weight_min"] == pytest.approx(logged(trainer, "sampling/importance_sampling_ratio/min"), rel=1e-12)
        assert stats["tis/weight_mean"] == pytest.approx(logged(trainer, "sampling/importance_sampling_ratio/mean"), rel=1e-12)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_sampler_weights_multiply_cispo_and_sapo_as_trls(monkeypatch, rollout, loss_type):
    # TRL multiplies every loss type's per-token loss by importance_sampling_ratio (all but vespo); rlalign's
    # policy_objective passes the tis_* weights to cispo_loss and sapo_loss. token_mask in [0.7, 1.5].
    trainer, batch = trl_grpo(rollout, loss_type, beta=0.04, epsilon_high=5.0, is_mode="token_mask", is_min=0.7, is_max=1.5)
    own = {"cispo_eps_high": 4.0} if loss_type == "cispo" else {"sapo_temperature_neg": TAU_NEG}  # test_sapo_equals_trls_sapo
    cfg = config(loss_type=loss_type, beta=0.04, tis_cap=1.5, tis_min=0.7, tis_mode="mask", **own)
    compare(rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask), trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])


def test_sequence_sampler_weight_mean_equals_trls_logged_mean(monkeypatch, rollout):
    trainer, batch = trl_grpo(rollout, "dapo", is_mode="sequence_truncate", is_min=0.5, is_max=2.0)
    stats = {}
    value_and_grads(rlalign_grpo_loss(monkeypatch, config(aggregation="token-mean", beta=0.0, tis_cap=2.0, tis_min=0.5, tis_level="sequence"),
                                      rollout, batch["advantages"], rollout.mask, stats=stats), [rollout.logp, rollout.entropy])
    assert stats["tis/weight_mean"] == pytest.approx(logged(trainer, "sampling/importance_sampling_ratio/mean"), rel=1e-12)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "dr_grpo"])
def test_mask_truncated_equals_trls_for_token_mean_and_dr_grpo(monkeypatch, rollout, loss_type):
    # TRL: mask_truncated_completions zeroes the completion mask of a row whose last id is neither EOS nor pad; rlalign:
    # passes.loss_mask(rollout, mask_truncated) on rollout.truncated. Token-mean (dapo, bnpo): the row's tokens leave the
    # sum and the count alike; dr_grpo: both still divide by all B rows times max_completion_length.
    trainer, batch = trl_grpo(rollout, loss_type, beta=0.04, mask_truncated=True)
    truncated = torch.zeros(B, dtype=torch.bool)
    truncated[TRUNCATED] = True
    mask = loss_mask(SimpleNamespace(completion_mask=rollout.mask, truncated=truncated), mask_truncated=True)
    agree(mask.to(F64), batch["completion_mask"].to(F64))
    compare(rlalign_grpo_loss(monkeypatch, config(aggregation=TRL_AGGREGATIONS[loss_type], beta=0.04), rollout, batch["advantages"], mask),
            trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])


def test_seq_mean_token_mean_leaves_an_empty_row_out_where_trl_counts_it_as_zero(monkeypatch, rollout):
    # Documented (README, "Differences from TRL's GRPOTrainer"): seq-mean-token-mean averages over the rows that have loss
    # tokens, TRL's grpo (mean over all B rows of sum / clamp(len, 1)) also counts a row without any as 0. One truncated row
    # of B = 8 is left out, so rlalign's loss and gradient are TRL's times 8 / 7.
    trainer, batch = trl_grpo(rollout, "grpo", beta=0.04, mask_truncated=True)
    mask = batch["completion_mask"].to(F64)
    assert (mask.sum(-1) == 0).sum() == 1
    ours = rlalign_grpo_loss(monkeypatch, config(beta=0.04), rollout, batch["advantages"], mask)
    mine, g_mine = value_and_grads(ours, [rollout.logp, rollout.entropy])
    trl, g_trl = value_and_grads(trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    agree(mine, trl * B / (B - 1))
    agree(g_mine[0], g_trl[0] * B / (B - 1))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus_against_trls(monkeypatch, rollout, loss_type):
    # TRL: entropy_coef c subtracts c * token-mean(H) over the micro-batch for every loss type; rlalign: entropy_coef adds
    # c * aggregate(-H) with the loss's aggregation. Documented (README, "Differences"): "entropy_coef's bonus is aggregated
    # as the loss is (TRL takes a token mean for every loss type)". token-mean: equal; seq-mean-token-mean: rlalign's loss
    # is TRL's + c (token-mean(H) - seq-mean(H)), the gradient w.r.t. H accordingly.
    c = 0.01
    trainer, batch = trl_grpo(rollout, loss_type, beta=0.04, entropy_coef=c)
    cfg = config(aggregation=TRL_AGGREGATIONS[loss_type], beta=0.04, entropy_coef=c)
    ours = rlalign_grpo_loss(monkeypatch, cfg, rollout, batch["advantages"], rollout.mask)
    if loss_type == "dapo":
        compare(ours, trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
        return
    mine, g_mine = value_and_grads(ours, [rollout.logp, rollout.entropy])
    trl, g_trl = value_and_grads(trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    m, h = rollout.mask, rollout.entropy
    token_mean, seq_mean = (h * m).sum() / m.sum(), ((h * m).sum(-1) / m.sum(-1)).mean()
    agree(mine, trl + c * (token_mean - seq_mean))
    agree(g_mine[0], g_trl[0])
    agree(g_mine[1], g_trl[1] + c * (m / m.sum() - m / m.sum(-1, keepdim=True) / B))


def accumulated(monkeypatch, cfg: grpo.GRPOConfig, t: Rollout, advantages: Tensor, micro_rows: list[Tensor]) -> tuple[float, Tensor]:
    """rlalign's minibatch update, updater.minibatch_step over ``micro_rows`` (grpo_step's loss_of): the loss it reports and
    the gradient it accumulates on the log-probs (the leaves are the parameters of the model it updates; no step is taken)."""
    from rlalign.train.distributed import World
    from rlalign.train.updater import Updater, minibatch_step

    leaves = torch.nn.Module()
    leaves.logp, leaves.entropy = torch.nn.Parameter(t.logp.clone()), torch.nn.Parameter(t.entropy.clone())
    monkeypatch.setattr(grpo, "completion_logprobs", lambda policy, rollout, *args, **kwargs: (leaves.logp[rollout.rows], leaves.entropy[rollout.rows]))
    updater = Updater.create(leaves, cfg.optim, 1)
    captured = {}
    monkeypatch.setattr(updater, "_apply", lambda value: captured.update(value=value, grad=leaves.logp.grad.clone()) or 0.0)
    select = lambda rows: SimpleNamespace(logprobs=t.old[rows], completion_mask=t.mask[rows], rows=rows)  # noqa: E731

    def loss_of(rows: Tensor):
        return grpo.grpo_loss(updater.model, select(rows), advantages[rows], t.mask[rows], t.ref[rows] if cfg.beta > 0 else None, cfg)

    minibatch_step(updater, loss_of, micro_rows, t.mask, cfg.aggregation, World())
    return captured["value"], captured["grad"]


@pytest.mark.parametrize("loss_type", sorted(TRL_AGGREGATIONS))
def test_micro_batch_accumulation_against_trls_gradient_accumulation(monkeypatch, rollout, loss_type):
    # TRL: gradient_accumulation_steps = steps_per_generation = 2, the generation batch split by its split_tensor_dict into
    # two micro-batches of 4 rows (15 and 18 tokens), each _compute_loss scaled for the accumulation (grpo, bnpo, dr_grpo:
    # / 2; dapo: over num_items_in_batch, the generation batch's tokens); the step's gradient is their sum. rlalign: one
    # minibatch, updater.minibatch_step over the same two micro-batches. Equal for dapo, grpo (equal row counts) and
    # dr_grpo; documented (README, "Differences"): TRL's bnpo divides by each micro-batch's tokens, rlalign's token-mean
    # by the minibatch's, so rlalign's bnpo update is TRL's bnpo of the whole batch in one micro-batch.
    from trl.trainer.utils import split_tensor_dict

    trainer, batch = trl_grpo(rollout, loss_type, beta=0.04, accumulation=2)
    micro = split_tensor_dict(batch, 2)
    cfg = config(aggregation=TRL_AGGREGATIONS[loss_type], beta=0.04)
    value, grad = accumulated(monkeypatch, cfg, rollout, batch["advantages"], [torch.arange(4), torch.arange(4, 8)])

    def theirs(logp: Tensor, entropy: Tensor) -> Tensor:
        total = 0
        for k, inputs in enumerate(micro):
            trainer.leaves = (logp[4 * k : 4 * k + 4], entropy[4 * k : 4 * k + 4])
            total = total + GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        return total

    trl, (g_trl, _) = value_and_grads(theirs, [rollout.logp, rollout.entropy])
    if loss_type == "bnpo":
        assert value != pytest.approx(float(trl), rel=1e-3)
        trainer, batch = trl_grpo(rollout, loss_type, beta=0.04)  # one micro-batch of all 8 rows
        trl, (g_trl, _) = value_and_grads(trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    assert value == pytest.approx(float(trl), rel=1e-12)
    agree(grad, g_trl)


def test_token_mean_of_several_minibatches_divides_by_each_minibatchs_tokens_where_trls_dapo_divides_by_the_steps(monkeypatch, rollout):
    # Documented (README, "Differences"): token-mean divides each minibatch's loss by that minibatch's tokens, TRL's dapo by
    # the generation batch's tokens over its optimizer steps. TRL: steps_per_generation 2, gradient_accumulation_steps 1
    # (two optimizer steps per generation), normaliser num_items_in_batch / steps_per_generation = 33 / 2; rlalign:
    # num_minibatches 2, minibatches of 15 and 18 tokens. Pinned: rlalign's update k is TRL's times (33 / 2) / n_k.
    from trl.trainer.utils import split_tensor_dict

    trainer, batch = trl_grpo(rollout, "dapo", beta=0.04, accumulation=2)
    trainer.args.gradient_accumulation_steps, trainer.current_gradient_accumulation_steps = 1, 1
    cfg = config(aggregation="token-mean", beta=0.04)
    for k, inputs in enumerate(split_tensor_dict(batch, 2)):
        rows = torch.arange(4 * k, 4 * k + 4)
        value, grad = accumulated(monkeypatch, cfg, rollout, batch["advantages"], [rows])

        def theirs(logp: Tensor, entropy: Tensor) -> Tensor:
            trainer.leaves = (logp[rows], entropy[rows])
            return GRPOTrainer._compute_loss(trainer, trainer.model, inputs)

        trl, (g_trl, _) = value_and_grads(theirs, [rollout.logp, rollout.entropy])
        factor = float(rollout.mask.sum()) / 2 / float(rollout.mask[rows].sum())  # 16.5 / 15, then 16.5 / 18
        assert value == pytest.approx(float(trl) * factor, rel=1e-12)
        agree(grad, g_trl * factor)


def test_logged_clip_fractions_kl_and_entropy_equal_trls(monkeypatch, rollout):
    # TRL logs clip_ratio/low_mean ((r < 1 - eps_low) & A < 0), high_mean ((r > 1 + eps_high) & A > 0), region_mean (either),
    # kl and entropy, each a mean over the counted tokens; rlalign: clip_frac/low, clip_frac/high, clip_frac, kl, entropy.
    # TRL counts the clipped tokens in float32 (is_clipped.float()): those agree to float32 round-off, kl and entropy to float64's.
    trainer, batch = trl_grpo(rollout, "grpo", beta=0.04)
    stats = {}
    value_and_grads(rlalign_grpo_loss(monkeypatch, config(beta=0.04), rollout, batch["advantages"], rollout.mask, stats=stats),
                    [rollout.logp, rollout.entropy])
    value_and_grads(trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    pairs = {"clip_frac/low": "clip_ratio/low_mean", "clip_frac/high": "clip_ratio/high_mean", "clip_frac": "clip_ratio/region_mean",
             "kl": "kl", "entropy": "entropy"}
    for ours, theirs in pairs.items():
        assert stats[ours] == pytest.approx(logged(trainer, theirs), rel=1e-12 if ours in ("kl", "entropy") else 1e-6), ours
    assert 0 < stats["clip_frac/low"] and 0 < stats["clip_frac/high"]


def test_gspo_clip_fractions_count_tokens_where_trls_count_sequences(monkeypatch):
    # Documented (README, "Differences"): "GSPO's clip fractions count tokens (TRL counts sequences)". TRL's
    # global_masked_mean of a (B, 1) indicator divides by B; rlalign's by the counted tokens. Pinned: TRL = mean over
    # rows of the row's indicator, rlalign = the same indicators weighted by the rows' lengths; they differ here.
    t = make_rollout(spread=0.3, shift=GSPO_SHIFT)
    trainer, batch = trl_grpo(t, "grpo", level="sequence")
    stats = {}
    value_and_grads(rlalign_grpo_loss(monkeypatch, config(beta=0.0, importance_sampling="sequence"), t, batch["advantages"], t.mask, stats=stats),
                    [t.logp, t.entropy])
    value_and_grads(trl_grpo_loss(trainer, batch), [t.logp, t.entropy])
    s, a, lengths = torch.exp(((t.logp - t.old) * t.mask).sum(-1) / t.mask.sum(-1)), batch["advantages"], t.mask.sum(-1)
    clipped = (((s < 0.8) & (a < 0)) | ((s > 1.28) & (a > 0))).to(F64)  # (B,)
    assert clipped.sum() == 3
    assert logged(trainer, "clip_ratio/region_mean") == pytest.approx(float(clipped.mean()), rel=1e-6)  # float32 in TRL
    assert stats["clip_frac"] == pytest.approx(float((clipped * lengths).sum() / lengths.sum()), rel=1e-12)
    assert stats["clip_frac"] != pytest.approx(logged(trainer, "clip_ratio/region_mean"), rel=1e-3)


def test_cispo_clip_fraction_counts_both_signs_where_trls_counts_positive_advantages(monkeypatch, rollout):
    # Documented (README, "Differences"): CISPO's clip_frac counts capped tokens of either advantage sign, TRL's
    # cispo_clip_ratio only those with A > 0 ((coef_1 > epsilon_high) & (advantages > 0)).
    trainer, batch = trl_grpo(rollout, "cispo", epsilon_high=1.3)
    stats = {}
    value_and_grads(rlalign_grpo_loss(monkeypatch, config(loss_type="cispo", cispo_eps_high=0.3, beta=0.0), rollout, batch["advantages"],
                                      rollout.mask, stats=stats), [rollout.logp, rollout.entropy])
    value_and_grads(trl_grpo_loss(trainer, batch), [rollout.logp, rollout.entropy])
    m, capped = rollout.mask, (torch.exp(rollout.logp - rollout.old) > 1.3).to(F64)
    positive = (batch["advantages"] > 0).to(F64)[:, None]
    assert logged(trainer, "cispo_clip_ratio") == pytest.approx(float((capped * positive * m).sum() / m.sum()), rel=1e-6)  # float32 in TRL
    assert stats["clip_frac"] == pytest.approx(float((capped * m).sum() / m.sum()), rel=1e-12)
    assert stats["clip_frac"] > logged(trainer, "cispo_clip_ratio")


# ----------------------------------------------------------------------------------------------
# GRPO advantages: TRL's group normalisation (std + 1e-4) against rlalign's (std clamped at 1e-6)
# ----------------------------------------------------------------------------------------------


def trl_advantages(scores: list[float], scale_rewards: str, group_size: int = G) -> Tensor:
    """TRL's advantages of ``scores`` (groups of ``group_size`` adjacent), from its _generate_and_score_completions."""
    _, batch = trl_grpo(make_rollout(scores=scores, lengths=[C] * len(scores)), scale_rewards=scale_rewards, group_size=group_size)
    return batch["advantages"]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_differ_from_trls_by_the_documented_std_epsilon(scale_rewards):
    # TRL: (R - mean_g) / (std + 1e-4), std the group's (group) or the batch's (batch) unbiased std, or no division (none);
    # rlalign: ADVANTAGE_ESTIMATORS[advantage], std clamped at 1e-6. Documented (README, "Differences"): so
    # A_rlalign = A_TRL (std + 1e-4) / std, the same for none. To float32 round-off: TRL's nanstd takes Bessel's factor
    # count / (count - 1) of integer tensors, a float32 (4/3 to 3e-8) even for float64 rewards.
    scores = torch.tensor(SCORES, dtype=F64)
    trl = trl_advantages(SCORES, scale_rewards)
    ours = grpo.ADVANTAGE_ESTIMATORS[scale_rewards](scores, G)  # rlalign's advantage names TRL's scale_rewards values
    if scale_rewards == "none":
        agree(ours, trl)
        return
    std = scores.view(-1, G).std(dim=1).repeat_interleave(G) if scale_rewards == "group" else scores.std().expand(B)
    agree(ours, trl * (std + 1e-4) / std, torch.float32)
    assert (ours - trl).abs().max() > 1e-5


def test_tied_and_near_tied_groups_get_zero_where_trl_divides_by_1e4():
    # Documented (README): "the group's std clamped at 1e-6 (a tied group gets 0)". A group tied exactly: 0 on both sides.
    # A group whose std is 5e-7 (<= 1e-6): rlalign 0, TRL (R - mean) / (5e-7 + 1e-4), -2.5e-3 three times and +7.5e-3.
    scores = [0.3, 0.3, 0.3, 0.3, 0.5, 0.5, 0.5, 0.5 + 1e-6]
    trl = trl_advantages(scores, "group")
    ours = grpo.ADVANTAGE_ESTIMATORS["group"](torch.tensor(scores, dtype=F64), G)
    assert (ours == 0).all() and (trl[:4] == 0).all()
    agree(trl[4:], torch.tensor([-2.5e-7, -2.5e-7, -2.5e-7, 7.5e-7], dtype=F64) / (5e-7 + 1e-4), torch.float32)


def test_zero_one_reward_advantages_differ_from_trls_by_1e4_over_the_std():
    # README: "1e-4 to 2e-4 in balanced groups, 1.5e-3 for one success in 16". The gap is |A| 1e-4 / (std + 1e-4): 1.0e-4 for a
    # group of two with one success, 1.75e-4 for four of eight, 1.5e-3 for one of sixteen (std 0.25, A = 3.75).
    cases = {2: ([1.0, 0.0], 1.0e-4), 8: ([1.0] * 4 + [0.0] * 4, 1.75e-4), 16: ([1.0] + [0.0] * 15, 1.5e-3)}
    for group, (scores, gap) in cases.items():
        trl = trl_advantages(scores, "group", group_size=group)
        ours = grpo.ADVANTAGE_ESTIMATORS["group"](torch.tensor(scores, dtype=F64), group)
        assert float((ours - trl).abs().max()) == pytest.approx(gap, rel=1e-3), group


def test_scores_1e4_apart_get_advantages_over_twice_trls():
    # README: "by a factor of 2.4 (two scores 1e-4 apart) to about 100". TRL's advantage is rlalign's times
    # std / (std + 1e-4): two scores 1e-4 apart (std 7.07e-5) differ 2.41x, one of four 1e-4 above the rest
    # (std 5e-5) 3.0x, and just above the 1e-6 clamp up to ~100x.
    for scores, group, ratio in (([0.5, 0.5 + 1e-4], 2, 1 + 2**0.5), ([0.5, 0.5, 0.5, 0.5 + 1e-4], 4, 3.0)):
        trl = trl_advantages(scores, "group", group_size=group)
        ours = grpo.ADVANTAGE_ESTIMATORS["group"](torch.tensor(scores, dtype=F64), group)
        assert float((ours / trl).max()) == pytest.approx(ratio, rel=1e-6), scores
        assert float((ours / trl).min()) == pytest.approx(ratio, rel=1e-6), scores


def test_unscorable_completions_get_zero_and_leave_the_group_statistics_as_in_trl():
    # TRL: a completion every reward function scored None is NaN, left out of the nanmean / nanstd and given advantage 0;
    # rlalign: trusted_rows -> ADVANTAGE_ESTIMATORS[...](scores, G, valid). Same up to the documented std epsilon.
    scores = torch.tensor(SCORES, dtype=F64)
    valid = torch.ones(B, dtype=torch.bool)
    valid[[1, 6]] = False
    for scale in ("group", "batch"):
        trl = trl_advantages(torch.where(valid, scores, torch.nan).tolist(), scale)
        ours = grpo.ADVANTAGE_ESTIMATORS[scale](scores, G, valid=valid)
        kept = torch.where(valid, scores, torch.nan)
        std = torch.stack([kept[:G][valid[:G]].std(), kept[G:][valid[G:]].std()]).repeat_interleave(G) if scale == "group" else kept[valid].std()
        assert (ours[~valid] == 0).all() and (trl[~valid] == 0).all()
        agree(ours[valid], (trl * (std + 1e-4) / std)[valid], torch.float32)


# ----------------------------------------------------------------------------------------------
# DPO: TRL's DPOTrainer._compute_loss (and CPOTrainer's SimPO) against rlalign's dpo.preference_loss
# ----------------------------------------------------------------------------------------------

PAIRS, T = 4, 7  # pairs; prompt (2 tokens) + response (up to 5), one row each for chosen and rejected
RESPONSE_LENGTHS = [5, 2, 4, 1, 3, 5, 1, 4]  # chosen rows first, then rejected: unequal, so IPO's per-token averages matter


@dataclass
class Pairs:
    logps: Tensor  # the policy's per-token log-probs of the next token (TRL's shifted layout), the leaf. Shape: (2P, T - 1)
    ref: Tensor  # the reference's summed response log-probs, chosen first. Shape: (2P,)

    @property
    def completion_mask(self) -> Tensor:  # (2P, T): 1 on response tokens, after the 2 prompt tokens
        positions = torch.arange(T)
        return ((positions >= 2) & (positions < 2 + torch.tensor(RESPONSE_LENGTHS)[:, None])).long()


def make_pairs() -> Pairs:
    """Log-ratios rho of both signs and sizes: margins rho_c - rho_r of +1.1, -0.9, +2.4, -1.9 (accuracy 1/2)."""
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(2 * PAIRS, T - 1, generator=g, dtype=F64) * 2
    rho = torch.tensor([0.8, -0.5, 1.5, -1.2, -0.3, 0.4, -0.9, 0.7], dtype=F64)
    return Pairs(logps, (logps * Pairs(logps, None).completion_mask[:, 1:]).sum(-1) - rho)


def trl_dpo(pairs: Pairs, loss_type: str, beta: float, label_smoothing: float = 0.0):
    """A bare DPOTrainer (reference log-probs precomputed, as ``precompute_ref_log_probs``) and its loss of the leaf."""
    trainer = bare(DPOTrainer, model=SimpleNamespace(training=True), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
                   f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
                   use_weighting=False, args=SimpleNamespace(discopop_tau=0.05), _total_train_tokens=0, _tp_size=1)
    mask = pairs.completion_mask
    inputs = {"input_ids": torch.full((2 * PAIRS, T), 7), "attention_mask": torch.ones(2 * PAIRS, T, dtype=torch.long), "completion_mask": mask,
              "ref_chosen_logps": pairs.ref[:PAIRS], "ref_rejected_logps": pairs.ref[PAIRS:]}

    def loss(logps: Tensor) -> Tensor:
        def model(**kwargs):  # TRL's fused LM head: per-token log-probs, 0 where the label is -100
            zeros = torch.zeros_like(logps)
            return SimpleNamespace(log_probs=logps * mask[:, 1:], entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

        return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)

    return trainer, loss


def rlalign_dpo(pairs: Pairs, metrics: dict | None = None, **fields):
    cfg = dpo.DPOConfig.model_validate(fields)
    shifted = pairs.completion_mask[:, 1:].to(F64)  # (2P, T - 1)

    def loss(logps: Tensor) -> Tensor:
        summed = (logps * shifted).sum(-1)  # (2P,) log pi(y | x), as dpo.sequence_logps sums it
        value, stats = dpo.preference_loss(cfg, summed, shifted.sum(-1), None if cfg.loss == "simpo" else pairs.ref)
        if metrics is not None:
            metrics.update(dpo._metrics(value, stats, summed))
        return value

    return loss


DPO_METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected", "rewards/margin": "rewards/margins",
               "rewards/accuracy": "rewards/accuracies", "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected"}


@pytest.mark.parametrize("trl_loss, loss, beta", [("sigmoid", "dpo", 0.1), ("ipo", "ipo", 0.5)])
def test_dpo_and_ipo_equal_trls_loss_and_metrics(trl_loss, loss, beta):
    # TRL: DPOTrainer._compute_loss, loss_type sigmoid (-log sigmoid(beta h)) or ipo ((h_c / |y_c| - h_r / |y_r| - 1 / (2 beta))^2,
    # lengths from the completion mask); rewards/* = beta * summed log-ratios, logps/* the summed policy log-probs.
    pairs = make_pairs()
    trainer, theirs = trl_dpo(pairs, trl_loss, beta)
    metrics = {}
    compare(rlalign_dpo(pairs, metrics, loss=loss, beta=beta), theirs, [pairs.logps])
    for ours, name in DPO_METRICS.items():
        assert metrics[ours] == pytest.approx(logged(trainer, name), rel=1e-12), ours
    assert 0 < metrics["rewards/accuracy"] < 1


def test_trls_sigmoid_ignores_label_smoothing_where_rlalign_makes_it_conservative_dpo():
    # Documented (README, DPO table; dpo.py's label_smoothing): TRL 1.16's DPOTrainer applies label_smoothing to robust,
    # exo_pair and aot only, so its sigmoid with label_smoothing 0.1 is plain DPO; rlalign's dpo with it is cDPO (below).
    pairs = make_pairs()
    _, smoothed = trl_dpo(pairs, "sigmoid", beta=0.1, label_smoothing=0.1)
    _, plain = trl_dpo(pairs, "sigmoid", beta=0.1)
    compare(rlalign_dpo(pairs, loss="dpo", beta=0.1), smoothed, [pairs.logps])
    compare(plain, smoothed, [pairs.logps])
    with pytest.raises(AssertionError):
        compare(rlalign_dpo(pairs, loss="dpo", beta=0.1, label_smoothing=0.1), smoothed, [pairs.logps])


def test_conservative_dpo_equals_trls_conservative_sigmoid_of_cpo():
    # TRL's own conservative-DPO expression lives in CPOTrainer.cpo_loss, loss_type sigmoid:
    # -(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x), x = its chosen minus rejected log-probs. Given the
    # log-ratios rho = log pi - log pi_ref as those log-probs (cpo_alpha = 0: no NLL term), x = h, and it is cDPO.
    pairs = make_pairs()
    shifted = pairs.completion_mask[:, 1:].to(F64)

    def theirs(logps: Tensor) -> Tensor:
        rho = (logps * shifted).sum(-1) - pairs.ref  # (2P,)
        zero = rho.new_zeros(())
        trainer = bare(CPOTrainer, loss_type="sigmoid", beta=0.1, label_smoothing=0.1, alpha=0.0, cpo_alpha=0.0, aux_loss_enabled=False,
                       concatenated_forward=lambda model, batch: (rho[:PAIRS], rho[PAIRS:], zero, zero, zero))
        return CPOTrainer.get_batch_loss_metrics(trainer, None, {})[0]

    compare(rlalign_dpo(pairs, loss="dpo", beta=0.1, label_smoothing=0.1), theirs, [pairs.logps])


def test_simpo_equals_trls_cpo_simpo():
    # TRL: trl.experimental.cpo.CPOTrainer, loss_type simpo, cpo_alpha 0 (no NLL term): -log sigmoid(beta (avg_c - avg_r) -
    # gamma), avg the per-token average log-prob (concatenated_forward's average_log_prob for simpo); rewards/* = beta avg.
    pairs = make_pairs()
    shifted = pairs.completion_mask[:, 1:].to(F64)
    trl_metrics = {}

    def theirs(logps: Tensor) -> Tensor:
        average = (logps * shifted).sum(-1) / shifted.sum(-1)  # (2P,)
        zero = average.new_zeros(())
        trainer = bare(CPOTrainer, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.0, alpha=0.0, cpo_alpha=0.0,
                       aux_loss_enabled=False, concatenated_forward=lambda model, batch: (average[:PAIRS], average[PAIRS:], zero, zero, zero))
        loss, logged_metrics = CPOTrainer.get_batch_loss_metrics(trainer, None, {})
        trl_metrics.update(logged_metrics)
        return loss

    metrics = {}
    compare(rlalign_dpo(pairs, metrics, loss="simpo", beta=2.0, gamma=0.5), theirs, [pairs.logps])
    for ours in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
        assert metrics[ours] == pytest.approx(trl_metrics[DPO_METRICS[ours]], rel=1e-12), ours


# ----------------------------------------------------------------------------------------------
# Reward model: TRL's RewardTrainer.compute_loss against rlalign's bradley_terry_loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("margin, center", [(False, None), (True, None), (False, 0.01), (True, 0.01)],
                         ids=["plain", "margin", "centred", "margin-centred"])
def test_bradley_terry_equals_trls_reward_trainer(margin, center):
    # TRL: RewardTrainer.compute_loss: -mean log sigmoid(r_c - r_r [- margin]) + center_rewards_coefficient * mean((r_c + r_r)^2),
    # r the model's (2P, 1) logits, chosen first; "margin" in the batch when the data has the column. Logged: accuracy,
    # margin, mean_reward. rlalign: bradley_terry_loss(r_c, r_r, margin, center_coef), as rm's batch_loss calls it.
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(2 * PAIRS, generator=g, dtype=F64) * 2
    margins = torch.tensor([0.5, 0.0, 1.5, 0.25], dtype=F64)
    trainer = bare(RewardTrainer, model=SimpleNamespace(training=True), args=SimpleNamespace(center_rewards_coefficient=center),
                   _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * PAIRS, 3, dtype=torch.long), "attention_mask": torch.ones(2 * PAIRS, 3, dtype=torch.long)}
    if margin:
        inputs["margin"] = margins
    stats = {}

    def theirs(r: Tensor) -> Tensor:
        return RewardTrainer.compute_loss(trainer, lambda **kwargs: SimpleNamespace(logits=r[:, None]), dict(inputs))

    def ours(r: Tensor) -> Tensor:
        loss, s = bradley_terry_loss(r[:PAIRS], r[PAIRS:], margins if margin else None, center or 0.0)
        stats.update(accuracy=float(s.accuracy), margin=float(s.margin_mean), mean_reward=float(s.reward_mean))
        return loss

    compare(ours, theirs, [rewards])
    for name in ("accuracy", "margin", "mean_reward"):
        assert stats[name] == pytest.approx(logged(trainer, name), rel=1e-12), name
    assert 0 < stats["accuracy"] < 1


# ----------------------------------------------------------------------------------------------
# SFT: TRL's SFTTrainer.compute_loss (its fused LM head) against rlalign's sft._batch_loss, on a tiny Llama
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm():
    from rlalign.lm.data import SFTExample
    from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(tokenizer, TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), seed=3)
    examples = [SFTExample("12+30=", "42"), SFTExample("7+5=", "12 because 7+5 is 12"), SFTExample("100+1=", "101"), SFTExample("2+2=", "4")]
    return tokenizer, model, examples


def sft_grads(model, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def trl_sft(model, tokenizer, examples, loss_type: str = "nll", num_items_in_batch=None):
    """TRL's SFTTrainer.compute_loss on rlalign's collated batch: labels = the ids where rlalign's loss mask counts them, else -100."""
    from rlalign.lm.encoding import collate_sft

    batch = collate_sft(tokenizer, examples, 64, True)
    labels = batch.input_ids.masked_fill(torch.cat([torch.ones_like(batch.loss_mask[:, :1]), 1 - batch.loss_mask], dim=1).bool(), -100)
    trainer = bare(SFTTrainer, model=model, aux_loss_enabled=False, compute_loss_func=None, label_smoother=None, _total_train_tokens=0, _tp_size=1,
                   get_tp_size=lambda: 1, args=SimpleNamespace(loss_type=loss_type, average_tokens_across_devices=True))
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "labels": labels}
    return SFTTrainer.compute_loss(trainer, model, inputs, num_items_in_batch=num_items_in_batch), batch


def test_sft_token_mean_equals_trls_nll(tiny_lm):
    # TRL: SFTTrainer.compute_loss, loss_type "nll": -sum log p(label) / (number of labels != -100) through its fused LM
    # head (add_fused_lm_head); rlalign: sft._batch_loss, token_logprobs of the logits and sft_loss's token-mean over the
    # batch's completion tokens. Float32 model: value and every parameter's gradient to float32 round-off.
    tokenizer, base, examples = tiny_lm
    model, theirs_model = copy.deepcopy(base), copy.deepcopy(base)
    add_fused_lm_head(theirs_model, outputs=("log_probs", "entropy", "is_top1"))
    model.train(), theirs_model.train()
    ours, stats = sft._batch_loss(model, tokenizer, examples, 64, False, True)
    theirs, batch = trl_sft(theirs_model, tokenizer, examples)
    agree(ours.detach(), theirs.detach(), torch.float32)
    g_ours, g_theirs = sft_grads(model, ours), sft_grads(theirs_model, theirs)
    for name in g_ours:
        agree(g_ours[name], g_theirs[name], torch.float32)
    assert float(stats.tokens) == float(batch.loss_mask.sum()) and batch.loss_mask.sum(-1).unique().numel() > 1


def test_sft_accumulated_micro_batches_equal_trls_num_items_in_batch(tiny_lm, monkeypatch):
    # TRL: under gradient accumulation Trainer passes num_items_in_batch (the step's target tokens) and compute_loss divides
    # each micro-batch's summed NLL by it, so the summed micro-batch gradients are the step's token mean. rlalign:
    # Updater.accumulated_step weighs each micro-batch's mean by its token count and divides by the total. Micro-batches of
    # 3 and 1 examples with unequal token counts (a mean of the two means would differ).
    from rlalign.lm.encoding import collate_sft
    from rlalign.train.distributed import World, loss_scale, loss_share
    from rlalign.train.run_config import OptimConfig
    from rlalign.train.updater import Updater

    tokenizer, model, examples = tiny_lm
    micro = [examples[:3], examples[3:]]
    theirs_model = copy.deepcopy(model)
    add_fused_lm_head(theirs_model, outputs=("log_probs", "entropy", "is_top1"))
    ours_model = copy.deepcopy(model)
    ours_model.train(), theirs_model.train()
    total = sum(float(collate_sft(tokenizer, m, 64, True).loss_mask.sum()) for m in micro)  # the step's target tokens
    theirs_model.zero_grad(set_to_none=True)
    theirs_value = 0.0
    for m in micro:
        loss, _ = trl_sft(theirs_model, tokenizer, m, num_items_in_batch=torch.tensor(total))
        loss.backward()
        theirs_value += float(loss.detach())
    updater = Updater.create(ours_model, OptimConfig(lr=1e-3), 1)
    captured = {}
    monkeypatch.setattr(updater, "_apply", lambda value: captured.update(value=value, grads={n: p.grad.clone() for n, p in ours_model.named_parameters()}) or 0.0)

    def call(rows):
        def run():
            loss, stats = sft._batch_loss(updater.model, tokenizer, rows, 64, False, True)
            return loss, float(stats.tokens)

        return run

    world = World()  # one process: supervised_loop's step, its micro-batches counted in completion tokens as sft's batch_loss counts them
    updater.accumulated_step([call(m) for m in micro], partial(loss_scale, world=world), partial(loss_share, world=world))
    assert captured["value"] == pytest.approx(theirs_value, rel=2e-6)
    for name, p in theirs_model.named_parameters():
        agree(captured["grads"][name], p.grad, torch.float32)
