"""verl's policy-loss modes (core_algos.policy_losses, cov_losses, the registry's entries):
hand-worked cases, NumPy re-implementations, rollout-correction weights, gradient
accumulation under every loss_agg_mode, jit, sharding, and the config keys."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import core_algos as ca
from rlhf_jax import train_steps as ts
from rlhf_jax.config import ConfigError, load_config
from rlhf_jax.core_algos import PolicyLossConfig, get_policy_loss

MODES = list(ca.LOSS_AGG_MODES)
LOSS_MODES = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
              "geo_mean", "dro", "cispo"]
B, T = 6, 5
MINIMAL = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=model"]
# every setting away from its default, so a wrong wiring shows
CFG = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28,
                       clip_ratio_c=2.5, clip_cov_ratio=0.3, clip_cov_lb=0.01, clip_cov_ub=3.0,
                       kl_cov_ratio=0.2, ppo_kl_coef=0.7, dro_beta=0.4, tau_pos=1.2,
                       tau_neg=1.6)
ALL_TOKENS = PolicyLossConfig(clip_cov_ratio=1.0, clip_cov_lb=-1e9, clip_cov_ub=1e9,
                              kl_cov_ratio=1.0, dro_beta=0.4)
sig = lambda x: 1 / (1 + np.exp(-x))


def batch(seed=0, b=B, t=T):
    """Log-probs of probabilities in (0.05, 0.95), a padded mask with an empty row and a
    length-1 row, advantages of both signs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[1], lengths[2] = 0, 1
    m = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    old = np.log(rng.uniform(0.05, 0.95, (b, t)))
    logp = np.log(np.clip(np.exp(old) * rng.uniform(0.6, 1.5, (b, t)), 0.02, 0.98))
    adv = rng.normal(size=(b, t))
    return old, logp, adv, m


# ------------------------------------------------------------------ NumPy references


def ref_agg(x, m, mode, n_tok=None, n_seq=None):
    seq_sums, seq_lens = (x * m).sum(-1), m.sum(-1)
    n_tok = seq_lens.sum() if n_tok is None else n_tok
    n_seq = (seq_lens > 0).sum() if n_seq is None else n_seq
    if mode == "token-sum":
        return seq_sums.sum()
    if mode == "token-mean":
        return seq_sums.sum() / n_tok
    per_seq = {"seq-mean-token-sum": seq_sums,
               "seq-mean-token-mean": np.divide(seq_sums, seq_lens, out=np.zeros_like(seq_sums),
                                                where=seq_lens > 0),
               "seq-mean-token-sum-norm": seq_sums / x.shape[-1]}[mode]
    return per_seq.sum() / n_seq


