"""core_algos.advantages: GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ (+baseline), ReMax."""

from collections import defaultdict

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_jax import core_algos as ca

B, T = 8, 6
MASKS = ["pad_end", "no_pad", "arbitrary", "edge"]
DTYPES = [(np.float64, 1e-6), (np.float32, 1e-5)]


def make_mask(kind, rng, b=B, t=T):
    """0/1 masks: padding at the end, no padding, arbitrary holes, and the edge cases."""
    if kind == "no_pad":
        return np.ones((b, t))
    if kind == "arbitrary":
        m = (rng.random((b, t)) < 0.6).astype(float)
        m[0, 0] = m[0, 1] = 1.0
        return m
    lengths = rng.integers(1, t + 1, size=b)
    if kind == "edge":
        lengths[0], lengths[1] = 0, 1  # an all-masked row and a length-1 response
    return (np.arange(t)[None, :] < lengths[:, None]).astype(float)


def outcome_rewards(rng, m):
    """A scalar score on the last valid token of each row (verl's token_level_rewards)."""
    r = np.zeros(m.shape)
    for i in range(m.shape[0]):
        valid = np.flatnonzero(m[i])
        if len(valid):
            r[i, valid[-1]] = rng.integers(0, 3) * 0.5
    return r


# ------------------------------------------------------------------ NumPy loop references


def ref_whiten(x, m):
    vals = x[m > 0]
    mean, var = vals.mean(), vals.var(ddof=1)
    return (x - mean) / np.sqrt(var + 1e-8)


def ref_gae(r, v, m, gamma, lam):
    adv = np.zeros(r.shape)
    for i in range(r.shape[0]):
        next_v, last = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            delta = r[i, t] + gamma * next_v - v[i, t]
            if m[i, t]:
                last = delta + gamma * lam * last
                next_v = v[i, t]
            adv[i, t] = last
    return ref_whiten(adv, m), adv + v


def ref_groups(scores, index):
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(scores[i])
    return groups


def ref_grpo(r, m, index, eps=1e-6, norm=True):
    scores = r.sum(-1)
    groups = ref_groups(scores, index)
    out = np.zeros(len(scores))
    for i, g in enumerate(index):
        s = np.array(groups[g])
        mean, std = (0.0, 1.0) if len(s) == 1 else (s.mean(), s.std(ddof=1))
        out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    adv = out[:, None] * m
    return adv, adv


def ref_rloo(r, m, index):
    scores = r.sum(-1)
    groups = ref_groups(scores, index)
    out = np.zeros(len(scores))
    for i, g in enumerate(index):
        others = list(groups[g])
        others.remove(scores[i])
        out[i] = scores[i] - (np.mean(others) if others else 0.0)
    adv = out[:, None] * m
    return adv, adv


def ref_rpp(r, m, gamma):
    # verl after its fix #7278: a masked token has return 0 and the running return crosses it
    returns = np.zeros(r.shape)
    for i in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t]:
                running = r[i, t] + gamma * running
                returns[i, t] = running
    return ref_whiten(returns, m) * m, returns


def ref_rpp_baseline(r, m, index):
    scores = r.sum(-1)
    groups = ref_groups(scores, index)
    centred = np.array([scores[i] - (np.mean(groups[g]) if len(groups[g]) > 1 else 0.0)
                        for i, g in enumerate(index)])
    adv = ref_whiten(centred[:, None] * m, m) * m
    return adv, adv


def ref_remax(r, b, m):
    returns = np.zeros(r.shape)
    for i in range(r.shape[0]):
        for t in range(r.shape[1]):
            returns[i, t] = sum(r[i, s] * m[i, s] for s in range(t, r.shape[1]))
    return returns - b[:, None] * m, returns


# index: groups of 3, a group of one (row 3), and a zero-variance group is likely (0/0.5/1 scores)
INDEX = np.array([2, 2, 2, 0, 5, 5, 7, 7], np.int32)

