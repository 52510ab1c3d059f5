import math

import pytest
import torch

from rlalign.core.logprobs import token_logprobs, token_logprobs_and_entropy


def naive(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_elements", [1, 37, 1 << 22])
def test_equals_log_softmax_gather_with_gradients(temperature, chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 9, 61, generator=g)).requires_grad_()
    tokens = torch.randint(0, 61, (4, 9), generator=g)
    weights = torch.randn(4, 9, generator=g)
    ours = token_logprobs(logits, tokens, temperature, chunk_elements)
    (ours * weights).sum().backward()
    grad_ours = logits.grad.clone()
    logits.grad = None
    ref = naive(logits, tokens, temperature)
    (ref * weights).sum().backward()
    # float32 round-off: 1e-6 absolute, or one part in 10^6 of values around -17
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_ours, logits.grad, atol=1e-6, rtol=1e-6)
    assert ours.dtype == torch.float32


@pytest.mark.parametrize("chunk_elements", [1, 12, 1 << 22])
def test_more_tokens_than_the_vocabulary(chunk_elements):
    # N = 4 * 9 = 36 tokens over V = 5 entries: the chunks (1, 2 or 36 rows) must cover the tokens, not the vocabulary
    g = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(4, 9, 5, generator=g)).requires_grad_()
    tokens = torch.randint(0, 5, (4, 9), generator=g)
    weights = torch.randn(4, 9, generator=g)
    ours, entropy = token_logprobs_and_entropy(logits, tokens, 0.7, chunk_elements=chunk_elements)
    (ours * weights).sum().backward()
    grad_ours = logits.grad.clone()
    logits.grad = None
    ref = naive(logits, tokens, 0.7)
    (ref * weights).sum().backward()
    log_p = torch.log_softmax(logits.detach() / 0.7, -1)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_ours, logits.grad, atol=1e-6, rtol=1e-6)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, 0.8, chunk_elements=10), (logits,))


def test_bfloat16_logits_match_float32_reference_and_keep_their_grad_dtype():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 33, generator=g).bfloat16().requires_grad_()
    tokens = torch.randint(0, 33, (2, 5), generator=g)
    out = token_logprobs(logits, tokens)
    torch.testing.assert_close(out, naive(logits.detach(), tokens), atol=1e-5, rtol=0)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 3, 5)
    before = logits.clone()
    token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.5)
    assert torch.equal(logits, before)


def test_bad_inputs():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


def test_entropy_from_the_same_pass_by_hand_and_against_the_separate_functions():
    from rlalign.core.kl import entropy_from_logits
    from rlalign.core.logprobs import token_logprobs_and_entropy

    # by hand: logits (0, ln 3) at temperature 1 -> pi = (1/4, 3/4); H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    logits = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]])
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert logp.item() == pytest.approx(float(torch.log(torch.tensor(0.75))), abs=1e-6)
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    # random logits, a temperature, several chunks: the same values as token_logprobs and entropy_from_logits,
    # the same gradient, and the entropy carries none
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 5))
    weights = torch.randn(3, 5, dtype=torch.float64)
    logp, entropy = token_logprobs_and_entropy(logits, tokens, 0.7, chunk_elements=100)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach() / 0.7), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    (expected_grad,) = torch.autograd.grad((token_logprobs(logits, tokens, 0.7) * weights).sum(), logits)
    torch.testing.assert_close(logp, token_logprobs(logits, tokens, 0.7), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


def test_an_entropy_bonus_on_bfloat16_logits_logs_the_entropy_the_statistic_logs():
    """passes.logprobs_and_entropy: with an entropy bonus (the entropy keeps its gradient) and without it (a statistic of
    the log-probs' pass), bfloat16 logits at a temperature give the same entropy, to float32 round-off."""
    from rlalign.train.passes import logprobs_and_entropy

    logits = (4 * torch.randn(2, 3, 5000, generator=torch.Generator().manual_seed(3))).bfloat16()
    tokens = torch.randint(0, 5000, (2, 3), generator=torch.Generator().manual_seed(4))
    _, statistic = logprobs_and_entropy(logits, tokens, 0.7, entropy_grad=False)
    _, bonus = logprobs_and_entropy(logits.requires_grad_(), tokens, 0.7, entropy_grad=True)
    assert bonus.requires_grad
    torch.testing.assert_close(bonus.detach(), statistic, atol=2e-5, rtol=0)


def test_masked_out_vocabulary_entries_add_nothing_to_the_entropy():
    from rlalign.core.kl import entropy_from_logits
    from rlalign.core.logprobs import token_logprobs_and_entropy

    # a -inf logit (a vocabulary entry masked out) has p = 0 and adds 0 * log 0 = 0 to H:
    # logits (0, ln 3, -inf) give pi = (1/4, 3/4, 0) and the H of (0, ln 3), 0.562335, not NaN
    logits = torch.tensor([[[0.0, math.log(3.0), float("-inf")]]], requires_grad=True)
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    differentiable = entropy_from_logits(logits)
    assert differentiable.item() == pytest.approx(0.562335, abs=1e-6)
    differentiable.sum().backward()
    # dH/dz_v = -p_v (log p_v + H): (-1/4 (ln 1/4 + H), -3/4 (ln 3/4 + H), 0) = (0.205990, -0.205990, 0)
    torch.testing.assert_close(logits.grad, torch.tensor([[[0.205990, -0.205990, 0.0]]]), atol=1e-6, rtol=0)


def test_logsumexp_in_a_workspace_is_torchs_bit_for_bit():
    """The chunked pass computes logsumexp with its temporaries in a reused buffer; the values are
    torch.logsumexp's exactly, rows of -inf and +inf included, in every float dtype."""
    from rlalign.core.logprobs import _logsumexp

    for dtype in (torch.float32, torch.float64):
        values = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(dtype) * 30
        values[1] = float("-inf")
        values[2, 17] = float("inf")
        values[3, :500] = float("-inf")
        expected = torch.logsumexp(values, dim=-1)
        work = torch.full_like(values, 123.0)  # stale contents must not matter
        assert torch.equal(_logsumexp(values, work).nan_to_num(0.5), expected.nan_to_num(0.5))


def test_chunks_share_one_workspace_and_match_a_single_chunk():
    """Many small chunks (each reusing the first chunk's buffers) give the log-probs, entropies and
    gradient of one chunk over all rows, bit for bit."""
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(1)) * 3
    tokens = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(3, 7, generator=torch.Generator().manual_seed(3))
    outputs = []
    for chunk_elements in (50 * 21, 50 * 2, 1):  # one chunk; 2 rows a chunk (the last chunk shorter); 1 row
        x = logits.clone().requires_grad_()
        logp, entropy = token_logprobs_and_entropy(x, tokens, temperature=0.7, chunk_elements=chunk_elements)
        (logp * weights).sum().backward()
        outputs.append((logp, entropy, x.grad))
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other):
            assert torch.equal(a, b)
