"""The named 3D device mesh `(data, fsdp, tensor)` and its two layouts.

A preset (`meshes/<name>.yaml`) holds axis sizes and names its logical-axis rules
(`rules: default`, the file `meshes/rules/default.yaml` that every preset shares): those of
the **train** layout (parameters over fsdp x tensor) and of the **generate** layout
(parameters replicated over fsdp, sharded over tensor; batch and KV cache over data x fsdp).
A preset's own `train_rules` / `generate_rules` entries replace the named ones entry by entry.
Model code names logical axes only (`embed`, `mlp`, `heads`, ...); this module is the one place
that maps them to mesh axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_jax.config.loader import read_yaml
from rlhf_jax.errors import ConfigError
from rlhf_jax.paths import MESHES_DIR, RULES_DIR

AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes (ICI and DCN) and the logical-axis rules of both layouts."""

    sizes: tuple[int, int, int]
    dcn_sizes: tuple[int, int, int] = (1, 1, 1)
    train_rules: Rules = ()
    generate_rules: Rules = ()
    name: str = "custom"
    # The one-step-off mode's rollout sub-mesh (None: the rollout generates on the train
    # mesh): its axis sizes, on the devices after the train mesh's.
    rollout_sizes: tuple[int, int, int] | None = None


def _parse_rules(raw: Mapping[str, Any] | None, where: str) -> Rules:
    out = []
    for logical, mesh_axes in (raw or {}).items():
        if mesh_axes is None:
            axes: tuple[str, ...] = ()
        elif isinstance(mesh_axes, str):
            axes = (mesh_axes,)
        else:
            axes = tuple(mesh_axes)
        bad = [a for a in axes if a not in AXES]
        if bad:
            raise ConfigError(f"{where}: rule '{logical}' names unknown mesh axis {bad[0]!r}")
        out.append((str(logical), axes))
    return tuple(out)


def _sizes(raw: Mapping[str, Any] | None, where: str, default: int) -> tuple[int, int, int]:
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: sizes must be a mapping of axis: size, got {raw!r}")
    raw = dict(raw or {})
    unknown = set(raw) - set(AXES)
    if unknown:
        bad = sorted(unknown)[0]
        raise ConfigError(f"{where}: unknown mesh axis {bad!r} (axes: data, fsdp, tensor)")
    if any(not isinstance(raw.get(a, default), int) or isinstance(raw.get(a), bool)
           for a in AXES):
        raise ConfigError(f"{where}: sizes must be integers, got {raw}")
    sizes = tuple(int(raw.get(a, default)) for a in AXES)
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
        raise ConfigError(f"{where}: sizes must be >= 1 with at most one -1, got {sizes}")
    return sizes  # type: ignore[return-value]


def _named_rules(name: str | None, where: Path) -> dict:
    """`meshes/rules/<name>.yaml` (`train_rules`, `generate_rules`); None: no shared rules."""
    if name is None:
        return {}
    path = RULES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RULES_DIR.glob("*.yaml")))
        raise ConfigError(f"{where}: rules {name!r} not found in {RULES_DIR} (known: {known})")
    return read_yaml(path)


def load_mesh_spec(preset: str, overrides: Mapping[str, int | None] | None = None) -> MeshSpec:
    """Reads `meshes/<preset>.yaml` (or a path to a YAML file) and applies size overrides.

    Args:
      preset: a preset name in the repo's `meshes/` folder, or a path to a `.yaml` file.
      overrides: optional `{data, fsdp, tensor, dcn_data, dcn_fsdp, dcn_tensor}`; None = keep.
    """
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        path = MESHES_DIR / f"{preset}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MESHES_DIR.glob("*.yaml")))
        raise ConfigError(f"mesh preset {preset!r} not found (known: {known})")
    raw = read_yaml(path)  # names the file and line of a YAML error
    unknown = set(raw) - {"sizes", "dcn_sizes", "rules", "train_rules", "generate_rules",
                          "rollout_sizes"}
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    shared = _named_rules(raw.get("rules"), path)
    sizes = list(_sizes(raw.get("sizes"), str(path), 1))
    dcn = list(_sizes(raw.get("dcn_sizes"), str(path), 1))
    for i, axis in enumerate(AXES):
        if overrides and overrides.get(axis) is not None:
            sizes[i] = int(overrides[axis])
        if overrides and overrides.get(f"dcn_{axis}") is not None:
            dcn[i] = int(overrides[f"dcn_{axis}"])
    sizes_t = _sizes(dict(zip(AXES, sizes, strict=True)), f"mesh {preset}", 1)
    return MeshSpec(
        sizes=sizes_t,
        dcn_sizes=_sizes(dict(zip(AXES, dcn, strict=True)), f"mesh {preset} dcn", 1),
        train_rules=_parse_rules({**(shared.get("train_rules") or {}),
                                  **(raw.get("train_rules") or {})}, f"{path} train_rules"),
        generate_rules=_parse_rules({**(shared.get("generate_rules") or {}),
                                     **(raw.get("generate_rules") or {})},
                                    f"{path} generate_rules"),
        name=path.stem,
        rollout_sizes=None if raw.get("rollout_sizes") is None
        else _sizes(raw["rollout_sizes"], f"{path} rollout_sizes", 1),
    )


