"""The decoder of the Qwen2 / Qwen3 / Llama / Mistral families in Flax linen, with a KV-cache
path for decoding. One module with switches from `ModelConfig`: q/k/v and output biases,
per-head q/k RMSNorm (Qwen3), the RoPE variant (`rope.py`) and a sliding window (Mistral).

Every parameter is created with logical axis names (`vocab`, `embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `norm`, and `layers` for the scanned layer stack); `rlhf_jax.mesh` maps
them to mesh axes. Shapes use dimension letters: B batch, T query length, S key length,
D model width, N query heads, K kv heads, G = N / K, H head dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rlhf_jax.mesh import constrain
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.lora import adapted
from rlhf_jax.models.ops import (
    NEG_INF,
    attention,
    attention_block,
    cache_classes,
    chunk_edges,
    dense_dot_general,
    gated_silu,
    over_cache_chunks,
    over_cache_prefix,
    rope,
    rope_table,
    sliding_window_mask,
)
from rlhf_jax.models.rope import rope_frequencies
from rlhf_jax.models.stacking import KVCache, layer_slices


def _dense_init(names):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02), names)


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],), self.param_dtype,
        )
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(jnp.float32) * y.astype(self.dtype).astype(jnp.float32)).astype(
            self.dtype
        )


def decode_as_products() -> bool:
    """Whether one-token decode attention runs as products and sums over the layer's cache
    block (CPU) rather than as the batched contraction (B * K matrix products of [G, H] x
    [H, S]) that every other forward uses.

    On CPU the products are ~1.3x faster for a single query row, and decode is all such steps.
    On a GPU the sum over cache positions becomes a slow reduction: on an H200 (0.5B model,
    64 slots, 256-position bf16 cache) it took 85 % of a 21 ms decode step, one fusion of
    0.8 ms per layer, where the contraction is a batched matmul.
    """
    return jax.default_backend() == "cpu"


# None: the KV cache's key layout follows the backend (`transposed_keys`); True / False
# force it (the tests run both layouts on CPU). Read when a program is traced.
TRANSPOSED_KEYS: bool | None = None


def transposed_keys() -> bool:
    """Whether the KV cache holds its keys [L, B, K, H, S], positions minor (see `KVCache`):
    on CPU, where decode runs as products and sums (`decode_as_products`). On accelerators
    the keys are [L, B, K, S, H], as the values always are."""
    if TRANSPOSED_KEYS is not None:
        return TRANSPOSED_KEYS
    return jax.default_backend() == "cpu"


# None: a decode loop holds each layer's cache block in chunks along its positions on CPU
# (`decode_chunks`); True / False force it (the tests run both). Read when a program is traced.
CHUNKED_DECODE: bool | None = None


def decode_chunks(length: int) -> tuple[int, ...]:
    """Where a decode loop splits each layer's cache block of `length` positions into chunks,
    each its own buffer (`KVCache.per_layer`; `over_cache_chunks` reads them where they lie):
    the `CACHE_STEP` classes of `over_cache_prefix`, on CPU, whose prefix slice of one buffer
    is copied out at every step (32 slots, 640 positions: ~2 ms of a 7 ms step). None on
    accelerators, where the slice fuses into its consumer."""
    on = jax.default_backend() == "cpu" if CHUNKED_DECODE is None else CHUNKED_DECODE
    return cache_classes(length) if on else ()


def cache_position_axes() -> tuple[int, int]:
    """The positions' axis of the stacked cache's keys and of its values: 3 ([L, B, K, S, H]),
    the keys' 4 where `transposed_keys()` ([L, B, K, H, S])."""
    return (4 if transposed_keys() else 3), 3


def _write(cache, new_btkh, layer, write_index_b, transposed: bool = False):
    """Writes layer `layer`'s T new keys (or values) of each batch row at its own offset.

    The whole [L, B, K, S, H] cache (`transposed`: [L, B, K, H, S]) goes in and out (a loop
    carry) and one scatter writes only the new rows, in place, in the cache's own layout.
    """
    b, t = new_btkh.shape[:2]
    rows_b1 = jnp.arange(b)[:, None]
    positions_bt = write_index_b[:, None] + jnp.arange(t)[None]
    # advanced indices (layer, rows, positions) around slices: the update is [B, T, K, H]
    at = (cache.at[layer, rows_b1, :, :, positions_bt] if transposed
          else cache.at[layer, rows_b1, :, positions_bt])
    return at.set(new_btkh.astype(cache.dtype), mode="drop")