ESTIMATORS = {
    "gae": (lambda r, v, m, idx, b: ca.compute_gae_advantage_return(r, v, m, 0.9, 0.8),
            lambda r, v, m, idx, b: ref_gae(r, v, m, 0.9, 0.8)),
    "grpo": (lambda r, v, m, idx, b: ca.compute_grpo_outcome_advantage(r, m, idx),
             lambda r, v, m, idx, b: ref_grpo(r, m, idx)),
    "drgrpo": (lambda r, v, m, idx, b: ca.compute_grpo_outcome_advantage(
        r, m, idx, norm_adv_by_std_in_grpo=False),
        lambda r, v, m, idx, b: ref_grpo(r, m, idx, norm=False)),
    "rloo": (lambda r, v, m, idx, b: ca.compute_rloo_outcome_advantage(r, m, idx),
             lambda r, v, m, idx, b: ref_rloo(r, m, idx)),
    "rpp": (lambda r, v, m, idx, b: ca.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.7),
            lambda r, v, m, idx, b: ref_rpp(r, m, 0.7)),
    "rpp_baseline": (
        lambda r, v, m, idx, b: ca.compute_reinforce_plus_plus_baseline_outcome_advantage(
            r, m, idx),
        lambda r, v, m, idx, b: ref_rpp_baseline(r, m, idx)),
    "remax": (lambda r, v, m, idx, b: ca.compute_remax_outcome_advantage(r, b, m),
              lambda r, v, m, idx, b: ref_remax(r, b, m)),
}
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "rpp_baseline")  # fed outcome rewards


def all_estimators(dense, sparse, v, m, index, base):
    """Every estimator in one program (one compile per dtype, shared by the tests)."""
    return {name: fn(sparse if name in GROUP_ESTIMATORS else dense, v, m, index, base)
            for name, (fn, _) in ESTIMATORS.items()}


# One wrapper per dtype: the parametrized tests call each with new values of one shape, and
# chex fails if any call traces (compiles) a second time.
# (chex counts traces per source text, hence two named copies.)
def all_estimators_f32(*args):
    return all_estimators(*args)


def all_estimators_f64(*args):
    return all_estimators(*args)


ALL = {np.float32: jax.jit(chex.assert_max_traces(all_estimators_f32, n=1)),
       np.float64: jax.jit(chex.assert_max_traces(all_estimators_f64, n=1))}
_gae64 = jax.jit(ca.compute_gae_advantage_return)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_estimators_match_numpy(kind, dtype, tol):
    rng = np.random.default_rng(MASKS.index(kind) + 10)
    m = make_mask(kind, rng)
    dense = rng.normal(size=(B, T))  # per-token rewards (GAE, REINFORCE++, ReMax)
    sparse = outcome_rewards(rng, m)  # outcome rewards (group estimators)
    v = rng.normal(size=(B, T))
    base = rng.normal(size=B)
    # padded positions hold garbage, as they may in a real batch
    v = np.where(m > 0, v, 5.0)
    with jax.enable_x64(dtype == np.float64):
        cast = lambda a: jnp.asarray(a, dtype)
        out = ALL[dtype](cast(dense), cast(sparse), cast(v), cast(m), jnp.asarray(INDEX),
                         cast(base))
        for name, (_, ref) in ESTIMATORS.items():
            r = sparse if name in GROUP_ESTIMATORS else dense
            got = out[name]
            want = ref(r.astype(dtype), v.astype(dtype), m, INDEX, base.astype(dtype))
            for g, w, what in zip(got, want, ("advantages", "returns"), strict=True):
                np.testing.assert_allclose(np.asarray(g), w, rtol=tol, atol=tol,
                                           err_msg=f"{name} {what}")
                assert np.isfinite(np.asarray(g)).all()
            if kind == "edge" and name != "gae":  # GAE whitens every position, as verl
                # row 0 is all-masked: nothing on it; row 1 is a length-1 response
                np.testing.assert_array_equal(np.asarray(got[0])[0], 0.0, err_msg=name)
        # GAE of a length-1 response: A = r - V, whatever gamma; an empty row carries 0
        if kind == "edge":
            raw = np.asarray(out["gae"][1]) - v
            np.testing.assert_allclose(raw[1, 0], dense[1, 0] - v[1, 0], rtol=tol, atol=tol)
            np.testing.assert_allclose(raw[0], 0.0, atol=tol)


