"""KL penalties between the policy and the reference, and the KL-coefficient controllers.

verl counterpart: `kl_penalty`, `FixedKLController`, `AdaptiveKLController`,
`get_kl_controller` of `verl/trainer/ppo/core_algos.py`. The controllers here are pure: their
state is a pytree (`KLControllerState`) that a jitted step returns and a checkpoint stores,
and `update` returns a new state instead of mutating `self.value`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.masked import _compute_dtype

_POINT_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_NAMES = (
    _POINT_ESTIMATORS + tuple(name + "+" for name in _POINT_ESTIMATORS) + ("full",)
)


def _kl_forward(d, name):
    """The per-token estimator `name` (no `+`) of the log-ratio `d = logp - ref_logp`."""
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        # d * sign(d) = |d| with torch's gradient sign(d), which is 0 at a tie (logp == ref);
        # jnp.abs has gradient 1 there
        return d * jnp.sign(d)
    if name in ("mse", "k2"):
        return 0.5 * jnp.square(d)
    # low_var_kl / k3 (Schulman's k3): exp(x) - x - 1 with x = ref - logp; expm1 keeps the
    # small-|x| values accurate in float32.
    x = jnp.clip(-d, -20.0, 20.0)
    return jnp.clip(jnp.expm1(x) - x, -10.0, 10.0)


def kl_penalty_full(logits, ref_logits):
    """Exact per-token KL(pi || ref) from both full next-token distributions.

    `KL_t = sum_v softmax(z)_v * (log_softmax(z)_v - log_softmax(z_ref)_v)`, in at least
    float32. verl leaves `kl_penalty="full"` unimplemented.

    Args:
      logits: `[batch, time, vocab]` policy logits.
      ref_logits: `[batch, time, vocab]` reference logits.

    Returns:
      `[batch, time]`, >= 0.
    """
    dtype = _compute_dtype(logits)
    logp = jax.nn.log_softmax(jnp.asarray(logits).astype(dtype), axis=-1)
    ref_logp = jax.nn.log_softmax(jnp.asarray(ref_logits).astype(dtype), axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - ref_logp), axis=-1)


def kl_penalty(logprob, ref_logprob, kl_penalty, *, logits=None, ref_logits=None):
    """Per-token KL penalty between the policy and the reference, by estimator name.

    With `d = logprob - ref_logprob` (log-probs of the sampled tokens):
    - `kl` / `k1`: `d`
    - `abs`: `|d|` (gradient `sign(d)`, 0 at `d = 0` as in torch)
    - `mse` / `k2`: `d^2 / 2`
    - `low_var_kl` / `k3`: `x = clip(-d, -20, 20)`; `clip(exp(x) - x - 1, -10, 10)`
    - any of these with a `+` suffix (`k1+`, `k3+`, ...): the forward value of the estimator
      with the gradient of k2 (straight-through: `k2 + stop_gradient(est - k2)`), an unbiased
      gradient of KL(pi || ref) when the tokens are sampled from pi
    - `full`: the exact KL from the full distributions; needs `logits` and `ref_logits`
      (`logprob` and `ref_logprob` are then unused and may be None). See `kl_penalty_full`.

    Args:
      logprob: `[batch, time]` log-probs under the policy.
      ref_logprob: `[batch, time]` log-probs under the reference.
      kl_penalty: estimator name, one of `KL_PENALTY_NAMES` (static).
      logits: `[batch, time, vocab]` policy logits, for `full` only.
      ref_logits: `[batch, time, vocab]` reference logits, for `full` only.

    Returns:
      `[batch, time]` penalties (not masked).

    Raises:
      ValueError: unknown name, or `full` without logits.

    verl: `core_algos.kl_penalty`.
    """
    if kl_penalty not in KL_PENALTY_NAMES:
        raise ValueError(
            f"unknown kl_penalty {kl_penalty!r}; valid names: {', '.join(KL_PENALTY_NAMES)}"
        )
    if kl_penalty == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kl_penalty='full' needs logits= and ref_logits= ([B, T, V])")
        return kl_penalty_full(logits, ref_logits)
    logprob = jnp.asarray(logprob)
    d = logprob - jnp.asarray(ref_logprob).astype(logprob.dtype)
    name = kl_penalty.rstrip("+")
    estimate = _kl_forward(d, name)
    if not kl_penalty.endswith("+") or name in ("mse", "k2"):
        return estimate
    k2 = 0.5 * jnp.square(d)
    return k2 + jax.lax.stop_gradient(estimate - k2)


class KLControllerState(NamedTuple):
    """The pytree state of a KL controller: the current coefficient beta (float32 scalar)."""

    kl_coef: jax.Array


@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """A constant KL coefficient. Hashable, so it can be a static jit argument.

    verl: `core_algos.FixedKLController` (its `.value` is `state.kl_coef` here).
    """

    kl_coef: float

    def init(self) -> KLControllerState:
        """The initial state, `kl_coef` as a float32 scalar array."""
        return KLControllerState(jnp.asarray(self.kl_coef, jnp.float32))

    def update(self, state: KLControllerState, current_kl, n_steps) -> KLControllerState:
        """Returns `state` unchanged (`current_kl` and `n_steps` are ignored)."""
        del current_kl, n_steps
        return state


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), proportional control.

    `e = clip(current_kl / target_kl - 1, -0.2, 0.2)`; `kl_coef *= 1 + e * n_steps / horizon`.
    It moves beta, the KL coefficient, not a learning rate.

    verl: `core_algos.AdaptiveKLController` (its `.value` is `state.kl_coef` here).
    """

    init_kl_coef: float
    target_kl: float
    horizon: float

    def __post_init__(self):
        if not self.horizon > 0:
            raise ValueError(f"horizon must be > 0, got {self.horizon}")
        if not self.target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {self.target_kl}")

    def init(self) -> KLControllerState:
        """The initial state, `init_kl_coef` as a float32 scalar array."""
        return KLControllerState(jnp.asarray(self.init_kl_coef, jnp.float32))

    def update(self, state: KLControllerState, current_kl, n_steps) -> KLControllerState:
        """One proportional update.

        Args:
          state: the current state.
          current_kl: scalar, the measured KL (e.g. batch mean of per-sequence mean KL).
          n_steps: scalar, sequences in the batch.

        Returns:
          The new state (same dtype as `state.kl_coef`).
        """
        coef = state.kl_coef
        error = jnp.clip(jnp.asarray(current_kl, coef.dtype) / self.target_kl - 1.0, -0.2, 0.2)
        mult = 1.0 + error * jnp.asarray(n_steps, coef.dtype) / self.horizon
        return KLControllerState((coef * mult).astype(coef.dtype))


def get_kl_controller(type, kl_coef, target_kl=None, horizon=None):
    """Builds the controller of `algorithm.kl_ctrl`.

    Args:
      type: `"fixed"` or `"adaptive"` (the `kl_ctrl.type` key).
      kl_coef: the (initial) coefficient.
      target_kl: target KL, adaptive only.
      horizon: horizon in sequences, adaptive only (> 0).

    Returns:
      A `FixedKLController` or an `AdaptiveKLController`.

    Raises:
      ValueError: unknown type, or an adaptive controller without a valid target/horizon.

    verl: `core_algos.get_kl_controller` (which takes the config node).
    """
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown kl_ctrl type {type!r}; valid types: fixed, adaptive")
