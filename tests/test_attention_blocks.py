"""Full-sequence attention in query blocks (`ops.attention`): the same output and gradients
as one block, the block size from the byte budget, and the decoder's forward through it on
(2,2,2) equal to one block on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig, ops
from rlhf_jax.models import transformer as tf


def _inputs(t=11, s=11, b=2, k=2, g=2, h=8, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, k, g, t, h)), jnp.float32)
    kk = jnp.asarray(rng.normal(size=(b, k, s, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, k, s, h)), jnp.float32)
    causal = np.tril(np.ones((t, s), bool), s - t)
    segments = np.array([[0] * 5 + [1] * (s - 5), [0] * s])  # row 0 packs two sequences
    same = segments[:, -t:, None] == segments[:, None, :]
    return q, kk, v, jnp.asarray(causal[None] & same)


@pytest.mark.parametrize("block", [1, 3, 4, 11])
def test_blocks_equal_one_block_values_and_gradients(block):
    """Blocks of 3 (a tail of 2), 4 (a tail of 3), 1 and all 11 queries: the outputs and the
    gradients of q, k and v equal the unblocked attention's."""
    q, k, v, mask = _inputs()
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(q, k, v, block):
        return jnp.sum(w * ops.attention(q, k, v, mask, 0.35, jnp.float32, block))

    ref, got = (jax.jit(functools.partial(ops.attention, scale=0.35, dtype=jnp.float32,
                                          block=bl))(q, k, v, mask) for bl in (None, block))
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    g_ref = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, None)
    g_got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, block)
    for a, b in zip(g_got, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_block_size_from_the_budget():
    shape = (4, 2, 7, 2049, 2049)  # Qwen2.5-0.5B's 14 heads over 2 KV heads, 4 rows
    per_query = 4 * 2 * 7 * 2049 * 4
    assert ops.attention_block((2, 2, 2, 128, 128)) is None  # the tiny runs: one block
    block = ops.attention_block(shape)
    assert block * per_query <= ops.ATTENTION_BLOCK_BYTES < (block + 1) * per_query
    assert ops.attention_block(shape, budget=1) == 1
    assert ops.attention_block(shape, budget=10**12) is None


def _decoder_inputs():
    """A 2-layer Qwen2 config, 4 rows of 13 token ids (row 0 left-padded by 5), their mask
    and the generator that drew them."""
    cfg = ModelConfig.from_hf(dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, model_type="qwen2"))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (4, 13)).astype(np.int32)
    mask = np.ones((4, 13), np.int32)
    mask[0, :5] = 0
    return cfg, ids, mask, rng


def test_decoder_in_blocks_on_the_mesh_equals_one_block(monkeypatch):
    """The model's forward with a budget that makes blocks of 3 queries (of 13, with a
    tail) on (2,2,2) gives the logits of the one-block forward on one device; the blocks
    are really used."""
    cfg, ids, mask, rng = _decoder_inputs()

    def logits(mesh_name):
        spec = load_mesh_spec(mesh_name)
        mesh = make_mesh(spec)
        model = Model(cfg).with_layout(mesh, spec.train_rules)
        params = model.init(jax.random.key(0), mesh, spec.train_rules)
        blocks.clear()  # the forward's layers only, not the initialisation's
        return np.asarray(jax.jit(model.forward)(params, ids, mask))

    blocks = []
    ref = logits("single")
    real = tf.attention

    def spy(*args, **kw):
        blocks.append(args[-1])
        return real(*args, **kw)

    monkeypatch.setattr(tf, "attention", spy)
    per_query = 4 * 2 * 2 * 13 * 4  # rows x K x G x S x 4 bytes (global shapes under jit)
    monkeypatch.setattr(ops, "ATTENTION_BLOCK_BYTES", 3 * per_query)
    got = logits("cpu-8")
    assert blocks == [3, 3], blocks  # both layers
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_causal_plan():
    """Blocks of at least `CAUSAL_BLOCK` queries, at most `CAUSAL_MAX_BLOCKS`, each over the
    keys up to its last query; one block over every key is no plan, and so is a byte
    budget's block shorter than a causal block."""
    assert ops.CAUSAL_BLOCK == 256 and ops.CAUSAL_MAX_BLOCKS == 4
    assert ops.causal_plan(640, 640, 0) == ((0, 256, 256), (256, 512, 512), (512, 640, 640))
    assert ops.causal_plan(2048, 2048, 0) == tuple((a, a + 512, a + 512)
                                                  for a in range(0, 2048, 512))
    assert ops.causal_plan(256, 256, 0) is None  # the tiny runs and workload 1: one block
    assert ops.causal_plan(200, 640, 100) is None  # one block, even over fewer keys
    assert ops.causal_plan(300, 640, 100) == ((0, 256, 356), (256, 300, 400))  # a query slice
    assert ops.causal_plan(640, 640, 0, block=100) is None  # `lax.map` blocks instead
    assert ops.causal_plan(640, 640, 0, block=300) is not None


@pytest.mark.parametrize("t, s, block", [(11, 11, None), (11, 11, 4), (7, 11, None),
                                         (11, 11, 1)])
