"""Several hosts, one program: `jax.distributed` start-up and the host-side gathers.

Every host runs one Python process (`scripts/launch_ray.py` starts them on a Ray cluster, or
a TPU pod slice starts them itself). `initialize()` joins them into one global device set
before the first jax computation, so `jax.devices()` lists every host's devices and the
(data, fsdp, tensor) mesh spans them all. From then on every process runs the same SPMD
program: each reads its own shard of the prompts, the shards are gathered (`GatheredLoader`)
so every host holds the same global batch, and host-side decisions (rollout slot refills,
shuffles, metrics) are identical everywhere because they are computed from identical data.

    from rlhf_jax import distributed
    distributed.initialize()          # from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
                                      # JAX_PROCESS_ID, or TPU / SLURM auto-detection
    ...                               # then build the mesh, the trainer, ...
"""

from __future__ import annotations

import functools
import os
import pickle
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_jax.errors import UserError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


class DistributedError(UserError):
    """jax.distributed cannot start: incomplete or inconsistent coordinates, or too late."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None


def set_cpu_device_count(n: int) -> None:
    """Makes the CPU backend (not started yet) simulate `n` devices in this process.

    Replaces a device count already in XLA_FLAGS: a launcher's environment may carry the
    single-host count (e.g. 8) while each of its processes is one host of 4.
    """
    if n < 1:
        raise DistributedError(f"cpu devices per process must be >= 1, got {n}")
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags.strip()} {_DEVICE_COUNT_FLAG}={n}".strip()


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: int | Sequence[int] | None = None, *,
               cpu_devices: int | None = None, initialization_timeout: int = 300) -> bool:
    """Joins this process to the others of the job (`jax.distributed.initialize`).

    Each argument left None comes from the environment: `JAX_COORDINATOR_ADDRESS` (host:port
    of process 0), `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, `JAX_LOCAL_DEVICE_IDS` (comma
    separated). What is still missing jax detects where it can (Cloud TPU pod slices and
    GKE TPU, SLURM, Open MPI, Kubernetes); with nothing given and nothing detected this is a
    single-process run and nothing is started. On the CPU backend the processes' collectives
    go through gloo.

    Args:
      coordinator_address: "host:port" of process 0's coordinator service.
      num_processes: how many processes (hosts) the job has.
      process_id: this process's index, 0 <= process_id < num_processes.
      local_device_ids: the local accelerators this process owns (default: all).
      cpu_devices: simulate this many CPU devices in this process (tests, CPU clusters).
      initialization_timeout: seconds to wait for every process to connect.

    Returns:
      True when the job runs on several processes.

    Raises:
      DistributedError: jax has already started its backends, or the coordinates are
        incomplete or inconsistent.
    """
    import jax
    from jax._src import xla_bridge

    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if local_device_ids is None and os.environ.get(ENV_LOCAL_DEVICE_IDS):
        raw = os.environ[ENV_LOCAL_DEVICE_IDS]
        try:
            local_device_ids = [int(x) for x in raw.split(",")]
        except ValueError:
            raise DistributedError(f"{ENV_LOCAL_DEVICE_IDS}={raw!r} is not a comma-separated "
                                   "list of integers") from None
    if num_processes is not None and num_processes < 1:
        raise DistributedError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None \
            and not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id {process_id} is not in [0, {num_processes})")
    given = (coordinator_address, num_processes, process_id)
    if xla_bridge.backends_are_initialized():
        if all(x is None for x in given) and cpu_devices is None:
            return False  # jax already runs here as one process (a notebook, a test)
        raise DistributedError("jax.distributed must start before the first jax computation "
                               "(call rlhf_jax.distributed.initialize() first)")
    if cpu_devices is not None:
        set_cpu_device_count(cpu_devices)
    # gloo: the CPU backend's cross-process collectives (TCP through the coordinator's store).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes == 1:
        return False
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   local_device_ids,
                                   initialization_timeout=initialization_timeout)
    except ValueError as e:
        if all(x is None for x in given):
            return False  # nothing given, no cluster detected: one process
        raise DistributedError(
            f"jax.distributed: {e} (got coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes}, process_id={process_id}; set the missing ones "
            f"or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})") from None
    return jax.process_count() > 1


# ------------------------------------------------------------------------- host-side gathers


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in process order; the same list on every process.

    A collective: every process must call it, in the same order. One process: `[obj]`.
    """
    import jax

    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = _allgather_rows(np.asarray([data.size], np.int64))[:, 0]
    # Padded to a power of two, so a run compiles a handful of gathers, not one a size.
    padded = np.zeros(max(1024, 1 << int(sizes.max() - 1).bit_length()), np.uint8)
    padded[: data.size] = data
    rows = _allgather_rows(padded)  # [processes, padded size]
    return [pickle.loads(rows[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]


def _allgather_rows(row: np.ndarray) -> np.ndarray:
    """`[processes, *row.shape]`: every process's `row`, gathered through the first local
    device of each process only. (`multihost_utils.process_allgather` runs on every device,
    so it would queue behind the one-step-off mode's rollout programs on the rollout
    devices, which the split puts after each host's train devices.)"""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    mesh = Mesh(np.asarray([first[p] for p in sorted(first)]), ("process",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("process")), row[None])
    return np.asarray(_moved_to(NamedSharding(mesh, P()))(x).addressable_data(0))


@functools.cache
def _moved_to(sharding):
    """A jitted identity onto `sharding` (one per sharding, so each compiles once a shape)."""
    import jax

    return jax.jit(lambda tree: tree, out_shardings=sharding)


def host_local_copy(tree, mesh):
    """The arrays of `tree` (laid out over `mesh`, which may span every host), each whole
    on one of this host's devices: an all-gather over `mesh` (a collective: every process
    calls it, in the same order), then this host's copy. The one-step-off mode moves the
    trained weights to each host's own rollout devices so (`roles.build_mesh`): the train
    devices hold one whole copy for the moment of the transfer."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    whole = _moved_to(NamedSharding(mesh, P()))(tree)
    return jax.tree.map(lambda x: x.addressable_data(0), whole)


def gather_batch(batch):
    """The processes' `PromptBatch` shards joined in process order: the global batch."""
    import jax

    if jax.process_count() == 1:
        return batch
    parts = allgather_objects(batch)
    first = parts[0]
    fields = {}
    for name in first.__dataclass_fields__:
        values = [getattr(p, name) for p in parts]
        if isinstance(values[0], np.ndarray):
            fields[name] = np.concatenate(values, axis=0)
        else:
            fields[name] = [x for v in values for x in v]
    return type(first)(**fields)


class GatheredLoader:
    """A `PromptLoader` whose batches are the global batch on every process.

    Each process reads only its shard (`shard_index = jax.process_index()`); `__next__` joins
    the shards, so every host runs the same step on the same data, the very batch a
    single-process run sees. Everything else (`get_state`, `epoch`, `dataset`, ...) is the
    wrapped loader's.
    """

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self) -> GatheredLoader:
        return self

    def __next__(self):
        return gather_batch(next(self.loader))  # StopIteration is raised on every process

    def batch_at(self, epoch: int, step: int):
        return gather_batch(self.loader.batch_at(epoch, step))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def gathered(loader):
    """`loader` itself on one process, else a `GatheredLoader` over it."""
    import jax

    return loader if loader is None or jax.process_count() == 1 else GatheredLoader(loader)


def barrier(name: str) -> None:
    """All processes wait here (a no-op on one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
