"""The composed loss and update of every classic trainer, pinned term by term on tiny fixed cases.

Each test runs a trainer's own ``train`` loop on a fixed case (explicit weights, a fixed transition
batch or a tiny deterministic environment) and checks every loss value and gradient it produced
against an independent computation written here from the formulas in the module docstrings: plain
loops over the batch, torch only for log_softmax and for autograd of the hand-written expression.
One case per option that changes the loss.

The seams, monkeypatched per test (nothing in rlalign is changed):
- ``mlp`` returns one nn.Linear with the explicit weights below (float64 for VPG, TRPO and PPO);
- ``collect_rollout`` returns a fixed transition batch (VPG, TRPO, PPO); ``gym.make`` a tiny chain
  (Q-learning, DQN);
- ``torch.optim.Adam`` is plain SGD that records, at every step, the parameters before it, the
  gradients it received (after any clipping), its learning rate and the loss last backpropagated;
- ``torch.randperm`` (the minibatch order) is the reversal n-1, ..., 0; ``finish`` skips the final
  evaluation.
The expected side of step k starts from the parameters recorded before step k, so each step is
checked on its own, and so is the loop's bookkeeping (minibatches, epochs, annealing, the target
network, the replay sampling, the line search). Q-learning and DQN runs are replayed whole here,
with the run's random generator. Last, the smaller exposed units (TRPO's line search and conjugate
gradient, VPG's gradient variance, the rollout collector, the schedule) on hand-derived numbers, and
how each trainer hands its greedy policy to evaluation and ``finish``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import Tensor, nn

from rlalign.classic import dqn, ppo, q_learning, trpo, vpg
from rlalign.classic.common import EpisodeTracker, FiniteGuard, Rollout, RunLog, collect_rollout, linear_schedule

torch.set_num_threads(1)

F64 = dict(rtol=1e-9, atol=1e-12)  # float64 on both sides: only summation order differs
F32 = dict(rtol=1e-5, atol=1e-6)  # float32 trainer against the float64 expectation


# --------------------------------------------------------------------------------------------
# Seams
# --------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One optimizer step as the optimizer saw it."""

    params: list[Tensor]  # before the step
    grads: list[Tensor]  # what the step used: after any gradient-norm clipping
    lr: float
    loss: Tensor  # the last tensor .backward() was called on before this step
    after: list[Tensor]  # after the step


class Recorder:
    def __init__(self) -> None:
        self.optimizers: list = []  # in construction order
        self.last_loss: Tensor | None = None


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    """``torch.optim.Adam`` -> recording SGD (p <- p - lr * grad), ``Tensor.backward`` -> recording."""
    rec = Recorder()
    backward = torch.Tensor.backward

    def recording_backward(self, *args, **kwargs):
        rec.last_loss = self.detach().clone()
        return backward(self, *args, **kwargs)

    class RecordingSGD(torch.optim.SGD):
        def __init__(self, params, lr, **kwargs):
            super().__init__(params, lr=lr)
            self.kwargs, self.steps = kwargs, []
            rec.optimizers.append(self)

        def step(self, closure=None):
            params = self.param_groups[0]["params"]
            before = [p.detach().clone() for p in params]
            grads = [p.grad.detach().clone() for p in params]
            super().step()
            self.steps.append(Step(before, grads, self.param_groups[0]["lr"], rec.last_loss, [p.detach().clone() for p in params]))

    monkeypatch.setattr(torch.Tensor, "backward", recording_backward)
    monkeypatch.setattr(torch.optim, "Adam", RecordingSGD)
    return rec


def linear(weight: list, bias: list, dtype=torch.float64) -> nn.Linear:
    """nn.Linear with the given weight (out, in) and bias (out,)."""
    w, b = torch.tensor(weight, dtype=dtype), torch.tensor(bias, dtype=dtype)
    layer = nn.Linear(w.shape[1], w.shape[0], dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def patch_mlp(monkeypatch, module, nets: dict[int, tuple[list, list]], dtype=torch.float64) -> list:
    """``module.mlp(sizes, ...)`` -> linear(*nets[sizes[-1]]); returns the calls' (sizes, activation, out_gain)."""
    calls = []

    def fixed_mlp(sizes, activation=nn.Tanh, out_gain=1.0):
        calls.append((list(sizes), activation, out_gain))
        return linear(*nets[sizes[-1]], dtype=dtype)

    monkeypatch.setattr(module, "mlp", fixed_mlp)
    return calls


def patch_finish(monkeypatch, module) -> None:
    """No final evaluation: ``train`` returns (agent, log)."""
    monkeypatch.setattr(module, "finish", lambda cfg, env_id, agent, act, log: SimpleNamespace(agent=agent, log=log))


def reversed_randperm(n, **kwargs) -> Tensor:
    return torch.arange(n - 1, -1, -1)


def params_of(step_params: list[Tensor]) -> list[Tensor]:
    """Leaf float64 copies with grad, for the expected side."""
    return [p.detach().to(torch.float64).clone().requires_grad_(True) for p in step_params]


def clip_by_global_norm(grads: list[Tensor], max_norm: float) -> list[Tensor]:
    """g * min(1, max_norm / (||g|| + 1e-6)), ||g|| over all tensors together (clip_grad_norm_)."""
    norm = math.sqrt(sum(float((g**2).sum()) for g in grads))
    return [g * min(1.0, max_norm / (norm + 1e-6)) for g in grads]


def assert_grads(actual: list[Tensor], expected: list[Tensor], tol: dict) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.to(torch.float64), e.to(torch.float64), **tol)


# --------------------------------------------------------------------------------------------
# The fixed on-policy batch (VPG, TRPO, PPO): T = 4 steps of N = 2 envs, obs dim 3, 3 actions
# --------------------------------------------------------------------------------------------

DIM, N_ACTIONS = 3, 3
ACTOR = ([[0.3, -0.2, 0.1], [-0.1, 0.4, 0.2], [0.2, 0.1, -0.3]], [0.1, -0.1, 0.0])  # W (A, dim), b (A,)
CRITIC = ([[0.5, -0.3, 0.2]], [0.1])  # W (1, dim), b (1,)
# The batch was sampled by an older actor and critic: the current ones plus these shifts, so the
# ratio pi/pi_old is not 1 and V_old is not V from the first minibatch on.
OLD_ACTOR_SHIFT = ([[0.4, 0.0, -0.3], [0.0, -0.4, 0.3], [-0.3, 0.3, 0.0]], [0.0, 0.2, -0.2])
OLD_CRITIC_SHIFT = ([[0.3, 0.2, -0.4]], [-0.2])


@dataclass
class Batch:
    """A fixed transition batch, time-major."""

    obs: list  # (T, N, dim)
    next_obs: list  # (T, N, dim): obs[t+1] within an episode, the true final obs at an episode end
    actions: list  # (T, N)
    rewards: list  # (T, N)
    terminated: list  # (T, N)
    episode_ends: list  # (T, N): terminated or truncated


# env 0: terminates at t=1, a new episode runs t=2..3 and goes on past the rollout.
# env 1: truncated at t=2 (bootstraps from its true final obs), a new episode starts at t=3.
PPO_BATCH = Batch(
    obs=[
        [[1.0, 0.0, 0.5], [0.2, -1.0, 0.3]],
        [[0.5, 1.0, -0.5], [1.5, 0.5, 0.0]],
        [[-1.0, 0.5, 1.0], [0.0, 0.0, 1.0]],
        [[0.0, -0.5, 1.5], [-0.5, 1.0, 0.5]],
    ],
    next_obs=[
        [[0.5, 1.0, -0.5], [1.5, 0.5, 0.0]],
        [[2.0, 2.0, 2.0], [0.0, 0.0, 1.0]],  # env 0: terminal obs (its value must not count)
        [[0.0, -0.5, 1.5], [1.0, -1.0, 1.0]],  # env 1: true final obs of the truncated episode
        [[0.5, 0.5, -1.0], [-1.0, 0.0, 0.5]],  # the obs the next rollout would start from
    ],
    actions=[[0, 1], [2, 1], [1, 2], [0, 0]],
    rewards=[[1.0, 0.5], [2.0, 1.5], [-0.5, 1.0], [1.0, -1.0]],
    terminated=[[0, 0], [1, 0], [0, 0], [0, 0]],
    episode_ends=[[0, 0], [1, 0], [0, 1], [0, 0]],
)


