"""REINFORCE / vanilla policy gradient with the seed's four choices of Psi.

    grad J = E[ sum_t grad log pi(a_t | s_t) * Psi_t ]

Williams (1992); seed 002, section 4.4, with

    total_return           Psi_t = R(tau), the discounted return of the whole episode
    reward_to_go           Psi_t = sum_{i >= t} gamma^(i-t) r_i
    reward_to_go_baseline  Psi_t = reward-to-go - V(s_t), V a learned baseline (bootstrapped at a time limit)
    gae                    Psi_t = GAE(gamma, lambda) advantage (Schulman et al. 2016)

Which steps count. The environments run on across rollouts, so a rollout's column can begin with
the rest of an episode that began in the previous rollout and end with an episode that goes on.
With a critic (``reward_to_go_baseline``, ``gae``) every step of the rollout counts: the episode
cut at the rollout's end is bootstrapped with V(s_T) (Spinning Up's VPG, ``finish_path(last_val=V)``).
Without one (``total_return``, ``reward_to_go``) there is nothing to bootstrap from, so after the
``num_steps`` rollout the environments run on, min(num_steps, 32) steps at a time, until in every
column the episode in progress at the rollout's last row has ended (:func:`run_to_episode_ends`).
``reward_to_go`` then counts the rollout's rows and, past them, the rest of those episodes
(:func:`window_mask`), never a step of an episode begun after the rollout. ``total_return`` needs
the episode's start as well: it counts only the episodes that begin inside the rollout
(:func:`whole_episode_mask`, with the start carried from the previous rollout), the textbook batch
of whole trajectories sampled by the policy being updated (Spinning Up's simplest policy gradient);
the rest of an episode that began before is left out, its first steps having been sampled by the
previous policy. Why not count "the episodes that end inside the rollout": whether an episode ends
within a fixed window depends on the actions it takes, so that filters the steps by their outcomes
and biases the gradient (one state, stopping pays 15, going on pays 1 a step, time limit 20: with
5-step rollouts the estimate pointed towards stopping, the exact gradient towards going on). Here
whether a step counts is settled before its action is taken (:func:`window_mask`). The extra env
steps count towards ``total_steps`` and the next rollout goes on from where they stopped; an
episode still going 100,000 steps past the rollout (:data:`MAX_EXTENSION`) is a ConfigError (use
a critic Psi or give the environment a time limit). ``counted_frac`` is the share of the sampled
steps (those run on included) that count: 1 with a critic.

Time limits. A truncated episode (a time limit, not a terminal state) is bootstrapped wherever a
critic exists: ``reward_to_go_baseline`` and the baseline's regression target use the reward-to-go
with V(true final obs) after a truncation (:func:`bootstrapped_reward_to_go`), so that
``reward_to_go_baseline`` is exactly ``gae`` with lambda = 1, as in PPO, TRPO and Spinning Up's VPG.
Without a critic (``total_return``, ``reward_to_go``) there is no V: a truncated episode counts
with the rewards it has, the return over the horizon its time limit sets (leaving it out would drop
the longest episodes, on CartPole every successful one).

One gradient step per rollout on L = -1/(T N) sum_{counted} log pi(a_t | s_t) Psi_t, divided by the
rollout's T N steps, not by the number counted (:func:`policy_loss`). No advantage whitening by
default (whitening subtracts the batch mean: a baseline, which would blur the comparison). The
baseline V is fitted after the policy step by regression to the bootstrapped reward-to-go (or to
the GAE returns for ``gae``).

``gradient_variance`` measures the estimator's variance: the trace of the covariance, across the
whole episodes of a rollout (begun inside it and ended inside it or the steps run on after it; the
same episodes for all four Psi), of each episode's gradient sum_t grad log pi(a_t | s_t) Psi_t.
"""

from __future__ import annotations

from typing import Literal

import gymnasium as gym
import numpy as np
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
    cat_rollouts,
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
from rlalign.config import ConfigError
from rlalign.core.advantages import gae, reward_to_go, total_returns
from rlalign.core.losses import value_loss
from rlalign.core.masks import masked_whiten