@pytest.mark.parametrize("t", [4, 9, 12])
@pytest.mark.parametrize("kind", ["arbitrary", "edge"])
def test_time_recurrences_in_blocks(monkeypatch, t, kind):
    # blocks of 4 time steps: one block, blocks plus a partial one, whole blocks only
    from rlhf_jax.core_algos import advantages

    monkeypatch.setattr(advantages, "TIME_BLOCK", 4)
    monkeypatch.setattr(advantages, "SUM_BLOCK", 2)  # GAE on prefix masks: 2 to 3 levels
    rng = np.random.default_rng(t)
    m = make_mask(kind, rng, t=t)
    r, v = rng.normal(size=(B, t)), rng.normal(size=(B, t))
    gae = ca.compute_gae_advantage_return(r, v, m, 0.9, 0.8)
    for g, w in zip(gae, ref_gae(r, v, m, 0.9, 0.8), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)
    rpp = ca.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.7)
    for g, w in zip(rpp, ref_rpp(r, m, 0.7), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)


def ref_discounted_reverse_cumsum(w, discount):
    y = np.zeros(w.shape)
    for t in reversed(range(w.shape[1])):
        y[:, t] = w[:, t] + (discount * y[:, t + 1] if t + 1 < w.shape[1] else 0.0)
    return y


@pytest.mark.parametrize("t", [1, 3, 4, 7, 16, 37])
@pytest.mark.parametrize("discount", [0.0, 0.6, 1.0])
def test_discounted_reverse_cumsum_in_blocks(t, discount):
    # blocks of 3: one partial block, whole blocks, and 37 = 13 blocks -> 5 -> 2 (3 levels)
    from rlhf_jax.core_algos import advantages

    w = np.random.default_rng(t).normal(size=(5, t))
    with jax.enable_x64(True):
        got = advantages._discounted_reverse_cumsum(jnp.asarray(w), discount, block=3)
    np.testing.assert_allclose(np.asarray(got), ref_discounted_reverse_cumsum(w, discount),
                               rtol=1e-12, atol=1e-12)


def test_prefix_mask_check():
    from rlhf_jax.core_algos import advantages

    prefix = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert bool(advantages._is_prefix_mask(jnp.asarray(prefix, jnp.float32)))
    for bad in ([[1, 0, 1, 0]], [[0, 1, 1, 0]], [[1, 0.5, 0, 0]], [[2, 1, 0, 0]]):
        assert not bool(advantages._is_prefix_mask(jnp.asarray(bad, jnp.float32))), bad


@pytest.mark.parametrize("kind", ["pad_end", "arbitrary", "leading"])
def test_both_paths_match_numpy(monkeypatch, kind):
    # a 70-step batch in blocks of 4 (prefix path, 3 levels) and 8 (scan path): prefix masks,
    # masks with holes, and masks with leading zeros all match verl's loops (GAE, REINFORCE++);
    # rewards are nonzero after the response too, where REINFORCE++'s return is 0
    from rlhf_jax.core_algos import advantages

    monkeypatch.setattr(advantages, "SUM_BLOCK", 4)
    monkeypatch.setattr(advantages, "TIME_BLOCK", 8)
    rng = np.random.default_rng(7)
    t = 70
    m = make_mask("arbitrary" if kind == "arbitrary" else "pad_end", rng, t=t)
    if kind == "leading":
        m[:, :3] = 0
    assert bool(advantages._is_prefix_mask(jnp.asarray(m))) == (kind == "pad_end")
    assert bool(jax.jit(advantages._is_prefix_mask)(jnp.asarray(m))) == (kind == "pad_end")
    assert bool(advantages._is_prefix_mask(jnp.zeros((0, t))))  # no rows: nothing to break it
    r, v = rng.normal(size=(B, t)), np.where(m > 0, rng.normal(size=(B, t)), 7.0)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.0), (1.0, 1.0)):
        with jax.enable_x64(True):
            got = jax.jit(ca.compute_gae_advantage_return)(r, v, m, gamma, lam)
        for g, w in zip(got, ref_gae(r, v, m, gamma, lam), strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-9, atol=1e-9)
    for gamma in (1.0, 0.7, 0.0):
        with jax.enable_x64(True):
            got = jax.jit(ca.compute_reinforce_plus_plus_outcome_advantage)(r, m, gamma)
        for g, w in zip(got, ref_rpp(r, m, gamma), strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-9, atol=1e-9)


