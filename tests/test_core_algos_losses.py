"""core_algos.losses: agg_loss, the PPO policy loss, the value loss, the entropy loss."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_jax import core_algos as ca

B, T, V = 6, 5, 7
MODES = list(ca.LOSS_AGG_MODES)
MASKS = ["pad_end", "no_pad", "arbitrary", "edge"]
DTYPES = [(np.float64, 1e-6), (np.float32, 1e-5)]


def make_mask(kind, rng, b=B, t=T):
    """0/1 masks: padding at the end, no padding, arbitrary holes, and the edge cases."""
    if kind == "no_pad":
        return np.ones((b, t))
    if kind == "arbitrary":
        m = (rng.random((b, t)) < 0.6).astype(float)
        m[0, 0] = 1.0
        return m
    lengths = rng.integers(1, t + 1, size=b)
    if kind == "edge":
        lengths[0], lengths[1] = 0, 1  # an all-masked row and a length-1 response
    return (np.arange(t)[None, :] < lengths[:, None]).astype(float)


# ------------------------------------------------------------------ NumPy loop references


def ref_agg(x, m, mode, scale=None):
    b, t = x.shape
    seq_sums = [sum(x[i, j] for j in range(t) if m[i, j]) for i in range(b)]
    seq_lens = [sum(1 for j in range(t) if m[i, j]) for i in range(b)]
    n_seqs = sum(1 for n in seq_lens if n > 0)
    if mode == "token-sum":
        return sum(seq_sums)
    if mode == "token-mean":
        return sum(seq_sums) / sum(seq_lens) if sum(seq_lens) else 0.0
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = [s / n if n else 0.0 for s, n in zip(seq_sums, seq_lens, strict=True)]
    else:
        per_seq = [s / (t if scale is None else scale) for s in seq_sums]
    return sum(per_seq) / n_seqs if n_seqs else 0.0


def ref_masked_mean(x, m):
    vals = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if m[i, j]]
    return sum(vals) / len(vals) if vals else 0.0


def ref_policy(old, logp, adv, m, mode, eps_low=0.2, eps_high=0.2, c=3.0):
    """Token by token, with the dual clip written as the branch it is."""
    loss = np.zeros(old.shape)
    clipped, lower, kl = np.zeros(old.shape), np.zeros(old.shape), np.zeros(old.shape)
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            d = min(max(logp[i, j] - old[i, j], -20.0), 20.0)
            ratio, a = math.exp(d), adv[i, j]
            surrogate = -a * ratio
            clipped_surrogate = -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
            pessimistic = max(surrogate, clipped_surrogate)
            clipped[i, j] = clipped_surrogate > surrogate
            if a < 0:
                lower[i, j] = pessimistic > -a * c
                loss[i, j] = min(pessimistic, -a * c)
            else:
                loss[i, j] = pessimistic
            kl[i, j] = -d
    metrics = {"pg_clipfrac": ref_masked_mean(clipped, m), "ppo_kl": ref_masked_mean(kl, m),
               "pg_clipfrac_lower": ref_masked_mean(lower, m)}
    return ref_agg(loss, m, mode), metrics


def ref_value(vpred, ret, values, m, mode, c=0.5):
    loss, frac = np.zeros(vpred.shape), np.zeros(vpred.shape)
    for i in range(vpred.shape[0]):
        for j in range(vpred.shape[1]):
            vclip = min(max(vpred[i, j], values[i, j] - c), values[i, j] + c)
            l1, l2 = (vpred[i, j] - ret[i, j]) ** 2, (vclip - ret[i, j]) ** 2
            loss[i, j], frac[i, j] = max(l1, l2), l2 > l1
    return 0.5 * ref_agg(loss, m, mode), ref_masked_mean(frac, m)


def ref_entropy(z):
    out = np.zeros(z.shape[:2])
    for i in range(z.shape[0]):
        for j in range(z.shape[1]):
            p = np.exp(z[i, j] - z[i, j].max())
            p /= p.sum()
            out[i, j] = -sum(q * math.log(q) for q in p if q > 0)
    return out


# ------------------------------------------------------- every loss of every mode, one program


def all_losses(x, old, logp, adv, m, vpred, ret, values, logits):
    out = {}
    for mode in MODES:
        out[f"agg/{mode}"] = ca.agg_loss(x, m, mode)
        pg, metrics = ca.compute_policy_loss(old, logp, adv, m, loss_agg_mode=mode)
        out[f"pg/{mode}"] = (pg, metrics)
        out[f"asym/{mode}"] = ca.compute_policy_loss(
            old, logp, adv, m, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.0,
            loss_agg_mode=mode)[0]
        out[f"vf/{mode}"] = ca.compute_value_loss(vpred, ret, values, m, 0.5, mode)
        out[f"ent/{mode}"] = ca.compute_entropy_loss(logits, m, mode)
    out["agg/norm-scale-2"] = ca.agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=2)
    return out


def all_losses_f32(*args):
    return all_losses(*args)


def all_losses_f64(*args):
    return all_losses(*args)


ALL = {np.float32: jax.jit(chex.assert_max_traces(all_losses_f32, n=1)),
       np.float64: jax.jit(chex.assert_max_traces(all_losses_f64, n=1))}


def random_inputs(rng, m):
    old = -np.abs(rng.normal(size=(B, T)))
    logp = old + rng.normal(size=(B, T)) * 0.5  # ratios from about e^-1.5 to e^1.5
    logp[0, 0] = old[0, 0] + 25.0  # beyond the +-20 clamp of the log-ratio
    return dict(x=rng.normal(size=(B, T)), old=old, logp=logp, adv=rng.normal(size=(B, T)) * 2,
                m=m, vpred=rng.normal(size=(B, T)), ret=rng.normal(size=(B, T)),
                values=rng.normal(size=(B, T)), logits=rng.normal(size=(B, T, V)) * 2)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_losses_match_numpy(kind, dtype, tol):
    rng = np.random.default_rng(MASKS.index(kind))
    inp = {k: v.astype(dtype) for k, v in random_inputs(rng, make_mask(kind, rng)).items()}
    with jax.enable_x64(dtype == np.float64):
        out = jax.tree.map(np.asarray, ALL[dtype](*[jnp.asarray(v) for v in inp.values()]))
    x, m = inp["x"], inp["m"]
    close = lambda got, want, msg: np.testing.assert_allclose(got, want, rtol=tol, atol=tol,
                                                              err_msg=msg)
    ent = ref_entropy(inp["logits"])
    for mode in MODES:
        close(out[f"agg/{mode}"], ref_agg(x, m, mode), mode)
        pg, metrics = ref_policy(inp["old"], inp["logp"], inp["adv"], m, mode)
        close(out[f"pg/{mode}"][0], pg, f"pg {mode}")
        for key, want in metrics.items():
            close(out[f"pg/{mode}"][1][key], want, f"{key} {mode}")
        asym, _ = ref_policy(inp["old"], inp["logp"], inp["adv"], m, mode, 0.1, 0.28, 2.0)
        close(out[f"asym/{mode}"], asym, f"asym {mode}")
        vf, frac = ref_value(inp["vpred"], inp["ret"], inp["values"], m, mode)
        close(out[f"vf/{mode}"][0], vf, f"vf {mode}")
        close(out[f"vf/{mode}"][1], frac, f"vf_clipfrac {mode}")
        close(out[f"ent/{mode}"], ref_agg(ent, m, mode), f"entropy {mode}")
    close(out["agg/norm-scale-2"], ref_agg(x, m, "seq-mean-token-sum-norm", scale=2), "scale")


def test_agg_loss_hand_case():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is empty and not counted
    want = {"token-mean": 7 / 3, "token-sum": 7.0, "seq-mean-token-sum": (3 + 4) / 2,
            "seq-mean-token-mean": (1.5 + 4) / 2, "seq-mean-token-sum-norm": (3 / 3 + 4 / 3) / 2}
    got = jax.jit(lambda x, m: {mode: ca.agg_loss(x, m, mode) for mode in MODES})(loss, mask)
    for mode, value in want.items():
        assert float(got[mode]) == pytest.approx(value, rel=1e-6), mode
    assert float(ca.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=2)) \
        == pytest.approx((1.5 + 2) / 2, rel=1e-6)
    # given global counts: token-mean -> 7 / 10, seq means -> / 4
    assert float(ca.agg_loss(loss, mask, "token-mean", global_token_count=10)) \
        == pytest.approx(0.7, rel=1e-6)
    assert float(ca.agg_loss(loss, mask, "seq-mean-token-mean", global_seq_count=4)) \
        == pytest.approx(5.5 / 4, rel=1e-6)
    den = ca.agg_loss_denominators(mask)
    assert int(den["global_token_count"]) == 3 and int(den["global_seq_count"]) == 2
    assert float(ca.agg_loss(loss, jnp.zeros((3, 3)), "token-mean")) == 0.0  # empty: 0, no NaN
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        ca.agg_loss(loss, mask, "sequence-mean")


def test_policy_loss_hand_case():
    # one row, A = [1, 1, -1, -1], ratio = [1.5, .9, .5, 4], eps .2, c 3:
    # t0: L1 = -1.5, L2 = -1.2 -> -1.2 (clipped);  t1: -.9 (inside the clip range)
    # t2: L1 = .5, L2 = .8 -> .8 (clipped), below c = 3;  t3: L1 = 4 -> dual clip: 3 (lower)
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    old = jnp.zeros((1, 4))
    logp = jnp.log(jnp.array([[1.5, 0.9, 0.5, 4.0]]))
    mask = jnp.ones((1, 4))

    @jax.jit
    def losses(old, logp, adv, mask):
        # the gradient of a clipped or dual-clipped token is 0
        grad = jax.grad(lambda q: ca.compute_policy_loss(old, q, adv, mask)[0])(logp)
        asym = ca.compute_policy_loss(old, logp, adv, mask, clip_ratio_low=0.6,
                                      clip_ratio_high=0.28)[0]
        return ca.compute_policy_loss(old, logp, adv, mask), asym, grad

    (loss, metrics), asym, g = losses(old, logp, adv, mask)
    assert float(loss) == pytest.approx((-1.2 - 0.9 + 0.8 + 3.0) / 4, rel=1e-5)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.5, rel=1e-6)
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(0.25, rel=1e-6)
    assert float(metrics["ppo_kl"]) == pytest.approx(-math.log(1.5 * 0.9 * 0.5 * 4) / 4, rel=1e-5)
    # clip-higher: eps_high .28 -> t0 = -1.28; eps_low .6 -> t2 = -(-1) * .5 = .5 (unclipped)
    assert float(asym) == pytest.approx((-1.28 - 0.9 + 0.5 + 3.0) / 4, rel=1e-5)
    # d loss / d logp: 0 for the clipped t0, t2 and the dual-clipped t3; -A * ratio / 4 for t1
    np.testing.assert_allclose(g, [[0.0, -0.9 / 4, 0.0, 0.0]], atol=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(old, logp, adv, mask, clip_ratio_c=1.0)


def test_value_loss_hand_case():
    # t0: vclip = clip(1, -.5, .5) = .5: (1 - 1.5)^2 = .25 < (.5 - 1.5)^2 = 1 -> 1, clipped
    # t1: vclip = 2 (inside): 4 and 4 -> 4, not clipped.  vf = .5 * (1 + 4) / 2 = 1.25
    vf, frac = ca.compute_value_loss(jnp.array([[1.0, 2.0]]), jnp.array([[1.5, 0.0]]),
                                     jnp.array([[0.0, 2.0]]), jnp.ones((1, 2)))
    assert float(vf) == pytest.approx(1.25, rel=1e-6)
    assert float(frac) == pytest.approx(0.5, rel=1e-6)


# ------------------------------------------------------------------------------ properties


def _token_losses(old, logp, adv, eps_low, eps_high):
    """Each token's loss: token-sum over a one-hot mask, vmapped over all positions."""
    onehots = jnp.eye(B * T).reshape(B * T, B, T)
    one = lambda m: ca.compute_policy_loss(old, logp, adv, m, clip_ratio_low=eps_low,
                                           clip_ratio_high=eps_high, clip_ratio_c=3.0,
                                           loss_agg_mode="token-sum")[0]
    return jax.vmap(one)(onehots).reshape(B, T)