def test_causal_blocks_equal_one_block_values_and_gradients(t, s, block, monkeypatch):
    """Causal blocks of 3 queries (11 = 3 + 3 + 3 + 2), each over its keys only, give the
    output and q / k / v gradients of one block over every key: a packed row and a padded
    one; 7 queries at the end of 11 keys (a query slice, offset 4); under a byte budget's
    blocks longer than a causal block, and (blocks of 1) in those blocks instead."""
    monkeypatch.setattr(ops, "CAUSAL_BLOCK", 3)
    q, k, v, mask = _inputs(t=t, s=s)
    w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    plans = []
    real = ops.causal_plan

    def spy(*a, **kw):
        plans.append(real(*a, **kw))
        return plans[-1]

    monkeypatch.setattr(ops, "causal_plan", spy)
    run = lambda offset: lambda q, k, v: ops.attention(q, k, v, mask, 0.35, jnp.float32, block,
                                                       causal_offset=offset)
    loss = lambda f: lambda q, k, v: jnp.sum(w * f(q, k, v))
    ref, got = run(None), run(s - t)
    np.testing.assert_allclose(jax.jit(got)(q, k, v), ref(q, k, v), atol=1e-6, rtol=0)
    assert plans[0] == (None if block == 1 else tuple(
        (a, min(a + 3, t), min(a + 3, t) + s - t) for a in range(0, t, 3)))
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.jit(jax.grad(loss(got), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_got, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_decoder_with_causal_blocks_on_the_mesh_equals_one_block(monkeypatch):
    """The model's logits and parameter gradients with causal blocks of 4 queries (13 tokens:
    4 + 4 + 4 + 1; the last layer's queries only the 8 of the head's slice) on (2,2,2) equal
    one block's on one device, on the real tokens of a left-padded batch."""
    cfg, ids, mask, rng = _decoder_inputs()
    head = slice(4, 12)
    w = rng.normal(size=(4, 8, 64)).astype(np.float32) * mask[:, head, None]

    def run(mesh_name):
        spec = load_mesh_spec(mesh_name)
        mesh = make_mesh(spec)
        model = Model(cfg).with_layout(mesh, spec.train_rules)
        params = model.init(jax.random.key(0), mesh, spec.train_rules)
        loss = lambda p: jnp.sum(w * model.forward(p, ids, mask, head))
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        return value, jax.tree.map(np.asarray, grads)

    monkeypatch.setattr(ops, "CAUSAL_BLOCK", 10**6)
    ref = run("single")
    monkeypatch.setattr(ops, "CAUSAL_BLOCK", 4)
    plans = []
    real = ops.causal_plan
    monkeypatch.setattr(ops, "causal_plan", lambda *a, **kw: plans.append(real(*a, **kw))
                        or plans[-1])
    got = run("cpu-8")
    assert plans[-2:] == [((0, 4, 4), (4, 8, 8), (8, 12, 12), (12, 13, 13)),  # the forward's
                          ((0, 4, 8), (4, 8, 12))], plans  # (the first: initialisation's)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def _reference(q, k, v, mask, scale):
    """Masked softmax attention as autodiff sees it (no custom backward)."""
    scores = jnp.einsum("BKGTH,BKSH->BKGTS", q, k) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, ops.NEG_INF), axis=-1)
    return jnp.einsum("BKGTS,BKSH->BKGTH", probs, v)


@pytest.mark.parametrize("block", [None, 4])
def test_the_hand_written_backward_equals_autodiffs(block):
    """Outputs and q / k / v gradients equal plain autodiff through the masked softmax, with
    a packed row, a fully masked query row (the mean of all values, no gradient through its
    scores) and a padded row, in one block and in blocks of 4 with a tail."""
    q, k, v, mask = _inputs()
    mask = np.asarray(mask).copy()
    mask[1, 3] = False  # a query that may read no key
    mask = jnp.asarray(mask)
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    got = jax.jit(lambda q, k, v: ops.attention(q, k, v, mask, 0.35, jnp.float32, block))
    np.testing.assert_allclose(got(q, k, v), _reference(q, k, v, mask, 0.35), atol=1e-6)
    np.testing.assert_allclose(got(q, k, v)[1, :, :, 3], np.broadcast_to(
        np.mean(np.asarray(v)[1], axis=1)[:, None], (2, 2, 8)), atol=1e-6)
    loss = lambda f: lambda q, k, v: jnp.sum(w * f(q, k, v))
    ref = jax.grad(loss(lambda q, k, v: _reference(q, k, v, mask, 0.35)), (0, 1, 2))(q, k, v)
    mine = jax.jit(jax.grad(loss(got), (0, 1, 2)))(q, k, v)
    for a, b in zip(mine, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_bfloat16_attention_is_close_to_float32():
    """bfloat16 inputs (the accelerator runs): float32 scores and softmax, so the output and
    gradients stay within bfloat16's rounding of the float32 ones."""
    q, k, v, mask = _inputs()
    f = lambda dt: lambda q, k, v: jnp.sum(ops.attention(q, k, v, mask, 0.35, dt)
                                           .astype(jnp.float32) ** 2)
    bf = lambda x: x.astype(jnp.bfloat16)
    g32 = jax.grad(f(jnp.float32), (0, 1, 2))(q, k, v)
    g16 = jax.jit(jax.grad(f(jnp.bfloat16), (0, 1, 2)))(bf(q), bf(k), bf(v))
    for a, b in zip(g16, g32, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=0.1, rtol=0.05)
