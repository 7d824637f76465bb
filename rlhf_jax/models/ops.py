"""Array functions of the decoder, each shaped for XLA: the projections' product with a
hand-written backward, the rotary table and rotation, the gated SiLU, the sliding-window
mask, the attention with a hand-written backward (the full sequence in query blocks), and
the attention over the used prefix of a KV cache.

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


# Attention over a KV cache reads its first P positions only, P the smallest multiple of
# CACHE_STEP (widened so that at most CACHE_CLASSES fit below the cache length S) past every
# row's newest key, or all S: the early decode steps of a long cache, when most slots are
# live, read a fraction of it. None: always all S.
CACHE_STEP: int | None = 128
CACHE_CLASSES = 8


def key_classes(s: int, step: int | None) -> tuple[int, ...]:
    """Static key counts below `s`: multiples of `step`, widened so that at most
    `CACHE_CLASSES` fit (none for a step of None or 0)."""
    if not step:
        return ()
    least = -(-s // CACHE_CLASSES)
    step = -(-least // step) * step
    return tuple(range(step, s, step))


def cache_classes(s: int) -> tuple[int, ...]:
    """The key counts of `over_cache_prefix` for a cache of `s` positions."""
    return key_classes(s, CACHE_STEP)


def over_cache_prefix(fn, k_bksh, v_bksh, mask_bts, newest_b, key_axis: int = 2):
    """`fn(k, v, mask)` over the first P cache positions, P from `CACHE_STEP` and the newest
    key any row holds (`newest_b`, [B] positions) by a `lax.switch`; `fn` must not read keys
    the mask does not allow, so that every branch gives the full cache's result. The keys'
    positions lie on `key_axis` (3: keys [B, K, H, S]), the values' on axis 2."""
    prefixes = cache_classes(v_bksh.shape[2])
    if not prefixes:
        return fn(k_bksh, v_bksh, mask_bts)
    index = jnp.searchsorted(jnp.asarray(prefixes, jnp.int32),
                             jnp.max(newest_b).astype(jnp.int32) + 1)
    branches = [lambda k, v, m, p=p: fn(jax.lax.slice_in_dim(k, 0, p, axis=key_axis),
                                        v[:, :, :p], m[..., :p])
                for p in prefixes]
    return jax.lax.switch(index, [*branches, fn], k_bksh, v_bksh, mask_bts)


def chunk_edges(chunks, axis: int = 2) -> list[int]:
    """The first position of each chunk of a cache block split along its positions (axis
    `axis` of each chunk, 2 for values [B, K, C, H]), and the block's length last."""
    edges = [0]
    for c in chunks:
        edges.append(edges[-1] + c.shape[axis])
    return edges


def over_cache_chunks(q_bkgth, k_chunks, v_chunks, mask_bts, newest_b, scale, dtype,
                      keys_transposed: bool):
    """One decode step's attention over a cache block held as chunks along its positions
    (keys [B, K, C, H], or [B, K, H, C] where `keys_transposed`; values [B, K, C, H]), each
    chunk its own buffer: a `lax.switch` on the newest key any row holds (`newest_b`, [B])
    reads the chunks up to it, each where it lies. A prefix sliced out of one buffer is a
    copy on CPU at every step, which costs more than the attention; the scores of the chunks
    are joined (a few KB) for one softmax instead. Output [B, K, G, T, H] in `dtype`."""
    edges = chunk_edges(v_chunks)
    spec = "BKGTH,BKHS->BKGTS" if keys_transposed else "BKGTH,BKSH->BKGTS"

    def over(n):
        def attend(ks, vs, m):
            s = jnp.concatenate([jnp.einsum(spec, q_bkgth, k, preferred_element_type=jnp.float32)
                                 for k in ks[:n]], axis=-1) * scale
            s = jnp.where(m[:, None, None, :, :edges[n]], s, NEG_INF)
            p = jax.nn.softmax(s, axis=-1).astype(dtype)
            out = sum(jnp.einsum("BKGTS,BKSH->BKGTH", p[..., lo:hi], v,
                                 preferred_element_type=jnp.float32)
                      for lo, hi, v in zip(edges, edges[1:n + 1], vs[:n], strict=False))
            return out.astype(dtype)

        return attend

    index = jnp.searchsorted(jnp.asarray(edges[1:], jnp.int32),
                             jnp.max(newest_b).astype(jnp.int32) + 1)
    index = jnp.minimum(index, len(v_chunks) - 1)
    return jax.lax.switch(index, [over(n) for n in range(1, len(v_chunks) + 1)],
                          tuple(k_chunks), tuple(v_chunks), mask_bts)


