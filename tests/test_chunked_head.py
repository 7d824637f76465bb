"""The chunked LM head (rlhf_jax/models/head.py): the full-logits path's numbers and
gradients, no float32 [tokens, vocab] buffer, sharded == single device, the config key."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import batching, core_algos
from rlhf_jax import train_steps as ts
from rlhf_jax.benchmarks.mfu import FAST_COMPILE
from rlhf_jax.config import ConfigError, load_config
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig, head

V = 61  # a vocabulary no other dimension equals


def _cfg(tie: bool, vocab: int = V, layers: int = 1) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, tie_word_embeddings=tie)


def _close(a, b, atol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


# ------------------------------------------------------------------ the array function


def _reference(h, w, y, layout, temperature):
    eq = "BWD,VD->BWV" if layout == "vd" else "BWD,DV->BWV"
    z = jnp.einsum(eq, h, w) / temperature
    return core_algos.logprobs_from_logits(z, y), core_algos.entropy_from_logits(z)


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_token_terms_equal_full_logits_values_and_gradients(layout, entropy_grad):
    """13 positions in chunks of 5 (the last one padded), temperature 0.7: log-probs,
    entropy and the gradients w.r.t. hidden states and weight, with and without the
    entropy's gradient."""
    rng = np.random.default_rng(0)
    b, w_len, d = 3, 13, 16
    h = jnp.asarray(rng.normal(size=(b, w_len, d)), jnp.float32)
    shape = (V, d) if layout == "vd" else (d, V)
    w = jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
    y = jnp.asarray(rng.integers(0, V, (b, w_len)), jnp.int32)
    # per-token loss weights over the token count, as a token-mean loss has them
    a = jnp.asarray(rng.normal(size=(b, w_len)) / (b * w_len), jnp.float32)
    c = jnp.asarray(rng.normal(size=(b, w_len)) / (b * w_len), jnp.float32)
    spec = head.HeadSpec(chunk=5, temperature=0.7, layout=layout, entropy_grad=entropy_grad)

    def chunked(h, w):
        logp, ent = head.token_terms(h, w, y, spec)
        return jnp.sum(a * logp) + jnp.sum(c * ent), (logp, ent)

    def full(h, w):
        logp, ent = _reference(h, w, y, layout, 0.7)
        ent = ent if entropy_grad else jax.lax.stop_gradient(ent)
        return jnp.sum(a * logp) + jnp.sum(c * ent), (logp, ent)

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)
    (l1, terms1), g1 = jax.jit(grad(chunked))(h, w)
    (l0, terms0), g0 = jax.jit(grad(full))(h, w)
    _close(terms1, terms0)
    _close(g1, g0)
    assert float(jnp.abs(g1[1]).max()) > 1e-3  # the weight does get a gradient


def test_token_terms_without_entropy_and_one_chunk():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(V, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, V, (2, 7)), jnp.int32)
    want, _ = _reference(h, w, y, "vd", 1.0)
    for chunk in (1, 7):
        logp, ent = head.token_terms(h, w, y, head.HeadSpec(chunk=chunk, with_entropy=False))
        _close(logp, want)
        assert not np.asarray(ent).any()


def test_chunk_positions():
    model = Model(_cfg(True, vocab=100))
    assert head.chunk_positions(0, model, (4, 50)) == 0  # off
    assert head.chunk_positions(None, model, (4, 50)) == 0  # tiny logits: the full path
    assert head.chunk_positions(40, model, (4, 50)) == 10  # 40 tokens = 4 rows x 10
    assert head.chunk_positions(1, model, (4, 50)) == 1  # at least one position
    assert head.chunk_positions(10**6, model, (4, 50)) == 50  # at most the window
    # balanced: 3 chunks of 17 rather than 24 + 24 + 2
    assert head.chunk_positions(96, model, (4, 50)) == 17
    big = Model(_cfg(True, vocab=151936))  # 4 x 2048 x 151936 x 4 bytes: 5 GB of logits
    c = head.chunk_positions(None, big, (4, 2048))
    assert 0 < c * 4 * 151936 * 4 <= 1.05 * head.AUTO_CHUNK_BYTES


# ------------------------------------------------------------------ through the model


