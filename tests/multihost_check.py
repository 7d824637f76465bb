"""The pieces of a multi-host step, computed on the global (2,2,2) mesh.

`compute(data_dir)` runs in the test process (one process, 8 devices) and, through
`python tests/multihost_check.py DATA_DIR OUT` with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES
/ JAX_PROCESS_ID set, in each of two processes of 4 devices; tests/test_distributed.py
checks that every process gets what the single process gets.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def compute(data_dir: Path) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from rlhf_jax import batching, distributed
    from rlhf_jax.data import PromptDataset, PromptLoader
    from rlhf_jax.mesh import load_mesh_spec, make_mesh
    from rlhf_jax.models import Model, ModelConfig
    from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences
    from rlhf_jax.tokenizer import load_tokenizer
    from rlhf_jax.trainer import SYNTHETIC_MODELS

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
    # Host arrays onto the batch layout and back; a reduction over all hosts' shards.
    x = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    dev = batching.put(x, mesh, dict(spec.train_rules)["batch"], lead=0)
    out["roundtrip"] = batching.fetch(dev)
    out["sum"] = batching.fetch(jax.jit(lambda a: jnp.sum(a * a))(dev))
    # A rollout: 16 requests through 4 slots, so the host loop refills slots many times.
    model = Model(ModelConfig.from_hf(SYNTHETIC_MODELS["addition"]))
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    rules = spec.generate_rules
    engine = Engine(model.with_layout(mesh, rules), mesh, rules, max_concurrent_decodes=4,
                    max_prefill_length=16, max_decode_length=6)
    sampling = SamplingParams(temperature=1.0, max_response_length=6,
                              eos_ids=tuple(tokenizer.eos_token_ids),
                              pad_id=tokenizer.pad_token_id)
    ro = generate_sequences(engine, params, first.input_ids, first.attention_mask, n=2,
                            sampling=sampling, rng=7, steps_per_call=2)
    out["responses"] = ro.responses
    out["response_mask"] = ro.response_mask
    out["log_probs"] = ro.rollout_log_probs
    out["generate_calls"] = np.int64(ro.stats["rollout/generate_calls"])
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
