"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617): PPO variants that single out the
tokens whose advantage and log-prob covary most, the ones that drive entropy collapse.

verl counterpart: `compute_policy_loss_clip_cov`, `compute_policy_loss_kl_cov` of
`verl/trainer/ppo/core_algos.py`.

Micro-batch semantics (as verl). Both modes choose tokens from statistics of the arrays they
are given: the means of the advantages and log-probs, the number of valid tokens `n`, and
from it the number of tokens to choose. verl computes these per micro-batch (per call of the
loss), and so does this code: the losses of k micro-batches are each exact given their
global denominators, but their sum is not the one-pass loss of the mini-batch unless every
micro-batch chooses the tokens that the whole batch would. Only the aggregation (the global
token / sequence counts) and the metrics add up across micro-batches.

Choosing "the top-k" under jit: the number k is a traced value (it depends on the mask), so
the tokens are ranked with one sort and the ones of rank < k are chosen; no shape depends on k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.groups import _replicated
from rlhf_jax.core_algos.masked import masked_mean
from rlhf_jax.core_algos.policy_losses import _counts, _eps, _finish, _prepare

sg = jax.lax.stop_gradient


def _rank(keys):
    """Rank of every element of `keys` (any shape) in ascending order, ties by position.

    The sort spans the whole batch, so a batch sharded over an explicit mesh axis is
    gathered first (a sort cannot run over a sharded dimension)."""
    flat = _replicated(keys).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return jnp.zeros(flat.shape, jnp.int32).at[order].set(
        jnp.arange(flat.size, dtype=jnp.int32)).reshape(keys.shape)


def _fraction_count(ratio, n):
    """`max(floor(ratio * n), 1)` as int32 (float32 product, as a scalar array)."""
    k = jnp.floor(jnp.asarray(ratio, jnp.float32) * n.astype(jnp.float32)).astype(jnp.int32)
    return jnp.maximum(k, 1)


def _covariance(adv, logp, valid):
    """`(A - mean A) * (logp - mean logp)`, the means over the `valid` tokens, no gradient."""
    w = valid.astype(adv.dtype)
    logp = sg(logp)
    return sg((adv - masked_mean(adv, w)) * (logp - masked_mean(logp, w)))


def _data_key(old_log_prob, m):
    """A PRNG key from the bits of `sum(m * old_log_prob)`: differs across batches and steps,
    the same for the same inputs (the loss stays a function of its arrays)."""
    total = jnp.sum(jnp.where(m != 0, old_log_prob * m, 0)).astype(jnp.float32)
    return jax.random.key(jax.lax.bitcast_convert_type(total, jnp.uint32))


