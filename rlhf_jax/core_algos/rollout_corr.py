"""Rollout correction: importance weights, rejection masks and off-policy diagnostics for
the gap between the policy that sampled (`rollout_log_prob`, the engine's) and the policy
being trained (`old_log_prob`, recomputed by the trainer; or the current one in bypass mode).

verl counterpart: `verl/trainer/ppo/rollout_corr_helper.py`, with its function names,
arguments and metric names (the bypass-mode losses are in `rollout_corr_loss`). verl
returns Python floats; here every metric is a scalar array and every mode string and
threshold is static (pass them by keyword under `jax.jit(..., static_argnames=...)`), so the
functions are jit-able.

Shapes: `[batch, time]` over response tokens, `response_mask` 0/1. `log_ratio = log pi_train
- log pi_rollout`; exponentials are taken of it clipped to `+-SAFETY_BOUND`. A row with no
valid token (batch padding) takes part in no statistic: where verl averages over the rows of
its batch (which has no such rows), the averages here are over the rows with a valid token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.masked import masked_mean, masked_sum
from rlhf_jax.core_algos.rollout_corr_spec import (
    RolloutCorrection,
    RSOption,
    parse_rollout_is_threshold,
    parse_rollout_rs,
)

SAFETY_BOUND = 20.0  # exp(+-20): the largest / smallest ratio an exponential may give
PREFIX = "rollout_corr/"


# ------------------------------------------------------------------------- row statistics


def _rows(mask):
    """`[batch]` 1.0 on the rows with at least one valid token."""
    return (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


def _row_mean(x, rows):
    return jnp.sum(x * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def _row_max(x, rows):
    """Max over the valid rows (0 when there is none, as verl's empty case)."""
    return jnp.where(jnp.any(rows > 0), jnp.max(jnp.where(rows > 0, x, -jnp.inf)), 0.0)


def _row_min(x, rows):
    return -_row_max(-x, rows)


def _row_std(x, rows):
    """Unbiased std over the valid rows (torch's `.std()`); 0 for fewer than two rows."""
    n = jnp.sum(rows)
    mean = _row_mean(x, rows)
    var = jnp.sum(jnp.square(x - mean) * rows) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n > 1, jnp.sqrt(var), 0.0)


def _token_max(x, mask):
    """Max over the valid tokens (-inf when there is none, as torch's masked max)."""
    return jnp.max(jnp.where(mask > 0, x, -jnp.inf))


def _token_min(x, mask):
    return jnp.min(jnp.where(mask > 0, x, jnp.inf))