def resolve_sizes(sizes: Sequence[int], n_devices: int) -> tuple[int, ...]:
    """Replaces the one -1 by whatever is left; fails with both numbers when it cannot fit.

    A mesh smaller than the device count (no -1) is allowed: it uses the first devices.
    """
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ConfigError(
                f"mesh {tuple(sizes)} cannot fit {n_devices} devices: "
                f"{n_devices} is not a multiple of {known}"
            )
        sizes = tuple(n_devices // known if s == -1 else s for s in sizes)
    if math.prod(sizes) > n_devices:
        raise ConfigError(
            f"mesh {tuple(sizes)} needs {math.prod(sizes)} devices but {n_devices} are available"
        )
    return tuple(sizes)


def ensure_host_devices(n: int) -> None:
    """Asks XLA for `n` CPU devices, if jax has not started its backends yet.

    The CPU presets need no environment variable from the user: the trainer calls this before
    the first jax computation. Once backends exist it is too late and this does nothing.
    """
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def make_mesh(spec: MeshSpec, devices: Sequence[Any] | None = None):
    """Builds the `jax.sharding.Mesh` with axes ("data", "fsdp", "tensor").

    With DCN sizes other than 1 the device array comes from
    `mesh_utils.create_hybrid_device_mesh` (slices over DCN, the rest over ICI).
    """
    import jax
    from jax.experimental import mesh_utils

    multi_slice = math.prod(spec.dcn_sizes) > 1
    if devices is None:
        want = math.prod(s for s in spec.sizes if s != -1) * math.prod(spec.dcn_sizes)
        if -1 not in spec.sizes:
            ensure_host_devices(want)  # only affects the CPU backend, and only before it starts
        devices = jax.devices()
    devices = list(devices)
    n_dcn = math.prod(spec.dcn_sizes)
    if len(devices) % n_dcn:
        raise ConfigError(
            f"mesh dcn sizes {spec.dcn_sizes} need a multiple of {n_dcn} devices, "
            f"{len(devices)} are available"
        )
    ici = resolve_sizes(spec.sizes, len(devices) // n_dcn)
    devices = devices[: math.prod(ici) * n_dcn]  # a smaller mesh takes the first devices
    if multi_slice:
        if not hasattr(devices[0], "slice_index"):
            raise ConfigError(
                f"mesh {spec.name} has dcn sizes {spec.dcn_sizes} but the devices have no slices"
            )
        arr = mesh_utils.create_hybrid_device_mesh(ici, spec.dcn_sizes, devices)
    else:
        try:
            arr = mesh_utils.create_device_mesh(ici, devices)
        except (ValueError, NotImplementedError, AssertionError):
            arr = np.asarray(devices).reshape(ici)
    return jax.sharding.Mesh(arr, AXES)


# --------------------------------------------------------------------------- logical -> mesh


def logical_to_pspec(names: Sequence[str | None] | None, shape: Sequence[int], mesh, rules: Rules):
    """Maps logical axis names of one array to a `PartitionSpec` on `mesh`.

    A mesh axis is used at most once per array (first dimension wins), and only where its size
    divides the dimension; otherwise that dimension stays replicated over it.
    """
    from jax.sharding import PartitionSpec as P

    if names is None:
        return P()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape, strict=True):
        axes = []
        size = 1
        for axis in table.get(name, ()) if name is not None else ():
            n = mesh.shape[axis]
            if axis in used or dim % (size * n):
                continue
            axes.append(axis)
            size *= n
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def tree_shardings(logical_tree, shape_tree, mesh, rules: Rules):
    """`NamedSharding`s for a pytree, given a matching tree of logical-name tuples."""
    import jax
    from jax.sharding import NamedSharding

    def one(names, leaf):
        return NamedSharding(mesh, logical_to_pspec(names, leaf.shape, mesh, rules))

    return jax.tree.map(one, logical_tree, shape_tree, is_leaf=lambda x: isinstance(x, tuple))


_ACTIVE: contextvars.ContextVar[tuple[Any, Rules] | None] = contextvars.ContextVar(
    "rlhf_jax_mesh_rules", default=None
)


@contextlib.contextmanager
def activation_rules(mesh, rules: Rules):
    """While tracing under this context, `constrain` pins activations to `mesh` by `rules`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, names: Sequence[str | None]):
    """`with_sharding_constraint` by logical names; a no-op outside `activation_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    import jax
    from jax.sharding import NamedSharding

    mesh, rules = active
    spec = logical_to_pspec(names, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def batch_sharding(mesh, rules: Rules, ndim: int):
    """Sharding of a `[batch, ...]` array: batch over the rules' `batch` axes, rest replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = dict(rules).get("batch", ())
    first = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def data_parallel_size(mesh, rules: Rules) -> int:
    """How many ways the batch is split: the product of the `batch` rule's mesh axes."""
    return math.prod(mesh.shape[a] for a in dict(rules).get("batch", ()))
