"""Rollout benchmark: decode with the KV cache against full recompute, and resharding.

- `rollout.decode_tokens_per_s`: new tokens per second of `generate_sequences` (prefill and
  decode, KV cache) on the WORKLOAD model, 32 prompts of 64 tokens, 64 new tokens each.
- `rollout.nocache_tokens_per_s`: the same tokens drawn by recomputing the full forward over
  the whole [32, 128] buffer at every step (one jitted loop, no cache); `cache_speedup` is
  the ratio, measured in the same run.
- `reshard.seconds`: the WORKLOAD parameters train layout -> generate layout with `reshard`;
  `reshard.copy_seconds`: a plain on-device copy of the same arrays (same sharding, one jit);
  `ratio_to_copy` = seconds / copy_seconds. With one device both layouts coincide, so the
  reshard part runs in a subprocess with 8 simulated CPU devices (`reshard.devices` says).

`python -m rlhf_jax.benchmarks.rollout --reshard-only` prints the reshard part as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.benchmarks.common import (
    WORKLOAD_PAD_ID,
    timed,
    workload_model_config,
    workload_prompts,
)
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model
from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences, reshard
from rlhf_jax.rollout.sampling import request_keys, sample_tokens


def workload_sampling(new_tokens: int) -> SamplingParams:
    """Plain ancestral sampling at temperature 1, EOS disabled (WORKLOAD.md)."""
    return SamplingParams(temperature=1.0, max_response_length=new_tokens,
                          eos_ids=(WORKLOAD_PAD_ID,), pad_id=WORKLOAD_PAD_ID)


def make_engine(model: Model, mesh, rules, *, batch: int, prompt_len: int,
                new_tokens: int) -> Engine:
    """An engine with one slot per sequence and one prefill bucket."""
    return Engine(model, mesh, rules, max_concurrent_decodes=batch, max_prefill_length=prompt_len,
                  max_decode_length=new_tokens, prefill_buckets=(prompt_len,),
                  sampling=workload_sampling(new_tokens))


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


def decode_benchmark(*, batch: int = 32, prompt_len: int = 64, new_tokens: int = 64,
                     warmup: int = 1, repeats: int = 3, mesh_name: str = "single") -> dict:
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    model = Model(workload_model_config())
    params = model.init(jax.random.key(0), mesh, spec.generate_rules)
    engine = make_engine(model, mesh, spec.generate_rules, batch=batch, prompt_len=prompt_len,
                         new_tokens=new_tokens)
    prompts = workload_prompts(warmup + repeats, batch, prompt_len)
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


def _reshard_mesh_spec(n: int):
    spec = load_mesh_spec("cpu-8")
    if n == 8:
        return spec
    tensor = 2 if n % 2 == 0 else 1
    return load_mesh_spec("cpu-8", {"data": 1, "fsdp": n // tensor, "tensor": tensor})


def reshard_benchmark(*, warmup: int = 2, repeats: int = 10) -> dict:
    """Train -> generate layout of the WORKLOAD parameters against a same-layout copy."""
    n = jax.device_count()
    spec = _reshard_mesh_spec(n)
    mesh = make_mesh(spec)
    model = Model(workload_model_config())
    train = model.shardings(mesh, spec.train_rules)
    gen = model.shardings(mesh, spec.generate_rules)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    t_reshard = timed(lambda: reshard(params, gen), warmup=warmup, repeats=repeats)
    copy = jax.jit(functools.partial(jax.tree.map, jnp.copy), out_shardings=train)
    t_copy = timed(lambda: copy(params), warmup=warmup, repeats=repeats)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {
        "reshard.seconds": t_reshard.median,
        "reshard.copy_seconds": t_copy.median,
        "reshard.ratio_to_copy": t_reshard.median / t_copy.median,
        "reshard.bytes": nbytes,
        "reshard.devices": n,
        "reshard.mesh": "x".join(str(mesh.shape[a]) for a in mesh.axis_names),
    }


def _reshard_in_subprocess(devices: int = 8) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    out = subprocess.run([sys.executable, "-m", "rlhf_jax.benchmarks.rollout", "--reshard-only"],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(*, small: bool = False, batch: int = 32, prompt_len: int = 64, new_tokens: int = 64,
        repeats: int = 3, reshard_repeats: int = 10) -> dict:
    """The rollout and reshard figures as one flat dict (`small`: a quick smoke-test size)."""
    if small:
        batch, prompt_len, new_tokens, repeats, reshard_repeats = 4, 16, 8, 1, 2
    out = decode_benchmark(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                           repeats=repeats)
    del reshard_repeats
    from rlhf_jax.benchmarks import reshard as reshard_bench  # the reshard figures, as `reshard`

    out.update(reshard_bench.run(small=small))
    return out


if __name__ == "__main__":
    if "--reshard-only" in sys.argv:
        print(json.dumps(reshard_benchmark()))
    else:
        print(json.dumps(run(), indent=1))
