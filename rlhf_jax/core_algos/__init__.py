"""The RL maths of PPO as pure, jit-able functions of arrays (verl's `core_algos` in JAX).

Same function and argument names as `verl/trainer/ppo/core_algos.py` and
`verl/utils/torch_functional.py`, so a verl line ports one at a time. No model and no config
object inside: arrays in, arrays out; static choices (estimator names, aggregation modes,
`num_groups`, `clip_ratio_c`) are Python values. Importing this package pulls in only jax and
numpy.

Modules: `masked` (masked reductions, log-probs, entropy), `advantages` (GAE, GRPO, RLOO,
REINFORCE++, ReMax), `kl` (KL penalties, KL controllers), `losses` (agg_loss with global
denominators, policy / value / entropy losses).
"""

from rlhf_jax.core_algos.advantages import (
    compute_gae_advantage_return,
    compute_gae_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from rlhf_jax.core_algos.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    KLControllerState,
    get_kl_controller,
    kl_penalty,
    kl_penalty_full,
)
from rlhf_jax.core_algos.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_loss_denominators,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
)
from rlhf_jax.core_algos.masked import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLControllerState",
    "agg_loss",
    "agg_loss_denominators",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gae_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_full",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