def test_gae_hand_case():
    # gamma = 0.5, lam = 1. Row 0, all valid, V = [.2, .4, .8], r = [0, 0, 1]:
    #   t2: delta = 1 - .8 = .2, A = .2;  t1: delta = .5*.8 - .4 = 0, A = .5*.2 = .1;
    #   t0: delta = .5*.4 - .2 = 0, A = .05.   returns = A + V = [.25, .5, 1.]
    # Row 1, token 1 masked (V there is 9, ignored): t2: A = .2; t1 skipped, A stays .2;
    #   t0: delta = .5*.8 - .2 = .2, A = .2 + .5*.2 = .3.   returns = [.5, 9.2, 1.]
    r = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    v = jnp.array([[0.2, 0.4, 0.8], [0.2, 9.0, 0.8]])
    m = jnp.array([[1, 1, 1], [1, 0, 1]])
    adv, ret = _gae64(r, v, m, 0.5, 1.0)
    np.testing.assert_allclose(ret, [[0.25, 0.5, 1.0], [0.5, 9.2, 1.0]], rtol=1e-6)
    raw = np.array([[0.05, 0.1, 0.2], [0.3, 0.2, 0.2]])
    np.testing.assert_allclose(ret - v, raw, rtol=1e-5, atol=1e-6)
    vals = np.array([0.05, 0.1, 0.2, 0.3, 0.2])  # the masked tokens
    np.testing.assert_allclose(adv, (raw - vals.mean()) / vals.std(ddof=1), rtol=1e-4)
    # before whitening (what the critic's update makes, micro-batch by micro-batch): row by row
    for rows in (slice(0, 2), slice(0, 1), slice(1, 2)):
        a_raw, ret_raw = jax.jit(ca.compute_gae_return)(r[rows], v[rows], m[rows], 0.5, 1.0)
        np.testing.assert_allclose(a_raw, raw[rows], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret_raw, np.asarray(ret)[rows], rtol=1e-6)


