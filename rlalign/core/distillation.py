"""Distillation losses: a student pi_s learns a frozen teacher pi_t's next-token distributions.

At each completion position t of a row (prompt x, completion y), both models give a distribution
over the vocabulary, pi(. | x, y_<t) = softmax(z_t / tau); tau is the temperature.

Reverse KL in policy-gradient form, on the student's own samples y ~ pi_s (Agarwal et al. 2024;
Gu et al. 2024, MiniLLM; Lu & Thinking Machines Lab 2025, "On-Policy Distillation"):

    A_t = -(log pi_s(y_t) - log pi_t(y_t))          the per-token advantage, no critic
    l_t = -sg(A_t) * log pi_s(y_t)

Its expected gradient over y_t ~ pi_s is the gradient of the per-position reverse KL:
E[(log pi_s(y) - log pi_t(y)) grad log pi_s(y)] = grad KL(pi_s || pi_t) - sum_y grad pi_s(y), and the
last sum is grad 1 = 0. Each token's advantage is its own KL term (discount 0, as Thinking Machines
train), not the sum of the terms after it.

The full-vocabulary reverse KL at a position, exactly (no sampling of y_t):

    KL(pi_s || pi_t) = sum_v pi_s(v) (log pi_s(v) - log pi_t(v))

GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes", eq. 1), in TRL's convention for beta:

    M = beta pi_t + (1 - beta) pi_s
    JSD_beta = beta KL(pi_t || M) + (1 - beta) KL(pi_s || M)          0 < beta < 1
    beta = 0: KL(pi_t || pi_s), the forward KL;   beta = 1: KL(pi_s || pi_t), the reverse KL

The mixture form tends to 0 at both ends of (0, 1); the endpoints are defined as the two KLs (so
JSD_beta is not continuous there), which is what TRL's ``GKDTrainer.generalized_jsd_loss`` computes.

Every loss returns what is minimised and a NamedTuple of detached statistics; per-token values are
reduced by :func:`rlalign.core.losses.aggregate`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from rlalign.core.losses import Aggregation, aggregate
from rlalign.core.masks import masked_mean

__all__ = [
    "reverse_kl_advantages",
    "reverse_kl_loss",
    "full_reverse_kl",
    "generalized_jsd",
    "generalized_jsd_loss",
    "jsd_loss",
    "head_divergences",
    "ReverseKLStats",
    "JSDStats",
]


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    """log softmax(z / tau) in float32 (float64 stays float64). Shape: (..., V) -> (..., V)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) from log-probabilities. Shapes: (..., V) -> (...)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor | None = None) -> Tensor:
    """A_t = -(log pi_s(y_t) - log pi_t(y_t)), detached; 0 where ``mask`` is 0.

    Positive where the teacher finds the student's token likelier than the student does.

    Args:
        student_logp: log pi_s(y_t) of the sampled tokens. Shape: (B, C).
        teacher_logp: log pi_t(y_t) of the same tokens. Shape: (B, C).
        mask: 1 on counted tokens. Shape: (B, C).
    Returns:
        Shape: (B, C).
    """
    advantages = -(student_logp.detach() - teacher_logp.detach())  # (B, C)
    return advantages if mask is None else advantages * mask.to(advantages.dtype)


class ReverseKLStats(NamedTuple):
    reverse_kl: Tensor  # mean of log pi_s(y_t) - log pi_t(y_t) over counted tokens (= -mean A_t; the k1 estimate of the reverse KL)
    advantage_min: Tensor  # the most negative A_t: the token the teacher most disagrees with
    advantage_max: Tensor


def reverse_kl_loss(
    student_logp: Tensor,
    teacher_logp: Tensor,
    mask: Tensor | None = None,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, ReverseKLStats]:
    """L = aggregate(-sg(A_t) * w_t * log pi_s(y_t)),  A_t = -(log pi_s(y_t) - log pi_t(y_t))  (module docstring).

    The value of L is not the KL (it is -sum A log pi_s); its gradient, in expectation over the
    student's samples, is that of the per-position reverse KL.

    Args:
        student_logp: log pi_s(y_t), with grad. Shape: (B, C).
        teacher_logp: log pi_t(y_t) (no grad needed). Shape: (B, C).
        mask: 1 on counted tokens. Shape: (B, C).
        mode, max_len: the reduction of :func:`rlalign.core.losses.aggregate`.
        token_weights: w_t, e.g. the importance weight pi_s / pi_sampler of samples drawn by another
            (older or lower-precision) copy of the student; detached. Shape: (B, C). None: 1.
    """
    advantages = reverse_kl_advantages(student_logp, teacher_logp)  # (B, C)
    token_loss = -advantages * student_logp  # (B, C)
    if token_weights is not None:
        token_loss = token_loss * token_weights.detach()
    loss = aggregate(token_loss, mask, mode, max_len)
    with torch.no_grad():
        m = torch.ones_like(advantages) if mask is None else mask.to(advantages.dtype)
        counted = advantages[m > 0]
        empty = advantages.new_zeros(())
        stats = ReverseKLStats(
            reverse_kl=masked_mean(-advantages, m),
            advantage_min=counted.min() if counted.numel() else empty,
            advantage_max=counted.max() if counted.numel() else empty,
        )
    return loss, stats


