"""Sampling functions against NumPy references and a chi-square test; the engine's JetStream API
(prefill / insert / generate / generate_steps) against the full forward, and its layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from scipy import stats

from rlhf_jax.errors import ConfigError, DataError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import KVCache, Model, ModelConfig
from rlhf_jax.models.stacking import per_layer_params
from rlhf_jax.rollout import Engine, SamplingParams, default_buckets, filter_logits, sample_tokens
from rlhf_jax.rollout.sampling import request_keys

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


def _np_filtered_probs(logits, temperature, top_k, top_p):
    """The sampling distribution by hand: temperature, then top-k, then nucleus."""
    x = logits / temperature
    if top_k > 0:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 3, 1.0), (1.0, -1, 0.8), (0.8, 5, 0.7),
])
def test_filter_logits_matches_numpy(temperature, top_k, top_p):
    got = filter_logits(jnp.asarray(LOGITS)[None], temperature=temperature, top_k=top_k,
                        top_p=top_p)
    got_p = np.asarray(jax.nn.softmax(got, axis=-1))[0]
    want = _np_filtered_probs(LOGITS.astype(np.float64), temperature, top_k, top_p)
    np.testing.assert_allclose(got_p, want, atol=1e-6)
    assert np.array_equal(np.isinf(np.asarray(got))[0], want == 0)


def test_top_p_keeps_at_least_the_most_likely_token():
    got = np.asarray(filter_logits(jnp.asarray(LOGITS)[None], top_p=1e-6))[0]
    assert np.isfinite(got).sum() == 1 and np.isfinite(got[0])


def test_top_k_1_equals_greedy():
    logits = jax.random.normal(jax.random.key(0), (64, 40)) * 3
    keys = request_keys(jax.random.key(1), jnp.arange(64), jnp.zeros(64, jnp.int32))
    both = jax.jit(lambda lg, k: (
        sample_tokens(lg, k, SamplingParams(temperature=0.9, top_k=1)),
        sample_tokens(lg, k, SamplingParams(do_sample=False))))
    (top1, lp, raw), (greedy, _, raw_g) = both(logits, keys)
    np.testing.assert_array_equal(top1, jnp.argmax(logits, -1))
    np.testing.assert_array_equal(top1, greedy)
    np.testing.assert_allclose(lp, 0.0, atol=1e-6)  # a point mass
    np.testing.assert_allclose(raw, raw_g)
    np.testing.assert_allclose(raw, jax.nn.log_softmax(logits)[jnp.arange(64), greedy],
                               atol=1e-6)


def test_sampled_frequencies_match_the_filtered_softmax():
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    n = 20_000
    keys = request_keys(jax.random.key(3), jnp.arange(n), jnp.full(n, 5, jnp.int32))
    tokens, log_probs, raw = jax.jit(lambda k: sample_tokens(
        jnp.broadcast_to(jnp.asarray(LOGITS), (n, len(LOGITS))), k, params))(keys)
    want = _np_filtered_probs(LOGITS.astype(np.float64), 0.8, 6, 0.9)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    support = want > 0
    assert counts[~support].sum() == 0
    assert support.sum() == 4  # top-p cuts inside the top-k set
    p = stats.chisquare(counts[support], n * want[support]).pvalue
    assert p > 1e-3, (counts, n * want)
    # Reported log-probs are those of the sampling distribution and of the raw softmax.
    np.testing.assert_allclose(np.exp(log_probs), want[np.asarray(tokens)], rtol=1e-5)
    raw_want = np.asarray(jax.nn.log_softmax(jnp.asarray(LOGITS)))[np.asarray(tokens)]
    np.testing.assert_allclose(raw, raw_want, atol=1e-6)


def test_first_argmax_and_draws_match_jax():
    from rlhf_jax.rollout.sampling import first_argmax

    x = np.array(jax.random.normal(jax.random.key(0), (64, 40)))
    x[0, [3, 9]] = x[0].max() + 1  # a tie: the first index wins
    x[1, [5, 7]] = np.nan  # a NaN counts as the maximum, as in jnp.argmax
    x[2, :] = -np.inf
    np.testing.assert_array_equal(jax.jit(first_argmax)(jnp.asarray(x)), jnp.argmax(x, -1))
    # the draws are jax.random.categorical's for the same keys
    keys = request_keys(jax.random.key(1), jnp.arange(64), jnp.zeros(64, jnp.int32))
    logits = jnp.asarray(x[3:])
    got = jax.jit(lambda lg, k: sample_tokens(lg, k, SamplingParams()))(logits, keys[3:])[0]
    np.testing.assert_array_equal(got, jax.vmap(jax.random.categorical)(keys[3:], logits))


def test_greedy_as_an_argument_matches_the_static_choice():
    """One program for both: `greedy` traced gives the tokens and log-probs of the static
    greedy and sampled rules, bit for bit (a filtered rule; the default one is the engine
    tests' and every run's)."""
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8)
    logits = jax.random.normal(jax.random.key(2), (32, 40)) * 2
    keys = request_keys(jax.random.key(4), jnp.arange(32), jnp.zeros(32, jnp.int32))
    dynamic = jax.jit(lambda lg, k, g: sample_tokens(lg, k, params.program(), g))
    for greedy in (False, True):
        rule = SamplingParams(temperature=params.temperature, top_k=params.top_k,
                              top_p=params.top_p, do_sample=not greedy)
        want = jax.jit(lambda lg, k, rule=rule: sample_tokens(lg, k, rule))(logits, keys)
        got = dynamic(logits, keys, jnp.bool_(greedy))
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert SamplingParams(do_sample=False, temperature=0.0).program() == SamplingParams()


def test_request_keys_depend_on_request_and_position_only():
    rng = jax.random.key(0)
    a = jax.random.key_data(request_keys(rng, jnp.array([5, 6]), jnp.array([0, 0])))
    b = jax.random.key_data(request_keys(rng, jnp.array([6, 5, 5]), jnp.array([0, 0, 1])))
    np.testing.assert_array_equal(a[0], b[1])
    np.testing.assert_array_equal(a[1], b[0])
    assert not np.array_equal(b[1], b[2])


def test_sampling_params_validation():
    assert SamplingParams(eos_ids=2, top_k=0).eos_ids == (2,)
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(temperature=0.0).greedy
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                dict(max_response_length=0)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


# ------------------------------------------------------------------------------ engine API

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def setup():
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    model = Model(CFG)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.1 + (s.ndim == 1)).astype(
        s.dtype), model.abstract_params())
    engine = Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=4,
                    max_prefill_length=8, max_decode_length=6, compiler_options=FAST_COMPILE,
                    sampling=SamplingParams(do_sample=False))
    params = engine.load_params(host)
    return model, engine, params


def _argmax_continuation(model, params, prompt, steps, width=16):
    """(token, log-prob) of greedy decoding by the full forward, left-padded to `width`."""
    fwd = jax.jit(model.forward)
    out, seq = [], list(prompt)
    for _ in range(steps):
        x = np.zeros((1, width), np.int32)
        m = np.zeros((1, width), np.int32)
        x[0, width - len(seq):], m[0, width - len(seq):] = seq, 1
        logits = np.asarray(fwd(params, x, m))[0, -1]
        tok = int(logits.argmax())
        out.append((tok, float(np.asarray(jax.nn.log_softmax(logits))[tok])))
        seq.append(tok)
    return out


def test_prefill_insert_generate_follow_the_full_forward(setup):
    model, engine, params = setup
    prompts = [[5, 9, 2], [7, 1, 1, 3, 30, 12]]
    tokens = np.zeros((2, 6), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    prefix, first = engine.prefill(params=params, padded_tokens=tokens, true_length=[3, 6])
    assert prefix.cache.length == 8  # padded to the bucket
    want = [_argmax_continuation(model, params, p, 5) for p in prompts]
    np.testing.assert_array_equal(np.asarray(first.tokens)[:, 0], [w[0][0] for w in want])
    state = engine.init_decode_state()
    state = engine.bulk_insert(prefix, state, [2, 0], rows=[0, 1])
    state, one = engine.generate(params, state)
    np.testing.assert_array_equal(np.asarray(one.tokens)[[2, 0], 0], [w[1][0] for w in want])
    np.testing.assert_array_equal(np.asarray(one.valid[:, 0]), [True, False, True, False])
    state, three = engine.generate_steps(params, state, 3)
    three = three.convert_to_numpy()
    for slot, w in ((2, want[0]), (0, want[1])):
        got = three.get_result_at_slot(slot)
        np.testing.assert_array_equal(got.tokens[0], [t for t, _ in w[2:5]])
        np.testing.assert_allclose(np.asarray(state.log_probs[slot, :5]), [lp for _, lp in w],
                                   atol=1e-5)
    np.testing.assert_array_equal(three.lengths[[2, 0]], [5, 5])
    assert not np.asarray(three.valid[[1, 3]]).any()

    # The decode state lives on the generate layout: slots over (data, fsdp), kv heads over
    # tensor; parameters are replicated over fsdp.
    assert state.cache.k.sharding.spec == P(None, ("data", "fsdp"), "tensor")
    assert state.tokens.sharding.spec == P(("data", "fsdp"))
    kernel = params["model"]["layers"]["mlp"]["gate_proj"]["kernel"]
    assert kernel.sharding.spec == P(None, None, "tensor")


def test_greedy_and_sampled_rollouts_share_their_programs(setup):
    """A greedy validation and a sampled rollout of one rule compile one prefill and one
    generate program (greedy is an argument), and each gets its own tokens."""
    model, shared, params = setup
    engine = Engine(model, shared.mesh, shared.rules, max_concurrent_decodes=4,
                    max_prefill_length=8, max_decode_length=6, compiler_options=FAST_COMPILE)
    tokens = np.array([[5, 9, 2, 0, 0, 0, 0], [7, 1, 1, 3, 30, 12, 4]], np.int32)
    out = {}
    for greedy in (True, False):
        rule = SamplingParams(do_sample=not greedy, temperature=0.0 if greedy else 1.0)
        prefix, first = engine.prefill(params=params, padded_tokens=tokens,
                                       true_length=[3, 7], sampler=rule, rng=jax.random.key(9))
        state = engine.bulk_insert(prefix, engine.init_decode_state(jax.random.key(9)),
                                   [0, 1], rows=[0, 1])
        state, more = engine.generate_steps(params, state, 3, rule)
        out[greedy] = np.concatenate([np.asarray(first.tokens)[:, 0:1],
                                      np.asarray(more.tokens)[:2]], axis=1)
    assert sorted(k[0] for k in engine.trace_counts) == ["generate", "init", "insert",
                                                         "prefill"], engine.trace_counts
    assert set(engine.trace_counts.values()) == {1}
    assert not np.array_equal(out[True], out[False])  # the sampled draw ran


def _keys_positions_minor(k):
    """The cache's keys [L, B, K, S, H] as [L, B, K, H, S]."""
    return jnp.swapaxes(k, 3, 4)


