"""Turning YAML values into the typed, frozen config tree, with one-line errors that name the key.

The schema is the dataclass annotations themselves: `int`, `float`, `bool`, `str`, `X | None`,
`Literal[...]` (an enum), `Annotated[str, OneOf(names)]` (an enum whose values a registry
holds, asked at every check), `Annotated[str | float, NumberOrText()]` (verl's `str | float`
keys: a number, or a string spec such as `"0.5_2.0"`), `tuple[X, ...]` (a YAML list),
`tuple[X, Y]` (a fixed-length list), `FrozenDict` (a free-form mapping) and nested dataclasses
(sections).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal

from rlhf_jax.errors import ConfigError

# PyYAML (YAML 1.1) reads `1e-6` as a string: a float field accepts numeric strings.
_FLOAT_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_EXP_FLOAT_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")  # a float in YAML 1.2

# verl keys that have no counterpart here, with what to use instead.
_VERL_HINTS = {
    "trainer.n_gpus_per_node": "devices come from the mesh: set mesh=<a preset in meshes/>",
    "trainer.nnodes": "devices come from the mesh: set mesh=<a preset in meshes/>",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "set mesh.tensor",
    "actor_rollout_ref.rollout.name": "rlhf_jax has one rollout engine (the JetStream API)",
    **{f"algorithm.rollout_correction.{k}": "removed from verl's rollout correction; set "
       "rollout_rs and rollout_rs_threshold ('lower_upper' for *_k1), loss_type for the "
       "policy gradient" for k in ("rollout_rs_threshold_lower", "rollout_token_veto_threshold",
                                   "use_policy_gradient")},
}


@dataclasses.dataclass(frozen=True)
class OneOf:
    """`Annotated[str, OneOf(names)]`: a str among `names()`, e.g. the registered advantage
    estimators; asked when a value is checked, so names registered later are accepted."""

    names: Callable[[], Iterable[str]]


@dataclasses.dataclass(frozen=True)
class NumberOrText:
    """`Annotated[str | float, NumberOrText()]`: a number (kept as a float) or a string (kept
    as given), for verl's keys typed `str | float`; a dotted override keeps its text."""


def is_number_or_text(tp: Any) -> bool:
    return typing.get_origin(tp) is Annotated and any(
        isinstance(m, NumberOrText) for m in tp.__metadata__)


class FrozenDict(Mapping):
    """A read-only, hashable mapping (nested dicts and lists frozen too)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenDict({self._items!r})"


def freeze(value: Any, path: str) -> Any:
    """Mappings -> FrozenDict, lists -> tuples, `1e4` -> 10000.0 (as YAML 1.2), recursively."""
    if isinstance(value, FrozenDict):
        return value
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{path}: keys must be strings, got {describe(bad[0])}")
        return FrozenDict({k: freeze(v, f"{path}.{k}") for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(value, str) and _EXP_FLOAT_RE.fullmatch(value):
        return float(value)
    if value is None or isinstance(value, str | int | float):
        return value
    raise ConfigError(f"{path}: unsupported value {describe(value)}")


def thaw(value: Any) -> Any:
    """The inverse of `freeze`: plain dicts and lists, ready for yaml.safe_dump."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


def describe(value: Any) -> str:
    """`str 'two'`, `int 3`, `null`: the type and a short repr, for error messages."""
    if value is None:
        return "null"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def optional_inner(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"config fields support only `X | None` unions, got {tp}")
        return args[0], True
    return tp, False


