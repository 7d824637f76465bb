"""A model as pure functions: shardings before allocation, a full-sequence forward, a decode step.

    model = Model(load_model_config(path))
    params = model.init(rng, mesh, rules)           # born sharded, never whole on one device
    logits = model.forward(params, ids, mask)       # [B, T, V], left padding allowed
    logits, cache = model.decode(params, ids, pos, cache, write_index)
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rlhf_jax.mesh import Rules, activation_rules, tree_shardings
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.stacking import KVCache, per_layer_params, stacked_params
from rlhf_jax.models.transformer import CausalLM, ValueModel, transposed_keys

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CACHE_AXES = ("layers", "cache_batch", "cache_heads", "cache_length", "head_dim")
# `scan_layers=None`: models up to this many layers run their layers unrolled.
UNROLL_MAX_LAYERS = 8


def positions_from_mask(attention_mask_bt):
    """RoPE positions of a left-padded batch: 0 at the first real token, 0 on padding."""
    return jnp.maximum(jnp.cumsum(attention_mask_bt.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(attention_mask_bt):
    """[B, T, T] bool: query t sees key s iff s <= t and s is a real token."""
    return segment_mask(attention_mask_bt)


def segment_mask(segment_ids_bt):
    """[B, T, T] bool: query t sees key s iff s <= t, s is a real token (segment > 0) and
    both are in the same segment; a padding query (segment 0) sees every real key before it.

    With one segment per row (segment ids = the attention mask of a padded row) this is
    the causal mask over the real tokens; packed rows get one causal block per sequence."""
    t = segment_ids_bt.shape[-1]
    seg = segment_ids_bt.astype(jnp.int32)
    causal_tt = jnp.tril(jnp.ones((t, t), dtype=bool))
    key_bs, query_bt = seg[:, None, :], seg[:, :, None]
    return causal_tt[None] & (key_bs > 0) & ((key_bs == query_bt) | (query_bt == 0))


def cache_mask(write_index_b, t: int, s: int, kv_mask_bs=None):
    """[B, T, S] bool for T new tokens written at `write_index`: keys up to each query."""
    query_bt = write_index_b[:, None] + jnp.arange(t)[None]
    mask_bts = jnp.arange(s)[None, None, :] <= query_bt[:, :, None]
    if kv_mask_bs is not None:
        mask_bts &= kv_mask_bs.astype(bool)[:, None, :]
    return mask_bts


@dataclasses.dataclass(frozen=True)
class Model:
    """A causal LM (`kind="lm"`) or a value model (`kind="value"`) of one architecture."""

    cfg: ModelConfig
    kind: str = "lm"
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    # The full-sequence forward (and so every train step) runs the layer stack as a
    # `lax.scan` (True) or unrolled over per-layer weights (False); None: unrolled up to
    # UNROLL_MAX_LAYERS layers. Unrolled spares the scan's per-layer slices of the stacked
    # weights and its stacked residuals (on the CPU workload: ~10 % of a train step's
    # time); scanned compiles in a time that does not grow with the depth.
    scan_layers: bool | None = None
    # Set by `with_layout`: activations inside forward/decode are pinned by these rules.
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    rules: Rules = dataclasses.field(default=(), compare=False, repr=False)

    def with_layout(self, mesh, rules: Rules) -> Model:
        """The same model whose forward/decode constrain activations to `mesh` by `rules`."""
        return dataclasses.replace(self, mesh=mesh, rules=rules)

    def _layout(self):
        return activation_rules(self.mesh, self.rules) if self.mesh is not None else nullcontext()

    @property
    def module(self) -> nn.Module:
        cls = {"lm": CausalLM, "value": ValueModel}[self.kind]
        return cls(self.cfg, DTYPES[self.dtype], DTYPES[self.param_dtype], self.remat)

    @property
    def scans_layers(self) -> bool:
        if self.scan_layers is None:
            return self.cfg.num_hidden_layers > UNROLL_MAX_LAYERS
        return self.scan_layers

    def split_layers(self, params):
        """`params` in the form `forward` runs on: the layer stack split into per-layer
        subtrees (`per_layer_params`) when this model unrolls its layers, else unchanged.
        A train step splits once, outside its gradient, so that the gradients of the
        micro-batches come per layer and are stacked (`stack_layers`) once per update."""
        if self.scans_layers:
            return params
        layers = params["model"]["layers"]
        if not isinstance(layers, tuple) and not jax.tree.leaves(layers):
            # a tree with no layer weights (e.g. the frozen part when every layer trains)
            n = self.cfg.num_hidden_layers
            return {**params, "model": {**params["model"], "layers": (layers,) * n}}
        return per_layer_params(params)

    def stack_layers(self, tree):
        """A params-shaped tree (e.g. gradients) with its layer stack as [L, ...] arrays."""
        return stacked_params(tree)

    def _init_boxed(self, rng):
        ids = jnp.zeros((1, 1), jnp.int32)
        return self.module.init(rng, ids, ids, jnp.ones((1, 1, 1), bool))["params"]

    def _boxed_shapes(self):
        """The boxed parameter tree of `_init_boxed` as shapes, traced once per architecture
        (`_boxed_shapes`): the actor, its reference, the critic and the engine each ask."""
        bare = dataclasses.replace(self, mesh=None, rules=())
        try:
            return _boxed_shapes(bare, bool(jax.config.jax_enable_x64))
        except TypeError:  # a config field that cannot be hashed: trace it every time
            return jax.eval_shape(self._init_boxed, jax.random.key(0))

    def logical_axes(self):
        """Tree of logical-name tuples, one per parameter."""
        boxed = self._boxed_shapes()
        boxed_type = nn.LogicallyPartitioned
        return jax.tree.map(
            lambda x: tuple(x.names) if isinstance(x, boxed_type) else (None,) * x.ndim,
            boxed, is_leaf=lambda x: isinstance(x, boxed_type),
        )

    def abstract_params(self):
        """Tree of `jax.ShapeDtypeStruct`, computed without allocating anything."""
        return nn.meta.unbox(self._boxed_shapes())

    def shardings(self, mesh, rules: Rules):
        """`NamedSharding` of every parameter on `mesh` under `rules` (train or generate)."""
        return tree_shardings(self.logical_axes(), self.abstract_params(), mesh, rules)

    def init(self, rng, mesh, rules: Rules):
        """Random parameters, created directly in their sharded layout."""
        init = jax.jit(
            lambda r: nn.meta.unbox(self._init_boxed(r)), out_shardings=self.shardings(mesh, rules)
        )
        return init(rng)

    def forward(self, params, input_ids_bt, attention_mask_bt=None,
                head_slice: slice | None = None, *, positions=None, segment_ids=None):
        """Full-sequence forward: logits [B,T,V] or values [B,T].

        The layout is either an `attention_mask_bt` of a (left-)padded batch (positions
        counted from each row's first real token) or explicit `positions` and
        `segment_ids` (`segment_mask`: packed rows hold several sequences).

        With `head_slice` (static), only those positions go through the head: e.g.
        `slice(-R - 1, -1)` for the R positions that predict a response, which spares the
        LM head's matmul (and its backward) on the prompt.
        """
        if segment_ids is None:
            positions = positions_from_mask(attention_mask_bt)
            segment_ids = attention_mask_bt
        with self._layout():
            out, _ = self.module.apply(
                {"params": self.split_layers(params)}, input_ids_bt, positions,
                segment_mask(segment_ids), head_slice=head_slice,
            )
        return out

    def hidden(self, params, input_ids_bt, attention_mask_bt=None,
               head_slice: slice | None = None, *, positions=None, segment_ids=None):
        """`forward` of a causal LM up to its head: the final (normed) hidden states
        [B, T', D] of the `head_slice` positions, in the compute dtype. With `head_weight`
        they give the logits without building them (`models.head`)."""
        assert self.kind == "lm", "hidden states of the LM head need a causal LM"
        if segment_ids is None:
            positions = positions_from_mask(attention_mask_bt)
            segment_ids = attention_mask_bt
        with self._layout():
            return self.module.apply(
                {"params": self.split_layers(params)}, input_ids_bt, positions,
                segment_mask(segment_ids), head_slice, method=CausalLM.hidden,
            )

    def head_weight(self, params):
        """The LM head's weight and its layout: the tied embedding [V, D] ("vd") or the
        `lm_head` kernel [D, V] ("dv"), as stored (logits = hidden @ it, in `dtype`)."""
        if self.cfg.tie_word_embeddings:
            return params["model"]["embed_tokens"]["embedding"], "vd"
        return params["lm_head"]["kernel"], "dv"

    def cache_shapes(self, batch: int, length: int) -> KVCache:
        """`(shape, logical axes)` of the cache's keys and of its values: [L, B, K, S, H],
        the keys [L, B, K, H, S] where `transposed_keys()` (see `KVCache`)."""
        c = self.cfg
        v = (c.num_hidden_layers, batch, c.num_key_value_heads, length, c.head_dim)
        if not transposed_keys():
            return KVCache((v, CACHE_AXES), (v, CACHE_AXES))
        swap = lambda x: (*x[:3], x[4], x[3])
        return KVCache((swap(v), swap(CACHE_AXES)), (v, CACHE_AXES))

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> KVCache:
        """Zeros of `cache_shapes(batch, length)` in the compute dtype."""
        dt = DTYPES[self.dtype] if dtype is None else dtype
        return KVCache(*(jnp.zeros(shape, dt) for shape, _ in self.cache_shapes(batch, length)))

    def decode(self, params, input_ids_bt, positions_bt, cache: KVCache, write_index_b,
               kv_mask_bs=None):
        """Runs T new tokens against the cache; each row writes at its own `write_index`.

        Args:
          input_ids_bt: [B, T] new tokens (T = 1 while generating, the bucket for a prefill).
          positions_bt: [B, T] their RoPE positions.
          cache: `KVCache` with S >= write_index + T, stacked or `per_layer()` (returned
            in the same form).
          write_index_b: [B] where row b's new keys go; earlier cache rows are its context.
          kv_mask_bs: optional [B, S] extra key validity (e.g. left padding inside the cache).

        Returns:
          (logits [B, T, V] float32, the updated cache).
        """
        assert self.kind == "lm", "decode needs a causal LM"
        mask_bts = cache_mask(write_index_b, input_ids_bt.shape[1], cache.length, kv_mask_bs)
        with self._layout():
            return self.module.apply(
                {"params": params}, input_ids_bt, positions_bt, mask_bts, cache, write_index_b
            )


@functools.lru_cache(maxsize=16)
def _boxed_shapes(model: Model, x64: bool):
    """`jax.eval_shape` of `model._init_boxed` (flax's init traces the whole model: ~0.2 s
    each on the tiny recipes, asked for several times while a run starts). `x64`: part of
    the key, as the traced dtypes follow it."""
    del x64
    return jax.eval_shape(model._init_boxed, jax.random.key(0))
