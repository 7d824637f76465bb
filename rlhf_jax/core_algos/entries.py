"""The built-in entries of the registries: verl's advantage estimators and policy-loss modes.

Each adapts a `compute_*` function (verl's name, verl's arguments) to the calling convention
of `registry`; the maths stays in `advantages`, `group_advantages`, `token_baseline`, `losses`,
`policy_losses` and `cov_losses`, reached through the lazy `core_algos` package, so importing
this module (the config does, to know the names) loads no jax. Imported by `registry`.
"""

from __future__ import annotations

from rlhf_jax import core_algos as ca
from rlhf_jax.core_algos.registry import PolicyLossConfig, register_adv_est, register_policy_loss

# ------------------------------------------------------------------------ advantage estimators


@register_adv_est("gae", needs=("values", "gamma", "lam"))
def gae(token_level_rewards, response_mask, *, values, gamma, lam):
    """`compute_gae_advantage_return` (whitened advantages, returns = A + values)."""
    return ca.compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma,
                                           lam)


@register_adv_est("grpo", needs=("index", "norm_adv_by_std_in_grpo"))
def grpo(token_level_rewards, response_mask, *, index, norm_adv_by_std_in_grpo):
    """`compute_grpo_outcome_advantage`; Dr.GRPO when `norm_adv_by_std_in_grpo` is False."""
    return ca.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


@register_adv_est("rloo", needs=("index",))
def rloo(token_level_rewards, response_mask, *, index):
    """`compute_rloo_outcome_advantage` (leave-one-out baseline per group)."""
    return ca.compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("reinforce_plus_plus", needs=("gamma",))
def reinforce_plus_plus(token_level_rewards, response_mask, *, gamma):
    """`compute_reinforce_plus_plus_outcome_advantage` (whitened discounted return-to-go)."""
    return ca.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask,
                                                            gamma)


@register_adv_est("reinforce_plus_plus_baseline", needs=("index",))
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, index):
    """`compute_reinforce_plus_plus_baseline_outcome_advantage` (group-mean baseline)."""
    return ca.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards, response_mask, index
    )


@register_adv_est("remax", needs=("reward_baselines",))
def remax(token_level_rewards, response_mask, *, reward_baselines):
    """`compute_remax_outcome_advantage` (return-to-go minus the greedy response's score)."""
    return ca.compute_remax_outcome_advantage(token_level_rewards, reward_baselines,
                                              response_mask)


@register_adv_est("opo", needs=("index",))
def opo(token_level_rewards, response_mask, *, index):
    """`compute_opo_outcome_advantage` (length-weighted group-mean baseline)."""
    return ca.compute_opo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("grpo_passk", needs=("index", "norm_adv_by_std_in_grpo"))
def grpo_passk(token_level_rewards, response_mask, *, index, norm_adv_by_std_in_grpo):
    """`compute_grpo_passk_outcome_advantage` (only each group's best response learns)."""
    return ca.compute_grpo_passk_outcome_advantage(
        token_level_rewards, response_mask, index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


@register_adv_est("gpg", needs=("index",))
def gpg(token_level_rewards, response_mask, *, index):
    """`compute_gpg_outcome_advantage` (group-centred, scaled by the batch's nonzero share)."""
    return ca.compute_gpg_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("rloo_vectorized", needs=("index",))
def rloo_vectorized(token_level_rewards, response_mask, *, index):
    """`compute_rloo_vectorized_outcome_advantage` (RLOO; a group of one gets 0)."""
    return ca.compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask,
                                                        index)


@register_adv_est("grpo_vectorized", needs=("index", "norm_adv_by_std_in_grpo"))
def grpo_vectorized(token_level_rewards, response_mask, *, index, norm_adv_by_std_in_grpo):
    """verl's vectorised GRPO, the same numbers as `grpo` (ours is vectorised already)."""
    return ca.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


@register_adv_est("optimal_token_baseline",
                  needs=("index", "old_log_probs", "sum_pi_squared", "rollout_is_weights"))
def optimal_token_baseline(token_level_rewards, response_mask, *, index, old_log_probs,
                           sum_pi_squared, rollout_is_weights):
    """`compute_optimal_token_baseline_advantage` (per-step group baseline)."""
    return ca.compute_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
    )


