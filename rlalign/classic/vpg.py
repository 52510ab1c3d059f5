"""REINFORCE / vanilla policy gradient with the seed's four choices of Psi.

    grad J = E[ sum_t grad log pi(a_t | s_t) * Psi_t ]

Williams (1992); seed 002, section 4.4, with

    total_return           Psi_t = R(tau), the discounted return of the whole episode
    reward_to_go           Psi_t = sum_{i >= t} gamma^(i-t) r_i
    reward_to_go_baseline  Psi_t = reward-to-go - V(s_t), V a learned baseline (bootstrapped at a time limit)
    gae                    Psi_t = GAE(gamma, lambda) advantage (Schulman et al. 2016)

Which steps count. The environments run on across rollouts, so a rollout's column can begin with
the rest of an episode that began in the previous rollout and end with an episode that goes on.
Deliberate simplification: the unfinished tail is dropped from the loss (no bootstrap at the cut),
only episodes that end inside the rollout count (``complete_mask``), so every Psi is an honest
Monte-Carlo quantity. ``total_return`` needs the episode's start as well: it counts only the
episodes that begin and end inside the rollout (``whole_episode_mask``), the textbook batch of whole
trajectories sampled by the policy being updated (Spinning Up's simplest policy gradient); the rest
of an episode that began in the previous rollout is left out, its first steps having been sampled
by the previous policy. The other three Psi need only the steps from t on and count those steps.

Time limits. A truncated episode (a time limit, not a terminal state) is bootstrapped wherever a
critic exists: ``reward_to_go_baseline`` and the baseline's regression target use the reward-to-go
with V(true final obs) after a truncation (:func:`bootstrapped_reward_to_go`), so that
``reward_to_go_baseline`` is exactly ``gae`` with lambda = 1, as in PPO, TRPO and Spinning Up's VPG.
Without a critic (``total_return``, ``reward_to_go``) there is no V: a truncated episode counts
with the rewards it has, the return over the horizon its time limit sets (leaving it out would drop
the longest episodes, on CartPole every successful one).

One gradient step per rollout, no advantage whitening by default (whitening subtracts the batch
mean: a baseline, which would blur the comparison). The baseline V is fitted after the policy step
by regression to the bootstrapped reward-to-go (or to the GAE returns for ``gae``).

``gradient_variance`` measures the estimator's variance: the trace of the covariance, across the
whole episodes of a rollout (begun and ended inside it; the same episodes for all four Psi), of each
episode's gradient sum_t grad log pi(a_t | s_t) Psi_t.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from rlalign.classic.common import (
    ClassicConfig,
    EpisodeTracker,
    FiniteGuard,
    Hidden,
    Result,
    Rollout,
    RunLog,
    categorical_logp,
    collect_rollout,
    finish,
    make_vec_env,
    maybe_evaluate,
    mlp,
    num_actions,
    obs_size,
    seed_everything,
    torch_act,
)
from rlalign.core.advantages import gae, reward_to_go, total_returns
from rlalign.core.losses import policy_gradient_loss, value_loss
from rlalign.core.masks import masked_whiten

__all__ = [
    "VPGConfig",
    "ENV_KIND",
    "PSI_CHOICES",
    "complete_mask",
    "whole_episode_mask",
    "bootstrapped_reward_to_go",
    "compute_psi",
    "gradient_variance",
    "train",
]

ENV_KIND = "vector"  # what common.check_env asks of the environment
Psi = Literal["total_return", "reward_to_go", "reward_to_go_baseline", "gae"]
PSI_CHOICES: tuple[str, ...] = ("total_return", "reward_to_go", "reward_to_go_baseline", "gae")


class VPGConfig(ClassicConfig):
    """REINFORCE / VPG."""

    total_steps: int = Field(100_000, ge=1, description="environment steps to train for (all envs together)")
    psi: Psi = Field("gae", description="the weight Psi_t of grad log pi (seed 002, section 4.4)")
    num_envs: int = Field(4, ge=1, description="parallel environments")
    num_steps: int = Field(500, ge=1, description="steps per environment per rollout")
    lr: float = Field(1e-2, gt=0.0, description="Adam learning rate of the policy")
    critic_lr: float = Field(1e-2, gt=0.0, description="Adam learning rate of the baseline")
    critic_updates: int = Field(20, ge=0, description="full-batch regression steps of the baseline per rollout")
    gamma: float = Field(0.99, gt=0.0, le=1.0, description="discount factor")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (psi=gae)")
    norm_adv: bool = Field(False, description="whiten Psi over the counted steps")
    measure_variance: bool = Field(False, description="log the gradient variance of all four Psi every rollout")
    hidden: Hidden = Field([64, 64], description="hidden sizes of the policy and of the baseline (tanh), each >= 1")


def complete_mask(episode_ends: Tensor) -> Tensor:
    """1 on steps whose episode ends inside the rollout: some end at t' >= t in the same column.

    Shape: (T, N) -> (T, N).
    """
    return episode_ends.flip(0).cummax(0).values.flip(0)


def whole_episode_mask(episode_ends: Tensor, starts: Tensor) -> Tensor:
    """1 on steps whose episode begins and ends inside the rollout.

    Begins inside: row 0 begins an episode (``starts``) or some episode ends at t' < t in the column.

    Args:
        episode_ends: Shape: (T, N).
        starts: 1 where row 0 is an episode's first step (every env after a reset; later, where
            the previous rollout's last row ended an episode). Shape: (N,).
    Returns:
        Shape: (T, N).
    """
    ended_before = torch.cat([starts.to(episode_ends.dtype)[None], episode_ends[:-1]])  # (T, N) row t begins an episode
    return ended_before.cummax(0).values * complete_mask(episode_ends)


def bootstrapped_reward_to_go(rewards: Tensor, next_values: Tensor, terminated: Tensor, episode_ends: Tensor, gamma: float) -> Tensor:
    """Reward-to-go that bootstraps from V(s_{t+1}) where an episode is truncated, not terminated:

        G_t = r_t + gamma * [(1 - end_t) * G_{t+1} + end_t * (1 - terminated_t) * V(s_{t+1})]

    and G_{T-1} = r_{T-1} + gamma * V(s_T) at the rollout's cut. Partial-episode bootstrapping
    (Pardo et al. 2018, "Time Limits in Reinforcement Learning"; Spinning Up's VPG
    ``finish_path(last_val=V)``). Telescoping the TD residuals gives G_t - V(s_t) = sum_l gamma^l
    delta_{t+l}: GAE with lambda = 1 (Schulman et al. 2016, eq. 18), returns included.

    Args:
        rewards, next_values, terminated, episode_ends: Shape: (T, N). ``next_values[t]`` is V of
            the true next state (the final observation at an episode end).
    Returns:
        Shape: (T, N).
    """
    ends = episode_ends.to(rewards.dtype)
    truncated = ends * (1.0 - terminated.to(rewards.dtype))  # (T, N)
    folded = rewards + gamma * truncated * next_values  # (T, N) the bootstrap folded into the truncated step's reward
    return reward_to_go(folded, ends, gamma, bootstrap=next_values[-1])  # (T, N)


def compute_psi(psi: str, ro: Rollout, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(Psi_t, the baseline's regression target), both (T, N); ``ro.values`` must hold V(s_t).

    ``total_return`` is right on the whole episodes of the rollout only (:func:`whole_episode_mask`).
    """
    if psi == "total_return":
        return total_returns(ro.rewards, ro.episode_ends, gamma), reward_to_go(ro.rewards, ro.episode_ends, gamma)
    if psi == "reward_to_go":
        to_go = reward_to_go(ro.rewards, ro.episode_ends, gamma)  # (T, N) no critic: no bootstrap
        return to_go, to_go
    if psi == "reward_to_go_baseline":
        to_go = bootstrapped_reward_to_go(ro.rewards, ro.next_values, ro.terminated, ro.episode_ends, gamma)  # (T, N)
        return to_go - ro.values, to_go
    if psi == "gae":
        return gae(ro.rewards, ro.values, ro.next_values, ro.terminated, ro.episode_ends, gamma, lam)
    raise ValueError(f"psi must be one of {PSI_CHOICES}, got {psi!r}")


