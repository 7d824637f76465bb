"""The array maths of one PPO step between rollout and updates, as jitted pure functions.

Token-level scores, the KL penalty in the reward (with its controller), and the advantage
estimators, all on `[N, R]` response arrays. Everything here is a thin composition of
`core_algos`, compiled once per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlhf_jax import core_algos


def token_level_scores(scores_n, response_mask_nr):
    """The scalar score of each sequence placed on its last valid response token: [N, R]."""
    last = jnp.maximum(jnp.sum(response_mask_nr, axis=-1) - 1, 0)
    r = response_mask_nr.shape[-1]
    onehot = jnp.arange(r)[None, :] == last[:, None]
    return jnp.where(onehot, scores_n[:, None], 0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("kind",))
def kl_in_reward(token_scores, old_log_probs, ref_log_probs, response_mask, kl_coef, *, kind):
    """verl's `apply_kl_penalty`: rewards = scores - beta * KL(old, ref) per token.

    Returns:
      (token_rewards [N, R], current_kl: the batch mean of per-sequence mean KL).
    """
    kld = core_algos.kl_penalty(old_log_probs, ref_log_probs, kind) * response_mask
    rewards = token_scores - kl_coef * kld
    per_seq = core_algos.masked_mean(kld, response_mask, axis=-1)
    return rewards, jnp.mean(per_seq)


@functools.partial(
    jax.jit, static_argnames=("estimator", "gamma", "lam", "norm_adv_by_std_in_grpo")
)
def advantages(token_rewards, values, response_mask, index, reward_baselines=None, *,
               estimator: str, gamma: float, lam: float, norm_adv_by_std_in_grpo: bool = True):
    """Dispatches to the estimator of `algorithm.adv_estimator`. Returns (advantages, returns).

    Args:
      token_rewards, values, response_mask: [N, R]; index: [N] int32 group (prompt) ids.
    """
    if estimator == "gae":
        return core_algos.compute_gae_advantage_return(
            token_rewards, values, response_mask, gamma, lam
        )
    if estimator == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            token_rewards, response_mask, index,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
    if estimator == "rloo":
        return core_algos.compute_rloo_outcome_advantage(token_rewards, response_mask, index)
    if estimator == "reinforce_plus_plus":
        return core_algos.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, response_mask, gamma
        )
    if estimator == "reinforce_plus_plus_baseline":
        return core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
            token_rewards, response_mask, index
        )
    if estimator == "remax":
        return core_algos.compute_remax_outcome_advantage(
            token_rewards, reward_baselines, response_mask
        )
    raise ValueError(f"unknown advantage estimator {estimator!r}")


whiten = jax.jit(core_algos.masked_whiten)  # GAE's advantages, over the whole batch


@jax.jit
def rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask):
    """`training/rollout_probs_diff_{max,mean}`: |p_rollout - p_trainer| over response tokens."""
    diff = jnp.abs(jnp.exp(rollout_log_probs) - jnp.exp(old_log_probs)) * response_mask
    return jnp.max(diff), core_algos.masked_mean(diff, response_mask)
