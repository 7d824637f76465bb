"""Host offload: the CPU fallback says so once and changes nothing; the moves themselves.

The CPU backend has a `pinned_host` memory kind too (the same RAM), so the mechanics of an
enabled `Offload` (memory kinds, shardings, a jitted update fed from host memory) run here;
only the speed-up needs an accelerator.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_train_steps import CFG, N, _arrange, _rollout
from tiny_run import ROOT

from rlhf_jax import batching, offload
from rlhf_jax import train_steps as ts
from rlhf_jax.config import load_config
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model


def _cfg(*overrides):
    return load_config(ROOT / "configs/ppo_tiny_cpu.yaml", list(overrides))


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(offload, "_warned", set())


def test_cpu_fallback_warns_once_and_is_a_no_op(capsys):
    cfg = _cfg("actor_rollout_ref.ref.param_offload=true",
               "actor_rollout_ref.actor.optimizer_offload=true")
    if jax.default_backend() != "cpu":  # RLHF_JAX_TEST_PLATFORM=cuda: the real thing
        assert offload.host_offload_supported()
        assert all(offload.plan(cfg)[k].enabled for k in ("ref", "actor"))
        assert capsys.readouterr().err == ""
        return
    assert not offload.host_offload_supported()
    plans = [offload.plan(cfg), offload.plan(cfg)]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: host offload (actor_rollout_ref.ref.param_offload, "
                               "actor_rollout_ref.actor.optimizer_offload) is not supported "
                               "on the cpu backend")
    assert lines[0].endswith("running without it")
    for plan in plans:
        assert not any(o.enabled for o in plan.values())
        tree = {"w": jnp.ones((4, 4))}
        assert plan["ref"].to_host(tree) is tree and plan["actor"].to_device(tree) is tree
        fn = jax.jit(lambda x: x)
        assert offload.onloaded(fn, plan["actor"], "opt_state") is fn


def test_no_warning_when_not_asked(capsys):
    plan = offload.plan(_cfg())
    assert capsys.readouterr().err == ""
    assert set(plan) == {"ref", "actor", "critic"} and not any(o.enabled for o in plan.values())


def test_plan_enables_the_asked_roles_where_supported(monkeypatch, capsys):
    monkeypatch.setattr(offload, "host_offload_supported", lambda devices=None: True)
    plan = offload.plan(_cfg("actor_rollout_ref.ref.param_offload=true",
                             "critic.optimizer_offload=true"))
    assert capsys.readouterr().err == ""
    assert {k: o.enabled for k, o in plan.items()} == {"ref": True, "actor": False,
                                                       "critic": True}
    assert plan["ref"].key == "actor_rollout_ref.ref.param_offload"


def _spec():
    """The (2,2,2) mesh; on one accelerator (RLHF_JAX_TEST_PLATFORM), the single device."""
    return load_mesh_spec("cpu-8" if jax.device_count() >= 8 else "single")


def _mesh():
    return make_mesh(_spec())


def test_sharding_with_memory_kind():
    mesh = _mesh()
    s = NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
    tree = {"a": s, "b": [NamedSharding(mesh, P())]}
    host = offload.with_memory_kind(tree, offload.HOST)
    assert host["a"].memory_kind == "pinned_host" and host["b"][0].memory_kind == "pinned_host"
    assert host["a"].spec == s.spec and host["a"].mesh == mesh
    back = offload.device_shardings(host)
    assert back["a"].memory_kind == "device" and back["a"].spec == s.spec
    untouched = NamedSharding(mesh, P("data"))
    assert offload.device_shardings(untouched) is untouched


def test_enabled_offload_moves_memory_kind_and_keeps_layout():
    mesh = _mesh()
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                       NamedSharding(mesh, P(("data", "fsdp"), "tensor")))
    off = offload.Offload(True, "test")
    host = off.to_host({"x": x, "none": None})
    assert offload.memory_kind(host["x"]) == "pinned_host" and host["none"] is None
    assert host["x"].sharding.spec == P(("data", "fsdp"), "tensor")
    dev = off.to_device(host)
    assert offload.memory_kind(dev["x"]) == "device"
    assert not host["x"].is_deleted() and not x.is_deleted()  # copies: the owners decide
    np.testing.assert_array_equal(np.asarray(dev["x"]), np.arange(64).reshape(8, 8))
    assert off.to_device(dev)["x"] is dev["x"]  # already on device: not copied


def _update_setup():
    spec = _spec()
    mesh = make_mesh(spec)
    model = Model(CFG)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
    state = ts.init_state(params, ts.make_optimizer(optim))
    plan = batching.Plan(N, mini_batch=8, micro_batch=4, epochs=1, shuffle=True)
    seqs, extra = _rollout()
    (s, ex), tok, sq = _arrange(plan, seqs, extra, mesh, dict(spec.train_rules)["batch"])
    batch = ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq)
    step = functools.partial(ts.actor_update, model=model, optim=optim, loss=ts.ActorLoss())
    return state, batch, step


def test_offloaded_optimizer_state_trains_like_the_resident_one():
    """Two updates with opt_state in host memory between them == two without offload."""
    state, batch, step = _update_setup()
    sh = jax.tree.map(lambda x: x.sharding, state)
    off = offload.Offload(True, "actor_rollout_ref.actor.optimizer_offload")

    class Holder:
        actor = offload.Offloaded("actor", "opt_state")

        def __init__(self):
            self.offload = {"actor": off}

    holder = Holder()
    holder.actor = jax.tree.map(jnp.copy, state)
    kinds = {offload.memory_kind(x) for x in jax.tree.leaves(holder.actor.opt_state)}
    assert kinds == {"pinned_host"}
    assert {offload.memory_kind(x) for x in jax.tree.leaves(holder.actor.params)} == {"device"}
    host_sh = jax.tree.map(lambda x: x.sharding, holder.actor)
    compiled = jax.jit(step, in_shardings=(offload.device_shardings(host_sh), None),
                       out_shardings=(offload.device_shardings(host_sh), None),
                       donate_argnums=0)
    assert offload.device_shardings(host_sh) == sh  # compiled for the resident layout
    update = offload.onloaded(compiled, off, "opt_state")
    plain, ref = compiled, state  # the same executable, fed from device memory
    for _ in range(2):
        ref, m_ref = plain(ref, batch)
        holder.actor, m = update(holder.actor, batch)
        assert {offload.memory_kind(x) for x in jax.tree.leaves(holder.actor.opt_state)} \
            == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(jax.device_get(ref)),
                    jax.tree.leaves(jax.device_get(holder.actor)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    assert float(m["actor/pg_loss"]) == pytest.approx(float(m_ref["actor/pg_loss"]), abs=1e-6)


@pytest.mark.slow
def test_trainer_with_forced_offload_trains_like_without(tmp_path, monkeypatch):
    """The trainer's wiring, on CPU's pinned_host memory kind: 2 PPO steps with the reference
    and both optimizer states offloaded log the metrics of a run without offload, the arrays
    sit in host memory between steps, and the checkpoint restores into host memory."""
    from tiny_run import algorithmic, compare, tiny

    from rlhf_jax.trainer import Trainer

    keys = {"trainer.sft_warmup.enable": False, "trainer.test_freq": -1,
            "algorithm.use_kl_in_reward": True}
    off = {"actor_rollout_ref.ref.param_offload": True,
           "actor_rollout_ref.actor.optimizer_offload": True, "critic.optimizer_offload": True}
    plain = algorithmic(Trainer(tiny(tmp_path / "plain", **keys, **off)).run())  # CPU: no-op
    monkeypatch.setattr(offload, "host_offload_supported", lambda devices=None: True)
    trainer = Trainer(tiny(tmp_path / "offload", **keys, **off))
    kinds = lambda tree: {offload.memory_kind(x) for x in jax.tree.leaves(tree)}
    assert kinds(trainer.ref_params) == kinds(trainer.actor.opt_state) == {"pinned_host"}
    compare(algorithmic(trainer.run()), plain, atol=1e-6, rel=1e-6)
    assert kinds(trainer.actor.opt_state) == kinds(trainer.critic.opt_state) == {"pinned_host"}
    assert kinds(trainer.actor.params) == {"device"}
    resumed = Trainer(tiny(tmp_path / "offload", **keys, **off))
    got = resumed.recovery.restore(resumed.state)
    assert got is not None
    resumed._restored(got[0])
    assert resumed.global_step == 2
    resumed.checkpointer.close()
    assert kinds(resumed.ref_params) == kinds(resumed.actor.opt_state) == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.actor.opt_state)),
                    jax.tree.leaves(jax.device_get(resumed.actor.opt_state)), strict=True):
        np.testing.assert_array_equal(a, b)