def _scores(q, k, m, scale):
    """float32 [B, K, G, C, S]: the scaled scores of a query block, NEG_INF where `m` hides
    the key."""
    s = jnp.einsum("BKGTH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(m[:, None, None], s, NEG_INF)


def _block_fwd(q, k, v, m, scale, dtype):
    """One query block over its keys: output [B, K, G, C, H] and the softmax's row max and
    sum (float32 [B, K, G, C])."""
    s = _scores(q, k, m, scale)
    top = jnp.max(s, axis=-1)
    e = jnp.exp(s - top[..., None])
    total = jnp.sum(e, axis=-1)
    p = (e / total[..., None]).astype(dtype)
    return jnp.einsum("BKGTS,BKSH->BKGTH", p, v), top, total


def _block_bwd(q, k, v, m, top, total, out, d_out, scale, dtype):
    """The block's dq [B, K, G, C, H], dk and dv [B, K, S, H] (float32), the scores
    recomputed from q and k."""
    p = jnp.exp(_scores(q, k, m, scale) - top[..., None]) / total[..., None]
    dv = jnp.einsum("BKGTS,BKGTH->BKSH", p.astype(dtype), d_out,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("BKGTH,BKSH->BKGTS", d_out, v, preferred_element_type=jnp.float32)
    rows = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    ds = jnp.where(m[:, None, None], p * (dp - rows[..., None]), 0.0) * scale
    dq = jnp.einsum("BKGTS,BKSH->BKGTH", ds.astype(dtype), k,
                    preferred_element_type=jnp.float32)
    dk = jnp.einsum("BKGTS,BKGTH->BKSH", ds.astype(dtype), q,
                    preferred_element_type=jnp.float32)
    return dq, dk, dv


def _blocks(x, axis: int, block: int, value=0):
    """`x` with its T axis padded with `value` to whole blocks of `block` and split, the
    block index leading: [..., T, ...] -> [N, ..., block, ...]."""
    t = x.shape[axis]
    n = -(-t // block)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * block - t)
    x = jnp.pad(x, pad, constant_values=value)
    return jnp.moveaxis(x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:]), axis, 0)


def _unblocks(x, axis: int, t: int):
    """Undoes `_blocks`: [N, ..., block, ...] -> [..., T, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
    return jax.lax.slice_in_dim(x, 0, t, axis=axis)


def _dense_fwd(q, k, v, m, scale, dtype, block):
    """All keys; the queries in blocks of `block` under `lax.map` (None: one block)."""
    if block is None:
        return _block_fwd(q, k, v, m, scale, dtype)
    t = q.shape[3]
    outs = jax.lax.map(lambda a: _block_fwd(a[0], k, v, a[1], scale, dtype),
                       (_blocks(q, 3, block), _blocks(m, 1, block, False)))
    return tuple(_unblocks(x, 3, t) for x in outs)


def _dense_bwd(q, k, v, m, top, total, out, d_out, scale, dtype, block):
    """dq, dk, dv of `_dense_fwd`: the query blocks under `lax.scan`, dk and dv summed."""
    if block is None:
        return _block_bwd(q, k, v, m, top, total, out, d_out, scale, dtype)

    def one(carry, a):
        dq, dk, dv = _block_bwd(a[0], k, v, *a[1:], scale, dtype)
        return (carry[0] + dk, carry[1] + dv), dq

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    per = lambda x, value=0: _blocks(x, 3, block, value)  # padded rows: sum 1, not 0 / 0
    (dk, dv), dq = jax.lax.scan(one, zeros, (per(q), _blocks(m, 1, block, False), per(top),
                                             per(total, 1), per(out), per(d_out)))
    return _unblocks(dq, 3, q.shape[3]), dk, dv


# Causal full-sequence attention longer than CAUSAL_BLOCK queries runs them in blocks of at
# least that many, at most CAUSAL_MAX_BLOCKS, each block over the keys up to its last query
# only (`causal_plan`). At 640 tokens on CPU (2 KV heads x 2 queries each, head dim 64),
# forward and backward: 14.3 ms in one block, 9.4 ms in 3 (68 % of the score square), 8.8 ms
# in 5 blocks of 128, whose compilation takes twice as long.
CAUSAL_BLOCK = 256
CAUSAL_MAX_BLOCKS = 4


def causal_plan(t: int, s: int, offset: int, block: int | None = None):
    """Static `(first query, end query, end key)` blocks of a causal attention whose query i
    sits at key position `offset + i` (and so reads no key past it), or None (one block over
    all keys) for at most `CAUSAL_BLOCK` queries: a short sequence keeps the program, and the
    rounding, it had. None too where the byte budget's blocks (`block`, from
    `attention_block`) are shorter than a causal block: those run under `lax.map`."""
    size = max(CAUSAL_BLOCK, -(-t // CAUSAL_MAX_BLOCKS))
    if t <= size or (block is not None and block < size):
        return None
    return tuple((a, min(a + size, t), min(s, offset + min(a + size, t)))
                 for a in range(0, t, size))


def _causal_fwd(q, k, v, m, scale, dtype, plan):
    """`_dense_fwd` by the blocks of `plan`, each over its keys only."""
    parts = [_block_fwd(q[:, :, :, a:b], k[:, :, :e], v[:, :, :e], m[:, a:b, :e], scale, dtype)
             for a, b, e in plan]
    return tuple(jnp.concatenate(x, axis=3) for x in zip(*parts, strict=True))


def _causal_bwd(q, k, v, m, top, total, out, d_out, scale, dtype, plan):
    """dq, dk, dv of `_causal_fwd`: each block's, dk and dv summed over the blocks."""
    dqs, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    s = k.shape[2]
    for a, b, e in plan:
        dq, dk_e, dv_e = _block_bwd(q[:, :, :, a:b], k[:, :, :e], v[:, :, :e], m[:, a:b, :e],
                                    top[..., a:b], total[..., a:b], out[:, :, :, a:b],
                                    d_out[:, :, :, a:b], scale, dtype)
        pad = ((0, 0), (0, 0), (0, s - e), (0, 0))
        dqs, dk, dv = [*dqs, dq], dk + jnp.pad(dk_e, pad), dv + jnp.pad(dv_e, pad)
    return jnp.concatenate(dqs, axis=3), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, m, scale, dtype, block):
    return _attention_fwd(q, k, v, m, scale, dtype, block)[0]