@register_adv_est("tir_optimal_token_baseline",
                  needs=("index", "old_log_probs", "sum_pi_squared", "rollout_is_weights"))
def tir_optimal_token_baseline(token_level_rewards, response_mask, *, index, old_log_probs,
                               sum_pi_squared, rollout_is_weights):
    """`compute_multi_turn_optimal_token_baseline_advantage` (steps over valid tokens)."""
    return ca.compute_multi_turn_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
    )


@register_adv_est("gdpo", needs=("index", "norm_adv_by_std_in_grpo"))
def gdpo(token_level_rewards, response_mask, *, index, norm_adv_by_std_in_grpo):
    """`compute_gdpo_outcome_advantage` with one reward dimension, the score (whitened GRPO):
    the trainer's rewards are scalars; call the function with `reward_components` for more."""
    return ca.compute_gdpo_outcome_advantage(
        token_level_rewards, response_mask, index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


# ------------------------------------------------------------------------ policy losses
# Every one: (old_log_prob, log_prob, advantages, response_mask, *, config, loss_agg_mode,
# global_token_count, global_seq_count, rollout_log_prob, rollout_is_weights) -> (loss, metrics)


def _clip(config: PolicyLossConfig) -> dict:
    return dict(clip_ratio=config.clip_ratio, clip_ratio_low=config.clip_ratio_low,
                clip_ratio_high=config.clip_ratio_high)


@register_policy_loss("vanilla")
def vanilla(old_log_prob, log_prob, advantages, response_mask, *,
            config: PolicyLossConfig, loss_agg_mode="token-mean", global_token_count=None,
            global_seq_count=None, rollout_log_prob=None, rollout_is_weights=None):
    """PPO clip + dual clip: `compute_policy_loss` with the clip settings of `config`.

    `rollout_log_prob` is unused (verl's vanilla mode takes none either)."""
    del rollout_log_prob
    return ca.compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, **_clip(config),
        clip_ratio_c=config.clip_ratio_c, loss_agg_mode=loss_agg_mode,
        global_token_count=global_token_count, global_seq_count=global_seq_count,
        rollout_is_weights=rollout_is_weights,
    )


def _mode(name: str, compute: str, settings) -> None:
    """Registers policy loss `name`: `core_algos.<compute>(arrays, **settings(config), ...)`."""

    def loss(old_log_prob, log_prob, advantages, response_mask, *,
             config: PolicyLossConfig, loss_agg_mode="token-mean", global_token_count=None,
             global_seq_count=None, rollout_log_prob=None, rollout_is_weights=None):
        del rollout_log_prob
        return getattr(ca, compute)(
            old_log_prob, log_prob, advantages, response_mask, **settings(config),
            loss_agg_mode=loss_agg_mode, global_token_count=global_token_count,
            global_seq_count=global_seq_count, rollout_is_weights=rollout_is_weights,
        )

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = f"`{compute}` with the settings of `config`."
    register_policy_loss(name)(loss)


_mode("dppo_tv", "compute_policy_loss_dppo_tv",
      lambda c: dict(**_clip(c), clip_ratio_c=c.clip_ratio_c))
_mode("dppo_kl", "compute_policy_loss_dppo_kl",
      lambda c: dict(**_clip(c), clip_ratio_c=c.clip_ratio_c))
_mode("gspo", "compute_policy_loss_gspo", _clip)
_mode("sapo", "compute_policy_loss_sapo", lambda c: dict(tau_pos=c.tau_pos, tau_neg=c.tau_neg))
_mode("gpg", "compute_policy_loss_gpg", lambda c: {})
_mode("clip_cov", "compute_policy_loss_clip_cov",
      lambda c: dict(**_clip(c), clip_cov_ratio=c.clip_cov_ratio, clip_cov_lb=c.clip_cov_lb,
                     clip_cov_ub=c.clip_cov_ub))
_mode("kl_cov", "compute_policy_loss_kl_cov",
      lambda c: dict(kl_cov_ratio=c.kl_cov_ratio, ppo_kl_coef=c.ppo_kl_coef))
_mode("geo_mean", "compute_policy_loss_geo_mean", _clip)
_mode("dro", "compute_policy_loss_dro", lambda c: dict(dro_beta=c.dro_beta))
_mode("cispo", "compute_policy_loss_cispo", _clip)
