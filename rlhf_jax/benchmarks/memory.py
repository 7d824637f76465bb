"""Memory benchmark: per-device bytes of the training state on the (2,2,2) `cpu-8` mesh.

The train layout shards parameters over fsdp x tensor (and replicates them over data), so
the ideal per-device share is total / (fsdp x tensor) = total / 4. For the WORKLOAD model:

- `memory.params_ratio_to_ideal`: largest per-device bytes of the actor's parameters / ideal.
- `memory.opt_state_ratio_to_ideal`: the same for its AdamW state (mu, nu, count).
- `memory.ratio_to_ideal`: actor params + opt state, critic params + opt state and the ref
  params together (the largest device over the ideal of the total). Target: within 5 %.
- `memory.generate_params_ratio_to_ideal`: the generate layout (replicated over fsdp by
  design), over total / tensor.
- `memory.opt_state_replicated_ratio_to_ideal`: the AdamW state as a bare `jax.jit(tx.init)`
  lays it out (XLA replicates the zeros), the layout `train_steps.init_state` had before it
  gave the moments their parameters' shardings: the reference that shows what is saved.

With fewer than 8 devices in this process it runs itself in a subprocess with 8 simulated
CPU devices (`python -m rlhf_jax.benchmarks.memory --in-process [--scale NAME]` prints the
JSON). At `scale="0.5b"` the roles are the Qwen2.5-0.5B architecture's (float32 state, as the
trainer holds it whatever the compute dtype).
"""

from __future__ import annotations

import collections
import json
import sys

import jax

from rlhf_jax import train_steps as ts
from rlhf_jax.benchmarks.common import get_scale, on_cpu_devices, scale_arg, workload_model_config
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model


def per_device_bytes(tree) -> dict:
    """Bytes each device holds of the arrays of `tree` (every addressable shard counted)."""
    out: collections.Counter = collections.Counter()
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device.id] += shard.data.nbytes
    return out


def total_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def measure(model_cfg=None, with_critic: bool = True) -> dict:
    """The figures on this process's devices (8 needed for the cpu-8 mesh).

    `with_critic=False` leaves the critic out of the totals (the smoke test: one init less).
    """
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    cfg = model_cfg or workload_model_config()
    shard = mesh.shape["fsdp"] * mesh.shape["tensor"]
    rules = spec.train_rules
    actor_model, critic_model = Model(cfg), Model(cfg, "value")
    tx = ts.make_optimizer(ts.OptimConfig(lr=1e-6, weight_decay=0.0))
    params = actor_model.init(jax.random.key(0), mesh, rules)
    actor = ts.init_state(params, tx)
    critic = ts.init_state(critic_model.init(jax.random.key(1), mesh, rules), tx) \
        if with_critic else None
    ref = jax.tree.map(lambda x: x.copy(), params)
    gen = jax.jit(lambda p: p, out_shardings=actor_model.shardings(mesh, spec.generate_rules))(
        params)

    def ratio(tree, ways):
        return max(per_device_bytes(tree).values()) / (total_bytes(tree) / ways)

    everything = (actor, critic, ref)
    replicated_opt = jax.jit(tx.init)(params)
    return {
        "memory.params_ratio_to_ideal": ratio(actor.params, shard),
        "memory.opt_state_ratio_to_ideal": ratio(actor.opt_state, shard),
        "memory.ratio_to_ideal": ratio(everything, shard),
        "memory.per_device_bytes": max(per_device_bytes(everything).values()),
        "memory.total_bytes": total_bytes(everything),
        "memory.opt_state_replicated_ratio_to_ideal": ratio(replicated_opt, shard),
        "memory.generate_params_ratio_to_ideal": ratio(gen, mesh.shape["tensor"]),
        "memory.mesh": "x".join(str(mesh.shape[a]) for a in mesh.axis_names),
        "memory.params": cfg.num_matmul_params,
    }


SMALL_MODEL = dict(model_type="qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                   max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=False)


def _model_cfg(small: bool, scale="workload"):
    from rlhf_jax.models import ModelConfig

    return ModelConfig.from_hf(SMALL_MODEL) if small else get_scale(scale).model_config()


def run(*, small: bool = False, scale="workload") -> dict:
    """The memory figures; in a subprocess with 8 CPU devices when this process has fewer.

    `small`: a tiny model and no critic instead of the WORKLOAD roles (the smoke test).
    """
    scale = get_scale(scale).name
    if jax.device_count() >= 8:
        return measure(_model_cfg(small, scale), with_critic=not small)
    return on_cpu_devices("rlhf_jax.benchmarks.memory", "--scale", scale,
                          *(["--small"] if small else []))


if __name__ == "__main__":
    if "--in-process" in sys.argv:
        small = "--small" in sys.argv
        name = scale_arg(sys.argv)
        print(json.dumps(measure(_model_cfg(small, name), with_critic=not small)))
    else:
        print(json.dumps(run(), indent=1, sort_keys=True))
