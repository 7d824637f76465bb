"""Masked reductions over response tokens and log-prob / entropy from logits.

verl counterpart: `verl/utils/torch_functional.py` (`masked_mean`, `masked_var`,
`masked_whiten`, `masked_sum`, `logprobs_from_logits`, `entropy_from_logits`,
`calculate_sum_pi_squared_from_logits`).

Shapes: `[batch, time]` over response tokens; `mask` is 1 for the tokens that count (response
tokens up to and including EOS) and 0 for padding. A mask may be bool, int or float.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_EPS = 1e-8


def _as_mask(mask, like):
    """The mask in the dtype of `like` (bool/int masks become 0/1 floats)."""
    return jnp.asarray(mask).astype(jnp.asarray(like).dtype)


def masked_sum(values, mask, axis=None):
    """Sum of `values` where `mask` is set: `sum(m * x)`.

    Positions with mask 0 contribute exactly 0 even when `values` holds inf or NaN there.

    Args:
      values: `[batch, time]` (any shape broadcastable with `mask`).
      mask: same shape as `values`, 0/1.
      axis: axis or axes to reduce; None reduces everything.

    Returns:
      The masked sum, with `axis` removed.

    verl: `verl_F.masked_sum`.
    """
    values = jnp.asarray(values)
    m = _as_mask(mask, values)
    return jnp.sum(jnp.where(m != 0, values * m, 0), axis=axis)


def masked_mean(values, mask, axis=None):
    """Mean of `values` over the masked positions: `sum(m * x) / (sum(m) + 1e-8)`.

    An all-masked slice gives 0.

    Args:
      values: `[batch, time]`.
      mask: `[batch, time]`, 0/1.
      axis: axis to reduce; None for the mean over every masked token of the batch.

    Returns:
      The masked mean, with `axis` removed.

    verl: `verl_F.masked_mean`.
    """
    values = jnp.asarray(values)
    m = _as_mask(mask, values)
    return masked_sum(values, m, axis=axis) / (jnp.sum(m, axis=axis) + _EPS)


def masked_var(values, mask, unbiased=True):
    """Variance of `values` over all masked positions.

    `var = masked_mean((x - masked_mean(x))^2)`, times Bessel's correction `N / (N - 1)` with
    `N = sum(m)` when `unbiased`. verl raises for `N <= 1`; under jit we cannot, so the
    correction is 1 there (and the variance is 0 for N = 1, 0 for N = 0).

    Args:
      values: `[batch, time]`.
      mask: `[batch, time]`, 0/1.
      unbiased: apply Bessel's correction.

    Returns:
      A scalar.

    verl: `verl_F.masked_var`.
    """
    values = jnp.asarray(values)
    m = _as_mask(mask, values)
    mean = masked_mean(values, m)
    var = masked_mean(jnp.square(values - mean), m)
    if unbiased:
        n = jnp.sum(m)
        var = var * (n / jnp.maximum(n - 1, 1))
    return var


def masked_whiten(values, mask, shift_mean=True):
    """Whitens `values` with the statistics of all masked tokens of the batch.

    `(x - mean) * rsqrt(var + 1e-8)` with `mean = masked_mean(x, m)` and
    `var = masked_var(x, m)` (unbiased). With `shift_mean=False` the mean is added back.
    Every position is transformed (as in verl); padding is not zeroed.

    Args:
      values: `[batch, time]`.
      mask: `[batch, time]`, 0/1.
      shift_mean: subtract the mean (True) or keep it (False).

    Returns:
      `[batch, time]`.

    verl: `verl_F.masked_whiten`.
    """
    values = jnp.asarray(values)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + _EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _compute_dtype(x):
    """float32 for low-precision inputs (bf16 logits), the input's float type otherwise."""
    return jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)


def logprobs_from_logits(logits, labels):
    """Log-probability of each label under the softmax of its logits.

    `log_softmax(z)[label] = z[label] - logsumexp(z)`, computed in at least float32 and without
    materialising the normalised `[batch, time, vocab]` array.

    Args:
      logits: `[batch, time, vocab]`.
      labels: `[batch, time]` integer token ids.

    Returns:
      `[batch, time]` log-probs.

    verl: `verl_F.logprobs_from_logits`.
    """
    z = jnp.asarray(logits).astype(_compute_dtype(logits))
    picked = jnp.take_along_axis(z, jnp.asarray(labels)[..., None].astype(jnp.int32), axis=-1)
    return picked[..., 0] - jax.nn.logsumexp(z, axis=-1)


def entropy_from_logits(logits):
    """Entropy of the softmax distribution of each position.

    `H = logsumexp(z) - sum(softmax(z) * z)`, computed in at least float32.

    Args:
      logits: `[batch, time, vocab]`.

    Returns:
      `[batch, time]` entropies (nats).

    verl: `verl_F.entropy_from_logits`.
    """
    z = jnp.asarray(logits).astype(_compute_dtype(logits))
    p = jax.nn.softmax(z, axis=-1)
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(p * z, axis=-1)


def sum_pi_squared_from_logits(logits):
    """`sum_v pi_v^2` of the softmax `pi` of each position's logits.

    `exp(logsumexp(2 z) - 2 logsumexp(z))`, computed in at least float32 on `z - max(z)` (the
    same value; without the shift, float32 loses digits once the logits are in the
    hundreds): in (0, 1], 1 for a one-hot distribution and 1/V for the uniform one (the
    optimal token baseline's `w_t = 1 - 2 pi_t + sum_v pi_v^2`).

    Args:
      logits: `[batch, time, vocab]`.

    Returns:
      `[batch, time]`.

    verl: `verl_F.calculate_sum_pi_squared_from_logits`.
    """
    z = jnp.asarray(logits).astype(_compute_dtype(logits))
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return jnp.exp(jax.nn.logsumexp(2.0 * z, axis=-1) - 2.0 * jax.nn.logsumexp(z, axis=-1))