def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask,
                                 clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                 clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
                                 loss_agg_mode="token-mean", *, global_token_count=None,
                                 global_seq_count=None, loss_scale_factor=None,
                                 rollout_is_weights=None, rng=None):
    """Clip-Cov: PPO clip, plus no gradient for a random few high-covariance tokens.

    `ratio = exp(d)` (d not clamped), `L1 = -A * ratio`,
    `L2 = -A * clip(ratio, 1 - eps_low, 1 + eps_high)`. Candidates: valid tokens that PPO did
    not clip (`L2 <= L1`) with `clip_cov_lb < cov < clip_cov_ub`, where
    `cov = (A - mean A) * (logp - mean logp)` over the valid tokens of this call. Of them,
    `min(max(floor(clip_cov_ratio * n), 1), #candidates)` chosen uniformly at random get
    `loss_t = 0`; the others `loss_t = max(L1, L2)`. No dual clip.
    Metrics: `pg_clipfrac` = mean(chosen), `ppo_kl` = mean(-d).

    Randomness: verl draws `torch.randperm` from torch's global generator. Here the draw is
    keyed by `rng` when given, and otherwise by the bits of `sum(m * old_log_prob)`, so the
    loss is a deterministic function of its inputs that changes from batch to batch.

    Args:
      clip_cov_ratio: fraction of the valid tokens to exempt (> 0).
      clip_cov_lb, clip_cov_ub: the open band of covariances that may be chosen.
      rng: optional `jax.random` key.
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      log_prob: `[batch, time]` log-probs of the current policy (differentiate through these).
      advantages: `[batch, time]` advantages.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      clip_ratio: eps of the clip, the default of both sides.
      clip_ratio_low: eps_low (None: `clip_ratio`).
      clip_ratio_high: eps_high (None: `clip_ratio`).
      loss_agg_mode: one of `LOSS_AGG_MODES`: how `agg_loss` reduces the per-token loss.
      global_token_count: the mini-batch's loss-token count (`agg_loss_denominators`), so
        micro-batches add up to one pass; None: this batch's.
      global_seq_count: the mini-batch's sequence count, likewise; None: this batch's.
      loss_scale_factor: the divisor of `seq-mean-token-sum-norm` (None: `time`).
      rollout_is_weights: `[batch, time]` rollout-correction IS weights (no gradient), or None.

    Returns:
      `(loss, metrics)`: the scalar loss and a dict of scalar metrics (verl's names without
      the `actor/` prefix: `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`, ...), token means
      over `global_token_count` when given.

    verl: `core_algos.compute_policy_loss_clip_cov` (per micro-batch, see the module doc).
    """
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _eps(clip_ratio, clip_ratio_low, clip_ratio_high)
    d = logp - old
    ratio = jnp.exp(d)
    losses1 = -adv * ratio
    losses2 = -adv * jnp.clip(ratio, 1 - low, 1 + high)
    valid = m > 0
    cov = _covariance(adv, logp, valid)
    candidate = valid & ~(losses2 > losses1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = _fraction_count(clip_cov_ratio, jnp.sum(m))
    key = _data_key(old, m) if rng is None else rng
    draw = jnp.where(candidate, jax.random.uniform(key, d.shape), 2.0)  # others rank last
    chosen = candidate & (_rank(draw) < k)
    token_losses = jnp.where(chosen, 0.0, jnp.maximum(losses1, losses2))
    return _finish(token_losses, m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, {"pg_clipfrac": chosen, "ppo_kl": -d})


def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask,
                               kl_cov_ratio=0.0002, ppo_kl_coef=0.1,
                               loss_agg_mode="token-mean", *, global_token_count=None,
                               global_seq_count=None, loss_scale_factor=None,
                               rollout_is_weights=None):
    """KL-Cov: the unclipped surrogate, plus a |log-ratio| penalty on the top-covariance tokens.

    `ratio = exp(d)` (not clamped), `loss_t = -A * ratio`, and on the
    `max(floor(kl_cov_ratio * n), 1)` valid tokens of largest
    `cov = (A - mean A) * (logp - mean logp)` (means over the valid tokens of this call; ties
    go to the earlier position) `loss_t = -A * ratio + ppo_kl_coef * |d|`. No clipping.
    Metric: `ppo_kl` = mean(|d|) (verl reports the absolute log-ratio here).
    `|d|` has gradient `sign(d)`, 0 at d = 0, as torch's `abs`.

    Args:
      kl_cov_ratio: fraction of the valid tokens to penalise (> 0).
      ppo_kl_coef: weight of the penalty (verl's default 0.1).
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      log_prob: `[batch, time]` log-probs of the current policy (differentiate through these).
      advantages: `[batch, time]` advantages.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      loss_agg_mode: one of `LOSS_AGG_MODES`: how `agg_loss` reduces the per-token loss.
      global_token_count: the mini-batch's loss-token count (`agg_loss_denominators`), so
        micro-batches add up to one pass; None: this batch's.
      global_seq_count: the mini-batch's sequence count, likewise; None: this batch's.
      loss_scale_factor: the divisor of `seq-mean-token-sum-norm` (None: `time`).
      rollout_is_weights: `[batch, time]` rollout-correction IS weights (no gradient), or None.

    Returns:
      `(loss, metrics)`: the scalar loss and a dict of scalar metrics (verl's names without
      the `actor/` prefix: `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`, ...), token means
      over `global_token_count` when given.

    verl: `core_algos.compute_policy_loss_kl_cov` (per micro-batch, see the module doc).
    """
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    d = logp - old
    abs_d = d * jnp.sign(d)
    losses1 = -adv * jnp.exp(d)
    valid = m > 0
    cov = _covariance(adv, logp, valid)
    k = _fraction_count(kl_cov_ratio, jnp.sum(valid))
    chosen = valid & (_rank(jnp.where(valid, -cov, jnp.inf)) < k)
    token_losses = jnp.where(chosen, losses1 + ppo_kl_coef * abs_d, losses1)
    return _finish(token_losses, m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, {"ppo_kl": abs_d})
