"""The RL maths of PPO as pure, jit-able functions of arrays (verl's `core_algos` in JAX).

Same function and argument names as `verl/trainer/ppo/core_algos.py` and
`verl/utils/torch_functional.py`, so a verl line ports one at a time. No model and no config
object inside: arrays in, arrays out; static choices (estimator names, aggregation modes,
`num_groups`, `clip_ratio_c`) are Python values. The maths pulls in only jax and numpy.

Modules: `masked` (masked reductions, log-probs, entropy), `advantages` (GAE, GRPO, RLOO,
REINFORCE++, ReMax), `kl` (KL penalties, KL controllers), `losses` (agg_loss with global
denominators, policy / value / entropy losses), `registry` (the advantage-estimator and
policy-loss registries, as verl's `register_adv_est` / `register_policy_loss`).

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
        "compute_value_loss",
    ),
    "masked": (
        "entropy_from_logits",
        "logprobs_from_logits",
        "masked_mean",
        "masked_sum",
        "masked_var",
        "masked_whiten",
    ),
    "registry": (
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

