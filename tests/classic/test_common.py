"""Shared helpers: schedules, episode tracking, MLP initialisation, evaluation, the environment
check and the guard against non-finite numbers."""

import numpy as np
import pytest
import torch
from torch import nn

from rlalign.classic.common import (
    EpisodeTracker,
    FiniteGuard,
    NonFiniteError,
    RunLog,
    check_env,
    collect_rollout,
    evaluate,
    linear_schedule,
    make_vec_env,
    mlp,
    state_index,
)
from rlalign.classic.dqn import DQNConfig
from rlalign.classic.ppo import PPOConfig
from rlalign.config import ConfigError, load_config
from rlalign.errors import RLAlignError


def test_linear_schedule():
    # from 1 to 0.1 over 10 steps: slope -0.09; t=5 -> 0.55; past the end it stays at 0.1
    assert linear_schedule(1.0, 0.1, 10, 5) == 0.55
    assert linear_schedule(1.0, 0.1, 10, 50) == 0.1
    assert linear_schedule(0.0, 1.0, 4, 2) == 0.5
    # rising from 0.2 to 1.0 over 4 steps: slope 0.2; t=2 -> 0.6; past the end it stays at 1.0
    assert linear_schedule(0.2, 1.0, 4, 2) == pytest.approx(0.6)
    assert linear_schedule(0.2, 1.0, 4, 9) == 1.0


def test_episode_tracker_reports_and_resets_per_env():
    tr = EpisodeTracker(2)
    assert tr.step(np.array([1.0, 2.0]), np.array([False, False])) == []
    assert tr.step(np.array([1.0, 2.0]), np.array([False, True])) == [4.0]
    assert tr.step(np.array([1.0, 5.0]), np.array([True, True])) == [3.0, 5.0]


def test_mlp_orthogonal_init():
    torch.manual_seed(0)
    net = mlp([4, 64, 64, 2], out_gain=0.01)
    w0, w_last = net[0].weight, net[-1].weight
    # orthogonal rows of the (64, 4) matrix scaled by sqrt(2): W^T W = 2 I
    torch.testing.assert_close(w0.T @ w0, 2.0 * torch.eye(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(w_last @ w_last.T, 1e-4 * torch.eye(2), rtol=0, atol=1e-9)
    assert all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in net if isinstance(m, torch.nn.Linear))


def test_state_index_and_evaluate_on_the_maze():
    assert state_index(np.eye(6, dtype=np.float32)[4]) == 4 and state_index(7) == 7
    path = {0: 3, 1: 1, 4: 3}  # right, down, right
    assert evaluate(lambda obs: path[state_index(obs)], "rlalign/Maze2x3-v0", episodes=2, seed=0) == [10.0, 10.0]
    assert evaluate(lambda obs: 0, "rlalign/Maze2x3-v0", episodes=1, seed=0) == [0.0]  # truncated at 50 steps


# --------------------------------------------------------------------------------------------
# FiniteGuard: the first non-finite number stops the run, named
# --------------------------------------------------------------------------------------------

GUARD = FiniteGuard("dqn", "Some-v0", {"q-network": "lr=1e+30 too high?"})


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf"), 3.5e38, -1e39])
def test_a_reward_not_finite_in_float32_is_an_error_naming_env_and_step(reward):
    # 3.5e38 is finite in float64 but beyond float32's largest, 3.4028e38: inf in the rollout buffer
    with pytest.raises(NonFiniteError, match=r"^dqn: env Some-v0 returned the reward .* at step 7; rewards must be finite in float32"):
        GUARD.rewards(7, np.array([1.0, reward]))
    assert issubclass(NonFiniteError, RLAlignError)  # the CLI prints it as one message and exits 2


def test_rewards_within_float32_pass():
    GUARD.rewards(1, 3.4e38)
    GUARD.rewards(1, np.array([-3.4e38, 0.0, 1.0]))


def test_update_names_the_loss_the_parameters_or_the_outputs():
    net = nn.Linear(2, 2)
    GUARD.update(5, "q-network", net, {"TD loss": torch.tensor(0.5)}, torch.ones(3, 2))  # all finite: no error
    with pytest.raises(NonFiniteError, match=r"^dqn: the TD loss is nan at the update at step 5 \(lr=1e\+30 too high\?\)$"):
        GUARD.update(5, "q-network", net, {"TD loss": torch.tensor(float("nan"), requires_grad=True)})
    with torch.no_grad():
        net.weight.fill_(1e30)  # finite parameters whose outputs overflow: 1e30 * 1e9 = 1e39 > 3.4e38
    with pytest.raises(NonFiniteError, match=r"^dqn: the q-network's outputs are not finite after the update at step 5 \(lr=1e\+30 too high\?\)$"):
        GUARD.update(5, "q-network", net, {"TD loss": 1.0}, torch.full((1, 2), 1e9))
    with torch.no_grad():
        net.bias[1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"^dqn: the q-network's parameters are not finite after the update at step 5 "):
        GUARD.update(5, "q-network", net, {"TD loss": 1.0})


class Constant(nn.Module):
    """Outputs ``value`` for every observation: (B, width)."""

    def __init__(self, value: float, width: int) -> None:
        super().__init__()
        self.value, self.width = value, width

    def forward(self, obs):
        return torch.full((*obs.shape[:-1], self.width), self.value)


@pytest.mark.parametrize("policy, critic, message", [
    (Constant(float("inf"), 4), None, "ppo: the actor's outputs are not finite at step 0 (lr=1 too high?)"),  # torch.multinomial raised before
    (Constant(0.0, 4), Constant(float("nan"), 1), "ppo: the critic's outputs are not finite at step 6 (critic_lr=2 too high?)"),  # went into GAE
])
def test_the_rollout_checks_the_logits_before_sampling_and_the_values(policy, critic, message):
    envs = make_vec_env("rlalign/Maze2x3-v0", 2, 0)
    obs, _ = envs.reset(seed=0)
    guard = FiniteGuard("ppo", "rlalign/Maze2x3-v0", {"actor": "lr=1 too high?", "critic": "critic_lr=2 too high?"})
    with pytest.raises(NonFiniteError) as err:
        collect_rollout(envs, obs, policy, critic, 3, EpisodeTracker(2), RunLog(), 0, guard)
    envs.close()
    assert str(err.value) == message


def test_returns_that_overflow_are_an_error():
    with pytest.raises(NonFiniteError, match=r"^ppo: the GAE returns of the rollout ending at step 64 are not finite"):
        FiniteGuard("ppo", "Some-v0", {}).returns(64, {"GAE returns": torch.tensor([1.0, float("inf")])})


# --------------------------------------------------------------------------------------------
# check_env: the environment made once, before training, checked against the algorithm
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env_id, kind, message", [
    ("NoSuchEnv-v0", "vector", "--env 'NoSuchEnv-v0': Environment `NoSuchEnv` doesn't exist"),
    ("CartPole-v99", "vector", "--env 'CartPole-v99': Environment version `v99` for environment `CartPole` doesn't exist"),
    ("nosuchmodule:Foo-v0", "vector", "--env 'nosuchmodule:Foo-v0': cannot import module 'nosuchmodule'"),
    ("CartPole-v1", "tabular", "--env 'CartPole-v1': q_learning needs Discrete observations (or a model env.unwrapped.P, as the maze has), not Box(4,)"),
    ("FrozenLake-v1", "vector", "--env 'FrozenLake-v1': dqn, vpg, trpo and ppo need vector observations (a flat Box), not Discrete(16)"),
    ("Pendulum-v1", "vector", "--env 'Pendulum-v1': the classic algorithms need a Discrete action space, not Box(1,)"),
    ("CartPole-v1", "model", "--env 'CartPole-v1': value_iteration needs the environment's model env.unwrapped.P"),
])
def test_check_env_refuses_unknown_ids_and_unsuitable_spaces(env_id, kind, message):
    with pytest.raises(ConfigError) as err:
        check_env(env_id, kind)
    assert str(err.value).startswith(message)


