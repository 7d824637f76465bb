"""The policy-loss modes of verl besides vanilla PPO: DPPO (TV, KL), GSPO, SAPO, GPG, GMPO
(`geo_mean`), DRO and CISPO. Clip-Cov and KL-Cov are in `cov_losses`.

verl counterpart: `compute_policy_loss_<mode>` of `verl/trainer/ppo/core_algos.py`, same
formulas and metric names; the settings are explicit arguments instead of verl's config.

Conventions shared by every mode (and by `losses.compute_policy_loss`):
- arrays `[batch, time]`; differentiate through `log_prob`; `d = log_prob - old_log_prob`.
- `rollout_is_weights` (`[batch, time]`, no gradient) multiply the per-token loss before it
  is aggregated (GMPO turns them into one weight per sequence first, as verl).
- the loss is `agg_loss(per-token loss, mask, loss_agg_mode, global counts)` and every metric
  is a token mean over `global_token_count` when given, so the losses and the metrics of
  micro-batches add up to those of one pass over the mini-batch.
- `loss_agg_mode` is honoured by every mode. verl itself pins `seq-mean-token-mean` for GSPO
  and SAPO and takes a plain mean over sequences for GMPO, whatever `loss_agg_mode` says; the
  defaults below are those pinned modes, so leaving `loss_agg_mode` unset gives verl's
  numbers, and `actor.loss_agg_mode=seq-mean-token-mean` does so through the trainer.
- a metric that verl fills with a constant 0 for compatibility is 0 here too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.losses import _reweighted, _token_mean, agg_loss
from rlhf_jax.core_algos.masked import _as_mask, masked_sum

sg = jax.lax.stop_gradient


def _prepare(old_log_prob, log_prob, advantages, response_mask):
    """`(old, logp, adv, m)` as arrays in the dtype of `log_prob`."""
    logp = jnp.asarray(log_prob)
    old = jnp.asarray(old_log_prob).astype(logp.dtype)
    adv = jnp.asarray(advantages).astype(logp.dtype)
    return old, logp, adv, _as_mask(response_mask, logp)


def _eps(clip_ratio, clip_ratio_low, clip_ratio_high):
    """`(eps_low, eps_high)`, each defaulting to `clip_ratio`."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _finish(token_losses, m, loss_agg_mode, counts, rollout_is_weights, metrics):
    """`(agg_loss(token_losses * weights), metrics as token means)`."""
    loss = agg_loss(_reweighted(token_losses, rollout_is_weights), m, loss_agg_mode, **counts)
    n = counts["global_token_count"]
    return loss, {k: _token_mean(v.astype(m.dtype), m, n) for k, v in metrics.items()}


def _counts(global_token_count, global_seq_count, loss_scale_factor):
    return dict(global_token_count=global_token_count, global_seq_count=global_seq_count,
                loss_scale_factor=loss_scale_factor)


def _dppo(old, logp, adv, m, valid, clip_ratio_c, loss_agg_mode, counts, rollout_is_weights):
    """DPPO's masked, truncated policy gradient given the trust-region mask `valid`."""
    d = jnp.clip(logp - old, -20.0, 20.0)
    ratio = jnp.exp(d)
    truncated = sg(jnp.minimum(ratio, clip_ratio_c))
    valid = sg(valid.astype(logp.dtype))
    token_losses = -adv * truncated * logp * valid
    metrics = {"pg_clipfrac": 1.0 - valid, "ppo_kl": -d,
               "pg_clipfrac_lower": (ratio > clip_ratio_c) * valid}
    return _finish(token_losses, m, loss_agg_mode, counts, rollout_is_weights, metrics)


