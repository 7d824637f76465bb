"""Reshard benchmark: the WORKLOAD parameters train layout -> generate layout on the cpu-8 mesh.

The train layout shards the parameters over fsdp x tensor, the generate layout over tensor
only (replicated over fsdp), so every device ends up holding twice the bytes it held. The
reference is the least any move to the generate layout can do: write those bytes once, on
the same devices. Both are measured in the same run:

- `reshard.seconds`: `rlhf_jax.rollout.reshard(params, generate_shardings)`, the call the
  trainer makes after every actor update.
- `reshard.copy_seconds`: a jitted copy of the generate-layout parameters onto the same
  shardings (each device copies its own shards: the same bytes on the same devices).
  The three are timed in turns (`common.interleaved`), under the same load.
- `reshard.ratio_to_copy` = seconds / copy_seconds. Target: <= 3.
- `reshard.collective_seconds`: the same move as one jitted identity with `out_shardings`
  (XLA's all-gathers), which `reshard` uses off CPU; for comparison.

With fewer than 8 devices in this process it runs itself in a subprocess with 8 simulated
CPU devices (`python -m rlhf_jax.benchmarks.reshard --in-process [--scale NAME]` prints the
JSON). At `scale="0.5b"` the parameters are the Qwen2.5-0.5B architecture's (float32, 10
repeats).
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp

from rlhf_jax.benchmarks.common import get_scale, interleaved, on_cpu_devices, scale_arg
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.rollout import reshard

SMALL_MODEL = dict(model_type="qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                   max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=False)


def device_bytes(tree) -> int:
    """Bytes of every addressable shard of `tree` (replicas counted once per device)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


REPEATS = {"workload": 30, "0.5b": 10}


def measure(small: bool = False, scale="workload", warmup: int = 2,
            repeats: int | None = None) -> dict:
    """The figures on this process's devices (8 needed for the cpu-8 mesh)."""
    scale = get_scale(scale)
    repeats = repeats or REPEATS[scale.name]
    if small:
        warmup, repeats = 1, 2
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    model = Model(ModelConfig.from_hf(SMALL_MODEL) if small else scale.model_config())
    gen = model.shardings(mesh, spec.generate_rules)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    out = reshard(params, gen)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(gen), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    copy = jax.jit(functools.partial(jax.tree.map, jnp.copy), out_shardings=gen)
    collective = jax.jit(lambda x: x, out_shardings=gen)
    t_reshard, t_copy, t_collective = interleaved(
        {"reshard": lambda: reshard(params, gen), "copy": lambda: copy(out),
         "collective": lambda: collective(params)}, warmup=warmup, repeats=repeats)
    return {
        "reshard.seconds": t_reshard.median,
        "reshard.copy_seconds": t_copy.median,
        "reshard.ratio_to_copy": t_reshard.median / t_copy.median,
        "reshard.collective_seconds": t_collective.median,
        "reshard.collective_ratio_to_copy": t_collective.median / t_copy.median,
        "reshard.bytes_written": device_bytes(out),
        "reshard.param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
        "reshard.devices": jax.device_count(),
        "reshard.mesh": "x".join(str(mesh.shape[a]) for a in mesh.axis_names),
        "reshard.scale": scale.name,
    }


def run(*, small: bool = False, scale="workload") -> dict:
    """The reshard figures; in a subprocess with 8 CPU devices when this process has fewer."""
    scale = get_scale(scale).name
    if jax.device_count() >= 8:
        return measure(small, scale)
    return on_cpu_devices("rlhf_jax.benchmarks.reshard", "--scale", scale,
                          *(["--small"] if small else []))


if __name__ == "__main__":
    if "--in-process" in sys.argv:
        name = scale_arg(sys.argv)
        print(json.dumps(measure("--small" in sys.argv, name)))
    else:
        print(json.dumps(run(), indent=1, sort_keys=True))
