"""Move a pytree of arrays to new shardings on device, e.g. parameters train -> generate layout.

`reshard` has two guarantees: an array whose sharding is already equivalent to its target
comes back as the very same object (no copy, no dispatch), and nothing is gathered to the
host (tests run it under `jax.transfer_guard("disallow")`).

How arrays that stay on the same devices move:

- CPU devices (one process, one host memory): every target shard is assembled on its device
  from the source shards that tile it (a device-to-device copy of each remote block, then one
  concatenation or slice per shard, all shards of one device in one dispatch). XLA's CPU
  collectives would do the same copies behind a rendezvous of every device's thread per
  collective, which on a host with fewer cores than devices costs several times the copies.
- Other platforms, and CPU layouts whose shards are not tiled along one dimension: a jitted
  identity with `out_shardings` (XLA all-gathers / slices on device; donation frees the
  source). Not plain `jax.device_put`: in jax 0.10.2 it can take a path through the host
  when a target shard is not one of the source shards.

`jax.device_put` (with `donate=`) is kept for host arrays and moves to other devices.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
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


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def _size(block) -> int:
    return math.prod(hi - lo for lo, hi in block)


def _within(inner, outer) -> bool:
    return all(o_lo <= lo and hi <= o_hi
               for (lo, hi), (o_lo, o_hi) in zip(inner, outer, strict=True))


@functools.lru_cache(maxsize=256)
def _shard_plan(shape: tuple[int, ...], source: Sharding, target: Sharding):
    """How each target shard is built from the source shards on CPU, or None.

    Returns `((device, op, source devices), ...)`, `op` being `("concat", dim)` (source
    blocks that tile the target block along `dim`, in order) or `("slice", bounds)` (one
    source block that contains the target block; `()`: the whole block). None if a target
    block is neither.
    """
    src: dict = {}  # distinct source blocks -> the devices holding them
    for dev, index in source.addressable_devices_indices_map(shape).items():
        src.setdefault(_bounds(index, shape), []).append(dev)
    plan = []
    for dev, index in target.addressable_devices_indices_map(shape).items():
        want = _bounds(index, shape)
        local = lambda block, dev=dev: dev if dev in src[block] else src[block][0]
        inside = sorted(b for b in src if _within(b, want))
        around = [b for b in src if _within(want, b)]
        if around:  # one source block holds the whole target block
            block = around[0]
            bounds = tuple((lo - b_lo, hi - b_lo)
                           for (lo, hi), (b_lo, _) in zip(want, block, strict=True))
            plan.append((dev, ("slice", () if block == want else bounds), (local(block),)))
            continue
        dims = {d for b in inside for d, (got, full) in enumerate(zip(b, want, strict=True))
                if got != full}
        if not inside or len(dims) != 1 or sum(map(_size, inside)) != _size(want):
            return None
        (dim,) = dims
        inside.sort(key=lambda b: b[dim])
        plan.append((dev, ("concat", dim), tuple(local(b) for b in inside)))
    return tuple(plan)


@functools.lru_cache(maxsize=256)
def _assembler(ops: tuple):
    """One jitted function building every target shard of one device from its pieces."""

    def build(pieces):
        out = []
        for (kind, arg), ps in zip(ops, pieces, strict=True):
            if kind == "concat":
                out.append(jnp.concatenate(ps, axis=arg))
            else:
                block = ps[0][tuple(slice(a, c) for a, c in arg)] if arg else ps[0]
                out.append(jnp.copy(block))
        return tuple(out)

    return jax.jit(build)


def _on_cpu(sharding: Sharding) -> bool:
    return all(d.platform == "cpu" for d in sharding.device_set)


def _cpu_blocks(xs, targets, plans):
    """The target arrays of `xs`, each shard assembled on its own device (see the module doc)."""
    per_device: dict = {}
    for k, (x, plan) in enumerate(zip(xs, plans, strict=True)):
        data = {s.device: s.data for s in x.addressable_shards}
        for dev, op, holders in plan:
            per_device.setdefault(dev, []).append((k, op, [data[h] for h in holders]))
    # every remote block of every device in one batched device_put (one dispatch, not one
    # per device)
    flats = {dev: [p for _, _, ps in items for p in ps] for dev, items in per_device.items()}
    remote = [(dev, i) for dev, flat in flats.items()
              for i, p in enumerate(flat) if p.devices() != {dev}]
    if remote:
        moved = jax.device_put([flats[dev][i] for dev, i in remote], [dev for dev, _ in remote])
        for (dev, i), x in zip(remote, moved, strict=True):
            flats[dev][i] = x
    shards: dict = {}
    for dev, items in per_device.items():
        it = iter(flats[dev])
        pieces = tuple(tuple(next(it) for _ in ps) for _, _, ps in items)
        outs = _assembler(tuple(op for _, op, _ in items))(pieces)
        for (k, _, _), out in zip(items, outs, strict=True):
            shards[k, dev] = out
    return [jax.make_array_from_single_device_arrays(
                x.shape, t, [shards[k, d] for d in t.addressable_devices_indices_map(x.shape)])
            for k, (x, t) in enumerate(zip(xs, targets, strict=True))]


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
        plans = {i: _shard_plan(leaves[i].shape, leaves[i].sharding, targets[i])
                 for i in on_device if _on_cpu(targets[i])}
        by_blocks = [i for i in on_device if plans.get(i) is not None]
        if by_blocks:
            moved = _cpu_blocks([leaves[i] for i in by_blocks], [targets[i] for i in by_blocks],
                                [plans[i] for i in by_blocks])
            for i, x in zip(by_blocks, moved, strict=True):
                if donate:
                    leaves[i].delete()
                leaves[i] = x
        on_device = [i for i in on_device if plans.get(i) is None]
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
