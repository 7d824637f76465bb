"""How many sequences the engine decodes at once: verl's `rollout.gpu_memory_utilization`.

In verl the key goes to vLLM (`gpu_memory_utilization`), SGLang (`mem_fraction_static`) or
TensorRT-LLM: the fraction of a GPU's total memory that the inference engine may take for its
weights and its KV cache (default 0.5); the KV cache gets what is left of that share after
the weights, and `max_num_seqs` bounds the concurrent sequences. Here the same fraction u
bounds the engine's decode slots, the counterpart of vLLM's concurrent sequences:

    budget = min(u * total - rollout_params, free)         bytes of one device
    slots  = the most slots, up to rollout.max_concurrent_decodes, whose decode state (KV
             cache [L, S, K, C, H] x 2, per-slot buffers) and sampling working set (4 x
             float32 logits [S, V]), on the generate layout, fit in the budget

`rollout_params` are the generate-layout parameters on that device; `free` is what the
device has free when the engine is sized (the training state stays resident here, where verl
puts it to sleep during generation, so the share of the total alone could overcommit).
On GPU and TPU `total` and `free` come from `device.memory_stats()` (`bytes_limit`,
`bytes_limit - bytes_in_use`); on CPU, which reports none, from the host's memory
(`/proc/meminfo` MemTotal and MemAvailable, else `os.sysconf`) split evenly between the
process's devices (simulated CPU devices share one RAM), the parameters being already out
of MemAvailable. The largest device's share counts: every device holds the same layout.

Slot counts stay multiples of the cache's batch sharding where the configured count does
not fit, so the cache stays sharded. A rollout does not depend on the number of slots
(`rollout.driver`), so the budget changes speed, never results. When not even one sequence
fits, `ConfigError` says how much one needs and how much there is.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from rlhf_jax.errors import ConfigError
from rlhf_jax.rollout.engine import Engine

KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"
GIB = float(1 << 30)
LOGIT_COPIES = 4  # float32 [S, V] arrays alive in one sampling step (logits, filtered, ...)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device: its total, what is free now, and where the figures come from."""

    total: int
    free: int
    source: str  # "memory_stats" or "host"


@dataclasses.dataclass(frozen=True)
class SlotBudget:
    """The engine's slots under a memory budget, with the figures that decided them."""

    slots: int
    budget: int  # bytes of one device the decode state may take
    per_device: DeviceMemory
    params: int  # generate-layout parameter bytes on the largest device
    need: int  # bytes the chosen slots take

    def describe(self) -> str:
        return (f"{self.slots} decode slots: {self.need / GIB:.3g} GiB of a "
                f"{self.budget / GIB:.3g} GiB budget per device ({self.per_device.source})")


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this host's RAM."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        try:
            return total, os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError):
            return total, total


def device_memory(device=None) -> DeviceMemory:
    """Total and free bytes of `device` (default: this process's first), see the module doc."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        total = int(stats["bytes_limit"])
        return DeviceMemory(total, total - int(stats.get("bytes_in_use", 0)), "memory_stats")
    total, available = host_memory()
    n = sum(d.platform == device.platform for d in jax.local_devices())
    return DeviceMemory(total // n, available // n, "host")


def params_bytes(params) -> int:
    """Bytes of `params` on the device that holds the most of them."""
    per: dict = {}
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
        else:
            shape = getattr(x, "shape", np.shape(x))
            size = math.prod(x.sharding.shard_shape(shape)) if getattr(
                x, "sharding", None) is not None else math.prod(shape)
            per[None] = per.get(None, 0) + size * np.dtype(x.dtype).itemsize
    return max(per.values(), default=0)


def slots_bytes(engine: Engine, slots: int) -> int:
    """Device bytes of `slots` slots: the decode state and the sampling working set."""
    v = engine.model.cfg.vocab_size
    logits = engine._sharding(("cache_batch", "act_vocab"), (slots, v)).shard_shape((slots, v))
    return engine.decode_state_bytes(slots) + LOGIT_COPIES * 4 * math.prod(logits)


def batch_shards(engine: Engine) -> int:
    """Ways the cache's slot axis is split on the mesh (`cache_batch`)."""
    axes = dict(engine.rules).get("cache_batch", ())
    return math.prod(engine.mesh.shape[a] for a in axes)


def fit_slots(need, budget: int, max_slots: int, granularity: int) -> int:
    """The most slots S <= `max_slots` with `need(S) <= budget`: `max_slots` itself if it
    fits, else a multiple of `granularity` (the shards of the slot axis), else fewer than
    one multiple; 0 if not even one slot fits. `need` is non-decreasing over multiples of
    `granularity` (linear: the decode state is per slot)."""
    if need(max_slots) <= budget:
        return max_slots
    g = max(1, granularity)
    if g <= max_slots and need(g) <= budget:
        per = need(2 * g) - need(g)  # bytes of g more slots
        k = max_slots // g if per <= 0 else min(max_slots // g, 1 + (budget - need(g)) // per)
        while k > 1 and need(k * g) > budget:
            k -= 1
        return k * g
    for s in range(min(g - 1, max_slots), 0, -1):
        if need(s) <= budget:
            return s
    return 0


def budget_slots(engine: Engine, params, utilization: float,
                 memory: DeviceMemory | None = None) -> SlotBudget:
    """The slots the engine gets under `utilization` (see the module doc); `ConfigError` if
    not one sequence fits. `memory`: the device's figures (default: measured now)."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"{KEY}: must be in (0, 1], got {utilization}")
    # This process's first device of the mesh: another host's has no memory stats here.
    mine = [d for d in engine.mesh.devices.flat if d.process_index == jax.process_index()]
    memory = memory or device_memory(mine[0] if mine else None)
    p = params_bytes(params)
    budget = min(int(utilization * memory.total) - p, memory.free)
    need = lambda s: slots_bytes(engine, s)
    slots = fit_slots(need, budget, engine.max_concurrent_decodes, batch_shards(engine))
    if slots == 0:
        raise ConfigError(
            f"{KEY}: {utilization} of {memory.total / GIB:.3g} GiB per device less "
            f"{p / GIB:.3g} GiB of rollout parameters leaves {max(budget, 0) / GIB:.3g} GiB "
            f"(free now {memory.free / GIB:.3g} GiB, {memory.source}), but one sequence of "
            f"{engine.cache_length} tokens needs {need(1) / GIB:.3g} GiB; raise it, or shorten "
            f"data.max_prompt_length + data.max_response_length")
    return SlotBudget(slots, budget, memory, p, need(slots))


def budgeted(engine: Engine, params, utilization: float,
             memory: DeviceMemory | None = None) -> tuple[Engine, SlotBudget]:
    """`engine` with the slots `budget_slots` gives it (the same engine when unchanged)."""
    b = budget_slots(engine, params, utilization, memory)
    return (engine if b.slots == engine.max_concurrent_decodes
            else engine.with_slots(b.slots)), b