def _decode_inputs(model, seed: int, keys_positions_minor: bool = True):
    """A random cache of 12 positions (values [L, 4, K, 12, H], keys [L, 4, K, H, 12], the CPU
    layout, or like the values), one token per row and the rows' write indices."""
    rng = np.random.default_rng(seed)
    shape = model.init_cache(4, 12).v.shape
    k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    cache = KVCache(_keys_positions_minor(k) if keys_positions_minor else k, v)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 1)), jnp.int32)
    return cache, ids, jnp.asarray([0, 3, 5, 7], jnp.int32)


def test_per_layer_cache_decodes_like_the_stacked_one(setup):
    """The decode loop's per-layer cache (unrolled layers, blocks in place), with the stacked
    parameters or their `per_layer_params` split, gives the same logits and the same written
    cache as the stacked cache (scanned layers), sharded."""
    model, _, params = setup
    cache, ids, wi = _decode_inputs(model, 1)
    step = jax.jit(model.decode)
    want_logits, want_cache = step(params, ids, wi[:, None], cache, wi)
    split = per_layer_params(params)
    layers = split["model"]["layers"]
    assert isinstance(layers, tuple) and len(layers) == CFG.num_hidden_layers
    np.testing.assert_array_equal(layers[1]["mlp"]["up_proj"]["kernel"],
                                  params["model"]["layers"]["mlp"]["up_proj"]["kernel"][1])
    assert per_layer_params(split) is split
    for p in (params, split):
        got_logits, got_cache = step(p, ids, wi[:, None], cache.per_layer(), wi)
        assert isinstance(got_cache.k, tuple) and len(got_cache.k) == CFG.num_hidden_layers
        np.testing.assert_allclose(got_logits, want_logits, atol=1e-6, rtol=0)
        for got, want in zip(got_cache.stacked(), want_cache, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert not np.allclose(want_cache.k, cache.k)  # the step wrote something
    # CPU's decode loop holds each block in chunks of positions (`decode_chunks`): the rows
    # write into chunks 0 and 1 and attend over chunks 0, 0-1 and 0-2 (a `lax.switch`)
    axes = (4, 3)  # the positions of the stacked keys [L, B, K, H, S] and values
    for chunks, last in (((4, 8), 2), ((8,), 1), ((4,), 1)):
        split_cache = cache.per_layer(chunks, axes)
        assert split_cache.length == 12 and len(split_cache.v[0]) == len(chunks) + 1
        for got, want in zip(split_cache.stacked(axes), cache, strict=True):
            np.testing.assert_array_equal(got, want)
        for w in (wi, jnp.minimum(wi, chunks[0] - 1)):  # the newest key in the last or first
            want_logits, want_cache = step(params, ids, w[:, None], cache, w)
            got_logits, got_cache = step(split, ids, w[:, None], split_cache, w)
            assert got_cache.v[1][last].shape[2] == 12 - chunks[-1]
            np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=0)
            for got, want in zip(got_cache.stacked(axes), want_cache, strict=True):
                np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_one_token_decode_as_products_equals_the_contraction(setup, monkeypatch, request):
    """CPU's products-and-sums decode attention over keys stored [L, B, K, H, S]
    (`transposed_keys`) and the batched contraction used off CPU (`decode_as_products`) over
    keys [L, B, K, S, H] give the same logits and cache; so do the products over keys
    [L, B, K, S, H]. The contraction adds its two attention matmuls to the (scanned) layer
    body."""
    from rlhf_jax.models import transformer

    model, _, params = setup
    cache, ids, wi = _decode_inputs(model, 2, keys_positions_minor=False)
    monkeypatch.setattr(transformer, "TRANSPOSED_KEYS", False)
    args = (params, ids, wi[:, None], cache, wi)
    dots = lambda *a: str(jax.make_jaxpr(model.decode)(*a)).count("dot_general")
    assert transformer.decode_as_products()  # the CPU default
    products = jax.jit(model.decode)(*args)
    n_products = dots(*args)
    monkeypatch.setattr(transformer, "TRANSPOSED_KEYS", None)
    assert transformer.transposed_keys()  # the CPU default
    t_args = (*args[:3], KVCache(_keys_positions_minor(cache.k), cache.v), wi)
    request.addfinalizer(jax.clear_caches)  # no program of another layout outlives the test
    jax.clear_caches()  # the layout is read when a program is traced
    logits, t_cache = jax.jit(model.decode)(*t_args)
    assert dots(*t_args) == n_products
    monkeypatch.setattr(transformer, "TRANSPOSED_KEYS", False)
    monkeypatch.setattr(transformer, "decode_as_products", lambda: False)
    jax.clear_caches()
    contraction = jax.jit(model.decode)(*args)
    assert dots(*args) == n_products + 2
    for got_logits, got_cache in (products, contraction):
        np.testing.assert_allclose(got_logits, logits, atol=1e-5, rtol=1e-5)
        # later layers: rounding apart
        np.testing.assert_allclose(_keys_positions_minor(got_cache.k), t_cache.k, atol=1e-5,
                                   rtol=1e-5)
        np.testing.assert_allclose(got_cache.v, t_cache.v, atol=1e-5, rtol=1e-5)
    assert not np.allclose(t_cache.k, t_args[3].k)  # the step wrote the transposed keys


