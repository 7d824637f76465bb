"""Sequence packing (`use_remove_padding`) and token-budget micro-batches (`use_dynamic_bsz`):
the packed rows give the padded rows' log-probs, values and updates, on (2,2,2) as on (1,1,1)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import batching, core_algos, packing
from rlhf_jax import train_steps as ts
from rlhf_jax.errors import ConfigError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
N, P, R = 16, 6, 7


def _rollout(seed=0):
    """Variable prompts (left-padded, 1..P tokens) and responses (1..R tokens)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 32, (N, P)).astype(np.int32)
    plen = rng.integers(1, P + 1, N)
    pmask = (np.arange(P)[None] >= P - plen[:, None]).astype(np.int32)
    prompt = prompt * pmask
    resp = rng.integers(3, 32, (N, R)).astype(np.int32)
    rlen = rng.integers(1, R + 1, N)
    rmask = (np.arange(R)[None] < rlen[:, None]).astype(np.int32)
    resp = resp * rmask
    seqs = ts.Sequences.padded(np.concatenate([prompt, resp], 1),
                               np.concatenate([pmask, rmask], 1), resp, rmask)
    f = lambda mu, sd: rng.normal(mu, sd, (N, R)).astype(np.float32) * rmask
    return seqs, {"old": f(-3.0, 0.3), "adv": f(0.0, 1.0), "ref": f(-3.0, 0.3),
                  "values": f(0.0, 1.0), "returns": f(0.0, 1.0)}


def _setup(mesh_name, kind="lm"):
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    axes = dict(spec.train_rules)["batch"]
    dp = int(np.prod([mesh.shape[a] for a in axes]))
    model = Model(CFG, kind=kind)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    if kind == "value":  # the value head starts at zero: move every weight off its init
        wiggle = lambda x: x + 0.1 * jnp.sin(1.7 * jnp.arange(x.size, dtype=x.dtype)
                                             ).reshape(x.shape)
        params = jax.jit(lambda p: jax.tree.map(wiggle, p),
                         out_shardings=jax.tree.map(lambda x: x.sharding, params))(params)
    return mesh, axes, dp, model, params


def _pack(seqs, groups, dp, budget, mesh, axes):
    plan = packing.PackPlan(groups.shape[1], dp, budget, P, R)
    packed, slots = packing.pack(plan, seqs, groups)
    put = lambda tree, lead: batching.put(tree, mesh, axes, lead=lead)
    dev = packing.Packed(put(packed.rows, groups.ndim),
                         batching.replicated(packed.active, mesh),
                         put(packed.where, groups.ndim - 1), put(packed.micro, groups.ndim - 1),
                         put(packed.response_mask, groups.ndim - 1))
    return dev, slots


