"""Chunked LM head benchmark: the actor update with `lm_head_chunk_size` (models/head.py)
against the same update through the full logits, on this process's first device, float32.

The model is the Qwen2.5-0.5B architecture (vocabulary 151,936, width 896, tied embedding)
with 2 layers; one micro-batch of 4 rows x 2,048 predicted tokens (rows of 2,049), so that
the full path's logits are a [4 x 2048, 151936] float32 array (~5 GB):

- `chunked_head.temp_bytes_ratio`: the compiled update's temporary bytes
  (`memory_analysis().temp_size_in_bytes`), chunked over full logits. Target <= 0.25.
- `chunked_head.time_ratio`: median seconds of the update, chunked over full, the two run in
  turns. Target <= 1.1. Where the host's memory cannot hold the full update at 4 rows, both
  are timed on fewer rows (halved until it fits; `chunked_head.time_rows`), and so is the
  log-prob comparison. `chunked_head.cpu_time_ratio`: the same with the process's CPU
  seconds, which a machine shared with other jobs disturbs less than the wall clock.
- `chunked_head.temp_bytes.vocab128`: the same update's temporaries with a 128-token
  vocabulary, i.e. what is not the head's (the 2 layers' dense attention at 2,049 positions):
  a floor that no head can go below.
- `chunked_head.logprob_max_abs_diff`: the largest difference of the log-prob pass's
  results (`log_probs_step`), chunked vs full. Target <= 1e-5.

`chunk` is `lm_head_chunk_size` (None: the automatic choice, which is what the trainer runs).
`small=True`: a tiny head and batch (the smoke test). `python -m
rlhf_jax.benchmarks.chunked_head [--chunk N] [--repeats N] [--time-rows N]` prints the JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import train_steps as ts
from rlhf_jax.benchmarks.common import QWEN2_5_0_5B, interleaved
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig, head

ROWS, TOKENS, LAYERS = 4, 2048, 2
SMALL = dict(rows=2, tokens=64, vocab=8192, hidden=64, layers=1)


def bench_config(small: bool = False) -> ModelConfig:
    """Qwen2.5-0.5B with LAYERS layers (small: a narrow one-layer model)."""
    if not small:
        return ModelConfig.from_hf(dict(QWEN2_5_0_5B, num_hidden_layers=LAYERS))
    s = SMALL
    return ModelConfig.from_hf(dict(QWEN2_5_0_5B, vocab_size=s["vocab"], hidden_size=s["hidden"],
                                    num_hidden_layers=s["layers"], num_attention_heads=2,
                                    num_key_value_heads=1, intermediate_size=128))


def actor_batch(vocab: int, rows: int, tokens: int, seed: int = 0) -> ts.ActorBatch:
    """One update of one micro-batch: `[1, 1, rows, ...]`, rows of `tokens + 1` ids whose
    last `tokens` are the targets, all of them in the loss."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, tokens + 1)).astype(np.int32)
    ones = np.ones((rows, tokens), np.int32)
    seqs = ts.Sequences.padded(ids, np.ones_like(ids), ids[:, 1:], ones)
    old = rng.normal(-12.0, 0.5, (rows, tokens)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, (rows, tokens)).astype(np.float32)
    lead = lambda x: jnp.asarray(x)[None, None]
    count = jnp.asarray([rows * tokens], jnp.float32)
    return ts.ActorBatch(jax.tree.map(lead, seqs), lead(old), lead(adv), lead(old), count,
                         jnp.asarray([rows], jnp.float32))


