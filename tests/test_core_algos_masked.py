"""core_algos.masked: masked reductions, log-probs and entropy; and the light import."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_jax import core_algos as ca

B, T, V = 5, 7, 11


def make_mask(kind, rng, b=B, t=T):
    """0/1 masks: padding at the end, no padding, arbitrary holes, and the edge cases."""
    if kind == "no_pad":
        return np.ones((b, t))
    if kind == "arbitrary":
        m = (rng.random((b, t)) < 0.6).astype(float)
        m[0, 0] = m[0, 1] = 1.0  # at least two valid tokens
        return m
    lengths = rng.integers(1, t + 1, size=b)
    if kind == "edge":
        lengths[0], lengths[1] = 0, 1  # an all-masked row and a length-1 response
    return (np.arange(t)[None, :] < lengths[:, None]).astype(float)


MASKS = ["pad_end", "no_pad", "arbitrary", "edge"]
DTYPES = [(np.float64, 1e-6), (np.float32, 1e-5)]


def ref_stats(x, m):
    """NumPy loop: mean and unbiased variance over the masked entries."""
    vals = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if m[i, j]]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return mean, var


def run(dtype, fn, *args):
    """Runs `fn` on `args` cast to `dtype`, with 64-bit enabled for float64."""
    with jax.enable_x64(dtype == np.float64):
        out = jax.jit(fn)(*[jnp.asarray(np.asarray(a, dtype)) for a in args])
        return jax.tree.map(np.asarray, out)


def test_masked_hand_case():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    m = np.array([[1, 0], [1, 1]])
    assert float(ca.masked_sum(x, m)) == pytest.approx(8.0)
    assert float(ca.masked_mean(x, m)) == pytest.approx(8 / 3, rel=1e-6)
    # deviations -5/3, 1/3, 4/3 -> squares sum 42/9; / 3 * 3/2 = 7/3
    assert float(ca.masked_var(x, m)) == pytest.approx(7 / 3, rel=1e-6)
    assert float(ca.masked_var(x, m, unbiased=False)) == pytest.approx(14 / 9, rel=1e-6)
    np.testing.assert_allclose(ca.masked_mean(x, m, axis=-1), [1.0, 3.5], rtol=1e-6)
    np.testing.assert_allclose(ca.masked_sum(x, m, axis=0), [4.0, 4.0], rtol=1e-6)
    w = ca.masked_whiten(x, m)
    np.testing.assert_allclose(w, (x - 8 / 3) / np.sqrt(7 / 3 + 1e-8), rtol=1e-5)
    np.testing.assert_allclose(ca.masked_whiten(x, m, shift_mean=False), w + 8 / 3, rtol=1e-5)


def test_masked_edge_cases():
    x = np.array([[np.nan, 1.0], [np.inf, 2.0]])
    m = np.array([[0, 1], [0, 1]])
    assert float(ca.masked_sum(x, m)) == 3.0  # inf/nan under the mask are ignored
    assert float(ca.masked_mean(jnp.ones((2, 3)), jnp.zeros((2, 3)))) == 0.0
    assert float(ca.masked_var(jnp.ones((2, 3)), jnp.zeros((2, 3)))) == 0.0
    one = jnp.zeros((2, 3)).at[1, 2].set(1)
    assert float(ca.masked_var(jnp.arange(6.0).reshape(2, 3), one)) == 0.0  # N = 1
    # bool and int masks behave as 0/1 floats
    assert float(ca.masked_mean(x, m.astype(bool))) == pytest.approx(1.5)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_masked_stats_match_numpy(kind, dtype, tol):
    rng = np.random.default_rng(MASKS.index(kind))
    x = rng.normal(size=(B, T)) * 3 + 1
    m = make_mask(kind, rng)
    mean, var = ref_stats(x, m)
    got_mean, got_var, got_w, got_rows = run(
        dtype, lambda x, m: (ca.masked_mean(x, m), ca.masked_var(x, m), ca.masked_whiten(x, m),
                             ca.masked_mean(x, m, axis=-1)), x, m)
    np.testing.assert_allclose(got_mean, mean, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_var, var, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_w, (x - mean) / np.sqrt(var + 1e-8), rtol=tol, atol=tol)
    rows = [sum(x[i, j] for j in range(T) if m[i, j]) / max(m[i].sum(), 1) for i in range(B)]
    np.testing.assert_allclose(got_rows, rows, rtol=tol, atol=tol)


_whiten64 = jax.jit(ca.masked_whiten)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 100.0))
def test_whiten_property_mean0_var1(seed, scale):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T)) * scale + rng.normal() * 10
    m = make_mask("arbitrary", rng)
    with jax.enable_x64(True):
        w = np.asarray(_whiten64(x, m))
    vals = w[m > 0]
    raw_var = x[m > 0].var(ddof=1)
    assert abs(vals.mean()) < 1e-6  # the 1e-8 of masked_mean shifts it slightly
    # rsqrt(var + 1e-8): the variance is var / (var + 1e-8), 1 up to that epsilon
    assert vals.var(ddof=1) == pytest.approx(raw_var / (raw_var + 1e-8), rel=1e-9)
    assert vals.var(ddof=1) == pytest.approx(1.0, rel=1e-4)


def ref_logprobs_entropy(z, labels):
    """NumPy loop over positions: log-softmax of the label and the entropy, in float64."""
    b, t, _ = z.shape
    logp, ent = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            row = z[i, j].astype(np.float64)
            shifted = row - row.max()
            log_probs = shifted - np.log(np.exp(shifted).sum())
            logp[i, j] = log_probs[labels[i, j]]
            ent[i, j] = -(np.exp(log_probs) * log_probs).sum()
    return logp, ent


def test_logprobs_entropy_hand_case():
    logits = jnp.array([[[0.0, np.log(3.0)]]])  # probs 1/4, 3/4
    assert float(ca.logprobs_from_logits(logits, jnp.array([[1]]))[0, 0]) == pytest.approx(
        np.log(0.75), rel=1e-6)
    assert float(ca.logprobs_from_logits(logits, jnp.array([[0]]))[0, 0]) == pytest.approx(
        np.log(0.25), rel=1e-6)
    h = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    assert float(ca.entropy_from_logits(logits)[0, 0]) == pytest.approx(h, rel=1e-6)


def test_logprobs_entropy_stable_for_huge_logits():
    logits = jnp.array([[[1000.0, 0.0, -1000.0]]], jnp.float32)

    @jax.jit
    def f(z):
        lp = ca.logprobs_from_logits(jnp.concatenate([z] * 3, 1), jnp.array([[0, 1, 2]]))
        # bf16 logits are computed in float32
        lp16 = ca.logprobs_from_logits(z.astype(jnp.bfloat16), jnp.zeros((1, 1), jnp.int32))
        return lp, ca.entropy_from_logits(z), lp16

    lp, h, lp16 = f(logits)
    np.testing.assert_allclose(lp, [[0.0, -1000.0, -2000.0]], rtol=1e-6)
    assert np.isfinite(h).all() and abs(float(h[0, 0])) < 1e-6
    assert lp16.dtype == jnp.float32 and float(lp16[0, 0]) == 0.0


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_logprobs_entropy_match_numpy(dtype, tol):
    rng = np.random.default_rng(7)
    z = rng.normal(size=(B, T, V)) * 4
    labels = rng.integers(0, V, size=(B, T))
    logp, ent = ref_logprobs_entropy(z.astype(dtype), labels)

    def fn(zj, lab):
        # the gradient of a log-prob is onehot - softmax
        g = jax.grad(lambda q: ca.logprobs_from_logits(q, lab)[0, 0])(zj)
        return ca.logprobs_from_logits(zj, lab), ca.entropy_from_logits(zj), g

    with jax.enable_x64(dtype == np.float64):
        got_lp, got_h, g = jax.jit(fn)(jnp.asarray(z, dtype), jnp.asarray(labels))
    np.testing.assert_allclose(got_lp, logp, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_h, ent, rtol=tol, atol=tol)
    p00 = np.exp(z[0, 0] - z[0, 0].max())
    p00 /= p00.sum()
    np.testing.assert_allclose(g[0, 0], np.eye(V)[labels[0, 0]] - p00, rtol=tol, atol=tol)


def test_masked_functions_compile_once():
    rng = np.random.default_rng(0)
    fns = {
        "masked_sum": lambda x, m, z, lab: ca.masked_sum(x, m),
        "masked_mean": lambda x, m, z, lab: ca.masked_mean(x, m, axis=-1),
        "masked_var": lambda x, m, z, lab: ca.masked_var(x, m),
        "masked_whiten": lambda x, m, z, lab: ca.masked_whiten(x, m),
        "logprobs_from_logits": lambda x, m, z, lab: ca.logprobs_from_logits(z, lab),
        "entropy_from_logits": lambda x, m, z, lab: ca.entropy_from_logits(z),
    }
    for fn in fns.values():
        jitted = jax.jit(chex.assert_max_traces(fn, n=1))
        for _ in range(3):
            jitted(rng.normal(size=(B, T)).astype(np.float32),
                   make_mask("pad_end", rng).astype(np.float32),
                   rng.normal(size=(B, T, V)).astype(np.float32),
                   rng.integers(0, V, size=(B, T)).astype(np.int32))


def test_import_pulls_in_no_heavy_dependency():
    heavy = ["flax", "optax", "orbax", "grain", "ray", "jetstream", "tensorflow"]
    code = (
        "import sys, rlhf_jax.core_algos as ca\n"
        "[getattr(ca, name) for name in ca.__all__]\n"  # the names load their modules lazily
        f"bad = [m for m in sys.modules if m.split('.')[0] in {heavy!r}]\n"
        "assert 'jax' in sys.modules\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    assert out.stdout.strip() == "", f"core_algos imported {out.stdout.strip()}"


def test_registries_load_without_jax():
    """The config reads the registered names, and reading a config must not load jax."""
    code = (
        "import sys, rlhf_jax.core_algos as ca\n"
        "assert 'grpo' in ca.adv_estimator_names() and 'vanilla' in ca.policy_loss_names()\n"
        "print(','.join(m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "", f"the registries imported {out.stdout.strip()}"


def test_lazy_names_are_the_module_attributes():
    from rlhf_jax.core_algos import advantages, losses, registry

    assert ca.compute_policy_loss is losses.compute_policy_loss
    assert ca.compute_gae_return is advantages.compute_gae_return
    assert ca.get_adv_estimator is registry.get_adv_estimator
    assert ca.advantages is advantages and set(ca.__all__) <= set(dir(ca))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        ca.no_such_name  # noqa: B018
