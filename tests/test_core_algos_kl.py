"""core_algos.kl: the KL penalty estimators and the KL-coefficient controllers."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import core_algos as ca

POINT = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
DTYPES = [(np.float64, 1e-6), (np.float32, 1e-5)]


def ref_kl(logp, ref, name):
    """NumPy loop over tokens of each estimator (the value; '+' keeps the value)."""
    name = name.rstrip("+")
    out = np.zeros(logp.shape)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            d = float(logp[i, j]) - float(ref[i, j])
            if name in ("kl", "k1"):
                out[i, j] = d
            elif name == "abs":
                out[i, j] = abs(d)
            elif name in ("mse", "k2"):
                out[i, j] = 0.5 * d * d
            else:
                x = min(max(-d, -20.0), 20.0)
                out[i, j] = min(max(math.exp(x) - x - 1, -10.0), 10.0)
    return out


def all_penalties(logp, ref):
    """Every point estimator, value and gradient w.r.t. logp, in one program."""
    out = {}
    for name in POINT + [n + "+" for n in POINT]:
        value = ca.kl_penalty(logp, ref, name)
        grad = jax.grad(lambda q, name=name: jnp.sum(ca.kl_penalty(q, ref, name)))(logp)
        out[name] = (value, grad)
    return out


def all_penalties_f32(logp, ref):
    return all_penalties(logp, ref)


def all_penalties_f64(logp, ref):
    return all_penalties(logp, ref)


ALL = {np.float32: jax.jit(chex.assert_max_traces(all_penalties_f32, n=1)),
       np.float64: jax.jit(chex.assert_max_traces(all_penalties_f64, n=1))}


def test_kl_hand_case():
    # d = logp - ref = 1 and -0.5; and two clipped log-ratios
    logp = jnp.array([[-1.0, -2.0, -31.0, 0.0]])
    ref = jnp.array([[-2.0, -1.5, -1.0, -30.0]])
    # embedded in the [6, 9] shape of the other calls, so the program compiles once
    pad = lambda x: jnp.zeros((6, 9)).at[0, :4].set(x[0])
    out = jax.tree.map(lambda a: a[:1, :4], ALL[np.float32](pad(logp), pad(ref)))
    e = math.e
    np.testing.assert_allclose(out["k1"][0][0, :2], [1.0, -0.5], rtol=1e-6)
    np.testing.assert_allclose(out["abs"][0][0, :2], [1.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(out["k2"][0][0, :2], [0.5, 0.125], rtol=1e-6)
    # k3 with x = ref - logp: x = -1 -> e^-1 + 1 - 1 = 1/e; x = .5 -> e^.5 - 1.5
    np.testing.assert_allclose(out["k3"][0][0, :2], [1 / e, math.sqrt(e) - 1.5], rtol=1e-6)
    # d = -30: x = clip(30, .., 20) -> e^20 - 21, clipped to 10; d = 30: x = -20 -> 19 -> 10
    np.testing.assert_allclose(out["k3"][0][0, 2:], [10.0, 10.0])
    np.testing.assert_array_equal(out["low_var_kl"][0], out["k3"][0])
    np.testing.assert_array_equal(out["kl"][0], out["k1"][0])
    np.testing.assert_array_equal(out["mse"][0], out["k2"][0])
    # '+': same value, gradient of k2 = d
    for name in POINT:
        np.testing.assert_allclose(out[name + "+"][0], out[name][0], rtol=1e-6)
        np.testing.assert_allclose(out[name + "+"][1], logp - ref, rtol=1e-6)
    # plain gradients: k1 -> 1, abs -> sign(d), k3 -> 1 - exp(-d) where unclipped, 0 when clipped
    np.testing.assert_allclose(out["k1"][1], 1.0)
    np.testing.assert_allclose(out["abs"][1][0, :2], [1.0, -1.0])
    np.testing.assert_allclose(out["k3"][1][0], [1 - 1 / e, 1 - math.sqrt(e), 0.0, 0.0],
                               rtol=1e-6)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_kl_estimators_match_numpy(dtype, tol):
    rng = np.random.default_rng(0)
    logp = -np.abs(rng.normal(size=(6, 9))) * 2
    ref = -np.abs(rng.normal(size=(6, 9))) * 2
    with jax.enable_x64(dtype == np.float64):
        out = ALL[dtype](jnp.asarray(logp, dtype), jnp.asarray(ref, dtype))
    d = logp.astype(dtype).astype(np.float64) - ref.astype(dtype).astype(np.float64)
    for name, (value, grad) in out.items():
        want = ref_kl(logp.astype(dtype), ref.astype(dtype), name)
        np.testing.assert_allclose(np.asarray(value), want, rtol=tol, atol=tol, err_msg=name)
        if name.endswith("+"):
            np.testing.assert_allclose(np.asarray(grad), d, rtol=tol, atol=tol, err_msg=name)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="low_var_kl.*full"):
        ca.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "k4")
    with pytest.raises(ValueError, match="full"):
        ca.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "full+")
    with pytest.raises(ValueError, match="logits"):
        ca.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "full")


def ref_full_kl(z, zr):
    b, t, _ = z.shape
    out = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            p = np.exp(z[i, j] - z[i, j].max())
            p /= p.sum()
            q = np.exp(zr[i, j] - zr[i, j].max())
            q /= q.sum()
            out[i, j] = sum(p[v] * math.log(p[v] / q[v]) for v in range(len(p)) if p[v] > 0)
    return out


def full_kl_f32(logits, ref_logits):
    return (ca.kl_penalty_full(logits, ref_logits),
            ca.kl_penalty(None, None, "full", logits=logits, ref_logits=ref_logits))


def full_kl_f64(logits, ref_logits):
    return (ca.kl_penalty_full(logits, ref_logits),
            ca.kl_penalty(None, None, "full", logits=logits, ref_logits=ref_logits))


FULL = {np.float32: jax.jit(chex.assert_max_traces(full_kl_f32, n=1)),
        np.float64: jax.jit(chex.assert_max_traces(full_kl_f64, n=1))}


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_full_kl(dtype, tol):
    # hand case: p = (1/2, 1/2), q = (1/4, 3/4): KL = .5 ln 2 + .5 ln(2/3) = .5 ln(4/3)
    rng = np.random.default_rng(1)
    z = rng.normal(size=(3, 4, 5)) * 2
    zr = rng.normal(size=(3, 4, 5)) * 2
    z[0, 0], zr[0, 0] = [0, 0, -1e4, -1e4, -1e4], [0, np.log(3), -1e4, -1e4, -1e4]
    zr[1, 1] = z[1, 1]
    with jax.enable_x64(dtype == np.float64):
        got, via_name = FULL[dtype](jnp.asarray(z, dtype), jnp.asarray(zr, dtype))
        again, _ = FULL[dtype](jnp.asarray(zr, dtype), jnp.asarray(z, dtype))  # no retrace
    np.testing.assert_allclose(again, ref_full_kl(zr, z), rtol=tol, atol=tol)
    np.testing.assert_allclose(got[0, 0], 0.5 * np.log(4 / 3), rtol=tol)
    assert abs(float(got[1, 1])) < tol  # identical distributions
    np.testing.assert_allclose(got, ref_full_kl(z, zr), rtol=tol, atol=tol)
    np.testing.assert_array_equal(got, via_name)
    assert (np.asarray(got) >= -tol).all()


def test_kl_controllers_hand_case():
    # target .02, horizon 100, n_steps 10: kl .03 -> e = .5 -> clipped .2 -> x 1.02;
    # kl .01 -> e = -.5 -> -.2 -> x .98; kl .021 -> e = .05 -> x 1.005
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=100)
    state = ctrl.init()
    assert isinstance(state, ca.KLControllerState) and state.kl_coef.dtype == jnp.float32
    update = jax.jit(ctrl.update)
    for kl, mult in [(0.03, 1.02), (0.01, 0.98), (0.021, 1.005)]:
        new = update(state, kl, 10)
        np.testing.assert_allclose(new.kl_coef, 0.1 * mult, rtol=1e-6)
    # two steps compose
    two = update(update(state, 0.03, 10), 0.03, 10)
    np.testing.assert_allclose(two.kl_coef, 0.1 * 1.02 * 1.02, rtol=1e-6)
    fixed = ca.FixedKLController(kl_coef=0.05)
    np.testing.assert_allclose(jax.jit(fixed.update)(fixed.init(), 1.0, 10).kl_coef, 0.05)
    # the state is a pytree: it flattens into one leaf and rebuilds
    leaves, treedef = jax.tree.flatten(two)
    assert len(leaves) == 1
    assert jax.tree.unflatten(treedef, leaves) == two


def test_kl_controller_jit_scan_and_compile_once():
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=1000)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, kl):
        return ctrl.update(state, kl, 256)

    state = ctrl.init()
    for kl in (0.05, 0.0, 0.02):
        state = step(state, jnp.float32(kl))
    np.testing.assert_allclose(state.kl_coef, 0.1 * (1 + 0.2 * 0.256) * (1 - 0.2 * 0.256),
                               rtol=1e-6)
    # inside a scan (a training loop): the coefficient stays positive and moves towards target
    kls = jnp.full((50,), 0.2)
    final, _ = jax.lax.scan(lambda s, kl: (ctrl.update(s, kl, 256), None), ctrl.init(), kls)
    np.testing.assert_allclose(final.kl_coef, 0.1 * (1 + 0.2 * 0.256) ** 50, rtol=1e-5)


def test_get_kl_controller():
    assert ca.get_kl_controller("fixed", 0.01) == ca.FixedKLController(0.01)
    adaptive = ca.get_kl_controller("adaptive", 0.001, target_kl=0.02, horizon=10000)
    assert adaptive == ca.AdaptiveKLController(0.001, 0.02, 10000)
    hash(adaptive)  # usable as a static jit argument
    with pytest.raises(ValueError, match="fixed, adaptive"):
        ca.get_kl_controller("pid", 0.01)
    with pytest.raises(ValueError, match="horizon"):
        ca.get_kl_controller("adaptive", 0.01, target_kl=0.02, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        ca.get_kl_controller("adaptive", 0.01)
