"""The LM head's log-probs and entropy of target tokens, in chunks of positions.

`token_terms(h, w, targets, spec)` gives what `core_algos.logprobs_from_logits` and
`entropy_from_logits` give on the logits `(h @ w) / temperature`, without ever holding the
float32 logits of all the tokens: a `lax.scan` over chunks of `spec.chunk` positions (all
rows of the batch at once) computes a chunk's logits, its log-softmax, the target's log-prob
and the entropy, and keeps only those per-token numbers (and the log-normaliser). Its
`custom_vjp` backward scans the chunks again, recomputes each chunk's logits from the hidden
states and the weight, and turns them into the gradients of both (z = one token's logits,
p = softmax(z), y its target, H its entropy):

    d logp / dz = onehot(y) - p          d H / dz = p * (E_p[z] - z),  E_p[z] = lse(z) - H

so the largest arrays of the forward and the backward are one chunk's `[B, c, V]`. The cost
is one more head matmul (the recomputation) than the full-logits path's three.

Sharding (`spec.mesh`, `spec.rules`; none: XLA decides): hidden states and logits keep the
batch over the `batch` axes and the vocabulary over `act_vocab`'s; the weight is gathered over
its `embed` axis once, before the scan (as the embedding lookup does), not once a chunk. The
weight gradient of each chunk contracts over the batch, which is sharded: rather than reduce
it across devices every chunk, each of the `spec.groups` batch shards adds its own partial
sum `[G, V, D]` (G sharded like the batch, no communication), and one reduction at the end
gives the gradient in the weight's own layout.

`model_token_terms` runs a `models.Model` up to its head (`Model.hidden`, `head_weight`);
`chunk_positions` turns `lm_head_chunk_size` (tokens per device per chunk; 0: off; None:
automatic) into positions per chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from rlhf_jax.mesh import logical_to_pspec

# lm_head_chunk_size None: chunk when one micro-batch's float32 logits would take more than
# AUTO_MIN_BYTES on a device, in chunks whose logits take about AUTO_CHUNK_BYTES there (at
# least AUTO_MIN_TOKENS tokens); `chunk_positions`. On the CPU the chunked update of the
# benchmark (151,936 vocab) took the same time with 256 or 1024 tokens a chunk.
AUTO_MIN_BYTES = 256 * 2**20
AUTO_CHUNK_BYTES = 128 * 2**20
AUTO_MIN_TOKENS = 64

_LOGITS = ("batch", "act_length", "act_vocab")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """Static settings of `token_terms`.

    chunk: positions per chunk (every row of the batch goes into each chunk).
    layout: the weight's, "vd" `[V, D]` (a tied embedding) or "dv" `[D, V]` (`lm_head`).
    dtype: compute dtype of the head's matmul (the model's); logits are float32 after it.
    with_entropy: compute the entropy (else zeros come back).
    entropy_grad: the entropy gets a gradient (an entropy bonus); else it is stop_gradient.
    with_sum_pi_squared: also `sum_v pi_v^2` of each position (no gradient through any
      output then: the old-log-prob pass of the optimal token baseline).
    groups: how many batch shards keep their weight-gradient partial sums apart.
    mesh, rules: pin shardings by the logical-axis rules (None: leave them to XLA).
    """

    chunk: int
    temperature: float = 1.0
    layout: str = "vd"
    dtype: Any = jnp.float32
    with_entropy: bool = True
    entropy_grad: bool = False
    with_sum_pi_squared: bool = False
    groups: int = 1
    mesh: Any = None
    rules: tuple = ()


def _pin(x, names, spec: HeadSpec):
    """`with_sharding_constraint` by logical names (no-op without a mesh)."""
    if spec.mesh is None:
        return x
    pspec = logical_to_pspec(names, x.shape, spec.mesh, spec.rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(spec.mesh, pspec))


def _vocab_axis(spec: HeadSpec) -> int:
    return 0 if spec.layout == "vd" else 1


def _gathered(w, spec: HeadSpec):
    """The weight in the compute dtype, sharded over the vocabulary only (gathered over its
    model-width axis once, outside the chunk loop)."""
    names = ("vocab", None) if spec.layout == "vd" else (None, "vocab")
    return _pin(w.astype(spec.dtype), names, spec)


def _logits(h_bcd, w, spec: HeadSpec):
    """`[B, c, V]` float32 logits / temperature of one chunk, as the model's head makes them."""
    eq = "BCD,VD->BCV" if spec.layout == "vd" else "BCD,DV->BCV"
    z = jnp.einsum(eq, h_bcd.astype(spec.dtype), w).astype(jnp.float32)
    return _pin(z, _LOGITS, spec) / spec.temperature