def _attention_fwd(q, k, v, m, scale, dtype, block):
    """`block`: queries per block (`lax.map`), None (one block) or a `causal_plan`."""
    fwd = _causal_fwd if isinstance(block, tuple) else _dense_fwd
    out, top, total = fwd(q, k, v, m, scale, dtype, block)
    return out, (q, k, v, m, top, total, out)


def _attention_bwd(scale, dtype, block, res, d_out):
    q, k, v, m, top, total, out = res
    bwd = _causal_bwd if isinstance(block, tuple) else _dense_bwd
    dq, dk, dv = bwd(q, k, v, m, top, total, out, d_out, scale, dtype, block)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_bkgth, k_bksh, v_bksh, mask_bts, scale: float, dtype,
              block: int | None = None, causal_offset: int | None = None):
    """Masked softmax attention, `softmax(q k^T * scale) v` over the keys `mask_bts` allows:
    [B, K, G, T, H] from queries [B, K, G, T, H] and keys / values [B, K, S, H].

    Scores and softmax are float32. The backward pass recomputes the scores from q and k: its
    residuals are q, k, v, the output and each row's softmax max and sum, so no
    [B, K, G, T, S] array outlives the pass that makes it, and the gradients take the four
    products of the textbook backward (dv = p^T do, dp = do v^T, ds = p (dp - rowsum(do o)),
    dq = ds k, dk = ds^T q), not autodiff's chain through the masked softmax. With `block`
    (queries per block; `attention_block` picks it from the scores' size) the queries run in
    blocks under `lax.map` / `lax.scan`, so no [B, K, G, T, S] array exists at all; each
    row's softmax is the same computation as in one block. A query the mask allows no key
    gets the mean of all values (and no gradient through its scores), as with a softmax over
    scores set to a large negative number.

    `causal_offset` (static): the mask is causal, query i reading no key past position
    `causal_offset + i`. Queries then run in blocks (`causal_plan`), each over the keys up
    to its last query only, with the same softmax over the keys the mask allows; a query
    that may read no key gets the mean of the values its block reads.
    """
    dtype = jnp.dtype(dtype)
    q_bkgth = q_bkgth.astype(dtype)
    k_bksh, v_bksh = k_bksh.astype(dtype), v_bksh.astype(dtype)
    if block is not None and block >= q_bkgth.shape[3]:
        block = None
    if causal_offset is not None:
        block = causal_plan(q_bkgth.shape[3], k_bksh.shape[2], causal_offset, block) or block
    return _attention(q_bkgth, k_bksh, v_bksh, mask_bts, scale, dtype, block)
