"""Every core_algos function with a string, mode or flag argument compiles through
`core_algos.jitted` with the eager call's arguments, and gives the eager results."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import core_algos as ca
from rlhf_jax.core_algos import PolicyLossConfig, get_adv_estimator, get_policy_loss, jitted

B, T = 4, 5
rng = np.random.default_rng(0)
MASK = jnp.asarray((np.arange(T)[None] < np.array([5, 3, 1, 4])[:, None]).astype(np.float32))
OLD = jnp.asarray(np.log(rng.uniform(0.1, 0.9, (B, T))), jnp.float32)
LOGP = OLD + jnp.asarray(rng.normal(0, 0.2, (B, T)), jnp.float32)
ADV = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
REWARDS = jnp.zeros((B, T)).at[:, 2].set(jnp.array([1.0, 0.0, 1.0, 0.5]))
INDEX = jnp.array([7, 7, 42, 42])
LOGITS = jnp.asarray(rng.normal(size=(B, T, 6)), jnp.float32)

# Options: parameters that are not arrays and choose what the function does.
OPTION_NAMES = {"loss_agg_mode", "kl_penalty", "rollout_is", "rollout_rs",
                "norm_adv_by_std_in_grpo", "handle_zero_tail", "unbiased", "shift_mean",
                "rollout_is_batch_normalize", "ppo_clip_loss", "correction", "config"}
NOT_ARRAY_FUNCTIONS = {"get_kl_controller", "get_adv_estimator", "get_policy_loss",
                       "register_adv_est", "register_policy_loss", "adv_estimator_names",
                       "policy_loss_names", "group_ids", "jit"}


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


CASES = {
    "kl_penalty": [((LOGP, OLD, name), {}) for name in ca.KL_PENALTY_NAMES if name != "full"]
    + [((LOGP, OLD, "full"), {"logits": LOGITS, "ref_logits": LOGITS * 0.9})],
    "agg_loss": [((ADV, MASK, mode), {}) for mode in ca.LOSS_AGG_MODES],
    "compute_policy_loss": [((OLD, LOGP, ADV, MASK), {"loss_agg_mode": mode,
                                                      "clip_ratio": 0.2})
                            for mode in ca.LOSS_AGG_MODES],
    "compute_value_loss": [((LOGP, OLD, OLD * 0.5, MASK), {"cliprange_value": 0.3,
                                                           "loss_agg_mode": "seq-mean-token-sum"})],
    "compute_entropy_loss": [((LOGITS, MASK), {"loss_agg_mode": "seq-mean-token-mean"})],
    "masked_var": [((ADV, MASK), {"unbiased": u}) for u in (True, False)],
    "masked_whiten": [((ADV, MASK), {"shift_mean": s}) for s in (True, False)],
    "compute_grpo_outcome_advantage": [((REWARDS, MASK, INDEX), {"norm_adv_by_std_in_grpo": n})
                                       for n in (True, False)],
    "compute_rollout_correction_weights": [
        ((LOGP - OLD, MASK), {"rollout_is": lvl, "rollout_is_threshold": 1.5,
                              "rollout_is_batch_normalize": True})
        for lvl in ca.ROLLOUT_IS_LEVELS],
    "compute_rollout_rejection_mask": [((LOGP - OLD, MASK), {"rollout_rs": opt,
                                                             "rollout_rs_threshold": 1.2})
                                       for opt in ("token_k2", "seq_mean_k3", "seq_max_k2")],
    "compute_rollout_correction_and_rejection_mask": [
        ((OLD, LOGP, MASK), {"rollout_is": "token", "rollout_is_threshold": 2.0,
                             "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"})],
}


SPI = jnp.asarray(rng.uniform(0.2, 0.9, (B, T)), jnp.float32)
CORRECTION = ca.RolloutCorrection.parse("token", 2.0, rollout_rs="token_k3",
                                        rollout_rs_threshold=0.5)
CASES.update({
    "compute_optimal_token_baseline_advantage": [
        ((REWARDS, MASK, INDEX, OLD, SPI), {"handle_zero_tail": h}) for h in (True, False)],
    "compute_multi_turn_optimal_token_baseline_advantage": [
        ((REWARDS, MASK, INDEX, OLD, SPI), {"handle_zero_tail": h}) for h in (True, False)],
    "compute_grpo_passk_outcome_advantage": [
        ((REWARDS, MASK, INDEX), {"norm_adv_by_std_in_grpo": n}) for n in (True, False)],
    "compute_gdpo_outcome_advantage": [
        ((REWARDS, MASK, INDEX), {"norm_adv_by_std_in_grpo": n}) for n in (True, False)],
    "apply_rollout_correction": [((OLD, LOGP, MASK, CORRECTION), {})],
    "compute_policy_loss_bypass_mode": [
        ((OLD, LOGP, ADV, MASK), {"correction": CORRECTION,
                                  "ppo_clip_loss": ca.compute_policy_loss_vanilla,
                                  "loss_agg_mode": "seq-mean-token-mean"})],
    "compute_policy_loss_reinforce": [((OLD, LOGP, ADV, MASK), {"loss_agg_mode": m})
                                      for m in ca.LOSS_AGG_MODES],
})
for _name in ca.__all__:  # the loss modes' own functions, at every aggregation mode
    if _name.startswith("compute_policy_loss_") and _name not in CASES:
        _extra = {"dro_beta": 0.3} if _name.endswith("_dro") else {}
        CASES[_name] = [((OLD, LOGP, ADV, MASK), {"loss_agg_mode": m, **_extra})
                        for m in ca.LOSS_AGG_MODES]


# The default run checks these; `-m slow` every other case (op-by-op eager calls are slow).
QUICK = {"kl_penalty", "agg_loss", "compute_policy_loss", "compute_grpo_outcome_advantage",
         "masked_whiten", "vanilla", "grpo", "gae"}
quick = lambda names: [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                       for n in sorted(names)]


@pytest.mark.parametrize("name", quick(CASES))
def test_jitted_equals_eager_with_string_arguments(name):
    eager, compiled = getattr(ca, name), getattr(jitted, name)
    for args, kwargs in CASES[name]:
        close(compiled(*args, **kwargs), eager(*args, **kwargs))


def test_plain_jit_of_a_string_fails_and_jitted_does_not():
    with pytest.raises(TypeError):  # the trap: jit traces the string
        jax.jit(ca.kl_penalty)(LOGP, OLD, "low_var_kl")
    close(jitted.kl_penalty(LOGP, OLD, "low_var_kl"), ca.kl_penalty(LOGP, OLD, "low_var_kl"))
    # inside your own jit: the string is a Python constant of the program
    close(jax.jit(lambda a, b: ca.kl_penalty(a, b, "low_var_kl"))(LOGP, OLD),
          ca.kl_penalty(LOGP, OLD, "low_var_kl"))


@pytest.mark.parametrize("loss_mode", quick(ca.policy_loss_names()))
def test_every_registered_policy_loss_through_jit(loss_mode):
    fn = get_policy_loss(loss_mode)
    kw = dict(config=PolicyLossConfig(dro_beta=0.3, clip_cov_ratio=0.5, kl_cov_ratio=0.5),
              loss_agg_mode="token-mean")
    close(jitted.jit(fn)(OLD, LOGP, ADV, MASK, **kw), fn(OLD, LOGP, ADV, MASK, **kw))


@pytest.mark.parametrize("name", quick(ca.adv_estimator_names()))
def test_every_registered_estimator_through_jit(name):
    est = get_adv_estimator(name)
    given = {"values": OLD, "index": INDEX, "reward_baselines": jnp.ones(B) * 0.3,
             "old_log_probs": OLD, "sum_pi_squared": SPI, "rollout_is_weights": None,
             "gamma": 1.0, "lam": 0.95}
    kw = {k: given[k] for k in est.needs if k in given}
    params = inspect.signature(est.fn).parameters
    for norm in ((True, False) if "norm_adv_by_std_in_grpo" in params else (None,)):
        extra = {} if norm is None else {"norm_adv_by_std_in_grpo": norm}
        close(jitted.jit(est.fn)(REWARDS, MASK, **kw, **extra),
              est.fn(REWARDS, MASK, **kw, **extra))


def test_compiles_once_per_option_value():
    traces = []
    g = jitted.jit(lambda x, mode: traces.append(mode) or (x * 2 if mode == "a" else x))
    for _ in range(3):
        g(LOGP, "a")
        g(LOGP + 1, mode="b")
    assert traces == ["a", "b"]


def test_every_function_with_an_option_is_covered():
    """A new public function with a string / mode / flag argument must join CASES."""
    uncovered = [
        name for name in ca.__all__
        if inspect.isfunction(getattr(ca, name)) and name not in NOT_ARRAY_FUNCTIONS
        and OPTION_NAMES & set(inspect.signature(getattr(ca, name)).parameters)
        and name not in CASES]
    assert not uncovered, uncovered


def test_every_public_function_documents_its_args_and_returns():
    """Google-style `Args:` naming every parameter, and `Returns:`."""
    missing = {}
    for name in ca.__all__:
        fn = getattr(ca, name)
        if not inspect.isfunction(fn):
            continue
        doc = inspect.getdoc(fn) or ""
        params = [p for p in inspect.signature(fn).parameters
                  if p not in ("args", "kwargs")]
        args = doc.split("Args:", 1)[1].split("Returns:", 1)[0] if "Args:" in doc else ""
        gaps = [p for p in params if not re.search(rf"(^|[\s,`]){p}[\s,:`(]", args)]
        if "Returns:" not in doc:
            gaps.append("Returns:")
        if params and "Args:" not in doc:
            gaps.append("Args:")
        if gaps:
            missing[name] = gaps
    assert not missing, missing