_token_losses_jit = jax.jit(_token_losses)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), eps_low=st.floats(0.0, 0.9),
       eps_high=st.floats(0.0, 5.0), spread=st.floats(0.01, 30.0))
def test_dual_clip_bounds_token_loss(seed, eps_low, eps_high, spread):
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(B, T)).astype(np.float32)
    logp = (old + rng.normal(size=(B, T)) * spread).astype(np.float32)
    adv = (rng.normal(size=(B, T)) * 3).astype(np.float32)
    loss = np.asarray(_token_losses_jit(old, logp, adv, eps_low, eps_high))
    neg, pos = adv < 0, adv >= 0
    # A < 0: never above -A * c (the dual clip); A >= 0: never below -A * (1 + eps_high)
    assert (loss[neg] <= (-adv * 3.0)[neg] * (1 + 1e-6)).all()
    assert (loss[pos] >= (-adv * (1 + eps_high))[pos] * (1 + 1e-6) - 1e-6).all()


def _vf_wide_vs_plain(vpred, ret, values, m):
    out = {}
    for mode in MODES:
        wide, frac = ca.compute_value_loss(vpred, ret, values, m, 1e9, mode)
        out[mode] = (wide, frac, 0.5 * ca.agg_loss(jnp.square(vpred - ret), m, mode))
    return out