def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask,
                                clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                clip_ratio_c=3.0, loss_agg_mode="token-mean", *,
                                global_token_count=None, global_seq_count=None,
                                loss_scale_factor=None, rollout_is_weights=None):
    """DPPO-Binary-TV (arXiv:2602.04879): a policy gradient inside a total-variation region.

    `p = exp(logp)`, `p_old = exp(old)`; a token is in the region when
    `p - p_old <= eps_high` (A > 0) or `p - p_old >= -eps_low` (A <= 0); the eps here bound
    a probability difference, not a ratio. With `ratio = exp(clip(d, -20, 20))`:
    `loss_t = -A * sg(min(ratio, clip_ratio_c)) * logp * sg(in region)`.
    Metrics: `pg_clipfrac` = mean(outside the region), `ppo_kl` = mean(-d),
    `pg_clipfrac_lower` = mean(ratio > clip_ratio_c & in region).

    `clip_ratio_c` is the truncation of the importance ratio; verl reads it with a fallback
    of 20, which never applies since its actor config always holds `clip_ratio_c` (3.0).

    verl: `core_algos.compute_policy_loss_dppo_tv`.

    Args:
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      log_prob: `[batch, time]` log-probs of the current policy (differentiate through these).
      advantages: `[batch, time]` advantages.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      clip_ratio: the bound of the probability difference, the default of both sides.
      clip_ratio_low: eps_low (None: `clip_ratio`).
      clip_ratio_high: eps_high (None: `clip_ratio`).
      clip_ratio_c: the truncation of the ratio in the gradient.
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
    """
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _eps(clip_ratio, clip_ratio_low, clip_ratio_high)
    diff = jnp.exp(logp) - jnp.exp(old)
    valid = jnp.where(adv > 0, diff <= high, diff >= -low)
    return _dppo(old, logp, adv, m, valid, clip_ratio_c, loss_agg_mode,
                 _counts(global_token_count, global_seq_count, loss_scale_factor),
                 rollout_is_weights)


def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask,
                                clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                clip_ratio_c=3.0, loss_agg_mode="token-mean", *,
                                global_token_count=None, global_seq_count=None,
                                loss_scale_factor=None, rollout_is_weights=None):
    """DPPO-Binary-KL (arXiv:2602.04879): as `dppo_tv` with a binary-KL trust region.

    `bkl = p_old * (old - logp) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8))`;
    in the region: `bkl <= eps_high or p <= p_old` (A > 0), `bkl <= eps_low or p >= p_old`
    (A <= 0). Loss and metrics as `compute_policy_loss_dppo_tv`.

    verl: `core_algos.compute_policy_loss_dppo_kl`.

    Args:
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      log_prob: `[batch, time]` log-probs of the current policy (differentiate through these).
      advantages: `[batch, time]` advantages.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      clip_ratio: the bound of the KL divergence, the default of both sides.
      clip_ratio_low: eps_low (None: `clip_ratio`).
      clip_ratio_high: eps_high (None: `clip_ratio`).
      clip_ratio_c: the truncation of the ratio in the gradient.
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
    """
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _eps(clip_ratio, clip_ratio_low, clip_ratio_high)
    p, p_old = jnp.exp(logp), jnp.exp(old)
    bkl = p_old * (old - logp) + (1 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = jnp.where(adv > 0, (bkl <= high) | (p <= p_old), (bkl <= low) | (p >= p_old))
    return _dppo(old, logp, adv, m, valid, clip_ratio_c, loss_agg_mode,
                 _counts(global_token_count, global_seq_count, loss_scale_factor),
                 rollout_is_weights)


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                             clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                             loss_agg_mode="seq-mean-token-mean", *, global_token_count=None,
                             global_seq_count=None, loss_scale_factor=None,
                             rollout_is_weights=None):
    """GSPO (arXiv:2507.18071): PPO clipping of a sequence-level importance ratio.

    `s_i = exp(sum_t m d / max(n_i, 1))` (the geometric mean of the token ratios of row i);
    per token `s_it = exp(min(logp - sg(logp) + sg(log s_i), 10))`, whose value is `s_i` and
    whose gradient is that of `logp`. `L1 = -A * s_it`,
    `L2 = -A * clip(s_it, 1 - eps_low, 1 + eps_high)`, `loss_t = max(L1, L2)`.
    Metrics: `pg_clipfrac` = mean(L2 > L1), `ppo_kl` = mean(-d), `pg_clipfrac_lower` = 0.
    The log-ratios are not clamped to [-20, 20] (as verl). Rows are independent, so a
    micro-batch of rows gets the same ratios as the whole batch.

    verl: `core_algos.compute_policy_loss_gspo` (which always aggregates with
    `seq-mean-token-mean`, the default here).

    Args:
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
    """
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _eps(clip_ratio, clip_ratio_low, clip_ratio_high)
    d = logp - old
    seq_d = masked_sum(d, m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1)
    log_s = jnp.minimum(logp - sg(logp) + sg(seq_d)[:, None], 10.0)
    s = jnp.exp(log_s)
    losses1 = -adv * s
    losses2 = -adv * jnp.clip(s, 1 - low, 1 + high)
    metrics = {"pg_clipfrac": losses2 > losses1, "ppo_kl": -d,
               "pg_clipfrac_lower": jnp.zeros_like(d)}
    return _finish(jnp.maximum(losses1, losses2), m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, metrics)