def _clamped_std(x, mask, low, high):
    """verl's bounded spread: std over the valid tokens of `clip(x, low, high)` (0 for fewer
    than two tokens)."""
    c = jnp.clip(x, low, high)
    mean = masked_mean(c, mask)
    var = masked_mean(jnp.square(c), mask) - jnp.square(mean)
    return jnp.where(jnp.sum(mask) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _real(x):
    """`x` in at least float32 (float64 stays float64)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _float(mask, like):
    return jnp.asarray(mask).astype(jnp.asarray(like).dtype)


# ------------------------------------------------------------------- importance weights


def _is_weights(log_ratio, mask, level: str, upper: float, lower: float | None,
                batch_normalize: bool):
    """`compute_rollout_correction_weights` on parsed thresholds."""
    log_ratio = _real(log_ratio)
    m = _float(mask, log_ratio)
    rows = _rows(m)
    if level == "token":
        log_ratio_for_metrics = log_ratio
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * m
    elif level == "sequence":
        log_ratio_for_metrics = masked_sum(log_ratio, m, axis=-1)  # [batch]
        raw = jnp.exp(jnp.clip(log_ratio_for_metrics, -SAFETY_BOUND, SAFETY_BOUND))[:, None] * m
    else:
        raise ValueError(f"rollout_is must be token or sequence, got {level!r}")
    if lower is None:  # TIS: truncated from above
        weights = jnp.minimum(raw, upper)
    else:  # IcePop: weights outside [lower, upper] are dropped (the mask is left as is)
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    weights = jax.lax.stop_gradient(weights)  # they change the measure, not the objective

    low_bound = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": masked_mean(weights, m)}
    if level == "sequence":  # unclamped extremes, from the log-space sums
        metrics["rollout_is_max"] = jnp.exp(jnp.minimum(
            _row_max(log_ratio_for_metrics, rows), SAFETY_BOUND))
        metrics["rollout_is_min"] = jnp.exp(_row_min(log_ratio_for_metrics, rows))
        metrics["rollout_is_ratio_fraction_high"] = _row_mean(
            (log_ratio_for_metrics > math.log(upper)).astype(raw.dtype), rows)
        metrics["rollout_is_ratio_fraction_low"] = _row_mean(
            (log_ratio_for_metrics < math.log(low_bound)).astype(raw.dtype), rows)
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw > upper).astype(raw.dtype), m)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean(
            (raw < low_bound).astype(raw.dtype), m)
        metrics["rollout_is_max"] = _token_max(weights, m)
        metrics["rollout_is_min"] = _token_min(weights, m)
    metrics["rollout_is_std"] = _clamped_std(weights, m, 0.0, upper)
    w = jnp.clip(weights, 0.0, upper)
    normalized = w / (masked_mean(w, m) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(jnp.square(normalized), m)
    seq_w = masked_mean(weights, m, axis=-1)
    raw_seq_w = masked_mean(raw, m, axis=-1)
    metrics.update({
        "rollout_is_seq_mean": _row_mean(seq_w, rows),
        "rollout_is_seq_std": _row_std(seq_w, rows),
        "rollout_is_seq_max": _row_max(seq_w, rows),
        "rollout_is_seq_min": _row_min(seq_w, rows),
        "rollout_is_seq_max_deviation": _row_max(jnp.abs(seq_w - 1.0), rows),
        # From the raw means: a mean of clamped weights never exceeds the bound.
        "rollout_is_seq_fraction_high": _row_mean((raw_seq_w > upper).astype(raw.dtype), rows),
        "rollout_is_seq_fraction_low": _row_mean((raw_seq_w < low_bound).astype(raw.dtype),
                                                 rows),
    })
    if lower is not None:
        out_of_bounds = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(out_of_bounds.astype(raw.dtype), m)

    if batch_normalize:  # mean 1 over the tokens (token) or over the sequences (sequence)
        if level == "token":
            mean = masked_mean(weights, m)
        else:
            mean = jnp.sum(seq_w * rows) / jnp.maximum(jnp.sum(rows), 1e-8)
        ok = mean > 1e-8
        weights = jnp.where(ok, weights / jnp.where(ok, mean, 1.0), weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return weights, metrics


def compute_rollout_correction_weights(log_ratio, response_mask, rollout_is="token",
                                       rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=False):
    """Importance weights `pi_train / pi_rollout` of each token, truncated (TIS) or cut
    (IcePop), without gradient.

    - `token`: `w_t = exp(clip(log_ratio_t, -20, 20))`.
    - `sequence`: every token of row i gets `exp(clip(sum_t m_t log_ratio_t, -20, 20))`.
    Then, with `rollout_is_threshold` a number U: `w = min(w, U)` (TIS); a `"L_U"` string:
    `w = w if L <= w <= U else 0` (IcePop). Padding gets 0. With
    `rollout_is_batch_normalize` the weights are divided by their mean (over valid tokens for
    `token`, over sequences for `sequence`) when that mean is > 1e-8.

    Args:
      log_ratio: `[batch, time]` `log pi_train - log pi_rollout`.
      response_mask: `[batch, time]`, 0/1.
      rollout_is: "token" or "sequence" (static).
      rollout_is_threshold: a number or a `"lower_upper"` string (static).
      rollout_is_batch_normalize: static bool.

    Returns:
      `(weights [batch, time], metrics)`; metrics (before the batch normalisation):
      `rollout_is_{mean,max,min,std,eff_sample_size}`, `rollout_is_ratio_fraction_{high,low}`,
      `rollout_is_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}`, plus
      `rollout_is_oob_ratio` (IcePop) and `rollout_is_batch_norm_factor` (normalised).

    verl: `rollout_corr_helper.compute_rollout_correction_weights` / `compute_is_metrics`.
    """
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    return _is_weights(log_ratio, response_mask, rollout_is, upper, lower,
                       bool(rollout_is_batch_normalize))


# ------------------------------------------------------------------- rejection sampling


def _divergences(log_ratio):
    """Per-token k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (log r clipped)."""
    lr = jnp.clip(_real(log_ratio), -SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * jnp.square(lr), "k3": jnp.exp(lr) - 1.0 - lr}


def _sequence_stat(token_stat, m, reduce: str):
    if reduce == "sum":
        return masked_sum(token_stat, m, axis=-1)
    if reduce == "mean":
        return masked_mean(token_stat, m, axis=-1)
    peak = jnp.max(jnp.where(m > 0, token_stat, -jnp.inf), axis=-1)  # max
    return jnp.where(jnp.isneginf(peak), 0.0, peak)


def _inside(stat, opt: RSOption):
    """Whether `stat` passes `opt`: k2 / k3 `stat <= upper`; k1 (`-log r`) within the log
    bounds, verl's convention."""
    if opt.estimator == "k1":
        return (stat >= math.log(opt.lower)) & (stat <= math.log(opt.upper))
    return stat <= opt.upper


def _rs_option_metrics(opt: RSOption, stat, seq_values, keep, m, rows):
    """verl's `compute_rs_metrics` (and the masked fractions) of one option.

    `stat` is the per-token statistic (a sequence option's value on each of its tokens),
    `seq_values` the per-sequence one, `keep` the option's `[batch, time]` 0/1 pass mask.
    The bounds the metrics compare with are log-ratios for k1 (`log lower`, `log upper`)."""
    k1 = opt.estimator == "k1"
    high = math.log(opt.upper) if k1 else opt.upper
    low = math.log(opt.lower) if k1 else 0.0
    p = f"rollout_rs_{opt.name}"
    above = lambda x: (x > high).astype(m.dtype)
    below = lambda x: (x < low).astype(m.dtype)
    zero = jnp.zeros((), m.dtype)
    out = {f"{p}_mean": masked_mean(stat, m)}
    if opt.level == "sequence":
        out[f"{p}_max"] = _row_max(seq_values, rows)
        out[f"{p}_min"] = _row_min(seq_values, rows)
        out[f"{p}_fraction_high"] = _row_mean(above(seq_values), rows)
        out[f"{p}_fraction_low"] = _row_mean(below(seq_values), rows) if k1 else zero
    else:
        out[f"{p}_max"] = _token_max(stat, m)
        out[f"{p}_min"] = _token_min(stat, m)
        out[f"{p}_fraction_high"] = masked_mean(above(stat), m)
        out[f"{p}_fraction_low"] = masked_mean(below(stat), m) if k1 else zero
    out[f"{p}_std"] = _clamped_std(stat, m, low, high)
    out.update({
        f"{p}_seq_mean": _row_mean(seq_values, rows),
        f"{p}_seq_std": _row_std(seq_values, rows),
        f"{p}_seq_max": _row_max(seq_values, rows),
        f"{p}_seq_min": _row_min(seq_values, rows),
        f"{p}_seq_max_deviation": _row_max(jnp.abs(seq_values), rows),
        f"{p}_seq_fraction_high": _row_mean(above(seq_values), rows),
    })
    if k1:
        out[f"{p}_seq_fraction_low"] = _row_mean(below(seq_values), rows)
    out[f"{p}_masked_fraction"] = masked_mean(1.0 - keep, m)
    rejected_row = jnp.any((keep < 0.5) & (m > 0), axis=-1).astype(m.dtype)
    out[f"{p}_seq_masked_fraction"] = _row_mean(rejected_row, rows)
    return out


def _rejection(log_ratio, mask, options: tuple[RSOption, ...]):
    """`compute_rollout_rejection_mask` on parsed options."""
    log_ratio = _real(log_ratio)
    m = _float(mask, log_ratio)
    rows = _rows(m)
    div = _divergences(log_ratio)
    combined = jnp.ones_like(m)
    metrics = {}
    for opt in options:
        token_stat = div[opt.estimator]
        if opt.level == "token":
            stat = token_stat
            seq_values = masked_mean(token_stat, m, axis=-1)
            keep = _inside(token_stat, opt).astype(m.dtype)
        else:
            seq_values = _sequence_stat(token_stat, m, opt.reduce)
            stat = jnp.broadcast_to(seq_values[:, None], m.shape)
            keep = jnp.broadcast_to(_inside(seq_values, opt)[:, None], m.shape)
            keep = keep.astype(m.dtype)
        combined = combined * keep
        metrics.update(_rs_option_metrics(opt, stat, seq_values, keep, m, rows))
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - combined, m)
    rejected_row = jnp.any((combined < 0.5) & (m > 0), axis=-1).astype(m.dtype)
    metrics["rollout_rs_seq_masked_fraction"] = _row_mean(rejected_row, rows)
    return m * combined, metrics


def compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs="token_k1",
                                   rollout_rs_threshold=None):
    """A hard trust region: tokens / sequences whose divergence between the training and
    the rollout policy is out of bounds leave the mask.

    Per token, with `lr = clip(log_ratio, -20, 20)`: `k1 = -lr`, `k2 = lr^2 / 2`,
    `k3 = exp(lr) - 1 - lr`. `token_kX` tests each token; `seq_sum_kX` / `seq_mean_kX` /
    `seq_max_kX` test the masked sum / mean / max over the row, and keep or drop the row
    whole. k2 and k3 keep `stat <= upper`; k1 keeps `log(lower) <= stat <= log(upper)`
    (verl compares `-log r` with the log bounds, so the kept ratios are `[1/upper, 1/lower]`,
    which is `[lower, upper]` for the symmetric default `lower = 1/upper`). Several
    comma-separated options must all pass.

    Args:
      log_ratio: `[batch, time]` `log pi_train - log pi_rollout`.
      response_mask: `[batch, time]`, 0/1.
      rollout_rs: comma-separated options (static), see `ROLLOUT_RS_OPTIONS`.
      rollout_rs_threshold: per-option thresholds (static), see `rollout_corr_spec`.

    Returns:
      `(mask [batch, time] = response_mask * kept, metrics)`; per option
      `rollout_rs_<opt>_{mean,max,min,std,fraction_high,fraction_low,masked_fraction,
      seq_masked_fraction,seq_mean,seq_std,seq_max,seq_min,seq_max_deviation,
      seq_fraction_high}` (and `_seq_fraction_low` for k1), plus
      `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction` of all together.

    verl: `rollout_corr_helper.compute_rollout_rejection_mask` / `compute_rs_metrics`.
    """
    return _rejection(log_ratio, response_mask, parse_rollout_rs(rollout_rs,
                                                                 rollout_rs_threshold))


