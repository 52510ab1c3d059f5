"""CISPO, SAPO and the sampler's importance weights against TRL's own GRPO loss, on the same tensors.

TRL computes its loss in ``GRPOTrainer._compute_loss`` (a method, not a function): it is called here
on a stand-in trainer whose forward pass returns fixed log-probs, so the comparison is TRL's code
against rlalign.core on identical inputs, value and gradient. Skipped where TRL is not installed
(the ``bench`` extra has it).

Names across: TRL's cispo caps the ratio at ``epsilon_high`` itself, with no lower bound (rlalign:
``eps_low=None, eps_high=epsilon_high - 1``) and normalises by the batch's token count (token-mean);
its sapo and grpo losses take the seq-mean-token-mean; its ``importance_sampling_ratio`` (the vLLM
correction) multiplies each token's loss as rlalign's ``token_weights`` do.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlalign.core.importance import importance_weights
from rlalign.core.losses import clipped_surrogate_loss
from rlalign.core.policy_losses import cispo_loss, sapo_loss

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed (the bench extra has it)")

from tests.peer.test_trl_losses import OneProcessAccelerator  # noqa: E402  (TRL imported: the stub of its accelerator)

B, C = 4, 5


def trl_loss(loss_type: str, logp, old_logp, advantages, mask, is_ratio=None, epsilon_low=0.2, epsilon_high=0.28, tau_pos=1.0, tau_neg=1.05):
    """TRL's ``_compute_loss`` on these tensors (beta = 0, no entropy terms, one process, no accumulation)."""
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0, loss_type=loss_type,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, use_vllm=is_ratio is not None, vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=OneProcessAccelerator(), _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg, delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": mask, "advantages": advantages,
        "old_per_token_logps": old_logp, "num_items_in_batch": mask.sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.fixture
def batch():
    """Log-probs whose ratios spread over [0.4, 2.5] (both clip edges and the CISPO cap), advantages of both signs, ragged rows."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, C, generator=g, dtype=torch.float64) * 3
    old = logp - torch.empty(B, C, dtype=torch.float64).uniform_(-0.9, 0.9, generator=g)  # r = e^(+-0.9) in [0.41, 2.46]
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    return logp, old, advantages, mask


def compare(ours, theirs, logp):
    """Value and gradient of two losses of the same ``logp`` leaf agree to round-off (float64: 1e-12; float32: 1e-6)."""
    leaf = logp.detach().clone().requires_grad_(True)
    mine, trl = ours(leaf), theirs(leaf)
    (g_mine,) = torch.autograd.grad(mine, leaf)
    (g_trl,) = torch.autograd.grad(trl, leaf)
    rtol, atol = (1e-12, 1e-14) if logp.dtype == torch.float64 else (1e-6, 1e-7)
    torch.testing.assert_close(mine, trl, rtol=rtol, atol=atol)
    torch.testing.assert_close(g_mine, g_trl, rtol=rtol, atol=atol)
    assert g_trl.abs().max() > 1e-3  # a real gradient


@pytest.mark.parametrize("cap", [1.3, 5.0])
def test_cispo_equals_trl(batch, cap):
    logp, old, adv, mask = batch
    compare(
        lambda lp: cispo_loss(lp, old, adv, mask, eps_low=None, eps_high=cap - 1.0, mode="token-mean")[0],
        lambda lp: trl_loss("cispo", lp, old, adv[:, None], mask, epsilon_high=cap),
        logp,
    )
    assert (torch.exp(logp - old)[mask > 0] > 1.3).any()  # the lower cap clips some tokens


@pytest.mark.parametrize(
    "tau_pos, tau_neg, dtype", [(1.0, 1.05, torch.float32), (1.0, 1.25, torch.float64), (0.5, 2.0, torch.float64)], ids=["defaults", "1-1.25", "0.5-2"]
)
def test_sapo_equals_trl(batch, tau_pos, tau_neg, dtype):
    # TRL builds its temperatures as float32 tensors: 1.05 is compared in float32 (float64 would see 1.05's float32 rounding)
    logp, old, adv, mask = (t.to(dtype) for t in batch)
    compare(
        lambda lp: sapo_loss(lp, old, adv, mask, tau_pos, tau_neg, mode="seq-mean-token-mean")[0],
        lambda lp: trl_loss("sapo", lp, old, adv[:, None], mask, tau_pos=tau_pos, tau_neg=tau_neg),
        logp,
    )


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sampler_weights_multiply_the_loss_as_trls_correction_does(batch, mode, level):
    # TRL's vllm_importance_sampling_mode {level}_{mode}: the same weights multiply each token's clipped surrogate
    logp, old, adv, mask = batch
    g = torch.Generator().manual_seed(1)
    sampler = old - torch.empty(B, C, dtype=torch.float64).uniform_(-0.6, 0.6, generator=g)
    weights, _ = importance_weights(old, sampler, mask, high=1.5, low=0.7, mode=mode, level=level)
    assert (weights[mask > 0] != 1).any()
    compare(
        lambda lp: clipped_surrogate_loss(lp, old, adv, mask, 0.2, 0.28, mode="seq-mean-token-mean", token_weights=weights)[0],
        lambda lp: trl_loss("grpo", lp, old, adv[:, None], mask, is_ratio=weights),
        logp,
    )
