"""sum_pi_squared (`sum_v pi_v^2` per token, verl's `actor.calculate_sum_pi_squared`): by hand,
from the softmax of the full logits, in the padded, packed and chunked-head old-log-prob
passes on (2,2,2) as on (1,1,1), and the optimal token baseline through the trainer."""

import functools

import jax
import numpy as np
import pytest
from test_packing import N, _pack, _rollout, _setup
from tiny_run import tiny

from rlhf_jax import batching, core_algos, packing
from rlhf_jax import train_steps as ts
from rlhf_jax.config import ConfigError
from rlhf_jax.models import head
from rlhf_jax.trainer import Trainer


def test_sum_pi_squared_by_hand():
    # softmax([0, log 3]) = [1/4, 3/4]: 1/16 + 9/16; uniform over 5: 1/5; one-hot-ish: ~1
    logits = np.array([[[0.0, np.log(3.0), -np.inf, -np.inf, -np.inf],
                        [2.0, 2.0, 2.0, 2.0, 2.0],
                        [60.0, 0.0, 0.0, 0.0, 0.0]]], np.float32)
    got = np.asarray(core_algos.sum_pi_squared_from_logits(logits))
    np.testing.assert_allclose(got, [[10 / 16, 1 / 5, 1.0]], rtol=1e-6)
    # bf16 logits are computed in float32; large logits do not overflow
    big = np.array([[[1000.0, 999.0]]])
    p = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(core_algos.sum_pi_squared_from_logits(big),
                               [[p**2 + (1 - p) ** 2]], rtol=1e-6)


def _softmax_reference(model, params, seqs, temperature):
    """numpy softmax of the full logits: `(sum_v p_v^2, log p[target])`, `[B, W]` each."""
    z = np.asarray(ts.response_logits(model, params, seqs, temperature), np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    picked = np.take_along_axis(p, np.asarray(seqs.targets)[..., None], -1)[..., 0]
    return (p**2).sum(-1), np.log(picked)


@pytest.mark.parametrize("mesh_name", [pytest.param("single", marks=pytest.mark.slow),
                                       "cpu-8"])
def test_old_pass_sum_pi_squared_padded_packed_chunked(mesh_name):
    seqs, _ = _rollout(1)
    mask = seqs.loss_mask
    t = 0.7
    mesh, axes, dp, model, params = _setup("single")
    want_spi, want_logp = (x * mask for x in _softmax_reference(model, params, seqs, t))
    assert 1 / model.cfg.vocab_size < want_spi.max() < 1 and want_spi.std() > 1e-4
    mesh, axes, dp, model, params = _setup(mesh_name)
    chunks = batching.put(jax.tree.map(lambda x: batching.chunked(x, 4), seqs), mesh, axes,
                          lead=1)
    dev, slots = _pack(seqs, np.arange(N)[None], dp, 26, mesh, axes)
    one = jax.tree.map(lambda x: x[0], dev)
    # the full logits (chunk 0) and the chunked LM head (6 tokens: 3 positions a chunk);
    # on (2,2,2) one of each path, on (1,1,1) all four
    cases = ([("padded", 0), ("packed", 6)] if mesh_name == "cpu-8" else
             [(p, c) for p in ("padded", "packed") for c in (0, 6)])
    for path, chunk in cases:
        kw = dict(model=model, temperature=t, lm_head_chunk_size=chunk,
                  with_sum_pi_squared=True)
        if path == "padded":
            logp, spi = jax.jit(functools.partial(ts.log_probs_step, **kw))(params, chunks)
            np.testing.assert_allclose(np.asarray(batching.unchunk(spi)) * mask, want_spi,
                                       rtol=1e-5, atol=1e-6, err_msg=f"padded {chunk}")
            np.testing.assert_allclose(np.asarray(batching.unchunk(logp)) * mask,
                                       want_logp, atol=1e-5, err_msg=f"padded {chunk}")
            continue
        out = jax.jit(functools.partial(ts.packed_log_probs_step, **kw))(params, one)
        logp, spi = (packing.from_slots(np.asarray(x)[None], slots, N) for x in out)
        np.testing.assert_allclose(spi, want_spi, rtol=1e-5, atol=1e-6,
                                   err_msg=f"packed {chunk}")
        np.testing.assert_allclose(logp, want_logp, atol=1e-5, err_msg=f"packed {chunk}")


def test_chunked_head_sum_pi_squared_has_no_gradient_and_matches():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 7, 8)).astype(np.float32)
    w = rng.normal(size=(8, 11)).astype(np.float32)
    y = rng.integers(0, 11, (2, 7))
    spec = head.HeadSpec(chunk=3, temperature=0.5, layout="dv", with_sum_pi_squared=True)
    logp, ent, spi = head.token_terms(h, w, y, spec)
    z = (h @ w) / 0.5
    np.testing.assert_allclose(spi, core_algos.sum_pi_squared_from_logits(z), rtol=1e-5)
    np.testing.assert_allclose(logp, core_algos.logprobs_from_logits(z, y), atol=1e-5)
    np.testing.assert_allclose(ent, core_algos.entropy_from_logits(z), atol=1e-5)
    g = jax.grad(lambda w: head.token_terms(h, w, y, spec)[2].sum())(w)
    assert not np.asarray(g).any()


