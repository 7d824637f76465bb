"""Group (prompt) ids and per-group statistics for the outcome estimators.

verl groups rows by a Python dict over its string `uid`s, so any labels work. Here the
estimators run under `jax.jit`, where groups are segment ids of `jax.ops.segment_sum`, which
silently drops ids outside `[0, num_segments)`. So every group estimator first maps its ids to
dense ones: `dense_group_ids` does it under jit with a sort-based unique of static size
`batch` (enough for any labelling of `batch` rows), and `group_ids` does it on the host for
verl-style string (or any hashable) uids. Any integer ids work, e.g. `[7, 7, 42, 42]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def group_ids(uids) -> np.ndarray:
    """Host-side: dense int32 group ids `[batch]` for any hashable labels (verl's string `uid`s).

    Ids are numbered in order of first appearance, as verl's dict grouping meets them:
    `group_ids(["b", "a", "b"]) == [0, 1, 0]`.

    Args:
      uids: `[batch]` labels: a numpy array (object, str, bytes or int), a list, a tuple.

    Returns:
      `[batch]` int32 numpy array with values in `[0, number of distinct labels)`.
    """
    flat = np.asarray(uids, dtype=object).reshape(-1)
    first: dict = {}
    return np.asarray([first.setdefault(u, len(first)) for u in flat.tolist()], np.int32)


def _replicated(x):
    """`x` replicated if its batch axis is sharded over an explicit mesh axis.

    Group statistics mix rows of every shard; on a `[batch]` vector gathering is cheap and
    spares the scatter of `segment_sum` an ambiguous output sharding. A no-op otherwise.
    """
    sharding = jax.typeof(x).sharding
    if any(p is not None for p in sharding.spec):
        return jax.sharding.reshard(x, sharding.update(spec=jax.sharding.PartitionSpec()))
    return x


def dense_group_ids(index):
    """Group ids in `[0, batch)` from any ids: `[batch]` int32, replicated.

    A numpy array or a list (called eagerly) is mapped on the host with `group_ids`, so
    string uids and 64-bit hashes work; a jax array (or a tracer under jit) must hold
    integers and is mapped with `jnp.unique(..., size=batch)` (sorted order of the ids).
    Either way rows with equal ids share a group and rows with different ids do not.

    Args:
      index: `[batch]` group labels.

    Returns:
      `[batch]` int32 ids in `[0, batch)`.
    """
    if not isinstance(index, jax.Array):
        return jnp.asarray(group_ids(index))
    index = _replicated(index)
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise TypeError(f"group ids under jit must be integers, got {index.dtype}; map string "
                        "uids on the host with core_algos.group_ids")
    b = index.shape[0]
    if b == 0:
        return index.astype(jnp.int32)
    _, inverse = jnp.unique(index, return_inverse=True, size=b, fill_value=jnp.max(index))
    return inverse.reshape(b).astype(jnp.int32)


def segment(x, ids, reduce: str = "sum"):
    """Per-group reduction of `x` (`[batch, ...]`) over dense `ids`, gathered back to the rows.

    `reduce` is `sum` or `max`; the result has the shape of `x` (each row gets its group's).
    """
    b = ids.shape[0]
    op = jax.ops.segment_sum if reduce == "sum" else jax.ops.segment_max
    return op(x, ids, num_segments=b)[ids]


def group_stats(scores_b, ids):
    """Per-row group size, group mean and unbiased group variance of `scores_b` (`[batch]`).

    `ids` are dense (`dense_group_ids`). A group of one has variance 0 (its Bessel
    denominator is clamped to 1).
    """
    n = segment(jnp.ones_like(scores_b), ids)
    mean = segment(scores_b, ids) / jnp.maximum(n, 1)
    var = segment(jnp.square(scores_b - mean), ids) / jnp.maximum(n - 1, 1)
    return n, mean, var


def safe_sqrt(x):
    """sqrt with a finite gradient at 0."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1)), 0)