def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos=1.0,
                             tau_neg=1.05, loss_agg_mode="seq-mean-token-mean", *,
                             global_token_count=None, global_seq_count=None,
                             loss_scale_factor=None, rollout_is_weights=None):
    """SAPO (arXiv:2511.20347): a smooth sigmoid gate on the token ratio instead of a clip.

    `ratio = exp(clip(d, -20, 20))`, `tau = tau_pos if A > 0 else tau_neg`,
    `gate = sigmoid(tau * (ratio - 1)) * 4 / tau`, `loss_t = -gate * A`.
    Metrics: `ppo_kl` = mean(-d); `pg_clipfrac` and `pg_clipfrac_lower` are 0 (as verl).

    verl: `core_algos.compute_policy_loss_sapo` (`actor.tau_pos`, `actor.tau_neg`; it always
    aggregates with `seq-mean-token-mean`, the default here).

    Args:
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      log_prob: `[batch, time]` log-probs of the current policy (differentiate through these).
      advantages: `[batch, time]` advantages.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      tau_pos: the gate temperature for A > 0.
      tau_neg: the gate temperature for A <= 0.
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
    """
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    d = jnp.clip(logp - old, -20.0, 20.0)
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, logp.dtype), jnp.asarray(tau_neg, logp.dtype))
    gate = jax.nn.sigmoid(tau * (jnp.exp(d) - 1.0)) * (4.0 / tau)
    zero = jnp.zeros_like(d)
    metrics = {"pg_clipfrac": zero, "ppo_kl": -d, "pg_clipfrac_lower": zero}
    return _finish(-gate * adv, m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, metrics)


def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask,
                            loss_agg_mode="token-mean", *, global_token_count=None,
                            global_seq_count=None, loss_scale_factor=None,
                            rollout_is_weights=None):
    """GPG (arXiv:2504.02546): the plain policy gradient `loss_t = -logp * A`, no ratio.

    `old_log_prob` is unused. No metrics (verl reports none).

    verl: `core_algos.compute_policy_loss_gpg`.

    Args:
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
    """
    _, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    return _finish(-logp * adv, m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, {})