def _split(x_bw, n: int, c: int):
    """`[B, W, ...]` -> `[n, B, c, ...]`, zero-padded to n * c positions."""
    pad = n * c - x_bw.shape[1]
    x_bw = jnp.pad(x_bw, [(0, 0), (0, pad)] + [(0, 0)] * (x_bw.ndim - 2))
    return jnp.moveaxis(x_bw.reshape(x_bw.shape[0], n, c, *x_bw.shape[2:]), 1, 0)


def _join(x_nbc, w: int):
    """`[n, B, c, ...]` -> `[B, W, ...]` (the padding dropped)."""
    x = jnp.moveaxis(x_nbc, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :w]


def _chunk_terms(h_bcd, y_bc, w, spec: HeadSpec):
    """Log-probs, entropy and log-normaliser `[B, c]` of one chunk (float32), and
    `sum_v pi_v^2` with `spec.with_sum_pi_squared`."""
    z = _logits(h_bcd, w, spec)
    top = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - top)
    total = jnp.sum(e, axis=-1)
    lse = jnp.log(total) + top[..., 0]
    # the target's logit by comparison with a vocabulary iota: elementwise and a sum, which
    # stays local to each vocabulary shard (a gather along a sharded axis would not)
    hit = jnp.arange(z.shape[-1], dtype=jnp.int32) == y_bc[..., None]
    logp = jnp.sum(jnp.where(hit, z, 0.0), axis=-1) - lse
    if spec.with_entropy:
        ent = lse - jnp.sum(e / total[..., None] * z, axis=-1)
    else:
        ent = jnp.zeros_like(logp)
    if not spec.with_sum_pi_squared:
        return logp, ent, lse
    # sum_v (e_v / total)^2, e = exp(z - max z) in (0, 1]: no overflow, total >= 1
    return logp, ent, lse, jnp.sum(jnp.square(e), axis=-1) / jnp.square(total)