def _seqs(b=4, t=20, w=13, vocab=V, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[::2, :3] = 0  # left padding
    resp_mask = (np.arange(w)[None] < rng.integers(1, w + 1, (b, 1))).astype(np.int32)
    return ts.Sequences.padded(ids, mask, ids[:, -w:], resp_mask)


@pytest.mark.parametrize("tie", [True, False])
def test_hidden_through_head_weight_is_forward(tie):
    model = Model(_cfg(tie))
    mesh = make_mesh(load_mesh_spec("single"))
    params = model.init(jax.random.key(0), mesh, ())
    s = _seqs()
    kw = dict(head_slice=s.head_slice, positions=s.positions, segment_ids=s.segment_ids)
    logits = model.forward(params, s.input_ids, **kw)
    w, layout = model.head_weight(params)
    h = model.hidden(params, s.input_ids, **kw)
    eq = "BTD,VD->BTV" if layout == "vd" else "BTD,DV->BTV"
    np.testing.assert_allclose(jnp.einsum(eq, h, w), logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tie, entropy_coeff", [(True, 0.05), (False, 0.0)])
def test_response_terms_gradients_equal_full_logits(tie, entropy_coeff):
    """Gradients w.r.t. every parameter (the tied embedding gets both the lookup's and the
    head's) of a loss of log-probs and entropy, temperature 0.7, 13 positions in chunks."""
    model = Model(_cfg(tie))
    mesh = make_mesh(load_mesh_spec("single"))
    params = model.init(jax.random.key(0), mesh, ())
    s = _seqs()
    weights = jnp.linspace(0.5, 1.5, 13)

    def loss(p, chunk):
        logp, ent = ts.response_terms(model, p, s, 0.7, chunk,
                                      entropy_grad=bool(entropy_coeff))
        return jnp.sum(logp * weights) + entropy_coeff * jnp.sum(ent), (logp, ent)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, full_terms), full_g = grad(params, 0)
    (_, chunk_terms), chunk_g = grad(params, 20)  # 20 tokens = 4 rows x 5 positions
    _close(chunk_terms, full_terms)
    _close(chunk_g, full_g)


def test_log_probs_step_chunked_equals_full():
    model = Model(_cfg(True))
    mesh = make_mesh(load_mesh_spec("single"))
    params = model.init(jax.random.key(0), mesh, ())
    s = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), _seqs())  # [K=2, m=2, ...]
    step = functools.partial(ts.log_probs_step, model=model, temperature=0.9,
                             with_entropy=True)
    _close(jax.jit(functools.partial(step, lm_head_chunk_size=6))(params, s),
           jax.jit(functools.partial(step, lm_head_chunk_size=0))(params, s))


# ---------------------------------------------------------------- the compiled update

N, P, R = 16, 5, 11


def _batch(mesh, axes, vocab=V, micro=4, r=R):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, (N, P)).astype(np.int32)
    resp = rng.integers(0, vocab, (N, r)).astype(np.int32)
    pmask = np.ones((N, P), np.int32)
    pmask[::3, :2] = 0
    rmask = (np.arange(r)[None] < rng.integers(1, r + 1, (N, 1))).astype(np.int32)
    seqs = ts.Sequences.padded(np.concatenate([prompt, resp], 1),
                               np.concatenate([pmask, rmask], 1), resp, rmask)
    old = (rng.normal(-4.0, 0.3, (N, r)) * rmask).astype(np.float32)
    adv = (rng.normal(0.0, 1.0, (N, r)) * rmask).astype(np.float32)
    plan = batching.Plan(N, mini_batch=8, micro_batch=micro, epochs=1, shuffle=False)
    host = jax.tree.map(lambda x: x[plan.order(0)], (seqs, old, adv, old))
    mask = host[0].response_mask
    tok = jnp.asarray(mask.sum(axis=(1, 2, 3)), jnp.float32)
    sq = jnp.asarray((mask.sum(-1) > 0).sum(axis=(1, 2)), jnp.float32)
    s, o, a, r = batching.put(host, mesh, axes, lead=2)
    return ts.ActorBatch(s, o, a, r, tok, sq)