def _write_chunks(chunks, new_btkh, layer, write_index_b, transposed: bool = False):
    """`_write` into a block held as chunks along its positions: each chunk takes the rows
    whose position falls in it (the others' writes are dropped)."""
    out, edges = [], chunk_edges(chunks, 4 if transposed else 3)  # chunks [L, B, K, C, H]
    for lo, hi, c in zip(edges, edges[1:], chunks, strict=False):
        at = write_index_b - lo
        at = jnp.where((at >= 0) & (at < hi - lo), at, hi - lo)  # past the chunk: dropped
        out.append(_write(c, new_btkh, layer, at, transposed))
    return tuple(out)


class Embed(nn.Module):
    """Token embedding [V, D]; the table is gathered over `fsdp` before the lookup (FSDP-style),
    which keeps the gather local instead of a full rematerialisation by the SPMD partitioner."""

    vocab_size: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding", _dense_init(("vocab", "embed")), (self.vocab_size, self.features),
            self.param_dtype,
        )

    def __call__(self, ids_bt):
        table_vd = constrain(self.embedding, ("vocab", None))
        return jnp.take(table_vd, ids_bt, axis=0).astype(self.dtype)

    def attend(self, x_btd):
        return jnp.einsum("BTD,VD->BTV", x_btd, self.embedding.astype(self.dtype))


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, rope_bt, mask_bts, cache=None, write_index=None,
                 layer=None, query_slice: slice | None = None):
        """Self-attention; with `cache` (the full (k, v) [L, B, K, S, H] pair) it writes this
        layer's new keys and values at `write_index` and attends over the cache.

        `query_slice` (static, no cache): only those positions query, over the keys and values
        of all of them; the output is [B, T', D] for the T' sliced positions."""
        cfg = self.cfg
        n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        def proj(name, heads, head_axis, x_btd):
            y = nn.DenseGeneral(
                (heads, h), use_bias=cfg.attention_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, name=name, dot_general=dense_dot_general,
                kernel_init=_dense_init(("embed", head_axis, "head_dim")),
                bias_init=nn.with_logical_partitioning(
                    nn.initializers.zeros, (head_axis, "head_dim")
                ),
            )(x_btd)
            return adapted(self, name, x_btd, y, (cfg.hidden_size,), ("embed",), (heads, h),
                           (head_axis, "head_dim"))

        cos_bsh, sin_bsh = rope_bt
        cos_bth, sin_bth, q_mask_bts, x_q_btd = cos_bsh, sin_bsh, mask_bts, x_btd
        if query_slice is not None:
            assert cache is None, "query_slice is for the full-sequence forward"
            cos_bth, sin_bth = cos_bsh[:, query_slice], sin_bsh[:, query_slice]
            q_mask_bts, x_q_btd = mask_bts[:, query_slice], x_btd[:, query_slice]
        q_btnh = constrain(proj("q_proj", n, "heads", x_q_btd),
                           ("batch", "act_length", "act_heads", None))
        k_btkh = proj("k_proj", k, "kv_heads", x_btd)
        v_btkh = proj("v_proj", k, "kv_heads", x_btd)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's H features, before the rotation
            kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
            q_btnh = RMSNorm(cfg.rms_norm_eps, name="q_norm", **kw)(q_btnh)
            k_btkh = RMSNorm(cfg.rms_norm_eps, name="k_norm", **kw)(k_btkh)
        b, t = q_btnh.shape[:2]
        keys_t = cache is not None and transposed_keys()
        if cfg.sliding_window is not None:
            if cache is None:
                query_bt = jnp.arange(mask_bts.shape[-1])[None]
                query_bt = query_bt if query_slice is None else query_bt[:, query_slice]
            else:
                query_bt = write_index[:, None] + jnp.arange(t)[None]
            q_mask_bts = q_mask_bts & sliding_window_mask(
                query_bt, q_mask_bts.shape[-1], cfg.sliding_window)
        # Heads before positions, then the rotation: the transpose fuses into rope's
        # elementwise pass, and the contractions read their batch dims (B, K) leading with
        # no copy of their own (for T = 1 the transpose moves nothing).
        q_bkgth = rope(q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4),
                       cos_bth[:, None, None], sin_bth[:, None, None])
        if cache is None:
            new_cache = None
            k_bksh = rope(k_btkh.transpose(0, 2, 1, 3), cos_bsh[:, None], sin_bsh[:, None])
            v_bksh = v_btkh.transpose(0, 2, 1, 3)
        else:
            k_btkh = rope(k_btkh, cos_bsh[:, :, None], sin_bsh[:, :, None])
            write = _write_chunks if isinstance(cache[0], tuple) else _write
            new_cache = (write(cache[0], k_btkh, layer, write_index, keys_t),
                         write(cache[1], v_btkh, layer, write_index))
            # keys [B, K, S, H], or [B, K, H, S] where `keys_t`; chunks of them (`decode_chunks`)
            k_bksh, v_bksh = (tuple(x[layer] for x in c) if isinstance(c, tuple) else c[layer]
                              for c in new_cache)
        decode = cache is not None and t == 1 and decode_as_products()
        if decode:
            # One new token: products and sums over this layer's cache block (see
            # `decode_as_products`).
            def attend(k_bksh, v_bksh, q_mask_bts):
                q_bkgh = q_bkgth[:, :, :, 0].astype(jnp.float32)
                k_bk1xx = k_bksh[:, :, None].astype(jnp.float32)
                scores = (jnp.sum(q_bkgh[..., None] * k_bk1xx, axis=-2) if keys_t  # over H
                          else jnp.sum(q_bkgh[:, :, :, None] * k_bk1xx, axis=-1))[:, :, :, None]
                scores = jnp.where(q_mask_bts[:, None, None], scores * (h**-0.5), NEG_INF)
                probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
                out_bkgh = jnp.sum(probs[:, :, :, 0, :, None].astype(jnp.float32)
                                   * v_bksh[:, :, None].astype(jnp.float32), axis=3)
                return out_bkgh[:, :, :, None].astype(self.dtype)
        elif cache is not None:  # prefill, or decode as contractions
            attend = lambda k_bksh, v_bksh, q_mask_bts: attention(
                q_bkgth, jnp.swapaxes(k_bksh, 2, 3) if keys_t else k_bksh, v_bksh,
                q_mask_bts, h**-0.5, self.dtype)
        if isinstance(v_bksh, tuple):  # a decode loop's cache in chunks (`decode_chunks`)
            out_bkgth = over_cache_chunks(q_bkgth, k_bksh, v_bksh, q_mask_bts, write_index,
                                          h**-0.5, self.dtype, keys_t)
        elif cache is not None:  # the cache's first positions, up to the newest key
            out_bkgth = over_cache_prefix(attend, k_bksh, v_bksh, q_mask_bts,
                                          write_index + t - 1, key_axis=3 if keys_t else 2)
        else:  # the full sequence (train, log-probs) in query blocks when its scores are big
            # or the sequence long; the mask is causal (`segment_mask`), so a block of queries
            # reads the keys up to its last one only
            block = attention_block((b, k, n // k, t, k_bksh.shape[2]))
            queries = range(k_bksh.shape[2])[query_slice or slice(None)]
            out_bkgth = attention(q_bkgth, k_bksh, v_bksh, q_mask_bts, h**-0.5, self.dtype,
                                  block, causal_offset=queries.start if queries.step == 1
                                  else None)
        out_btnh = out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
        out_btd = nn.DenseGeneral(
            cfg.hidden_size, axis=(-2, -1), use_bias=cfg.o_proj_bias, dtype=self.dtype,
            param_dtype=self.param_dtype, name="o_proj", dot_general=dense_dot_general,
            kernel_init=_dense_init(("heads", "head_dim", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )(out_btnh)
        out_btd = adapted(self, "o_proj", out_btnh, out_btd, (n, h), ("heads", "head_dim"),
                          (cfg.hidden_size,), ("embed",))
        return out_btd, new_cache


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        f, d = self.cfg.intermediate_size, self.cfg.hidden_size
        sizes = {"embed": d, "mlp": f}

        def dense(name, names, x):
            y = nn.Dense(
                sizes[names[1]], use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=_dense_init(names), name=name, dot_general=dense_dot_general,
            )(x)
            return adapted(self, name, x, y, (sizes[names[0]],), names[:1],
                           (sizes[names[1]],), names[1:])

        gate_btf = dense("gate_proj", ("embed", "mlp"), x_btd)
        up_btf = dense("up_proj", ("embed", "mlp"), x_btd)
        act_btf = constrain(gated_silu(gate_btf, up_btf), ("batch", "act_length", "act_mlp"))
        return dense("down_proj", ("mlp", "embed"), act_btf)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, rope_bt, mask_bts, write_index, layer,
                 query_slice: slice | None = None):
        """One layer of the scan: `carry` is (x [B, T, D], the full cache or None); `layer`
        is this layer's index into the cache (None without a cache). With `query_slice`
        (static) only those positions go on past the keys and values: attention output,
        residual and MLP, and x comes out [B, T', D]."""
        x_btd, cache = carry
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        eps = self.cfg.rms_norm_eps
        h = RMSNorm(eps, name="input_layernorm", **kw)(x_btd)
        attn, new_cache = Attention(self.cfg, name="self_attn", **kw)(
            h, rope_bt, mask_bts, cache, write_index, layer, query_slice
        )
        if query_slice is not None:
            x_btd = x_btd[:, query_slice]
        x_btd = x_btd + attn
        h = RMSNorm(eps, name="post_attention_layernorm", **kw)(x_btd)
        x_btd = x_btd + MLP(self.cfg, name="mlp", **kw)(h)
        x_btd = constrain(x_btd, ("batch", "act_length", "act_embed"))
        return (x_btd, new_cache), None


class Backbone(nn.Module):
    """Embedding, the scanned layer stack and the final norm: hidden states [B, T, D]."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    def setup(self):
        self.embed_tokens = Embed(
            self.cfg.vocab_size, self.cfg.hidden_size, self.dtype, self.param_dtype
        )
        layer = DecoderLayer
        if self.remat:
            layer = nn.remat(layer, prevent_cse=False)
        self.layers = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
            length=self.cfg.num_hidden_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(self.cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        self.norm = RMSNorm(self.cfg.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)

    def __call__(self, input_ids_bt, positions_bt, mask_bts, cache=None, write_index=None,
                 out_slice: slice | None = None):
        """Hidden states [B, T, D] (and the new cache with `cache`); with `out_slice` (static,
        no cache) only those positions' [B, T', D]. Unrolled, the last layer then runs its
        queries, attention output and MLP on those positions only (its keys and values need
        them all): for a response as long as its prompt, ~10 % of a 4-layer model's matmuls,
        forward and backward. Scanned, or with a cache, the output is sliced.

        `mask_bts` [B, T, S] is causal (a query reads no key past its own position:
        `model.segment_mask`, `model.cache_mask`): the full-sequence attention skips the
        keys past each block of queries (`ops.causal_plan`)."""
        x_btd = constrain(self.embed_tokens(input_ids_bt), ("batch", "act_length", "act_embed"))
        c = self.cfg
        rope_bt = rope_table(positions_bt, c.head_dim, c.rope_theta,
                             *rope_frequencies(c.rope_theta, c.head_dim, c.rope_scaling))
        split = not self.is_initializing() and isinstance(
            self.layers.variables["params"], tuple)
        unrolled = split or (cache is not None and isinstance(cache.k, tuple))
        trim = out_slice if unrolled and cache is None else None
        if unrolled:
            x_btd, new_cache = self._unrolled(x_btd, rope_bt, mask_bts, cache, write_index,
                                              trim)
        else:
            # The cache rides in the scan's carry, whole, with each layer's index as the
            # scanned input: scanning over it as xs / ys would copy every layer's block out
            # and back in at every step.
            kv = None if cache is None else (cache.k, cache.v)
            layers = None if cache is None else jnp.arange(self.cfg.num_hidden_layers)
            (x_btd, new), _ = self.layers((x_btd, kv), rope_bt, mask_bts, write_index, layers)
            new_cache = None if cache is None else KVCache(*new)
        if out_slice is not None and trim is None:
            x_btd = x_btd[:, out_slice]
        return self.norm(x_btd), new_cache

    def _unrolled(self, x_btd, rope_bt, mask_bts, cache: KVCache | None, write_index,
                  last_query_slice: slice | None = None):
        """The scanned layers unrolled, one after another: layer i's parameters are its entry
        of `per_layer_params` (or its slice of the stacked ones); with a `per_layer()` cache
        its block is a [1, B, K, S, H] view of its own buffer (index 0: no copy, the write in
        place). A stacked cache goes in per layer and comes back stacked. The last layer
        gets `last_query_slice` (no cache) as its `query_slice`."""
        per_layer = layer_slices(self.layers.variables["params"])
        layer = DecoderLayer(self.cfg, self.dtype, self.param_dtype, parent=None)

        def runner(query_slice):
            def run(params, x_btd, kv):
                (x_btd, kv), _ = layer.apply({"params": params}, (x_btd, kv), rope_bt,
                                             mask_bts, write_index, None if kv is None else 0,
                                             query_slice)
                return x_btd, kv

            return jax.checkpoint(run) if self.remat else run

        run, run_last = runner(None), runner(last_query_slice)
        restack = cache is not None and not isinstance(cache.k, tuple)
        if restack:
            cache = cache.per_layer()
        ks, vs = (None, None) if cache is None else (list(cache.k), list(cache.v))
        last = self.cfg.num_hidden_layers - 1
        # a layer's block, or its chunks (`decode_chunks`), with a layer axis of 1 and back
        add = lambda c: tuple(x[None] for x in c) if isinstance(c, tuple) else c[None]
        drop = lambda c: tuple(x[0] for x in c) if isinstance(c, tuple) else c[0]
        for i in range(self.cfg.num_hidden_layers):
            kv = None if cache is None else (add(ks[i]), add(vs[i]))
            x_btd, kv = (run_last if i == last else run)(per_layer[i], x_btd, kv)
            if cache is not None:
                ks[i], vs[i] = drop(kv[0]), drop(kv[1])
        if cache is None:
            return x_btd, None
        new_cache = KVCache(tuple(ks), tuple(vs))
        return x_btd, new_cache.stacked() if restack else new_cache

    def attend(self, x_btd):
        return self.embed_tokens.attend(x_btd)


class CausalLM(nn.Module):
    """Logits [B, T, V] in float32 (and the new cache on the decode path)."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    def setup(self):
        self.model = Backbone(self.cfg, self.dtype, self.param_dtype, self.remat)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(
                self.cfg.vocab_size, use_bias=False, dtype=self.dtype,
                param_dtype=self.param_dtype, kernel_init=_dense_init(("embed", "vocab")),
                dot_general=dense_dot_general,
            )

    def __call__(self, input_ids_bt, positions_bt, mask_bts, cache=None, write_index=None,
                 head_slice: slice | None = None):
        """`head_slice` (static): the positions whose logits are wanted, e.g. the responses';
        the head runs on those hidden states only."""
        x_btd, new_cache = self.model(input_ids_bt, positions_bt, mask_bts, cache, write_index,
                                      head_slice)
        if self.cfg.tie_word_embeddings:
            logits_btv = self.model.attend(x_btd)
        else:
            logits_btv = self.lm_head(x_btd)
        logits_btv = constrain(logits_btv.astype(jnp.float32), ("batch", "act_length", "act_vocab"))
        return logits_btv, new_cache

    def hidden(self, input_ids_bt, positions_bt, mask_bts, head_slice: slice | None = None):
        """What `__call__` sends through the LM head: the final (normed) hidden states
        [B, T', D] of the `head_slice` positions, in the compute dtype (`models.head`)."""
        return self.model(input_ids_bt, positions_bt, mask_bts, None, None, head_slice)[0]


class ValueModel(nn.Module):
    """Backbone plus a scalar head (HF `*ForTokenClassification` with one label): [B, T]."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    def setup(self):
        self.model = Backbone(self.cfg, self.dtype, self.param_dtype, self.remat)
        self.score = nn.Dense(
            1, dtype=jnp.float32, param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed", None)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        )

    def __call__(self, input_ids_bt, positions_bt, mask_bts, cache=None, write_index=None,
                 head_slice: slice | None = None):
        x_btd, _ = self.model(input_ids_bt, positions_bt, mask_bts, out_slice=head_slice)
        return self.score(x_btd.astype(jnp.float32))[..., 0], None