def ref_loss(name, old, logp, adv, m, c=CFG, w=None, rng_pick=None):
    """verl's formulas, token by token: (per-token loss [B, T], {metric: per-token values})."""
    eps_lo = c.clip_ratio if c.clip_ratio_low is None else c.clip_ratio_low
    eps_hi = c.clip_ratio if c.clip_ratio_high is None else c.clip_ratio_high
    d = logp - old
    dc = np.clip(d, -20, 20)
    ratio, zero = np.exp(dc), np.zeros_like(d)
    if name == "vanilla":
        l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - eps_lo, 1 + eps_hi)
        c1 = np.maximum(l1, l2)
        l3 = -adv * c.clip_ratio_c
        loss = np.where(adv < 0, np.minimum(l3, c1), c1)
        met = {"pg_clipfrac": l2 > l1, "ppo_kl": -dc, "pg_clipfrac_lower": (c1 > l3) & (adv < 0)}
    elif name in ("dppo_tv", "dppo_kl"):
        p, po = np.exp(logp), np.exp(old)
        if name == "dppo_tv":
            valid = np.where(adv > 0, p - po <= eps_hi, p - po >= -eps_lo)
        else:
            bkl = po * (old - logp) + (1 - po) * np.log((1 - po + 1e-8) / (1 - p + 1e-8))
            valid = np.where(adv > 0, (bkl <= eps_hi) | (p <= po), (bkl <= eps_lo) | (p >= po))
        loss = -adv * np.minimum(ratio, c.clip_ratio_c) * logp * valid
        met = {"pg_clipfrac": ~valid, "ppo_kl": -dc,
               "pg_clipfrac_lower": (ratio > c.clip_ratio_c) & valid}
    elif name == "gspo":
        s = np.exp(np.minimum((d * m).sum(-1) / np.maximum(m.sum(-1), 1), 10))[:, None] + zero
        l1, l2 = -adv * s, -adv * np.clip(s, 1 - eps_lo, 1 + eps_hi)
        loss = np.maximum(l1, l2)
        met = {"pg_clipfrac": l2 > l1, "ppo_kl": -d, "pg_clipfrac_lower": zero}
    elif name == "sapo":
        tau = np.where(adv > 0, c.tau_pos, c.tau_neg)
        loss = -sig(tau * (ratio - 1)) * 4 / tau * adv
        met = {"pg_clipfrac": zero, "ppo_kl": -dc, "pg_clipfrac_lower": zero}
    elif name == "gpg":
        loss, met = -logp * adv, {}
    elif name == "dro":
        loss, met = -(logp * adv - 0.5 * c.dro_beta * d**2), {"ppo_kl": -d}
    elif name == "cispo":
        cr = np.clip(ratio, 1 - eps_lo, 1 + eps_hi)
        loss = -cr * adv * logp
        met = {"pg_clipfrac": ratio != cr, "ppo_kl": -dc, "pg_clipfrac_lower": zero}
    elif name == "geo_mean":
        sgn, dcl = np.sign(adv), np.clip(d, -eps_lo, eps_hi)
        dmin = sgn * np.minimum(sgn * d, sgn * dcl)
        n = m.sum(-1) + 1e-8
        seq = -((adv * m).sum(-1) / n) * np.exp((dmin * m).sum(-1) / n)
        if w is not None:
            seq = seq * np.exp((np.log(w + 1e-10) * m).sum(-1) / n)
        loss = seq[:, None] + zero
        met = {"pg_clipfrac": (d != dcl) & (adv > 0), "ppo_kl": -d,
               "pg_clipfrac_lower": (d != dcl) & (adv < 0)}
        return loss, met  # the weights are in already
    elif name == "kl_cov":
        valid = m > 0
        a_v, l_v = adv[valid], logp[valid]
        cov = np.full(d.shape, -np.inf)
        cov[valid] = (a_v - a_v.mean()) * (l_v - l_v.mean())
        k = max(1, int(valid.sum() * c.kl_cov_ratio))
        pick = np.zeros(d.size, bool)
        pick[np.argsort(-cov.ravel(), kind="stable")[:k]] = True
        pick = pick.reshape(d.shape) & valid
        loss = -adv * np.exp(d) + np.where(pick, c.ppo_kl_coef * np.abs(d), 0)
        met = {"ppo_kl": np.abs(d)}
    elif name == "clip_cov":
        l1, l2 = -adv * np.exp(d), -adv * np.clip(np.exp(d), 1 - eps_lo, 1 + eps_hi)
        valid = m > 0
        mean = lambda x: (x * m).sum() / (m.sum() + 1e-8)
        cov = (adv - mean(adv)) * (logp - mean(logp))
        cand = valid & ~(l2 > l1) & (cov > c.clip_cov_lb) & (cov < c.clip_cov_ub)
        pick = cand if rng_pick is None else rng_pick
        loss = np.where(pick, 0, np.maximum(l1, l2))
        met = {"pg_clipfrac": pick, "ppo_kl": -d}
    else:
        raise KeyError(name)
    if w is not None:
        loss = loss * w
    return loss, met


def ref_metrics(met, m, n_tok=None):
    n_tok = m.sum() if n_tok is None else n_tok
    return {k: (v * m).sum() / n_tok for k, v in met.items()}


def call(name, old, logp, adv, m, config=CFG, mode="token-mean", **kw):
    return get_policy_loss(name)(old, logp, adv, m, config=config, loss_agg_mode=mode, **kw)


# ------------------------------------------------------------------ hand-worked cases


