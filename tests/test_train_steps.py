"""The compiled actor / critic updates: micro-batching is exact, sharding does not change them."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import batching
from rlhf_jax import train_steps as ts
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
N, P, R = 16, 5, 4


def _rollout(seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 32, (N, P)).astype(np.int32)
    pmask = np.ones((N, P), np.int32)
    pmask[::3, :2] = 0  # left padding
    resp = rng.integers(0, 32, (N, R)).astype(np.int32)
    lengths = rng.integers(1, R + 1, N)
    rmask = (np.arange(R)[None] < lengths[:, None]).astype(np.int32)
    seqs = ts.Sequences.padded(np.concatenate([prompt, resp], 1),
                               np.concatenate([pmask, rmask], 1), resp, rmask)
    extra = {
        "old": rng.normal(-3.0, 0.3, (N, R)).astype(np.float32) * rmask,
        "adv": rng.normal(0.0, 1.0, (N, R)).astype(np.float32) * rmask,
        "ref": rng.normal(-3.0, 0.3, (N, R)).astype(np.float32) * rmask,
        "values": rng.normal(0.0, 1.0, (N, R)).astype(np.float32) * rmask,
        "returns": rng.normal(0.0, 1.0, (N, R)).astype(np.float32) * rmask,
    }
    return seqs, extra


def _arrange(plan, seqs, extra, mesh, axes):
    order = plan.order(0)
    host = jax.tree.map(lambda x: x[order], (seqs, extra))
    mask = host[0].response_mask
    tok = jnp.asarray(mask.sum(axis=(1, 2, 3)), jnp.float32)
    sq = jnp.asarray((mask.sum(-1) > 0).sum(axis=(1, 2)), jnp.float32)
    return batching.put(host, mesh, axes, lead=2), tok, sq


def _run_actor(mesh_name, micro, mode="token-mean", kind="actor", **model_kw):
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    axes = dict(spec.train_rules)["batch"]
    model = Model(CFG, kind="lm" if kind == "actor" else "value", **model_kw)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
    state = ts.init_state(params, ts.make_optimizer(optim))
    plan = batching.Plan(N, mini_batch=8, micro_batch=micro, epochs=2, shuffle=True)
    seqs, extra = _rollout()
    (s, ex), tok, sq = _arrange(plan, seqs, extra, mesh, axes)
    if kind == "actor":
        step = functools.partial(
            ts.actor_update, model=model, optim=optim,
            loss=ts.ActorLoss(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True),
        )
        batch = ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq)
    else:
        step = functools.partial(ts.critic_update, model=model, optim=optim,
                                 loss=ts.CriticLoss(0.2, mode))
        batch = ts.CriticBatch(s, ex["values"], ex["returns"], tok, sq)
    state, metrics = jax.jit(step)(state, batch)
    return jax.device_get(state.params), jax.device_get(metrics), state


@pytest.mark.parametrize("mode", ["token-mean"] + [  # the others: -m slow
    pytest.param(m, marks=pytest.mark.slow)
    for m in ("seq-mean-token-mean", "seq-mean-token-sum-norm")])
def test_micro_batch_2_equals_8(mode):
    p2, m2, _ = _run_actor("single", 2, mode)
    p8, m8, _ = _run_actor("single", 8, mode)
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for k in m8:
        np.testing.assert_allclose(m2[k], m8[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_critic_micro_batching_and_sharding():
    p2, m2, _ = _run_actor("single", 2, kind="critic")
    p8, m8, _ = _run_actor("cpu-8", 8, kind="critic")
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert m2["critic/vf_loss"] == pytest.approx(m8["critic/vf_loss"], rel=1e-4)


def test_sharded_update_equals_single_device_and_params_move():
    p1, m1, state = _run_actor("single", 8)
    p8, m8, _ = _run_actor("cpu-8", 4)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert int(state.step) == 4  # 2 epochs x 2 mini-batches, one optimizer step each
    init = Model(CFG).init(jax.random.key(0), make_mesh(load_mesh_spec("single")), ())
    moved = max(float(np.abs(a - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(init), strict=True))
    assert moved > 1e-3
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
                "actor/kl_loss", "actor/grad_norm", "actor/lr"):
        assert np.isfinite(m1[key]) and key in m8


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_scanned_and_unrolled_layers_update_alike(kind):
    """The updates with the layer stack scanned, sharded (2,2,2) and rematerialised, equal
    the default one (2 layers: unrolled, gradients per layer stacked once per update)."""
    assert not Model(CFG).scans_layers
    p1, m1, _ = _run_actor("single", 8, kind=kind)
    p8, m8, _ = _run_actor("cpu-8", 4, kind=kind, scan_layers=True, remat=True)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for k in m1:
        np.testing.assert_allclose(m1[k], m8[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_critic_update_from_rollout_equals_values_gae_update():
    """One update a step: the critic's update that makes the rollout's values from its own
    forward pass gives the values, GAE returns, parameters and metrics of a values pass, GAE
    and the plain update (on (2,2,2), 4 micro-batches of 4 rows)."""
    from rlhf_jax import core_algos
    from rlhf_jax.benchmarks.mfu import FAST_COMPILE

    jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    mesh_name, micro = "cpu-8", 4
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    axes = dict(spec.train_rules)["batch"]
    model = Model(CFG, kind="value")
    optim = ts.OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
    loss = ts.CriticLoss(0.2)
    seqs, extra = _rollout(3)
    rewards = extra["returns"]  # any token-level rewards
    plan = batching.Plan(N, mini_batch=N, micro_batch=micro, epochs=1, shuffle=True)
    order = plan.order(0)  # as `_arrange` walks the rows

    # every weight moved off its init (the value head starts at zero); no step donates it
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    wiggle = lambda x: x + 0.1 * jnp.sin(1.7 * jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
    params = jit(lambda p: jax.tree.map(wiggle, p),
                 out_shardings=jax.tree.map(lambda x: x.sharding, params))(params)
    state = ts.init_state(params, ts.make_optimizer(optim))

    arrange = lambda extra: _arrange(plan, seqs, extra, mesh, axes)
    # the separate way: values pass, GAE over the batch, update
    chunks = batching.put(jax.tree.map(lambda x: batching.chunked(x, 4), seqs), mesh, axes,
                          lead=1)
    values = batching.unchunk(jit(functools.partial(ts.values_step, model=model))(
        state.params, chunks))
    adv, returns = jit(core_algos.compute_gae_return)(rewards, values, seqs.response_mask, 1.0,
                                                      0.95)
    (s, ex), tok, sq = arrange({"values": np.asarray(values), "returns": np.asarray(returns)})
    want_state, want_m = jit(functools.partial(ts.critic_update, model=model, loss=loss,
                                               optim=optim))(
        state, ts.CriticBatch(s, ex["values"], ex["returns"], tok, sq))

    # in one call
    step = jit(functools.partial(ts.critic_update_from_rollout, model=model, loss=loss,
                                 optim=optim, gamma=1.0, lam=0.95))
    (s, ex), tok, sq = arrange({"rewards": rewards})
    got_state, got_m, outs = step(state, ts.CriticRolloutBatch(s, ex["rewards"], tok, sq))
    got_v, got_adv, got_ret = (batching.unarrange(x, order) for x in batching.fetch(outs))
    np.testing.assert_allclose(got_v, values, atol=1e-5)
    np.testing.assert_allclose(got_adv, adv, atol=1e-5)
    np.testing.assert_allclose(got_ret, returns, atol=1e-5)
    assert np.abs(np.asarray(values)).max() > 1e-2  # the comparison is not of zeros
    chex.assert_trees_all_close(jax.device_get(got_state.params),
                                jax.device_get(want_state.params), atol=1e-5, rtol=0)
    assert int(got_state.step) == 1
    for k in want_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert float(got_m["critic/vf_clipfrac"]) == 0.0  # on-policy: nothing to clip

    two = batching.Plan(N, mini_batch=8, micro_batch=micro)
    (s, ex), tok, sq = _arrange(two, seqs, {"rewards": rewards}, mesh, axes)
    with pytest.raises(ValueError, match="exactly one optimizer update, got a batch of 2"):
        step(state, ts.CriticRolloutBatch(s, ex["rewards"], tok, sq))


def test_entropy_enters_the_gradient_only_with_a_bonus():
    """With `entropy_coeff=0` the entropy is a metric with no backward pass: the gradient is
    the policy loss's alone; with a bonus c it is that minus c x the entropy's gradient."""
    from rlhf_jax import core_algos

    model = Model(CFG)
    params = model.init(jax.random.key(0), make_mesh(load_mesh_spec("single")), ())
    seqs, extra = _rollout()
    tok = jnp.asarray(seqs.response_mask.sum(), jnp.float32)
    sq = jnp.asarray((seqs.response_mask.sum(-1) > 0).sum(), jnp.float32)
    mb = (seqs, extra["old"], extra["adv"], extra["ref"], None)  # no IS weights

    def grad(coeff):  # compiled: op by op, the backward pass alone took ~40 s
        loss = functools.partial(ts._actor_micro_loss, model=model,
                                 loss=ts.ActorLoss(entropy_coeff=coeff))
        (_, metrics), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, mb, tok, sq)
        return g, metrics

    def pg_only(p):
        logits = ts.response_logits(model, p, seqs)
        logp = core_algos.logprobs_from_logits(logits, seqs.responses)
        return core_algos.compute_policy_loss(
            extra["old"], logp, extra["adv"], seqs.response_mask, clip_ratio=0.2,
            global_token_count=tok)[0]

    def entropy(p):
        logits = ts.response_logits(model, p, seqs)
        return core_algos.agg_loss(core_algos.entropy_from_logits(logits),
                                   seqs.response_mask, "token-mean", global_token_count=tok)

    g0, m0 = grad(0.0)
    g1, _ = grad(0.5)
    g_pg, g_ent = jax.jit(jax.grad(pg_only))(params), jax.jit(jax.grad(entropy))(params)
    assert m0["actor/entropy"] == pytest.approx(float(jax.jit(entropy)(params)), rel=1e-6)
    chex.assert_trees_all_close(g0, g_pg, atol=1e-7, rtol=1e-5)
    want = jax.tree.map(lambda a, b: a - 0.5 * b, g_pg, g_ent)
    chex.assert_trees_all_close(g1, want, atol=1e-6, rtol=1e-4)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_ent)) > 1e-3


def test_non_finite_gradient_skips_the_update():
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec)
    model = Model(CFG)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-2)
    state = ts.init_state(params, ts.make_optimizer(optim))
    plan = batching.Plan(N, mini_batch=16, micro_batch=16, epochs=1, shuffle=False)
    seqs, extra = _rollout()
    extra["adv"][0, 0] = np.nan
    (s, ex), tok, sq = _arrange(plan, seqs, extra, mesh, ("data", "fsdp"))
    step = jax.jit(functools.partial(ts.actor_update, model=model, optim=optim,
                                     loss=ts.ActorLoss()))
    new, metrics = step(state, ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq))
    assert int(new.skipped) == 1 and int(new.step) == 0
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.isfinite(float(metrics["actor/grad_norm"]))


def test_update_compiles_once():
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec)
    model = Model(CFG)
    optim = ts.OptimConfig(lr=1e-3)
    state = ts.init_state(model.init(jax.random.key(0), mesh, spec.train_rules),
                          ts.make_optimizer(optim))
    plan = batching.Plan(N, mini_batch=8, micro_batch=4, epochs=1)
    @chex.assert_max_traces(n=1)
    def update(state, batch):
        return ts.actor_update(state, batch, model=model, optim=optim, loss=ts.ActorLoss())

    sh = jax.tree.map(lambda x: x.sharding, state)  # as the trainer jits it
    step = jax.jit(update, in_shardings=(sh, None), out_shardings=(sh, None), donate_argnums=0)

    for seed in range(3):
        seqs, extra = _rollout(seed)
        (s, ex), tok, sq = _arrange(plan, seqs, extra, mesh, ("data", "fsdp"))
        state, _ = step(state, ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq))


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_lr_schedule_advances_once_per_training_step(kind):
    """verl steps its scheduler once per update_actor / update_critic call: warm-up and decay
    count training steps, not the U optimizer updates (epochs x mini-batches) inside one."""
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec)
    model = Model(CFG, kind="lm" if kind == "actor" else "value")
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-2, weight_decay=0.0, warmup_steps=2)  # in training steps
    state = ts.init_state(params, ts.make_optimizer(optim))
    plan = batching.Plan(N, mini_batch=8, micro_batch=8, epochs=2)  # U = 4 updates a step
    (s, ex), tok, sq = _arrange(plan, *_rollout(), mesh, ("data", "fsdp"))
    if kind == "actor":
        batch = ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq)
        step = functools.partial(ts.actor_update, model=model, optim=optim, loss=ts.ActorLoss())
    else:
        batch = ts.CriticBatch(s, ex["values"], ex["returns"], tok, sq)
        step = functools.partial(ts.critic_update, model=model, optim=optim,
                                 loss=ts.CriticLoss(0.2))
    step = jax.jit(step)
    state, m1 = step(state, batch)  # training step 0 of the warm-up: lr 0 for all 4 updates
    assert int(state.step) == 4 and float(m1[f"{kind}/lr"]) == 0.0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state, m2 = step(state, batch)  # training step 1: lr / 2 for all 4 updates
    assert float(m2[f"{kind}/lr"]) == pytest.approx(0.5 * optim.lr)
    state, m3 = step(state, batch)  # warmed up
    assert float(m3[f"{kind}/lr"]) == pytest.approx(optim.lr)


def test_lr_schedules():
    const = ts.lr_schedule(ts.OptimConfig(lr=1.0, warmup_steps=4))
    assert [float(const(s)) for s in (0, 2, 4, 10)] == [0.0, 0.5, 1.0, 1.0]
    cos = ts.lr_schedule(ts.OptimConfig(lr=1.0, warmup_steps=0, warmup_style="cosine",
                                        min_lr_ratio=0.1, total_steps=10))
    assert float(cos(0)) == pytest.approx(1.0)
    assert float(cos(5)) == pytest.approx(0.55)
    assert float(cos(10)) == pytest.approx(0.1)
