"""Registries of advantage estimators and policy-loss modes, as verl's `register_adv_est` and
`register_policy_loss`: a new estimator or loss is one decorated pure function, and the
config's allowed values (`algorithm.adv_estimator`, `actor.policy_loss.loss_mode`) are the
registered names.

    @register_adv_est("my_estimator", needs=("index",))
    def my_estimator(token_level_rewards, response_mask, *, index): ...   # -> (adv, returns)

    @register_policy_loss("my_loss")
    def my_loss(old_log_prob, log_prob, advantages, response_mask, *, config, loss_agg_mode,
                global_token_count=None, global_seq_count=None, rollout_log_prob=None,
                rollout_is_weights=None):
        ...                                                               # -> (loss, metrics)

    get_adv_estimator("grpo")(rewards, mask, index=ids)                   # -> (adv, returns)

This module imports no jax: the config, which is read without jax (`train.py --print-config`),
asks it for the names. The built-in entries (`entries`, imported at the end) call the maths
through the lazy `core_algos` package, so jax loads when one first runs.

A name belongs to one function: registering another function under a taken name raises,
while re-registering a function with the same module and qualified name (a reloaded module,
a re-run notebook cell) replaces it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

# What an estimator may declare in `needs`: arrays from the trainer, and `algorithm.*` settings.
ADV_INPUTS = ("values", "index", "reward_baselines", "old_log_probs", "sum_pi_squared",
              "rollout_is_weights")
ADV_SETTINGS = ("gamma", "lam", "norm_adv_by_std_in_grpo")
# Inputs that an estimator declaring them still accepts as None (they are optional to it).
ADV_OPTIONAL = ("rollout_is_weights",)
# The keywords every policy loss takes after its four arrays.
POLICY_LOSS_KEYWORDS = ("config", "loss_agg_mode", "global_token_count", "global_seq_count",
                        "rollout_log_prob", "rollout_is_weights")


@dataclasses.dataclass(frozen=True)
class AdvEstimator:
    """A registered advantage estimator: `fn` and what it `needs` (from `ADV_INPUTS` and
    `ADV_SETTINGS`); `fn` receives exactly those as keywords."""

    name: str
    fn: Callable[..., tuple[Any, Any]]
    needs: frozenset[str]

    def __call__(self, token_level_rewards, response_mask, *, values=None, index=None,
                 reward_baselines=None, old_log_probs=None, sum_pi_squared=None,
                 rollout_is_weights=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        """The uniform calling convention: `(advantages, returns)`, each `[batch, time]`.

        Args:
          token_level_rewards: `[batch, time]`.
          response_mask: `[batch, time]`, 0/1.
          values: `[batch, time]` critic values (GAE).
          index: `[batch]` group (prompt) ids, any integers (GRPO, RLOO, ...); string uids
            too when called eagerly.
          reward_baselines: `[batch]` score of the greedy response of each row's prompt (ReMax).
          old_log_probs: `[batch, time]` rollout-policy log-probs (optimal token baseline).
          sum_pi_squared: `[batch, time]` `sum_v pi_v^2` per step (optimal token baseline).
          rollout_is_weights: `[batch, time]` rollout importance weights, optional.
          gamma, lam, norm_adv_by_std_in_grpo: `algorithm.*` (verl's defaults); passed to
            the estimators that declare them.

        Raises:
          ValueError: an input in `needs` (other than `ADV_OPTIONAL`) is None.
        """
        given = dict(values=values, index=index, reward_baselines=reward_baselines,
                     old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
                     rollout_is_weights=rollout_is_weights, gamma=gamma, lam=lam,
                     norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        missing = [k for k in ADV_INPUTS
                   if k in self.needs and k not in ADV_OPTIONAL and given[k] is None]
        if missing:
            raise ValueError(f"advantage estimator {self.name!r} needs {', '.join(missing)}, "
                             "got None")
        kwargs = {k: v for k, v in given.items() if k in self.needs}
        return self.fn(token_level_rewards, response_mask, **kwargs)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the policy-loss modes; frozen and hashable, so a jit can take it as static.
    Names and defaults are verl's (`actor.*` and `actor.policy_loss.*`).

    clip_ratio: eps of the PPO clip, the default of both sides (vanilla, gspo, geo_mean,
      cispo, clip_cov; dppo_*: the divergence bound).
    clip_ratio_low, clip_ratio_high: eps_low, eps_high (None: `clip_ratio`).
    clip_ratio_c: the dual-clip bound (> 1); dppo_*: the truncation of the ratio.
    clip_cov_ratio, clip_cov_lb, clip_cov_ub: clip_cov's fraction of tokens and its band.
    kl_cov_ratio, ppo_kl_coef: kl_cov's fraction of tokens and the weight of its penalty.
    dro_beta: dro's quadratic penalty (required, > 0, for dro).
    tau_pos, tau_neg: sapo's gate temperatures for A > 0 and A <= 0.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05


PolicyLossFn = Callable[..., tuple[Any, dict[str, Any]]]

_ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def _qualified(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _check_free(table: dict[str, Any], name: str, fn: Callable, what: str) -> None:
    old = table.get(name)
    old_fn = old.fn if isinstance(old, AdvEstimator) else old
    if old_fn is not None and _qualified(old_fn) != _qualified(fn):
        raise ValueError(f"{what} {name!r} is already registered ({_qualified(old_fn)})")


def _check_signature(fn: Callable, n_arrays: int, keywords: frozenset[str], what: str) -> None:
    """`fn` takes `n_arrays` positional arrays, accepts `keywords` and requires no others."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < n_arrays and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"{what}: {_qualified(fn)} must take {n_arrays} positional arrays")
    named = params[min(len(positional), n_arrays):]  # positional parameters come first
    taken = {p.name for p in named if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in params) and keywords - taken:
        raise TypeError(f"{what}: {_qualified(fn)} does not take "
                        f"{', '.join(sorted(keywords - taken))}")
    required = {p.name for p in named if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if required - keywords:
        raise TypeError(f"{what}: {_qualified(fn)} requires "
                        f"{', '.join(sorted(required - keywords))}, which it is never given")


def register_adv_est(name: str, *, needs: tuple[str, ...] = ()) -> Callable:
    """Decorator: registers `fn(token_level_rewards, response_mask, **needs) -> (adv, returns)`.

    Args:
      name: the `algorithm.adv_estimator` value.
      needs: what `fn` takes as keywords, among `ADV_INPUTS` (arrays the trainer provides)
        and `ADV_SETTINGS` (config values).

    Returns:
      The decorator; it returns `fn` unchanged.
    """
    needs_set = frozenset(needs)
    unknown = sorted(needs_set - set(ADV_INPUTS) - set(ADV_SETTINGS))
    if unknown:
        raise ValueError(f"advantage estimator {name!r}: unknown needs {', '.join(unknown)} "
                         f"(known: {', '.join(ADV_INPUTS + ADV_SETTINGS)})")

    def decorator(fn):
        what = f"advantage estimator {name!r}"
        _check_signature(fn, 2, needs_set, what)
        _check_free(_ADV_ESTIMATORS, name, fn, "advantage estimator")
        _ADV_ESTIMATORS[name] = AdvEstimator(name, fn, needs_set)
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvEstimator:
    """The estimator registered as `name`; raises ValueError naming the registered ones.

    Args:
      name: a registered estimator name (`adv_estimator_names()`).

    Returns:
      The `AdvEstimator` registered under `name` (its `fn` and `needs`).
    """
    if name not in _ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: "
                         f"{', '.join(adv_estimator_names())}")
    return _ADV_ESTIMATORS[name]


def adv_estimator_names() -> tuple[str, ...]:
    """The registered estimator names, in registration order.

    Returns:
      A tuple of the names, in registration order.
    """
    return tuple(_ADV_ESTIMATORS)


def register_policy_loss(name: str) -> Callable:
    """Decorator: registers a policy loss of the calling convention
    `fn(old_log_prob, log_prob, advantages, response_mask, *, config: PolicyLossConfig,
    loss_agg_mode, global_token_count, global_seq_count, rollout_log_prob=None,
    rollout_is_weights=None) -> (pg_loss, metrics)`.

    The arrays are `[batch, time]`, differentiated through `log_prob`; the counts are those of
    the whole mini-batch (see `losses.agg_loss`); `rollout_is_weights` (`[batch, time]`, no
    gradient) multiply the per-token loss before aggregation; `metrics` maps names without
    the `actor/` prefix to scalars that add up over micro-batches. Called inside the actor
    update's jit, once per micro-batch.

    Args:
      name: the mode's name (`actor_rollout_ref.actor.policy_loss.loss_mode`).

    Returns:
      A decorator that registers the function under `name` and returns it unchanged.
    """

    def decorator(fn):
        what = f"policy loss {name!r}"
        _check_signature(fn, 4, frozenset(POLICY_LOSS_KEYWORDS), what)
        _check_free(_POLICY_LOSSES, name, fn, "policy loss")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; raises ValueError naming the registered ones.

    Args:
      name: a registered policy-loss mode (`policy_loss_names()`).

    Returns:
      The loss function registered under `name`.
    """
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: "
                         f"{', '.join(policy_loss_names())}")
    return _POLICY_LOSSES[name]


def policy_loss_names() -> tuple[str, ...]:
    """The registered policy-loss modes, in registration order.

    Returns:
      A tuple of the modes, in registration order.
    """
    return tuple(_POLICY_LOSSES)


# The built-in estimators and policy losses (verl's), registered in that order on import.
from rlhf_jax.core_algos import entries as _entries  # noqa: E402,F401
