"""Rollout benchmark: decode with the KV cache against full recompute.

- `rollout.decode_tokens_per_s`: new tokens per second of `generate_sequences` (prefill and
  decode, KV cache) on the WORKLOAD model, 32 prompts of 64 tokens, 64 new tokens each.
- `rollout.nocache_tokens_per_s`: the same tokens drawn by recomputing the full forward over
  the whole [32, 128] buffer at every step (one jitted loop, no cache); `cache_speedup` is
  the ratio, measured in the same run.

At `scale="0.5b"`: the Qwen2.5-0.5B architecture with bfloat16 compute, 64 prompts of 128
tokens, 128 new tokens each. The train -> generate reshard has its own benchmark, `reshard`.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.benchmarks.common import (
    SMALL_MODEL,
    eos_free_sampling,
    get_scale,
    timed,
    workload_prompts,
)
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences
from rlhf_jax.rollout.sampling import request_keys, sample_tokens


def make_engine(model: Model, mesh, rules, *, batch: int, prompt_len: int,
                new_tokens: int) -> Engine:
    """An engine with one slot per sequence and one prefill bucket."""
    return Engine(model, mesh, rules, max_concurrent_decodes=batch, max_prefill_length=prompt_len,
                  max_decode_length=new_tokens, prefill_buckets=(prompt_len,),
                  sampling=eos_free_sampling(model.cfg, new_tokens))


def generate(engine: Engine, params, prompts: np.ndarray, rng) -> Any:
    """One rollout of [B, P] prompts with all new tokens in one generate call (for reuse)."""
    mask = np.ones_like(prompts)
    return generate_sequences(engine, params, prompts, mask, rng=rng,
                              steps_per_call=engine.max_decode_length,
                              max_prefill_batch=engine.max_concurrent_decodes)


def nocache_generate_fn(model: Model, sampling: SamplingParams, prompt_len: int,
                        new_tokens: int):
    """A jitted loop that draws `new_tokens` tokens by re-running the full forward each step.

    Same sampling rule and per-request keys as the engine, so the tokens agree with it up to
    floating-point ties.
    """

    def run(params, prompts_bp, rng):
        b = prompts_bp.shape[0]
        width = prompt_len + new_tokens
        buf = jnp.zeros((b, width), jnp.int32).at[:, :prompt_len].set(prompts_bp)
        ids_b = jnp.arange(b, dtype=jnp.int32)

        def step(t, buf):
            mask = (jnp.arange(width)[None] < prompt_len + t).astype(jnp.int32)
            logits = model.forward(params, buf, jnp.broadcast_to(mask, buf.shape))
            keys = request_keys(rng, ids_b, jnp.full((b,), t, jnp.int32))
            tok, _, _ = sample_tokens(logits[:, prompt_len + t - 1], keys, sampling)
            return buf.at[:, prompt_len + t].set(tok)

        buf = jax.lax.fori_loop(0, new_tokens, step, buf)
        return buf[:, prompt_len:]

    return jax.jit(run)


def decode_benchmark(model: Model, *, batch: int, prompt_len: int, new_tokens: int,
                     warmup: int = 1, repeats: int = 3, mesh_name: str = "single") -> dict:
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    params = model.init(jax.random.key(0), mesh, spec.generate_rules)
    engine = make_engine(model, mesh, spec.generate_rules, batch=batch, prompt_len=prompt_len,
                         new_tokens=new_tokens)
    prompts = workload_prompts(warmup + repeats, batch, prompt_len) % model.cfg.vocab_size
    rng = jax.random.key(1)
    it = iter(range(len(prompts)))
    outs = []

    def cached():
        out = generate(engine, params, prompts[next(it)], rng)
        outs.append(out)
        return out.responses

    t_cache = timed(cached, warmup=warmup, repeats=repeats)
    nocache = nocache_generate_fn(model, engine.default_sampling, prompt_len, new_tokens)
    it2 = iter(range(len(prompts)))
    last = {}

    def uncached():
        i = next(it2)
        last[i] = nocache(params, prompts[i], rng)
        return last[i]

    t_nocache = timed(uncached, warmup=warmup, repeats=repeats)
    i = len(prompts) - 1
    match = float(np.mean(np.asarray(last[i]) == outs[-1].responses))
    tokens = batch * new_tokens
    stats = outs[-1].stats
    return {
        "rollout.decode_tokens_per_s": tokens / t_cache.median,
        "rollout.nocache_tokens_per_s": tokens / t_nocache.median,
        "rollout.cache_speedup": t_nocache.median / t_cache.median,
        "rollout.seconds": t_cache.median,
        "rollout.nocache_seconds": t_nocache.median,
        "rollout.nocache_token_agreement": match,
        "rollout.generate_calls": stats["rollout/generate_calls"],
        "rollout.decode_steps": stats["rollout/decode_steps"],
        "rollout.batch": batch, "rollout.prompt_len": prompt_len,
        "rollout.new_tokens": new_tokens, "rollout.mesh": mesh_name,
    }


ALL_KW = dict(repeats=1)  # what `scripts/bench.py all` runs (its 10 minutes)
SIZES = {  # per scale: prompts, prompt length, new tokens each, measured repeats
    "workload": dict(batch=32, prompt_len=64, new_tokens=64, repeats=3),
    "0.5b": dict(batch=64, prompt_len=128, new_tokens=128, repeats=3),
}


def run(*, small: bool = False, scale="workload", **sizes) -> dict:
    """The rollout figures as one flat dict (`small`: a quick smoke-test size)."""
    scale = get_scale(scale)
    kw = {**SIZES[scale.name], **sizes}
    cfg = scale.model_config()
    if small:
        kw, cfg = dict(batch=4, prompt_len=16, new_tokens=8, repeats=1), \
            ModelConfig.from_hf(SMALL_MODEL)
    out = decode_benchmark(Model(cfg, dtype=scale.dtype), **kw)
    out.update({"rollout.scale": scale.name, "rollout.dtype": scale.dtype})
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(small="--small" in sys.argv), indent=1))
