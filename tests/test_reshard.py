"""`reshard`: train -> generate layout on device only, and a no-op where nothing moves."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.rollout import reshard

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def layouts():
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    model = Model(CFG)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype),
                        model.abstract_params())
    train = model.shardings(mesh, spec.train_rules)
    gen = model.shardings(mesh, spec.generate_rules)
    return host, jax.device_put(host, train), train, gen


def test_train_to_generate_stays_on_device(layouts):
    host, params, train, gen = layouts
    kernel = params["model"]["layers"]["mlp"]["gate_proj"]["kernel"]
    assert kernel.sharding.spec == P(None, "fsdp", "tensor")
    with jax.transfer_guard("disallow"), \
            jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        out = reshard(params, gen)
        jax.block_until_ready(out)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(gen), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    moved = out["model"]["layers"]["mlp"]["gate_proj"]["kernel"]
    assert moved.sharding.spec == P(None, None, "tensor")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(out), host)


def test_already_equivalent_leaves_are_the_same_objects(layouts):
    _, params, train, gen = layouts
    same = reshard(params, train)
    assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params),
                                      strict=True))
    out = reshard(params, gen)
    # Norm scales and kv biases are laid out alike in both layouts: they are not copied.
    for a, b, t, g in zip(jax.tree.leaves(out), jax.tree.leaves(params),
                          jax.tree.leaves(train), jax.tree.leaves(gen), strict=True):
        assert (a is b) == t.is_equivalent_to(g, a.ndim)
    assert any(a is b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params),
                                      strict=True))


def test_one_sharding_for_every_leaf_and_donation(layouts):
    host, params, train, _ = layouts
    mesh = jax.tree.leaves(train)[0].mesh
    replicated = NamedSharding(mesh, P())
    copy = jax.tree.map(lambda x: x + 0, params)  # something we may donate
    out = reshard(copy, replicated, donate=True)
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.is_fully_replicated
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(out), host)


def test_donated_sources_are_freed(layouts):
    _, params, train, gen = layouts
    copy = jax.tree.map(lambda x: x + 0, params)
    out = reshard(copy, gen, donate=True)
    moved = [a is not b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(copy),
                                        strict=True)]
    deleted = [x.is_deleted() for x in jax.tree.leaves(copy)]
    assert any(moved) and deleted == moved


def test_moving_to_other_devices(layouts):
    host, params, _, _ = layouts
    one = jax.sharding.SingleDeviceSharding(jax.devices()[7])
    out = reshard(params, one)
    assert all(x.devices() == {jax.devices()[7]} for x in jax.tree.leaves(out))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(out), host)
