"""Move a pytree of arrays to new shardings on device, e.g. parameters train -> generate layout.

`reshard` is `jax.device_put` with two guarantees: an array whose sharding is already
equivalent to its target comes back as the very same object (no copy, no dispatch), and
nothing is gathered to the host (tests run it under `jax.transfer_guard("disallow")`).
"""

from __future__ import annotations

import jax
from jax.sharding import Sharding


def _already_there(x, sharding: Sharding) -> bool:
    return (
        isinstance(x, jax.Array)
        and not x.is_deleted()
        and x.sharding.is_equivalent_to(sharding, x.ndim)
    )


def reshard(tree, shardings, *, donate: bool = False):
    """Puts every leaf of `tree` on its sharding in `shardings`.

    Args:
      tree: a pytree of `jax.Array`s (host arrays are uploaded).
      shardings: one `Sharding` for every leaf, or a pytree matching `tree` (its leaves being
        `Sharding`s), e.g. `model.shardings(mesh, spec.generate_rules)`.
      donate: let `jax.device_put` reuse or free the source buffers of the leaves that move
        (the caller must not touch them afterwards). Leaves that do not move are untouched.

    Returns:
      A pytree like `tree`; leaves already on an equivalent sharding are the same objects.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, Sharding):
        targets = [shardings] * len(leaves)
    else:
        targets = treedef.flatten_up_to(shardings)
    moving = [i for i, (x, s) in enumerate(zip(leaves, targets, strict=True))
              if not _already_there(x, s)]
    if moving:
        moved = jax.device_put([leaves[i] for i in moving], [targets[i] for i in moving],
                               donate=donate)
        for i, x in zip(moving, moved, strict=True):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
