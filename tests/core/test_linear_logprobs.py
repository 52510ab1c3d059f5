"""The fused LM head + log-softmax (rlalign.core.linear_logprobs) against the full computation:
logits = F.linear(h, W, b), then token_logprobs / entropy_from_logits, values and gradients of h, W
and b, at every chunk size, temperature and entropy mode."""

import pytest
import torch
import torch.nn.functional as F

from rlalign.core.kl import entropy_from_logits
from rlalign.core.linear_logprobs import linear_token_logprobs
from rlalign.core.logprobs import token_logprobs


def inputs(seed=0, batch=3, steps=5, hidden=16, vocab=41, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, steps, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (0.5 * torch.randn(vocab, hidden, generator=g, dtype=dtype)).requires_grad_()
    b = (0.3 * torch.randn(vocab, generator=g, dtype=dtype)).requires_grad_() if bias else None
    tokens = torch.randint(0, vocab, (batch, steps), generator=g)
    weights = torch.randn(batch, steps, generator=g, dtype=dtype)  # d loss / d logp
    entropy_weights = torch.randn(batch, steps, generator=g, dtype=dtype)  # d loss / d H
    return h, w, b, tokens, weights, entropy_weights


def grads(*tensors):
    out = [None if t is None or t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("chunk_elements", [1, 41 * 4, 1 << 24])  # one row a chunk, 4 rows, all rows
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_the_full_logits_path_in_value_and_gradient(temperature, chunk_elements, with_bias):
    h, w, b, tokens, weights, _ = inputs(bias=with_bias)
    logp, entropy = linear_token_logprobs(h, w, tokens, temperature, b, chunk_elements=chunk_elements)
    (logp * weights).sum().backward()
    fused = grads(h, w, b)
    full = token_logprobs(F.linear(h, w, b), tokens, temperature)
    (full * weights).sum().backward()
    reference = grads(h, w, b)
    assert entropy is None and logp.shape == tokens.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp, full, atol=1e-6, rtol=1e-6)
    for ours, theirs in zip(fused, reference):
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_elements", [41, 1 << 24])
def test_the_entropy_as_statistic_and_with_its_gradient(chunk_elements):
    h, w, b, tokens, weights, entropy_weights = inputs(seed=1)
    logp, entropy = linear_token_logprobs(h, w, tokens, 0.8, b, entropy="gradient", chunk_elements=chunk_elements)
    ((logp * weights).sum() + (entropy * entropy_weights).sum()).backward()
    fused = grads(h, w, b)
    logits = F.linear(h, w, b)
    full_logp, full_entropy = token_logprobs(logits, tokens, 0.8), entropy_from_logits(logits / 0.8)
    ((full_logp * weights).sum() + (full_entropy * entropy_weights).sum()).backward()
    reference = grads(h, w, b)
    torch.testing.assert_close(entropy, full_entropy, atol=1e-5, rtol=1e-5)  # -sum pi log pi here, logsumexp - sum pi z there
    for ours, theirs in zip(fused, reference):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # as a statistic: the same values, detached, and the log-probs' gradient alone
    logp, entropy = linear_token_logprobs(h, w, tokens, 0.8, b, entropy="statistic", chunk_elements=chunk_elements)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, full_entropy.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trained", ["hidden", "weight"])
def test_only_the_trained_side_gets_a_gradient_and_it_is_the_full_paths(trained):
    # LoRA and a frozen head: the hidden states train, the head does not; a frozen body under a trained head: the reverse
    h, w, b, tokens, weights, entropy_weights = inputs(seed=5)
    h, w, b = (t.detach().requires_grad_(name == trained) for name, t in (("hidden", h), ("weight", w), ("bias", b)))
    logp, entropy = linear_token_logprobs(h, w, tokens, 0.9, b, entropy="gradient", chunk_elements=41 * 2)
    ((logp * weights).sum() + (entropy * entropy_weights).sum()).backward()
    fused = grads(h, w)
    logits = F.linear(h, w, b)
    ((token_logprobs(logits, tokens, 0.9) * weights).sum() + (entropy_from_logits(logits / 0.9) * entropy_weights).sum()).backward()
    reference = grads(h, w)
    assert (fused[0] is None) == (trained != "hidden") and (fused[1] is None) == (trained != "weight")
    for ours, theirs in zip(fused, reference):
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64():
    h, w, b, tokens, _, _ = inputs(seed=2, batch=2, steps=3, hidden=4, vocab=7, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w, b: linear_token_logprobs(h, w, tokens, 0.9, b, entropy="gradient", chunk_elements=14), (h, w, b))


def test_a_masked_logit_adds_nothing_to_the_entropy():
    # a -inf bias entry (a token forbidden outright): pi = 0 there, so it adds 0 to H, not NaN
    h, w, b, tokens, _, _ = inputs(seed=3)
    b = b.detach().clone()
    b[0] = float("-inf")
    tokens = tokens.clamp(min=1)
    logp, entropy = linear_token_logprobs(h, w, tokens, 1.0, b, entropy="statistic")
    full = F.linear(h, w, b)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, entropy_from_logits(full), atol=1e-5, rtol=1e-5)


def test_under_bfloat16_autocast_the_head_runs_in_bfloat16_as_the_full_path_does():
    h, w, b, tokens, weights, _ = inputs(seed=4, hidden=32, vocab=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = linear_token_logprobs(h, w, tokens, 1.0, b)
        full = token_logprobs(F.linear(h, w, b), tokens)
    (logp * weights).sum().backward()
    fused = grads(h, w, b)
    (full * weights).sum().backward()
    reference = grads(h, w, b)
    # the same bfloat16 logits; float32 log-softmax on both sides
    torch.testing.assert_close(logp, full, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(fused, reference):  # the weight's gradient: summed in float32 here, in bfloat16 matmuls there
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


def test_bad_inputs_name_what_is_wrong():
    h, w, b, tokens, _, _ = inputs()
    with pytest.raises(ValueError, match="temperature"):
        linear_token_logprobs(h, w, tokens, 0.0)
    with pytest.raises(ValueError, match="disagree"):
        linear_token_logprobs(h, w[:, :-1], tokens)
    with pytest.raises(ValueError, match="disagree"):
        linear_token_logprobs(h, w, tokens[:, :-1])
    with pytest.raises(ValueError, match="disagree"):
        linear_token_logprobs(h, w[None], tokens)
    with pytest.raises(ValueError, match="entropy"):
        linear_token_logprobs(h, w, tokens, entropy="yes")
