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
