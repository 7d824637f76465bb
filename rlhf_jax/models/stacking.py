"""The two forms of the decoder's layer stack: stacked ([L, ...] arrays, what a scanned
forward and the checkpoints hold) and per layer (a tuple of L subtrees, each its own buffer,
what an unrolled forward and the decode loop read in place), for the parameters and the KV
cache."""

from __future__ import annotations

from collections.abc import Sequence
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
    than the attention itself. On CPU each block is further held in chunks of positions
    (`per_layer(chunks)`, `transformer.decode_chunks`), so that the attention over the used
    prefix reads whole chunks where they lie instead of a prefix sliced out of the block.
    `stacked()` goes back.
    """

    k: Any
    v: Any

    @property
    def length(self) -> int:
        """S, the positions the cache holds."""
        v = self.v[0] if isinstance(self.v, tuple) else self.v
        return sum(c.shape[-2] for c in v) if isinstance(v, tuple) else v.shape[-2]

    def per_layer(self, chunks: Sequence[int] = (), axes: tuple[int, int] = (3, 3)) -> KVCache:
        """Each layer's block its own buffer (`k`, `v` tuples of L arrays); with `chunks`
        (positions), each block further split there along its positions (axes `axes` of the
        stacked keys and values): tuples of L tuples of chunks, each its own buffer."""
        def split(x, axis):
            edges = (0, *chunks, x.shape[axis])
            return tuple(jax.lax.slice_in_dim(x, lo, hi, axis=axis)
                         for lo, hi in zip(edges, edges[1:], strict=False))

        return KVCache(*(tuple(split(c[i], a - 1) if chunks else c[i] for i in range(c.shape[0]))
                         for c, a in zip(self, axes, strict=True)))

    def stacked(self, axes: tuple[int, int] = (3, 3)) -> KVCache:
        """The inverse of `per_layer` (with the same `axes`)."""
        whole = lambda x, a: jnp.concatenate(x, axis=a - 1) if isinstance(x, tuple) else x
        return KVCache(*(jnp.stack([whole(x, a) for x in c])
                         for c, a in zip(self, axes, strict=True)))


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