__all__ = [
    "VPGConfig",
    "ENV_KIND",
    "PSI_CHOICES",
    "complete_mask",
    "whole_episode_mask",
    "window_mask",
    "counted_mask",
    "run_to_episode_ends",
    "collect_counted",
    "MAX_EXTENSION",
    "bootstrapped_reward_to_go",
    "compute_psi",
    "policy_loss",
    "gradient_variance",
    "train",
]

ENV_KIND = "vector"  # what common.check_env asks of the environment
Psi = Literal["total_return", "reward_to_go", "reward_to_go_baseline", "gae"]
PSI_CHOICES: tuple[str, ...] = ("total_return", "reward_to_go", "reward_to_go_baseline", "gae")
CRITIC_FREE = ("total_return", "reward_to_go")  # no V to bootstrap from: the episodes of a rollout are run to their ends
EXTENSION_CHUNK = 32  # steps per environment per collect_rollout call when running episodes to their ends (at most num_steps)
MAX_EXTENSION = 100_000  # steps per environment past a rollout before an episode that never ends is an error


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


def window_mask(episode_ends: Tensor, window: int) -> Tensor:
    """1 on the first ``window`` rows, and past them on the rows of each column's episode in progress
    at row ``window - 1``, up to and including its end; 0 on the rows of episodes begun after it.

    Why this is unbiased where "the episodes that end inside the window" is not: whether row t
    counts is settled before a_t is drawn. An episode that begins at or before row ``window - 1``
    counts to its end, however it goes on; which episodes begin there depends only on the earlier
    episodes, not on the episode's own actions. So E[grad log pi(a_t|s_t) G_t | s_t, row t counts]
    is the policy gradient's term at s_t, and the episodes begun in the window are an unselected
    sample of the policy's episodes. Requiring an episode to end inside the window would count it
    depending on its own actions (short episodes in, long ones out) and bias the estimate towards
    whatever ends episodes.

    Args:
        episode_ends: Shape: (T, N), T >= ``window``; every episode in progress at row
            ``window - 1`` ends by row T - 1 (:func:`run_to_episode_ends`).
    Returns:
        Shape: (T, N).
    """
    ended = episode_ends[window - 1 : -1].cummax(0).values  # (T - window, N) 1 once the episode at row window - 1 has ended
    return torch.cat([torch.ones_like(episode_ends[:window]), 1.0 - ended])  # (T, N)


def counted_mask(psi: str, episode_ends: Tensor, starts: Tensor, window: int) -> Tensor:
    """The steps the loss counts (module docstring, "Which steps count"): every step with a critic;
    :func:`window_mask` for ``reward_to_go``; for ``total_return`` also only the episodes that begin
    inside the rollout (:func:`whole_episode_mask`).

    Args:
        episode_ends: Shape: (T, N), the rollout and the steps run on after its ``window`` rows.
        starts: 1 where row 0 begins an episode. Shape: (N,).
    Returns:
        Shape: (T, N).
    """
    if psi not in CRITIC_FREE:
        return torch.ones_like(episode_ends)
    mask = window_mask(episode_ends, window)  # (T, N)
    return mask * whole_episode_mask(episode_ends, starts) if psi == "total_return" else mask


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


def policy_loss(logp: Tensor, psi: Tensor, mask: Tensor, num_samples: int) -> Tensor:
    """L = -1/(T N) sum_{counted t, n} log pi(a_t|s_t) Psi_t  (Williams 1992; Spinning Up's VPG, whose
    buffer holds a fixed number of steps), with T N = ``num_samples`` the rollout's steps, a constant.

    Not the mean over the counted steps: how many steps count past the rollout depends on how its
    episodes went, and dividing each rollout's sum by its own count weighs the rollouts by their
    outcomes. (One state, stopping pays 15, going on 1 a step, time limit 20, 8 envs x 5 steps,
    8,000 rollouts: per counted step, that mean gave 0.85 +- 0.03 of the exact gradient, this sum
    0.97 +- 0.03.) A constant divisor only scales the step. With a critic every step counts and
    the two agree.

    Args:
        logp: log pi(a_t|s_t), with grad. Shape: (T, N).
        psi: Psi_t, treated as a constant. Shape: (T, N).
        mask: 1 on the counted steps. Shape: (T, N).
    """
    return -(logp * psi.detach() * mask).sum() / num_samples


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