def test_grpo_rloo_hand_case():
    # groups {0,1,2}: scores 1, 0, 0 -> mean 1/3, std = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt3
    # group {3}: size one -> mean 0, std 1;  group {4,5}: scores 2, 2 -> std 0 -> A = 0
    m = jnp.array([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]])
    r = jnp.array([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [5.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    index = jnp.array([0, 0, 0, 1, 2, 2])

    @jax.jit
    def group_estimators(r, m, index, sparse_ids):
        return (ca.compute_grpo_outcome_advantage(r, m, index),
                ca.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=False),
                ca.compute_rloo_outcome_advantage(r, m, index),
                ca.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, index),
                ca.compute_grpo_outcome_advantage(r, m, sparse_ids, num_groups=7))

    # group ids need not be dense; num_groups only bounds them
    sparse_ids = jnp.array([6, 6, 6, 1, 3, 3])
    (adv, ret), (dr, _), (rl, _), (rb, _), (adv2, _) = group_estimators(r, m, index, sparse_ids)
    s3 = np.sqrt(3.0)
    want = np.array([2 / 3 * s3, -1 / 3 * s3, -1 / 3 * s3, 5 / (1 + 1e-6), 0.0, 0.0])
    np.testing.assert_allclose(adv, want[:, None] * m, rtol=1e-5)
    np.testing.assert_array_equal(adv, ret)
    np.testing.assert_allclose(dr, np.array([2 / 3, -1 / 3, -1 / 3, 5, 0, 0])[:, None] * m,
                               rtol=1e-6)
    # RLOO: n = 3: score * 3/2 - mean * 3/2 -> 1 - 0 = 1, 0 - 1/2 = -1/2; size one keeps 5
    np.testing.assert_allclose(rl, np.array([1, -0.5, -0.5, 5, 0, 0])[:, None] * m, rtol=1e-6)
    # REINFORCE++-baseline: centred scores [2/3, -1/3, -1/3, 5, 0, 0] broadcast, whitened
    c = np.array([2 / 3, -1 / 3, -1 / 3, 5, 0, 0])[:, None] * np.asarray(m)
    vals = c[np.asarray(m) > 0]
    np.testing.assert_allclose(rb, (c - vals.mean()) / vals.std(ddof=1) * m, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(adv2, adv, rtol=1e-6)


def test_reinforce_pp_and_remax_hand_case():
    # gamma .5, r = [1, 0, 2]: all valid -> G = [1 + .5*(0 + .5*2), 0 + .5*2, 2] = [1.5, 1, 2]
    # mask [1, 1, 0]: the masked token's return is 0 and its reward is dropped: G = [1, 0, 0]
    r = jnp.array([[1.0, 0.0, 2.0], [1.0, 0.0, 2.0]])
    m = jnp.array([[1, 1, 1], [1, 1, 0]])
    adv, ret = jax.jit(ca.compute_reinforce_plus_plus_outcome_advantage)(r, m, 0.5)
    np.testing.assert_allclose(ret, [[1.5, 1.0, 2.0], [1.0, 0.0, 0.0]], rtol=1e-6)
    vals = np.array([1.5, 1.0, 2.0, 1.0, 0.0])
    want = (np.asarray(ret) - vals.mean()) / vals.std(ddof=1) * np.asarray(m)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    # ReMax: r = [0, 1, 2] mask [1, 1, 0] -> returns = [1, 1, 0]; baseline .5 -> [.5, .5, 0]
    adv, ret = jax.jit(ca.compute_remax_outcome_advantage)(
        jnp.array([[0.0, 1.0, 2.0]]), jnp.array([0.5]), jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose(ret, [[1.0, 1.0, 0.0]])
    np.testing.assert_allclose(adv, [[0.5, 0.5, 0.0]])


# ------------------------------------------------------------------------------ properties

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(MASKS))
def test_gae_gamma_lam_one_is_reward_to_go_minus_value(seed, kind):
    rng = np.random.default_rng(seed)
    m = make_mask(kind, rng)
    r, v = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    with jax.enable_x64(True):
        adv, ret = (np.asarray(x) for x in _gae64(r, v, m, 1.0, 1.0))
    # with gamma = lam = 1 the TD errors telescope over the valid tokens
    to_go = np.array([[sum(r[i, s] for s in range(t, T) if m[i, s]) for t in range(T)]
                      for i in range(B)])
    valid = m > 0
    np.testing.assert_allclose((ret - v)[valid], (to_go - v)[valid], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(adv[valid].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(adv[valid].var(ddof=1), 1.0, rtol=1e-4)


_grpo64 = jax.jit(ca.compute_grpo_outcome_advantage)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_grpo_property_groups_are_standardised(seed):
    rng = np.random.default_rng(seed)
    index = rng.integers(0, 3, size=B).astype(np.int32)
    r = np.zeros((B, T))
    r[:, -1] = rng.normal(size=B)
    m = np.ones((B, T))
    with jax.enable_x64(True):
        adv = np.asarray(_grpo64(r, m, index, epsilon=0.0)[0])[:, 0]
    for g in range(3):
        a = adv[index == g]
        if len(a) > 1:
            np.testing.assert_allclose(a.mean(), 0.0, atol=1e-9)
            np.testing.assert_allclose(a.std(ddof=1), 1.0, rtol=1e-9)
        elif len(a) == 1:
            np.testing.assert_allclose(a, r[index == g, -1], rtol=1e-12)


# -------------------------------------------------------------------------- jit and sharding


def test_estimators_compile_once():
    rng = np.random.default_rng(3)
    # one program holding every estimator: chex raises if any of them retraces it
    jitted = ALL[np.float32]
    for _ in range(3):
        m = make_mask("pad_end", rng).astype(np.float32)
        jitted(rng.normal(size=(B, T)).astype(np.float32), outcome_rewards(rng, m),
               rng.normal(size=(B, T)).astype(np.float32), m,
               rng.integers(0, B, size=B).astype(np.int32), rng.normal(size=B).astype(np.float32))


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_estimators_sharded_match_unsharded(axis_types):
    # jax.make_mesh gives Explicit axes (sharding in types); rlhf_jax.mesh builds Auto ones
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    if axis_types == "auto":
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    rng = np.random.default_rng(4)
    m = make_mask("edge", rng).astype(np.float32)
    args = [rng.normal(size=(B, T)), outcome_rewards(rng, m), rng.normal(size=(B, T)), m,
            INDEX, rng.normal(size=B)]
    args = [a.astype(np.float32) if a.dtype == np.float64 else a for a in args]
    want = ALL[np.float32](*args)
    sharded = [jax.device_put(a, rows) for a in args]
    got = jax.jit(all_estimators)(*sharded)  # no mesh context needed
    for name in ESTIMATORS:
        for g, w in zip(got[name], want[name], strict=True):
            assert g.sharding.spec[0] == ("data", "fsdp"), name  # the output stays sharded
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                       err_msg=name)
