"""LoRA (issue 27): adapters with B = 0 are the base exactly; an update moves only the
adapters and keeps optimizer state for them alone; (2,2,2) equals (1,1,1); the weight sync
moves only the adapters; the config's module names; the PEFT export (in test_lora_export.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_steps import CFG, N, _arrange, _rollout

from rlhf_jax import batching, lora
from rlhf_jax import train_steps as ts
from rlhf_jax.config import load_config
from rlhf_jax.errors import ConfigError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model
from rlhf_jax.models import lora as mlora

SPEC = mlora.LoraSpec(4, 8.0)
LORA_CFG = dataclasses.replace(CFG, lora=SPEC)


def _mesh(name):
    spec = load_mesh_spec(name)
    return make_mesh(spec), spec


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_adapters_with_b_zero_are_the_base_exactly(scan):
    mesh, spec = _mesh("single")
    model = Model(LORA_CFG, scan_layers=scan)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    ids = jax.random.randint(jax.random.key(1), (3, 7), 0, 32)
    mask = jnp.ones((3, 7), jnp.int32).at[0, :2].set(0)
    with_lora = model.forward(params, ids, mask)
    base = lora.base_model(model).forward(mlora.strip(params), ids, mask)
    assert bool(jnp.all(with_lora == base))  # bit for bit
    # every projection adapted, rank axis replicated, B zero, A not
    layer = params["model"]["layers"]
    assert sorted(k for k in layer["self_attn"] if k.endswith("_lora")) == [
        "k_proj_lora", "o_proj_lora", "q_proj_lora", "v_proj_lora"]
    assert sorted(k for k in layer["mlp"] if k.endswith("_lora")) == [
        "down_proj_lora", "gate_proj_lora", "up_proj_lora"]
    assert not np.any(np.asarray(layer["mlp"]["up_proj_lora"]["b"]))
    assert np.any(np.asarray(layer["mlp"]["up_proj_lora"]["a"]))
    axes = model.logical_axes()["model"]["layers"]["self_attn"]
    assert axes["q_proj_lora"]["a"] == ("layers", "embed", None)
    assert axes["q_proj_lora"]["b"] == ("layers", None, "heads", "head_dim")
    # the adapted forward is the merged one: x W + (alpha / r) x A B
    moved = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "'b'" in jax.tree_util.keystr(p) else x, params)
    np.testing.assert_allclose(
        model.forward(moved, ids, mask),
        lora.base_model(model).forward(mlora.merge(moved, SPEC), ids, mask), atol=2e-5)


def _lora_update(mesh_name, micro):
    mesh, spec = _mesh(mesh_name)
    axes = dict(spec.train_rules)["batch"]
    model = Model(LORA_CFG)
    base = Model(CFG).init(jax.random.key(0), mesh, spec.train_rules)
    params = lora.init_adapters(model, base, mesh, spec.train_rules, jax.random.key(3))
    trainable = lora.trainable(model)
    optim = ts.OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0)
    state = ts.init_state(params, ts.make_optimizer(optim), trainable)
    before = jax.device_get(params)
    plan = batching.Plan(N, mini_batch=8, micro_batch=micro, epochs=1, shuffle=True)
    seqs, extra = _rollout()
    (s, ex), tok, sq = _arrange(plan, seqs, extra, mesh, axes)
    step = functools.partial(ts.actor_update, model=model, optim=optim, trainable=trainable,
                             loss=ts.ActorLoss(entropy_coeff=0.01, use_kl_loss=True))
    state, metrics = jax.jit(step)(state, ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"],
                                                        tok, sq))
    return before, jax.device_get(state), jax.device_get(metrics)


def test_an_update_moves_only_the_adapters():
    before, state, _ = _lora_update("single", 8)
    flat = lambda t: {jax.tree_util.keystr(p): x
                      for p, x in jax.tree_util.tree_leaves_with_path(t)}
    old, new = flat(before), flat(state.params)
    assert old.keys() == new.keys()
    for k in old:
        if mlora.is_adapter_path(k):
            assert np.abs(new[k] - old[k]).max() > 1e-4, k  # every adapter matrix moved
        else:
            assert np.array_equal(new[k], old[k]), k  # the base, bit for bit
    # optimizer state only for the adapters: Adam's two moments of each adapter matrix
    assert len(jax.tree.leaves(state.opt_state[0].mu)) == len(jax.tree.leaves(
        mlora.adapters(before)))
    assert int(state.step) == 2


@pytest.mark.slow  # two compiles of the update: ~1 minute on 2 cores
def test_a_lora_update_on_2_2_2_equals_1_1_1():
    _, state, m1 = _lora_update("single", 8)
    _, state8, m8 = _lora_update("cpu-8", 4)  # (2,2,2), micro-batches of 4
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state8.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert m1["actor/pg_loss"] == pytest.approx(m8["actor/pg_loss"], rel=1e-4, abs=1e-6)


def test_weight_sync_moves_only_the_adapters_and_merges_them():
    mesh, spec = _mesh("cpu-8")
    model = Model(LORA_CFG)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    gen_sh = model.shardings(mesh, spec.generate_rules)
    sync = lora.WeightSync(model, gen_sh)
    gen, moved = sync(params)
    total, adapter_bytes = lora.nbytes(params), lora.nbytes(mlora.adapters(params))
    assert moved == total  # the first sync moves the base too
    # an update's new arrays: the base's values unchanged (frozen), the adapters moved
    params2 = mlora.with_adapters(jax.tree.map(jnp.copy, mlora.strip(params)),
                                  jax.tree.map(lambda x: x + 0.05, mlora.adapters(params)))
    gen2, moved2 = sync(params2)
    assert moved2 == adapter_bytes and adapter_bytes < total / 4
    # the engine's weights: the base's tree, the adapted kernels merged, the rest the very
    # same arrays as the generate copy of the base (not moved again)
    assert jax.tree.structure(gen2) == jax.tree.structure(mlora.strip(params))
    assert gen2["model"]["embed_tokens"]["embedding"] is gen["model"]["embed_tokens"]["embedding"]
    kernel = gen2["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.is_equivalent_to(
        gen_sh["model"]["layers"]["mlp"]["up_proj"]["kernel"], kernel.ndim)
    assert sync.engine_model(model).cfg.lora is None  # the engine runs the merged base
    ad = jax.device_get(params2["model"]["layers"]["mlp"]["up_proj_lora"])
    w = np.asarray(params["model"]["layers"]["mlp"]["up_proj"]["kernel"])
    np.testing.assert_allclose(np.asarray(kernel), w + SPEC.scale * np.einsum(
        "lir,lro->lio", ad["a"], ad["b"]), atol=1e-6)
    assert sync(params2, rebase=True)[1] == total  # the warm start, a restore: all of it
    # one device: the layouts agree, yet the engine's base is its own copy (an update
    # donates the train-layout arrays)
    mesh1, spec1 = _mesh("single")
    one = model.init(jax.random.key(0), mesh1, spec1.train_rules)
    gen1, _ = lora.WeightSync(model, model.shardings(mesh1, spec1.generate_rules))(one)
    assert gen1["model"]["norm"]["scale"] is not one["model"]["norm"]["scale"]
    full = lora.WeightSync(Model(CFG), Model(CFG).shardings(mesh, spec.generate_rules))
    assert full(mlora.strip(params))[1] == lora.nbytes(mlora.strip(params))


def test_config_keys_and_a_bad_module_name():
    base = ["actor_rollout_ref.model.lora_rank=8"]
    cfg = load_config("configs/ppo_tiny_cpu.yaml", base + [
        "actor_rollout_ref.model.exclude_modules=[o_proj,down_proj]"])
    spec = lora.spec_of(cfg.actor_rollout_ref.model)
    assert spec == mlora.LoraSpec(8, 16.0, ("q_proj", "k_proj", "v_proj", "gate_proj",
                                            "up_proj"))
    assert lora.spec_of(cfg.critic.model) is None  # lora_rank 0: off
    with pytest.raises(ConfigError) as e:
        load_config("configs/ppo_tiny_cpu.yaml",
                    base + ["actor_rollout_ref.model.target_modules=[q_proj,qkv]"])
    msg = str(e.value)
    assert "\n" not in msg and "'qkv'" in msg and "all-linear, q_proj" in msg
    assert "down_proj" in msg
    with pytest.raises(ConfigError, match="critic.model.exclude_modules"):
        load_config("configs/ppo_tiny_cpu.yaml",
                    ["critic.model.lora_rank=4", "critic.model.exclude_modules=[lm_head]"])