def full_reverse_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(pi_s || pi_t) = sum_v pi_s(v) (log pi_s(v) - log pi_t(v)) at every position, exactly.

    Args:
        student_logits: z_s, with grad. Shape: (B, C, V).
        teacher_logits: z_t. Shape: (B, C, V).
    Returns:
        float32 (float64 for float64 logits). Shape: (B, C).
    """
    return _kl(_log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature).detach())


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float = 0.5, temperature: float = 1.0) -> Tensor:
    """GKD's JSD_beta(pi_t, pi_s) at every position (module docstring; Agarwal et al. 2024, eq. 1).

        M = beta pi_t + (1 - beta) pi_s,   JSD_beta = beta KL(pi_t || M) + (1 - beta) KL(pi_s || M)

    beta = 0 is the forward KL(pi_t || pi_s), beta = 1 the reverse KL(pi_s || pi_t) (TRL's convention).
    The teacher is a constant (its logits are detached).

    Args:
        student_logits: z_s, with grad. Shape: (B, C, V).
        teacher_logits: z_t. Shape: (B, C, V).
        beta: in [0, 1].
    Returns:
        float32 (float64 for float64 logits). Shape: (B, C).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    log_s = _log_probs(student_logits, temperature)  # (B, C, V)
    log_t = _log_probs(teacher_logits, temperature).detach()  # (B, C, V)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log1p(-beta)]), dim=0)  # (B, C, V): log M
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


class JSDStats(NamedTuple):
    jsd: Tensor  # mean JSD_beta over counted positions
    reverse_kl: Tensor  # mean exact KL(pi_s || pi_t) over counted positions (the same diagnostic for every beta)


def generalized_jsd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
) -> tuple[Tensor, JSDStats]:
    """L = aggregate(JSD_beta(pi_t, pi_s)_t) over the counted positions (GKD, Agarwal et al. 2024).

    With ``mode="token-mean"`` this is TRL's ``generalized_jsd_loss`` with ``reduction="batchmean"``
    and the padding labelled -100: the divergence summed over positions, over the counted positions.

    Args:
        student_logits: z_s, with grad. Shape: (B, C, V).
        teacher_logits: z_t. Shape: (B, C, V).
        mask: 1 on counted positions. Shape: (B, C).
    """
    per_position = generalized_jsd(student_logits, teacher_logits, beta, temperature)  # (B, C)
    with torch.no_grad():
        reverse = per_position.detach() if beta == 1.0 else full_reverse_kl(student_logits.detach(), teacher_logits, temperature)  # (B, C)
    return jsd_loss(per_position, reverse, mask, mode, max_len)


def jsd_loss(per_position: Tensor, reverse_kl: Tensor, mask: Tensor | None, mode: Aggregation, max_len: int | None) -> tuple[Tensor, JSDStats]:
    """aggregate(JSD_beta) and its statistics from the per-position divergences (both (B, C)), however they were computed."""
    loss = aggregate(per_position, mask, mode, max_len)
    with torch.no_grad():
        m = torch.ones_like(per_position) if mask is None else mask.to(per_position.dtype)
        return loss, JSDStats(masked_mean(per_position.detach(), m), masked_mean(reverse_kl.detach(), m))


def head_divergences(
    student_hidden: Tensor, student_head: torch.nn.Linear, teacher_hidden: Tensor, teacher_head: torch.nn.Linear, beta: float = 0.5,
    temperature: float = 1.0, chunk_elements: int = 1 << 24,
) -> tuple[Tensor, Tensor]:
    """:func:`generalized_jsd` (with gradient to the student) and :func:`full_reverse_kl` (detached) at
    every position, from the two models' last hidden states and LM heads, without their (B, C, V)
    logits: each chunk of rows makes both logits (the vocabulary cut to the smaller one's), its
    divergences, and, in backward, makes them again (activation checkpointing, per chunk). Equal to
    the functions on the logits to float round-off, value and gradient.

    Shapes: (..., H_s), (..., H_t) -> (...), (...).
    """
    vocab = min(student_head.out_features, teacher_head.out_features)
    rows = max(1, chunk_elements // max(student_head.out_features, teacher_head.out_features))
    flat_s, flat_t = student_hidden.reshape(-1, student_hidden.shape[-1]), teacher_hidden.reshape(-1, teacher_hidden.shape[-1])

    def chunk(hidden_s: Tensor, hidden_t: Tensor) -> tuple[Tensor, Tensor]:
        z_s = student_head(hidden_s)[:, :vocab]  # (n, V), the head's own call (autocast as the logits path)
        with torch.no_grad():
            z_t = teacher_head(hidden_t)[:, :vocab]  # (n, V)
        jsd = generalized_jsd(z_s, z_t, beta, temperature)  # (n,)
        with torch.no_grad():
            reverse = jsd.detach() if beta == 1.0 else full_reverse_kl(z_s.detach(), z_t, temperature)
        return jsd, reverse

    parts = [torch.utils.checkpoint.checkpoint(chunk, flat_s[i : i + rows], flat_t[i : i + rows], use_reentrant=False) for i in range(0, flat_s.shape[0], rows)]
    shape = student_hidden.shape[:-1]
    return torch.cat([jsd for jsd, _ in parts]).view(shape), torch.cat([reverse for _, reverse in parts]).view(shape)
