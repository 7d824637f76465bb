"""Host offload: the reference parameters and optimizer states in pinned host memory.

verl's `actor_rollout_ref.ref.param_offload`, `actor_rollout_ref.actor.optimizer_offload`
and `critic.optimizer_offload` keep those arrays off the accelerator between uses. Here they
live in `memory_kind="pinned_host"` (same shardings, host memory of each device) and come to
device memory only for the call that needs them:

    off = Offload(True, "actor_rollout_ref.ref.param_offload")
    ref = off.to_host(params)                     # between uses: pinned host memory
    logp = onloaded(log_probs_fn, off)(ref, seqs)  # on device for this call only

The arrays stay sharded the same way; only their memory kind changes, by `jax.device_put`.
Only accelerators have a separate pinned host memory: on the CPU backend every array is in
host memory already, so the trainer says so once and runs without offload (`plan`).
"""

from __future__ import annotations

import functools
import sys

import jax

HOST = "pinned_host"
DEVICE = "device"
KEYS = {
    "ref": "actor_rollout_ref.ref.param_offload",
    "actor": "actor_rollout_ref.actor.optimizer_offload",
    "critic": "critic.optimizer_offload",
}
_warned: set[str] = set()


def host_offload_supported(devices=None) -> bool:
    """True where the devices have a pinned host memory apart from their own (GPU, TPU)."""
    devices = list(devices) if devices is not None else jax.local_devices()
    d = devices[0]
    if d.platform == "cpu":
        return False
    return HOST in {m.kind for m in d.addressable_memories()}


def memory_kind(x) -> str | None:
    """The memory kind of an array's sharding (None for host numpy arrays)."""
    return getattr(getattr(x, "sharding", None), "memory_kind", None)


def with_memory_kind(shardings, kind: str):
    """The same shardings, in memory `kind` (e.g. "pinned_host")."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings,
                        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def device_shardings(shardings):
    """Shardings in device memory: host-memory ones moved back, the others unchanged.

    What a jitted step is compiled for when its state may sit in host memory between calls.
    """
    def one(s):
        return s.with_memory_kind(DEVICE) if s.memory_kind == HOST else s

    return jax.tree.map(one, shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def _move(tree, kind: str):
    """Copies the arrays of `tree` not in memory `kind` there. The sources are not donated
    (XLA cannot donate across memory kinds): they are freed when their last reference goes,
    which for the trainer's states is the assignment that offloads them."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(leaves)
           if isinstance(x, jax.Array) and memory_kind(x) != kind]
    if idx:
        moved = jax.device_put([leaves[i] for i in idx],
                               [leaves[i].sharding.with_memory_kind(kind) for i in idx])
        for i, x in zip(idx, moved, strict=True):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


class Offload:
    """Moves one role's arrays between device and pinned host memory; disabled: identity."""

    def __init__(self, enabled: bool, key: str = ""):
        self.enabled = bool(enabled)
        self.key = key

    def __repr__(self) -> str:
        return f"Offload({self.key or '?'}, enabled={self.enabled})"

    def to_host(self, tree):
        """`tree` with every array in pinned host memory."""
        return _move(tree, HOST) if self.enabled and tree is not None else tree

    def to_device(self, tree):
        """`tree` with every array in device memory (leaves already there are not copied)."""
        return _move(tree, DEVICE) if self.enabled and tree is not None else tree


def plan(cfg, devices=None) -> dict[str, Offload]:
    """One `Offload` per role ("ref", "actor", "critic") from the config's offload keys.

    Keys set on a backend without a separate host memory (CPU) are turned off with one
    warning line on stderr, once per process.
    """
    a = cfg.actor_rollout_ref
    wanted = {"ref": a.ref.param_offload, "actor": a.actor.optimizer_offload,
              "critic": cfg.critic.optimizer_offload}
    ok = host_offload_supported(devices)
    asked = [KEYS[k] for k, v in wanted.items() if v]
    if asked and not ok:
        platform = (list(devices) if devices is not None else jax.local_devices())[0].platform
        message = (f"warning: host offload ({', '.join(asked)}) is not supported on the "
                   f"{platform} backend, whose arrays are all in host memory already: "
                   "running without it")
        if message not in _warned:
            _warned.add(message)
            print(message, file=sys.stderr, flush=True)
    return {k: Offload(v and ok, KEYS[k]) for k, v in wanted.items()}


def onloaded(fn, offload: Offload, field: str | None = None):
    """`fn(x, *rest)` with `x` (or its NamedTuple field `field`) moved to device memory first.

    Disabled offload returns `fn` itself. Leaves already in device memory are not copied, so
    the same wrapper serves calls with the actor's (device) and the reference's (host)
    parameters.
    """
    if not offload.enabled:
        return fn

    @functools.wraps(fn)
    def call(x, *rest, **kw):
        if field is None:
            x = offload.to_device(x)
        else:
            x = x._replace(**{field: offload.to_device(getattr(x, field))})
        return fn(x, *rest, **kw)

    return call


class Offloaded:
    """A `Trainer` attribute that is put in host memory whenever it is assigned.

    `Offloaded("ref")` offloads the whole value, `Offloaded("actor", "opt_state")` one field
    of a NamedTuple; the instance's `offload` dict (from `plan`) says whether to. Until that
    dict exists, values are stored as they are.
    """

    def __init__(self, role: str, field: str | None = None):
        self.role, self.field = role, field

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_offloaded_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.get(self.slot)

    def __set__(self, obj, value) -> None:
        off = obj.__dict__.get("offload", {}).get(self.role)
        if off is not None and off.enabled and value is not None:
            if self.field is None:
                value = off.to_host(value)
            else:
                value = value._replace(**{self.field: off.to_host(getattr(value,
                                                                          self.field))})
        obj.__dict__[self.slot] = value