def available_bytes() -> int:
    """Memory this host can still give (MemAvailable; free pages where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _needs(compiled) -> int:
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def measure(*, small: bool = False, chunk: int | None = None, repeats: int = 3,
            time_rows: int | None = None, warmup: int = 1) -> dict:
    cfg = bench_config(small)
    rows, tokens = (SMALL["rows"], SMALL["tokens"]) if small else (ROWS, TOKENS)
    if small and chunk is None:  # the automatic choice leaves a tiny head alone
        chunk = 32
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec, jax.devices()[:1])
    optim = ts.OptimConfig(lr=1e-6)

    def setup(cfg):
        model = Model(cfg).with_layout(mesh, spec.train_rules)
        params = model.init(jax.random.key(0), mesh, spec.train_rules)
        return model, params, ts.init_state(params, ts.make_optimizer(optim))

    def compiled(model, state, batch, size):
        step = functools.partial(ts.actor_update, model=model, optim=optim,
                                 loss=ts.ActorLoss(lm_head_chunk_size=size))
        return jax.jit(step).lower(state, batch).compile()

    model, params, state = setup(cfg)
    if not head.chunk_positions(chunk, model, (rows, tokens)):
        raise ValueError(f"lm_head_chunk_size={chunk} does not chunk this workload")
    sizes = {"chunked": chunk, "full": 0}
    batch = actor_batch(cfg.vocab_size, rows, tokens)
    updates = {k: compiled(model, state, batch, size) for k, size in sizes.items()}
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in updates.items()}
    # the same update with a 128-token vocabulary: the temporaries that are not the head's
    small_model, _, small_state = setup(dataclasses.replace(cfg, vocab_size=128))
    temp["vocab128"] = compiled(small_model, small_state, actor_batch(128, rows, tokens),
                                0).memory_analysis().temp_size_in_bytes
    del small_state

    # Time the full update on as many of the rows as this host's memory holds (or time_rows).
    n_rows = rows
    if time_rows is not None and time_rows < rows:
        n_rows = time_rows
        batch = actor_batch(cfg.vocab_size, n_rows, tokens)
        updates = {k: compiled(model, state, batch, size) for k, size in sizes.items()}
    while n_rows > 1 and _needs(updates["full"]) > 0.6 * available_bytes():
        n_rows //= 2
        batch = actor_batch(cfg.vocab_size, n_rows, tokens)
        updates = {k: compiled(model, state, batch, size) for k, size in sizes.items()}
    cpu = {"chunked": [], "full": []}  # process CPU seconds: less hit by a busy machine

    def call(name, update):
        t0 = time.process_time()
        out = jax.block_until_ready(update(state, batch))
        cpu[name].append(time.process_time() - t0)
        return out

    t_chunked, t_full = interleaved({k: functools.partial(call, k, updates[k]) for k in cpu},
                                    warmup=warmup, repeats=repeats)
    del updates
    cpu_median = {k: statistics.median(v[warmup:]) for k, v in cpu.items()}  # warm-up dropped

    seqs = jax.tree.map(lambda x: x[0], batch.seqs)  # [K=1, m, ...]
    logp = {k: jax.jit(functools.partial(ts.log_probs_step, model=model, temperature=1.0,
                                         lm_head_chunk_size=size))(params, seqs)
            for k, size in sizes.items()}
    return {
        "chunked_head.temp_bytes_ratio": temp["chunked"] / temp["full"],
        "chunked_head.time_ratio": t_chunked.median / t_full.median,
        "chunked_head.cpu_time_ratio": cpu_median["chunked"] / cpu_median["full"],
        "chunked_head.logprob_max_abs_diff": float(jnp.max(jnp.abs(
            logp["chunked"] - logp["full"]))),
        "chunked_head.temp_bytes.chunked": temp["chunked"],
        "chunked_head.temp_bytes.full": temp["full"],
        "chunked_head.temp_bytes.vocab128": temp["vocab128"],
        "chunked_head.seconds.chunked": t_chunked.median,
        "chunked_head.seconds.full": t_full.median,
        "chunked_head.times.chunked": list(t_chunked.times),
        "chunked_head.times.full": list(t_full.times),
        "chunked_head.time_rows": n_rows,
        "chunked_head.chunk_positions": head.chunk_positions(chunk, model, (rows, tokens)),
        "chunked_head.workload": f"{rows}x{tokens} tokens, vocab {cfg.vocab_size}, "
                                 f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers",
    }


# What `scripts/bench.py all` runs (its 10 minutes): the memory figures at 4 rows as always,
# the times on 1 row, once each (the updates are compiled ahead of the calls).
ALL_KW = dict(time_rows=1, repeats=1, warmup=0)


def run(*, small: bool = False, scale="workload", chunk: int | None = None,
        repeats: int = 3, time_rows: int | None = None, warmup: int = 1) -> dict:
    """The figures (`scale` is accepted for `scripts/bench.py`; the workload is fixed)."""
    del scale
    return measure(small=small, chunk=chunk, repeats=repeats, time_rows=time_rows,
                   warmup=warmup)


if __name__ == "__main__":
    argv = sys.argv[1:]
    kw = {}
    for flag, key in (("--chunk", "chunk"), ("--repeats", "repeats"),
                      ("--time-rows", "time_rows")):
        if flag in argv:
            kw[key] = int(argv[argv.index(flag) + 1])
    print(json.dumps(run(small="--small" in argv, **kw), indent=1, sort_keys=True))