_FAST = {"mesh": "single", "trainer.sft_warmup.enable": False, "trainer.test_freq": -1,
         "trainer.rollback.enable": False, "data.train_batch_size": 8,
         "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_device": 8,
         "actor_rollout_ref.rollout.max_concurrent_decodes": 16}


@pytest.mark.slow  # the trainer's paths are those of the other estimators (test_step_contract)
@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_trains_two_steps(tmp_path, estimator):
    """The old pass fills `sum_pi_squared`; the estimator reads it with the old log-probs
    and the rollout IS weights (`rollout_is: token`), and the trainer runs two steps."""
    run = tiny(tmp_path, **_FAST, **{
        "algorithm.adv_estimator": estimator, "critic.enable": False,
        "algorithm.rollout_correction.rollout_is": "token",
        "actor_rollout_ref.rollout.n": 2, "trainer.total_training_steps": 2})
    trainer = Trainer(run)
    exp = trainer.make_experience(trainer.train_loader.batch_at(0, 0), trainer.state)
    mask = np.asarray(exp.response_mask, bool)
    spi = np.asarray(exp.sum_pi_squared)
    assert spi.shape == mask.shape and exp.rollout_is_weights is not None
    assert (spi[mask] > 1 / 32).all() and (spi[mask] <= 1 + 1e-6).all()
    adv, _ = core_algos.get_adv_estimator(estimator)(
        exp.token_rewards, exp.response_mask, index=exp.index, old_log_probs=exp.old_log_probs,
        sum_pi_squared=spi, rollout_is_weights=exp.rollout_is_weights)
    np.testing.assert_allclose(exp.advantages, adv, atol=1e-6)
    # the same batch with sum_pi_squared 0 gives other advantages: the input is read
    adv0, _ = core_algos.get_adv_estimator(estimator)(
        exp.token_rewards, exp.response_mask, index=exp.index, old_log_probs=exp.old_log_probs,
        sum_pi_squared=np.zeros_like(spi), rollout_is_weights=exp.rollout_is_weights)
    if np.abs(np.asarray(exp.advantages)).max() > 0:
        assert np.abs(np.asarray(adv0) - np.asarray(exp.advantages)).max() > 1e-6
    history = trainer.run()
    assert len(history) == 2 and trainer.global_step == 2
    for m in history:
        assert np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["critic/advantages/mean"])


def test_sum_pi_squared_config_refusals(tmp_path):
    otb = {"algorithm.adv_estimator": "optimal_token_baseline", "critic.enable": False}
    with pytest.raises(ConfigError, match="calculate_sum_pi_squared: only the estimators"):
        tiny(tmp_path, **{"actor_rollout_ref.actor.calculate_sum_pi_squared": True})
    with pytest.raises(ConfigError, match="bypass_mode: 'optimal_token_baseline' needs"):
        tiny(tmp_path, **otb, **{"algorithm.rollout_correction.bypass_mode": True})
    cfg = tiny(tmp_path, **otb, **{"actor_rollout_ref.actor.calculate_sum_pi_squared": True})
    assert cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
