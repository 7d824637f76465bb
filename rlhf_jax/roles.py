"""Which role uses which model, layout and optimizer: actor, reference, critic, rollout.

The actor and critic train in the **train** layout; the reference scores in the train layout;
the rollout engine generates from the actor's parameters moved to the **generate** layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rlhf_jax import distributed, lora
from rlhf_jax.errors import ConfigError, ModelError
from rlhf_jax.mesh import MeshSpec, ensure_host_devices, load_mesh_spec, make_mesh
from rlhf_jax.models import Model, load_model_config
from rlhf_jax.models.hf_io import load_hf_params, save_hf


@dataclasses.dataclass
class Layouts:
    mesh: Any  # the train mesh
    spec: MeshSpec
    rollout_mesh: Any = None  # the one-step-off mode's rollout devices (None: `mesh`)
    # Several hosts in the one-step-off mode: `rollout_mesh` is this host's own devices,
    # which generate this host's share of each batch (`_split_hosts`).
    rollout_per_host: bool = False

    @property
    def gen_mesh(self):
        """The mesh the rollout engine generates on."""
        return self.mesh if self.rollout_mesh is None else self.rollout_mesh

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return dict(self.spec.train_rules).get("batch", ())

    @property
    def dp(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))


def build_mesh(cfg) -> Layouts:
    """The train mesh, and the one-step-off mode's rollout mesh when the preset has
    `rollout_sizes` (on the devices after the train mesh's; with several hosts, on each
    host's devices after its share of the train mesh: `_split_hosts`)."""
    m = cfg.mesh
    sizes = {k: getattr(m, k) for k in
             ("data", "fsdp", "tensor", "dcn_data", "dcn_fsdp", "dcn_tensor")}
    spec = load_mesh_spec(m.preset, sizes)
    if spec.rollout_sizes is None:
        layouts = Layouts(make_mesh(spec), spec)
        # After the mesh: asking for the process count starts the backend, which must come
        # after the simulated CPU device count is set.
        if not cfg.actor_rollout_ref.hybrid_engine and jax.process_count() > 1:
            raise ConfigError(f"actor_rollout_ref.hybrid_engine: false on several hosts "
                              f"needs a mesh preset with rollout_sizes (got {spec.name})")
        return layouts
    if cfg.actor_rollout_ref.hybrid_engine:
        raise ConfigError(f"mesh {spec.name} has rollout_sizes, devices of their own for the "
                          "rollout: set actor_rollout_ref.hybrid_engine=false")
    if -1 in spec.sizes or -1 in spec.rollout_sizes or spec.dcn_sizes != (1, 1, 1):
        raise ConfigError(f"mesh {spec.name}: with rollout_sizes, give every size (no -1) "
                          "and no dcn_sizes")
    n_train, n_roll = math.prod(spec.sizes), math.prod(spec.rollout_sizes)
    ensure_host_devices(n_train + n_roll)
    devices = jax.devices()
    if len(devices) < n_train + n_roll:
        raise ConfigError(f"mesh {spec.name} needs {n_train} train + {n_roll} rollout "
                          f"devices, {len(devices)} are available")
    rollout = dataclasses.replace(spec, sizes=spec.rollout_sizes)
    if jax.process_count() > 1:
        return _split_hosts(spec, rollout)
    return Layouts(make_mesh(spec, devices[:n_train]), spec,
                   make_mesh(rollout, devices[n_train:n_train + n_roll]))


def _split_hosts(spec: MeshSpec, rollout: MeshSpec) -> Layouts:
    """The one-step-off split on several hosts: each host gives its first
    train devices / hosts devices to the one train mesh (spanning every host, data-parallel
    across them), and the next rollout devices / hosts to a rollout mesh of its own, of
    `rollout_sizes` with the data axis divided by the host count. Each host then generates
    its share of the batch's prompts on its own devices, so the rollout thread runs no
    collective across hosts (those of the training thread, interleaved with them in a
    different order on each host, would mismatch); the trained weights reach every host's
    rollout devices through one all-gather on the train mesh, at a fixed point of the step
    (`distributed.host_local_copy`)."""
    hosts, n_train = jax.process_count(), math.prod(spec.sizes)
    data, fsdp, tensor = spec.rollout_sizes
    if n_train % hosts or data % hosts:
        raise ConfigError(f"mesh {spec.name} on {hosts} hosts: the train devices ({n_train}) "
                          f"and the rollout's data size ({data}) must be multiples of the "
                          "host count (each host takes an equal share of both)")
    per_train, local = n_train // hosts, jax.local_devices()
    mine = dataclasses.replace(rollout, sizes=(data // hosts, fsdp, tensor))
    per_roll = math.prod(mine.sizes)
    if len(local) < per_train + per_roll:
        raise ConfigError(f"mesh {spec.name} on {hosts} hosts needs {per_train} train + "
                          f"{per_roll} rollout devices a host, this one has {len(local)}")
    by_host: dict[int, list] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_host.setdefault(d.process_index, []).append(d)
    train = [d for h in sorted(by_host) for d in by_host[h][:per_train]]
    ours = sorted(local, key=lambda d: d.id)[per_train:per_train + per_roll]
    return Layouts(make_mesh(spec, train), spec, make_mesh(mine, ours), rollout_per_host=True)


def load_or_init(model: Model, path: str | Path | None, layouts: Layouts, rng) -> Any:
    """Parameters in the train layout from an HF directory with weights, else random init;
    a LoRA model's base so, with fresh adapters (B = 0) attached."""
    rules = layouts.spec.train_rules
    if model.cfg.lora is not None:
        base = load_or_init(lora.base_model(model), path, layouts, rng)
        return lora.init_adapters(model, base, layouts.mesh, rules, jax.random.fold_in(rng, 7))
    if path is not None and any(Path(path).glob("*.safetensors")):
        return load_hf_params(model, path, model.shardings(layouts.mesh, rules))
    return model.init(rng, layouts.mesh, rules)


def train_state(model: Model, params, optim) -> tuple[Any, Any]:
    """A role's fresh `TrainState` (AdamW on `optim`, a `train_steps.OptimConfig`) and what
    its update trains (`lora.trainable`: everything, or the adapters on a frozen base)."""
    from rlhf_jax import train_steps as ts

    trainable = lora.trainable(model)
    return ts.init_state(params, ts.make_optimizer(optim), trainable), trainable


def weight_sync(actor: Model, layouts: Layouts) -> lora.WeightSync:
    """update_weights of the actor `actor`: its train-layout parameters to the engine's
    generate layout (with the rollout on each host's own devices, through a host-local copy
    of the whole weights first: `distributed.host_local_copy`)."""
    gather = functools.partial(distributed.host_local_copy, mesh=layouts.mesh) \
        if layouts.rollout_per_host else None
    shardings = actor.shardings(layouts.gen_mesh, layouts.spec.generate_rules)
    return lora.WeightSync(actor, shardings, gather)


def engine(cfg, model: Model, layouts: Layouts, gen_params):
    """The rollout engine of the actor `model` in the generate layout, with as many slots
    as its memory budget allows (`rollout.memory.budgeted`): `(engine, budget)`."""
    from rlhf_jax.rollout import Engine, memory

    ro, d, rules = cfg.actor_rollout_ref.rollout, cfg.data, layouts.spec.generate_rules
    eng = Engine(model.with_layout(layouts.gen_mesh, rules), layouts.gen_mesh, rules,
                 max_concurrent_decodes=ro.max_concurrent_decodes,
                 max_prefill_length=d.max_prompt_length, max_decode_length=d.max_response_length,
                 prefill_buckets=ro.prefill_buckets,
                 compact_min_length=ro.compact_slots_min_response_length)
    return memory.budgeted(eng, gen_params, ro.gpu_memory_utilization)


def ensure_model_weights(path: str | Path, hf_config: dict, seed: int) -> None:
    """Writes a random-init HF checkpoint at `path` unless one is there (synthetic tasks)."""
    path = Path(path)
    if any(path.glob("*.safetensors")):
        return
    from rlhf_jax.models import ModelConfig

    model = Model(ModelConfig.from_hf(hf_config))
    mesh = make_mesh(load_mesh_spec("single"), jax.local_devices())  # this host's own device
    params = model.init(jax.random.key(seed), mesh, load_mesh_spec("single").train_rules)
    save_hf(model, params, path)


def actor_model(cfg) -> Model:
    m = cfg.actor_rollout_ref.model
    model_cfg = load_model_config(m.path, dict(m.override_config))
    return Model(
        dataclasses.replace(model_cfg, lora=lora.spec_of(m)), "lm", m.compute_dtype,
        m.param_dtype, m.enable_gradient_checkpointing, m.scan_layers,
    )


def critic_model(cfg) -> tuple[Model, str]:
    """The value model and the directory its weights come from (the actor's by default)."""
    m = cfg.actor_rollout_ref.model
    c = cfg.critic.model
    path = c.path or m.path
    if not Path(path, "config.json").is_file():
        raise ModelError(f"critic.model.path {path!r} has no config.json")
    overrides = dict(c.override_config) if c.path else dict(m.override_config)
    model_cfg = dataclasses.replace(load_model_config(path, overrides), lora=lora.spec_of(c))
    model = Model(model_cfg, "value", m.compute_dtype, m.param_dtype,
                  c.enable_gradient_checkpointing, c.scan_layers)
    return model, path