# ---------------------------------------------------------------------------- diagnostics


def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """How far the training policy is from the rollout policy on the sampled tokens.

    With `lp_s = masked mean of a row's log-probs` and `lr = old - rollout`:
    `training_ppl = mean_s exp(-lp_s(old))`, `training_log_ppl = mean_s -lp_s(old)` (and
    `rollout_*` alike); `kl = mean_t(rollout - old)` (k1 of KL(rollout || train)),
    `k3_kl = mean_t(exp(lr) - lr - 1)`; `log_ppl_diff = lp_s(rollout) - lp_s(old)` as
    `log_ppl_diff` (mean), `log_ppl_abs_diff`, `log_ppl_diff_max`, `log_ppl_diff_min`,
    `ppl_ratio = mean_s exp(log_ppl_diff)`; `chi2_token = mean_t rho^2 - 1` and
    `chi2_seq = mean_s (prod_t rho_t)^2 - 1` with `rho = exp(clip(lr, -20, 20))` (the
    sequence's log sum clipped likewise).

    Args:
      old_log_prob, rollout_log_prob, response_mask: `[batch, time]`.

    Returns:
      The metrics above (without the `rollout_corr/` prefix), scalars.

    verl: `rollout_corr_helper.compute_offpolicy_metrics`.
    """
    old, rollout = _real(old_log_prob), _real(rollout_log_prob)
    m = _float(response_mask, old)
    rows = _rows(m)
    lp_train = masked_mean(old, m, axis=-1)
    lp_rollout = masked_mean(rollout, m, axis=-1)
    log_ratio = old - rollout
    diff = lp_rollout - lp_train
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = jnp.clip(masked_sum(log_ratio, m, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": _row_mean(jnp.exp(-lp_train), rows),
        "training_log_ppl": _row_mean(-lp_train, rows),
        "kl": masked_mean(rollout - old, m),
        "k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, m),
        "rollout_ppl": _row_mean(jnp.exp(-lp_rollout), rows),
        "rollout_log_ppl": _row_mean(-lp_rollout, rows),
        "log_ppl_diff": _row_mean(diff, rows),
        "log_ppl_abs_diff": _row_mean(jnp.abs(diff), rows),
        "log_ppl_diff_max": _row_max(diff, rows),
        "log_ppl_diff_min": _row_min(diff, rows),
        "ppl_ratio": _row_mean(jnp.exp(diff), rows),
        "chi2_token": masked_mean(jnp.square(rho), m) - 1.0,
        "chi2_seq": _row_mean(jnp.exp(2.0 * seq_log_ratio), rows) - 1.0,
    }


# ------------------------------------------------------------------------------- together


def apply_rollout_correction(old_log_prob, rollout_log_prob, response_mask,
                             correction: RolloutCorrection):
    """IS weights, rejection and diagnostics of a parsed `RolloutCorrection` (static).

    Args:
      old_log_prob: `[batch, time]` log-probs of the sampling (old) policy; no gradient.
      rollout_log_prob: `[batch, time]` log-probs the rollout engine sampled with.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      correction: a parsed `RolloutCorrection` (hashable: static under jit).

    Returns:
      `(weights [batch, time] or None when correction.rollout_is is None,
      mask [batch, time] (the response mask less the rejected tokens), metrics)`, the
      metric names prefixed `rollout_corr/`. The diagnostics are always there.
    """
    old, rollout = _real(old_log_prob), _real(rollout_log_prob)
    m = _float(response_mask, old)
    log_ratio = old - rollout
    metrics, weights = {}, None
    if correction.rollout_is is not None:
        weights, is_metrics = _is_weights(log_ratio, m, correction.rollout_is,
                                          correction.is_upper, correction.is_lower,
                                          correction.batch_normalize)
        metrics.update(is_metrics)
    mask = m
    if correction.rs:
        mask, rs_metrics = _rejection(log_ratio, m, correction.rs)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old, rollout, m))
    return weights, mask, {PREFIX + k: v for k, v in metrics.items()}


def compute_rollout_correction_and_rejection_mask(
        old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
        rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
        rollout_rs_threshold=None):
    """IS weights (if `rollout_is`), the rejection mask (if `rollout_rs`) and the
    off-policy diagnostics, from `log_ratio = old_log_prob - rollout_log_prob`.

    Args:
      old_log_prob: `[batch, time]` the training policy's log-probs.
      rollout_log_prob: `[batch, time]` the rollout policy's.
      response_mask: `[batch, time]`, 0/1.
      rollout_is, rollout_is_threshold, rollout_is_batch_normalize: see
        `compute_rollout_correction_weights` (static; None turns the weights off).
      rollout_rs, rollout_rs_threshold: see `compute_rollout_rejection_mask` (static; None
        turns rejection off).

    Returns:
      `(weights or None, mask, metrics)` as `apply_rollout_correction`.

    verl: `rollout_corr_helper.compute_rollout_correction_and_rejection_mask` (its weights
    come wrapped in a DataProto).
    """
    correction = RolloutCorrection.parse(rollout_is, rollout_is_threshold,
                                         rollout_is_batch_normalize, rollout_rs,
                                         rollout_rs_threshold)
    return apply_rollout_correction(old_log_prob, rollout_log_prob, response_mask, correction)
