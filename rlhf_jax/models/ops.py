"""Array functions of the decoder, each shaped for XLA: the projections' product with a
hand-written backward, the rotary table and rotation, the gated SiLU, the sliding-window
mask, and the full-sequence attention in query blocks.

Pure `jax.numpy`; `rlhf_jax.models.transformer` builds its modules on them. Shapes use the
dimension letters of that module (B, T, H, ...).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, w, nk: int, precision=None):
    """`x [..., K...] @ w [K..., N...]`: x's last `nk` dims against w's first `nk`."""
    return jax.lax.dot_general(
        x, w, ((tuple(range(x.ndim - nk, x.ndim)), tuple(range(nk))), ((), ())),
        precision=precision)


def _matmul_fwd(x, w, nk, precision):
    return _matmul(x, w, nk, precision), (x, w)


def _matmul_bwd(nk, precision, res, dy):
    x, w = res
    nn_ = w.ndim - nk
    dx = jax.lax.dot_general(
        dy, w, ((tuple(range(dy.ndim - nn_, dy.ndim)), tuple(range(nk, w.ndim))), ((), ())),
        precision=precision)
    # The weight gradient as one [M, K] x [M, N] -> [K, N] product over the flattened
    # tokens M: left to autodiff (a contraction over the batch and length dims), XLA on CPU
    # transposes the output cotangent to [N, M] first, inside the fusion that produces it,
    # a strided loop that costs as much as the matmuls of the layer.
    x2 = x.reshape(-1, math.prod(w.shape[:nk]))
    dy2 = dy.reshape(-1, math.prod(w.shape[nk:]))
    dw = jax.lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())), precision=precision)
    return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None,
                      preferred_element_type=None):
    """`lax.dot_general` for `nn.Dense` / `nn.DenseGeneral` layers: the same product, with a
    hand-written backward (`_matmul`) when it contracts the inputs' trailing dims with the
    kernel's leading ones (every projection here); anything else goes to `lax.dot_general`."""
    (lc, rc), (lb, rb) = dimension_numbers
    nk = len(lc)
    if (lb or rb or preferred_element_type is not None
            or tuple(lc) != tuple(range(lhs.ndim - nk, lhs.ndim))
            or tuple(rc) != tuple(range(nk))):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
    return _matmul(lhs, rhs, nk, precision)


