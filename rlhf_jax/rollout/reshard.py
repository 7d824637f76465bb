"""Move a pytree of arrays to new shardings on device, e.g. parameters train -> generate layout.

`reshard` has two guarantees: an array whose sharding is already equivalent to its target
comes back as the very same object (no copy, no dispatch), and nothing is gathered to the
host (tests run it under `jax.transfer_guard("disallow")`).

Why not plain `jax.device_put`: in jax 0.10.2 `device_put` of an array onto another sharding
of the same devices takes a slow path whenever a target shard is not one of the source shards
(e.g. fsdp-sharded -> replicated over fsdp): it reads the whole array to the host
(`x._value`) and uploads it again. So arrays that stay on the same devices move through a
jitted identity with `out_shardings` (XLA all-gathers / slices on device, and donation frees
the source); `jax.device_put` (with `donate=`) is kept for host arrays and for moves to other
devices, where it is the only way.
"""

from __future__ import annotations

import functools
import warnings

import jax
from jax.sharding import Sharding


def _already_there(x, sharding: Sharding) -> bool:
    return (
        isinstance(x, jax.Array)
        and not x.is_deleted()
        and x.sharding.is_equivalent_to(sharding, x.ndim)
    )


def _same_devices(x, sharding: Sharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding.device_set == sharding.device_set


@functools.lru_cache(maxsize=64)
def _mover(targets: tuple[Sharding, ...], donate: bool):
    """One compiled identity per target layout: the reshard runs as XLA collectives."""
    return jax.jit(lambda xs: xs, out_shardings=targets, donate_argnums=(0,) if donate else ())


def reshard(tree, shardings, *, donate: bool = False):
    """Puts every leaf of `tree` on its sharding in `shardings`, on device.

    Args:
      tree: a pytree of `jax.Array`s (host arrays are uploaded).
      shardings: one `Sharding` for every leaf, or a pytree matching `tree` (its leaves being
        `Sharding`s), e.g. `model.shardings(mesh, spec.generate_rules)`.
      donate: free the source buffers of the leaves that move (the caller must not touch
        them afterwards). Leaves that do not move are untouched.

    Returns:
      A pytree like `tree`; leaves already on an equivalent sharding are the same objects.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, Sharding):
        targets = [shardings] * len(leaves)
    else:
        targets = treedef.flatten_up_to(shardings)
    on_device, elsewhere = [], []
    for i, (x, s) in enumerate(zip(leaves, targets, strict=True)):
        if not _already_there(x, s):
            (on_device if _same_devices(x, s) else elsewhere).append(i)
    if on_device:
        with warnings.catch_warnings():  # a resharded buffer cannot be reused in place; it
            # is freed all the same, which is what donating is for here
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            moved = _mover(tuple(targets[i] for i in on_device), donate)(
                tuple(leaves[i] for i in on_device))
        for i, x in zip(on_device, moved, strict=True):
            if donate and not leaves[i].is_deleted():  # XLA reuses only same-shaped buffers
                leaves[i].delete()
            leaves[i] = x
    if elsewhere:
        moved = jax.device_put([leaves[i] for i in elsewhere], [targets[i] for i in elsewhere],
                               donate=donate)
        for i, x in zip(elsewhere, moved, strict=True):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