_vf_wide_jit = jax.jit(_vf_wide_vs_plain)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(MASKS))
def test_value_loss_without_clipping_is_plain_mse(seed, kind):
    rng = np.random.default_rng(seed)
    vpred, ret, values = (rng.normal(size=(B, T)).astype(np.float32) * 5 for _ in range(3))
    out = _vf_wide_jit(vpred, ret, values, make_mask(kind, rng).astype(np.float32))
    for mode, (wide, frac, plain) in out.items():
        np.testing.assert_allclose(wide, plain, rtol=1e-6, err_msg=mode)
        assert float(frac) == 0.0


# ---------------------------------------------------------------------- gradient accumulation

GB, GT, GF = 8, 5, 3  # rows, response length, features of the toy model


def actor_critic_losses(params, batch, denoms):
    """A linear policy and critic: the summed policy + value loss of each mode, `[modes]`.

    The forward pass is shared; only the aggregation differs between modes, so one
    `jacrev` gives the gradients of all modes (a small program to compile). The entropy and
    KL losses aggregate through the same `agg_loss`.
    """
    logits = jnp.einsum("btf,fv->btv", batch["x"], params["pi"])
    logp = ca.logprobs_from_logits(logits, batch["labels"])
    vpred = jnp.einsum("btf,f->bt", batch["x"], params["v"])
    m = batch["mask"]
    totals, metrics = [], []
    for mode in MODES:
        pg, met = ca.compute_policy_loss(batch["old"], logp, batch["adv"], m,
                                         loss_agg_mode=mode, **denoms)
        vf, vf_clipfrac = ca.compute_value_loss(vpred, batch["ret"], batch["values"], m, 0.2,
                                                mode, **denoms)
        totals.append(pg + vf)
        metrics.append(dict(met, vf_clipfrac=vf_clipfrac, pg_loss=pg, loss=totals[-1]))
    return jnp.stack(totals), jax.tree.map(lambda *xs: jnp.stack(xs), *metrics)


