"""The two forms of the decoder's layer stack: stacked ([L, ...] arrays, what a scanned
forward and the checkpoints hold) and per layer (a tuple of L subtrees, each its own buffer,
what an unrolled forward and the decode loop read in place), for the parameters and the KV
cache."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer: `v` of shape [L, B, K, S, H], `k` the same or, where
    `transposed_keys()` (CPU), [L, B, K, H, S].

    Heads before positions, so that a layer's block is what the attention contractions read
    (batch dims B, K leading), with no transpose of the cache per step. On CPU a decode
    step's scores `q . k` then sum over the keys' second-minor axis with the positions
    vectorised, rather than over the minor H of each position: 1.35 against 2.14 ms a layer
    and step (32 slots, 640 positions, head dim 64).

    A decode loop carries the cache `per_layer()`: `k`, `v` as tuples of L arrays, each its
    own buffer. The layers then run one after another (unrolled) and each writes its new
    keys into, and attends over, its block in place; a block of the stacked array is copied
    out at every step on CPU (XLA materialises its slice), which costs more memory traffic
    than the attention itself. `stacked()` goes back.
    """

    k: Any
    v: Any

    @property
    def length(self) -> int:
        """S, the positions the cache holds."""
        return (self.v[0] if isinstance(self.v, tuple) else self.v).shape[-2]

    def per_layer(self) -> KVCache:
        return KVCache(*(tuple(c[i] for i in range(c.shape[0])) for c in self))

    def stacked(self) -> KVCache:
        return KVCache(*(jnp.stack(c) for c in self))


def per_layer_params(params):
    """`params` of a `CausalLM` / `ValueModel` with the scanned layer stack split into a tuple
    of L per-layer subtrees; the forward then runs its layers unrolled, each reading its own
    weights where they lie. A decode loop over a `per_layer()` cache closes over this form
    (a slice of the stacked arrays taken inside the loop is copied out at every step on
    CPU), and so does a training step that unrolls its layers (`stacked_params` puts the
    gradients back). Idempotent."""
    layers = params["model"]["layers"]
    if isinstance(layers, tuple):
        return params
    return {**params, "model": {**params["model"], "layers": layer_slices(layers)}}


def layer_slices(layers):
    """A stacked layer subtree ([L, ...] leaves) as a tuple of L subtrees; a tuple as is."""
    if isinstance(layers, tuple):
        return layers
    n = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda p, i=i: p[i], layers) for i in range(n))


def stacked_params(params):
    """The inverse of `per_layer_params` (any tree of that structure, e.g. its gradients):
    the layer stack as [L, ...] arrays again. Idempotent."""
    layers = params["model"]["layers"]
    if not isinstance(layers, tuple):
        return params
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *layers)
    return {**params, "model": {**params["model"], "layers": stacked}}
