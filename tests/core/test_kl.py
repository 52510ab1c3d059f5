import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.core.kl import (
    AdaptiveKLController,
    FixedKLController,
    adaptive_kl_coef,
    categorical_kl,
    entropy_from_logits,
    kl_k1,
    kl_k2,
    kl_k3,
)


def test_estimators_hand_values():
    # pi(o) = 0.5, pi_ref(o) = 0.25: x = log(pi_ref/pi) = -ln 2
    # k1 = ln 2 = 0.693147;  k2 = (ln 2)^2 / 2 = 0.240227;  k3 = 0.5 + ln 2 - 1 = 0.193147
    logp, ref = torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))
    assert kl_k1(logp, ref).item() == pytest.approx(0.6931472, abs=1e-6)
    assert kl_k2(logp, ref).item() == pytest.approx(0.2402265, abs=1e-6)
    assert kl_k3(logp, ref).item() == pytest.approx(0.1931472, abs=1e-6)
    assert kl_k3(ref, ref).item() == 0.0


@settings(max_examples=200, deadline=None)
@given(st.floats(-30, 0, allow_nan=False), st.floats(-30, 0, allow_nan=False))
def test_k3_is_non_negative(logp, ref_logp):
    assert kl_k3(torch.tensor(logp, dtype=torch.float64), torch.tensor(ref_logp, dtype=torch.float64)).item() >= 0.0


def test_categorical_kl_hand_value():
    # p = (0.5, 0.5), q = (0.25, 0.75): 0.5 ln 2 + 0.5 ln(2/3) = 0.346574 - 0.202733 = 0.143841
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.75]))
    assert categorical_kl(p, q).item() == pytest.approx(0.1438410, abs=1e-6)
    assert categorical_kl(q, q).item() == pytest.approx(0.0, abs=1e-7)


def _monte_carlo(p_logits, q_logits, n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp_all = torch.log_softmax(p_logits.double(), -1)
    logq_all = torch.log_softmax(q_logits.double(), -1)
    samples = torch.multinomial(logp_all.exp(), n, replacement=True, generator=g)
    return logp_all[samples], logq_all[samples]


@pytest.mark.parametrize("estimator", [kl_k1, kl_k3])
def test_k1_and_k3_are_unbiased(estimator):
    # mean over 200k samples from pi is within 4 standard errors of the exact KL(pi || pi_ref)
    p_logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    q_logits = torch.tensor([0.3, 0.9, -1.0, 1.0, 0.5])
    exact = categorical_kl(p_logits.double(), q_logits.double()).item()
    values = estimator(*_monte_carlo(p_logits, q_logits))
    stderr = values.std().item() / math.sqrt(values.numel())
    assert abs(values.mean().item() - exact) < 4 * stderr


def test_k2_is_biased():
    # p = (0.9, 0.1), q = (0.1, 0.9): KL = 0.8 ln 9 = 1.7578, but E[k2] = (ln 9)^2 / 2 = 2.4139
    p_logits, q_logits = torch.log(torch.tensor([0.9, 0.1])), torch.log(torch.tensor([0.1, 0.9]))
    values = kl_k2(*_monte_carlo(p_logits, q_logits))
    assert values.mean().item() == pytest.approx(0.5 * math.log(9) ** 2, rel=1e-7)
    stderr = values.std().item() / math.sqrt(values.numel()) + 1e-12
    assert abs(values.mean().item() - 0.8 * math.log(9)) > 100 * stderr


def test_entropy_hand_value_and_matches_torch_distributions():
    # uniform over 4 -> ln 4 = 1.386294
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4), abs=1e-6)
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    expected = torch.distributions.Categorical(logits=logits).entropy()
    for chunk_rows in (1, 4, 1024):
        torch.testing.assert_close(entropy_from_logits(logits, chunk_rows=chunk_rows), expected, atol=1e-6, rtol=1e-6)


def test_entropy_gradient_flows():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1), requires_grad=True)
    entropy_from_logits(logits, chunk_rows=2).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.distributions.Categorical(logits=logits).entropy().sum().backward()
    torch.testing.assert_close(ours, logits.grad, atol=1e-6, rtol=1e-6)


def test_the_entropy_of_bfloat16_logits_at_a_temperature_is_that_of_their_float32_division():
    """softmax(z / tau) of bfloat16 logits z: dividing in bfloat16 first rounds z / tau again (errors of ~1e-2 nats on a
    spread vocabulary); the temperature divides after the float32 cast, as token_logprobs does, in value and gradient."""
    logits = (4 * torch.randn(6, 5000, generator=torch.Generator().manual_seed(2))).bfloat16().requires_grad_()
    exact = torch.distributions.Categorical(logits=logits.detach().double() / 0.7).entropy()  # (6,) float64
    ours = entropy_from_logits(logits, chunk_rows=4, temperature=0.7)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), exact, atol=2e-5, rtol=0)
    assert (entropy_from_logits(logits.detach() / 0.7).double() - exact).abs().max() > 1e-3  # what the bfloat16 division lost
    ours.sum().backward()
    reference = logits.detach().double().requires_grad_()
    torch.distributions.Categorical(logits=reference / 0.7).entropy().sum().backward()
    torch.testing.assert_close(logits.grad.double(), reference.grad.bfloat16().double(), atol=1e-6, rtol=2e-2)


def test_adaptive_kl_hand_values():
    # KL 12 vs target 6: error clipped to +0.2 -> 0.1 * (1 + 0.2 * 100/10000) = 0.1002
    assert adaptive_kl_coef(0.1, 12.0, 6.0, 10000, 100) == pytest.approx(0.1002, abs=1e-12)
    # KL 5 vs target 6: error -1/6 -> 0.1 * (1 - (1/6) * 0.01) = 0.0998333
    assert adaptive_kl_coef(0.1, 5.0, 6.0, 10000, 100) == pytest.approx(0.1 * (1 - 0.01 / 6), abs=1e-12)


def test_controllers_update_and_round_trip():
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 10) == 0.05
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 100)
    twin = AdaptiveKLController(1.0, target=1.0)
    twin.load_state_dict(ctl.state_dict())
    assert twin == ctl and twin.value == pytest.approx(0.1002)
    # sustained high KL raises beta, sustained low KL lowers it
    for _ in range(50):
        ctl.update(100.0, 1000)
    assert ctl.value > 0.1002


def test_categorical_kl_keeps_float64():
    p = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    q = torch.log(torch.tensor([0.25, 0.75], dtype=torch.float64))
    out = categorical_kl(p, q)
    assert out.dtype == torch.float64
    assert out.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-15)
