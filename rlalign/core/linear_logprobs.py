"""Log-probabilities and entropy of chosen tokens straight from the last hidden states and the LM
head, without the (N, V) logits: the vocabulary projection, log-softmax and gather fused per chunk
of rows.

    z_t = W h_t + b,      log pi(y_t) = z_{t,y_t} / tau - logsumexp_v(z_{t,v} / tau)
    H_t = -sum_v pi_v log pi_v,   pi = softmax(z_t / tau)

The forward pass computes the logits of at most ``chunk_elements`` (row x vocabulary) values at a
time and keeps, for backward, the hidden states, the weight and the (N,) logsumexp (and entropy).
Backward recomputes each chunk's logits and applies

    d log pi(y_t) / d z_{t,v} = (1[v = y_t] - pi_v) / tau
    d H_t / d z_{t,v}         = -pi_v (log pi_v + H_t) / tau

then dh = dz W and dW = sum_t dz_t h_t^T (db = sum_t dz_t), chunk by chunk. The memory of the
logits and of their gradient, N V values each (160 GB in float32 for 256 rows x 1024 tokens of a
152k vocabulary), falls to one chunk's; the price is the projection computed twice (forward and
backward), as activation checkpointing of the head would (Liger Kernel's fused linear
cross-entropy does the same in Triton; this is the pure-torch form, on every device).

Numerics: the chunk's logits are made in the dtype the head's matmul would use (the autocast dtype
when autocast is on, else the promoted dtype of the inputs), then log-softmax in float32, so the
values equal ``token_logprobs(lm_head(h), y, tau)`` to float round-off, gradients included.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["linear_token_logprobs", "EntropyMode", "CHUNK_ELEMENTS"]

EntropyMode = Literal["none", "statistic", "gradient"]
CHUNK_ELEMENTS = 1 << 24  # 16M logits (64 MB in float32) per chunk, by default


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) computes in here: autocast's where it is on, else the promoted one."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """F.linear of one chunk of rows in ``dtype``. Shape: (n, H) -> (n, V)."""
    return F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, rows, entropy_mode, dtype):
        # hidden (N, H), weight (V, H), bias (V,) or None, tokens (N,)
        compute = torch.promote_types(dtype, torch.float32)  # float64 stays float64
        n_rows = hidden.shape[0]
        logp = torch.empty(n_rows, dtype=compute, device=hidden.device)  # (N,)
        logsumexp = torch.empty_like(logp)  # (N,)
        entropy = torch.empty_like(logp) if entropy_mode != "none" else None  # (N,)
        for start in range(0, n_rows, rows):
            end = start + rows
            scaled = _chunk_logits(hidden[start:end], weight, bias, dtype).to(compute)  # (n, V)
            if temperature != 1.0:
                scaled.div_(temperature)
            lse = torch.logsumexp(scaled, -1)  # (n,)
            logsumexp[start:end] = lse
            logp[start:end] = scaled.gather(1, tokens[start:end, None]).squeeze(1) - lse
            if entropy is not None:  # a -inf logit has pi = 0 and adds 0, not 0 * -inf
                log_pi = scaled.sub_(lse[:, None]).clamp_(min=torch.finfo(compute).min)  # (n, V)
                entropy[start:end] = -(log_pi.exp() * log_pi).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, logsumexp, entropy if entropy_mode == "gradient" else None)
        ctx.temperature, ctx.rows, ctx.dtype, ctx.entropy_mode = temperature, rows, dtype, entropy_mode
        if entropy is None:
            return logp, logp.new_zeros(0)
        if entropy_mode == "statistic":
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):  # the casts are explicit, as in forward
            return _LinearTokenLogprobs._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens, logsumexp, entropy = ctx.saved_tensors
        temperature, rows, dtype = ctx.temperature, ctx.rows, ctx.dtype
        compute = logsumexp.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (N, H)
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) if ctx.needs_input_grad[1] else None  # (V, H)
        grad_bias = torch.zeros(bias.shape, dtype=compute, device=bias.device) if bias is not None and ctx.needs_input_grad[2] else None
        use_entropy = entropy is not None and grad_entropy is not None  # entropy is saved only when it takes a gradient
        for start in range(0, hidden.shape[0], rows):
            end = start + rows
            scaled = _chunk_logits(hidden[start:end], weight, bias, dtype).to(compute)  # (n, V)
            if temperature != 1.0:
                scaled.div_(temperature)
            log_pi = scaled.sub_(logsumexp[start:end, None])  # (n, V)
            pi = log_pi.exp()  # (n, V)
            g = grad_logp[start:end, None].to(compute)  # (n, 1)
            grad_z = (pi * -g).scatter_add_(1, tokens[start:end, None], g)  # g (onehot - pi)
            if use_entropy:
                g_h = grad_entropy[start:end, None].to(compute)  # (n, 1)
                grad_z -= g_h * pi * (log_pi.clamp_(min=torch.finfo(compute).min) + entropy[start:end, None])
            grad_z = grad_z.div_(temperature).to(dtype)  # (n, V): the logits' gradient, in the matmul's dtype
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ weight.to(dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_z.t() @ hidden[start:end].to(dtype)).to(compute)
            if grad_bias is not None:
                grad_bias += grad_z.sum(0).to(compute)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def linear_token_logprobs(
    hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float = 1.0, bias: Tensor | None = None,
    entropy: EntropyMode = "none", chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t) under softmax((W h_t + b) / temperature), and optionally the entropy of each
    position, without the (..., V) logits (module docstring).

    Equal to ``token_logprobs(F.linear(hidden, weight, bias), tokens, temperature)`` (and
    ``entropy_from_logits`` of the scaled logits) to float round-off, value and gradient.

    Args:
        hidden: the last hidden states, logits' rows: hidden[..., t] predicts tokens[..., t]. Shape: (..., H).
        weight: the LM head's weight. Shape: (V, H).
        tokens: valid token ids (mask padding separately). Shape: (...).
        temperature: tau > 0, the sampling temperature.
        bias: the LM head's bias, or None. Shape: (V,).
        entropy: "none"; "statistic" (detached, from the same pass); "gradient" (an entropy bonus in the loss).
        chunk_elements: logits computed at once (rows per chunk: chunk_elements // V, at least 1).
    Returns:
        (log-probs, entropy or None), each of ``tokens``' shape, float32 (float64 for float64 inputs).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != tokens.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and tokens {tuple(tokens.shape)} disagree")
    if entropy not in ("none", "statistic", "gradient"):
        raise ValueError(f"entropy must be 'none', 'statistic' or 'gradient', got {entropy!r}")
    rows = max(1, int(chunk_elements) // weight.shape[0])
    dtype = _matmul_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):  # the casts are explicit, the same in forward and backward
        logp, ent = _LinearTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, tokens.reshape(-1).long(), float(temperature), rows,
                                               entropy, dtype)
    return logp.view(tokens.shape), (ent.view(tokens.shape) if entropy != "none" else None)
