"""MFU benchmark: the actor's PPO update on a model big enough for matmuls to dominate.

- `mfu.ratio`: model FLOP/s of one `actor_update` (`metrics.train_flops`, DESIGN.md's
  formula) over the f32 matmul peak measured in the same run (`mfu.peak_matmul_flops`: a
  jitted 1024 x 1024 matmul, best of 5, sampled after every measured step; the median of
  the samples). Target: >= 0.4.
- `mfu.step_seconds`: median seconds of one update (K micro-batches, one optimizer step).

The bench model: Qwen2 layout, hidden 1024, 8 layers, MLP 2816, 16 heads (8 KV heads),
vocab 8192, float32 (111M matmul parameters); sequences of 128 prompt + 128 response tokens;
batch 2 in 2 micro-batches of 1 (gradient accumulation 2), one device (`single` mesh).
At `scale="0.5b"`: the Qwen2.5-0.5B architecture with bfloat16 compute, sequences of 512 + 512
tokens, batch 16 in 2 micro-batches of 8, against a bfloat16 8192^3 matmul peak; where the
device's datasheet peak is known (`metrics.PEAK_FLOPS`), also
`mfu.ratio_to_datasheet_peak`.

Also home of the helpers the other benchmarks share: `matmul_peak_flops` and
`CompileCounter` (XLA compilations, from `jax.monitoring`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import batching
from rlhf_jax import train_steps as ts
from rlhf_jax.benchmarks.common import Timing, datasheet_peak, get_scale, timed
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.metrics import train_flops
from rlhf_jax.models import Model, ModelConfig

BENCH_MODEL = dict(
    model_type="qwen2", vocab_size=8192, hidden_size=1024, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, intermediate_size=2816,
    rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SMALL_MODEL = dict(BENCH_MODEL, vocab_size=256, hidden_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


def matmul_peak_flops(n: int = 1024, repeats: int = 10, dtype=jnp.float32) -> float:
    """FLOP/s of a jitted n x n matmul on the first device, best of `repeats`."""
    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), dev)
    b = jax.device_put(jnp.full((n, n), 0.5, dtype), dev)
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


class CompileCounter:
    """Counts XLA backend compilations while `counting(True)` is active."""

    _listening: list[CompileCounter] = []
    _registered = False

    def __init__(self):
        self.count = 0

    @classmethod
    def _on_event(cls, event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            for c in cls._listening:
                c.count += 1

    @contextlib.contextmanager
    def counting(self, active: bool = True):
        if not CompileCounter._registered:
            jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_event)
            CompileCounter._registered = True
        if active:
            CompileCounter._listening.append(self)
        try:
            yield self
        finally:
            if active:
                CompileCounter._listening.remove(self)


def actor_batch(mesh, batch_axes, *, batch: int, micro: int, prompt_len: int,
                response_len: int, vocab: int, seed: int = 0) -> ts.ActorBatch:
    """A random `[1, K, m, ...]` actor batch (one update of K = batch / micro micro-batches)."""
    rng = np.random.default_rng(seed)
    k = batch // micro
    t = prompt_len + response_len
    ids = rng.integers(3, vocab, size=(1, k, micro, t)).astype(np.int32)
    resp = ids[..., prompt_len:]
    ones = lambda *s: np.ones(s, np.int32)
    seqs = ts.Sequences.padded(ids, ones(1, k, micro, t), resp,
                               ones(1, k, micro, response_len))
    f = lambda: (rng.standard_normal((1, k, micro, response_len)) * 0.1).astype(np.float32)
    old, adv = f() - 2.0, f() * 10
    dev = batching.put((seqs, old, adv, np.zeros_like(old)), mesh, batch_axes, lead=2)
    counts = (jnp.asarray([batch * response_len], jnp.float32),
              jnp.asarray([batch], jnp.float32))
    return ts.ActorBatch(*dev, *counts)


SIZES = {  # per scale: batch, micro-batch, prompt and response lengths, warm-up, repeats
    "workload": dict(batch=2, micro=1, prompt_len=128, response_len=128, warmup=1, repeats=3),
    "0.5b": dict(batch=16, micro=8, prompt_len=512, response_len=512, warmup=2, repeats=5),
}


def run(*, small: bool = False, scale="workload", **sizes) -> dict:
    """The actor update's MFU (small=True: a tiny model, for the smoke test).

    `sizes` override the scale's `SIZES` entry (batch, micro, prompt_len, ...)."""
    scale = get_scale(scale)
    kw = {**SIZES[scale.name], **sizes}
    if small:
        kw = dict(batch=2, micro=1, prompt_len=8, response_len=8, warmup=1, repeats=1)
    batch, micro = kw["batch"], kw["micro"]
    prompt_len, response_len = kw["prompt_len"], kw["response_len"]
    cfg = ModelConfig.from_hf(SMALL_MODEL) if small else scale.model_config(BENCH_MODEL)
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec)
    model = Model(cfg, dtype=scale.dtype).with_layout(mesh, spec.train_rules)
    optim = ts.OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0)
    state = ts.init_state(model.init(jax.random.key(0), mesh, spec.train_rules),
                          ts.make_optimizer(optim))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    fast = {"compiler_options": FAST_COMPILE} if small else {}
    step = jax.jit(functools.partial(ts.actor_update, model=model, loss=ts.ActorLoss(),
                                     optim=optim),
                   in_shardings=(state_sh, None), out_shardings=(state_sh, None),
                   donate_argnums=0, **fast)
    data = actor_batch(mesh, dict(spec.train_rules).get("batch", ()), batch=batch, micro=micro,
                       prompt_len=prompt_len, response_len=response_len,
                       vocab=cfg.vocab_size)
    holder = [state]

    def one():
        holder[0], m = step(holder[0], data)
        return m

    # Steps and peak samples in turns, so that both see the same load of a shared machine.
    peak_n = 64 if small else scale.peak_n
    peaks, times = [], []
    for i in range(kw["warmup"] + kw["repeats"]):
        t = timed(one, warmup=0, repeats=1).min
        if i >= kw["warmup"]:
            times.append(t)
            peaks.append(matmul_peak_flops(peak_n, repeats=3 if small else 5,
                                           dtype=jnp.dtype(scale.dtype)))
    t, peak = Timing(tuple(times)), statistics.median(peaks)
    seq_lens = np.full(batch, prompt_len + response_len)
    flops = train_flops(cfg, seq_lens)
    no_embed = flops - 6.0 * cfg.vocab_size * cfg.hidden_size * float(seq_lens.sum())
    out = {
        "mfu.ratio": flops / (t.median * peak),
        "mfu.ratio_without_embedding_flops": no_embed / (t.median * peak),
        "mfu.step_seconds": t.median,
        "mfu.model_flops_per_step": flops,
        "mfu.model_flops_per_s": flops / t.median,
        "mfu.peak_matmul_flops": peak,
        "mfu.peak_matmul_n": peak_n,
        "mfu.params": cfg.num_matmul_params,
        "mfu.tokens_per_step": float(seq_lens.sum()),
        "mfu.micro_batches": batch // micro,
        "mfu.scale": scale.name,
        "mfu.dtype": scale.dtype,
    }
    sheet = datasheet_peak(scale.dtype)
    if sheet is not None:
        out["mfu.datasheet_peak_flops"] = sheet
        out["mfu.ratio_to_datasheet_peak"] = flops / (t.median * sheet)
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, sort_keys=True))
