"""The maths: pure functions on tensors (no modules, no I/O, no configs). See each module."""

from rlalign.core.bellman import double_q_target, polyak_update_, q_learning_target, q_learning_update
from rlalign.core.advantages import (
    gae,
    group_advantages,
    kl_shaped_rewards,
    overlong_penalty,
    last_token_index,
    reinforce_plus_plus_advantages,
    reward_to_go,
    rloo_advantages,
    sampled_token_gae,
    td_residuals,
    token_gae,
    total_returns,
)
from rlalign.core.distillation import full_reverse_kl, generalized_jsd, generalized_jsd_loss, reverse_kl_advantages, reverse_kl_loss
from rlalign.core.evaluation import pass_at_k
from rlalign.core.importance import importance_weights
from rlalign.core.information import cross_entropy_bits, entropy_bits, kl_bits, surprisal_bits
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
from rlalign.core.logprobs import token_logprobs
from rlalign.core.losses import (
    AGGREGATION_MODES,
    aggregate,
    bradley_terry_loss,
    clipped_surrogate_loss,
    entropy_loss,
    explained_variance,
    kl_penalty_loss,
    policy_gradient_loss,
    sft_loss,
    truncated_is_weights,
    value_loss,
)
from rlalign.core.policy_losses import cispo_loss, sapo_loss
from rlalign.core.preference import PreferenceStats, dpo_loss, ipo_loss, simpo_loss
from rlalign.core.masks import masked_mean, masked_sum, masked_var, masked_whiten, whiten

__all__ = [name for name in dir() if not name.startswith("_")]
