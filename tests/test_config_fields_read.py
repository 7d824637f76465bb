"""No silent keys: every field of the config schema is read by code outside rlhf_jax/config/
(an attribute access `.field` in rlhf_jax/ or scripts/, found in their syntax trees, so a
word in a comment or a docstring does not count), or is one of the verl keys the config
refuses at any value but the one that runs (`checks._ONLY`)."""

import ast
import dataclasses
import typing
from pathlib import Path

from rlhf_jax.config import checks, schema

ROOT = Path(__file__).resolve().parents[1]

# Fields read generically, by a name built at run time rather than an attribute access:
GENERIC = {
    # MeshConfig's axis sizes: roles.build_mesh reads them as getattr(cfg.mesh, axis) over
    # the axis names of the mesh (and dcn_ + axis).
    "MeshConfig.data", "MeshConfig.fsdp", "MeshConfig.tensor",
    "MeshConfig.dcn_data", "MeshConfig.dcn_fsdp", "MeshConfig.dcn_tensor",
    # Every field of algorithm.rollout_correction: RolloutCorrection.from_config passes
    # them all to its parser (core_algos/rollout_corr_spec.py, dataclasses.fields).
    *(f"RolloutCorrectionConfig.{f.name}"
      for f in dataclasses.fields(schema.RolloutCorrectionConfig)),
    # The mini-batch sizes: config.validate_batch_arithmetic turns them into the split of
    # a step's sequences (`BatchArithmetic`) that the trainer's batching plans walk.
    "ActorConfig.ppo_mini_batch_size", "CriticConfig.ppo_mini_batch_size",
}


def _fields(cls, prefix=""):
    """(dotted key, owner.field, field name) of every field of `cls`, sections recursed."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key, f"{cls.__name__}.{f.name}", f.name
        kind = hints[f.name]
        for arg in (kind, *typing.get_args(kind)):
            if dataclasses.is_dataclass(arg):
                yield from _fields(arg, key + ".")


def _attributes_read() -> set[str]:
    files = [p for p in (ROOT / "rlhf_jax").rglob("*.py") if "config" not in p.parts]
    files += list((ROOT / "scripts").glob("*.py"))
    names: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def test_every_schema_field_is_read_outside_the_config_package():
    read = _attributes_read()
    refused = {path for path, *_ in checks._ONLY}
    fields = list(_fields(schema.Config))
    assert len(fields) > 150  # the walk reaches every section
    unread = [key for key, owner, name in fields
              if name not in read and key not in refused and owner not in GENERIC]
    assert unread == [], f"config keys nothing outside rlhf_jax/config/ reads: {unread}"
