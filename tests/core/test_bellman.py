import pytest
import torch

from rlalign.core.bellman import double_q_target, polyak_update_, q_learning_target, q_learning_update


def test_q_learning_target_hand_values():
    # y0 = 1 + 0.9 * max(2, 5) = 5.5;  y1 = -1 + 0 (terminal) = -1
    rewards = torch.tensor([1.0, -1.0])
    next_q = torch.tensor([[2.0, 5.0], [7.0, 3.0]])
    torch.testing.assert_close(q_learning_target(rewards, next_q, torch.tensor([0, 1]), 0.9), torch.tensor([5.5, -1.0]))


def test_double_q_target_uses_online_argmax_and_target_value():
    # online picks action 0 (4 > 1); target values it at 2: y = 0 + 0.5 * 2 = 1  (plain max would give 0.5 * 6)
    y = double_q_target(torch.tensor([0.0]), torch.tensor([[4.0, 1.0]]), torch.tensor([[2.0, 6.0]]), torch.tensor([0]), 0.5)
    assert y.item() == 1.0


def test_q_learning_update_hand_value():
    # 2 + 0.1 * (5.5 - 2) = 2.35
    assert q_learning_update(torch.tensor([2.0]), torch.tensor([5.5]), 0.1).item() == pytest.approx(2.35)


def test_polyak_update_is_an_ema_and_tau_one_is_a_copy():
    target, online = [torch.tensor([0.0, 10.0])], [torch.tensor([1.0, 0.0])]
    polyak_update_(target, online, 0.25)  # 0.75 * (0, 10) + 0.25 * (1, 0) = (0.25, 7.5)
    torch.testing.assert_close(target[0], torch.tensor([0.25, 7.5]))
    polyak_update_(target, online, 1.0)
    torch.testing.assert_close(target[0], online[0])
    with pytest.raises(ValueError, match="tau"):
        polyak_update_(target, online, 0.0)