def test_check_env_accepts_what_each_kind_takes(env_module):
    assert check_env("CartPole-v1", "vector") == "CartPole-v1"
    assert check_env("rlalign/Maze2x3-v0", "tabular") == check_env("rlalign/Maze2x3-v0", "vector") == "rlalign/Maze2x3-v0"  # one-hot + model
    assert check_env("FrozenLake-v1", "model") == check_env("FrozenLake-v1", "tabular") == "FrozenLake-v1"
    module, env_id = env_module
    assert check_env(f"{module}:{env_id}", "vector") == env_id  # imported, registered, and named as registered


def test_evaluate_takes_the_module_form_as_training_does(env_module):
    # gym.make accepts module:EnvId; the evaluation used gym.spec, which does not (NameNotFound after training)
    module, env_id = env_module
    assert evaluate(lambda obs: 0, f"{module}:{env_id}", episodes=2, seed=0) == evaluate(lambda obs: 0, env_id, episodes=2, seed=0)


# --------------------------------------------------------------------------------------------
# Config values that trained silently wrong or crashed late
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, overrides, message", [
    (PPOConfig, ["hidden=[0]"], "hidden = [0]: every hidden layer size must be >= 1"),
    (DQNConfig, ["hidden=[64,0]"], "hidden = [64, 0]: every hidden layer size must be >= 1"),
    (PPOConfig, ["num_minibatches=1000", "num_envs=1", "num_steps=10"], "num_minibatches = 1000 is more than the batch of num_envs * num_steps = 10"),
    (PPOConfig, ["clip_coef=1e40"], "clip_coef = '1e40': beyond float32's range"),
])
def test_config_values_that_cannot_work_are_refused(cls, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(cls, None, overrides)
    assert message in str(err.value)


def test_config_edges_that_work_are_accepted():
    assert PPOConfig(hidden=[], num_minibatches=10, num_envs=1, num_steps=10, clip_coef=3e38).hidden == []  # a linear policy; one transition per minibatch
