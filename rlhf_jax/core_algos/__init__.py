"""The RL maths of PPO as pure, jit-able functions of arrays (verl's `core_algos` in JAX).

Same function and argument names as `verl/trainer/ppo/core_algos.py` and
`verl/utils/torch_functional.py`, so a verl line ports one at a time. No model and no config
object inside: arrays in, arrays out; static choices (estimator names, aggregation modes,
`num_groups`, `clip_ratio_c`) are Python values. The maths pulls in only jax and numpy.

Modules: `masked` (masked reductions, log-probs, entropy), `groups` (group ids of any kind,
group statistics), `advantages` (GAE, GRPO, RLOO, REINFORCE++, ReMax), `group_advantages`
(OPO, GRPO pass@k, GPG, GDPO, vectorised RLOO), `token_baseline` (optimal token baseline),
`kl` (KL penalties, KL controllers), `losses` (agg_loss with global denominators, vanilla
policy / value / entropy losses), `policy_losses` (DPPO, GSPO, SAPO, GPG, GMPO, DRO, CISPO),
`cov_losses` (Clip-Cov, KL-Cov), `registry` (the advantage-estimator and policy-loss
registries, as verl's `register_adv_est` / `register_policy_loss`), `entries` (the
built-in entries of the registries) and `jitted` (every function compiled, its strings and
modes static without naming them: `jitted.kl_penalty(logp, ref, "low_var_kl")`).

The names below load their module on first use (a module `__getattr__`, PEP 562): the
config validates names against the registries, and reading a config must not load jax
(`scripts/train.py --print-config`); `registry` itself imports no jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "advantages": (
        "compute_gae_advantage_return",
        "compute_gae_return",
        "compute_grpo_outcome_advantage",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
        "compute_reinforce_plus_plus_outcome_advantage",
        "compute_remax_outcome_advantage",
        "compute_rloo_outcome_advantage",
    ),
    "group_advantages": (
        "compute_gdpo_outcome_advantage",
        "compute_gpg_outcome_advantage",
        "compute_grpo_passk_outcome_advantage",
        "compute_opo_outcome_advantage",
        "compute_rloo_vectorized_outcome_advantage",
    ),
    "jitted": (
        "jit",
    ),
    "groups": (
        "dense_group_ids",
        "group_ids",
    ),
    "token_baseline": (
        "compute_multi_turn_optimal_token_baseline_advantage",
        "compute_optimal_token_baseline_advantage",
    ),
    "policy_losses": (
        "compute_policy_loss_cispo",
        "compute_policy_loss_dppo_kl",
        "compute_policy_loss_dppo_tv",
        "compute_policy_loss_dro",
        "compute_policy_loss_geo_mean",
        "compute_policy_loss_gpg",
        "compute_policy_loss_gspo",
        "compute_policy_loss_sapo",
    ),
    "cov_losses": (
        "compute_policy_loss_clip_cov",
        "compute_policy_loss_kl_cov",
    ),
    "kl": (
        "KL_PENALTY_NAMES",
        "AdaptiveKLController",
        "FixedKLController",
        "KLControllerState",
        "get_kl_controller",
        "kl_penalty",
        "kl_penalty_full",
    ),
    "losses": (
        "LOSS_AGG_MODES",
        "agg_loss",
        "agg_loss_denominators",
        "compute_entropy_loss",
        "compute_policy_loss",
        "compute_policy_loss_vanilla",
        "compute_value_loss",
    ),
    "masked": (
        "entropy_from_logits",
        "logprobs_from_logits",
        "masked_mean",
        "masked_sum",
        "masked_var",
        "masked_whiten",
        "sum_pi_squared_from_logits",
    ),
    "rollout_corr": (
        "apply_rollout_correction",
        "compute_offpolicy_metrics",
        "compute_rollout_correction_and_rejection_mask",
        "compute_rollout_correction_weights",
        "compute_rollout_rejection_mask",
    ),
    "rollout_corr_loss": (
        "compute_policy_loss_bypass_mode",
        "compute_policy_loss_reinforce",
    ),
    "rollout_corr_spec": (
        "ROLLOUT_IS_LEVELS",
        "ROLLOUT_RS_OPTIONS",
        "RolloutCorrection",
    ),
    "registry": (
        "ADV_INPUTS",
        "AdvEstimator",
        "PolicyLossConfig",
        "adv_estimator_names",
        "get_adv_estimator",
        "get_policy_loss",
        "policy_loss_names",
        "register_adv_est",
        "register_policy_loss",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _EXPORTS:  # a submodule: `core_algos.advantages`
        return importlib.import_module(f"{__name__}.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_MODULE_OF})