@pytest.mark.parametrize("keys_positions_minor", [True, False])
def test_existing_prefix_continues_the_prompt(setup, keys_positions_minor, monkeypatch):
    """A prefill on top of an existing prefix gives the whole prompt's cache and first token,
    in either key layout (`transposed_keys`: CPU's, or the accelerators')."""
    from rlhf_jax.models import transformer

    model, engine, params = setup
    if not keys_positions_minor:  # a new engine: programs are traced with the layout
        monkeypatch.setattr(transformer, "TRANSPOSED_KEYS", False)
        engine = Engine(model, engine.mesh, engine.rules, max_concurrent_decodes=4,
                        max_prefill_length=8, max_decode_length=6,
                        compiler_options=FAST_COMPILE, sampling=SamplingParams(do_sample=False))
    whole, _ = engine.prefill(params=params, padded_tokens=[[4, 8, 15, 16, 23, 0, 0, 0]],
                              true_length=5)
    head, _ = engine.prefill(params=params, padded_tokens=[[4, 8, 15, 0, 0, 0, 0, 0]],
                             true_length=3)
    both, res = engine.prefill(params=params, existing_prefix=head,
                               padded_tokens=[[16, 23, 0, 0]], true_length=2)
    assert int(both.true_length[0]) == 5
    assert int(res.tokens[0, 0]) == int(whole.tokens[0, 0])
    key_axis = 4 if keys_positions_minor else 3
    assert both.cache.k.shape[key_axis] == both.cache.v.shape[3] == 12  # 8 + 4 positions
    for got, want, axis in zip(both.cache, whole.cache, (key_axis, 3), strict=True):
        np.testing.assert_allclose(jax.lax.slice_in_dim(got, 0, 5, axis=axis),
                                   jax.lax.slice_in_dim(want, 0, 5, axis=axis), atol=1e-5)


def test_engine_properties_buckets_and_errors(setup):
    _, engine, params = setup
    assert engine.max_concurrent_decodes == 4 and engine.max_prefill_length == 8
    assert engine.samples_per_slot == 1 and engine.cache_length == 14
    assert engine.prefill_buckets == (8,)
    assert default_buckets(100) == (16, 32, 64, 100) and default_buckets(16) == (16,)
    with pytest.raises(DataError, match="exceeds max_prefill_length 8"):
        engine.prefill(params=params, padded_tokens=np.zeros((1, 9), np.int32), true_length=9)
    with pytest.raises(ConfigError, match="exceeds the engine's max_decode_length 6"):
        engine.resolve_sampling(SamplingParams(max_response_length=7))
    with pytest.raises(ConfigError, match="prefill_buckets"):
        Engine(engine.model, engine.mesh, engine.rules, max_prefill_length=8,
               prefill_buckets=(4, 16))
    sh = engine.get_prefix_destination_sharding()
    assert sh.cache.k.spec == P(None, None, "tensor")  # one prompt: batch replicated