def choices(tp: Any) -> tuple[str, ...] | None:
    """The allowed values of a `Literal[...]` or `Annotated[str, OneOf(...)]`; else None."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return typing.get_args(tp)
    if origin is Annotated:
        one_of = [m for m in tp.__metadata__ if isinstance(m, OneOf)]
        if one_of:
            return tuple(one_of[0].names())
    return None


def type_name(tp: Any) -> str:
    tp, optional = optional_inner(tp)
    origin = typing.get_origin(tp)
    allowed = choices(tp)
    if allowed is not None:
        name = "one of " + ", ".join(map(str, allowed))
    elif is_number_or_text(tp):
        name = "a number or a string"
    elif origin is tuple:
        args = typing.get_args(tp)
        elem = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        name = f"a list of {type_name(elem)}" if elem else f"a list of {len(args)} values"
    elif dataclasses.is_dataclass(tp) or tp is FrozenDict:
        name = "a mapping"
    else:
        name = getattr(tp, "__name__", str(tp))
    return f"{name} or null" if optional else name


def convert(value: Any, tp: Any, path: str, root: type) -> Any:
    """Checks `value` against the annotation `tp` and returns it normalised (frozen)."""
    tp, optional = optional_inner(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path}: expected {type_name(tp)}, got null")
    origin = typing.get_origin(tp)
    allowed = choices(tp)
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build(tp, value, path, root)
    if is_number_or_text(tp):
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif allowed is not None:
        if isinstance(value, str) and value in allowed:
            return value
        if isinstance(value, str):
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(allowed)}")
    elif origin is tuple:
        return _convert_tuple(value, tp, path, root)
    elif tp is FrozenDict:
        if isinstance(value, Mapping):
            return freeze(value, path)
    elif tp is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (bool, str):
        if isinstance(value, tp):
            return value
    else:
        raise TypeError(f"unsupported config annotation {tp} at {path}")
    raise ConfigError(f"{path}: expected {type_name(tp)}, got {describe(value)}")


def _convert_tuple(value: Any, tp: Any, path: str, root: type) -> tuple:
    args = typing.get_args(tp)
    variadic = len(args) == 2 and args[1] is Ellipsis
    stringy = variadic and (args[0] is str or choices(args[0]) is not None)
    if stringy and isinstance(value, str):  # `trainer.logger=console` means [console], as verl
        value = [value]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {describe(value)}")
    if not variadic and len(value) != len(args):
        raise ConfigError(f"{path}: expected a list of {len(args)} values, got {len(value)}")
    elems = [args[0]] * len(value) if variadic else args
    pairs = enumerate(zip(value, elems, strict=True))
    return tuple(convert(v, t, f"{path}[{i}]", root) for i, (v, t) in pairs)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def build(cls: type, raw: Any, path: str, root: type | None = None) -> Any:
    """Builds the dataclass `cls` from a mapping (a section of the YAML tree) at `path`."""
    root = root or cls
    scalar_field = getattr(cls, "scalar_field", None)  # `mesh: single` == `mesh: {preset: single}`
    if raw is None:
        raw = {}
    elif scalar_field and isinstance(raw, str):
        raw = {scalar_field: raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {describe(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'config'}: keys must be strings, got {describe(key)}")
        if key not in fields:
            raise unknown_key(_join(path, key), root)
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        tp = hints(cls)[name]
        if name in raw:
            if raw[name] is None and _is_required(f) and not optional_inner(tp)[1]:
                raise ConfigError(f"{sub} is required")
            kwargs[name] = convert(raw[name], tp, sub, root)
        elif _is_required(f):
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"{sub} is required")
            kwargs[name] = build(tp, {}, sub, root)
    return cls(**kwargs)


class Section:
    """Mixin for config dataclasses: fields are checked and frozen on construction, so a config
    built in Python (`DataConfig(train_files="a.parquet")`) is normalised like one from YAML."""

    def __post_init__(self) -> None:
        cls = type(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            new = convert(value, hints(cls)[f.name], f"{cls.__name__}.{f.name}", cls)
            if new is not value:
                object.__setattr__(self, f.name, new)


section = dataclasses.dataclass(frozen=True, kw_only=True)  # a config section's decorator


def factory(cls):
    """A field whose default is a fresh `cls` section."""
    return dataclasses.field(default_factory=cls)


@functools.cache
def all_paths(root: type) -> tuple[str, ...]:
    """Every key path of the schema, sections included (`data`, `data.train_files`, ...)."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in hints(cls).items():
            path = _join(prefix, name)
            out.append(path)
            inner = optional_inner(tp)[0]
            if dataclasses.is_dataclass(inner):
                walk(inner, path)

    walk(root, "")
    return tuple(out)


def unknown_key(path: str, root: type) -> ConfigError:
    """`unknown config key 'a.b' (did you mean 'a.c'?)`, with the likeliest intended key."""
    if path in _VERL_HINTS:
        return ConfigError(f"unknown config key {path!r} (a verl key; {_VERL_HINTS[path]})")
    paths = all_paths(root)
    parent, _, leaf = path.rpartition(".")
    renamed = path.replace("_per_gpu", "_per_device")
    siblings = [p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    same_leaf = [p for p in paths if p.endswith("." + path) or p.rpartition(".")[2] == leaf]
    if renamed != path and renamed in paths:
        guess = renamed
    elif close:
        guess = _join(parent, close[0])
    elif len(same_leaf) == 1:
        guess = same_leaf[0]
    else:
        guess = next(iter(difflib.get_close_matches(path, paths, n=1, cutoff=0.75)), None)
    if guess:
        return ConfigError(f"unknown config key {path!r} (did you mean {guess!r}?)")
    return ConfigError(f"unknown config key {path!r}")


def schema_walk(root: type, parts: list[str]) -> list[Any]:
    """The annotation of each prefix of a dotted key; raises on an unknown key.

    Below a free-form mapping (`override_config.x.y`) every key is allowed and typed `Any`.
    """
    out: list[Any] = []
    cls: Any = root
    for i, part in enumerate(parts):
        prefix = ".".join(parts[: i + 1])
        if cls is Any:
            out.append(Any)
            continue
        if not dataclasses.is_dataclass(cls):
            parent = ".".join(parts[:i])
            raise ConfigError(f"{parent} is a value, not a section: cannot set {prefix!r}")
        if part not in hints(cls):
            raise unknown_key(prefix, root)
        tp = hints(cls)[part]
        out.append(tp)
        inner = optional_inner(tp)[0]
        cls = Any if inner is FrozenDict else inner
    return out
