"""The RL rollout driver: parity with the full forward, mesh and slot independence,
continuous batching, compile counts, and prompt-length errors."""

import dataclasses

import jax
import numpy as np
import pytest

from rlhf_jax.errors import DataError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences, prompt_rows, reshard
from rlhf_jax.rollout.program_cache import abstract

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
R = 10  # max response length
GREEDY = SamplingParams(do_sample=False, max_response_length=R)
SAMPLED = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_response_length=R,
                         eos_ids=(3, 7, 11), pad_id=47)
LENGTHS = [3, 9, 14, 6, 11, 1]  # real prompt tokens, left-padded to P
P = 14
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # tiny programs: compile time dominates


def _mesh(name):
    spec = load_mesh_spec(name)
    return make_mesh(spec), spec


@pytest.fixture(scope="module")
def model():
    return Model(CFG)


def random_params(model, mesh, rules, seed=0, scale=0.1):
    """Random parameters (matrices N(0, scale^2), vectors around 1) without compiling init."""
    rng = np.random.default_rng(seed)

    def one(s):
        x = rng.normal(size=s.shape) * scale
        return (x + (1.0 if s.ndim == 1 else 0.0)).astype(s.dtype)

    host = jax.tree.map(one, model.abstract_params())
    return jax.device_put(host, model.shardings(mesh, rules))


@pytest.fixture(scope="module")
def params(model):
    """Train-layout parameters on the (2,2,2) mesh, large enough that logits are peaked."""
    mesh, spec = _mesh("cpu-8")
    return random_params(model, mesh, spec.train_rules)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    ids = np.zeros((len(LENGTHS), P), np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, P - n:] = rng.integers(0, CFG.vocab_size, n)
        mask[i, P - n:] = 1
    return ids, mask


_ENGINES = {}


def engine(model, mesh_name: str, slots: int) -> Engine:
    key = (mesh_name, slots)
    if key not in _ENGINES:
        mesh, spec = _mesh(mesh_name)
        _ENGINES[key] = Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=slots,
                               max_prefill_length=16, max_decode_length=R,
                               prefill_buckets=(8, 16), compiler_options=FAST_COMPILE)
    return _ENGINES[key]


_RUNS = {}


def on_mesh(model, params, mesh_name):
    e = engine(model, mesh_name, 4)
    return params if mesh_name == "cpu-8" else jax.device_put(
        params, model.shardings(e.mesh, e.rules))


def rollout(model, params, prompts, mesh_name, slots, sampling, n):
    """Cached rollouts: most tests run on one device (fast compiles); the (2,2,2) mesh is
    compared with it, and the engine tests check its layouts."""
    key = (mesh_name, slots, sampling, n)
    if key not in _RUNS:
        e = engine(model, mesh_name, slots)
        _RUNS[key] = generate_sequences(e, on_mesh(model, params, mesh_name), *prompts, n=n,
                                        sampling=sampling, rng=jax.random.key(42))
    return _RUNS[key]


def _reference_greedy(model, params, ids, mask, steps):
    """Step-by-step argmax of the full forward without a cache, on a fixed-width buffer."""
    fwd = jax.jit(model.forward)
    width = ids.shape[1] + steps
    toks, lps = [], []
    for i in range(ids.shape[0]):
        seq = list(ids[i][mask[i].astype(bool)])
        row_t, row_l = [], []
        for _ in range(steps):
            buf = np.zeros((1, width), np.int32)
            m = np.zeros((1, width), np.int32)
            buf[0, width - len(seq):] = seq
            m[0, width - len(seq):] = 1
            logits = np.asarray(fwd(params, buf, m))[0, -1]
            tok = int(np.argmax(logits))
            row_t.append(tok)
            row_l.append(float(jax.nn.log_softmax(logits)[tok]))
            seq.append(tok)
        toks.append(row_t)
        lps.append(row_l)
    return np.array(toks), np.array(lps)