def run_to_episode_ends(
    envs: gym.vector.VectorEnv, env_id: str, obs: np.ndarray, actor: nn.Module, critic: nn.Module | None, ro: Rollout, psi: str,
    tracker: EpisodeTracker, log: RunLog, step: int, guard: FiniteGuard | None = None,
) -> tuple[Rollout, np.ndarray, int]:
    """``ro`` followed by more steps, min(T, 32) per environment at a time, until in every column the
    episode in progress at ``ro``'s last row has ended. Returns the rollouts concatenated, the
    observation to go on from and the env-step counter. ConfigError if one is still going
    :data:`MAX_EXTENSION` steps past ``ro``."""
    chunk = min(ro.rewards.shape[0], EXTENSION_CHUNK)
    parts, going = [ro], ro.episode_ends[-1] == 0  # (N,) the episode at the last row goes on
    extra = 0
    while going.any():
        if extra >= MAX_EXTENSION:
            raise ConfigError(
                f"vpg: psi={psi} needs every episode to end (there is no critic to bootstrap from), but an episode of env {env_id} "
                f"was still going {extra} steps past the rollout; use psi=gae or psi=reward_to_go_baseline (they bootstrap from V "
                "at the rollout's end), or give the environment a time limit (max_episode_steps)"
            )
        part, obs, step = collect_rollout(envs, obs, actor, critic, chunk, tracker, log, step, guard)
        parts.append(part)
        going &= part.episode_ends.sum(0) == 0
        extra += chunk
    return cat_rollouts(parts), obs, step


def collect_counted(
    envs: gym.vector.VectorEnv, env_id: str, obs: np.ndarray, actor: nn.Module, critic: nn.Module | None, cfg: VPGConfig, starts: Tensor,
    tracker: EpisodeTracker, log: RunLog, step: int, guard: FiniteGuard | None = None,
) -> tuple[Rollout, Tensor, Tensor, np.ndarray, int]:
    """One rollout of ``cfg.num_steps`` steps, run on to the episodes' ends for a critic-free Psi,
    and the steps the loss counts. Returns (rollout (T, N), counted mask (T, N), the mask of its
    whole episodes for :func:`gradient_variance` (T, N), the observation to go on from, the env-step
    counter); ``starts`` (N,) is 1 where row 0 begins an episode."""
    ro, obs, step = collect_rollout(envs, obs, actor, critic, cfg.num_steps, tracker, log, step, guard)
    if cfg.psi in CRITIC_FREE:
        ro, obs, step = run_to_episode_ends(envs, env_id, obs, actor, critic, ro, cfg.psi, tracker, log, step, guard)
    mask = counted_mask(cfg.psi, ro.episode_ends, starts, cfg.num_steps)  # (T, N)
    whole = whole_episode_mask(ro.episode_ends, starts) * window_mask(ro.episode_ends, cfg.num_steps)  # (T, N) begun in the rollout
    return ro, mask, whole, obs, step


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
        ro, mask, whole, obs, step = collect_counted(envs, env_id, obs, actor, critic, cfg, starts, tracker, log, step, guard)  # (T, N)
        starts = ro.episode_ends[-1]  # (N,) an episode ended on the last row: the next rollout begins one
        psi, target = compute_psi(cfg.psi, ro, cfg.gamma, cfg.gae_lambda)  # (T, N)
        guard.returns(step, {"Psi": psi, "regression targets": target})
        if cfg.norm_adv:
            psi = masked_whiten(psi, mask)
        stats: dict[str, float] = {"counted_frac": mask.mean().item()}
        if cfg.measure_variance:
            for name in PSI_CHOICES:
                stats[f"grad_var/{name}"] = gradient_variance(actor, ro, compute_psi(name, ro, cfg.gamma, cfg.gae_lambda)[0], whole)

        logp, _ = categorical_logp(actor, ro.obs, ro.actions)  # (T, N)
        pg_loss = policy_loss(logp, psi, mask, cfg.num_steps * cfg.num_envs)
        actor_opt.zero_grad()
        pg_loss.backward()
        actor_opt.step()
        guard.update(step, "actor", actor, {"policy loss": pg_loss}, ro.obs)
        for _ in range(0 if cfg.psi in CRITIC_FREE else cfg.critic_updates):
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
