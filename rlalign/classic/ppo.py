"""Proximal Policy Optimization with the implementation details that matter (CleanRL's ppo.py).

    L = L^CLIP + c1 * L^V - c2 * H,   L^CLIP = -E[min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)]

Schulman et al. (2017), eq. 9; the details after Huang et al. (2022), "The 37 Implementation
Details of PPO": vector environments (SAME_STEP autoreset, so no transition spans a reset), GAE
that bootstraps on truncation but not on termination, the clipped surrogate, optional value
clipping, an entropy bonus, advantages normalised per minibatch, learning rate (and optionally
clip range) annealed linearly to 0, global gradient-norm clipping, orthogonal initialisation,
separate actor and critic MLPs.

Logged per update, as CleanRL's ppo.py logs them: ``loss/policy``, ``loss/value``, ``entropy`` and
``approx_kl`` (mean((r - 1) - log r)) of the last minibatch of the last epoch run; ``clip_frac``,
CleanRL's clipfrac: the share of samples with |r - 1| > eps (:func:`ratio_clip_frac`), averaged
over every minibatch of every epoch run, eps the clip range in effect; ``clip_active_frac``, the
share whose clip is active, so that their gradient is zero (A > 0 and r > 1 + eps, or A < 0 and
r < 1 - eps: ClipStats.clip_frac, the clip ratio verl and TRL log), averaged the same way;
``explained_variance`` of the rollout's values against its returns; ``lr``; ``epochs`` run; and
``ratio/first_minibatch_max_log_dev``, max |log r| on the first minibatch (0 before any step).

Every formula is a call into rlalign.core (gae, clipped_surrogate_loss, value_loss, entropy_loss,
masked_whiten) or :func:`ratio_clip_frac`; the rest of this file is the loop.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from rlalign.classic.common import (
    ClassicConfig,
    EpisodeTracker,
    FiniteGuard,
    Hidden,
    Result,
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
from rlalign.core.advantages import gae
from rlalign.core.kl import entropy_from_logits
from rlalign.core.losses import clipped_surrogate_loss, entropy_loss, explained_variance, value_loss
from rlalign.core.masks import masked_whiten

__all__ = ["PPOConfig", "ENV_KIND", "ratio_clip_frac", "train"]

ENV_KIND = "vector"  # what common.check_env asks of the environment


class PPOConfig(ClassicConfig):
    """PPO. Defaults: the SB3 zoo's CartPole-v1 values; configs/classic/ppo_cartpole.yaml is the tuned recipe."""

    total_steps: int = Field(100_000, ge=1, description="environment steps to train for (all envs together)")
    num_envs: int = Field(8, ge=1, description="parallel environments")
    num_steps: int = Field(32, ge=1, description="steps per environment per rollout")
    num_minibatches: int = Field(1, ge=1, description="minibatches per epoch (batch = num_envs * num_steps)")
    update_epochs: int = Field(20, ge=1, description="passes over each rollout")
    lr: float = Field(1e-3, gt=0.0, description="Adam learning rate")
    anneal_lr: bool = Field(True, description="anneal the learning rate linearly to 0")
    gamma: float = Field(0.98, gt=0.0, le=1.0, description="discount factor")
    gae_lambda: float = Field(0.8, ge=0.0, le=1.0, description="GAE lambda")
    clip_coef: float = Field(0.2, gt=0.0, description="surrogate clip range eps")
    anneal_clip: bool = Field(True, description="anneal the clip range linearly to 0 (SB3 zoo 'lin_0.2')")
    clip_vloss: bool = Field(
        False,
        description="clip the value update around the old values to +- the clip range in use: clip_coef, annealed with the "
        "surrogate's when anneal_clip (as OpenAI baselines' ppo2 does)",
    )
    norm_adv: bool = Field(True, description="whiten advantages per minibatch")
    ent_coef: float = Field(0.0, ge=0.0, description="entropy bonus coefficient c2")
    vf_coef: float = Field(0.5, ge=0.0, description="value loss coefficient c1")
    max_grad_norm: float = Field(0.5, gt=0.0, description="global gradient-norm clip")
    target_kl: float | None = Field(None, gt=0.0, description="stop the epochs early when approx_kl exceeds this")
    hidden: Hidden = Field([64, 64], description="hidden sizes of the actor and of the critic (tanh), each >= 1")

    @model_validator(mode="after")
    def _minibatches_fit(self) -> PPOConfig:
        if self.num_minibatches > self.num_envs * self.num_steps:
            raise ValueError(
                f"num_minibatches = {self.num_minibatches} is more than the batch of num_envs * num_steps = "
                f"{self.num_envs * self.num_steps} transitions; at most {self.num_envs * self.num_steps}"
            )
        return self


