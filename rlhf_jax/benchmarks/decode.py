"""Decode benchmark: KV-cache decode steps of the rollout engine against a memory bound.

On the WORKLOAD model (`single` mesh), 32 slots each holding a prefilled 64-token prompt
and its first sampled token, `Engine.generate_steps` draws the other 63 tokens of every
response in one call (EOS disabled). Only that call is timed (prefill and insert are not).

A decode step must at least read every parameter and the whole KV cache once, so the bound
on a step is the time to move those bytes: `decode.copy_seconds`, a jitted copy of exactly
the generate-layout parameters and the cache, measured right after each timed decode call
(best of 3 copies; its bandwidth, bytes / seconds, is `decode.copy_bytes_per_s`).

- `decode.tokens_per_s`: new tokens / seconds of the generate call.
- `decode.step_seconds`: seconds per decode step (all 32 slots).
- `decode.bound_tokens_per_s` = slots / copy_seconds.
- `decode.ratio_to_bound` = tokens_per_s / bound_tokens_per_s (= copy_seconds /
  step_seconds). Target: >= 0.3.

At `scale="0.5b"`: the Qwen2.5-0.5B architecture, bfloat16 compute and cache (float32
parameters, as the trainer holds them), 64 slots of 128-token prompts, 128 new tokens each.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.benchmarks.common import (
    SMALL_MODEL,
    Timing,
    eos_free_sampling,
    get_scale,
    timed,
    workload_prompts,
)
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.rollout import Engine


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


SIZES = {  # per scale: slots, prompt length, new tokens per slot, warm-up, repeats
    "workload": dict(batch=32, prompt_len=64, new_tokens=64, warmup=1, repeats=3),
    "0.5b": dict(batch=64, prompt_len=128, new_tokens=128, warmup=1, repeats=3),
}


def run(*, small: bool = False, scale="workload", **sizes) -> dict:
    """Decode tokens/s and the copy bound (`small`: a tiny model, for the smoke test).

    `sizes` override the scale's `SIZES` entry."""
    scale = get_scale(scale)
    kw = {**SIZES[scale.name], **sizes}
    cfg, compiler_options = scale.model_config(), None
    if small:
        from rlhf_jax.benchmarks.mfu import FAST_COMPILE

        cfg, compiler_options = ModelConfig.from_hf(SMALL_MODEL), FAST_COMPILE
        kw = dict(batch=4, prompt_len=8, new_tokens=8, warmup=1, repeats=1)
    batch, prompt_len, new_tokens = kw["batch"], kw["prompt_len"], kw["new_tokens"]
    warmup, repeats = kw["warmup"], kw["repeats"]
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec)
    rules = spec.generate_rules
    model = Model(cfg, dtype=scale.dtype).with_layout(mesh, rules)
    params = model.init(jax.random.key(0), mesh, rules)
    sampling = eos_free_sampling(cfg, new_tokens)
    engine = Engine(model, mesh, rules, max_concurrent_decodes=batch,
                    max_prefill_length=prompt_len, max_decode_length=new_tokens,
                    prefill_buckets=(prompt_len,), sampling=sampling,
                    compiler_options=compiler_options)
    prompts = workload_prompts(warmup + repeats, batch, prompt_len) % cfg.vocab_size
    steps = new_tokens - 1  # prefill samples the first token
    cache = engine.init_decode_state().cache
    copy = jax.jit(functools.partial(jax.tree.map, jnp.copy))
    decode_times, copy_times, results = [], [], []
    for i in range(warmup + repeats):
        prefix, _ = engine.prefill(params=params, padded_tokens=prompts[i],
                                   true_length=prompt_len)
        state = engine.bulk_insert(prefix, engine.init_decode_state(jax.random.key(1)),
                                   slots=list(range(batch)), rows=list(range(batch)))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, res = jax.block_until_ready(engine.generate_steps(params, state, steps))
        dt = time.perf_counter() - t0
        # the reference right after, under the same load: best of a few copies
        ct = timed(lambda: copy((params, cache)), warmup=1 if i == 0 else 0, repeats=3).min
        if i >= warmup:
            decode_times.append(dt)
            copy_times.append(ct)
            results.append(res)
    t, t_copy = Timing(tuple(decode_times)), Timing(tuple(copy_times))
    tokens = int(np.asarray(results[-1].valid).sum())
    assert tokens == batch * steps, (tokens, batch * steps)  # EOS disabled: every step counts
    nbytes = tree_bytes(params) + tree_bytes(cache)
    step_seconds = t.median / steps
    return {
        "decode.tokens_per_s": tokens / t.median,
        "decode.seconds": t.median,
        "decode.step_seconds": step_seconds,
        "decode.copy_seconds": t_copy.median,
        "decode.copy_bytes": nbytes,
        "decode.param_bytes": tree_bytes(params),
        "decode.cache_bytes": tree_bytes(cache),
        "decode.copy_bytes_per_s": nbytes / t_copy.median,
        "decode.bound_tokens_per_s": batch / t_copy.median,
        "decode.ratio_to_bound": t_copy.median / step_seconds,
        "decode.slots": batch,
        "decode.steps": steps,
        "decode.cache_length": engine.cache_length,
        "decode.scale": scale.name,
        "decode.dtype": scale.dtype,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, sort_keys=True))