class FakeVecEnv:
    """What the on-policy ``train`` reads of the vector env when ``collect_rollout`` is patched."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.single_observation_space = spaces.Box(-10.0, 10.0, shape=(DIM,), dtype=np.float64)
        self.single_action_space = spaces.Discrete(N_ACTIONS)
        self.reset_seeds: list = []
        self.obs = None  # what the next collect_rollout must continue from

    def reset(self, seed=None):
        self.reset_seeds.append(seed)
        self.obs = np.zeros((self.num_envs, DIM))
        return self.obs, {}

    def close(self) -> None:
        pass


def patch_on_policy(monkeypatch, module, batch: Batch, extension: Batch | None = None) -> SimpleNamespace:
    """Fixed nets, a fake vector env, and ``collect_rollout`` returning ``batch`` with the log-probs
    and values of the old actor and critic (the current ones plus the shifts). With ``extension``
    (VPG's critic-free Psi) the calls alternate: ``batch`` for a rollout, then ``extension`` for the
    min(T, 32) steps the trainer samples next to run the rollout's episodes to their ends. Returns
    the rollouts handed out, the ``mlp`` calls and the envs made as (env_id, num_envs, seed, env)."""
    calls = patch_mlp(monkeypatch, module, {N_ACTIONS: ACTOR, 1: CRITIC})
    patch_finish(monkeypatch, module)
    made: list[tuple] = []

    def make_vec_env(env_id, num_envs, seed):
        made.append((env_id, num_envs, seed, FakeVecEnv(num_envs)))
        return made[-1][-1]

    monkeypatch.setattr(module, "make_vec_env", make_vec_env)
    monkeypatch.setattr(torch, "randperm", reversed_randperm)
    rollouts: list[Rollout] = []
    d_actor, d_critic = linear(*OLD_ACTOR_SHIFT), linear(*OLD_CRITIC_SHIFT)
    T, N = torch.tensor(batch.actions).shape

    def fake_collect(envs, last_obs, policy, value, num_steps, tracker, log, step, guard):
        part = batch if extension is None or len(rollouts) % 2 == 0 else extension
        obs, next_obs = torch.tensor(part.obs, dtype=torch.float64), torch.tensor(part.next_obs, dtype=torch.float64)
        actions = torch.tensor(part.actions)
        assert isinstance(guard, FiniteGuard) and guard.env_id == "fixed-batch"
        assert actions.shape == (num_steps, N) and num_steps == (T if part is batch else min(T, vpg.EXTENSION_CHUNK))
        assert envs.num_envs == N and step == len(rollouts) * T * N
        assert last_obs is envs.obs  # continues from the reset, then from where the last rollout stopped
        assert isinstance(tracker, EpisodeTracker) and len(tracker.running) == N and isinstance(log, RunLog)
        envs.obs = np.full((N, DIM), float(len(rollouts) + 1))
        with torch.no_grad():
            old_logits = policy(obs) + d_actor(obs)  # (T, N, A)
            logp = torch.log_softmax(old_logits, -1).gather(-1, actions[..., None]).squeeze(-1)  # (T, N)
            values = (value(obs) + d_critic(obs)).squeeze(-1)  # (T, N)
            next_values = (value(next_obs) + d_critic(next_obs)).squeeze(-1)  # (T, N)
        ro = Rollout(
            obs=obs, actions=actions, logp=logp, values=values, next_values=next_values,
            rewards=torch.tensor(part.rewards, dtype=torch.float64),
            terminated=torch.tensor(part.terminated, dtype=torch.float64),
            episode_ends=torch.tensor(part.episode_ends, dtype=torch.float64),
        )
        rollouts.append(ro)
        return ro, envs.obs, step + num_steps * N

    monkeypatch.setattr(module, "collect_rollout", fake_collect)
    return SimpleNamespace(rollouts=rollouts, mlp_calls=calls, made=made)


def assert_made_and_reset(seam: SimpleNamespace, cfg) -> None:
    """One vector env of cfg.num_envs for the run's env id, seeded, and reset once with the seed."""
    ((env_id, num_envs, seed, envs),) = seam.made
    assert (env_id, num_envs, seed, envs.reset_seeds) == ("fixed-batch", cfg.num_envs, cfg.seed, [cfg.seed])



def run_on_policy(monkeypatch, module, cfg, batch: Batch, extension: Batch | None = None):
    """``module.train`` on the fixed batch, after checking what every on-policy trainer builds: one
    seeded vector env, reset once, and an actor (gain 0.01) and a critic (gain 1) of the fixed nets.
    Returns (the trainer's result, the rollouts it was handed)."""
    seam = patch_on_policy(monkeypatch, module, batch, extension)
    result = module.train(cfg, "fixed-batch")
    assert_made_and_reset(seam, cfg)
    assert seam.mlp_calls == [([DIM, N_ACTIONS], nn.Tanh, 0.01), ([DIM, 1], nn.Tanh, 1.0)]
    return result, seam.rollouts


def gae_by_loop(ro: Rollout, gamma: float, lam: float) -> tuple[list, list]:
    """GAE per env column, backwards (Schulman et al. 2016, eq. 16):
    delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t),
    A_t = delta_t + gamma * lam * (1 - end_t) * A_{t+1};  R_t = A_t + V(s_t).  Lists (T, N)."""
    T, N = ro.rewards.shape
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            r, term, end = float(ro.rewards[t, n]), float(ro.terminated[t, n]), float(ro.episode_ends[t, n])
            delta = r + gamma * (1.0 - term) * float(ro.next_values[t, n]) - float(ro.values[t, n])
            running = delta + gamma * lam * (1.0 - end) * running
            adv[t][n] = running
    returns = [[adv[t][n] + float(ro.values[t, n]) for n in range(N)] for t in range(T)]
    return adv, returns


def whiten_list(xs: list[float]) -> list[float]:
    """(x - mean) / sqrt(var + 1e-8) with the unbiased variance."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def log_pi(W: Tensor, b: Tensor, obs: Tensor) -> Tensor:
    """log softmax(W obs + b), (A,), for one observation (dim,)."""
    return torch.log_softmax(W @ obs + b, dim=0)


def flat_samples(ro: Rollout, adv: list, returns: list) -> list[SimpleNamespace]:
    """The rollout flattened time-major (i = t * N + n), as the trainers flatten it."""
    T, N = ro.rewards.shape
    return [
        SimpleNamespace(obs=ro.obs[t, n], action=int(ro.actions[t, n]), old_logp=float(ro.logp[t, n]),
                        adv=adv[t][n], ret=returns[t][n], old_value=float(ro.values[t, n]))
        for t in range(T) for n in range(N)
    ]


def explained_variance_by_hand(values: list[float], returns: list[float]) -> float:
    """1 - Var[R - V] / Var[R], unbiased variances."""
    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return 1.0 - var([r - v for r, v in zip(returns, values)]) / var(returns)


# --------------------------------------------------------------------------------------------
# PPO
# --------------------------------------------------------------------------------------------

# Two iterations of 8 transitions, 2 minibatches of 4, 2 epochs: 8 optimizer steps. SGD's lr 0.5
# moves the nets enough that later minibatches see other ratios and values.
PPO_BASE = dict(
    total_steps=16, num_envs=2, num_steps=4, num_minibatches=2, update_epochs=2, lr=0.5, anneal_lr=True,
    gamma=0.9, gae_lambda=0.8, clip_coef=0.2, anneal_clip=True, clip_vloss=False, norm_adv=True,
    ent_coef=0.0, vf_coef=0.5, max_grad_norm=1e6, target_kl=None, hidden=[], eval_every=0,
)
PPO_CASES = {
    "base": {},
    "clip_coef=0.1": dict(clip_coef=0.1),
    "clip_vloss": dict(clip_vloss=True),  # the value clip is annealed with the surrogate's: 0.2, then 0.1
    "clip_vloss,no_anneal_clip": dict(clip_vloss=True, anneal_clip=False),
    "vf_coef=1.5": dict(vf_coef=1.5),
    "ent_coef=0.1": dict(ent_coef=0.1),
    "no_norm_adv": dict(norm_adv=False),
    "gamma=0.5,lam=0": dict(gamma=0.5, gae_lambda=0.0),
    "gamma=1,lam=1": dict(gamma=1.0, gae_lambda=1.0),
    "grad_norm_clipped": dict(max_grad_norm=0.05),
    "no_annealing": dict(anneal_lr=False, anneal_clip=False),
    "target_kl_stops_epochs": dict(target_kl=1e-3),
    "one_iteration,one_minibatch,3_epochs": dict(total_steps=8, num_minibatches=1, update_epochs=3),
}


def ppo_minibatch_by_hand(params: list[Tensor], samples: list, mb: list[int], clip: float, cfg) -> SimpleNamespace:
    """L = L^CLIP + c1 L^V - c2 H over one minibatch, summed sample by sample:
    L^CLIP = -1/M sum min(r A, clip(r, 1 - eps, 1 + eps) A),  r = exp(log pi - log pi_old), A whitened
             over the minibatch when norm_adv;
    L^V = 1/M sum 1/2 (V - R)^2, or 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2);
    H = 1/M sum -sum_a pi log pi.  Gradients w.r.t. actor W, b and critic W, b, then clipped to
    max_grad_norm over all four together. Stats: approx_kl = 1/M sum (r - 1) - log r; outside =
    1/M #{|r - 1| > eps} (CleanRL's clipfrac); active = 1/M #{A > 0 and r > 1 + eps, or A < 0 and
    r < 1 - eps} (the samples whose clipped term is active)."""
    W, b, Wv, bv = params_of(params)
    advs = [samples[i].adv for i in mb]
    if cfg.norm_adv:
        advs = whiten_list(advs)
    pg = value = entropy = 0.0
    approx_kl = outside = active = 0.0
    regimes = set()
    for a_hat, i in zip(advs, mb):
        s = samples[i]
        logp = log_pi(W, b, s.obs)  # (A,)
        ratio = torch.exp(logp[s.action] - s.old_logp)
        pg = pg - torch.minimum(ratio * a_hat, ratio.clamp(1 - clip, 1 + clip) * a_hat)
        v = (Wv @ s.obs + bv)[0]
        err = (v - s.ret) ** 2
        if cfg.clip_vloss:
            v_clipped = s.old_value + (v - s.old_value).clamp(-clip, clip)
            if abs(v.item() - s.old_value) > clip:
                regimes.add("value clipped, larger" if ((v_clipped - s.ret) ** 2).item() > err.item() else "value clipped, smaller")
            err = torch.maximum(err, (v_clipped - s.ret) ** 2)
        value = value + 0.5 * err
        entropy = entropy - (logp.exp() * logp).sum()
        r = ratio.item()
        approx_kl += (r - 1.0) - math.log(r)
        high, low = a_hat > 0 and r > 1 + clip, a_hat < 0 and r < 1 - clip
        active += high + low
        outside += abs(r - 1.0) > clip
        regimes.add("high" if high else "low" if low else "inside")
        if abs(r - 1.0) > clip and not (high or low):
            regimes.add("outside, not active")
    M = len(mb)
    loss = pg / M + cfg.vf_coef * value / M - cfg.ent_coef * entropy / M
    grads = clip_by_global_norm(list(torch.autograd.grad(loss, [W, b, Wv, bv])), cfg.max_grad_norm)
    return SimpleNamespace(loss=loss.detach(), grads=grads, pg=pg.item() / M, value=value.item() / M,
                           entropy=entropy.item() / M, approx_kl=approx_kl / M, outside=outside / M, active=active / M, regimes=regimes)


@pytest.mark.parametrize("case", PPO_CASES.values(), ids=PPO_CASES.keys())
def test_ppo_update_matches_hand_computation(case, monkeypatch, recorder):
    cfg = ppo.PPOConfig(**{**PPO_BASE, **case})
    result, rollouts = run_on_policy(monkeypatch, ppo, cfg, PPO_BATCH)
    (opt,) = recorder.optimizers
    assert opt.kwargs["eps"] == 1e-5 and opt.defaults["lr"] == cfg.lr
    assert [p.shape for p in opt.param_groups[0]["params"]] == [(3, 3), (3,), (1, 3), (1,)]  # actor and critic
    B = 8
    num_iterations = max(cfg.total_steps // B, 1)
    mb_size = B // cfg.num_minibatches
    minibatches = [list(range(B - 1, -1, -1))[j * mb_size:(j + 1) * mb_size] for j in range(cfg.num_minibatches)]  # randperm reversed
    k, regimes = 0, set()
    assert len(rollouts) == num_iterations == len(result.log.updates)
    for it, ro in enumerate(rollouts):
        frac = 1.0 - it / num_iterations  # 1, then 0.5
        lr = cfg.lr * frac if cfg.anneal_lr else cfg.lr
        clip = cfg.clip_coef * frac if cfg.anneal_clip else cfg.clip_coef
        adv, returns = gae_by_loop(ro, cfg.gamma, cfg.gae_lambda)
        samples = flat_samples(ro, adv, returns)
        first_params = opt.steps[k].params
        every = []  # each minibatch of every epoch run, by hand
        for epoch in range(cfg.update_epochs):
            for mb in minibatches:
                step = opt.steps[k]
                want = ppo_minibatch_by_hand(step.params, samples, mb, clip, cfg)
                torch.testing.assert_close(step.loss, want.loss, **F64)
                assert_grads(step.grads, want.grads, F64)
                assert step.lr == pytest.approx(lr, rel=1e-12)
                regimes |= want.regimes
                every.append(want)
                k += 1
            if cfg.target_kl is not None and want.approx_kl > cfg.target_kl:
                break
        stats = result.log.updates[it]
        assert stats["epochs"] == epoch + 1 and stats["step"] == (it + 1) * B
        assert stats["lr"] == pytest.approx(lr, rel=1e-12)
        # CleanRL's logging: the losses, entropy and approx_kl of the last minibatch run; clip_frac the
        # mean over every minibatch run of the share with |r - 1| > eps; clip_active_frac likewise
        for key, value in [("loss/policy", want.pg), ("loss/value", want.value), ("entropy", want.entropy),
                           ("approx_kl", want.approx_kl), ("clip_frac", sum(w.outside for w in every) / len(every)),
                           ("clip_active_frac", sum(w.active for w in every) / len(every))]:
            assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        W, b = first_params[0].double(), first_params[1].double()
        first_dev = max(abs(float(log_pi(W, b, samples[i].obs)[samples[i].action]) - samples[i].old_logp) for i in minibatches[0])
        assert stats["ratio/first_minibatch_max_log_dev"] == pytest.approx(first_dev, rel=1e-9)
        ev = explained_variance_by_hand([s.old_value for s in samples], [s.ret for s in samples])
        assert stats["explained_variance"] == pytest.approx(ev, rel=1e-5, abs=1e-6)  # computed in float32
    assert k == len(opt.steps)
    assert {"high", "low", "inside", "outside, not active"} <= regimes  # both clipped sides, and a ratio outside with an unclipped term
    if cfg.clip_vloss:
        assert {"value clipped, larger", "value clipped, smaller"} <= regimes
    if cfg.target_kl is not None:
        assert [u["epochs"] for u in result.log.updates] == [1] * num_iterations
    if cfg.max_grad_norm < 1:  # the clip is active at every step: the norm is max_norm * |g| / (|g| + 1e-6)
        assert all(math.sqrt(sum(float((g**2).sum()) for g in s.grads)) == pytest.approx(cfg.max_grad_norm, rel=1e-4) for s in opt.steps)


# --------------------------------------------------------------------------------------------
# VPG
# --------------------------------------------------------------------------------------------

# T = 5 steps of N = 2 envs. env 0: episode A = t0-t1 (terminated), episode B = t2-t3 (truncated),
# episode C begins at t4. env 1: one episode t0-t2 (terminated), episode D begins at t3. With a
# critic every step counts (the cut bootstraps from V(s_5)). Without one the trainer samples
# VPG_EXTENSION next (t5-t9), in which C terminates at t5 and D is truncated at t6: env 0 counts
# t0-t5, env 1 t0-t6, 13 of the 20 steps; the episodes begun in the extension (env 0: t6-t7 and
# t8-t9, env 1: t7-t9) count for nothing. Two rollouts: in the second, total_return also drops env
# 1's t0-t2, the rest of an episode begun before (the first rollout's t9 ended none in env 1, but
# did in env 0): 10 of 20 steps.
VPG_BATCH = Batch(
    obs=[
        [[1.0, 0.0, 0.5], [0.2, -1.0, 0.3]],
        [[0.5, 1.0, -0.5], [1.5, 0.5, 0.0]],
        [[-1.0, 0.5, 1.0], [0.0, 0.0, 1.0]],
        [[0.0, -0.5, 1.5], [-0.5, 1.0, 0.5]],
        [[1.0, 1.0, 0.0], [0.5, -0.5, -1.0]],
    ],
    next_obs=[
        [[0.5, 1.0, -0.5], [1.5, 0.5, 0.0]],
        [[2.0, 2.0, 2.0], [0.0, 0.0, 1.0]],  # env 0: terminal
        [[0.0, -0.5, 1.5], [1.0, 1.0, 1.0]],  # env 1: terminal
        [[1.0, -1.0, 1.0], [0.5, -0.5, -1.0]],  # env 0: true final obs of the truncated episode
        [[0.5, 0.5, -1.0], [-1.0, 0.0, 0.5]],
    ],
    actions=[[0, 1], [2, 1], [1, 2], [0, 0], [2, 1]],
    rewards=[[1.0, 0.5], [2.0, 1.0], [0.5, 2.0], [-1.0, -0.5], [3.0, 1.5]],
    terminated=[[0, 0], [1, 0], [0, 1], [0, 0], [0, 0]],
    episode_ends=[[0, 0], [1, 0], [0, 1], [1, 0], [0, 0]],
)
VPG_EXTENSION = Batch(  # t5-t9, sampled after VPG_BATCH by the critic-free Psi
    obs=[
        [[0.5, 0.5, -1.0], [-1.0, 0.0, 0.5]],
        [[1.0, 0.0, 0.5], [0.5, 1.5, -0.5]],
        [[0.0, 1.0, -1.0], [1.0, 0.0, 0.5]],
        [[-0.5, 0.5, 0.5], [0.5, -1.0, 1.0]],
        [[1.0, 0.0, 0.5], [-0.5, 0.5, 0.0]],
    ],
    next_obs=[
        [[2.0, 2.0, 2.0], [0.5, 1.5, -0.5]],  # env 0: terminal (C ends)
        [[0.0, 1.0, -1.0], [1.5, -0.5, 1.0]],  # env 1: true final obs of the truncated D
        [[2.0, -2.0, 2.0], [0.5, -1.0, 1.0]],  # env 0: terminal
        [[1.0, 0.0, 0.5], [-0.5, 0.5, 0.0]],
        [[0.0, -1.0, 1.0], [1.0, 1.0, -1.0]],  # env 0: true final obs of a truncated episode
    ],
    actions=[[1, 0], [0, 2], [2, 2], [1, 0], [0, 1]],
    rewards=[[0.5, 2.5], [-1.0, 1.0], [2.0, -1.5], [1.0, 0.5], [-0.5, 2.0]],
    terminated=[[1, 0], [0, 0], [1, 0], [0, 0], [0, 0]],
    episode_ends=[[1, 0], [0, 1], [1, 0], [0, 0], [1, 0]],
)
VPG_BASE = dict(total_steps=20, num_envs=2, num_steps=5, lr=0.5, critic_lr=0.3, critic_updates=3, gamma=0.9,
                gae_lambda=0.8, norm_adv=False, measure_variance=True, hidden=[], eval_every=0)
VPG_CASES = {
    "total_return": dict(psi="total_return"),
    "reward_to_go": dict(psi="reward_to_go"),
    "reward_to_go_baseline": dict(psi="reward_to_go_baseline"),
    "gae": dict(psi="gae"),
    "gae,gamma=0.5,lam=0": dict(psi="gae", gamma=0.5, gae_lambda=0.0),
    "gae,gamma=1,lam=1": dict(psi="gae", gamma=1.0, gae_lambda=1.0),
    "reward_to_go_baseline,norm_adv": dict(psi="reward_to_go_baseline", norm_adv=True),
    "total_return,norm_adv,gamma=0.5": dict(psi="total_return", norm_adv=True, gamma=0.5),
}
CRITIC_FREE = ("total_return", "reward_to_go")
# counted steps / sampled steps in the two iterations (the comment above VPG_BATCH)
VPG_COUNTED_FRAC = {"total_return": (13 / 20, 10 / 20), "reward_to_go": (13 / 20, 13 / 20), "reward_to_go_baseline": (1.0, 1.0), "gae": (1.0, 1.0)}


def episodes_of(ends_column: list) -> list[list[int]]:
    """The steps of each episode in one env column, the unfinished tail last (if any)."""
    episodes, current = [], []
    for t, end in enumerate(ends_column):
        current.append(t)
        if end:
            episodes.append(current)
            current = []
    return episodes + ([current] if current else [])


def cat_by_hand(parts: list[Rollout]) -> Rollout:
    """Rollouts one after the other: each field concatenated on time (None stays None)."""
    return Rollout(**{k: None if v is None else torch.cat([getattr(p, k) for p in parts]) for k, v in vars(parts[0]).items()})


def psi_by_loop(psi: str, ro: Rollout, gamma: float, lam: float, starts: list | None = None, window: int | None = None) -> tuple[list, list, list]:
    """(Psi, baseline target, the mask of the steps the loss counts), lists (T, N), from the
    definitions in vpg's docstring: reward-to-go G_t = sum_{i >= t in the episode} gamma^(i-t) r_i;
    R(tau) = G at the episode's first step, given to all its steps; the bootstrapped reward-to-go
    G^b_t = G_t + gamma^(last + 1 - t) V(s_{last + 1}) unless the episode's last step is terminal
    (a truncation, or the rollout's cut), and G^b_t - V(s_t); GAE(gamma, lambda). The baseline's
    target is G^b, or the GAE return A_t + V(s_t) for gae. The mask: with a critic every step.
    Without one ``ro`` holds the rollout's ``window`` rows (all of them by default) and the steps
    sampled after them: the episodes that begin at or before row window - 1 and end inside ``ro``
    count whole, the others not; for total_return only those that also begin inside the rollout
    (row 0 begins one in env n when ``starts[n]``; all envs when None)."""
    T, N = ro.rewards.shape
    starts = [1.0] * N if starts is None else starts
    window = T if window is None else window
    r = ro.rewards.tolist()
    ends = ro.episode_ends.tolist()
    to_go, boot, total, mask = ([[0.0] * N for _ in range(T)] for _ in range(4))
    for n in range(N):
        for steps in episodes_of([ends[t][n] for t in range(T)]):
            last = steps[-1]
            counts = ends[last][n] == 1 and steps[0] <= window - 1
            if psi == "total_return":
                counts = counts and (steps[0] > 0 or starts[n] == 1)
            v_after = 0.0 if ro.terminated[last, n] == 1 else float(ro.next_values[last, n])
            for t in steps:
                to_go[t][n] = sum(gamma ** (i - t) * r[i][n] for i in steps if i >= t)
                boot[t][n] = to_go[t][n] + gamma ** (last + 1 - t) * v_after
                mask[t][n] = 1.0 if counts or psi not in CRITIC_FREE else 0.0
            for t in steps:
                total[t][n] = to_go[steps[0]][n]
    if psi == "total_return":
        return total, boot, mask
    if psi == "reward_to_go":
        return to_go, boot, mask
    if psi == "reward_to_go_baseline":
        return [[boot[t][n] - float(ro.values[t, n]) for n in range(N)] for t in range(T)], boot, mask
    adv, returns = gae_by_loop(ro, gamma, lam)
    return adv, returns, mask


def _fixed_rollout(batch: Batch, next_value: float = 0.0) -> Rollout:
    T, N = len(batch.rewards), len(batch.rewards[0])
    return Rollout(obs=None, actions=None, logp=None, values=torch.zeros(T, N), next_values=torch.full((T, N), next_value),
                   rewards=torch.tensor(batch.rewards), terminated=torch.tensor(batch.terminated, dtype=torch.float32),
                   episode_ends=torch.tensor(batch.episode_ends, dtype=torch.float32))


def test_psi_by_loop_by_hand():
    # The expected side's own helper on VPG_BATCH then VPG_EXTENSION (t0-t9), gamma = 0.9:
    # env 0, episode A (1, 2): G = 1 + 0.9 * 2 = 2.8, 2; B (0.5, -1): 0.5 - 0.9 = -0.4, -1; C (3, 0.5):
    #   3 + 0.45 = 3.45, 0.5; then t6-t7 (-1, 2): 0.8, 2 and t8-t9 (1, -0.5): 0.55, -0.5.
    #   R(tau) = 2.8, 2.8, -0.4, -0.4, 3.45, 3.45, 0.8, 0.8, 0.55, 0.55.
    # env 1, t0-t2 (0.5, 1, 2): G = 0.5 + 0.9 * (1 + 0.9 * 2) = 3.02, 2.8, 2; D (-0.5, 1.5, 2.5, 1):
    #   G6 = 1, G5 = 2.5 + 0.9 = 3.4, G4 = 1.5 + 0.9 * 3.4 = 4.56, G3 = -0.5 + 0.9 * 4.56 = 3.604.
    ro = cat_by_hand([_fixed_rollout(VPG_BATCH), _fixed_rollout(VPG_EXTENSION)])
    to_go, _, mask = psi_by_loop("reward_to_go", ro, 0.9, 0.0, window=5)
    total, _, whole = psi_by_loop("total_return", ro, 0.9, 0.0, window=5)
    assert [row[0] for row in to_go] == pytest.approx([2.8, 2.0, -0.4, -1.0, 3.45, 0.5, 0.8, 2.0, 0.55, -0.5])
    assert [row[1] for row in to_go[:7]] == pytest.approx([3.02, 2.8, 2.0, 3.604, 4.56, 3.4, 1.0])
    assert [row[0] for row in total] == pytest.approx([2.8, 2.8, -0.4, -0.4, 3.45, 3.45, 0.8, 0.8, 0.55, 0.55])
    # the episodes begun at t0-t4 count: env 0 t0-t5, env 1 t0-t6; and for total_return, with row 0
    # beginning an episode in both envs, the same
    assert [row[0] for row in mask] == [1.0] * 6 + [0.0] * 4 and [row[1] for row in mask] == [1.0] * 7 + [0.0] * 3
    assert whole == mask
    # total_return when both envs' row 0 continues an episode: env 0's A and env 1's t0-t2 are
    # rests of episodes begun before; env 0's B and C and env 1's D are whole.
    _, _, whole = psi_by_loop("total_return", ro, 0.9, 0.0, starts=[0.0, 0.0], window=5)
    assert [row[0] for row in whole] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [row[1] for row in whole] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # with a critic every step of VPG_BATCH counts, the cut included
    ro = _fixed_rollout(VPG_BATCH, next_value=2.0)
    _, boot, ones = psi_by_loop("reward_to_go_baseline", ro, 0.9, 0.0)
    assert ones == [[1.0, 1.0]] * 5
    # the bootstrapped reward-to-go with V(s_{t+1}) = 2 everywhere: env 0's episode B is truncated at
    # t3: -1 + 0.9 * 2 = 0.8, then 0.5 + 0.9 * 0.8 = 1.22; its tail is cut: 3 + 0.9 * 2 = 4.8. Episode A
    # and env 1's episode terminate: 2.8, 2 and 3.02, 2.8, 2 as above. Env 1's tail (-0.5, 1.5): 1.5 + 1.8
    # = 3.3, then -0.5 + 0.9 * 3.3 = 2.47.
    assert [row[0] for row in boot] == pytest.approx([2.8, 2.0, 1.22, 0.8, 4.8])
    assert [row[1] for row in boot] == pytest.approx([3.02, 2.8, 2.0, 2.47, 3.3])


@pytest.mark.parametrize("case", VPG_CASES.values(), ids=VPG_CASES.keys())
def test_vpg_update_matches_hand_computation(case, monkeypatch, recorder):
    T, N = 5, 2
    critic_free = case["psi"] in CRITIC_FREE
    calls = 2 if critic_free else 1  # collect_rollout calls per iteration: the rollout, then (critic-free) its extension
    cfg = vpg.VPGConfig(**{**VPG_BASE, "total_steps": 2 * calls * T * N, **case})
    result, rollouts = run_on_policy(monkeypatch, vpg, cfg, VPG_BATCH, VPG_EXTENSION if critic_free else None)
    actor_opt, critic_opt = recorder.optimizers
    assert len(rollouts) == 2 * calls and len(actor_opt.steps) == len(result.log.updates) == 2
    assert len(critic_opt.steps) == (0 if critic_free else 2 * cfg.critic_updates)
    starts = [1.0] * N  # row 0 of the first rollout begins an episode in every env
    for it in range(2):
        ro = cat_by_hand(rollouts[it * calls:(it + 1) * calls])  # the rollout and the steps sampled after it
        rows = len(ro.rewards)
        psi, target, mask = psi_by_loop(cfg.psi, ro, cfg.gamma, cfg.gae_lambda, starts, window=T)
        counted = [(t, n) for t in range(rows) for n in range(N) if mask[t][n]]
        weights = {tn: psi[tn[0]][tn[1]] for tn in counted}
        if cfg.norm_adv:  # whitened over the counted steps
            weights = dict(zip(counted, whiten_list([weights[tn] for tn in counted])))

        # the policy step: L = -1/(T N) sum_{counted} log pi(a_t | s_t) Psi_t, T N = 10 the rollout's steps
        step = actor_opt.steps[it]
        assert step.lr == cfg.lr
        W, b = params_of(step.params)
        pg = -sum(log_pi(W, b, ro.obs[t, n])[int(ro.actions[t, n])] * weights[(t, n)] for t, n in counted) / (T * N)
        torch.testing.assert_close(step.loss, pg.detach(), **F64)
        assert_grads(step.grads, torch.autograd.grad(pg, [W, b]), F64)
        if it == 0:
            torch.testing.assert_close(step.params, [torch.tensor(x, dtype=torch.float64) for x in ACTOR], rtol=0, atol=0)

        # the baseline: critic_updates full-batch steps of L_V = 1/|counted| sum_{counted} 1/2 (V(s_t) - target_t)^2
        for step in [] if critic_free else critic_opt.steps[it * cfg.critic_updates:(it + 1) * cfg.critic_updates]:
            assert step.lr == cfg.critic_lr
            Wv, bv = params_of(step.params)
            v_loss = sum(0.5 * ((Wv @ ro.obs[t, n] + bv)[0] - target[t][n]) ** 2 for t, n in counted) / len(counted)
            torch.testing.assert_close(step.loss, v_loss.detach(), **F64)
            assert_grads(step.grads, torch.autograd.grad(v_loss, [Wv, bv]), F64)

        stats = result.log.updates[it]
        assert stats["loss/policy"] == pytest.approx(pg.item(), rel=1e-9) and stats["step"] == (it + 1) * calls * T * N
        assert stats["counted_frac"] == pytest.approx(VPG_COUNTED_FRAC[cfg.psi][it], rel=1e-12) == len(counted) / (rows * N)
        # gradient variance of each Psi (unwhitened): tr Cov over the whole episodes (begun in the rollout,
        # ended in it or the extension: with a critic 3 in the first, env 0's B alone in the second, which
        # gives 0; without one A, B, C, t0-t2 and D, then all but t0-t2) of
        # g_i = sum_{t in episode i} grad log pi(a_t | s_t) Psi_t, at the parameters before the step
        W0, b0 = params_of(actor_opt.steps[it].params)
        episodes = [[(t, n) for t in steps] for n in range(N) for steps in episodes_of([ro.episode_ends[t, n].item() for t in range(rows)])
                    if ro.episode_ends[steps[-1], n] == 1 and steps[0] <= T - 1 and (steps[0] > 0 or starts[n] == 1)]
        assert len(episodes) == ((5, 4) if critic_free else (3, 1))[it]
        for name in vpg.PSI_CHOICES:
            psi_n, _, _ = psi_by_loop(name, ro, cfg.gamma, cfg.gae_lambda, starts, window=T)
            grads = []
            for ep in episodes:
                g = torch.autograd.grad(sum(log_pi(W0, b0, ro.obs[t, n])[int(ro.actions[t, n])] * psi_n[t][n] for t, n in ep), [W0, b0])
                grads.append(torch.cat([x.flatten() for x in g]))
            if len(grads) < 2:
                assert stats[f"grad_var/{name}"] == 0.0, name
                continue
            mean = sum(grads) / len(grads)
            variance = sum(((g - mean) ** 2 for g in grads)) / (len(grads) - 1)  # unbiased, per coordinate
            assert stats[f"grad_var/{name}"] == pytest.approx(variance.sum().item(), rel=1e-9), name
        starts = [float(ro.episode_ends[rows - 1, n]) for n in range(N)]  # the next rollout's row 0 begins an episode


# --------------------------------------------------------------------------------------------
# TRPO
# --------------------------------------------------------------------------------------------


def conjugate_gradient_by_hand(A: Tensor, b: Tensor, iters: int, residual_tol: float = 1e-10) -> Tensor:
    """Nocedal & Wright, Algorithm 5.2, on an explicit matrix (same stopping rule: r.r < tol)."""
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    for _ in range(iters):
        alpha = (r @ r) / (p @ A @ p)
        x = x + alpha * p
        r_new = r - alpha * (A @ p)
        if r_new @ r_new < residual_tol:
            break
        p = r_new + (r_new @ r_new) / (r @ r) * p
        r = r_new
    return x


def trpo_update_by_hand(ro: Rollout, cfg) -> SimpleNamespace:
    """One TRPO actor update from ACTOR (theta = [W.flatten(), b], 12 numbers):
    L(theta) = 1/B sum_i exp(log pi_theta(a_i|s_i) - log pi_old(a_i|s_i)) A_i   (A whitened over the batch),
    KL(theta) = 1/B sum_i sum_a pi_0(a|s_i) (log pi_0(a|s_i) - log pi_theta(a|s_i)),  pi_0 the actor before the update,
    F = Hessian of KL at theta_0 + damping I (explicit 12 x 12), x = CG(F, grad L), full step
    s = sqrt(2 delta / x^T F x) x; the line search keeps the first theta_0 + shrink^k s, k < iters, with
    KL <= delta and L > L(theta_0)."""
    adv, returns = gae_by_loop(ro, cfg.gamma, cfg.gae_lambda)
    samples = flat_samples(ro, adv, returns)
    advs = [s.adv for s in samples]
    if cfg.norm_adv:
        advs = whiten_list(advs)
    W0, b0 = (torch.tensor(x, dtype=torch.float64) for x in ACTOR)
    theta0 = torch.cat([W0.flatten(), b0])

    def unpack(theta):
        return theta[:9].view(3, 3), theta[9:]

    def surrogate(theta):
        W, b = unpack(theta)
        return sum(torch.exp(log_pi(W, b, s.obs)[s.action] - s.old_logp) * a for s, a in zip(samples, advs)) / len(samples)

    def mean_kl(theta):
        W, b = unpack(theta)
        total = 0.0
        for s in samples:
            logp0, logp = log_pi(W0, b0, s.obs), log_pi(W, b, s.obs)
            total = total + (logp0.exp() * (logp0 - logp)).sum()
        return total / len(samples)

    theta = theta0.clone().requires_grad_(True)
    g = torch.autograd.grad(surrogate(theta), theta)[0]
    F = torch.autograd.functional.hessian(mean_kl, theta0) + cfg.cg_damping * torch.eye(12, dtype=torch.float64)
    x = conjugate_gradient_by_hand(F, g, cfg.cg_iters)
    full_step = math.sqrt(2 * cfg.max_kl / (x @ F @ x)) * x
    surr0 = surrogate(theta0).item()
    trials = []
    for k in range(cfg.backtrack_iters):
        candidate = theta0 + cfg.backtrack_coef**k * full_step
        trials.append((mean_kl(candidate).item(), surrogate(candidate).item()))
        if trials[-1][0] <= cfg.max_kl and trials[-1][1] > surr0:
            W, b = unpack(candidate)
            return SimpleNamespace(accepted=True, k=k, W=W, b=b, kl=trials[-1][0], surr=trials[-1][1], trials=trials, g=g, F=F, x=x,
                                   samples=samples)
    return SimpleNamespace(accepted=False, k=None, W=W0, b=b0, kl=0.0, surr=surr0, trials=trials, g=g, F=F, x=x, samples=samples)


# PPO_BATCH with other rewards: with these the exact KL of the full step exceeds its quadratic model
# (the step raises rare actions' probabilities), so without damping the first trial breaks the bound.
TRPO_BATCH = Batch(**{**PPO_BATCH.__dict__, "rewards": [[0.5, 2.0], [0.5, 1.5], [-0.5, -1.0], [-1.5, 1.5]]})
TRPO_BASE = dict(total_steps=8, num_envs=2, num_steps=4, max_kl=0.05, cg_iters=20, cg_damping=0.1, backtrack_iters=10,
                 backtrack_coef=0.8, gamma=0.9, gae_lambda=0.8, norm_adv=True, critic_lr=0.1, critic_updates=2,
                 critic_minibatch=3, hidden=[], eval_every=0)
TRPO_CASES = {  # name: (config, the accepted trial k, None when every trial is rejected)
    "full_step_accepted": ({}, 0),
    "no_damping_kl_breaks_bound_once": (dict(cg_damping=0.0), 1),  # trial KLs 1.17 delta, then 0.73 delta
    "shrink=0.95_backtracks_twice": (dict(cg_damping=0.0, backtrack_coef=0.95), 2),
    "one_trial_rejected": (dict(cg_damping=0.0, backtrack_iters=1), None),
    "cg_iters=1": (dict(cg_iters=1), 0),
    "max_kl=0.01": (dict(max_kl=0.01), 0),
    "no_norm_adv": (dict(norm_adv=False), 0),
    "gamma=0.5,lam=0": (dict(gamma=0.5, gae_lambda=0.0), 0),
}


def test_conjugate_gradient_by_hand_is_one_step_closed_form():
    # the expected side's CG: one iteration is x = (g.g / g.F g) g; enough iterations solve F x = g
    g_ = torch.Generator().manual_seed(0)
    m = torch.randn(5, 5, generator=g_, dtype=torch.float64)
    A, b = m @ m.T + torch.eye(5, dtype=torch.float64), torch.randn(5, generator=g_, dtype=torch.float64)
    torch.testing.assert_close(conjugate_gradient_by_hand(A, b, 1), (b @ b) / (b @ A @ b) * b, **F64)
    torch.testing.assert_close(conjugate_gradient_by_hand(A, b, 10, residual_tol=1e-28), torch.linalg.solve(A, b), rtol=0, atol=1e-10)


@pytest.mark.parametrize("case,accepted_k", TRPO_CASES.values(), ids=TRPO_CASES.keys())
def test_trpo_update_matches_hand_computation(case, accepted_k, monkeypatch, recorder):
    cfg = trpo.TRPOConfig(**{**TRPO_BASE, **case})
    result, rollouts = run_on_policy(monkeypatch, trpo, cfg, TRPO_BATCH)
    (ro,) = rollouts
    want = trpo_update_by_hand(ro, cfg)
    assert want.k == accepted_k, want.trials  # the case exercises what its name says
    if accepted_k:  # the earlier trials broke the KL bound (their surrogate improved)
        assert all(kl > cfg.max_kl for kl, _ in want.trials[:accepted_k])
    if accepted_k is None:
        assert want.trials[0][0] > cfg.max_kl
    if cfg.cg_iters == 1:
        torch.testing.assert_close(want.x, (want.g @ want.g) / (want.g @ want.F @ want.g) * want.g, **F64)
    actor = result.agent["actor"]
    torch.testing.assert_close(actor.weight, want.W, **F64)
    torch.testing.assert_close(actor.bias, want.b, **F64)
    (stats,) = result.log.updates
    assert stats["step"] == 8 and stats["accepted"] == float(want.accepted)
    assert stats["surrogate"] == pytest.approx(want.surr, rel=1e-9) and stats["kl"] == pytest.approx(want.kl, rel=1e-9, abs=0)

    # the critic: critic_updates passes over minibatches of 3 (randperm reversed: [7 6 5] [4 3 2] [1 0]) of
    # L_V = 1/M sum 1/2 (V(s) - R)^2, R the GAE return (not whitened)
    (critic_opt,) = recorder.optimizers
    minibatches = [[7, 6, 5], [4, 3, 2], [1, 0]] * cfg.critic_updates
    assert len(critic_opt.steps) == len(minibatches)
    for step, mb in zip(critic_opt.steps, minibatches):
        assert step.lr == cfg.critic_lr
        Wv, bv = params_of(step.params)
        v_loss = sum(0.5 * ((Wv @ want.samples[i].obs + bv)[0] - want.samples[i].ret) ** 2 for i in mb) / len(mb)
        torch.testing.assert_close(step.loss, v_loss.detach(), **F64)
        assert_grads(step.grads, torch.autograd.grad(v_loss, [Wv, bv]), F64)
    assert stats["loss/value"] == pytest.approx(v_loss.item(), rel=1e-9)
    ev = explained_variance_by_hand([s.old_value for s in want.samples], [s.ret for s in want.samples])
    assert stats["explained_variance"] == pytest.approx(ev, rel=1e-5, abs=1e-6)


def _toy_line_search(surrogate=lambda w: w):
    """One parameter w = 0; surrogate(w) given, 'KL'(w) = w^2. Exact in binary for steps 2^-k."""
    actor = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(actor.weight)
    return actor, lambda: (surrogate(actor.weight.item()), actor.weight.item() ** 2)


def test_line_search_accepts_kl_equal_to_the_bound():
    # full step 0.5, shrink 0.5: trials 0.5, 0.25, 0.125 with KL 0.25, 0.0625, 0.015625 = max_kl exactly:
    # the bound is KL <= delta, so the third trial, the last of iters=3, is kept (KL < delta would
    # need a fourth).
    actor, surrogate_kl = _toy_line_search()
    accepted, surr, kl = trpo.line_search(actor, torch.zeros(1), torch.full((1,), 0.5), surrogate_kl, max_kl=0.015625, iters=3, shrink=0.5)
    assert (accepted, surr, kl) == (True, 0.125, 0.015625) and actor.weight.item() == 0.125


def test_line_search_needs_a_strict_improvement_and_reports_the_old_surrogate():
    # a flat surrogate (3 everywhere) never improves: nothing is kept, and the report is
    # (False, surrogate at theta_old = 3, KL 0), theta_old restored.
    actor, surrogate_kl = _toy_line_search(lambda w: 3.0)
    assert trpo.line_search(actor, torch.zeros(1), torch.ones(1), surrogate_kl, max_kl=1.0, iters=3, shrink=0.5) == (False, 3.0, 0.0)
    assert actor.weight.item() == 0.0


def test_conjugate_gradient_stops_at_zero_residual():
    # b an eigenvector of A = diag(2, 3): solved in one iteration, x = b / 2; without the stop the
    # next iteration would divide 0 by 0 (p = 0).
    A = torch.diag(torch.tensor([2.0, 3.0], dtype=torch.float64))
    x = trpo.conjugate_gradient(lambda v: A @ v, torch.tensor([1.0, 0.0], dtype=torch.float64), iters=5)
    assert x.tolist() == [0.5, 0.0]


# --------------------------------------------------------------------------------------------
# Q-learning and DQN: a 4-state chain
# --------------------------------------------------------------------------------------------

N_STATES, START, LEFT, RIGHT = 4, 1, 0, 1
EPISODE_LIMIT = 3  # steps before truncation


def chain_model(s: int, a: int) -> tuple[int, float, bool]:
    """(next state, reward, terminated): right steps on (+0.1; into state 3: +4, terminal), left
    steps back (+0.5), except at state 0 where it falls off (-1, terminal, observed as state 0, whose
    Q-values are not 0: only the terminal flag may stop the bootstrap)."""
    if a == RIGHT:
        return s + 1, (4.0 if s + 1 == 3 else 0.1), s + 1 == 3
    if s == 0:
        return 0, -1.0, True
    return s - 1, 0.5, False


class Chain(gym.Env):
    """States 0 1 2 3 in a row, start 1 (``chain_model``); truncated after ``limit`` steps.
    Observes the state (Discrete) or its one-hot vector (float32, with the toy-text model ``P`` as
    the maze has). Records every transition (s, a, r, s', terminated, truncated) and reset seed."""

    def __init__(self, one_hot: bool, limit: int = EPISODE_LIMIT) -> None:
        self.one_hot, self.limit = one_hot, limit
        self.observation_space = spaces.Box(0.0, 1.0, shape=(N_STATES,), dtype=np.float32) if one_hot else spaces.Discrete(N_STATES)
        self.action_space = spaces.Discrete(2)
        if one_hot:
            self.P = {s: {a: [(1.0, *chain_model(s, a))] for a in (LEFT, RIGHT)} for s in range(N_STATES)}
        self.transitions: list[tuple] = []
        self.reset_seeds: list = []

    def _obs(self):
        return np.eye(N_STATES, dtype=np.float32)[self.s] if self.one_hot else self.s

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.reset_seeds.append(seed)
        self.s, self.t = START, 0
        return self._obs(), {}

    def step(self, action):
        s2, reward, terminated = chain_model(self.s, int(action))
        self.t += 1
        truncated = not terminated and self.t >= self.limit
        self.transitions.append((self.s, int(action), reward, s2, terminated, truncated))
        self.s = s2
        return self._obs(), reward, terminated, truncated, {}


def patch_chain(monkeypatch, module, one_hot: bool) -> list[Chain]:
    """``module.gym.make("chain")`` -> a fresh Chain; returns the list of envs made."""
    made: list[Chain] = []

    def make(env_id):
        assert env_id == "chain"
        made.append(Chain(one_hot))
        return made[-1]

    monkeypatch.setattr(module, "gym", SimpleNamespace(make=make))
    patch_finish(monkeypatch, module)
    return made


def schedule(start: float, end: float, duration: int, t: int) -> float:
    """Linear from start (t = 0) to end (t = duration), then end."""
    return start + (end - start) * min(t / max(duration, 1), 1.0)


def argmax_first(values) -> int:
    return max(range(len(values)), key=lambda a: values[a])  # the first of tied maxima, as numpy and torch


QL_BASE = dict(total_steps=60, gamma=0.9, alpha=1.0, alpha_end=1.0, eps_start=1.0, eps_end=0.0, exploration_fraction=0.5, seed=2, eval_every=0)
QL_CASES = {
    "alpha=1": ({}, False),
    "alpha_decays_0.5_to_0.1": (dict(alpha=0.5, alpha_end=0.1), False),
    "gamma=0.5": (dict(gamma=0.5, alpha=0.7, alpha_end=0.7), False),
    "one_hot_observations": (dict(alpha=0.6, alpha_end=0.2), True),
    "greedy_only": (dict(eps_start=0.0, eps_end=0.0, alpha=0.5, alpha_end=0.5), False),
    "eps_floor_0.3": (dict(eps_end=0.3, exploration_fraction=0.25, seed=2), False),
    "alpha_rises_0.2_to_0.8": (dict(alpha=0.2, alpha_end=0.8), False),
}


@pytest.mark.parametrize("case,one_hot", QL_CASES.values(), ids=QL_CASES.keys())
def test_q_learning_run_matches_hand_replay(case, one_hot, monkeypatch):
    """The whole run replayed here: epsilon-greedy with the run's generator (random() < eps, then
    integers(A)), and Q(s, a) <- Q(s, a) + alpha (r + gamma (1 - terminated) max_a' Q(s', a') - Q(s, a));
    a truncated step still bootstraps; after an episode end the next step starts from the reset state."""
    cfg = q_learning.QLearningConfig(**{**QL_BASE, **case})
    made = patch_chain(monkeypatch, q_learning, one_hot)
    result = q_learning.train(cfg, "chain")
    (env,) = made
    assert env.reset_seeds[0] == cfg.seed

    rng = np.random.default_rng(cfg.seed)
    q = [[0.0, 0.0] for _ in range(N_STATES)]
    s, t_episode, ret = START, 0, 0.0
    transitions, episodes, kinds = [], [], set()
    for step in range(1, cfg.total_steps + 1):
        eps = schedule(cfg.eps_start, cfg.eps_end, int(cfg.exploration_fraction * cfg.total_steps), step)
        alpha = schedule(cfg.alpha, cfg.alpha_end, cfg.total_steps, step)
        if rng.random() < eps:
            a = int(rng.integers(2))
            kinds.add("explore")
        else:
            a = argmax_first(q[s])
            kinds.add("greedy")
        s2, r, terminated = chain_model(s, a)
        t_episode += 1
        truncated = not terminated and t_episode >= EPISODE_LIMIT
        future = 0.0 if terminated else max(q[s2])
        if truncated and future != 0.0:
            kinds.add("truncated bootstraps")
        if terminated and max(q[s2]) != 0.0:
            kinds.add("terminated, future ignored")
        q[s][a] += alpha * (r + cfg.gamma * future - q[s][a])
        transitions.append((s, a, r, s2, terminated, truncated))
        ret += r
        if terminated or truncated:
            episodes.append((step, ret))
            s, t_episode, ret = START, 0, 0.0
        else:
            s = s2
    assert env.transitions == transitions
    np.testing.assert_allclose(result.agent, np.array(q), rtol=1e-12, atol=1e-12)
    assert [st for st, _ in result.log.episodes] == [st for st, _ in episodes]
    assert [ret for _, ret in result.log.episodes] == pytest.approx([ret for _, ret in episodes], rel=1e-12)
    if cfg.eps_start > 0:  # the case exercises both branches and both episode ends
        assert {"explore", "greedy", "terminated, future ignored", "truncated bootstraps"} <= kinds, kinds


DQN_BASE = dict(total_steps=20, lr=0.3, buffer_size=100, batch_size=3, gamma=0.9, learning_starts=4, train_freq=2,
                gradient_steps=2, target="hard", target_update_interval=5, tau=0.3, eps_start=1.0, eps_end=0.0,
                exploration_fraction=0.5, loss="huber", hidden=[], max_grad_norm=1e6, seed=1, eval_every=0)
DQN_CASES = {
    "hard_target": {},
    "hard_target_every_2": dict(target_update_interval=2),
    "ema_target_tau=0.3": dict(target="ema"),
    "mse": dict(loss="mse"),
    "gamma=0.5": dict(gamma=0.5),
    "grad_norm_clipped": dict(max_grad_norm=0.1),
    "ring_buffer_wraps": dict(buffer_size=4),
    "learning_starts=3,train_freq=3,1_step": dict(learning_starts=3, train_freq=3, gradient_steps=1),
}
Q_NET = ([[0.2, -0.3, 0.5, 0.1], [-0.1, 0.4, 0.3, -0.2]], [0.05, -0.05])  # Q(s) = W[:, s] + b for one-hot s


@pytest.mark.parametrize("case", DQN_CASES.values(), ids=DQN_CASES.keys())
def test_dqn_run_matches_hand_replay(case, monkeypatch, recorder):
    """The whole run replayed here: epsilon-greedy with the run's generator, a ring buffer of
    (s, a, r, s', terminated) sampled with the same generator, and at every gradient step
    L = 1/B sum huber(Q(s, a) - y) (or the squared error), y = r + gamma (1 - terminated) max_a' Q_target(s', a'),
    with the target a hard copy every target_update_interval env steps or theta_t <- tau theta + (1 - tau) theta_t
    after every gradient step."""
    cfg = dqn.DQNConfig(**{**DQN_BASE, **case})
    made = patch_chain(monkeypatch, dqn, one_hot=True)
    mlp_calls = patch_mlp(monkeypatch, dqn, {2: Q_NET}, dtype=torch.float32)
    result = dqn.train(cfg, "chain")
    (env,) = made
    assert env.reset_seeds[0] == cfg.seed
    assert mlp_calls == [([N_STATES, 2], nn.ReLU, 1.0)]
    (opt,) = recorder.optimizers
    assert opt.defaults["lr"] == cfg.lr

    rng = np.random.default_rng(cfg.seed)
    theta = [torch.tensor(x, dtype=torch.float32) for x in Q_NET]  # (W (2, 4), b (2,)) now
    target = [p.double() for p in theta]
    buffer: list[tuple] = []  # (s, a, r, s', terminated), a ring of buffer_size
    s, t_episode, k, ret = START, 0, 0, 0.0
    transitions, kinds, updates, episodes = [], set(), [], []
    for step in range(1, cfg.total_steps + 1):
        eps = schedule(cfg.eps_start, cfg.eps_end, int(cfg.exploration_fraction * cfg.total_steps), step)
        if rng.random() < eps:
            a = int(rng.integers(2))
            kinds.add("explore")
        else:
            a = argmax_first((theta[0][:, s] + theta[1]).tolist())
            kinds.add("greedy")
        s2, r, terminated = chain_model(s, a)
        t_episode += 1
        truncated = not terminated and t_episode >= EPISODE_LIMIT
        transitions.append((s, a, r, s2, terminated, truncated))
        kinds |= {"truncated"} if truncated else set()
        transition = (s, a, r, s2, float(terminated))
        if len(buffer) < cfg.buffer_size:
            buffer.append(transition)
        else:
            buffer[(step - 1) % cfg.buffer_size] = transition
        ret += r
        if terminated or truncated:
            episodes.append((step, ret))
            s, t_episode, ret = START, 0, 0.0
        else:
            s = s2
        if step > cfg.learning_starts and step % cfg.train_freq == 0:
            for _ in range(cfg.gradient_steps):
                idx = rng.integers(len(buffer), size=cfg.batch_size)
                opt_step = opt.steps[k]
                assert all(torch.equal(p, q) for p, q in zip(opt_step.params, theta))  # nothing else moved the net
                W, b = params_of(opt_step.params)
                loss, q_sum = 0.0, 0.0
                for i in idx:
                    bs, ba, br, bs2, bterm = buffer[i]
                    y = br + cfg.gamma * (1.0 - bterm) * max((target[0][:, bs2] + target[1]).tolist())
                    d = W[ba, bs] + b[ba] - y
                    q_sum += (W[ba, bs] + b[ba]).item()
                    kinds.add("terminal in batch" if bterm else "bootstrap in batch")
                    if cfg.loss == "huber":
                        kinds.add("|d| < 1" if abs(d.item()) < 1 else "|d| >= 1")
                        loss = loss + (0.5 * d**2 if abs(d.item()) < 1 else abs(d) - 0.5)
                    else:
                        loss = loss + d**2
                loss = loss / cfg.batch_size
                grads = list(torch.autograd.grad(loss, [W, b]))
                norm = math.sqrt(sum(float((g**2).sum()) for g in grads))
                kinds.add("clipped" if norm > cfg.max_grad_norm else "not clipped")
                torch.testing.assert_close(opt_step.loss.double(), loss.detach(), **F32)
                assert_grads(opt_step.grads, clip_by_global_norm(grads, cfg.max_grad_norm), F32)
                assert opt_step.lr == cfg.lr
                theta = opt_step.after
                if cfg.target == "ema":
                    target = [t + cfg.tau * (p.double() - t) for t, p in zip(target, theta)]
                k += 1
            updates.append((step, loss.item(), q_sum / cfg.batch_size, eps))
        if cfg.target == "hard" and step % cfg.target_update_interval == 0:
            target = [p.double() for p in theta]
    assert env.transitions == transitions
    assert k == len(opt.steps) > 0
    # logged per update: the last gradient step's loss and mean Q(s, a) of its batch, epsilon
    assert [(u["step"], u["loss/td"], u["q/mean"], u["epsilon"]) for u in result.log.updates] == [
        (st, pytest.approx(lo, rel=1e-5), pytest.approx(qm, rel=1e-5, abs=1e-6), pytest.approx(ep, abs=1e-12)) for st, lo, qm, ep in updates]
    assert [st for st, _ in result.log.episodes] == [st for st, _ in episodes]
    assert [r for _, r in result.log.episodes] == pytest.approx([r for _, r in episodes], rel=1e-12)
    # the case exercises what it claims
    assert {"explore", "greedy", "truncated", "terminal in batch", "bootstrap in batch"} <= kinds, kinds
    if cfg.loss == "huber":
        assert {"|d| < 1", "|d| >= 1"} <= kinds, kinds
    assert ("clipped" in kinds) == (cfg.max_grad_norm < 1), kinds
    if cfg.buffer_size < cfg.total_steps:
        assert len(buffer) == cfg.buffer_size


# --------------------------------------------------------------------------------------------
# The shared rollout collector (common.collect_rollout) the on-policy trainers compose with
# --------------------------------------------------------------------------------------------


def test_collect_rollout_by_hand(counter_env):
    # env 0 terminates every 2 steps; env 1 is truncated (TimeLimit) after 3. SAME_STEP autoreset.
    envs = gym.vector.SyncVectorEnv([lambda: counter_env(2), lambda: gym.wrappers.TimeLimit(counter_env(99), 3)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=0)
    torch.manual_seed(0)
    policy = linear([[0.5], [-0.5]], [0.1, 0.0], dtype=torch.float32)  # logits (0.5 k + 0.1, -0.5 k)
    critic = linear([[10.0]], [1.0], dtype=torch.float32)  # V(k) = 10 k + 1
    log = RunLog()
    ro, last_obs, step = collect_rollout(envs, obs, policy, critic, 4, EpisodeTracker(2), log, step=100)
    # env 0: k = 0, 1 | 0, 1 (terminated at t=1 and t=3, true final obs k=2: V 21); env 1: k = 0, 1, 2 | 0
    # (truncated at t=2, true final obs k=3: V 31); the rollout ends at k = 0 (env 0), 1 (env 1, V 11).
    assert ro.obs.squeeze(-1).T.tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
    assert ro.values.T.tolist() == [[1, 11, 1, 11], [1, 11, 21, 1]]
    assert ro.next_values.T.tolist() == [[11, 21, 11, 21], [11, 21, 31, 11]]
    assert ro.terminated.T.tolist() == [[0, 1, 0, 1], [0, 0, 0, 0]]
    assert ro.episode_ends.T.tolist() == [[0, 1, 0, 1], [0, 0, 1, 0]]
    assert ro.rewards.tolist() == [[1.0, 1.0]] * 4
    assert ro.actions.shape == ro.logp.shape == (4, 2) and ro.obs.dtype == torch.float32
    assert last_obs.squeeze(-1).tolist() == [0.0, 1.0] and step == 100 + 8
    # returns logged at the env step where each episode ends: 100 + (t + 1) * 2 envs
    assert log.episodes == [(104, 2.0), (106, 3.0), (108, 2.0)]
    for t in range(4):
        for n in range(2):
            k = ro.obs[t, n, 0].item()
            logits = torch.tensor([0.5 * k + 0.1, -0.5 * k])
            expected = torch.log_softmax(logits, 0)[ro.actions[t, n]]
            torch.testing.assert_close(ro.logp[t, n], expected, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# VPG's gradient-variance measurement, and how every trainer hands over to evaluation and finish
# --------------------------------------------------------------------------------------------


def test_gradient_variance_by_hand():
    # one env column: episodes t0-t1, t2, t3-t5, and t6 unfinished (not counted)
    T = 7
    ends = torch.tensor([0, 1, 1, 0, 0, 1, 0], dtype=torch.float64)[:, None]  # (T, 1)
    g = torch.Generator().manual_seed(1)
    ro = Rollout(obs=torch.randn(T, 1, DIM, generator=g, dtype=torch.float64), actions=torch.tensor([0, 2, 1, 1, 0, 2, 1])[:, None],
                 logp=None, values=None, next_values=None, rewards=None, terminated=None, episode_ends=ends)
    psi = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 7.0], dtype=torch.float64)[:, None]  # (T, 1)
    actor = linear(*ACTOR)
    W, b = params_of([actor.weight, actor.bias])

    def episode_grad(steps):  # g_i = sum_{t in episode} grad log pi(a_t|s_t) Psi_t, flattened (W, b)
        total = sum(log_pi(W, b, ro.obs[t, 0])[int(ro.actions[t, 0])] * psi[t, 0] for t in steps)
        return torch.cat([x.flatten() for x in torch.autograd.grad(total, [W, b])])

    mask = vpg.complete_mask(ends)
    assert mask.flatten().tolist() == [1, 1, 1, 1, 1, 1, 0]
    grads = [episode_grad(ep) for ep in ([0, 1], [2], [3, 4, 5])]
    mean = sum(grads) / 3
    expected = (sum((x - mean) ** 2 for x in grads) / 2).sum().item()  # unbiased over 3 episodes, summed
    assert vpg.gradient_variance(actor, ro, psi, mask) == pytest.approx(expected, rel=1e-9)
    # two episodes: (g1 - g2)^2 / 2 summed; one episode: no variance to measure, 0
    two = Rollout(**{**ro.__dict__, "episode_ends": torch.tensor([0, 1, 1, 0, 0, 0, 0], dtype=torch.float64)[:, None]})
    g1, g2 = episode_grad([0, 1]), episode_grad([2])
    assert vpg.gradient_variance(actor, two, psi, vpg.complete_mask(two.episode_ends)) == pytest.approx(((g1 - g2) ** 2 / 2).sum().item(), rel=1e-9)
    one = Rollout(**{**ro.__dict__, "episode_ends": torch.tensor([0, 1, 0, 0, 0, 0, 0], dtype=torch.float64)[:, None]})
    assert vpg.gradient_variance(actor, one, psi, vpg.complete_mask(one.episode_ends)) == 0.0
    # row 0 continues an episode begun in the previous rollout: t0-t1 is its rest, not an episode;
    # the whole episodes are t2 and t3-t5
    whole = vpg.whole_episode_mask(ends, torch.zeros(1, dtype=torch.float64))
    assert whole.flatten().tolist() == [0, 0, 1, 1, 1, 1, 0]
    g2, g3 = episode_grad([2]), episode_grad([3, 4, 5])
    assert vpg.gradient_variance(actor, ro, psi, whole) == pytest.approx(((g2 - g3) ** 2 / 2).sum().item(), rel=1e-9)


def _plumbing_setup(name: str, monkeypatch):
    """(module, cfg, env steps between evaluation checks) with the seams of the tests above."""
    if name == "q_learning":
        patch_chain(monkeypatch, q_learning, one_hot=False)
        return q_learning, q_learning.QLearningConfig(**QL_BASE), 1
    if name == "dqn":
        patch_chain(monkeypatch, dqn, one_hot=True)
        patch_mlp(monkeypatch, dqn, {2: Q_NET}, dtype=torch.float32)
        return dqn, dqn.DQNConfig(**DQN_BASE), 1
    module, base, batch = {"vpg": (vpg, VPG_BASE, VPG_BATCH), "trpo": (trpo, TRPO_BASE, TRPO_BATCH), "ppo": (ppo, PPO_BASE, PPO_BATCH)}[name]
    patch_on_policy(monkeypatch, module, batch)
    T, N = len(batch.actions), len(batch.actions[0])
    cfg_class = {"vpg": vpg.VPGConfig, "trpo": trpo.TRPOConfig, "ppo": ppo.PPOConfig}[name]
    return module, cfg_class(**{**base, "total_steps": 4 * T * N}), T * N


@pytest.mark.parametrize("name", ["q_learning", "dqn", "vpg", "trpo", "ppo"])
def test_evaluation_and_finish_plumbing(name, monkeypatch, recorder):
    """maybe_evaluate gets (cfg, env_id, the greedy act, the run's log, the env step, the step it
    returned last time) after every env step (tabular, DQN) or rollout; setting log.stop ends the run;
    finish gets (cfg, env_id, agent, the same act, the log) and train returns what finish returns."""
    module, cfg, per_check = _plumbing_setup(name, monkeypatch)
    checks, finished = [], []

    def maybe_evaluate(cfg_, env_id, act, log, step, last):
        checks.append(SimpleNamespace(cfg=cfg_, env_id=env_id, act=act, log=log, step=step, last=last))
        log.stop = len(checks) == 2
        return 1000 + step

    def finish(cfg_, env_id, agent, act, log):
        finished.append(SimpleNamespace(cfg=cfg_, env_id=env_id, agent=agent, act=act, log=log))
        return "the result"

    monkeypatch.setattr(module, "maybe_evaluate", maybe_evaluate)
    monkeypatch.setattr(module, "finish", finish)
    env_id = "chain" if name in ("q_learning", "dqn") else "fixed-batch"
    assert module.train(cfg, env_id) == "the result"
    (done,) = finished
    assert [(c.step, c.last) for c in checks] == [(per_check, 0), (2 * per_check, 1000 + per_check)]
    assert all(c.cfg is cfg and c.env_id == env_id and c.act is done.act and c.log is done.log for c in checks)
    assert done.cfg is cfg and done.env_id == env_id and isinstance(done.log, RunLog)
    # the act handed over is greedy on the trained agent
    if name == "q_learning":
        assert isinstance(done.agent, np.ndarray) and done.agent.shape == (N_STATES, 2)
        for state in range(N_STATES):
            assert done.act(state) == int(np.argmax(done.agent[state]))
        return
    net = done.agent if name == "dqn" else done.agent["actor"]
    if name != "dqn":
        assert set(done.agent) == {"actor", "critic"} and done.agent["critic"].out_features == 1
        net.float()  # in place: torch_act feeds float32 observations
    for obs in np.eye(net.in_features, dtype=np.float32) - 0.25:
        with torch.no_grad():
            assert done.act(obs) == int(net(torch.as_tensor(obs)).argmax())


def test_ppo_target_kl_is_a_strict_bound(monkeypatch, recorder):
    # Run 1 (one epoch) logs the approx KL of the first epoch's last minibatch. Runs 2 and 3 (two
    # epochs, bit-identical first epoch) stop after the first epoch only when KL > target_kl:
    # not at target_kl = that KL exactly, but at a target a hair below it.
    base = {**PPO_BASE, "total_steps": 8, "update_epochs": 2}
    patch_on_policy(monkeypatch, ppo, PPO_BATCH)
    kl = ppo.train(ppo.PPOConfig(**{**base, "update_epochs": 1}), "fixed-batch").log.updates[0]["approx_kl"]
    for target_kl, epochs in [(kl, 2), (kl * (1 - 1e-9), 1)]:
        patch_on_policy(monkeypatch, ppo, PPO_BATCH)
        assert ppo.train(ppo.PPOConfig(**{**base, "target_kl": target_kl}), "fixed-batch").log.updates[0]["epochs"] == epochs


def test_linear_schedule_over_one_step():
    # duration 1: slope (0 - 1) / 1, so 1 - t: at t = 1 already at the end; duration 0 counts as 1
    assert linear_schedule(1.0, 0.0, 1, 1) == 0.0 and linear_schedule(1.0, 0.0, 0, 1) == 0.0
    assert linear_schedule(1.0, 0.0, 1, 0) == 1.0 and linear_schedule(0.2, 0.8, 1, 5) == 0.8