def ratio_clip_frac(logp: Tensor, old_logp: Tensor, eps: float) -> Tensor:
    """mean(|r - 1| > eps), r = exp(log pi - log pi_old): CleanRL's clipfrac (ppo.py), the share of
    samples whose ratio has left the clip range, whichever the sign of their advantage.

    Shapes: logp, old_logp (M,) -> ().
    """
    ratio = torch.exp(logp.detach() - old_logp)  # (M,)
    return ((ratio - 1.0).abs() > eps).to(ratio.dtype).mean()


def train(cfg: PPOConfig, env_id: str, log: RunLog | None = None) -> Result:
    """Train an actor-critic on ``env_id``; the agent is ``{"actor": ..., "critic": ...}``."""
    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    log = log or RunLog()
    envs = make_vec_env(env_id, cfg.num_envs, cfg.seed)
    dim, n_actions = obs_size(envs.single_observation_space), num_actions(envs.single_action_space)
    actor = mlp([dim, *cfg.hidden, n_actions], out_gain=0.01)
    critic = mlp([dim, *cfg.hidden, 1], out_gain=1.0)
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = torch.optim.Adam(params, lr=cfg.lr, eps=1e-5, fused=True)
    batch_size = cfg.num_envs * cfg.num_steps
    minibatch_size = batch_size // cfg.num_minibatches
    num_iterations = max(cfg.total_steps // batch_size, 1)
    tracker, greedy = EpisodeTracker(cfg.num_envs), torch_act(actor)
    guard = FiniteGuard("ppo", env_id, {"actor": f"lr={cfg.lr:g} too high?", "critic": f"lr={cfg.lr:g} too high?"})
    obs, _ = envs.reset(seed=cfg.seed)
    step = last_eval = 0

    for iteration in range(num_iterations):
        frac = 1.0 - iteration / num_iterations  # 1 -> 1/num_iterations
        optimizer.param_groups[0]["lr"] = cfg.lr * frac if cfg.anneal_lr else cfg.lr
        clip = cfg.clip_coef * frac if cfg.anneal_clip else cfg.clip_coef
        ro, obs, step = collect_rollout(envs, obs, actor, critic, cfg.num_steps, tracker, log, step, guard)
        adv, returns = gae(ro.rewards, ro.values, ro.next_values, ro.terminated, ro.episode_ends, cfg.gamma, cfg.gae_lambda)  # (T, N)
        guard.returns(step, {"GAE returns": returns, "advantages": adv})

        b_obs, b_act, b_logp = ro.obs.flatten(0, 1), ro.actions.flatten(), ro.logp.flatten()  # (B, dim), (B,), (B,)
        b_adv, b_ret, b_val = adv.flatten(), returns.flatten(), ro.values.flatten()  # (B,)
        first_dev = None
        clip_fracs, active_fracs = [], []  # one per minibatch of every epoch run
        for epoch in range(cfg.update_epochs):
            for mb in torch.randperm(batch_size).split(minibatch_size):
                logp, logits = categorical_logp(actor, b_obs[mb], b_act[mb])  # (M,), (M, A)
                if first_dev is None:  # first minibatch of the first epoch: the policy has not moved
                    first_dev = (logp - b_logp[mb]).abs().max().item()
                mb_adv = masked_whiten(b_adv[mb]) if cfg.norm_adv else b_adv[mb]
                pg_loss, pg_stats = clipped_surrogate_loss(logp, b_logp[mb], mb_adv, eps_low=clip)
                clip_fracs.append(ratio_clip_frac(logp, b_logp[mb], clip))
                active_fracs.append(pg_stats.clip_frac)
                values = critic(b_obs[mb]).squeeze(-1)  # (M,)
                v_loss, _ = value_loss(values, b_ret[mb], old_values=b_val[mb], clip_range=clip if cfg.clip_vloss else None)
                ent_loss, ent_stats = entropy_loss(entropy_from_logits(logits))
                loss = pg_loss + cfg.vf_coef * v_loss + cfg.ent_coef * ent_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
            if cfg.target_kl is not None and pg_stats.approx_kl > cfg.target_kl:
                break
        guard.update(step, "actor", actor, {"policy loss": pg_loss}, b_obs)
        guard.update(step, "critic", critic, {"value loss": v_loss}, b_obs)

        log.update(step, {
            "loss/policy": pg_loss.item(), "loss/value": v_loss.item(), "entropy": ent_stats.entropy.item(),
            "approx_kl": pg_stats.approx_kl.item(), "clip_frac": torch.stack(clip_fracs).mean().item(),
            "clip_active_frac": torch.stack(active_fracs).mean().item(),
            "explained_variance": explained_variance(b_val, b_ret).item(), "lr": optimizer.param_groups[0]["lr"],
            "ratio/first_minibatch_max_log_dev": first_dev, "epochs": epoch + 1,
        })
        last_eval = maybe_evaluate(cfg, env_id, greedy, log, step, last_eval)
        if log.stop:
            break
    envs.close()
    return finish(cfg, env_id, {"actor": actor, "critic": critic}, greedy, log)
