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
def advantages(token_rewards, response_mask, *, estimator: str, values=None, index=None,
               reward_baselines=None, old_log_probs=None, sum_pi_squared=None,
               rollout_is_weights=None, gamma: float, lam: float,
               norm_adv_by_std_in_grpo: bool = True):
    """The estimator registered as `algorithm.adv_estimator`: (advantages, returns), [N, R].

    Pass what the estimator needs (`core_algos.get_adv_estimator(name).needs`); the others
    may be None.

    Args:
      token_rewards, response_mask: [N, R].
      values: [N, R] critic values (gae).
      index: [N] int32 group (prompt) ids (grpo, rloo, reinforce_plus_plus_baseline).
      reward_baselines: [N] greedy-response scores, see `remax_reward_baselines` (remax).
      old_log_probs, sum_pi_squared: [N, R] the old pass's (optimal_token_baseline).
      rollout_is_weights: [N, R] rollout correction's IS weights, or None.

    Raises:
      ValueError: an unknown estimator, or a need left None.
    """
    return core_algos.get_adv_estimator(estimator)(
        token_rewards, response_mask, values=values, index=index,
        reward_baselines=reward_baselines, old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights,
        gamma=gamma, lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


def remax_reward_baselines(greedy_scores_p, index_n):
    """ReMax's `reward_baselines`: each sample gets the score of its prompt's greedy response.

    As verl's `RayPPOTrainer.fit`: one response per prompt generated with `do_sample=False`
    by the current policy, scored by the same reward as the samples (rule or reward model;
    the scalar score, i.e. the sum of its token-level scores, with no KL penalty), and
    repeated to the prompt's `rollout.n` samples.

    Args:
      greedy_scores_p: [P] scores of the greedy responses, one per prompt.
      index_n: [N] prompt id of each sample, in `[0, P)` (the GRPO group ids).

    Returns:
      [N] float32 `greedy_scores_p[index_n]`.
    """
    return jnp.asarray(greedy_scores_p, jnp.float32)[jnp.asarray(index_n)]


whiten = jax.jit(core_algos.masked_whiten)  # GAE's advantages, over the whole batch


@jax.jit
def rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask):
    """`training/rollout_probs_diff_{max,mean}`: |p_rollout - p_trainer| over response tokens."""
    diff = jnp.abs(jnp.exp(rollout_log_probs) - jnp.exp(old_log_probs)) * response_mask
    return jnp.max(diff), core_algos.masked_mean(diff, response_mask)
