"""Trust Region Policy Optimization.

    maximise  L(theta) = E[ pi_theta(a|s) / pi_old(a|s) * A ]   subject to   mean KL(pi_old || pi_theta) <= delta

Schulman et al. (2015), eq. 14; seed 002, section 5.3. The step: g = grad L, x = F^-1 g by
conjugate gradient on Fisher-vector products F v = grad (grad KL . v) (the Hessian of the mean KL
at theta_old, + damping * v), full step s = sqrt(2 delta / x^T F x) * x (the step whose quadratic
KL model equals delta), then a backtracking line search over s, shrink * s, shrink^2 * s, ...
that accepts the first step whose exact mean KL is <= delta and whose surrogate improves
(Appendix C). If none qualifies the policy stays where it was. The value function is fitted by
regression to the GAE returns with Adam (``critic_updates`` passes in minibatches).

The surrogate is core's clipped surrogate with eps = inf, i.e. no clipping: exactly L^CPI
(Schulman et al. 2017, eq. 6).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

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
from rlalign.core.kl import categorical_kl
from rlalign.core.losses import clipped_surrogate_loss, explained_variance, value_loss
from rlalign.core.masks import masked_whiten

__all__ = ["TRPOConfig", "ENV_KIND", "conjugate_gradient", "line_search", "train"]

ENV_KIND = "vector"  # what common.check_env asks of the environment


class TRPOConfig(ClassicConfig):
    """TRPO. Defaults: sb3-contrib's TRPO defaults, tuned for CartPole-v1."""

    total_steps: int = Field(100_000, ge=1, description="environment steps to train for (all envs together)")
    num_envs: int = Field(2, ge=1, description="parallel environments")
    num_steps: int = Field(512, ge=1, description="steps per environment per rollout")
    max_kl: float = Field(0.01, gt=0.0, description="trust region delta on the mean KL(pi_old || pi)")
    cg_iters: int = Field(15, ge=1, description="conjugate-gradient iterations")
    cg_damping: float = Field(0.1, ge=0.0, description="damping added to the Fisher-vector product")
    backtrack_iters: int = Field(10, ge=1, description="line-search trials")
    backtrack_coef: float = Field(0.8, gt=0.0, lt=1.0, description="line-search shrink factor")
    gamma: float = Field(0.99, gt=0.0, le=1.0, description="discount factor")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda")
    norm_adv: bool = Field(True, description="whiten the advantages of each rollout")
    critic_lr: float = Field(1e-3, gt=0.0, description="Adam learning rate of the value function")
    critic_updates: int = Field(10, ge=1, description="passes of value regression per rollout")
    critic_minibatch: int = Field(128, ge=1, description="minibatch size of the value regression")
    hidden: Hidden = Field([64, 64], description="hidden sizes of the actor and of the critic (tanh), each >= 1")


def conjugate_gradient(Avp: Callable[[Tensor], Tensor], b: Tensor, iters: int, residual_tol: float = 1e-10) -> Tensor:
    """Approximately solve A x = b for symmetric positive-definite A given only v -> A v.

    Hestenes & Stiefel (1952); Nocedal & Wright, Algorithm 5.2. Exact in dim(b) iterations
    (in exact arithmetic).
    """
    x = torch.zeros_like(b)
    r = b.clone()  # residual b - A x
    p = b.clone()  # search direction
    rr = r @ r
    for _ in range(iters):
        Ap = Avp(p)
        alpha = rr / (p @ Ap)
        x += alpha * p
        r -= alpha * Ap
        rr_new = r @ r
        if rr_new < residual_tol:
            break
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x


def line_search(
    actor: nn.Module,
    old_params: Tensor,
    full_step: Tensor,
    surrogate_kl: Callable[[], tuple[float, float]],
    max_kl: float,
    iters: int,
    shrink: float,
) -> tuple[bool, float, float]:
    """Try theta_old + shrink^k * full_step for k = 0..iters-1; keep the first whose mean KL is
    <= max_kl and whose surrogate beats the old one. Otherwise restore theta_old.

    ``surrogate_kl()`` evaluates (surrogate, mean KL) at the actor's current parameters.
    Returns (accepted, surrogate, kl) of the kept parameters.
    """
    vector_to_parameters(old_params, actor.parameters())
    surr_old, _ = surrogate_kl()
    for k in range(iters):
        vector_to_parameters(old_params + shrink**k * full_step, actor.parameters())
        surr, kl = surrogate_kl()
        if kl <= max_kl and surr > surr_old:
            return True, surr, kl
    vector_to_parameters(old_params, actor.parameters())
    return False, surr_old, 0.0