def test_pack_layout_restarts_positions_and_keeps_every_token():
    seqs, _ = _rollout()
    groups = np.arange(N)[None]
    plan = packing.PackPlan(N, 2, 16, P, R)
    packed, slots = packing.pack(plan, seqs, groups)
    rows, where = packed.rows, packed.where[0]
    plen, rlen = packing.lengths(seqs.segment_ids, seqs.loss_mask)
    assert sorted(slots[0].tolist()) == list(range(N))
    flat_targets = rows.targets[0].reshape(-1)
    for s, i in enumerate(slots[0]):
        r = rlen[i]
        np.testing.assert_array_equal(flat_targets[where[s, :r]], seqs.targets[i, :r])
        assert (where[s, r:] == -1).all()
    # every row holds at most the budget, positions restart per segment, no segment crosses
    seg, pos = rows.segment_ids[0], rows.positions[0]
    for k, d in np.ndindex(seg.shape[:2]):
        for sid in set(seg[k, d].tolist()) - {0}:
            np.testing.assert_array_equal(pos[k, d][seg[k, d] == sid],
                                          np.arange((seg[k, d] == sid).sum()))
    assert seg.astype(bool).sum() == (plen + rlen).sum()  # every real token, once
    # the ranks hold the same number of sequences, with close token sums
    per_rank = [(plen + rlen)[slots[0][d * N // 2:(d + 1) * N // 2]].sum() for d in range(2)]
    assert abs(per_rank[0] - per_rank[1]) <= max(plen + rlen)
    # micro-batches that hold nothing come last and are inactive
    assert packed.active[0].tolist() == sorted(packed.active[0].tolist(), reverse=True)


def test_budget_smaller_than_one_sequence_is_an_error():
    with pytest.raises(ConfigError, match="smaller than one sequence"):
        packing.PackPlan(N, 2, P + R - 1, P, R)


@pytest.mark.parametrize("mesh_name", ["single", "cpu-8"])
def test_packed_log_probs_and_values_equal_padded(mesh_name):
    seqs, _ = _rollout(1)
    mask = seqs.loss_mask
    want = {}
    for kind in ("lm", "value"):
        mesh, axes, dp, model, params = _setup("single", kind)
        chunks = batching.put(jax.tree.map(lambda x: batching.chunked(x, 4), seqs), mesh, axes,
                              lead=1)
        fn = (functools.partial(ts.log_probs_step, model=model, temperature=0.7) if kind == "lm"
              else functools.partial(ts.values_step, model=model))
        want[kind] = np.asarray(batching.unchunk(jax.jit(fn)(params, chunks))) * mask
    for kind in ("lm", "value"):
        mesh, axes, dp, model, params = _setup(mesh_name, kind)
        dev, slots = _pack(seqs, np.arange(N)[None], dp, 2 * (P + R), mesh, axes)
        one = jax.tree.map(lambda x: x[0], dev)
        fn = (functools.partial(ts.packed_log_probs_step, model=model, temperature=0.7)
              if kind == "lm" else functools.partial(ts.packed_values_step, model=model))
        got = packing.from_slots(np.asarray(jax.jit(fn)(params, one))[None], slots, N)
        np.testing.assert_allclose(got, want[kind], atol=1e-5, rtol=0, err_msg=kind)
        assert np.abs(want[kind]).max() > 1e-2


def _update(mesh_name, kind, mode, packed, budget=None, epochs=2):
    mesh, axes, dp, model, params = _setup(mesh_name, "lm" if kind == "actor" else "value")
    # AdamW's eps 1e-8 turns the rounding of a near-zero gradient element into a step of up
    # to lr; eps 1e-4 keeps the parameters' comparison about the gradients.
    optim = ts.OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0, eps=1e-4)
    state = ts.init_state(params, ts.make_optimizer(optim))
    seqs, extra = _rollout()
    plan = batching.Plan(N, mini_batch=8, micro_batch=4, epochs=epochs, shuffle=True)
    order = plan.order(0)
    names = ("old", "adv", "ref") if kind == "actor" else ("values", "returns")
    if packed:
        groups = order.reshape(order.shape[0], -1)
        s, slots = _pack(seqs, groups, dp, budget, mesh, axes)
        ex = batching.put({k: extra[k][slots] for k in names}, mesh, axes, lead=1)
        mask = seqs.loss_mask[slots]
        tok = jnp.asarray(mask.sum(axis=(1, 2)), jnp.float32)
        sq = jnp.asarray((mask.sum(-1) > 0).sum(axis=1), jnp.float32)
    else:
        host = jax.tree.map(lambda x: x[order], (seqs, {k: extra[k] for k in names}))
        mask = host[0].loss_mask
        tok = jnp.asarray(mask.sum(axis=(1, 2, 3)), jnp.float32)
        sq = jnp.asarray((mask.sum(-1) > 0).sum(axis=(1, 2)), jnp.float32)
        s, ex = batching.put(host, mesh, axes, lead=2)
    if kind == "actor":
        step = functools.partial(
            ts.actor_update, model=model, optim=optim,
            loss=ts.ActorLoss(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True))
        batch = ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq)
    else:
        step = functools.partial(ts.critic_update, model=model, optim=optim,
                                 loss=ts.CriticLoss(0.2, mode))
        batch = ts.CriticBatch(s, ex["values"], ex["returns"], tok, sq)
    state, metrics = jax.jit(step)(state, batch)
    return jax.device_get(state.params), jax.device_get(metrics)


def _assert_same(a, b):
    pa, ma = a
    pb, mb = b
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    assert set(ma) == set(mb)
    for k in ma:
        np.testing.assert_allclose(ma[k], mb[k], rtol=1e-4, atol=1e-5, err_msg=k)


def _assert_same_metrics(a, b):
    for k in a[1]:
        np.testing.assert_allclose(a[1][k], b[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


# token-sum and seq-mean-token-sum (the plain sums of their -mean twins) run with -m slow.
SLOW_MODES = ("token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODES else m
    for m in core_algos.LOSS_AGG_MODES])
def test_packed_actor_update_equals_padded(mode):
    """Packed on (2,2,2), with a token budget that makes several micro-batches (some of them
    empty on a rank), against padded on (2,2,2): parameters after 4 AdamW steps and metrics
    equal to 1e-5; and the metrics equal padded on (1,1,1)."""
    packed = _update("cpu-8", "actor", mode, packed=True, budget=P + R + 3)
    _assert_same(packed, _update("cpu-8", "actor", mode, packed=False))
    _assert_same_metrics(packed, _update("single", "actor", mode, packed=False))


@pytest.mark.parametrize("budget", [P + R, pytest.param(4 * (P + R), marks=pytest.mark.slow)])
def test_packed_critic_update_equals_padded(budget):
    packed = _update("cpu-8", "critic", "seq-mean-token-mean", packed=True, budget=budget)
    _assert_same(packed, _update("cpu-8", "critic", "seq-mean-token-mean", packed=False))
    _assert_same_metrics(packed, _update("single", "critic", "seq-mean-token-mean",
                                         packed=False))


def test_packed_critic_update_from_rollout_equals_padded():
    mesh, axes, dp, model, params = _setup("cpu-8", "value")
    optim = ts.OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
    loss = ts.CriticLoss(0.2)
    state = ts.init_state(params, ts.make_optimizer(optim))
    seqs, extra = _rollout(3)
    rewards = extra["returns"]
    step = jax.jit(functools.partial(ts.critic_update_from_rollout, model=model, loss=loss,
                                     optim=optim, gamma=1.0, lam=0.95))
    plan = batching.Plan(N, mini_batch=N, micro_batch=4, epochs=1, shuffle=True)
    order = plan.order(0)
    host = jax.tree.map(lambda x: x[order], (seqs, rewards))
    mask = host[0].loss_mask
    tok = jnp.asarray(mask.sum(axis=(1, 2, 3)), jnp.float32)
    sq = jnp.asarray((mask.sum(-1) > 0).sum(axis=(1, 2)), jnp.float32)
    s, rw = batching.put(host, mesh, axes, lead=2)
    want_state, want_m, outs = step(state, ts.CriticRolloutBatch(s, rw, tok, sq))
    want = [batching.unarrange(x, order) for x in batching.fetch(outs)]

    state = ts.init_state(params, ts.make_optimizer(optim))
    groups = order.reshape(1, -1)
    s, slots = _pack(seqs, groups, dp, P + R + 2, mesh, axes)
    rw = batching.put(rewards[slots], mesh, axes, lead=1)
    got_state, got_m, outs = step(state, ts.CriticRolloutBatch(s, rw, tok, sq))
    got = [packing.from_slots(x, slots, N) for x in batching.fetch(outs)]
    for g, w, name in zip(got, want, ("values", "advantages", "returns"), strict=True):
        np.testing.assert_allclose(g * seqs.loss_mask, w * seqs.loss_mask, atol=1e-5,
                                   err_msg=name)
    assert np.abs(want[1] * seqs.loss_mask).max() > 1e-2
    _assert_same((jax.device_get(got_state.params), jax.device_get(got_m)),
                 (jax.device_get(want_state.params), jax.device_get(want_m)))


PACKED = {
    "actor_rollout_ref.model.use_remove_padding": True,
    "critic.model.use_remove_padding": True,
}
DYNAMIC = {  # the tiny task's sequences are at most 7 + 4 tokens
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 24,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 40,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 12,
    "critic.ppo_max_token_len_per_gpu": 16,
    "critic.forward_max_token_len_per_gpu": 30,
}


@pytest.mark.parametrize("extra", [
    {**PACKED, **DYNAMIC},  # the fused critic (values in its update)
    pytest.param({**PACKED, "critic.values_in_update": False, "actor_rollout_ref.rollout.n": 2},
                 marks=pytest.mark.slow),
], ids=["dynamic_fused_critic", "fixed_values_pass"])
def test_packed_run_logs_the_padded_runs_metrics(tmp_path, extra):
    """Two PPO steps (critic, KL in the reward and the KL loss) on (2,2,2): packed rows with
    token budgets log the padded run's metrics."""
    from tiny_run import algorithmic, compare, tiny

    from rlhf_jax.trainer import Trainer

    base = {"actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.rollout.n": extra.get("actor_rollout_ref.rollout.n", 1),
            "critic.values_in_update": extra.get("critic.values_in_update", True)}
    runs = []
    for name, more in (("padded", {}), ("packed", extra)):
        trainer = Trainer(tiny(tmp_path / name, **{**base, **more}))
        runs.append(algorithmic(trainer.run()))
        if name == "packed":
            assert all(v is not None for k, v in trainer.pack_budgets.items())
    compare(runs[0], runs[1], atol=1e-5)


@pytest.mark.parametrize("key, value, match", [
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 10,
     "ppo_max_token_len_per_gpu: 10 tokens is smaller than one sequence"),
    ("critic.forward_max_token_len_per_gpu", 8, "forward_max_token_len_per_gpu: 8 tokens"),
])
def test_a_budget_below_one_sequence_is_a_one_line_error(tmp_path, key, value, match):
    from tiny_run import tiny

    with pytest.raises(ConfigError, match=match):
        tiny(tmp_path, **{**PACKED, **DYNAMIC, key: value})


def test_dynamic_bsz_without_packing_is_refused(tmp_path):
    from tiny_run import tiny

    with pytest.raises(ConfigError, match="actor.use_dynamic_bsz: token-budget micro-batches "
                                          "are packed rows here"):
        tiny(tmp_path, **{"actor_rollout_ref.actor.use_dynamic_bsz": True})
