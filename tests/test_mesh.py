"""Mesh presets, size resolution, logical-axis mapping and the automatic CPU device count."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlhf_jax.errors import ConfigError
from rlhf_jax.mesh import (
    MESHES_DIR,
    activation_rules,
    constrain,
    data_parallel_size,
    load_mesh_spec,
    logical_to_pspec,
    make_mesh,
    resolve_sizes,
)


@pytest.mark.parametrize("name", sorted(p.stem for p in MESHES_DIR.glob("*.yaml")))
def test_every_preset_loads_with_both_layouts(name):
    spec = load_mesh_spec(name)
    train, gen = dict(spec.train_rules), dict(spec.generate_rules)
    assert train["embed"] == ("fsdp",) and gen["embed"] == ()  # generate: replicated over fsdp
    assert train["batch"] == gen["batch"] == ("data", "fsdp")
    assert gen["cache_batch"] == ("data", "fsdp") and gen["cache_heads"] == ("tensor",)


def test_required_presets_exist():
    names = {p.stem for p in MESHES_DIR.glob("*.yaml")}
    assert {"single", "cpu-8", "gpu-8", "tpu-v5p-64", "tpu-v5e-256-2slice"} <= names
    assert load_mesh_spec("gpu-8").sizes == (1, 4, 2)
    assert load_mesh_spec("tpu-v5e-256-2slice").dcn_sizes == (2, 1, 1)


def test_cpu8_mesh_axes_and_overrides():
    mesh = make_mesh(load_mesh_spec("cpu-8"))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = make_mesh(load_mesh_spec("cpu-8", {"data": 1, "fsdp": -1, "tensor": 1}))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}


def test_minus_one_takes_the_rest_and_misfits_name_both_numbers():
    assert resolve_sizes((2, -1, 2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"needs 16 devices but 8 are available"):
        make_mesh(load_mesh_spec("cpu-8", {"fsdp": 4}))
    with pytest.raises(ConfigError, match=r"cannot fit 8 devices: 8 is not a multiple of 3"):
        resolve_sizes((3, -1, 1), 8)


def test_bad_presets_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="mesh preset 'nope' not found"):
        load_mesh_spec("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sizes: {data: 1, fsdp: -1, tensor: -1}\n")
    with pytest.raises(ConfigError, match="at most one -1"):
        load_mesh_spec(str(bad))
    bad.write_text("sizes: {data: 1}\ntrain_rules: {embed: model}\n")
    with pytest.raises(ConfigError, match="unknown mesh axis 'model'"):
        load_mesh_spec(str(bad))


def test_logical_mapping_drops_axes_that_do_not_divide():
    mesh = make_mesh(load_mesh_spec("cpu-8"))
    rules = (("embed", ("fsdp",)), ("kv_heads", ("tensor",)), ("batch", ("data", "fsdp")))
    assert logical_to_pspec(("embed", "kv_heads"), (8, 2), mesh, rules) == P("fsdp", "tensor")
    assert logical_to_pspec(("embed", "kv_heads"), (8, 1), mesh, rules) == P("fsdp")
    assert logical_to_pspec(("batch", None), (4, 3), mesh, rules) == P(("data", "fsdp"))
    assert logical_to_pspec(("batch", None), (2, 3), mesh, rules) == P("data")
    # an axis is used once per array
    assert logical_to_pspec(("embed", "embed"), (4, 4), mesh, rules) == P("fsdp")
    assert data_parallel_size(mesh, rules) == 4


def test_constrain_is_noop_outside_and_shards_inside():
    mesh = make_mesh(load_mesh_spec("cpu-8"))
    rules = (("batch", ("data", "fsdp")),)
    x = jnp.ones((8, 4))
    assert constrain(x, ("batch", None)) is x

    @jax.jit
    def f(x):
        with activation_rules(mesh, rules):
            return constrain(x * 2, ("batch", None))

    y = f(x)
    assert y.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((8, 4)))


def test_cpu_preset_sets_the_device_count_itself():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    code = (
        "from rlhf_jax.mesh import load_mesh_spec, make_mesh\n"
        "m = make_mesh(load_mesh_spec('cpu-8'))\n"
        "import jax; print(jax.device_count(), dict(m.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split()[0] == "8"