def rope_table(positions_bt, head_dim: int, theta: float, inv_freq=None,
               attention_factor: float = 1.0):
    """cos and sin [B, T, H] (float32) of the rotary embedding at `positions`: computed once
    per forward and shared by every layer's queries and keys.

    `inv_freq` [H/2] (a constant from `rope.rope_frequencies`) replaces the default
    `1 / theta^(2i/H)`, which is computed here; `attention_factor` multiplies cos and sin
    (YaRN's, as transformers applies it), and 1.0 leaves them untouched."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    else:
        inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)

    def scaled(cos, sin):
        if attention_factor == 1.0:
            return cos, sin
        return cos * attention_factor, sin * attention_factor

    table = lambda e: scaled(jnp.cos(e), jnp.sin(e))
    if jax.default_backend() != "cpu":
        return table(emb)
    # XLA on CPU fuses cos and sin into every rotation that reads them and evaluates them
    # there once per head (per layer, forward and backward): ~4x the cost of the rotation.
    # A conditional's results are buffers that no fusion reaches into, so here they are
    # computed once. Both branches give the table (cos x = sin(x + pi/2)): they differ, so
    # XLA keeps the conditional, and either one is right. (Not on accelerators, where the
    # predicate would cost a device-to-host copy and the recomputation is cheap.)
    other = lambda e: scaled(jnp.sin(e + jnp.pi / 2), jnp.sin(e))
    return jax.lax.cond(jnp.all(jnp.isfinite(emb)), table, other, emb)


def rope(x, cos, sin):
    """Rotary embedding, HF's half-rotation convention, computed in float32; `cos` and
    `sin` from `rope_table`, broadcast against x (e.g. [B, 1, T, H] for [B, heads, T, H])."""
    h = x.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


@jax.custom_vjp
def gated_silu(gate, up):
    """`silu(gate) * up`, the SwiGLU activation, with a hand-written backward that keeps only
    `gate` and `up` for the backward pass and recomputes the sigmoid there (autodiff would
    also keep the sigmoid and the product: per layer, two more activation-sized arrays
    written by the forward scan and read back by the backward one)."""
    return jax.nn.silu(gate) * up


def _gated_silu_fwd(gate, up):
    return gated_silu(gate, up), (gate, up)


def _gated_silu_bwd(res, d_out):
    gate, up = res
    sig = jax.nn.sigmoid(gate)
    d_gate = d_out * up * sig * (1 + gate * (1 - sig))
    return d_gate, d_out * (gate * sig)


gated_silu.defvjp(_gated_silu_fwd, _gated_silu_bwd)


def sliding_window_mask(query_index_bt, s: int, window: int):
    """[B, T, S] bool: key index s lies within the `window` keys that end at each query's
    index (`s > t - window`, transformers' sliding-window overlay).

    Indices, not RoPE positions: within a sequence both advance by one per token (left
    padding, packed segments and the engine's cache keep every sequence contiguous), so the
    distance is the same, and the causal / segment mask removes everything else."""
    return jnp.arange(s)[None, None, :] > query_index_bt[:, :, None] - window


# Scores of one query block at most this many bytes (float32 [B, K, G, T', S]): above it the
# full-sequence attention runs in query blocks (`attention`). At 4 rows x 2,049 tokens x 14
# heads the whole [B, K, G, T, S] array is ~0.9 GB per buffer, and the update keeps several
# (scores, probabilities, their gradients) per layer; 128 MiB blocks cut the actor update's
# temporaries of `bench.py chunked_head` from 7.7 to 2.2 GB (below that the head and the
# MLP's activations are the floor).
ATTENTION_BLOCK_BYTES = 128 * 2**20
NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_block(shape_bkgts: tuple[int, ...],
                    budget: int | None = None) -> int | None:
    """Queries per block so that one block's float32 scores fit `budget` bytes (default
    `ATTENTION_BLOCK_BYTES`), or None when all T queries fit in one block."""
    b, k, g, t, s = shape_bkgts
    per_query = b * k * g * s * 4
    budget = ATTENTION_BLOCK_BYTES if budget is None else budget
    if t * per_query <= budget:
        return None
    return max(1, min(t, budget // per_query))


def attention(q_bkgth, k_bksh, v_bksh, mask_bts, scale: float, dtype,
              block: int | None = None):
    """Masked softmax attention, `softmax(q k^T * scale) v` over the keys `mask_bts` allows:
    [B, K, G, T, H] from queries [B, K, G, T, H] and keys / values [B, K, S, H].

    Scores and softmax are float32. With `block` (queries per block; `attention_block`
    picks it from the scores' size) the queries run in blocks under `lax.map`, each
    block rematerialised in the backward pass, so no [B, K, G, T, S] array exists, forward
    or backward; each row's softmax is the same computation as in one block, so the output
    equals the unblocked one (the keys' and values' gradients are summed over blocks, in
    another order). A tail of T mod block queries runs as one more block.
    """
    k_bksh, v_bksh = k_bksh.astype(dtype), v_bksh.astype(dtype)

    def one(q, m):
        scores = jnp.einsum("BKGTH,BKSH->BKGTS", q, k_bksh,
                            preferred_element_type=jnp.float32) * scale
        probs = jax.nn.softmax(jnp.where(m[:, None, None], scores, NEG_INF), axis=-1)
        return jnp.einsum("BKGTS,BKSH->BKGTH", probs.astype(dtype), v_bksh)

    t = q_bkgth.shape[3]
    if block is None or block >= t:
        return one(q_bkgth, mask_bts)
    n = t // block
    head, tail = n * block, t - n * block
    b, k, g, _, h = q_bkgth.shape
    qs = jnp.moveaxis(q_bkgth[:, :, :, :head].reshape(b, k, g, n, block, h), 3, 0)
    ms = jnp.moveaxis(mask_bts[:, :head].reshape(b, n, block, -1), 1, 0)
    out = jax.lax.map(lambda qm: jax.checkpoint(one)(*qm), (qs, ms))
    out = jnp.moveaxis(out, 0, 3).reshape(b, k, g, head, h)
    if tail:
        out = jnp.concatenate([out, one(q_bkgth[:, :, :, head:], mask_bts[:, head:])], axis=3)
    return out