_grads = jax.jacrev(actor_critic_losses, has_aux=True)  # leaves get a leading [modes] axis


def one_pass(params, batch):
    """Gradients and metrics of the whole mini-batch at once, with its local counts."""
    return _grads(params, batch, {})


def accumulate(params, micro_batches):
    """Gradients and metrics summed over micro-batches `[k, m, ...]`.

    `global`: every micro-batch divides by the mini-batch's counts (the fix);
    `local_loss`: each divides by its own counts and the mean is taken (verl's issue #5625).
    """
    denoms = ca.agg_loss_denominators(micro_batches["mask"])
    k = micro_batches["mask"].shape[0]

    def step(acc, mb):
        local_loss = actor_critic_losses(params, mb, {})[0]
        return jax.tree.map(jnp.add, acc, (*_grads(params, mb, denoms), local_loss / k)), None

    n = len(MODES)
    zeros = (jax.tree.map(lambda p: jnp.zeros((n, *p.shape), p.dtype), params),
             {key: jnp.zeros(n) for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower",
                                            "vf_clipfrac", "pg_loss", "loss")},
             jnp.zeros(n))
    (g, met, local_loss), _ = jax.lax.scan(step, zeros, micro_batches)
    return {"global": (g, met), "local_loss": local_loss}


def toy_batch(rng):
    mask = make_mask("pad_end", rng, GB, GT)
    mask[3] = 0.0  # an all-masked row (e.g. bucket padding)
    mask[5, 1:] = 0.0  # a length-1 response
    old = -np.abs(rng.normal(size=(GB, GT)))
    return {
        "x": rng.normal(size=(GB, GT, GF)), "labels": rng.integers(0, V, size=(GB, GT)),
        "mask": mask, "old": old,
        "adv": rng.normal(size=(GB, GT)), "ret": rng.normal(size=(GB, GT)),
        "values": rng.normal(size=(GB, GT)),
    }


