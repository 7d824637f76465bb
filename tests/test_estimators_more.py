"""verl's other advantage estimators (core_algos.group_advantages, token_baseline), group ids
of any kind (core_algos.groups), and two fixes: REINFORCE++ across masked observation spans
and the gradient of the `abs` KL penalty at ties."""

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import core_algos as ca
from rlhf_jax import ppo
from rlhf_jax.core_algos import get_adv_estimator

B, T = 8, 6
GROUP_NAMES = ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg",
               "rloo_vectorized", "grpo_vectorized", "gdpo", "optimal_token_baseline",
               "tir_optimal_token_baseline"]
NEW_NEEDS = {
    "opo": {"index"}, "grpo_passk": {"index", "norm_adv_by_std_in_grpo"}, "gpg": {"index"},
    "rloo_vectorized": {"index"}, "grpo_vectorized": {"index", "norm_adv_by_std_in_grpo"},
    "optimal_token_baseline": {"index", "old_log_probs", "sum_pi_squared", "rollout_is_weights"},
    "tir_optimal_token_baseline": {"index", "old_log_probs", "sum_pi_squared",
                                   "rollout_is_weights"},
    "gdpo": {"index", "norm_adv_by_std_in_grpo"},
}


def batch(seed=0, holes=False):
    """Outcome rewards on the last valid token (plus a small per-token term), groups of sizes
    3, 2, 2 and 1, rollout log-probs, sum pi^2 and importance weights."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    m = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    if holes:  # observation spans inside the responses (multi-turn), and an empty row
        m = (rng.random((B, T)) < 0.7).astype(np.float64)
        m[5] = 0
    r = np.zeros((B, T))
    r[np.arange(B), lengths - 1] = rng.integers(0, 3, size=B) * 0.5
    r += 0.01 * rng.random((B, T))
    old = np.log(rng.uniform(0.05, 0.95, (B, T)))
    spi = rng.uniform(0.05, 1.0, (B, T))
    w = rng.uniform(0.5, 2.0, (B, T))
    return dict(r=r, m=m, index=np.array([3, 3, 3, 9, 9, 1, 1, 5]), old=old, spi=spi, w=w)


# ------------------------------------------------------------------ NumPy references (verl)


def groups(index):
    out = defaultdict(list)
    for i, g in enumerate(index):
        out[g].append(i)
    return out


def ref_grpo_scalar(scores, index, norm=True, eps=1e-6):
    out = np.zeros_like(scores)
    for rows in groups(index).values():
        s = scores[rows]
        mean, std = (0.0, 1.0) if len(rows) == 1 else (s.mean(), s.std(ddof=1))
        out[rows] = (s - mean) / (std + eps) if norm else s - mean
    return out


def ref_opo(r, m, index):
    scores, lens, out = r.sum(-1), m.sum(-1), np.zeros(len(index))
    for rows in groups(index).values():
        b = 0.0 if len(rows) == 1 else (lens[rows] * scores[rows]).sum() / lens[rows].sum()
        out[rows] = scores[rows] - b
    return out[:, None] * m


def ref_passk(r, m, index, norm=True, eps=1e-6):
    scores, out = r.sum(-1), np.zeros(len(index))
    for rows in groups(index).values():
        if len(rows) < 2:
            continue  # verl raises; 0 here
        s = scores[rows]
        top = np.argsort(-s, kind="stable")
        gap = s[top[0]] - s[top[1]]
        out[rows[top[0]]] = gap / (s.std(ddof=1) + eps) if norm else gap
    return out[:, None] * m


def ref_gpg(r, m, index):
    scores = r.sum(-1)
    alpha = len(scores) / max(np.count_nonzero(scores), 1)
    out = np.zeros(len(index))
    for rows in groups(index).values():
        mean = 0.0 if len(rows) == 1 else scores[rows].mean()
        out[rows] = alpha * (scores[rows] - mean)
    return out[:, None] * m


def ref_whiten(x, m):
    vals = x[m > 0]
    return (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8)


def ref_gdpo(components, m, index, weights, norm=True):
    total = sum(w * ref_grpo_scalar(c, index, norm) for c, w in zip(components, weights,
                                                                      strict=True))
    return ref_whiten(total[:, None] * m, m) * m


def ref_rloo_vectorized(r, m, index):
    scores, out = r.sum(-1), np.zeros(len(index))
    for rows in groups(index).values():
        n = len(rows)
        out[rows] = (n * scores[rows] - scores[rows].sum()) / (n - 1) if n > 1 else 0.0
    return out[:, None] * m


def ref_otb(r, m, index, old, spi, w=None, tail=True, eps=1e-8):
    returns = np.flip(np.cumsum(np.flip(r * m, -1), -1), -1)
    wt = (1 - 2 * np.exp(old) + spi) * (1 if w is None else w**2)
    cum = np.cumsum(wt * m, -1)
    base = np.zeros_like(returns)
    for rows in groups(index).values():
        if len(rows) == 1:
            continue
        base[rows] = ((returns[rows] * cum[rows] * m[rows]).sum(0)
                      / ((cum[rows] * m[rows]).sum(0) + eps))
        if tail:
            lens = m[rows].sum(-1)
            srt = np.sort(lens)
            longest = np.nonzero(lens == srt[-1])[0]
            if len(longest) == 1 and srt[-1] > srt[-2]:
                base[rows[longest[0]], int(srt[-2]):] = 0
    return (returns - base) * m, returns


def ref_tir_otb(r, m, index, old, spi, w=None, tail=True, eps=1e-8):
    returns = np.flip(np.cumsum(np.flip(r * m, -1), -1), -1)
    wt = (1 - 2 * np.exp(old) + spi) * (1 if w is None else w**2)
    cum = np.cumsum(wt * m, -1)
    lens = (m > 0).sum(-1)
    cw, cr = np.zeros_like(r), np.zeros_like(r)
    for i in range(len(r)):
        cw[i, :lens[i]], cr[i, :lens[i]] = cum[i, m[i] > 0], returns[i, m[i] > 0]
    base = np.zeros_like(r)
    members = groups([g if n else None for g, n in zip(index, lens, strict=True)])
    members.pop(None, None)
    for rows in members.values():
        if len(rows) == 1:
            continue
        base[rows] = (cr[rows] * cw[rows]).sum(0) / (cw[rows].sum(0) + eps)
        if tail:
            srt = np.sort(lens[rows])
            longest = np.nonzero(lens[rows] == srt[-1])[0]
            if len(longest) == 1 and srt[-1] > srt[-2]:
                base[rows[longest[0]], srt[-2]:] = 0
    adv = np.zeros_like(r)
    for i in range(len(r)):
        adv[i, m[i] > 0] = (cr[i] - base[i])[:lens[i]]
    return adv * m, returns


# ------------------------------------------------------------------ group ids


def test_non_contiguous_group_ids():
    # the notebook trap of issue 25: ids outside [0, batch) used to give wrong advantages
    r = jnp.array([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    m = jnp.ones((4, 2))
    want = np.array([1, -1, 1, -1])[:, None] * 0.5 / (np.sqrt(0.5) + 1e-6) * np.ones((1, 2))
    for ids in (jnp.array([7, 7, 42, 42]), np.array([7, 7, 42, 42]), [7, 7, 42, 42],
                np.array(["uid-7", "uid-7", "uid-42", "uid-42"], dtype=object),
                np.array(["b", "b", "a", "a"]), np.array([2**40, 2**40, -3, -3])):
        adv, _ = ca.compute_grpo_outcome_advantage(r, m, ids)
        np.testing.assert_allclose(adv, want, rtol=1e-6, err_msg=str(ids))
        np.testing.assert_allclose(adv[0, 0], 0.7071, atol=1e-4)
    adv, _ = jax.jit(ca.compute_grpo_outcome_advantage)(r, m, jnp.array([7, 7, 42, 42]))
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    adv, _ = jax.jit(ca.compute_rloo_outcome_advantage)(r, m, jnp.array([7, 7, -42, -42]))
    np.testing.assert_allclose(adv, [[1, 1], [-1, -1], [1, 1], [-1, -1]], rtol=1e-6)


def test_group_id_helpers():
    np.testing.assert_array_equal(ca.group_ids(["b", "a", "b", "c"]), [0, 1, 0, 2])
    np.testing.assert_array_equal(ca.group_ids(np.array([("x", 1), ("y", 2), ("x", 1)],
                                                        dtype=object)[:, 0]), [0, 1, 0])
    assert ca.group_ids(["a"]).dtype == np.int32
    ids = np.asarray(jax.jit(ca.dense_group_ids)(jnp.array([7, 7, 42, -3, 42, 7])))
    assert ids.min() >= 0 and ids.max() < 6
    assert ids[0] == ids[1] == ids[5] and ids[2] == ids[4] and len({ids[0], ids[2], ids[3]}) == 3
    with pytest.raises(TypeError, match="group ids under jit must be integers"):
        ca.dense_group_ids(jnp.array([0.5, 1.5]))


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_every_group_estimator_takes_any_ids(name):
    b = batch(1)
    inputs = dict(old_log_probs=b["old"], sum_pi_squared=b["spi"], rollout_is_weights=b["w"])
    est = get_adv_estimator(name)
    want = est(b["r"], b["m"], index=ca.group_ids(b["index"]), **inputs)
    sparse = jnp.asarray(b["index"] * 1000 - 4000)  # [-1000, ..., 5000]
    got = jax.jit(lambda idx: est(b["r"], b["m"], index=idx, **inputs))(sparse)
    uids = np.array([f"prompt-{i}" for i in b["index"]], dtype=object)
    eager = est(b["r"], b["m"], index=uids, **inputs)
    for g, e, w in zip(got, eager, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(e, w, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ hand-worked cases


def test_outcome_estimators_by_hand():
    # groups a = {0, 1, 2}, b = {3, 4}, c = {5}; scores [1, .5, 0 | 1, 1 | 2]
    r = jnp.array([[0, 1.0], [0.5, 0], [0, 0], [0, 1], [1, 0], [2, 0]])
    m = jnp.array([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1.0]])
    index = jnp.array([0, 0, 0, 1, 1, 2])
    col = lambda *v: np.array(v)[:, None] * np.asarray(m)
    # OPO: lengths [2, 1, 2]: b_a = (2 * 1 + 1 * .5 + 0) / 5 = .5; lengths [2, 1]:
    # b_b = (2 + 1) / 3 = 1; a group of one keeps its score
    np.testing.assert_allclose(ca.compute_opo_outcome_advantage(r, m, index)[0],
                               col(.5, 0, -.5, 0, 0, 2), rtol=1e-6)
    # pass@k: a: best 1, second .5, std .5 -> 1 / (1 + 2e-6); b: a tie -> 0; c: one row -> 0
    np.testing.assert_allclose(ca.compute_grpo_passk_outcome_advantage(r, m, index)[0],
                               col(0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0), rtol=1e-6)
    np.testing.assert_allclose(
        ca.compute_grpo_passk_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=False)[0],
        col(0.5, 0, 0, 0, 0, 0), rtol=1e-6)
    # GPG: 5 nonzero scores of 6 -> alpha 6/5; means .5 and 1, a group of one keeps 2
    np.testing.assert_allclose(ca.compute_gpg_outcome_advantage(r, m, index)[0],
                               1.2 * col(.5, 0, -.5, 0, 0, 2), rtol=1e-6)
    # vectorised RLOO: a: (3 s - 1.5) / 2 = [.75, 0, -.75]; b: 0; c: a group of one -> 0
    np.testing.assert_allclose(ca.compute_rloo_vectorized_outcome_advantage(r, m, index)[0],
                               col(.75, 0, -.75, 0, 0, 0), rtol=1e-6)
    # GDPO, two dimensions [1, 0, 0 | 1, 0 | 5] and [0, 1, 1 | 0, 2 | 0], weights 1 and .5.
    # GRPO of dimension 1: a: mean 1/3, std sqrt(1/3); b: mean .5, std sqrt(.5); c: 5 / 1;
    # dimension 2: a: the negation of dimension 1's; b: mean 1, std sqrt 2; c: 0
    comps = np.array([[1, 0, 0, 1, 0, 5], [0, 1, 1, 0, 2, 0]], float)
    got, ret = ca.compute_gdpo_outcome_advantage(r, m, index, reward_components=comps,
                                                 reward_weights=[1.0, 0.5])
    a1 = np.array([2 / 3, -1 / 3, -1 / 3]) / (np.sqrt(1 / 3) + 1e-6)
    b1 = np.array([0.5, -0.5]) / (np.sqrt(0.5) + 1e-6)
    b2 = np.array([-1.0, 1.0]) / (np.sqrt(2.0) + 1e-6)
    total = np.concatenate([a1, b1, [5 / (1 + 1e-6)]]) + 0.5 * np.concatenate([-a1, b2, [0]])
    want = ref_whiten(total[:, None] * np.asarray(m), np.asarray(m)) * np.asarray(m)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, ret)


def test_optimal_token_baseline_by_hand():
    # one group of two full rows; pi = .5 -> w = .5 + sum_pi^2: row 0 .5 (W = [.5, 1]),
    # row 1 1.5 (W = [1.5, 3]); G = [[1, 1], [0, 0]]; B_t = G0 W0 / (W0 + W1) = .25, .25
    r = jnp.array([[0, 1.0], [0, 0]])
    old = jnp.log(jnp.full((2, 2), 0.5))
    spi = jnp.array([[0.5, 0.5], [1.5, 1.5]])
    adv, ret = ca.compute_optimal_token_baseline_advantage(r, jnp.ones((2, 2)), [0, 0], old,
                                                           spi)
    np.testing.assert_allclose(ret, [[1, 1], [0, 0]])
    np.testing.assert_allclose(adv, [[0.75, 0.75], [-0.25, -0.25]], rtol=1e-6)
    # row 1 one token long: W1 = [1.5, 1.5] masked at t1; B_0 = .25, B_1 = 1 * 1 / 1 = 1,
    # but row 0, the unique longest, has no baseline from t = 1 (the second length) on
    m = jnp.array([[1, 1], [1, 0.0]])
    adv, _ = ca.compute_optimal_token_baseline_advantage(r, m, [0, 0], old, spi)
    np.testing.assert_allclose(adv, [[0.75, 1.0], [-0.25, 0]], rtol=1e-6)
    adv, _ = ca.compute_optimal_token_baseline_advantage(r, m, [0, 0], old, spi,
                                                         handle_zero_tail=False)
    np.testing.assert_allclose(adv, [[0.75, 0.0], [-0.25, 0]], rtol=1e-6, atol=1e-7)
    # rollout weights scale w by rho^2: row 1's rho = 2 -> w1 = 6, B_0 = .5 / 6.5
    adv, _ = ca.compute_optimal_token_baseline_advantage(
        r, jnp.ones((2, 2)), [0, 0], old, spi, rollout_is_weights=jnp.array([[1, 1], [2, 2.0]]))
    np.testing.assert_allclose(adv[0, 0], 1 - 0.5 / 6.5, rtol=1e-6)
    # multi-turn: row 0 = [tok, obs, tok], row 1 = [tok, tok, pad]; over valid tokens both
    # rows have steps 0 and 1 with W0 = [.5, 1], W1 = [1.5, 3] -> the full-row case again
    r3 = jnp.array([[0, 0, 1.0], [0, 0, 0]])
    m3 = jnp.array([[1, 0, 1], [1, 1, 0.0]])
    old3, spi3 = jnp.log(jnp.full((2, 3), 0.5)), jnp.array([[.5, 9, .5], [1.5, 1.5, 9]])
    adv, _ = ca.compute_multi_turn_optimal_token_baseline_advantage(r3, m3, [4, 4], old3, spi3)
    np.testing.assert_allclose(adv, [[0.75, 0, 0.75], [-0.25, -0.25, 0]], rtol=1e-6)


# ------------------------------------------------------------------ against NumPy


@pytest.mark.parametrize("holes", [False, True])
def test_estimators_match_numpy(holes):
    b = batch(2, holes)
    r, m, idx, old, spi, w = b["r"], b["m"], b["index"], b["old"], b["spi"], b["w"]
    comps = np.random.default_rng(3).integers(0, 3, (3, B)).astype(float)
    with jax.enable_x64(True):
        got = jax.jit(lambda r, m, idx, old, spi, w, comps: {
            "opo": ca.compute_opo_outcome_advantage(r, m, idx)[0],
            "passk": ca.compute_grpo_passk_outcome_advantage(r, m, idx)[0],
            "passk_dr": ca.compute_grpo_passk_outcome_advantage(
                r, m, idx, norm_adv_by_std_in_grpo=False)[0],
            "gpg": ca.compute_gpg_outcome_advantage(r, m, idx)[0],
            "gdpo": ca.compute_gdpo_outcome_advantage(r, m, idx, reward_components=comps,
                                                      reward_weights=[1.0, 0.5, 2.0])[0],
            "gdpo1": ca.compute_gdpo_outcome_advantage(r, m, idx)[0],
            "rloo_vec": ca.compute_rloo_vectorized_outcome_advantage(r, m, idx)[0],
            "otb": ca.compute_optimal_token_baseline_advantage(r, m, idx, old, spi),
            "otb_w": ca.compute_optimal_token_baseline_advantage(r, m, idx, old, spi, w,
                                                                 handle_zero_tail=False),
            "tir": ca.compute_multi_turn_optimal_token_baseline_advantage(r, m, idx, old, spi),
            "tir_w": ca.compute_multi_turn_optimal_token_baseline_advantage(
                r, m, idx, old, spi, w, handle_zero_tail=False),
        })(r, m, idx, old, spi, w, comps)
    want = {
        "opo": ref_opo(r, m, idx), "passk": ref_passk(r, m, idx),
        "passk_dr": ref_passk(r, m, idx, norm=False), "gpg": ref_gpg(r, m, idx),
        "gdpo": ref_gdpo(comps, m, idx, [1.0, 0.5, 2.0]),
        "gdpo1": ref_gdpo([r.sum(-1)], m, idx, [1.0]),
        "rloo_vec": ref_rloo_vectorized(r, m, idx),
        "otb": ref_otb(r, m, idx, old, spi), "otb_w": ref_otb(r, m, idx, old, spi, w, False),
        "tir": ref_tir_otb(r, m, idx, old, spi),
        "tir_w": ref_tir_otb(r, m, idx, old, spi, w, False),
    }
    for name, w_ in want.items():
        for g, v in zip(jax.tree.leaves(got[name]), jax.tree.leaves(w_), strict=True):
            # masked_mean divides by sum(m) + 1e-8, the references by sum(m)
            np.testing.assert_allclose(g, v, rtol=1e-7, atol=1e-9, err_msg=name)
    if not holes:  # on prefix masks the multi-turn OTB is the plain one
        np.testing.assert_allclose(got["tir"][0], got["otb"][0], rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ registry and trainer call


def test_registered_needs_and_the_trainer_call():
    for name, needs in NEW_NEEDS.items():
        assert get_adv_estimator(name).needs == frozenset(needs), name
    b = batch(4)
    r, m = jnp.asarray(b["r"], jnp.float32), jnp.asarray(b["m"], jnp.float32)
    index = jnp.asarray(b["index"], jnp.int32)
    for name in ("opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "gdpo"):
        # ppo.advantages is the jitted call of the trainer (index, gamma, lam, norm)
        got = ppo.advantages(r, m, estimator=name, index=index, gamma=1.0, lam=1.0,
                             norm_adv_by_std_in_grpo=False)
        want = get_adv_estimator(name)(r, m, index=index, norm_adv_by_std_in_grpo=False)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(
        get_adv_estimator("grpo_vectorized")(r, m, index=index)[0],
        get_adv_estimator("grpo")(r, m, index=index)[0])
    otb = get_adv_estimator("optimal_token_baseline")
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs old_log_probs, "
                                         "sum_pi_squared, got None"):
        ppo.advantages(r, m, estimator="optimal_token_baseline", index=index, gamma=1.0,
                       lam=1.0)
    no_is = otb(r, m, index=index, old_log_probs=b["old"], sum_pi_squared=b["spi"])
    np.testing.assert_allclose(no_is[0], ref_otb(b["r"], b["m"], b["index"], b["old"],
                                                 b["spi"])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_sharded_match_unsharded(axis_types):
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    if axis_types == "auto":
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    b = batch(5, holes=True)
    args = [b[k].astype(np.float32) for k in ("r", "m", "old", "spi", "w")]
    args.insert(2, (b["index"] * 7 - 20).astype(np.int32))

    def every(r, m, idx, old, spi, w):
        inputs = dict(old_log_probs=old, sum_pi_squared=spi, rollout_is_weights=w)
        return {n: get_adv_estimator(n)(r, m, index=idx, **inputs) for n in GROUP_NAMES}

    want = jax.jit(every)(*args)
    got = jax.jit(every)(*[jax.device_put(a, rows) for a in args])
    for name in GROUP_NAMES:
        for g, w in zip(got[name], want[name], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------ issue 23, item 6


def test_reinforce_pp_carries_the_return_across_observation_spans():
    # gamma .5; row 0: [tok, obs, obs, tok] with reward 1 at the end: t3 1; t2, t1 masked:
    # return 0, the running return stays 1 (no reward added, no discount); t0 .5 * 1
    # (verl #7278; before it the return restarted: [0, .5, 1, 1] unmasked, 0 at t0).
    # Row 1: plain response [tok, tok, pad, pad] with reward 2 at t1 -> [1, 2, 0, 0]
    r = jnp.array([[0, 0, 0, 1.0], [0, 2.0, 0, 0]])
    m = jnp.array([[1, 0, 0, 1.0], [1, 1, 0, 0]])
    adv, ret = jax.jit(ca.compute_reinforce_plus_plus_outcome_advantage)(r, m, 0.5)
    np.testing.assert_allclose(ret, [[0.5, 0, 0, 1], [1, 2, 0, 0]], rtol=1e-6)
    vals = np.array([0.5, 1, 1, 2])
    np.testing.assert_allclose(adv, (np.asarray(ret) - vals.mean()) / vals.std(ddof=1) * m,
                               rtol=1e-5, atol=1e-6)
    # the prefix-mask path (row 1 alone) agrees with the scan path
    _, ret1 = ca.compute_reinforce_plus_plus_outcome_advantage(r[1:], m[1:], 0.5)
    np.testing.assert_allclose(ret1, ret[1:], rtol=1e-6)


def test_abs_kl_gradient_is_zero_at_ties():
    logp = jnp.array([[-1.0, -2.0, -3.0]])
    ref = jnp.array([[-1.0, -1.5, -3.5]])
    for kind in ("abs", "abs+"):
        grad = jax.grad(lambda q, kind=kind: ca.kl_penalty(q, ref, kind).sum())(logp)
        want = [[0.0, -1.0, 1.0]] if kind == "abs" else [[0.0, -0.5, 0.5]]  # k2's for "+"
        np.testing.assert_allclose(grad, want)
    np.testing.assert_allclose(ca.kl_penalty(logp, ref, "abs"), [[0.0, 0.5, 0.5]])
