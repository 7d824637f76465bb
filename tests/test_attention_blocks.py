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


def test_decoder_in_blocks_on_the_mesh_equals_one_block(monkeypatch):
    """The model's forward with a budget that makes blocks of 3 queries (of 13, with a
    tail) on (2,2,2) gives the logits of the one-block forward on one device; the blocks
    are really used."""
    cfg = ModelConfig.from_hf(dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, model_type="qwen2"))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (4, 13)).astype(np.int32)
    mask = np.ones((4, 13), np.int32)
    mask[0, :5] = 0

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