def test_greedy_matches_full_forward_argmax(model, params, prompts):
    out = rollout(model, params, prompts, "single", 4, GREEDY, 1)
    want_tok, want_lp = _reference_greedy(model, params, *prompts, R)
    np.testing.assert_array_equal(out.responses, want_tok)
    np.testing.assert_allclose(out.rollout_log_probs, want_lp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.rollout_raw_log_probs, want_lp, atol=1e-5, rtol=0)
    assert out.response_mask.all() and (out.response_lengths == R).all()


def test_truncation_left_equals_cut_prompts(model, params, prompts):
    ids, mask = prompts
    long_ids = np.concatenate([np.full((len(ids), 4), 5, np.int32), ids], axis=1)
    long_mask = np.concatenate([np.ones((len(ids), 4), np.int32), mask], axis=1)
    e = engine(model, "single", 4)
    params = on_mesh(model, params, "single")
    with pytest.raises(DataError, match=r"^prompt 2 has 18 tokens, more than "
                                        r"max_prefill_length 16 \(set truncation"):
        generate_sequences(e, params, long_ids, long_mask, sampling=GREEDY)
    rows = prompt_rows(long_ids, long_mask, 16, "left")
    assert [len(r) for r in rows] == [7, 13, 16, 10, 15, 5]
    assert (rows[2] == long_ids[2, -16:]).all()
    right = prompt_rows(long_ids, long_mask, 16, "right")
    assert (right[2] == long_ids[2, :16]).all()

    out = generate_sequences(e, params, long_ids, long_mask, sampling=GREEDY, rng=42,
                             truncation="left")
    cut_ids = np.zeros((len(ids), 16), np.int32)
    cut_mask = np.zeros_like(cut_ids)
    for i, r in enumerate(rows):
        cut_ids[i, 16 - len(r):] = r
        cut_mask[i, 16 - len(r):] = 1
    want = generate_sequences(e, params, cut_ids, cut_mask, sampling=GREEDY, rng=42)
    np.testing.assert_array_equal(out.responses, want.responses)


def test_empty_prompt_is_data_error(model, params, prompts):
    ids, mask = prompts
    mask = mask.copy()
    mask[4] = 0
    with pytest.raises(DataError, match="^prompt 4 is empty"):
        generate_sequences(engine(model, "single", 4), params, ids, mask, sampling=GREEDY)


def test_sampled_rollout_layout_eos_and_padding(model, params, prompts):
    n = 3
    out = rollout(model, params, prompts, "single", 4, SAMPLED, n)
    b = len(LENGTHS)
    assert out.responses.shape == (b * n, R)
    np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(b), n))
    lengths = out.response_lengths
    assert len(set(lengths.tolist())) > 2, lengths  # EOS makes lengths differ
    for row, k in zip(out.responses, lengths, strict=True):
        eos = np.isin(row[:k], SAMPLED.eos_ids)
        assert not eos[:k - 1].any()  # nothing is generated after an EOS
        assert k == R or eos[k - 1]  # a short response ends with its EOS, inside the mask
        assert (row[k:] == SAMPLED.pad_id).all()
    mask = np.arange(R)[None] < lengths[:, None]
    np.testing.assert_array_equal(out.response_mask, mask.astype(np.int32))
    assert (out.rollout_log_probs[~mask] == 0).all()
    assert (out.rollout_log_probs[mask] < 0).all()
    # The sampling distribution is filtered: its log-probs are above the untempered ones'
    # wherever the token is likely; both are finite.
    assert np.isfinite(out.rollout_raw_log_probs[mask]).all()
    # Samples of one prompt differ (distinct request ids), so the n draws are not copies.
    assert any(len({tuple(r) for r in out.responses[i * n:(i + 1) * n]}) > 1 for i in range(b))