def _update(mesh_name, chunk, tie=True, entropy_coeff=0.01, micro=4):
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    model = Model(_cfg(tie)).with_layout(mesh, spec.train_rules)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-3, grad_clip=1.0)
    state = ts.init_state(params, ts.make_optimizer(optim))
    loss = ts.ActorLoss(entropy_coeff=entropy_coeff, use_kl_loss=True, temperature=0.8,
                        lm_head_chunk_size=chunk)
    step = jax.jit(functools.partial(ts.actor_update, model=model, loss=loss, optim=optim),
                   compiler_options=FAST_COMPILE)
    state, metrics = step(state, _batch(mesh, dict(spec.train_rules)["batch"], micro=micro))
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.parametrize("tie", [pytest.param(True, marks=pytest.mark.slow), False])
def test_sharded_chunked_update_equals_single_device_full_logits(tie):
    """The actor update with the chunked head on (2,2,2) (4 tokens a device per chunk:
    1 row x 4 positions of 11) gives the parameters and metrics of the full-logits update on
    one device."""
    p_full, m_full = _update("single", 0, tie)
    p_mesh, m_mesh = _update("cpu-8", 4, tie)
    _close(p_mesh, p_full)
    for k in m_full:
        np.testing.assert_allclose(m_mesh[k], m_full[k], rtol=1e-4, atol=1e-6, err_msg=k)


_F32 = re.compile(r"f32\[([0-9,]+)\]")


def _logits_buffers(hlo_text, vocab, rows, positions):
    """The f32 arrays of a compiled (per-device) program that hold a vocabulary dim (whole
    or halved by the tensor axis) and either a micro-batch's positions or tokens, or as many
    elements as its logits on one device."""
    shapes = {tuple(int(x) for x in m.split(",")) for m in _F32.findall(hlo_text)}
    vocabs, tokens = {vocab, vocab // 2}, {positions, rows * positions}
    return sorted(s for s in shapes if vocabs & set(s) and (
        tokens & set(s) or np.prod(s) >= rows * positions * (vocab // 2)))


def test_compiled_chunked_update_has_no_full_logits_buffer():
    """The compiled (2,2,2) update and log-prob pass: no f32 buffer with a micro-batch's
    tokens and the vocabulary (the full-logits update has them, so the check sees them), and
    less than half the full-logits update's temporary memory."""
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    vocab, r = 4098, 40  # the vocabulary halved by tensor=2, 40 positions a row
    model = Model(_cfg(True, vocab)).with_layout(mesh, spec.train_rules)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-3)
    state = ts.init_state(params, ts.make_optimizer(optim))
    batch = _batch(mesh, dict(spec.train_rules)["batch"], vocab=vocab, micro=8, r=r)
    rows = 2  # a micro-batch of 8 rows over data x fsdp = 4

    def compiled(chunk):
        loss = ts.ActorLoss(entropy_coeff=0.01, lm_head_chunk_size=chunk)
        step = functools.partial(ts.actor_update, model=model, loss=loss, optim=optim)
        return jax.jit(step).lower(state, batch).compile()

    chunked, full = compiled(16), compiled(0)  # 16 tokens a device: 2 rows x 8 positions
    assert _logits_buffers(full.as_text(), vocab, rows, r)
    assert not _logits_buffers(chunked.as_text(), vocab, rows, r)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(chunked) < 0.5 * temp(full)
    seqs = jax.tree.map(lambda x: x[0], batch.seqs)  # [K, m, ...] of one mini-batch
    lp = jax.jit(functools.partial(ts.log_probs_step, model=model, temperature=1.0,
                                   lm_head_chunk_size=16)).lower(params, seqs).compile()
    assert not _logits_buffers(lp.as_text(), vocab, rows, r)


# ------------------------------------------------------------------------- the config


def test_config_key_reaches_the_loss_and_negative_is_refused():
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    cfg = load_config(None, base)
    assert cfg.actor_rollout_ref.actor.lm_head_chunk_size is None
    assert cfg.actor_rollout_ref.ref.lm_head_chunk_size is None
    cfg = load_config(None, [*base, "actor_rollout_ref.actor.lm_head_chunk_size=512"])
    assert ts.ActorLoss.from_config(cfg.actor_rollout_ref.actor, 1.0).lm_head_chunk_size == 512
    for role in ("actor", "ref"):
        with pytest.raises(ConfigError, match=rf"^actor_rollout_ref.{role}.lm_head_chunk_size: "
                                              r"must be >= 0"):
            load_config(None, [*base, f"actor_rollout_ref.{role}.lm_head_chunk_size=-1"])


@pytest.mark.slow
def test_benchmark_small():
    """`scripts/bench.py chunked_head` on a tiny head: the figures are there and sane."""
    from rlhf_jax.benchmarks import chunked_head

    out = chunked_head.run(small=True, repeats=1)
    assert out["chunked_head.logprob_max_abs_diff"] <= 1e-5
    assert 0 < out["chunked_head.temp_bytes_ratio"] < 1
    assert out["chunked_head.time_ratio"] > 0 and out["chunked_head.time_rows"] == 2
