"""The host-side pieces of a multi-host step, computed on the global (2,2,2) mesh.

`compute(data_dir)` runs in the test process (one process, 8 devices) and, through
`python tests/multihost_check.py DATA_DIR OUT` with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES
/ JAX_PROCESS_ID set, in each of two processes of 4 devices; tests/test_distributed.py
checks that every process gets what the single process gets. (The rollout's host loop
across processes is covered end to end by the slow two-host PPO test.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def compute(data_dir: Path) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from rlhf_jax import batching, distributed
    from rlhf_jax.data import PromptDataset, PromptLoader
    from rlhf_jax.mesh import load_mesh_spec, make_mesh
    from rlhf_jax.tokenizer import load_tokenizer

    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    out: dict[str, np.ndarray] = {"devices": np.int64(jax.device_count())}
    # Each process reads its shard; the gathered batch is the single-process batch.
    tokenizer = load_tokenizer(str(data_dir / "model"))
    dataset = PromptDataset([str(data_dir / "train.parquet")], tokenizer, max_prompt_length=16)
    loader = distributed.gathered(PromptLoader(
        dataset, 8, shuffle=True, seed=3, shard_index=jax.process_index(),
        shard_count=jax.process_count()))
    first, second = next(loader), next(loader)
    out["prompt_ids"] = np.concatenate([first.input_ids, second.input_ids])
    out["prompt_index"] = np.asarray(first.index + second.index)
    out["ground_truth"] = np.asarray([str(g) for g in first.ground_truth + second.ground_truth])
    # Host arrays onto the batch layout and back; a reduction over all hosts' shards.
    x = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    dev = batching.put(x, mesh, dict(spec.train_rules)["batch"], lead=0)
    out["roundtrip"] = batching.fetch(dev)
    out["sum"] = batching.fetch(jax.jit(lambda a: jnp.sum(a * a))(dev))
    rows = jax.jit(lambda a: a * 2.0 + 1.0)(dev)  # stays sharded over both hosts' devices
    out["rows_sharded_over_hosts"] = np.bool_(not rows.is_fully_addressable)
    out["rows"] = batching.fetch(rows)
    out["objects"] = np.asarray(json.dumps(distributed.allgather_objects(
        {"process": jax.process_index(), "text": "x" * (3 + jax.process_index())})))
    out.update(one_step_off_split(x))
    return out


def one_step_off_split(x: np.ndarray) -> dict[str, np.ndarray]:
    """The one-step-off mode's 4 + 4 split (meshes/cpu-8-async.yaml): arrays from the train
    mesh to the rollout devices, and the hosts' shares of a rollout joined."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rlhf_jax import async_rollout, batching, distributed, roles
    from rlhf_jax.config import load_config
    from rlhf_jax.experience import Experience
    from rlhf_jax.forward import Sequences
    from rlhf_jax.paths import CONFIGS_DIR

    cfg = load_config(CONFIGS_DIR / "ppo_tiny_cpu.yaml",
                      ["mesh=cpu-8-async", "actor_rollout_ref.hybrid_engine=false"])
    lay = roles.build_mesh(cfg)
    me = jax.process_index()
    out = {
        "split": np.asarray(json.dumps({
            "per_host": lay.rollout_per_host,
            "train_devices_by_process": [sum(d.process_index == p for d in lay.mesh.devices.flat)
                                         for p in range(jax.process_count())],
            "train_mesh": dict(lay.mesh.shape), "rollout_mesh": dict(lay.rollout_mesh.shape),
            "rollout_devices_mine": all(d.process_index == me
                                        for d in lay.rollout_mesh.devices.flat)})),
    }
    # train layout -> whole on this host -> the rollout's layout on its devices
    train = batching.put(x, lay.mesh, lay.batch_axes, lead=0)
    local = distributed.host_local_copy({"w": train}, lay.mesh) if lay.rollout_per_host \
        else {"w": train}
    gen = jax.device_put(local["w"], NamedSharding(lay.rollout_mesh, P(None, "tensor")))
    out["on_rollout_devices"] = np.asarray(gen)
    # a rollout of 4 prompts x 2 samples, made in shares (one per host) and joined
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (8, 5)).astype(np.int32)
    whole = Experience(Sequences.padded(ids[:, :3], np.ones((8, 3), np.int32), ids[:, 3:],
                                        np.ones((8, 2), np.int32)),
                       np.repeat(np.arange(4), 2), rng.normal(size=(8, 2)).astype(np.float32),
                       scores=rng.normal(size=8).astype(np.float32), times={"gen": 1.0 + me})
    lo, hi = async_rollout._share(4)
    share = whole._replace(
        seqs=jax.tree.map(lambda a: a[2 * lo:2 * hi], whole.seqs),
        index=whole.index[2 * lo:2 * hi] - lo, rollout_log_probs=whole.rollout_log_probs[
            2 * lo:2 * hi], scores=whole.scores[2 * lo:2 * hi])
    joined, busy = async_rollout._joined(distributed.allgather_objects((share, 0.5 + me)))
    for name in ("index", "rollout_log_probs", "scores"):
        out[f"joined_{name}"] = getattr(joined, name)
    for name, value in joined.seqs._asdict().items():
        out[f"joined_seqs_{name}"] = value
    out["joined_slowest"] = np.asarray([busy, joined.times["gen"]])
    return out


def main(data_dir: str, out: str) -> int:
    from rlhf_jax import distributed

    distributed.initialize(cpu_devices=4)
    import jax

    result = compute(Path(data_dir))
    result["process"] = np.int64(jax.process_index())
    np.savez(f"{out}.{jax.process_index()}.npz", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