def test_same_tokens_on_2x2x2_and_1x1x1_mesh(model, params, prompts):
    a = rollout(model, params, prompts, "cpu-8", 4, SAMPLED, 3)
    b = rollout(model, params, prompts, "single", 4, SAMPLED, 3)
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_array_equal(a.response_lengths, b.response_lengths)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5, rtol=0)


def test_independent_of_max_concurrent_decodes(model, params, prompts):
    a = rollout(model, params, prompts, "single", 4, SAMPLED, 3)
    b = rollout(model, params, prompts, "single", 16, SAMPLED, 3)
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_array_equal(a.response_lengths, b.response_lengths)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5, rtol=0)


def test_once_no_request_waits_the_slots_decode_to_the_end_in_one_call(model, params, prompts):
    """`steps_per_call` bounds the calls while requests wait for a slot; after that one call of
    `max_decode_length` steps decodes to the end. The tokens do not depend on the split."""
    key, mesh = jax.random.key(42), "single"

    def fresh(slots):  # not the shared engines: their compile counts are tested below
        e = engine(model, mesh, slots)
        return Engine(model, e.mesh, e.rules, max_concurrent_decodes=slots,
                      max_prefill_length=16, max_decode_length=R, prefill_buckets=(8, 16),
                      compiler_options=FAST_COMPILE)

    e16 = fresh(16)
    nobody_waits = generate_sequences(e16, on_mesh(model, params, mesh), *prompts, n=1,
                                      sampling=GREEDY, rng=key, steps_per_call=2)
    assert nobody_waits.stats["rollout/generate_calls"] == 1  # 6 requests, 16 slots
    assert [k[1] for k in e16.trace_counts if k[0] == "generate"] == [R]
    want = rollout(model, params, prompts, mesh, 16, GREEDY, 1)
    np.testing.assert_array_equal(nobody_waits.responses, want.responses)
    e4 = fresh(4)
    queued = generate_sequences(e4, on_mesh(model, params, mesh), *prompts, n=3,
                                sampling=SAMPLED, rng=key, steps_per_call=2)
    # 2-step calls while 18 requests pass through 4 slots, then one call for the rest
    assert sorted(k[1] for k in e4.trace_counts if k[0] == "generate") == [2, R]
    want = rollout(model, params, prompts, mesh, 4, SAMPLED, 3)
    np.testing.assert_array_equal(queued.responses, want.responses)
    np.testing.assert_array_equal(queued.response_lengths, want.response_lengths)
    assert queued.stats["rollout/decode_steps"] == want.stats["rollout/decode_steps"]


def _list_schedule_steps(durations, slots):
    """Steps to run jobs in order on `slots` machines, each free machine taking the next job
    at once (continuous batching); and with waves of `slots` jobs (static batching)."""
    free_at = [0] * slots
    for d in durations:
        i = free_at.index(min(free_at))
        free_at[i] += d
    waves = sum(max(durations[i:i + slots]) for i in range(0, len(durations), slots))
    return max(free_at), waves


def test_shares_of_the_prompts_sample_the_whole_batchs_tokens(model, params, prompts):
    """The one-step-off mode on several hosts: each host generates its share of the prompts
    with `prompt_offset`; the shares, joined, are the whole batch's rollout."""
    whole = rollout(model, params, prompts, "single", 4, SAMPLED, 3)
    e, ids, mask = engine(model, "single", 4), *prompts
    cut = len(ids) // 2
    parts = [generate_sequences(e, on_mesh(model, params, "single"), ids[lo:hi], mask[lo:hi],
                                n=3, sampling=SAMPLED, rng=jax.random.key(42),
                                prompt_offset=lo)
             for lo, hi in ((0, cut), (cut, len(ids)))]
    joined = {f: np.concatenate([getattr(p, f) for p in parts])
              for f in ("responses", "response_lengths", "rollout_log_probs")}
    np.testing.assert_array_equal(joined["responses"], whole.responses)
    np.testing.assert_array_equal(joined["response_lengths"], whole.response_lengths)
    np.testing.assert_allclose(joined["rollout_log_probs"], whole.rollout_log_probs, atol=1e-6)
    # without the offset the second share samples the first's keys: other tokens
    again = generate_sequences(e, on_mesh(model, params, "single"), ids[cut:], mask[cut:], n=3,
                               sampling=SAMPLED, rng=jax.random.key(42))
    assert not np.array_equal(again.responses, parts[1].responses)


