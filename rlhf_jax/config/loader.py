"""YAML files and `key.sub=value` overrides in, `Config` out; and back to dicts and YAML."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlhf_jax.config.coerce import (
    build,
    describe,
    is_number_or_text,
    optional_inner,
    schema_walk,
    thaw,
)
from rlhf_jax.config.schema import Config
from rlhf_jax.errors import ConfigError


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config, applies dotted overrides in order, and validates the result.

    Args:
      path: a YAML file (None: start from the defaults; overrides must then set the
        required keys `data.train_files` and `actor_rollout_ref.model.path`).
      overrides: `key.sub=value` strings; values are YAML (`[1, 2]`, `null`, `1e-6`).
        `mesh=NAME` selects a preset and drops the file's size overrides; a leading `+`
        (Hydra's "add a key") is ignored.

    Returns:
      The immutable, validated Config.
    """
    raw = {} if path is None else read_yaml(path)
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def config_from_dict(d: Mapping[str, Any]) -> Config:
    """Builds and validates a Config from a nested mapping (the parsed YAML tree)."""
    return build(Config, d, "")


def to_dict(cfg: Any) -> Any:
    """The config as plain dicts, lists and scalars (the inverse of `config_from_dict`)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return thaw(cfg)


def to_yaml(cfg: Config) -> str:
    """The effective config as YAML; loading it gives an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def replace(cfg: Config, key: str, value: Any) -> Config:
    """A copy of `cfg` with the dotted `key` set to `value`, validated like a loaded config.

    E.g. `replace(cfg, "actor_rollout_ref.actor.optim.lr", lr * factor)` after a rollback.
    """
    raw = to_dict(cfg)
    _set(raw, _split(key, key), value)
    return config_from_dict(raw)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Parses a YAML file with yaml.safe_load; errors name the file and line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = file.read_text(encoding="utf-8")
        _check_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), str(path), "")
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {describe(raw)}")
    return raw


def _yaml_error(exc: yaml.YAMLError, where: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    loc = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    text = f"{loc}: invalid YAML: {problem}" + (f" ({context})" if context else "")
    return ConfigError(" ".join(text.split()))


def _check_duplicate_keys(node: yaml.Node | None, where: str, prefix: str) -> None:
    """PyYAML keeps the last of two equal keys silently; a config must not."""
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            if key in seen:
                raise ConfigError(f"{where}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
            _check_duplicate_keys(value_node, where, key)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, where, f"{prefix}[{i}]")


def _split(key: str, item: str) -> list[str]:
    parts = key.strip().lstrip("+").split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment in {key!r}")
    return parts


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Applies one `key.sub=value` override to the raw (not yet typed) config tree."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"no '=' in override {item!r} (expected key.path=value)")
    parts = _split(key, item)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"override {item!r}: cannot parse {text!r} as YAML ({problem})") from None
    leaf = schema_walk(Config, parts)[-1]
    inner = optional_inner(leaf)[0]
    if (inner is str or is_number_or_text(inner)) and isinstance(value, bool | int | float):
        value = text.strip()  # `trainer.experiment_name=2024` is the name "2024"; and YAML
        # reads `x=0.5_5` as 0.55, while rollout_is_threshold=0.5_5 is the spec "0.5_5"
    _set(raw, parts, value)


def _set(raw: dict[str, Any], parts: list[str], value: Any) -> None:
    types = schema_walk(Config, parts)
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        section = optional_inner(types[i])[0]
        scalar_field = getattr(section, "scalar_field", None)
        if child is None:
            child = {}
        elif scalar_field and isinstance(child, str):
            child = {scalar_field: child}
        elif not isinstance(child, Mapping):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"{where}: expected a mapping, got {describe(child)}")
        node[part] = child = dict(child)
        node = child
    node[parts[-1]] = value
