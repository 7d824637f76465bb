"""Bypass mode's policy losses: PPO's old log-probs are the rollout's, and rollout
correction (`rollout_corr`) is made inside the loss, against the current policy.

verl counterpart: `compute_policy_loss_reinforce` and `compute_policy_loss_bypass_mode` of
`verl/trainer/ppo/core_algos.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.losses import _token_mean, agg_loss
from rlhf_jax.core_algos.rollout_corr import _float, _rows, apply_rollout_correction
from rlhf_jax.core_algos.rollout_corr_spec import RolloutCorrection


def compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode="token-mean", *, global_token_count=None,
                                  global_seq_count=None, rollout_is_weights=None):
    """REINFORCE with optional importance weights: `loss_t = -A_t * log_prob_t * w_t`.

    `w` (no gradient) is `pi_current / pi_rollout` truncated, so the gradient is
    `-E[w A grad log pi]`: the importance-corrected policy gradient, without PPO's clip.

    Args:
      rollout_log_prob: `[batch, time]` the rollout policy's log-probs (for `ppo_kl`).
      log_prob: `[batch, time]` the current policy's (differentiate this).
      advantages, response_mask: `[batch, time]`.
      loss_agg_mode, global_token_count, global_seq_count: see `losses.agg_loss`.
      rollout_is_weights: `[batch, time]` or None (plain REINFORCE).

    Returns:
      `(pg_loss, {"ppo_kl": mean_t(rollout_log_prob - log_prob)})`.

    verl: `core_algos.compute_policy_loss_reinforce`.
    """
    log_prob = jnp.asarray(log_prob)
    m = _float(response_mask, log_prob)
    losses = -jnp.asarray(advantages).astype(log_prob.dtype) * log_prob
    if rollout_is_weights is not None:
        losses = losses * jax.lax.stop_gradient(jnp.asarray(rollout_is_weights, log_prob.dtype))
    pg_loss = agg_loss(losses, m, loss_agg_mode, global_token_count=global_token_count,
                       global_seq_count=global_seq_count)
    kl = jax.lax.stop_gradient(jnp.asarray(rollout_log_prob) - log_prob)
    return pg_loss, {"ppo_kl": _token_mean(kl, m, global_token_count)}


def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, *,
                                    correction: RolloutCorrection, ppo_clip_loss,
                                    loss_agg_mode="token-mean", global_token_count=None,
                                    global_seq_count=None):
    """verl's bypass-mode policy loss: `old_log_prob` is the rollout's, and the correction is
    made here, against the current policy (`log_prob`, no gradient through it).

    The IS weights and the rejection mask of `correction` are computed from
    `log_prob - old_log_prob`; the rejected tokens leave the loss. `loss_type` "reinforce":
    `compute_policy_loss_reinforce` with the weights; "ppo_clip": `ppo_clip_loss` on the
    rollout ratio, without the weights (the ratio already is the importance ratio; the
    weights are then computed for their metrics only).

    Args:
      old_log_prob: `[batch, time]` the rollout policy's log-probs.
      log_prob: `[batch, time]` the current policy's (differentiate this).
      advantages, response_mask: `[batch, time]`.
      correction: the parsed settings (static).
      ppo_clip_loss: `fn(old, logp, adv, mask, *, loss_agg_mode, global_token_count,
        global_seq_count) -> (loss, metrics)`, a registered policy loss with its config bound.
      loss_agg_mode, global_token_count, global_seq_count: see `losses.agg_loss`; the counts
        are those of the whole mini-batch, before rejection.

    Returns:
      `(pg_loss, pg_metrics, rollout_corr_metrics)`. The `rollout_corr/` metrics are this
      call's (verl's per-micro-batch values) times its share of the mini-batch's sequences
      (`sequences here / global_seq_count`), so that they add up over the micro-batches of a
      mini-batch to their sequence-weighted mean (verl averages its micro-batches).

    verl: `core_algos.compute_policy_loss_bypass_mode`.
    """
    weights, mask, corr = apply_rollout_correction(
        jax.lax.stop_gradient(jnp.asarray(log_prob)), old_log_prob, response_mask, correction)
    counts = dict(global_token_count=global_token_count, global_seq_count=global_seq_count)
    if correction.loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, rollout_is_weights=weights,
            **counts)
    elif correction.loss_type == "ppo_clip":
        pg_loss, pg_metrics = ppo_clip_loss(old_log_prob, log_prob, advantages, mask,
                                            loss_agg_mode=loss_agg_mode, **counts)
    else:
        raise ValueError(f"loss_type must be ppo_clip or reinforce, got {correction.loss_type!r}")
    here = jnp.sum(_rows(_float(response_mask, jnp.float32(0))))
    share = here / jnp.maximum(jnp.asarray(global_seq_count, jnp.float32), 1.0) \
        if global_seq_count is not None else jnp.float32(1)
    corr = {k: jnp.where(share > 0, v * share, 0.0) for k, v in corr.items()}
    return pg_loss, pg_metrics, corr