def test_continuous_batching_refills_finished_slots(model, params, prompts):
    out = rollout(model, params, prompts, "single", 4, SAMPLED, 3)
    steps = out.stats["rollout/decode_steps"]
    # A request of k tokens needs k - 1 generate steps (prefill draws the first one).
    continuous, static = _list_schedule_steps(list(out.response_lengths - 1), 4)
    assert steps == continuous < static, (steps, continuous, static)
    assert steps < -(-len(out.responses) // 4) * R  # fewer than (requests / slots) * max_len
    assert out.stats["rollout/tokens_generated"] == out.response_lengths.sum()
    assert out.stats["rollout/prefill_prompts"] == len(LENGTHS)  # once for its n samples


def test_every_function_compiles_once_and_prefill_once_per_bucket(model, params, prompts):
    e = engine(model, "single", 4)
    rollout(model, params, prompts, "single", 4, SAMPLED, 3)
    rollout(model, params, prompts, "single", 4, GREEDY, 1)
    before = dict(e.trace_counts)
    ids, mask = prompts
    generate_sequences(e, on_mesh(model, params, "single"), ids[::-1].copy(), mask[::-1].copy(),
                       n=3, sampling=SAMPLED, rng=jax.random.key(7))
    assert dict(e.trace_counts) == before  # a new rollout with the same shapes: no retrace
    assert max(e.trace_counts.values()) == 1
    gen = [k for k in e.trace_counts if k[0] == "generate"]
    assert len(gen) == 2  # one per sampling rule, whole rollouts included
    buckets = {k[2] for k in e.trace_counts if k[0] == "prefill"}
    assert buckets <= set(e.prefill_buckets)


def test_train_layout_params_are_moved_to_the_generate_layout(model, params, prompts):
    e = engine(model, "cpu-8", 4)
    gen = reshard(params, e.param_shardings)
    assert reshard(gen, e.param_shardings)["lm_head"]["kernel"] is gen["lm_head"]["kernel"]
    key = jax.random.key(42)
    with jax.transfer_guard("disallow"):  # every host <-> device transfer is explicit
        a = generate_sequences(e, gen, *prompts, n=3, sampling=SAMPLED, rng=key)
    b = rollout(model, params, prompts, "cpu-8", 4, SAMPLED, 3)  # given train-layout params
    np.testing.assert_array_equal(a.responses, b.responses)


def _compacting(model, mesh_name, slots, min_length=1):
    mesh, spec = _mesh(mesh_name)
    return Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=slots,
                  max_prefill_length=16, max_decode_length=R, prefill_buckets=(8, 16),
                  compiler_options=FAST_COMPILE, compact_min_length=min_length)


def _engines(e):
    return [e, *(e.smaller(s) for s in sorted(e._smaller, reverse=True))]