def train(cfg: TRPOConfig, env_id: str, log: RunLog | None = None) -> Result:
    """Train an actor-critic on ``env_id`` with TRPO; the agent is ``{"actor": ..., "critic": ...}``."""
    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    log = log or RunLog()
    envs = make_vec_env(env_id, cfg.num_envs, cfg.seed)
    dim, n_actions = obs_size(envs.single_observation_space), num_actions(envs.single_action_space)
    actor = mlp([dim, *cfg.hidden, n_actions], out_gain=0.01)
    critic = mlp([dim, *cfg.hidden, 1], out_gain=1.0)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr, fused=True)
    batch_size = cfg.num_envs * cfg.num_steps
    tracker, greedy = EpisodeTracker(cfg.num_envs), torch_act(actor)
    guard = FiniteGuard("trpo", env_id, {"actor": f"max_kl={cfg.max_kl:g} too high or cg_damping={cfg.cg_damping:g} too low?",
                                         "critic": f"critic_lr={cfg.critic_lr:g} too high?"})
    obs, _ = envs.reset(seed=cfg.seed)
    step = last_eval = 0

    while step < cfg.total_steps:
        ro, obs, step = collect_rollout(envs, obs, actor, critic, cfg.num_steps, tracker, log, step, guard)
        adv, returns = gae(ro.rewards, ro.values, ro.next_values, ro.terminated, ro.episode_ends, cfg.gamma, cfg.gae_lambda)  # (T, N)
        guard.returns(step, {"GAE returns": returns, "advantages": adv})
        b_obs, b_act, b_logp = ro.obs.flatten(0, 1), ro.actions.flatten(), ro.logp.flatten()  # (B, dim), (B,), (B,)
        b_adv = masked_whiten(adv.flatten()) if cfg.norm_adv else adv.flatten()  # (B,)
        with torch.no_grad():
            old_logits = actor(b_obs)  # (B, A)

        def surrogate_kl() -> tuple[float, float]:
            with torch.no_grad():
                logp, logits = categorical_logp(actor, b_obs, b_act)
                loss, _ = clipped_surrogate_loss(logp, b_logp, b_adv, eps_low=math.inf)  # eps = inf: L^CPI
                return -loss.item(), categorical_kl(old_logits, logits).mean().item()

        def fisher_vector(v: Tensor) -> Tensor:
            kl = categorical_kl(old_logits, actor(b_obs)).mean()
            grads = parameters_to_vector(torch.autograd.grad(kl, actor.parameters(), create_graph=True))
            hv = torch.autograd.grad(grads @ v, actor.parameters())
            return parameters_to_vector(hv) + cfg.cg_damping * v

        logp, _ = categorical_logp(actor, b_obs, b_act)
        loss, _ = clipped_surrogate_loss(logp, b_logp, b_adv, eps_low=math.inf)
        g = -parameters_to_vector(torch.autograd.grad(loss, actor.parameters()))  # gradient of the surrogate
        direction = conjugate_gradient(fisher_vector, g, cfg.cg_iters)  # F^-1 g
        full_step = torch.sqrt(2 * cfg.max_kl / (direction @ fisher_vector(direction))) * direction
        old_params = parameters_to_vector(actor.parameters()).detach()
        accepted, surr, kl = line_search(actor, old_params, full_step, surrogate_kl, cfg.max_kl, cfg.backtrack_iters, cfg.backtrack_coef)
        guard.update(step, "actor", actor, {"surrogate": surr}, b_obs)

        b_ret, b_val = returns.flatten(), ro.values.flatten()  # (B,)
        for _ in range(cfg.critic_updates):
            for mb in torch.randperm(batch_size).split(cfg.critic_minibatch):
                v_loss, _ = value_loss(critic(b_obs[mb]).squeeze(-1), b_ret[mb])
                critic_opt.zero_grad()
                v_loss.backward()
                critic_opt.step()
        guard.update(step, "critic", critic, {"value loss": v_loss}, b_obs)
        log.update(step, {
            "surrogate": surr, "kl": kl, "accepted": float(accepted), "loss/value": v_loss.item(),
            "explained_variance": explained_variance(b_val, b_ret).item(),
        })
        last_eval = maybe_evaluate(cfg, env_id, greedy, log, step, last_eval)
        if log.stop:
            break
    envs.close()
    return finish(cfg, env_id, {"actor": actor, "critic": critic}, greedy, log)
