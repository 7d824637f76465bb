"""Registries of advantage estimators and policy-loss modes, as verl's `register_adv_est` and
`register_policy_loss`: a new estimator or loss is one decorated pure function, and the
config's allowed values (`algorithm.adv_estimator`, `actor.policy_loss.loss_mode`) are the
registered names.

    @register_adv_est("my_estimator", needs=("index",))
    def my_estimator(token_level_rewards, response_mask, *, index): ...   # -> (adv, returns)

    @register_policy_loss("my_loss")
    def my_loss(old_log_prob, log_prob, advantages, response_mask, *, config, loss_agg_mode,
                global_token_count=None, global_seq_count=None, rollout_log_prob=None):
        ...                                                               # -> (loss, metrics)

    get_adv_estimator("grpo")(rewards, mask, index=ids)                   # -> (adv, returns)

This module imports no jax: the config, which is read without jax (`train.py --print-config`),
asks it for the names. The built-in entries at the end call the maths of `advantages` and
`losses` through the lazy `core_algos` package, so jax loads when one first runs.

A name belongs to one function: registering another function under a taken name raises,
while re-registering a function with the same module and qualified name (a reloaded module,
a re-run notebook cell) replaces it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from rlhf_jax import core_algos as ca

# What an estimator may declare in `needs`: arrays from the trainer, and `algorithm.*` settings.
ADV_INPUTS = ("values", "index", "reward_baselines")
ADV_SETTINGS = ("gamma", "lam", "norm_adv_by_std_in_grpo")
# The keywords every policy loss takes after its four arrays.
POLICY_LOSS_KEYWORDS = ("config", "loss_agg_mode", "global_token_count", "global_seq_count",
                        "rollout_log_prob")


@dataclasses.dataclass(frozen=True)
class AdvEstimator:
    """A registered advantage estimator: `fn` and what it `needs` (from `ADV_INPUTS` and
    `ADV_SETTINGS`); `fn` receives exactly those as keywords."""

    name: str
    fn: Callable[..., tuple[Any, Any]]
    needs: frozenset[str]

    def __call__(self, token_level_rewards, response_mask, *, values=None, index=None,
                 reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        """The uniform calling convention: `(advantages, returns)`, each `[batch, time]`.

        Args:
          token_level_rewards: `[batch, time]`.
          response_mask: `[batch, time]`, 0/1.
          values: `[batch, time]` critic values (GAE).
          index: `[batch]` int group (prompt) ids in `[0, batch)` (GRPO, RLOO, ...).
          reward_baselines: `[batch]` score of the greedy response of each row's prompt (ReMax).
          gamma, lam, norm_adv_by_std_in_grpo: `algorithm.*` (verl's defaults); passed to
            the estimators that declare them.

        Raises:
          ValueError: an input in `needs` is None.
        """
        given = dict(values=values, index=index, reward_baselines=reward_baselines,
                     gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        missing = [k for k in ADV_INPUTS if k in self.needs and given[k] is None]
        if missing:
            raise ValueError(f"advantage estimator {self.name!r} needs {', '.join(missing)}, "
                             "got None")
        kwargs = {k: v for k, v in given.items() if k in self.needs}
        return self.fn(token_level_rewards, response_mask, **kwargs)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the policy-loss modes; frozen and hashable, so a jit can take it as static.

    clip_ratio: eps of the PPO clip, the default of both sides.
    clip_ratio_low, clip_ratio_high: eps_low, eps_high (None: `clip_ratio`).
    clip_ratio_c: the dual-clip bound (> 1).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0


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
    """The estimator registered as `name`; raises ValueError naming the registered ones."""
    if name not in _ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: "
                         f"{', '.join(adv_estimator_names())}")
    return _ADV_ESTIMATORS[name]


def adv_estimator_names() -> tuple[str, ...]:
    """The registered estimator names, in registration order."""
    return tuple(_ADV_ESTIMATORS)


def register_policy_loss(name: str) -> Callable:
    """Decorator: registers a policy loss of the calling convention
    `fn(old_log_prob, log_prob, advantages, response_mask, *, config: PolicyLossConfig,
    loss_agg_mode, global_token_count, global_seq_count, rollout_log_prob=None)
    -> (pg_loss, metrics)`.

    The arrays are `[batch, time]`, differentiated through `log_prob`; the counts are those of
    the whole mini-batch (see `losses.agg_loss`); `metrics` maps names without the `actor/`
    prefix to scalars. Called inside the actor update's jit, once per micro-batch.
    """

    def decorator(fn):
        what = f"policy loss {name!r}"
        _check_signature(fn, 4, frozenset(POLICY_LOSS_KEYWORDS), what)
        _check_free(_POLICY_LOSSES, name, fn, "policy loss")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; raises ValueError naming the registered ones."""
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: "
                         f"{', '.join(policy_loss_names())}")
    return _POLICY_LOSSES[name]


def policy_loss_names() -> tuple[str, ...]:
    """The registered policy-loss modes, in registration order."""
    return tuple(_POLICY_LOSSES)


# ------------------------------------------------------------------------ built-in entries
# Each adapts a `compute_*` function of `advantages` / `losses` (verl's names, verl's
# arguments) to the calling convention; the maths stays there.


@register_adv_est("gae", needs=("values", "gamma", "lam"))
def gae(token_level_rewards, response_mask, *, values, gamma, lam):
    """`compute_gae_advantage_return` (whitened advantages, returns = A + values)."""
    return ca.compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma,
                                           lam)


@register_adv_est("grpo", needs=("index", "norm_adv_by_std_in_grpo"))
def grpo(token_level_rewards, response_mask, *, index, norm_adv_by_std_in_grpo):
    """`compute_grpo_outcome_advantage`; Dr.GRPO when `norm_adv_by_std_in_grpo` is False."""
    return ca.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


@register_adv_est("rloo", needs=("index",))
def rloo(token_level_rewards, response_mask, *, index):
    """`compute_rloo_outcome_advantage` (leave-one-out baseline per group)."""
    return ca.compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("reinforce_plus_plus", needs=("gamma",))
def reinforce_plus_plus(token_level_rewards, response_mask, *, gamma):
    """`compute_reinforce_plus_plus_outcome_advantage` (whitened discounted return-to-go)."""
    return ca.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask,
                                                            gamma)


@register_adv_est("reinforce_plus_plus_baseline", needs=("index",))
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, index):
    """`compute_reinforce_plus_plus_baseline_outcome_advantage` (group-mean baseline)."""
    return ca.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards, response_mask, index
    )


@register_adv_est("remax", needs=("reward_baselines",))
def remax(token_level_rewards, response_mask, *, reward_baselines):
    """`compute_remax_outcome_advantage` (return-to-go minus the greedy response's score)."""
    return ca.compute_remax_outcome_advantage(token_level_rewards, reward_baselines,
                                              response_mask)


@register_policy_loss("vanilla")
def vanilla(old_log_prob, log_prob, advantages, response_mask, *,
            config: PolicyLossConfig, loss_agg_mode="token-mean", global_token_count=None,
            global_seq_count=None, rollout_log_prob=None):
    """PPO clip + dual clip: `compute_policy_loss` with the clip settings of `config`.

    `rollout_log_prob` is unused (verl's vanilla mode takes none either)."""
    del rollout_log_prob
    return ca.compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c, loss_agg_mode=loss_agg_mode,
        global_token_count=global_token_count, global_seq_count=global_seq_count,
    )