def test_hand_cases():
    ln = np.log
    one = np.ones((1, 2))
    cfg = PolicyLossConfig(dro_beta=0.5)  # eps 0.2, c 3.0, tau 1.0 / 1.05, verl's defaults
    # dppo_tv, A = 1, p_old = .5: p = .8 leaves the TV region (.3 > .2) -> loss 0;
    # p = .6 stays (.1), ratio 1.2 -> loss -1 * 1.2 * ln .6 = .61299; token-mean -> .30650
    loss, met = call("dppo_tv", ln([[.5, .5]]), ln([[.8, .6]]), one, one, cfg)
    np.testing.assert_allclose(loss, -1.2 * ln(0.6) / 2, rtol=1e-5)
    np.testing.assert_allclose(met["pg_clipfrac"], 0.5)
    # dppo_kl, same tokens: bkl(.5 -> .8) = .5 ln(.5/.8) + .5 ln(.5/.2) = .22314 > .2, out;
    # bkl(.5 -> .6) = .5 ln(.5/.6) + .5 ln(.5/.4) = .02041, in
    loss, _ = call("dppo_kl", ln([[.5, .5]]), ln([[.8, .6]]), one, one, cfg)
    np.testing.assert_allclose(loss, -1.2 * ln(0.6) / 2, rtol=1e-5)
    # cispo: ratio 1.5 -> clipped to 1.2 (no gradient); A = 2, p = .6: -1.2 * 2 * ln .6
    loss, met = call("cispo", ln([[.4]]), ln([[.6]]), 2 * np.ones((1, 1)), np.ones((1, 1)), cfg)
    np.testing.assert_allclose(loss, -2.4 * ln(0.6), rtol=1e-5)
    assert float(met["pg_clipfrac"]) == 1.0
    g = jax.grad(lambda q: call("cispo", ln([[.4]]), q, 2 * np.ones((1, 1)), np.ones((1, 1)),
                                cfg)[0])(jnp.asarray(ln([[.6]]), jnp.float32))
    np.testing.assert_allclose(g, [[-2.4]], rtol=1e-5)
    # sapo at ratio 1: gate = sigmoid(0) * 4 / tau = 2 / tau; A = +1 (tau 1) -> -2,
    # A = -1 (tau 1.05) -> 2 / 1.05; seq-mean-token-mean of one row: (-2 + 1.90476) / 2
    loss, _ = call("sapo", ln([[.5, .5]]), ln([[.5, .5]]), np.array([[1.0, -1.0]]), one, cfg,
                   "seq-mean-token-mean")
    np.testing.assert_allclose(loss, (-2 + 2 / 1.05) / 2, rtol=1e-5)
    # gspo: d = [.1, .3] -> s = exp(.2) = 1.2214 > 1.2: A = 1 -> max(-1.2214, -1.2) = -1.2,
    # both tokens clipped
    loss, met = call("gspo", np.zeros((1, 2)), np.array([[0.1, 0.3]]), one, one, cfg,
                     "seq-mean-token-mean")
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    np.testing.assert_allclose(met["pg_clipfrac"], 1.0)
    # geo_mean: d = [.1, .3], A = 1: d_min = [.1, .2] -> ratio exp(.15), loss -1.16183;
    # one of two tokens clipped with A > 0
    loss, met = call("geo_mean", np.zeros((1, 2)), np.array([[0.1, 0.3]]), one, one, cfg,
                     "seq-mean-token-mean")
    np.testing.assert_allclose(loss, -np.exp(0.15), rtol=1e-5)
    np.testing.assert_allclose([met["pg_clipfrac"], met["pg_clipfrac_lower"]], [0.5, 0.0])
    # dro, beta .5: p .5 against .25 -> d = ln 2; -(ln .5 - .25 ln(2)^2) = .69315 + .12011
    loss, met = call("dro", ln([[.25]]), ln([[.5]]), np.ones((1, 1)), np.ones((1, 1)), cfg)
    np.testing.assert_allclose(loss, ln(2) + 0.25 * ln(2) ** 2, rtol=1e-5)
    np.testing.assert_allclose(met["ppo_kl"], -ln(2), rtol=1e-5)
    # gpg: -ln(.5) * 3, no metrics
    loss, met = call("gpg", np.zeros((1, 1)), ln([[.5]]), 3 * np.ones((1, 1)), np.ones((1, 1)))
    np.testing.assert_allclose(loss, 3 * ln(2), rtol=1e-5)
    assert met == {}
    # kl_cov, 4 tokens, ratio .25 -> 1 token: A = [1, -1, 1, -1], logp = [-1, -2, -3, -3.5]:
    # cov = A * (logp + 2.375) = [1.375, -.375, -.625, 1.125] -> token 0 gets + .1 * |d|,
    # d = -1 + 1.1; the losses -A * ratio are [-exp(.1), 1, -1, 1]
    c = PolicyLossConfig(kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    old, logp = np.array([[-1.1, -2, -3, -3.5]]), np.array([[-1.0, -2, -3, -3.5]])
    loss, met = call("kl_cov", old, logp, np.array([[1.0, -1, 1, -1]]), np.ones((1, 4)), c,
                     "token-sum")
    np.testing.assert_allclose(loss, -np.exp(0.1) + 0.1 * 0.1 + 1 - 1 + 1, rtol=1e-5)
    np.testing.assert_allclose(met["ppo_kl"], 0.1 / 4, rtol=1e-5)
    # clip_cov: one token in the band, ratio 1 so PPO does not clip it: its loss is 0
    c = PolicyLossConfig(clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=5.0)
    logp = np.array([[-1.0, -3.0]])  # cov = A_c * logp_c = [1 * 1, -1 * -1] = [1, 1]: none
    loss, met = call("clip_cov", logp, logp, np.array([[2.0, 0.0]]), np.ones((1, 2)), c)
    np.testing.assert_allclose(loss, -2 / 2, rtol=1e-6)
    assert float(met["pg_clipfrac"]) == 0
    logp = np.array([[-1.0, -5.0]])  # cov = [1 * 2, -1 * -2] = [2, 2]: k = 1 of the two
    loss, met = call("clip_cov", logp, logp, np.array([[2.0, 0.0]]), np.ones((1, 2)), c)
    assert float(met["pg_clipfrac"]) == 0.5
    assert float(loss) in (0.0, -1.0)


# ------------------------------------------------------------------ against NumPy


@pytest.mark.parametrize("name", LOSS_MODES)
def test_modes_match_numpy_under_every_agg_mode(name):
    old, logp, adv, m = batch(1)
    w = np.random.default_rng(2).uniform(0.5, 2.0, (B, T))
    n_tok, n_seq = m.sum() + 3, (m.sum(-1) > 0).sum() + 1  # global counts of a larger batch
    config = ALL_TOKENS if name == "clip_cov" else CFG  # clip_cov: every candidate, no draw
    with jax.enable_x64(True):
        for mode in MODES:
            for weights in (None, w):
                got, met = call(name, old, logp, adv, m, config, mode,
                                global_token_count=n_tok, global_seq_count=n_seq,
                                rollout_is_weights=weights)
                loss, want_met = ref_loss(name, old, logp, adv, m, config, weights)
                np.testing.assert_allclose(got, ref_agg(loss, m, mode, n_tok, n_seq),
                                           rtol=1e-10, atol=1e-12, err_msg=mode)
                want_met = ref_metrics(want_met, m, n_tok)
                assert set(met) == set(want_met)
                for k, v in want_met.items():
                    np.testing.assert_allclose(met[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "gspo", "cispo", "sapo", "dro", "gpg"])
def test_gradients_follow_the_stop_gradients(name):
    # d loss / d logp by hand (token-mean): what each mode differentiates and what it holds
    old, logp, adv, m = batch(3)
    with jax.enable_x64(True):
        got = jax.grad(lambda q: call(name, old, q, adv, m)[0])(jnp.asarray(logp))
    eps_lo, eps_hi, c = 0.15, 0.28, 2.5
    ratio, n = np.exp(logp - old), m.sum()
    if name in ("dppo_tv", "dppo_kl"):
        _, met = ref_loss(name, old, logp, adv, m)
        want = -adv * np.minimum(ratio, c) * ~met["pg_clipfrac"]
    elif name == "cispo":
        want = -np.clip(ratio, 1 - eps_lo, 1 + eps_hi) * adv
    elif name == "sapo":
        tau = np.where(adv > 0, 1.2, 1.6)
        s = sig(tau * (ratio - 1))
        want = -adv * 4 * s * (1 - s) * ratio
    elif name == "dro":
        want = -(adv - 0.4 * (logp - old))
    elif name == "gpg":
        want = -adv
    else:  # gspo: the gradient of logp scaled by the sequence ratio, 0 where it is clipped
        _, met = ref_loss(name, old, logp, adv, m)
        s = np.exp(((logp - old) * m).sum(-1) / np.maximum(m.sum(-1), 1))[:, None]
        want = -adv * s * ~met["pg_clipfrac"]
    np.testing.assert_allclose(got, want * m / n, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["geo_mean", "kl_cov", "clip_cov", "vanilla"])
def test_gradients_match_finite_differences(name):
    old, logp, adv, m = batch(4)
    config = ALL_TOKENS if name == "clip_cov" else CFG
    f = lambda q: ref_agg(ref_loss(name, old, q, adv, m, config)[0], m, "seq-mean-token-mean")
    with jax.enable_x64(True):
        got = np.asarray(jax.grad(lambda q: call(name, old, q, adv, m, config,
                                                 "seq-mean-token-mean")[0])(jnp.asarray(logp)))
    h, want = 1e-6, np.zeros_like(logp)
    for i, j in zip(*np.nonzero(m), strict=True):
        e = np.zeros_like(logp)
        e[i, j] = h
        want[i, j] = (f(logp + e) - f(logp - e)) / (2 * h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def test_rollout_weights_carry_no_gradient_and_ones_change_nothing():
    old, logp, adv, m = batch(5)
    w = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2, (B, T)))
    with jax.enable_x64(True):
        for name in LOSS_MODES:
            grad = jax.grad(lambda v, name=name: call(name, old, logp, adv, m,
                                                      rollout_is_weights=v)[0])(w)
            assert float(jnp.abs(grad).sum()) == 0, name
            np.testing.assert_allclose(call(name, old, logp, adv, m)[0],
                                       call(name, old, logp, adv, m,
                                            rollout_is_weights=np.ones((B, T)))[0],
                                       rtol=1e-9, err_msg=name)  # geo_mean: log(1 + 1e-10)