def toy_params(rng):
    return {"pi": rng.normal(size=(GF, V)).astype(np.float32) * 0.5,
            "v": rng.normal(size=GF).astype(np.float32)}


def as_f32(tree):
    return jax.tree.map(lambda a: a.astype(np.int32 if a.dtype.kind == "i" else np.float32), tree)


def split(batch, k):
    return jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)


def check_accumulation(want, got):
    for i, mode in enumerate(MODES):
        pick = lambda tree, i=i: jax.tree.map(lambda leaf: leaf[i], tree)
        chex.assert_trees_all_close(pick(got["global"]), pick(want), rtol=1e-5, atol=1e-7)
        if mode != "token-sum":  # the split matters: local counts would give another loss
            assert abs(float(got["local_loss"][i] - want[1]["loss"][i])) > 1e-3, mode


# chex-wrapped: every call below with new values must reuse the first compile. The cheap
# backend options only shorten XLA's CPU compile of these test programs.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_one_pass = jax.jit(chex.assert_max_traces(one_pass, n=1), compiler_options=FAST_COMPILE)
_accumulate = jax.jit(chex.assert_max_traces(accumulate, n=1), compiler_options=FAST_COMPILE)


def test_gradient_accumulation_matches_one_pass():
    rng = np.random.default_rng(0)
    batch, params = as_f32(toy_batch(rng)), toy_params(rng)
    want = _one_pass(params, batch)
    # the micro-batches are uneven: different token and non-empty-row counts
    micro = split(batch, 4)
    counts = micro["mask"].sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1
    check_accumulation(want, _accumulate(params, micro))


def test_gradient_accumulation_sharded_matches_unsharded():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    P = jax.sharding.PartitionSpec
    micro_rows = jax.sharding.NamedSharding(mesh, P(None, ("data", "fsdp")))
    rng = np.random.default_rng(0)
    batch, params = as_f32(toy_batch(rng)), toy_params(rng)
    want = _one_pass(params, batch)
    with jax.set_mesh(mesh):
        micro = jax.device_put(split(batch, 2), micro_rows)  # 2 micro-batches of 4 rows
        assert micro["x"].sharding.shard_shape(micro["x"].shape)[1] == 1  # a row per shard
        sharded_acc = jax.jit(accumulate, compiler_options=FAST_COMPILE)(params, micro)
    check_accumulation(want, sharded_acc)


# -------------------------------------------------------------------------------- compile once


def test_losses_compile_once():
    rng = np.random.default_rng(9)
    for _ in range(3):  # chex raises if the shared program traces again for new values
        inp = random_inputs(rng, make_mask("arbitrary", rng))
        ALL[np.float32](*[v.astype(np.float32) for v in inp.values()])
    for _ in range(2):
        params, batch = toy_params(rng), as_f32(toy_batch(rng))
        _one_pass(params, batch)
        _accumulate(params, split(batch, 4))