def gradient_variance(actor: nn.Module, ro: Rollout, psi: Tensor, mask: Tensor) -> float:
    """tr Cov_i[g_i] with g_i = sum_{t in episode i} grad log pi(a_t|s_t) Psi_t, over the episodes
    that end inside the rollout and that ``mask`` counts (1 on an episode's first row; pass
    :func:`whole_episode_mask` so that every g_i is a whole episode's). At least two needed;
    otherwise 0."""
    grads = []
    for n in range(ro.obs.shape[1]):
        ends = torch.nonzero(ro.episode_ends[:, n]).flatten().tolist()
        for start, end in zip([0] + [e + 1 for e in ends[:-1]], ends):
            if not mask[start, n]:
                continue
            sl = slice(start, end + 1)
            logp, _ = categorical_logp(actor, ro.obs[sl, n], ro.actions[sl, n])
            g = torch.autograd.grad((logp * psi[sl, n] * mask[sl, n]).sum(), list(actor.parameters()))
            grads.append(parameters_to_vector(g))
    if len(grads) < 2:
        return 0.0
    return torch.stack(grads).var(dim=0).sum().item()


def train(cfg: VPGConfig, env_id: str, log: RunLog | None = None) -> Result:
    """Train a policy with REINFORCE; the agent is ``{"actor": ..., "critic": ...}``."""
    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    log = log or RunLog()
    envs = make_vec_env(env_id, cfg.num_envs, cfg.seed)
    dim, n_actions = obs_size(envs.single_observation_space), num_actions(envs.single_action_space)
    actor = mlp([dim, *cfg.hidden, n_actions], out_gain=0.01)
    critic = mlp([dim, *cfg.hidden, 1], out_gain=1.0)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=cfg.lr, fused=True)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr, fused=True)
    tracker, greedy = EpisodeTracker(cfg.num_envs), torch_act(actor)
    guard = FiniteGuard("vpg", env_id, {"actor": f"lr={cfg.lr:g} too high?", "critic": f"critic_lr={cfg.critic_lr:g} too high?"})
    obs, _ = envs.reset(seed=cfg.seed)
    starts = torch.ones(cfg.num_envs)  # (N,) 1 where the next rollout's row 0 begins an episode
    step = last_eval = 0

    while step < cfg.total_steps:
        ro, obs, step = collect_rollout(envs, obs, actor, critic, cfg.num_steps, tracker, log, step, guard)
        whole = whole_episode_mask(ro.episode_ends, starts)  # (T, N) episodes begun and ended in the rollout
        starts = ro.episode_ends[-1]  # (N,) an episode ended on the last row: the next rollout begins one
        mask = whole if cfg.psi == "total_return" else complete_mask(ro.episode_ends)  # (T, N) R(tau) needs the start
        psi, target = compute_psi(cfg.psi, ro, cfg.gamma, cfg.gae_lambda)  # (T, N)
        guard.returns(step, {"Psi": psi, "regression targets": target})
        if cfg.norm_adv:
            psi = masked_whiten(psi, mask)
        stats: dict[str, float] = {"counted_frac": mask.mean().item()}
        if cfg.measure_variance:
            for name in PSI_CHOICES:
                stats[f"grad_var/{name}"] = gradient_variance(actor, ro, compute_psi(name, ro, cfg.gamma, cfg.gae_lambda)[0], whole)

        logp, _ = categorical_logp(actor, ro.obs, ro.actions)  # (T, N)
        pg_loss, _ = policy_gradient_loss(logp, psi, mask)
        actor_opt.zero_grad()
        pg_loss.backward()
        actor_opt.step()
        guard.update(step, "actor", actor, {"policy loss": pg_loss}, ro.obs)
        for _ in range(cfg.critic_updates if cfg.psi in ("reward_to_go_baseline", "gae") else 0):
            v_loss, _ = value_loss(critic(ro.obs).squeeze(-1), target, mask)
            critic_opt.zero_grad()
            v_loss.backward()
            critic_opt.step()
            guard.update(step, "critic", critic, {"value loss": v_loss}, ro.obs)
        log.update(step, {"loss/policy": pg_loss.item(), **stats})
        last_eval = maybe_evaluate(cfg, env_id, greedy, log, step, last_eval)
        if log.stop:
            break
    envs.close()
    return finish(cfg, env_id, {"actor": actor, "critic": critic}, greedy, log)