# ------------------------------------------------------------- gradient accumulation


def _value_and_grad(name, old, logp, adv, m, config, mode, counts):
    def loss(q):
        return call(name, old, q, adv, m, config, mode, **counts)
    return jax.value_and_grad(loss, has_aux=True)(logp)


@functools.partial(jax.jit, static_argnames=("name", "config"))
def _every_agg_mode(name, old, logp, adv, m, config, counts):
    return {mode: _value_and_grad(name, old, logp, adv, m, config, mode, counts)
            for mode in MODES}


@pytest.mark.parametrize("name", LOSS_MODES)
def test_micro_batches_add_up_to_one_pass(name):
    # 3 uneven micro-batches of 2 rows, each divided by the mini-batch's counts: the losses,
    # gradients and metrics add up to one pass; clip_cov / kl_cov choose every token here,
    # so their per-micro-batch choice is the batch's (see the next test)
    old, logp, adv, m = (x.astype(np.float32) for x in batch(6))
    config = ALL_TOKENS if name in ("clip_cov", "kl_cov") else CFG
    counts = ca.agg_loss_denominators(m)
    one = _every_agg_mode(name, old, logp, adv, m, config, counts)
    micro = [_every_agg_mode(name, old[rows], logp[rows], adv[rows], m[rows], config, counts)
             for rows in (slice(0, 2), slice(2, 4), slice(4, 6))]
    for mode in MODES:
        (loss, met), grad = one[mode]
        tot_loss, tot_met, grads = 0.0, {k: 0.0 for k in met}, []
        for out in micro:
            (lk, mk), gk = out[mode]
            tot_loss, grads = tot_loss + lk, [*grads, gk]
            tot_met = {k: tot_met[k] + mk[k] for k in met}
        np.testing.assert_allclose(tot_loss, loss, rtol=2e-5, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(np.concatenate(grads), grad, rtol=2e-5, atol=1e-7)
        for k in met:
            np.testing.assert_allclose(tot_met[k], met[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_cov_modes_choose_tokens_per_micro_batch():
    # as verl: the covariance, its means and the number of tokens are those of the call
    # (the micro-batch); a micro-batch's loss is the reference computed on its rows alone
    old, logp, adv, m = batch(7, b=8, t=6)
    counts = dict(global_token_count=m.sum(), global_seq_count=(m.sum(-1) > 0).sum())
    c = PolicyLossConfig(kl_cov_ratio=0.25, ppo_kl_coef=0.7)
    with jax.enable_x64(True):
        for rows in (slice(0, 4), slice(4, 8)):
            got, _ = call("kl_cov", old[rows], logp[rows], adv[rows], m[rows], c, **counts)
            loss, _ = ref_loss("kl_cov", old[rows], logp[rows], adv[rows], m[rows], c)
            np.testing.assert_allclose(got, ref_agg(loss, m[rows], "token-mean", m.sum()),
                                       rtol=1e-10)
        one, _ = call("kl_cov", old, logp, adv, m, c)
        split = sum(float(call("kl_cov", old[r], logp[r], adv[r], m[r], c, **counts)[0])
                    for r in (slice(0, 4), slice(4, 8)))
        assert abs(split - float(one)) > 1e-6  # the two halves choose other tokens


def test_clip_cov_draws_k_of_the_candidates():
    old, logp, adv, m = batch(8, b=16, t=8)
    c = PolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=100.0)
    _, met = ref_loss("clip_cov", old, logp, adv, m, c)
    candidates = met["pg_clipfrac"]
    k = max(int(0.05 * m.sum()), 1)
    assert candidates.sum() > k
    clip_cov = functools.partial(ca.compute_policy_loss_clip_cov, clip_cov_ratio=0.05,
                                 clip_cov_lb=0.0, clip_cov_ub=100.0)
    chosen = []
    for rng in (None, jax.random.key(1), jax.random.key(2)):
        with jax.enable_x64(True):
            _, got = clip_cov(old, logp, adv, m, global_token_count=1, rng=rng)
            assert int(round(float(got["pg_clipfrac"]))) == k  # a sum over the mask: k tokens
            # the chosen tokens, where the loss has no gradient, are k of the candidates
            token = jax.grad(lambda q, rng=rng: clip_cov(old, q, adv, m, loss_agg_mode="token-sum",
                                                         rng=rng)[0])(logp)
        pick = (np.asarray(token) == 0) & candidates  # (PPO-clipped tokens have none too)
        assert pick.sum() == k
        chosen.append(pick)
    assert not all((chosen[0] == p).all() for p in chosen[1:])  # other keys, other draws
    again = call("clip_cov", old, logp, adv, m, c)
    assert float(again[0]) == float(call("clip_cov", old, logp, adv, m, c)[0])  # same inputs


# ------------------------------------------------------------- jit and sharding


def test_sharded_losses_match_unsharded():
    # the (2, 2, 2) mesh with rows over data x fsdp against one device, every mode
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    old, logp, adv, m = (x.astype(np.float32) for x in batch(9, b=8, t=6))
    counts = ca.agg_loss_denominators(m)
    def every(old, logp, adv, m, counts):
        return {n: _value_and_grad(n, old, logp, adv, m, CFG, "seq-mean-token-mean", counts)
                for n in LOSS_MODES}

    want = jax.jit(every)(old, logp, adv, m, counts)
    got = jax.jit(every)(*[jax.device_put(x, rows) for x in (old, logp, adv, m)], counts)
    for name in LOSS_MODES:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=name)


def test_dro_without_beta_fails():
    old, logp, adv, m = batch()
    with pytest.raises(ValueError, match="dro_beta must be a positive number"):
        call("dro", old, logp, adv, m, PolicyLossConfig())


# ------------------------------------------------------------- config keys


def test_config_keys_defaults_and_wiring():
    cfg = load_config(None, MINIMAL)
    actor = cfg.actor_rollout_ref.actor
    pl = actor.policy_loss
    assert (pl.clip_cov_ratio, pl.clip_cov_lb, pl.clip_cov_ub, pl.kl_cov_ratio, pl.ppo_kl_coef,
            pl.dro_beta, actor.tau_pos, actor.tau_neg) == (0.0002, 1.0, 5.0, 0.0002, 0.1, None,
                                                           1.0, 1.05)
    a = "actor_rollout_ref.actor"
    cfg = load_config(None, [*MINIMAL, f"{a}.policy_loss.loss_mode=dro",
                             f"{a}.policy_loss.dro_beta=0.4", f"{a}.policy_loss.clip_cov_ratio=0.3",
                             f"{a}.policy_loss.clip_cov_lb=0.01", f"{a}.policy_loss.clip_cov_ub=3",
                             f"{a}.policy_loss.kl_cov_ratio=0.2",
                             f"{a}.policy_loss.ppo_kl_coef=0.7", f"{a}.tau_pos=1.2",
                             f"{a}.tau_neg=1.6", f"{a}.clip_ratio_low=0.15",
                             f"{a}.clip_ratio_high=0.28", f"{a}.clip_ratio_c=2.5"])
    loss = ts.ActorLoss.from_config(cfg.actor_rollout_ref.actor, 1.0)
    assert loss.loss_mode == "dro"
    assert loss.policy == CFG
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.policy_loss.dro_beta: must "
                                          r"be > 0 when loss_mode is dro, got None$"):
        load_config(None, [*MINIMAL, f"{a}.policy_loss.loss_mode=dro"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.policy_loss.kl_cov_ratio: "
                                          r"must be > 0, got 0.0$"):
        load_config(None, [*MINIMAL, f"{a}.policy_loss.kl_cov_ratio=0"])
