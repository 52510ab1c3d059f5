"""Log-probabilities of chosen tokens without materialising a float32 (B, T, V) log-softmax.

    log pi(y_t) = z_{t,y_t} / tau - logsumexp_v(z_{t,v} / tau)

The naive ``log_softmax(logits.float() / tau).gather(...)`` holds the float32 copy, the scaled copy
and the log-softmax output, each (B, T, V), and autograd keeps one of them for backward. Here the
forward pass works on row chunks of at most ``chunk_elements`` float32 values and keeps only the
(B, T) logsumexp for backward; the gradient

    d log pi(y_t) / d z_{t,v} = (1[v = y_t] - softmax(z_t / tau)_v) / tau

is recomputed chunk by chunk straight into a gradient of the logits' own dtype.

``benchmarks/logprobs_memory.py`` measures the peak memory of both paths, forward + backward
(figures in benchmarks/RESULTS.md). Most of what this one needs is the logits' gradient itself,
which any method must return.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_logprobs", "token_logprobs_and_entropy"]

_DEFAULT_CHUNK_ELEMENTS = 1 << 22  # 4M float32 values = 16 MB per chunk


def _check_inputs(logits: Tensor, tokens: Tensor, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree on (B, T)")


def _rows_per_chunk(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(vocab, 1))


def _workspaces(flat_logits: Tensor, rows: int, dtype: torch.dtype, pair: bool = True) -> tuple[Tensor, Tensor | None]:
    """One chunk's worth of ``dtype`` values, (min(rows, N), V), twice (once unless ``pair``): every
    chunk works in the same buffers. A fresh tensor per chunk and per operation cost more than the
    arithmetic on it: such a buffer (16 MB at the default chunk) comes from the OS as new pages, and
    each page faults on first touch."""
    shape = (min(rows, flat_logits.shape[0]), flat_logits.shape[1])
    first = torch.empty(shape, dtype=dtype, device=flat_logits.device)
    return first, (torch.empty_like(first) if pair else None)


def _logsumexp(values: Tensor, work: Tensor) -> Tensor:
    """``torch.logsumexp(values, -1)`` with its (n, V) temporaries in ``work`` (same shape), the same
    operations in the same order as torch's CPU kernel (max, a max of +-inf taken as 0, exp of the
    difference, sum, log, add the max back), so the same values bit for bit. Shape: (n,)."""
    maxes = values.amax(dim=-1, keepdim=True)  # (n, 1)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0)
    return torch.sub(values, maxes, out=work).exp_().sum(-1).log_().add_(maxes.squeeze(-1))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_elements: int, with_entropy: bool = False):
        vocab = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab)  # (N, V)
        flat_tokens = tokens.reshape(-1, 1)  # (N, 1)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 stays float64
        logp = torch.empty(flat_logits.shape[0], dtype=compute_dtype, device=logits.device)  # (N,)
        logsumexp = torch.empty_like(logp)  # (N,)
        entropy = torch.empty_like(logp) if with_entropy else None  # (N,)
        rows = _rows_per_chunk(vocab, chunk_elements)
        chunk_copy, chunk_work = _workspaces(flat_logits, rows, compute_dtype)  # (n, V) each, reused by every chunk
        for start in range(0, flat_logits.shape[0], rows):
            chunk = flat_logits[start : start + rows]
            scaled = chunk_copy[: len(chunk)].copy_(chunk)  # (n, V) in compute_dtype, modified in place below
            if temperature != 1.0:
                scaled.div_(temperature)
            chunk_lse = _logsumexp(scaled, chunk_work[: len(chunk)])
            logsumexp[start : start + rows] = chunk_lse
            logp[start : start + rows] = scaled.gather(1, flat_tokens[start : start + rows]).squeeze(1) - chunk_lse
            if with_entropy:  # H = -sum_v p_v log p_v, log p = z / tau - logsumexp
                # clamped: a -inf logit (an entry masked out) has p = 0 and must add 0, not 0 * -inf = NaN
                log_probs = scaled.sub_(chunk_lse[:, None]).clamp_(min=torch.finfo(compute_dtype).min)  # (n, V)
                entropy[start : start + rows] = -torch.exp(log_probs, out=chunk_work[: len(chunk)]).mul_(log_probs).sum(-1)
        ctx.save_for_backward(logits, tokens, logsumexp)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        if not with_entropy:
            return logp.view(tokens.shape)
        entropy = entropy.view(tokens.shape)
        ctx.mark_non_differentiable(entropy)
        return logp.view(tokens.shape), entropy

    @staticmethod
    def backward(ctx, grad_output: Tensor, *_entropy_grad):
        logits, tokens, logsumexp = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab)
        flat_tokens = tokens.reshape(-1, 1)
        flat_grad_out = grad_output.reshape(-1, 1).to(logsumexp.dtype) / temperature  # (N, 1)
        grad_logits = torch.empty_like(flat_logits)  # (N, V), the logits' dtype
        rows = _rows_per_chunk(vocab, ctx.chunk_elements)
        chunk_copy, _ = _workspaces(flat_logits, rows, logsumexp.dtype, pair=False)
        for start in range(0, flat_logits.shape[0], rows):
            end = start + rows
            chunk = flat_logits[start:end]
            probs = chunk_copy[: len(chunk)].copy_(chunk)
            if temperature != 1.0:
                probs.div_(temperature)
            probs.sub_(logsumexp[start:end, None]).exp_()  # softmax(z / tau)
            g = flat_grad_out[start:end]  # (n, 1)
            probs.mul_(-g).scatter_add_(1, flat_tokens[start:end], g)  # g * (onehot - softmax)
            grad_logits[start:end] = probs
        return grad_logits.view_as(logits), None, None, None, None


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_elements: int = _DEFAULT_CHUNK_ELEMENTS) -> Tensor:
    """log pi(y_t) of the chosen tokens under softmax(logits / temperature), in float32.

    Equal to ``log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]``
    (to float32 round-off) with gradients, at a fraction of the memory (module docstring).

    Args:
        logits: Shape: (B, T, V), any float dtype; logits[b, t] predicts tokens[b, t].
        tokens: valid token ids (mask padding separately, never with -100). Shape: (B, T).
        temperature: tau > 0, the sampling temperature, so log-probs match the sampling distribution.
    Returns:
        Shape: (B, T), float32 (float64 for float64 logits).
    """
    _check_inputs(logits, tokens, temperature)
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature), int(chunk_elements))


def token_logprobs_and_entropy(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_elements: int = _DEFAULT_CHUNK_ELEMENTS
) -> tuple[Tensor, Tensor]:
    """:func:`token_logprobs` and, from the same chunked pass, the entropy of each position,

        H_t = -sum_v pi_v log pi_v,  pi = softmax(z_t / tau)

    (seed 003's entropy; equal to :func:`rlalign.core.kl.entropy_from_logits` of ``logits / tau``).
    The entropy is a statistic here, without gradient; an entropy bonus uses ``entropy_from_logits``.
    One pass over the (B, T, V) logits instead of two, and no scaled (B, T, V) copy: a separate
    entropy pass would cost more than the log-probs themselves.

    Returns:
        (log-probs with gradient, entropy detached), each (B, T), float32 (float64 for float64 logits).
    """
    _check_inputs(logits, tokens, temperature)
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature), int(chunk_elements), True)
