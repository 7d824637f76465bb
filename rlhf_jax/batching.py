"""Host-side batch arithmetic: shuffle, split into mini- and micro-batches, place on the mesh.

A PPO batch of N sequences becomes `[U, K, m, ...]`: U = ppo_epochs x N / M optimizer updates
(M = mini-batch sequences), each of K = M / m micro-batches of m = micro-per-device x dp rows.
The arrangement is done on host with numpy (the arrays are a few bytes per token), so the
compiled update only scans; the micro-batch axis `m` is the one sharded over the batch axes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlhf_jax import packing
from rlhf_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Plan:
    """How N sequences are walked by one PPO update."""

    n_rows: int
    mini_batch: int  # sequences per optimizer update (M)
    micro_batch: int  # rows per micro-batch, all devices together (m)
    epochs: int = 1
    shuffle: bool = True

    def __post_init__(self):
        if self.n_rows % self.mini_batch or self.mini_batch % self.micro_batch:
            raise ConfigError(
                f"{self.n_rows} sequences cannot be split into mini-batches of {self.mini_batch} "
                f"and micro-batches of {self.micro_batch}"
            )

    @classmethod
    def of(cls, role, batch, epochs: int, shuffle: bool = True) -> Plan:
        """From the validated plan of a role (`config.validate_batch_arithmetic`'s
        `MiniBatchPlan` and its `BatchPlan`), walked for `epochs`."""
        return cls(batch.sequences, role.mini_batch_size,
                   role.micro_batch_size_per_device * batch.data_parallel_size, epochs, shuffle)

    @property
    def updates(self) -> int:
        return self.epochs * (self.n_rows // self.mini_batch)

    @property
    def micro_per_update(self) -> int:
        return self.mini_batch // self.micro_batch

    def order(self, seed: int) -> np.ndarray:
        """Row indices `[U, K, m]`: a fresh permutation per epoch when shuffling."""
        rng = np.random.default_rng(seed)
        rows = [
            rng.permutation(self.n_rows) if self.shuffle else np.arange(self.n_rows)
            for _ in range(self.epochs)
        ]
        return np.concatenate(rows).reshape(self.updates, self.micro_per_update, self.micro_batch)


def unarrange(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Undoes `x_arranged = x[order]` for an `order` that visits every row once (one epoch):
    `[U, K, m, ...]` in update order -> `[N, ...]` in rollout order."""
    flat = order.reshape(-1)
    out = np.empty((flat.size, *x.shape[order.ndim:]), x.dtype)
    out[flat] = x.reshape(flat.size, *x.shape[order.ndim:])
    return out


def chunked(x: np.ndarray, chunk: int) -> np.ndarray:
    """`[N, ...] -> [N / chunk, chunk, ...]` for micro-batched forward passes."""
    if x.shape[0] % chunk:
        raise ConfigError(f"batch of {x.shape[0]} rows is not a multiple of the chunk {chunk}")
    return x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])


def unchunk(x):
    return x.reshape(-1, *x.shape[2:])


def micro_sharding(mesh, batch_axes: tuple[str, ...], ndim: int, lead: int) -> NamedSharding:
    """Sharding of `[lead axes..., m, ...]`: the micro-batch axis over the batch mesh axes."""
    axis = None if not batch_axes else batch_axes[0] if len(batch_axes) == 1 else batch_axes
    return NamedSharding(mesh, P(*([None] * lead), axis, *([None] * (ndim - lead - 1))))


def to_global(x, sharding) -> jax.Array:
    """A host array that every process holds whole -> a `jax.Array` laid out by `sharding`.

    With several processes each one fills only its own devices' shards (no transfer between
    hosts, no check that the copies agree: the SPMD program guarantees they do).
    """
    x = np.asarray(x)
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def replicated(x, mesh) -> jax.Array:
    """A host array on every device of `mesh` (fully replicated)."""
    return to_global(x, NamedSharding(mesh, P()))


def put(tree, mesh, batch_axes: tuple[str, ...], lead: int):
    """Places host arrays on the mesh with `micro_sharding`.

    Every process passes the same, global arrays (the trainer gathers the hosts' prompts
    first, so all of them hold the whole rollout); each fills its own devices' shards.
    """

    def one(x):
        x = np.asarray(x)
        return to_global(x, micro_sharding(mesh, batch_axes, x.ndim, lead))

    return jax.tree.map(one, tree)


def fetch(tree):
    """Device arrays back to host numpy (gathered across processes when needed)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable \
                and not x.is_fully_replicated:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def put_packed(packed: packing.Packed, mesh, batch_axes: tuple[str, ...],
               lead: int) -> packing.Packed:
    """A host `Packed` (with `lead` leading axes) onto the mesh: each rank's rows and slots
    on its own devices, `active` everywhere."""
    return packing.Packed(put(packed.rows, mesh, batch_axes, lead + 1),
                          replicated(packed.active, mesh),
                          put(packed.where, mesh, batch_axes, lead),
                          put(packed.micro, mesh, batch_axes, lead),
                          put(packed.response_mask, mesh, batch_axes, lead))


def arrange(seqs, extra: dict, order: np.ndarray, mesh, batch_axes: tuple[str, ...],
            pack_plan: packing.PackPlan | None = None):
    """An update's batch on the mesh: `((seqs, extra), token_count[U], seq_count[U],
    unarrange)`.

    Padded (`pack_plan` None): the rows in `order` `[U, K, m, ...]`. Packed: each mini-batch
    `order[u]` packed by `pack_plan`, `extra`'s per-sequence arrays in its slots `[U, M, ...]`.
    `unarrange(x)` takes an output of one update back to the rollout's row order.
    """
    n = seqs.input_ids.shape[0]
    if pack_plan is None:
        host = jax.tree.map(lambda x: x[order], (seqs, extra))
        mask = host[0].loss_mask
        token_count, seq_count = mask.sum(axis=(1, 2, 3)), (mask.sum(-1) > 0).sum(axis=(1, 2))
        dev = put(host, mesh, batch_axes, lead=2)
        back = lambda x: unarrange(x, order)
    else:
        packed, slots = packing.pack(pack_plan, seqs, order.reshape(order.shape[0], -1))
        mask = packed.response_mask
        token_count, seq_count = mask.sum(axis=(1, 2)), (mask.sum(-1) > 0).sum(axis=1)
        dev = (put_packed(packed, mesh, batch_axes, lead=1),
               put(jax.tree.map(lambda x: np.asarray(x)[slots], extra), mesh, batch_axes, 1))
        back = lambda x: packing.from_slots(x, slots, n)
    count = lambda x: jax.numpy.asarray(x.astype(np.float32))
    return dev, count(token_count), count(seq_count), back
