"""`rollout.gpu_memory_utilization`: the engine's slots from a memory budget."""

import jax
import numpy as np
import pytest
from tiny_run import ROOT, tiny

from rlhf_jax.config import load_config
from rlhf_jax.errors import ConfigError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences, memory
from rlhf_jax.rollout.memory import DeviceMemory

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
MIB = 1 << 20


@pytest.fixture(scope="module")
def engine():
    spec = load_mesh_spec("cpu-8")  # slots over data x fsdp (4), KV heads over tensor (2)
    mesh = make_mesh(spec)
    return Engine(Model(CFG).with_layout(mesh, spec.generate_rules), mesh, spec.generate_rules,
                  max_concurrent_decodes=64, max_prefill_length=8, max_decode_length=8,
                  compiler_options={"xla_backend_optimization_level": 0})


@pytest.fixture(scope="module")
def params(engine):
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.3).astype(s.dtype),
                        engine.model.abstract_params())
    return jax.device_put(host, engine.param_shardings)


def test_fit_slots_by_hand():
    need = lambda s: 100 + 10 * s  # bytes: a fixed part and 10 a slot
    assert memory.fit_slots(need, 10_000, 64, 4) == 64  # the configured slots fit
    assert memory.fit_slots(need, 400, 64, 4) == 28  # 100 + 10 * 28 = 380 <= 400 < 420
    assert memory.fit_slots(need, 400, 64, 1) == 30
    assert memory.fit_slots(need, 125, 64, 4) == 2  # under one multiple of 4: fewer
    assert memory.fit_slots(need, 105, 64, 4) == 0  # not even one slot


def test_decode_state_bytes_is_what_one_device_holds(engine):
    state = engine.init_decode_state(0)
    dev = engine.mesh.devices.flat[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
               if s.device == dev)
    assert engine.decode_state_bytes() == held
    # [L, S, K, C, H] x (k, v) float32, S over 4 devices, K over 2: per slot on a device
    kv = 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * 16 * CFG.head_dim * 4 // 2
    rows = sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(state)
               if x.ndim and x.shape[0] == 64)  # per-slot buffers: [S], [S, R]
    assert engine.decode_state_bytes(32) - engine.decode_state_bytes(16) == 16 // 4 * (
        kv + rows)


def test_slots_from_a_budget(engine, params):
    p = memory.params_bytes(params)
    per_slot = memory.slots_bytes(engine, 8) - memory.slots_bytes(engine, 4)  # 4 more slots
    base = memory.slots_bytes(engine, 4) - per_slot
    budget = base + 5 * per_slot + per_slot // 2  # room for 20 slots and a half multiple
    total = int((budget + p) / 0.5) + 1
    b = memory.budget_slots(engine, params, 0.5, DeviceMemory(total, 1 << 40, "test"))
    assert b.slots == 20 and b.need <= b.budget < memory.slots_bytes(engine, 24)
    assert b.params == p > 0
    # free memory binds too, whatever the share
    b = memory.budget_slots(engine, params, 1.0, DeviceMemory(1 << 40, budget, "test"))
    assert b.slots == 20
    # enough for all: the configured slots, the same engine
    same, b = memory.budgeted(engine, params, 0.5, DeviceMemory(1 << 40, 1 << 40, "test"))
    assert same is engine and b.slots == 64


def test_not_one_sequence_fits(engine, params):
    tiny_device = DeviceMemory(memory.params_bytes(params) * 2 + 1000, 1 << 40, "test")
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.gpu_memory_utilization:"
                       r" .* one sequence of 16 tokens needs"):
        memory.budget_slots(engine, params, 0.5, tiny_device)
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        memory.budget_slots(engine, params, 1.5)


def test_engine_honours_the_budget(engine, params):
    per_slot = memory.slots_bytes(engine, 8) - memory.slots_bytes(engine, 4)
    budget = memory.slots_bytes(engine, 8) + per_slot // 2
    small, b = memory.budgeted(engine, params, 1.0, DeviceMemory(1 << 40, budget, "test"))
    assert b.slots == small.max_concurrent_decodes == 8 and engine.max_concurrent_decodes == 64
    state = small.init_decode_state(0)
    assert state.cache.k.shape[1] == 8 == state.done.shape[0]
    ids = np.random.default_rng(1).integers(4, CFG.vocab_size, (6, 5)).astype(np.int32)
    sampling = SamplingParams(temperature=1.0, max_response_length=8, eos_ids=(3,))
    a = generate_sequences(small, params, ids, np.ones_like(ids), n=3, sampling=sampling,
                           rng=2)
    ref = generate_sequences(engine, params, ids, np.ones_like(ids), n=3, sampling=sampling,
                             rng=2)
    assert a.stats["rollout/generate_calls"] > ref.stats["rollout/generate_calls"]  # refills
    np.testing.assert_array_equal(a.responses, ref.responses)


def test_config_key_and_the_trainer(tmp_path, monkeypatch):
    from rlhf_jax.trainer import Trainer

    cfg = tiny(tmp_path, "grpo_tiny_cpu.yaml", mesh="single",
               **{"trainer.sft_warmup.enable": False,
                  "actor_rollout_ref.rollout.gpu_memory_utilization": 0.25})
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.25
    with pytest.raises(ConfigError, match="gpu_memory_utilization: must be in"):
        load_config(ROOT / "configs/grpo_tiny_cpu.yaml",
                    ["actor_rollout_ref.rollout.gpu_memory_utilization=0"])
    monkeypatch.setattr(memory, "device_memory",
                        lambda device=None: DeviceMemory(1 << 40, 1 << 40, "test"))
    monkeypatch.setattr(memory, "slots_bytes", lambda engine, s: s * MIB)  # 1 MiB a slot
    monkeypatch.setattr(memory, "params_bytes", lambda params: (1 << 38) - 10 * MIB)
    monkeypatch.setenv("RLHF_JAX_PRECOMPILE", "0")
    trainer = Trainer(cfg)  # 0.25 x 1 TiB - params leaves 10 MiB: 10 slots of 16
    assert trainer.engine.max_concurrent_decodes == trainer.rollout_budget.slots == 10