def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask,
                                 clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                 loss_agg_mode="seq-mean-token-mean", *,
                                 global_token_count=None, global_seq_count=None,
                                 loss_scale_factor=None, rollout_is_weights=None):
    """GMPO (arXiv:2507.20673): PPO on the geometric mean of the token ratios of a sequence.

    Token-level clip in log space: `d_c = clip(d, -eps_low, eps_high)`,
    `d_min = sgn(A) * min(sgn(A) * d, sgn(A) * d_c)`; per row i with `n_i` tokens:
    `r_i = exp(sum_t m d_min / (n_i + 1e-8))`, `A_i = sum_t m A / (n_i + 1e-8)` (sequence-
    level advantages), `L_i = -A_i * r_i`, times the geometric mean of the row's rollout
    weights `exp(sum_t m log(w + 1e-10) / (n_i + 1e-8))` when given. `L_i` is put on every
    token of row i and aggregated with `loss_agg_mode`: `seq-mean-token-mean` (the default)
    is the mean of `L_i` over the non-empty rows, verl's number (verl averages over every row
    and ignores `loss_agg_mode`). The log-ratios are not clamped (as verl).
    Metrics: `ppo_kl` = mean(-d), `pg_clipfrac` = mean(d != d_c & A > 0),
    `pg_clipfrac_lower` = mean(d != d_c & A < 0).

    verl: `core_algos.compute_policy_loss_geo_mean`.

    Args:
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
    """
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _eps(clip_ratio, clip_ratio_low, clip_ratio_high)
    d = logp - old
    d_clip = jnp.clip(d, -low, high)
    sign = jnp.sign(adv)
    d_min = sign * jnp.minimum(sign * d, sign * d_clip)
    n = jnp.sum(m, axis=-1) + 1e-8
    ratio = jnp.exp(masked_sum(d_min, m, axis=-1) / n)
    seq_losses = -(masked_sum(adv, m, axis=-1) / n) * ratio
    if rollout_is_weights is not None:
        w = sg(jnp.asarray(rollout_is_weights).astype(logp.dtype))
        seq_losses = seq_losses * jnp.exp(masked_sum(jnp.log(w + 1e-10), m, axis=-1) / n)
    clipped = d != d_clip
    metrics = {"pg_clipfrac": clipped & (adv > 0), "ppo_kl": -d,
               "pg_clipfrac_lower": clipped & (adv < 0)}
    return _finish(jnp.broadcast_to(seq_losses[:, None], d.shape), m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor), None,
                   metrics)


def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask, dro_beta,
                            loss_agg_mode="token-mean", *, global_token_count=None,
                            global_seq_count=None, loss_scale_factor=None,
                            rollout_is_weights=None):
    """Direct Reward Optimization: a policy gradient with a quadratic log-ratio penalty.

    `loss_t = -(logp * A - dro_beta / 2 * d^2)`. Metric: `ppo_kl` = mean(-d).

    Raises:
      ValueError: `dro_beta` is None or not positive.

    verl: `core_algos.compute_policy_loss_dro` (`policy_loss.dro_beta`).

    Args:
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      log_prob: `[batch, time]` log-probs of the current policy (differentiate through these).
      advantages: `[batch, time]` advantages.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      dro_beta: the weight of the quadratic penalty (> 0).
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
    """
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"dro_beta must be a positive number for the dro loss, got {dro_beta}")
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    d = logp - old
    token_losses = -(logp * adv - 0.5 * dro_beta * jnp.square(d))
    return _finish(token_losses, m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, {"ppo_kl": -d})


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask,
                              clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                              loss_agg_mode="token-mean", *, global_token_count=None,
                              global_seq_count=None, loss_scale_factor=None,
                              rollout_is_weights=None):
    """CISPO (arXiv:2506.13585): a policy gradient weighted by the clipped ratio, no gradient
    through the weight.

    `ratio = exp(clip(d, -20, 20))`, `c = clip(ratio, 1 - eps_low, 1 + eps_high)`,
    `loss_t = -sg(c) * A * logp`. Metrics: `pg_clipfrac` = mean(ratio != c),
    `ppo_kl` = mean(-d), `pg_clipfrac_lower` = 0.

    verl: `core_algos.compute_policy_loss_cispo`.

    Args:
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
    """
    old, logp, adv, m = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _eps(clip_ratio, clip_ratio_low, clip_ratio_high)
    d = jnp.clip(logp - old, -20.0, 20.0)
    ratio = jnp.exp(d)
    clipped = jnp.clip(ratio, 1 - low, 1 + high)
    metrics = {"pg_clipfrac": ratio != clipped, "ppo_kl": -d,
               "pg_clipfrac_lower": jnp.zeros_like(d)}
    return _finish(-sg(clipped) * adv * logp, m, loss_agg_mode,
                   _counts(global_token_count, global_seq_count, loss_scale_factor),
                   rollout_is_weights, metrics)
