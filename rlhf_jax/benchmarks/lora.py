"""LoRA benchmark (issue 27): what adapters save against full fine-tuning, in one run.

Shape-derived, on the Qwen2.5-0.5B architecture at rank 8 on every projection (all-linear),
whatever `scale`:

- `lora.optimizer_bytes_ratio`: the AdamW state of the adapters over full fine-tuning's
  (`jax.eval_shape` of the optimizer's init on the trainable part). Target <= 0.02.
- `lora.sync_bytes_ratio`: the bytes `lora.WeightSync` moves train -> generate layout at a
  step's sync (the adapters) over full fine-tuning's (every parameter). Target <= 0.02.

Measured (`workload`: WORKLOAD.md's model, float32, CPU; `0.5b`: the 0.5B architecture cut
to 4 layers, bfloat16 compute), each pair timed in turns (`common.interleaved`):

- `lora.step_seconds`, `lora.full_step_seconds`, `lora.step_time_ratio`: one actor update
  (2 optimizer updates of 2 micro-batches) with the adapters trained on a frozen base
  against all parameters trained.
- `lora.live_bytes_ratio`: device bytes alive (`jax.live_arrays`) for the actor's training
  state plus the reference policy: LoRA (base + adapters + their optimizer state; the
  reference is the base itself) over full fine-tuning (parameters, optimizer state and a
  copy of the parameters as the reference).
- The engine's choice: `lora.decode_apply_seconds` (a decode step applying the adapters in
  its matmuls), `lora.decode_merged_seconds` (a decode step on merged weights) and
  `lora.merge_seconds` (W + (alpha / r) A B folded into a generate copy, once per sync);
  `lora.apply_over_merge` = R x apply / (merge + R x merged) for a rollout of R decode
  steps (R = `ROLLOUT_STEPS`): below 1, applying wins.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import lora
from rlhf_jax import train_steps as ts
from rlhf_jax.benchmarks.common import QWEN2_5_0_5B, get_scale, interleaved
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.models import lora as mlora

RANK, ALPHA = 8, 16.0
ROLLOUT_STEPS = 128  # decode steps a rollout runs per sync (one response length)


def _spec():
    return mlora.LoraSpec(RANK, ALPHA)


def shape_ratios() -> dict:
    """Optimizer-state and sync bytes, adapters over all parameters, 0.5B shapes."""
    cfg = ModelConfig.from_hf(QWEN2_5_0_5B)
    full = Model(cfg).abstract_params()
    adapted = Model(dataclasses.replace(cfg, lora=_spec())).abstract_params()
    tx = ts.make_optimizer(ts.OptimConfig(lr=1e-5))
    opt_full = lora.nbytes(jax.eval_shape(tx.init, full))
    opt_lora = lora.nbytes(jax.eval_shape(tx.init, mlora.adapters(adapted)))
    return {
        "lora.optimizer_bytes_ratio": opt_lora / opt_full,
        "lora.sync_bytes_ratio": lora.nbytes(mlora.adapters(adapted)) / lora.nbytes(full),
        "lora.adapter_params": sum(math.prod(x.shape)
                                   for x in jax.tree.leaves(mlora.adapters(adapted))),
        "lora.rank": RANK,
    }


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _batch(cfg, mesh, axes, rows: int, prompt: int, response: int):
    from rlhf_jax import batching

    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (rows, prompt + response)).astype(np.int32)
    mask = np.ones_like(ids)
    resp, rmask = ids[:, prompt:], mask[:, prompt:]
    seqs = ts.Sequences.padded(ids, mask, resp, rmask)
    per_tok = rng.normal(-2.0, 0.3, (rows, response)).astype(np.float32)
    host = jax.tree.map(lambda x: x.reshape(2, 2, rows // 4, *x.shape[1:]),
                        (seqs, per_tok, per_tok * 0 + 0.5))
    (s, old, adv) = batching.put(host, mesh, axes, lead=2)
    tok = jnp.full((2,), rows // 2 * response, jnp.float32)
    sq = jnp.full((2,), rows // 2, jnp.float32)
    return ts.ActorBatch(s, old, adv, old, tok, sq)


def measure(scale="workload", small: bool = False) -> dict:
    scale = get_scale(scale)
    cfg = scale.model_config()
    if scale.name == "0.5b":
        cfg = dataclasses.replace(cfg, num_hidden_layers=4)  # a whole 24-layer step: too slow
    if small:
        cfg = dataclasses.replace(cfg, num_hidden_layers=1, hidden_size=64, head_dim=16,
                                  intermediate_size=128, vocab_size=128)
    rows, prompt, response = (8, 8, 8) if small else (16, 64, 64)
    repeats = 1 if small else 5
    spec = load_mesh_spec("single")
    mesh = make_mesh(spec, jax.devices()[:1])
    rules, axes = spec.train_rules, dict(spec.train_rules).get("batch", ())
    dtype = scale.dtype
    full_model = Model(cfg, dtype=dtype)
    lora_model = Model(dataclasses.replace(cfg, lora=_spec()), dtype=dtype)
    optim = ts.OptimConfig(lr=1e-4)
    tx = ts.make_optimizer(optim)
    loss = ts.ActorLoss()

    start = _live_bytes()
    base = full_model.init(jax.random.key(0), mesh, rules)
    lora_state = ts.init_state(lora.init_adapters(lora_model, base, mesh, rules,
                                                  jax.random.key(1)),
                               tx, lora.trainable(lora_model))
    lora_bytes = _live_bytes() - start  # the reference is `strip(params)`: nothing more
    full_state = ts.init_state(jax.tree.map(jnp.copy, base), tx)
    ref = jax.tree.map(jnp.copy, full_state.params)
    full_bytes = _live_bytes() - start - lora_bytes
    del ref

    batch = _batch(cfg, mesh, axes, rows, prompt, response)
    step = {name: jax.jit(functools.partial(ts.actor_update, model=m, loss=loss, optim=optim,
                                            trainable=lora.trainable(m)))
            for name, m in (("lora", lora_model), ("full", full_model))}
    states = {"lora": lora_state, "full": full_state}

    def run(name):
        states[name], metrics = step[name](states[name], batch)
        return metrics

    t_lora, t_full = interleaved({"lora": lambda: run("lora"), "full": lambda: run("full")},
                                 warmup=1, repeats=repeats)

    # the engine: adapters applied in the decode matmuls, or merged into the weights
    params = mlora.with_adapters(base, jax.tree.map(
        lambda x: x + 0.01, mlora.adapters(states["lora"].params)))
    b, length = rows, prompt + response
    cache = lora_model.init_cache(b, length)
    ids = jnp.ones((b, 1), jnp.int32)
    pos = jnp.full((b, 1), prompt, jnp.int32)
    where = jnp.full((b,), prompt, jnp.int32)
    decode_lora = jax.jit(lambda p, c: lora_model.decode(p, ids, pos, c, where)[0])
    decode_base = jax.jit(lambda p, c: full_model.decode(p, ids, pos, c, where)[0])
    merge = jax.jit(functools.partial(mlora.merge, spec=_spec()))
    merged = merge(params)
    t_apply, t_merged, t_merge = interleaved(
        {"apply": lambda: decode_lora(params, cache), "merged": lambda: decode_base(merged, cache),
         "merge": lambda: merge(params)}, warmup=1, repeats=max(repeats, 3))
    r = ROLLOUT_STEPS
    return {
        **shape_ratios(),
        "lora.step_seconds": t_lora.median,
        "lora.full_step_seconds": t_full.median,
        "lora.step_time_ratio": t_lora.median / t_full.median,
        "lora.live_bytes": lora_bytes,
        "lora.full_live_bytes": full_bytes,
        "lora.live_bytes_ratio": lora_bytes / full_bytes,
        "lora.decode_apply_seconds": t_apply.median,
        "lora.decode_merged_seconds": t_merged.median,
        "lora.merge_seconds": t_merge.median,
        "lora.apply_over_merge": r * t_apply.median / (t_merge.median + r * t_merged.median),
        "lora.step_layers": cfg.num_hidden_layers,
        "lora.scale": scale.name,
    }


def run(*, small: bool = False, scale="workload") -> dict:
    return measure(scale, small)
