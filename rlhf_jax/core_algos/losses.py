"""PPO losses: loss aggregation with global denominators, clipped policy loss, value loss.

verl counterpart: `agg_loss`, `compute_policy_loss` (= `compute_policy_loss_vanilla`),
`compute_value_loss`, `compute_entropy_loss` of `verl/trainer/ppo/core_algos.py`.

Gradient accumulation. A mini-batch is split into k micro-batches whose losses are summed
(their gradients added). That sum equals the one-pass loss only if every micro-batch divides
by the counts of the whole mini-batch, not by its own (verl's issue #5625). So every loss here
takes keyword-only `global_token_count` / `global_seq_count`: compute them once per mini-batch
with `agg_loss_denominators` and pass them to each micro-batch. Left as None, they default to
the local counts of the arrays given, which is exactly the one-pass loss. Under `jax.jit` with
the batch sharded over data-parallel devices the arrays are global, so the local counts are
already global across shards; inside `shard_map` pass the `psum` of the counts. The metrics
(`pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`, `vf_clipfrac`) divide by `global_token_count`
too when given, so they also sum over micro-batches to the mini-batch value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.masked import _as_mask, entropy_from_logits, masked_mean, masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _safe_div(num, den):
    """`num / den`, with 0 / 0 = 0 (a denominator of 0 only occurs with an all-zero sum)."""
    den = jnp.asarray(den).astype(num.dtype)
    return num / jnp.where(den > 0, den, 1)


def agg_loss_denominators(loss_mask):
    """The global counts of a mini-batch, to pass to every micro-batch's loss.

    Args:
      loss_mask: `[..., batch, time]` mask of the whole mini-batch (any leading axes, e.g.
        `[k, micro, time]` for k stacked micro-batches).

    Returns:
      `{"global_token_count": sum(m), "global_seq_count": number of rows with at least one
      valid token}`, int32 scalars; splat them into `agg_loss` / `compute_policy_loss` /
      `compute_value_loss` / `compute_entropy_loss` with `**`.
    """
    m = jnp.asarray(loss_mask) != 0
    return {
        "global_token_count": jnp.sum(m, dtype=jnp.int32),
        "global_seq_count": jnp.sum(jnp.any(m, axis=-1), dtype=jnp.int32),
    }


def agg_loss(loss_mat, loss_mask, loss_agg_mode, *, global_token_count=None,
             global_seq_count=None, loss_scale_factor=None):
    """Aggregates a per-token loss into a scalar.

    With `m` the mask, `N` = `global_token_count` (default `sum(m)`), `S` =
    `global_seq_count` (default: rows with at least one valid token; all-masked rows, e.g.
    bucket padding, do not count) and `s_i = sum_t m_it * x_it`:
    - `token-mean`: `sum_i s_i / N`
    - `token-sum`: `sum_i s_i`
    - `seq-mean-token-sum`: `sum_i s_i / S`
    - `seq-mean-token-mean`: `sum_i (s_i / n_i) / S`, `n_i = sum_t m_it` (0 for empty rows)
    - `seq-mean-token-sum-norm`: `sum_i (s_i / C) / S`, `C` = `loss_scale_factor` (default
      `time`, the padded max response length): Dr.GRPO's constant normaliser. This is current
      verl's meaning (its older `agg_loss` returned `sum_i s_i / C`, without the `/ S`).
    A zero denominator gives 0. verl's newest default `S` counts every local row; we count
    non-empty rows so that padding rows change nothing.

    Args:
      loss_mat: `[batch, time]` per-token loss (any leading axes).
      loss_mask: `[batch, time]`, 0/1.
      loss_agg_mode: one of `LOSS_AGG_MODES` (static).
      global_token_count: N of the whole mini-batch (scalar), for gradient accumulation.
      global_seq_count: S of the whole mini-batch (scalar), for gradient accumulation.
      loss_scale_factor: C for `seq-mean-token-sum-norm` (static or scalar).

    Returns:
      A scalar.

    Raises:
      ValueError: unknown `loss_agg_mode`.

    verl: `core_algos.agg_loss` (its `batch_num_tokens`, `global_batch_size` and `dp_size` are
    our `global_token_count` and `global_seq_count`; no dp_size is needed with global arrays).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"invalid loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    loss_mat = jnp.asarray(loss_mat)
    m = _as_mask(loss_mask, loss_mat)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, m)
    if loss_agg_mode == "token-mean":
        count = jnp.sum(m) if global_token_count is None else global_token_count
        return _safe_div(masked_sum(loss_mat, m), count)
    seq_sums = masked_sum(loss_mat, m, axis=-1)
    seq_tokens = jnp.sum(m, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = _safe_div(seq_sums, seq_tokens)
    else:  # seq-mean-token-sum-norm
        scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        seq_losses = seq_sums / jnp.asarray(scale, loss_mat.dtype)
    count = jnp.sum(seq_tokens > 0) if global_seq_count is None else global_seq_count
    return _safe_div(jnp.sum(seq_losses), count)


def _token_mean(x, mask, global_token_count):
    """A metric's token mean: masked_mean locally, or sum / global count (adds up)."""
    if global_token_count is None:
        return masked_mean(x, mask)
    return _safe_div(masked_sum(x, mask), global_token_count)


def _reweighted(token_losses, rollout_is_weights):
    """`token_losses * rollout_is_weights` (the weights without gradient), or as is if None.

    verl's rollout correction: importance weights `[batch, time]` multiply the per-token
    policy loss before it is aggregated.
    """
    if rollout_is_weights is None:
        return token_losses
    w = jax.lax.stop_gradient(jnp.asarray(rollout_is_weights).astype(token_losses.dtype))
    return token_losses * w


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2,
                        clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                        loss_agg_mode="token-mean", *, global_token_count=None,
                        global_seq_count=None, loss_scale_factor=None,
                        rollout_is_weights=None):
    """PPO clipped surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020).

    `d = clip(logp - old, -20, 20)`, `ratio = exp(d)`;
    `L1 = -A * ratio`, `L2 = -A * clip(ratio, 1 - eps_low, 1 + eps_high)`,
    `clip1 = max(L1, L2)`; `L3 = -A * clip_ratio_c`, `clip2 = min(L3, clip1)`;
    `loss_t = clip2 if A < 0 else clip1` (for A < 0 the loss never exceeds `-A * c`);
    `pg_loss = agg_loss(loss_t * w, mask, loss_agg_mode)` with `w` the rollout-correction
    weights (1 without them).
    Metrics (token means over the mask): `pg_clipfrac = mean(L2 > L1)`,
    `ppo_kl = mean(-d)` (d clipped, as verl), `pg_clipfrac_lower = mean(clip1 > L3 & A < 0)`.

    Args:
      old_log_prob: `[batch, time]` log-probs under the rollout (old) policy.
      log_prob: `[batch, time]` log-probs under the current policy (differentiate this).
      advantages: `[batch, time]`.
      response_mask: `[batch, time]`, 0/1.
      clip_ratio: eps of the PPO clip, the default of both sides.
      clip_ratio_low: eps_low (default `clip_ratio`).
      clip_ratio_high: eps_high (default `clip_ratio`); DAPO's clip-higher uses a larger one.
      clip_ratio_c: dual-clip bound, a static Python number > 1.
      loss_agg_mode: see `agg_loss`.
      global_token_count, global_seq_count, loss_scale_factor: see `agg_loss`; the metrics
        use `global_token_count` too.
      rollout_is_weights: `[batch, time]` rollout-correction weights (no gradient), or None.

    Returns:
      `(pg_loss, metrics)`: the scalar loss and a dict of scalars with keys `pg_clipfrac`,
      `ppo_kl`, `pg_clipfrac_lower` (verl returns the same four values as a tuple).

    Raises:
      ValueError: `clip_ratio_c <= 1`.

    verl: `core_algos.compute_policy_loss_vanilla` (and the deprecated `compute_policy_loss`).
    """
    if not float(clip_ratio_c) > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    eps_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_prob = jnp.asarray(log_prob)
    adv = jnp.asarray(advantages).astype(log_prob.dtype)
    m = _as_mask(response_mask, log_prob)

    negative_approx_kl = jnp.clip(log_prob - jnp.asarray(old_log_prob), -20.0, 20.0)
    ratio = jnp.exp(negative_approx_kl)
    losses1 = -adv * ratio
    losses2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clip1 = jnp.maximum(losses1, losses2)
    losses3 = -adv * clip_ratio_c
    clip2 = jnp.minimum(losses3, clip1)
    token_losses = _reweighted(jnp.where(adv < 0, clip2, clip1), rollout_is_weights)

    pg_loss = agg_loss(token_losses, m, loss_agg_mode, global_token_count=global_token_count,
                       global_seq_count=global_seq_count, loss_scale_factor=loss_scale_factor)
    as_float = lambda b: b.astype(log_prob.dtype)
    metrics = {
        "pg_clipfrac": _token_mean(as_float(losses2 > losses1), m, global_token_count),
        "ppo_kl": _token_mean(-negative_approx_kl, m, global_token_count),
        "pg_clipfrac_lower": _token_mean(
            as_float((clip1 > losses3) & (adv < 0)), m, global_token_count
        ),
    }
    return pg_loss, metrics


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value=0.5,
                       loss_agg_mode="token-mean", *, global_token_count=None,
                       global_seq_count=None, loss_scale_factor=None):
    """Clipped value loss of PPO's critic.

    `vclip = clip(vpred, V_old - c, V_old + c)`;
    `vf_loss = 0.5 * agg_loss(max((vpred - R)^2, (vclip - R)^2), mask, loss_agg_mode)`;
    `vf_clipfrac = mean((vclip - R)^2 > (vpred - R)^2)` over the mask.

    Args:
      vpreds: `[batch, time]` current critic predictions (differentiate these).
      returns: `[batch, time]` targets R.
      values: `[batch, time]` critic values at rollout time (the clipping anchor V_old).
      response_mask: `[batch, time]`, 0/1.
      cliprange_value: c, `critic.cliprange_value`.
      loss_agg_mode: see `agg_loss`.
      global_token_count, global_seq_count, loss_scale_factor: see `agg_loss`;
        `vf_clipfrac` uses `global_token_count` too.

    Returns:
      `(vf_loss, vf_clipfrac)`, two scalars.

    verl: `core_algos.compute_value_loss`.
    """
    vpreds = jnp.asarray(vpreds)
    returns = jnp.asarray(returns).astype(vpreds.dtype)
    values = jnp.asarray(values).astype(vpreds.dtype)
    m = _as_mask(response_mask, vpreds)
    vclip = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    losses1 = jnp.square(vpreds - returns)
    losses2 = jnp.square(vclip - returns)
    vf_loss = 0.5 * agg_loss(
        jnp.maximum(losses1, losses2), m, loss_agg_mode, global_token_count=global_token_count,
        global_seq_count=global_seq_count, loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = _token_mean((losses2 > losses1).astype(vpreds.dtype), m, global_token_count)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(logits, response_mask, loss_agg_mode="token-mean", *,
                         global_token_count=None, global_seq_count=None,
                         loss_scale_factor=None):
    """Aggregated entropy of the policy: `agg_loss(entropy_from_logits(logits), mask)`.

    The actor loss subtracts it: `pg_loss - entropy_coeff * entropy`.

    Args:
      logits: `[batch, time, vocab]`.
      response_mask: `[batch, time]`, 0/1.
      loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor: see `agg_loss`.

    Returns:
      A scalar (nats).

    verl: `core_algos.compute_entropy_loss`.
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count,
                    loss_scale_factor=loss_scale_factor)


compute_policy_loss_vanilla = compute_policy_loss  # verl's registered name for the same loss
