"""Qwen2 / Llama decoder in Flax linen, with a KV-cache path for decoding.

Every parameter is created with logical axis names (`vocab`, `embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `norm`, and `layers` for the scanned layer stack); `rlhf_jax.mesh` maps
them to mesh axes. Shapes use dimension letters: B batch, T query length, S key length,
D model width, N query heads, K kv heads, G = N / K, H head dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from rlhf_jax.mesh import constrain
from rlhf_jax.models.config import ModelConfig

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(NamedTuple):
    """Keys and values of every layer: `k`, `v` of shape [L, B, S, K, H]."""

    k: jax.Array
    v: jax.Array


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


def rope(x_bthd, positions_bt, theta: float):
    """Rotary embedding, HF's half-rotation convention, computed in float32."""
    h = x_bthd.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x_bthd.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x_bthd.dtype)


def _write(cache_bskh, new_btkh, write_index_b):
    """Writes T new rows per batch element at its own offset."""
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (i, 0, 0)))(
        cache_bskh, new_btkh.astype(cache_bskh.dtype), write_index_b
    )


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
    def __call__(self, x_btd, positions_bt, mask_bts, cache=None, write_index=None):
        cfg = self.cfg
        n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        def proj(name, heads, head_axis):
            return nn.DenseGeneral(
                (heads, h), use_bias=cfg.attention_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, name=name,
                kernel_init=_dense_init(("embed", head_axis, "head_dim")),
                bias_init=nn.with_logical_partitioning(
                    nn.initializers.zeros, (head_axis, "head_dim")
                ),
            )(x_btd)

        q_btnh = rope(proj("q_proj", n, "heads"), positions_bt, cfg.rope_theta)
        k_btkh = rope(proj("k_proj", k, "kv_heads"), positions_bt, cfg.rope_theta)
        v_btkh = proj("v_proj", k, "kv_heads")
        q_btnh = constrain(q_btnh, ("batch", "act_length", "act_heads", None))

        if cache is not None:
            k_bskh = _write(cache[0], k_btkh, write_index)
            v_bskh = _write(cache[1], v_btkh, write_index)
            new_cache = (k_bskh, v_bskh)
        else:
            k_bskh, v_bskh, new_cache = k_btkh, v_btkh, None

        b, t = q_btnh.shape[:2]
        q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
        scores = jnp.einsum(
            "BTKGH,BSKH->BKGTS", q_btkgh, k_bskh.astype(self.dtype),
            preferred_element_type=jnp.float32,
        ) * (h**-0.5)
        scores = jnp.where(mask_bts[:, None, None], scores, _NEG)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out_btkgh = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v_bskh.astype(self.dtype))
        out_btnh = out_btkgh.reshape(b, t, n, h)
        out_btd = nn.DenseGeneral(
            cfg.hidden_size, axis=(-2, -1), use_bias=False, dtype=self.dtype,
            param_dtype=self.param_dtype, name="o_proj",
            kernel_init=_dense_init(("heads", "head_dim", "embed")),
        )(out_btnh)
        return out_btd, new_cache


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        def dense(name, features, names):
            return nn.Dense(
                features, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=_dense_init(names), name=name,
            )

        f = self.cfg.intermediate_size
        gate_btf = dense("gate_proj", f, ("embed", "mlp"))(x_btd)
        up_btf = dense("up_proj", f, ("embed", "mlp"))(x_btd)
        act_btf = constrain(nn.silu(gate_btf) * up_btf, ("batch", "act_length", "act_mlp"))
        return dense("down_proj", self.cfg.hidden_size, ("mlp", "embed"))(act_btf)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, positions_bt, mask_bts, write_index, cache):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        eps = self.cfg.rms_norm_eps
        h = RMSNorm(eps, name="input_layernorm", **kw)(x_btd)
        attn, new_cache = Attention(self.cfg, name="self_attn", **kw)(
            h, positions_bt, mask_bts, cache, write_index
        )
        x_btd = x_btd + attn
        h = RMSNorm(eps, name="post_attention_layernorm", **kw)(x_btd)
        x_btd = x_btd + MLP(self.cfg, name="mlp", **kw)(h)
        x_btd = constrain(x_btd, ("batch", "act_length", "act_embed"))
        return x_btd, new_cache


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

    def __call__(self, input_ids_bt, positions_bt, mask_bts, cache=None, write_index=None):
        x_btd = constrain(self.embed_tokens(input_ids_bt), ("batch", "act_length", "act_embed"))
        layer_cache = None if cache is None else (cache.k, cache.v)
        x_btd, new = self.layers(x_btd, positions_bt, mask_bts, write_index, layer_cache)
        new_cache = None if cache is None else KVCache(*new)
        return self.norm(x_btd), new_cache

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
            )

    def __call__(self, input_ids_bt, positions_bt, mask_bts, cache=None, write_index=None):
        x_btd, new_cache = self.model(input_ids_bt, positions_bt, mask_bts, cache, write_index)
        if self.cfg.tie_word_embeddings:
            logits_btv = self.model.attend(x_btd)
        else:
            logits_btv = self.lm_head(x_btd)
        logits_btv = constrain(logits_btv.astype(jnp.float32), ("batch", "act_length", "act_vocab"))
        return logits_btv, new_cache


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

    def __call__(self, input_ids_bt, positions_bt, mask_bts, cache=None, write_index=None):
        x_btd, _ = self.model(input_ids_bt, positions_bt, mask_bts)
        return self.score(x_btd.astype(jnp.float32))[..., 0], None