def _n_chunks(spec: HeadSpec, w: int) -> int:
    return -(-w // spec.chunk)


def _forward(h_bwd, w, y_bw, spec: HeadSpec):
    n, width = _n_chunks(spec, h_bwd.shape[1]), h_bwd.shape[1]
    wg = _gathered(w, spec)
    body = lambda _, xs: (None, _chunk_terms(xs[0], xs[1], wg, spec))
    _, out = jax.lax.scan(body, None, (_split(h_bwd, n, spec.chunk),
                                       _split(y_bw, n, spec.chunk)))
    return tuple(_join(x, width) for x in out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_terms(h_bwd, w, y_bw, spec: HeadSpec):
    logp, ent, _ = _forward(h_bwd, w, y_bw, spec)
    return logp, ent


def _token_terms_fwd(h_bwd, w, y_bw, spec: HeadSpec):
    logp, ent, lse = _forward(h_bwd, w, y_bw, spec)
    return (logp, ent), (h_bwd, w, y_bw, lse, ent)


def _token_terms_bwd(spec: HeadSpec, res, cotangents):
    h_bwd, w, y_bw, lse_bw, ent_bw = res
    g_logp, g_ent = cotangents
    b, width, d = h_bwd.shape
    n, c, g = _n_chunks(spec, width), spec.chunk, spec.groups
    wg = _gathered(w, spec)
    vd = spec.layout == "vd"
    v = w.shape[_vocab_axis(spec)]
    entropy = spec.with_entropy and spec.entropy_grad
    # each batch shard's partial weight gradient: [G, V, D] (or [G, D, V]), G like the batch
    part_names = ("batch", "vocab", None) if vd else ("batch", None, "vocab")

    def body(dw_gvd, xs):
        h, y, lse, ent, gl, ge = xs
        z = _logits(h, wg, spec)
        p = jnp.exp(z - lse[..., None])
        hit = jnp.arange(v, dtype=jnp.int32) == y[..., None]
        dz = gl[..., None] * (hit.astype(jnp.float32) - p)
        if entropy:
            dz = dz + ge[..., None] * p * ((lse - ent)[..., None] - z)
        dz = _pin((dz / spec.temperature).astype(spec.dtype), _LOGITS, spec)
        dh = jnp.einsum("BCV,VD->BCD" if vd else "BCV,DV->BCD", dz, wg)
        # tokens of each group flattened: one [M, V] x [M, D] product a group
        dz_gm = dz.reshape(g, (b // g) * c, v)
        h_gm = h.astype(spec.dtype).reshape(g, (b // g) * c, d)
        lhs, rhs = (dz_gm, h_gm) if vd else (h_gm, dz_gm)
        part = jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((0,), (0,))),
                                   preferred_element_type=jnp.float32)
        return dw_gvd + _pin(part, part_names, spec), dh

    zeros = _pin(jnp.zeros((g, *w.shape), jnp.float32), part_names, spec)
    g_ent = g_ent if entropy else jnp.zeros_like(g_logp)
    xs = tuple(_split(x, n, c) for x in (h_bwd, y_bw, lse_bw, ent_bw, g_logp, g_ent))
    dw_gvd, dh = jax.lax.scan(body, zeros, xs)
    weight_names = ("vocab", "embed") if vd else ("embed", "vocab")
    dw = _pin(jnp.sum(dw_gvd, axis=0).astype(w.dtype), weight_names, spec)
    return _join(dh, width).astype(h_bwd.dtype), dw, None


_token_terms.defvjp(_token_terms_fwd, _token_terms_bwd)


def token_terms(h_bwd, w, targets_bw, spec: HeadSpec):
    """Log-probs of the targets and the entropy under `softmax((h @ w) / T)`, in chunks.

    Args:
      h_bwd: `[B, W, D]` final hidden states (the positions that predict the targets).
      w: the head weight, `[V, D]` or `[D, V]` (`spec.layout`).
      targets_bw: `[B, W]` int token ids.
      spec: `HeadSpec`; B must be a multiple of `spec.groups`.

    Returns:
      `(log_probs, entropy)`, `[B, W]` float32 each; the entropy is zeros without
      `spec.with_entropy`, and has no gradient without `spec.entropy_grad`. With
      `spec.with_sum_pi_squared`, `(log_probs, entropy, sum_pi_squared)`, none with a
      gradient.
    """
    if h_bwd.shape[0] % spec.groups:
        raise ValueError(f"batch {h_bwd.shape[0]} is not a multiple of groups {spec.groups}")
    if spec.with_sum_pi_squared:  # a pass without gradients: the plain forward scan
        logp, ent, _, spi = _forward(h_bwd, w, targets_bw.astype(jnp.int32), spec)
        return tuple(jax.lax.stop_gradient(x) for x in (logp, ent, spi))
    logp, ent = _token_terms(h_bwd, w, targets_bw.astype(jnp.int32), spec)
    return logp, (ent if spec.entropy_grad else jax.lax.stop_gradient(ent))


# ------------------------------------------------------------------------- with a Model


def _shards(model, names, shape) -> int:
    """How many ways `model`'s layout splits an array of `shape` with logical `names`."""
    if model.mesh is None:
        return 1
    pspec = logical_to_pspec(names, shape, model.mesh, model.rules)
    axes = [a for entry in pspec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))]
    return math.prod(model.mesh.shape[a] for a in axes)


def chunk_positions(chunk_size: int | None, model, targets_shape) -> int:
    """Positions per chunk for `lm_head_chunk_size`, 0 for the full logits.

    Args:
      chunk_size: tokens a device puts through the head at once (all its rows of the
        micro-batch times the chunk's positions); 0: full logits; None: automatic, that is
        chunks of about AUTO_CHUNK_BYTES of float32 logits a device when the micro-batch's
        would take more than AUTO_MIN_BYTES there (so small heads keep the full logits).
      model: the `models.Model` (its vocabulary, and its layout for the per-device share).
      targets_shape: `(B, W)` of the micro-batch's targets.

    Returns:
      c, balanced so that ceil(W / c) chunks pad as little as they can.
    """
    b, w = targets_shape
    v = model.cfg.vocab_size
    rows = b // _shards(model, ("batch",), (b,))
    if chunk_size is None:
        token_bytes = 4 * v / _shards(model, ("act_vocab",), (v,))  # a token's logits
        big = rows * w * token_bytes > AUTO_MIN_BYTES
        chunk_size = max(int(AUTO_CHUNK_BYTES // token_bytes), AUTO_MIN_TOKENS) if big else 0
    if chunk_size <= 0:
        return 0
    c = min(max(chunk_size // max(rows, 1), 1), w)
    n = -(-w // c)
    return -(-w // n)


def model_token_terms(model, params, input_ids, positions, segment_ids, head_slice, targets,
                      *, chunk: int, temperature: float = 1.0, with_entropy: bool = True,
                      entropy_grad: bool = False, with_sum_pi_squared: bool = False):
    """`token_terms` of a causal LM's forward pass (`Model.forward`'s layout arguments):
    log-probs and entropy `[B, W]` of `targets` at the `head_slice` positions, `chunk`
    positions at a time (`chunk_positions`); and `sum_pi_squared` `[B, W]` with
    `with_sum_pi_squared`."""
    from rlhf_jax.models.model import DTYPES

    h = model.hidden(params, input_ids, head_slice=head_slice, positions=positions,
                     segment_ids=segment_ids)
    w, layout = model.head_weight(params)
    spec = HeadSpec(
        chunk=chunk, temperature=float(temperature), layout=layout, dtype=DTYPES[model.dtype],
        with_entropy=with_entropy, entropy_grad=entropy_grad,
        with_sum_pi_squared=with_sum_pi_squared,
        groups=_shards(model, ("batch",), (targets.shape[0],)),
        mesh=model.mesh, rules=tuple(model.rules) if model.mesh is not None else ())
    return token_terms(h, w, targets, spec)
