"""core_algos.registry: advantage estimators and policy losses by name; the config's names."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import core_algos as ca
from rlhf_jax import ppo
from rlhf_jax.config import ConfigError, load_config
from rlhf_jax.core_algos import registry
from rlhf_jax.core_algos.registry import (
    PolicyLossConfig,
    adv_estimator_names,
    get_adv_estimator,
    get_policy_loss,
    policy_loss_names,
    register_adv_est,
    register_policy_loss,
)

B, T, N = 8, 6, 2  # rows, response length, samples per prompt
MINIMAL = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=model"]

BUILTIN_NEEDS = {
    "gae": {"values", "gamma", "lam"},
    "grpo": {"index", "norm_adv_by_std_in_grpo"},
    "rloo": {"index"},
    "reinforce_plus_plus": {"gamma"},
    "reinforce_plus_plus_baseline": {"index"},
    "remax": {"reward_baselines"},
}


@pytest.fixture
def scratch(monkeypatch):
    """Registrations made in a test are dropped after it."""
    monkeypatch.setattr(registry, "_ADV_ESTIMATORS", dict(registry._ADV_ESTIMATORS))
    monkeypatch.setattr(registry, "_POLICY_LOSSES", dict(registry._POLICY_LOSSES))


def batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = np.zeros((B, T), np.float32)
    rewards[np.arange(B), lengths - 1] = rng.integers(0, 3, size=B) * 0.5
    rewards -= 0.01 * rng.random((B, T)).astype(np.float32) * mask  # a KL-like penalty
    return dict(
        token_level_rewards=jnp.asarray(rewards),
        response_mask=jnp.asarray(mask),
        values=jnp.asarray(rng.normal(size=(B, T)).astype(np.float32)),
        index=jnp.asarray(np.repeat(np.arange(B // N), N), jnp.int32),
        reward_baselines=jnp.asarray(rng.random(B).astype(np.float32)),
    )


def direct(name, b, gamma, lam, norm):
    """The `compute_*` call each built-in name stands for (what ppo.advantages used to do)."""
    r, m = b["token_level_rewards"], b["response_mask"]
    return {
        "gae": lambda: ca.compute_gae_advantage_return(r, b["values"], m, gamma, lam),
        "grpo": lambda: ca.compute_grpo_outcome_advantage(r, m, b["index"],
                                                          norm_adv_by_std_in_grpo=norm),
        "rloo": lambda: ca.compute_rloo_outcome_advantage(r, m, b["index"]),
        "reinforce_plus_plus": lambda: ca.compute_reinforce_plus_plus_outcome_advantage(
            r, m, gamma),
        "reinforce_plus_plus_baseline":
            lambda: ca.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, b["index"]),
        "remax": lambda: ca.compute_remax_outcome_advantage(r, b["reward_baselines"], m),
    }[name]()


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ------------------------------------------------------------------ advantage estimators


def test_builtin_estimators_and_their_needs():
    # also the config's error order; verl's other estimators follow (tests/test_estimators_more)
    assert adv_estimator_names()[:len(BUILTIN_NEEDS)] == tuple(BUILTIN_NEEDS)
    for name, needs in BUILTIN_NEEDS.items():
        est = get_adv_estimator(name)
        assert (est.name, est.needs) == (name, frozenset(needs))


@pytest.mark.parametrize("name", list(BUILTIN_NEEDS))
@pytest.mark.parametrize("gamma, lam, norm", [(1.0, 1.0, True), (0.9, 0.8, False)])
def test_estimator_by_name_equals_its_compute_function(name, gamma, lam, norm):
    b = batch()
    want = direct(name, b, gamma, lam, norm)
    got = get_adv_estimator(name)(**b, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm)
    assert_same(got, want)
    # ppo.advantages (jitted, the trainer's call) == the compute function jitted
    jitted = jax.jit(functools.partial(direct, name, gamma=gamma, lam=lam, norm=norm))(b)
    got = ppo.advantages(b["token_level_rewards"], b["response_mask"], estimator=name,
                         values=b["values"], index=b["index"],
                         reward_baselines=b["reward_baselines"], gamma=gamma, lam=lam,
                         norm_adv_by_std_in_grpo=norm)
    assert_same(got, jitted)


@pytest.mark.parametrize("name", list(BUILTIN_NEEDS))
def test_estimator_needs_only_what_it_declares(name):
    b = batch()
    inputs = {k: b[k] for k in registry.ADV_INPUTS if k in BUILTIN_NEEDS[name]}
    ppo.advantages(b["token_level_rewards"], b["response_mask"], estimator=name, gamma=1.0,
                   lam=1.0, **inputs)  # the others are None
    for need in inputs:
        with pytest.raises(ValueError, match=f"advantage estimator '{name}' needs {need}, got "
                                             "None"):
            get_adv_estimator(name)(b["token_level_rewards"], b["response_mask"],
                                    **{**inputs, need: None})


def test_remax_without_baselines_says_so_in_the_trainer_call():
    b = batch()
    with pytest.raises(ValueError, match="'remax' needs reward_baselines"):
        ppo.advantages(b["token_level_rewards"], b["response_mask"], estimator="remax",
                       values=b["values"], index=b["index"], gamma=1.0, lam=1.0)


def test_remax_reward_baselines_repeat_the_greedy_score_of_each_prompt():
    b = batch()
    greedy = np.array([0.5, 1.0, 0.0, 1.5], np.float32)  # B // N prompts
    base = ppo.remax_reward_baselines(greedy, b["index"])
    np.testing.assert_array_equal(base, [0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 1.5, 1.5])
    adv, returns = ppo.advantages(b["token_level_rewards"], b["response_mask"],
                                  estimator="remax", reward_baselines=base, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, returns - base[:, None] * b["response_mask"])


def test_unknown_estimator_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; registered: gae, "
                                         "grpo, rloo"):
        get_adv_estimator("ppo")


def test_a_new_estimator_is_one_decorated_function(scratch):
    @register_adv_est("mean_baseline", needs=("index", "gamma"))
    def mean_baseline(token_level_rewards, response_mask, *, index, gamma):
        scores = jnp.sum(token_level_rewards, -1) * gamma
        adv = (scores - jnp.mean(scores))[:, None] * response_mask
        return adv, adv

    assert adv_estimator_names()[-1] == "mean_baseline"
    b = batch()
    adv, _ = ppo.advantages(b["token_level_rewards"], b["response_mask"],
                            estimator="mean_baseline", index=b["index"], gamma=0.5, lam=1.0)
    scores = 0.5 * b["token_level_rewards"].sum(-1)
    np.testing.assert_allclose(adv, (scores - scores.mean())[:, None] * b["response_mask"],
                               rtol=1e-6)


def test_registration_errors(scratch):
    def est(token_level_rewards, response_mask, *, index):
        return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError, match="unknown needs value"):
        register_adv_est("x", needs=("value",))
    with pytest.raises(TypeError, match="requires index, which it is never given"):
        register_adv_est("x", needs=())(est)  # takes index without declaring it
    with pytest.raises(TypeError, match="does not take values"):
        register_adv_est("x", needs=("index", "values"))(est)
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        register_adv_est("grpo", needs=("index",))(est)
    register_adv_est("x", needs=("index",))(est)
    register_adv_est("x", needs=("index",))(est)  # a re-run cell: same function name, fine
    assert get_adv_estimator("x").fn is est


# ------------------------------------------------------------------ policy losses


def loss_batch(seed=1):
    rng = np.random.default_rng(seed)
    mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, size=B)[:, None]).astype(np.float32)
    old = np.log(rng.uniform(0.05, 1, size=(B, T))).astype(np.float32)
    logp = (old + rng.normal(scale=0.4, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    return [jnp.asarray(x) for x in (old, logp, adv, mask)]


def test_policy_loss_config_is_static():
    cfg = PolicyLossConfig(clip_ratio_high=0.28)
    assert hash(cfg) == hash(PolicyLossConfig(clip_ratio_high=0.28))
    with pytest.raises(AttributeError):
        cfg.clip_ratio = 0.1


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_vanilla_by_name_is_compute_policy_loss(mode):
    old, logp, adv, mask = loss_batch()
    cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28,
                           clip_ratio_c=2.5)
    counts = dict(global_token_count=jnp.sum(mask, dtype=jnp.int32) + 3,
                  global_seq_count=jnp.asarray(B + 1, jnp.int32))
    vanilla = get_policy_loss("vanilla")

    def by_name(logp):
        return vanilla(old, logp, adv, mask, config=cfg, loss_agg_mode=mode, **counts)

    def by_function(logp):
        return ca.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_low=0.1,
                                      clip_ratio_high=0.28, clip_ratio_c=2.5,
                                      loss_agg_mode=mode, **counts)

    for transform in (lambda f: f, jax.jit):
        (l1, m1), (l2, m2) = transform(by_name)(logp), transform(by_function)(logp)
        assert set(m1) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
        np.testing.assert_array_equal(l1, l2)
        for k in m2:
            np.testing.assert_array_equal(m1[k], m2[k])
    g1 = jax.jit(jax.grad(lambda q: by_name(q)[0]))(logp)
    g2 = jax.jit(jax.grad(lambda q: by_function(q)[0]))(logp)
    np.testing.assert_array_equal(g1, g2)


def test_a_new_policy_loss_is_one_registered_function(scratch):
    @register_policy_loss("toy_reinforce")
    def toy_reinforce(old_log_prob, log_prob, advantages, response_mask, *, config,
                      loss_agg_mode, global_token_count=None, global_seq_count=None,
                      rollout_log_prob=None, rollout_is_weights=None):
        """Plain REINFORCE: `agg(-A * log_prob)`."""
        del config, rollout_log_prob, rollout_is_weights
        loss = ca.agg_loss(-advantages * log_prob, response_mask, loss_agg_mode,
                           global_token_count=global_token_count,
                           global_seq_count=global_seq_count)
        return loss, {"ppo_kl": ca.masked_mean(old_log_prob - log_prob, response_mask)}

    assert "toy_reinforce" in policy_loss_names()
    old, logp, adv, mask = loss_batch()
    fn = get_policy_loss("toy_reinforce")

    @functools.partial(jax.jit, static_argnames=("config", "loss_agg_mode"))
    def loss_and_grad(logp, *, config, loss_agg_mode):  # as the actor update calls it
        def loss(q):
            return fn(old, q, adv, mask, config=config, loss_agg_mode=loss_agg_mode,
                      global_token_count=jnp.sum(mask), global_seq_count=B)
        return jax.value_and_grad(loss, has_aux=True)(logp)

    (loss, metrics), grad = loss_and_grad(logp, config=PolicyLossConfig(),
                                          loss_agg_mode="token-mean")
    n = float(mask.sum())
    np.testing.assert_allclose(loss, float(jnp.sum(-adv * logp * mask)) / n, rtol=1e-5)
    np.testing.assert_allclose(grad, -adv * mask / n, rtol=1e-6)
    np.testing.assert_allclose(metrics["ppo_kl"], ca.masked_mean(old - logp, mask), rtol=1e-6)


def test_policy_loss_registration_errors(scratch):
    def no_rollout(old_log_prob, log_prob, advantages, response_mask, *, config, loss_agg_mode,
                   global_token_count, global_seq_count):
        return 0.0, {}

    with pytest.raises(TypeError, match="does not take rollout_is_weights, rollout_log_prob"):
        register_policy_loss("x")(no_rollout)
    with pytest.raises(TypeError, match="must take 4 positional arrays"):
        register_policy_loss("x")(lambda log_prob, advantages, **kw: (0.0, {}))
    with pytest.raises(ValueError, match="policy loss 'vanilla' is already registered"):
        register_policy_loss("vanilla")(lambda a, b, c, d, **kw: (0.0, {}))
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; registered: vanilla, "
                                         "dppo_tv, "):
        get_policy_loss("ppo")


# ------------------------------------------------------------------ the config's names


def test_config_names_come_from_the_registries(scratch):
    with pytest.raises(ConfigError, match="^algorithm.adv_estimator: 'mine' is not one of gae, "):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=mine"])
    with pytest.raises(ConfigError, match="^actor_rollout_ref.actor.policy_loss.loss_mode: "
                                          "'mine' is not one of vanilla, dppo_tv, .*, cispo$"):
        load_config(None, [*MINIMAL, "actor_rollout_ref.actor.policy_loss.loss_mode=mine"])

    @register_adv_est("mine", needs=("values",))
    def mine(token_level_rewards, response_mask, *, values):
        return values, values

    @register_policy_loss("mine")
    def mine_loss(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        return 0.0, {}

    cfg = load_config(None, [*MINIMAL, "algorithm.adv_estimator=mine",
                             "actor_rollout_ref.actor.policy_loss.loss_mode=mine"])
    assert cfg.algorithm.adv_estimator == "mine"
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "mine"
    assert cfg.critic.enable  # it needs values, as gae does
    with pytest.raises(ConfigError, match="^critic.enable: algorithm.adv_estimator=mine needs a "
                                          "critic$"):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=mine", "critic.enable=false"])