@pytest.mark.parametrize("mesh_name", ["single", "cpu-8"])
def test_compacting_the_slots_keeps_every_token(model, params, prompts, mesh_name):
    """12 requests in 16 slots: once at most half are live they move into 8, then 4, ...
    (on (2,2,2) down to the 4 devices the slots are split over); the rollout is the
    uncompacted one's, token for token, on either mesh."""
    e = _compacting(model, mesh_name, 16)
    assert e.compacts(SAMPLED) and e.min_slots == (1 if mesh_name == "single" else 4)
    p = on_mesh(model, params, mesh_name)
    out = generate_sequences(e, p, *prompts, n=2, sampling=SAMPLED, rng=jax.random.key(42))
    want = generate_sequences(engine(model, "single", 16), on_mesh(model, params, "single"),
                              *prompts, n=2, sampling=SAMPLED, rng=jax.random.key(42))
    np.testing.assert_array_equal(out.responses, want.responses)
    np.testing.assert_array_equal(out.response_lengths, want.response_lengths)
    np.testing.assert_allclose(out.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.rollout_raw_log_probs, want.rollout_raw_log_probs,
                               atol=1e-5, rtol=0)
    assert out.stats["rollout/decode_steps"] == want.stats["rollout/decode_steps"]
    sizes = [x.max_concurrent_decodes for x in _engines(e)]
    # down to the fewest slots that hold the requests of the longest response (all live
    # to the last step), at least the devices the slots are split over
    last = int(np.sum(want.response_lengths == want.response_lengths.max()))
    smallest = max(e.min_slots, 1 << (last - 1).bit_length())
    assert sizes == [16 >> i for i in range((16 // smallest).bit_length())]
    assert out.stats["rollout/compactions"] == len(sizes) - 1
    # every smaller engine decoded (the last request is alone at the end)
    assert all(any(k[0] == "generate" for k in x.trace_counts) for x in _engines(e)[1:])
    ids, mask = prompts
    generate_sequences(e, p, ids[::-1].copy(), mask[::-1].copy(), n=2, sampling=SAMPLED,
                       rng=jax.random.key(7))
    assert {max(x.trace_counts.values()) for x in _engines(e)} == {1}  # each program once


def test_no_compaction_when_every_response_runs_to_the_cap(model, params, prompts):
    """With no EOS id the model can sample (none, or past its vocabulary, as the PPO
    benchmark's), every slot finishes at the last step: the rollout keeps one engine and
    precompiles no smaller one. Requests with lengths of their own (`max_lengths`) still
    compact (end to end: tests/test_benchmarks.py::test_packing_small)."""
    never = dataclasses.replace(SAMPLED, eos_ids=(CFG.vocab_size,))
    e = _compacting(model, "single", 16)
    assert e.compacts(SAMPLED) and e.compacts(never, limited=True)
    assert not e.compacts(never) and not e.compacts(dataclasses.replace(SAMPLED, eos_ids=()))
    p = on_mesh(model, params, "single")
    from rlhf_jax.rollout import driver

    driver.precompile(e, abstract(p), num_prompts=len(LENGTHS), prompt_length=P, n=2,
                      sampling=never)
    assert not e._smaller
    out = generate_sequences(e, p, *prompts, n=2, sampling=never, rng=jax.random.key(42))
    assert (out.response_lengths == R).all() and "rollout/compactions" not in out.stats
    assert not e._smaller


def test_compaction_only_for_long_responses_and_precompiled(model, params, prompts):
    """Responses shorter than `compact_min_length` keep one engine (no new program); the
    engine's `precompile` compiles each compaction and each smaller engine's generate, so
    that the rollout compiles nothing."""
    short = _compacting(model, "single", 16, min_length=R + 1)
    assert not short.compacts(SAMPLED)
    out = generate_sequences(short, on_mesh(model, params, "single"), *prompts, n=2,
                             sampling=SAMPLED, rng=jax.random.key(42))
    assert "rollout/compactions" not in out.stats and not short._smaller
    assert not _compacting(model, "single", 1).compacts(SAMPLED)  # nothing to halve
    e = _compacting(model, "single", 16)
    p = on_mesh(model, params, "single")
    from rlhf_jax.rollout import driver

    driver.precompile(e, abstract(p), num_prompts=len(LENGTHS), prompt_length=P, n=2,
                      sampling=SAMPLED)
    compiled = [dict(x.trace_counts) for x in _engines(e)]
    assert [x.max_concurrent_decodes for x in _engines(e)] == [16, 8, 4, 2, 1]
    assert all(("compact", x.max_concurrent_decodes // 2) in c
               for x, c in zip(_engines(e)[:-1], compiled[:-1], strict=True))
    generate_sequences(e, p, *prompts, n=2, sampling=SAMPLED, rng=jax.random.key(42))
    decode = lambda counts: {k: v for k, v in counts.items() if k[0] in ("generate", "compact")}
    # (its prefills group the prompts by bucket, which `precompile` does not foresee)
    assert [decode(x.trace_counts) for x in _engines(e)] == [decode(c) for c in compiled]


@pytest.mark.parametrize("mesh_name", ["single", "cpu-8"])
def test_both_key_layouts_give_the_same_rollout(model, params, prompts, mesh_name,
                                                 monkeypatch):
    """The KV cache's keys stored [L, S, K, H, C] (CPU's, `transposed_keys`) and
    [L, S, K, C, H] (the accelerators'), and the decode loop's cache blocks whole (a prefix
    sliced out) or in chunks of 4 positions (CPU's, `decode_chunks`), give the same tokens
    and log-probs, on either mesh: prefill, insert, decode over cache prefixes of 4, 8, .. 24
    positions, and the slots compacted as responses end at their own lengths."""
    from rlhf_jax.models import ops, transformer

    mesh, spec = _mesh(mesh_name)
    monkeypatch.setattr(ops, "CACHE_STEP", 4)
    p = on_mesh(model, params, mesh_name)
    limits = np.arange(len(prompts[0]) * 2) % R + 1

    def run(transposed, chunked=False):
        monkeypatch.setattr(transformer, "TRANSPOSED_KEYS", transposed)
        monkeypatch.setattr(transformer, "CHUNKED_DECODE", chunked)
        e = Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=8,
                   max_prefill_length=16, max_decode_length=R, prefill_buckets=(8, 16),
                   compiler_options=FAST_COMPILE, compact_min_length=1)
        out = generate_sequences(e, p, *prompts, n=2, sampling=SAMPLED, rng=jax.random.key(7),
                                 max_lengths=limits)
        state = e.init_decode_state()
        return out, state.cache.k.shape, state.cache.v.shape

    (want, k_want, v), (got, k_got, v_got) = run(False), run(True, chunked=True)
    assert k_want == v == v_got and k_got == (*v[:3], v[4], v[3])
    assert transformer.decode_chunks(v[3]) == (4, 8, 12, 16, 20, 24)  # chunks while decoding
    for out in (got, run(False, chunked=True)[0]):
        assert out.stats["rollout/compactions"] > 0
        assert np.all(out.response_lengths <= limits) and out.response_lengths.max() > 4
        np.testing.assert_array_equal(out.responses, want.responses)
        np.testing.assert_allclose(out.rollout_log_probs, want.rollout_log_probs, atol=1e-5,
                                   rtol=0)


@pytest.mark.parametrize("mesh_name", ["single", "cpu-8"])
def test_attention_over_the_cache_prefix_keeps_every_token(model, params, prompts, mesh_name,
                                                           monkeypatch):
    """With a step of 4 the prefill and each decode step read the first 4, 8, .. 24 of the
    26 cache positions (as far as the newest key): the tokens and log-probs of reading them
    all, on either mesh."""
    from rlhf_jax.models import ops

    mesh, spec = _mesh(mesh_name)
    make = lambda: Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=4,
                          max_prefill_length=16, max_decode_length=R, prefill_buckets=(8, 16),
                          compiler_options=FAST_COMPILE)
    p = on_mesh(model, params, mesh_name)
    run = lambda e: generate_sequences(e, p, *prompts, n=2, sampling=SAMPLED,
                                       rng=jax.random.key(42))
    monkeypatch.setattr(ops, "CACHE_STEP", None)
    want = run(make())
    monkeypatch.setattr(ops, "CACHE_STEP", 4)
    e = make()
    assert ops.key_classes(e.cache_length, 4) == (4, 8, 12, 16, 20, 24)
    got = run(e)
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=0)
