"""Packing benchmark: workload 2 of `/work/shared/bench/WORKLOAD.md` (variable lengths), padded
vs packed, both on the real trainer, in turns.

Two `rlhf_jax.trainer.Trainer`s are built from `packing_workload.yaml` (WORKLOAD.md's model,
reward and PPO settings, `single` mesh): the padded one as it is, where every sequence is a
row of 128 + 512 tokens, and the packed one with `PACKED`, verl's keys for sequence packing
(`actor_rollout_ref.model.use_remove_padding`, `critic.model.use_remove_padding`) and token
budget micro-batches (`*.use_dynamic_bsz` and the `*_max_token_len_per_gpu` budgets). Each
iteration's batch of 32 prompts runs through `Trainer.step` of both, the order swapped every
iteration, so that both see the same load of the shared machine.

The workload (prompt k of iteration i): `p = default_rng(0).integers(16, 129, (iterations,
32))` prompt tokens, ids `common.workload_prompts(iterations, 32, 128)[k, i, :p]` (3..1023),
left-padded to 128 by the loader; response length `L = clip(round(default_rng(1).lognormal(
log(96), 0.8, (iterations, 32))), 8, 512)`. The rollout stops response i after exactly L[k, i]
tokens: the benchmark passes L[k] as the rollout's per-request length limit
(`generate_sequences(max_lengths=...)`, which the engine holds per decode slot), so the
slot finishes there as at an EOS; no sampled token is replaced, the log-probs stay the
sampler's. It checks every rollout's lengths against L[k] (a `UserError` otherwise).
Real tokens of an iteration: the sum of p + L over its batch.

- `packing.tokens_per_s`, `packing.padded_tokens_per_s`: real tokens of an iteration (mean over
  the measured ones) / median seconds of `Trainer.step`, packed and padded; `packing.speedup`:
  their ratio (target >= 2.0 on the 2-core machine).
- `packing.flop_bound_ratio` (`packing.padded_flop_bound_ratio`): model FLOPs of the real
  tokens (`ppo.workload_flops` per sequence of p + L tokens: rollout, 3 forward passes, 2
  updates, attention over each sequence's own p + L square) / (measured f32 matmul peak x
  median seconds); the peak as `ppo.flop_bound_ratio`'s, sampled after every measured
  iteration. Target >= 0.5 packed.
- `packing.<path>.seconds_per_iteration`, `.gen_seconds` (`timing_s/gen`), `.passes_seconds`
  (old_log_prob + ref + values), `.update_seconds` (update_critic + update_actor) and
  `.stage.<name>` for every `timing_s/<name>` (`other`: the rest of the step), medians;
  `<path>` is `packed` or `padded`; `.decode_steps` (the engine's generate steps, the
  batch's longest response), `.gen_ms_per_decode_step` and `.compactions` (the times the
  rollout halved its decode slots as responses finished, `rollout.compact_slots_min_response_
  length`; the same on both paths: generation is not what packing changes).
- `packing.compiles_after_warmup`: XLA compilations during the measured iterations of both
  trainers (expected 0: every shape is fixed after the warm-up ones).
- `packing.real_tokens_per_iteration`, `packing.padded_tokens_per_iteration` (32 x 640),
  `packing.cpu_steal_fraction` (as `ppo.cpu_steal_fraction`).

2 warm-up + 3 measured iterations (WORKLOAD.md asks 5 measured: `run(repeats=5)`; 3 keep
`bench.py all` nearer its 10 minutes). `--scale 0.5b`: the Qwen2.5-0.5B architecture in bfloat16,
the same sizes, 1 + 3.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import statistics
import tempfile
from collections.abc import Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_jax.benchmarks import ppo
from rlhf_jax.benchmarks.common import (
    SMALL_MODEL,
    WORKLOAD_MODEL,
    cpu_ticks,
    get_scale,
    peak_rss_mb,
    workload_prompts,
)
from rlhf_jax.benchmarks.mfu import CompileCounter, matmul_peak_flops
from rlhf_jax.config import load_config
from rlhf_jax.errors import UserError
from rlhf_jax.rollout import driver
from rlhf_jax.rollout.program_cache import abstract

WORKLOAD_CONFIG = pathlib.Path(__file__).with_name("packing_workload.yaml")
PATHS = ("padded", "packed")
PASSES = ("old_log_prob", "ref", "values")  # the forward passes of the experience
UPDATES = ("update_critic", "update_actor")

# Per scale: prompts, prompt lengths lo..hi, response lengths (lognormal), micro-batch rows of
# the padded path and the packed path's token budget. The attention of a packed row is dense
# over the row (masked by segment), so the smallest budget the trainer takes, one whole
# sequence (128 + 512), spends the fewest FLOPs: by first-fit rows of the measured
# iterations, 3.1x fewer than padded at 640, 2.6x at 1024, 1.7x at 2048.
SIZES = {
    "workload": dict(batch=32, prompt_min=16, prompt_len=128, response_median=96,
                     response_min=8, response_len=512, micro_batch=8, budget=640),
    "0.5b": dict(batch=32, prompt_min=16, prompt_len=128, response_median=96,
                 response_min=8, response_len=512, micro_batch=8, budget=2048),
}
SMALL = dict(batch=4, prompt_min=4, prompt_len=8, response_median=4, response_min=2,
             response_len=8, micro_batch=2, budget=32)  # the smoke test's sizes
# ... whose 8-token responses compact the slots too (the default starts at 32 tokens)
SMALL_OVERRIDES = ("actor_rollout_ref.rollout.compact_slots_min_response_length=2",)
# Per scale: (warm-up, measured). WORKLOAD.md's 5 measured iterations would add two of both
# paths (~70 s on the idle 2-core machine), which `bench.py all`'s 10 minutes cannot spare.
ITERATIONS = {"workload": (2, 3), "0.5b": (1, 3)}
ALL_KW = dict(warmup=1)  # what `scripts/bench.py all` runs (nearer its 10 minutes)


def packed_overrides(budget: int) -> list[str]:
    """verl's keys of the packed path: remove padding in every model, token-budget
    micro-batches of `budget` tokens per device in every pass and update."""
    arr = "actor_rollout_ref"
    return [f"{arr}.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
            f"{arr}.actor.use_dynamic_bsz=true",
            f"{arr}.actor.ppo_max_token_len_per_gpu={budget}",
            f"{arr}.ref.log_prob_max_token_len_per_gpu={budget}",
            f"{arr}.rollout.log_prob_max_token_len_per_gpu={budget}",
            "critic.use_dynamic_bsz=true", f"critic.ppo_max_token_len_per_gpu={budget}",
            f"critic.forward_max_token_len_per_gpu={budget}"]


# ------------------------------------------------------------------------- the workload


def workload_lengths(iterations: int, *, batch: int, prompt_min: int, prompt_len: int,
                     response_median: float, response_min: int, response_len: int,
                     **_) -> tuple[np.ndarray, np.ndarray]:
    """WORKLOAD.md's workload 2: `[iterations, batch]` prompt lengths (uniform in
    [prompt_min, prompt_len]) and response lengths (lognormal, median `response_median`,
    sigma 0.8, rounded and clipped to [response_min, response_len])."""
    p = np.random.default_rng(0).integers(prompt_min, prompt_len + 1,
                                          size=(iterations, batch))
    r = np.random.default_rng(1).lognormal(mean=math.log(response_median), sigma=0.8,
                                           size=(iterations, batch))
    return p.astype(np.int32), np.clip(np.round(r), response_min, response_len).astype(np.int32)


def write_model_dir(path: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """`ppo.write_model_dir` (EOS = `vocab_size`, never sampled) with pad id 0: padding here
    reaches the embedding table (left-padded prompts, responses padded after their end), and
    the table's lookup of an id past the vocabulary gives NaN rows, which the masked
    attention does not stop (0 weight x NaN). Padding is told by the masks, never by the id."""
    ppo.write_model_dir(path, vocab_size)
    tok_cfg = path / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({**json.loads(tok_cfg.read_text()), "pad_token": "0"}))
    return path


def write_prompts(path: pathlib.Path, ids: np.ndarray, lengths: np.ndarray) -> pathlib.Path:
    """Prompt k of iteration i, `ids[i, k, :lengths[i, k]]`, as verl-schema parquet rows in
    file order (the loader's batch i is iteration i)."""
    rows = [{"data_source": ppo.DATA_SOURCE,
             "prompt": [{"role": "user", "content": " ".join(map(str, row[:n]))}],
             "reward_model": {"style": "rule", "ground_truth": ""}}
            for row, n in zip(ids.reshape(-1, ids.shape[-1]).tolist(), lengths.reshape(-1),
                              strict=True)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def workload_config(workdir: pathlib.Path, ids: np.ndarray, prompt_lengths: np.ndarray, *,
                    response_len: int, micro_batch: int, model: dict | None = None,
                    dtype: str = "float32", overrides: Sequence[str] = ()):
    """The `Config` of `packing_workload.yaml` on the files it needs, written into `workdir`
    (`ids [iterations, B, P]`, `prompt_lengths [iterations, B]`); B, P, the response length
    and the micro-batch set the sizes where they differ from the yaml's."""
    _, b, p = ids.shape
    model = model or WORKLOAD_MODEL
    model_dir = write_model_dir(workdir / "model", model["vocab_size"])
    data = workdir / "prompts.parquet"
    if not data.exists():
        write_prompts(data, ids, prompt_lengths)
    arr = "actor_rollout_ref"
    items = [f"data.train_files=[{data}]", f"{arr}.model.path={model_dir}",
             f"{arr}.model.compute_dtype={dtype}",
             f"{arr}.model.override_config={json.dumps(ppo.model_overrides(model))}",
             f"trainer.default_local_dir={workdir / 'run'}",
             f"data.train_batch_size={b}", f"{arr}.actor.ppo_mini_batch_size={b}",
             f"{arr}.rollout.max_concurrent_decodes={b}", f"data.max_prompt_length={p}",
             f"{arr}.rollout.prefill_buckets=[{p}]", f"data.max_response_length={response_len}",
             f"{arr}.actor.ppo_micro_batch_size_per_device={micro_batch}",
             f"critic.ppo_micro_batch_size_per_device={micro_batch}"]
    return load_config(WORKLOAD_CONFIG, [*items, *overrides])


@contextlib.contextmanager
def forced_lengths(lengths: np.ndarray, seen: list):
    """While open, every rollout of the trainer stops request i after `lengths[i]` tokens
    (`generate_sequences(max_lengths=lengths)`); each rollout's `RolloutBatch` goes to
    `seen`. The trainer calls the driver by its module-level name, which this replaces."""
    import rlhf_jax.trainer as trainer_module

    real = trainer_module.generate_sequences

    def limited(*args, **kw):
        out = real(*args, max_lengths=lengths, **kw)
        seen.append(out)
        return out

    with mock.patch.object(trainer_module, "generate_sequences", limited):
        yield


def real_token_flops(model_cfg, seq_lens: np.ndarray) -> float:
    """Model FLOPs of one iteration over sequences of `seq_lens` real tokens, by
    `ppo.workload_flops`' accounting (its attention over each sequence's own square)."""
    return float(sum(ppo.workload_flops(model_cfg, 1, int(s)) for s in seq_lens))


# ------------------------------------------------------------------------------------ run


class TrainerPath(ppo.Run):
    """One trainer of the comparison; `step(k, lengths)` is `ppo.Run.step(k)` with the
    rollout's lengths forced to `lengths`, checked, and the step's losses checked finite."""

    CHECKED = ("actor/pg_loss", "critic/vf_loss")

    def __init__(self, name: str, cfg):
        super().__init__(cfg)
        self.name = name
        self.metrics: dict = {}
        self.decode_steps: list[float] = []  # the engine's generate steps of each rollout
        self.compactions: list[float] = []  # and the times it halved its slots
        step = self.trainer.step

        def recorded(*args, **kw):
            state, self.metrics = step(*args, **kw)
            return state, self.metrics

        self.trainer.step = recorded
        # The forced lengths end responses early although no EOS can be sampled: the
        # rollout compacts its slots, so its smaller engines' programs compile now, with
        # the launch (the trainer's own precompile does not foresee them).
        t = self.trainer
        driver.precompile(t.engine, abstract(t.gen_params),
                          num_prompts=t.cfg.data.train_batch_size,
                          prompt_length=t.cfg.data.max_prompt_length, sampling=t.sampling(),
                          limited=True)

    def step(self, k: int, lengths: np.ndarray) -> dict[str, float]:
        seen: list = []
        with forced_lengths(lengths, seen):
            out = super().step(k)
        if len(seen) != 1 or not np.array_equal(seen[0].response_lengths, lengths):
            raise UserError(f"packing: the {self.name} path's rollout of iteration {k} did not "
                            f"stop at the forced response lengths")
        bad = [m for m in self.CHECKED if not np.isfinite(self.metrics.get(m, np.nan))]
        if bad:
            raise UserError(f"packing: the {self.name} path's iteration {k} gave a non-finite "
                            f"{bad[0]}")
        self.decode_steps.append(seen[0].stats["rollout/decode_steps"])
        self.compactions.append(seen[0].stats.get("rollout/compactions", 0.0))
        return out


def run(*, small: bool = False, scale="workload", warmup: int | None = None,
        repeats: int | None = None, budget: int | None = None,
        overrides: Sequence[str] = (), packed: Sequence[str] | None = None) -> dict:
    """Workload 2, padded and packed, or with `small=True` a shrunken one for the smoke test.

    `budget`: the packed path's tokens per device of every micro-batch (default per scale,
    see `SIZES`). `overrides`: more `key=value` config overrides of both trainers;
    `packed`: the packed trainer's own (default `packed_overrides(budget)`).
    """
    scale = get_scale(scale)
    warmup = ITERATIONS[scale.name][0] if warmup is None else warmup
    repeats = ITERATIONS[scale.name][1] if repeats is None else repeats
    sizes, model = SIZES[scale.name], scale.model or WORKLOAD_MODEL
    if small:
        sizes, model, warmup, repeats = SMALL, SMALL_MODEL, 1, 1
        overrides = [*SMALL_OVERRIDES, *overrides]
    budget = sizes["budget"] if budget is None else budget
    packed = packed_overrides(budget) if packed is None else packed
    iterations = warmup + repeats
    prompt_lens, response_lens = workload_lengths(iterations, **sizes)
    ids = workload_prompts(iterations, sizes["batch"], sizes["prompt_len"]) % model["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="rlhf_jax_bench_packing_") as tmp:
        kw = dict(response_len=sizes["response_len"], micro_batch=sizes["micro_batch"],
                  model=model, dtype=scale.dtype)
        paths = {}
        try:
            for name, extra in (("padded", []), ("packed", packed)):
                cfg = workload_config(pathlib.Path(tmp, name), ids, prompt_lens, **kw,
                                      overrides=[*overrides, *extra])
                paths[name] = TrainerPath(name, cfg)
            out = _measure(paths, response_lens, prompt_lens, warmup, repeats, scale, small)
        finally:
            for p in paths.values():
                p.close()
    out["packing.budget"] = budget
    return out


def _measure(paths: dict[str, TrainerPath], response_lens, prompt_lens, warmup: int, repeats: int,
             scale, small: bool) -> dict:
    counter = CompileCounter()
    records = {name: [] for name in paths}
    peaks, steal = [], [0, 0]
    for k in range(warmup):
        for p in paths.values():
            p.step(k, response_lens[k])
    for j in range(repeats):
        k = warmup + j
        order = list(paths) if j % 2 == 0 else list(paths)[::-1]
        before = cpu_ticks()
        for name in order:
            with counter.counting(True):
                records[name].append(paths[name].step(k, response_lens[k]))
        after = cpu_ticks()
        if before and after:
            steal = [steal[0] + after[0] - before[0], steal[1] + after[1] - before[1]]
        # the peak right after each iteration, under the same load of a shared machine
        peaks.append(matmul_peak_flops(64 if small else scale.peak_n, repeats=3 if small else 5,
                                       dtype=jnp.dtype(scale.dtype)))
    measured = slice(warmup, warmup + repeats)
    real = prompt_lens[measured] + response_lens[measured]  # [repeats, B]
    tokens = float(real.sum(-1).mean())
    model_cfg = paths["packed"].trainer.actor_model.cfg
    flops = statistics.mean(real_token_flops(model_cfg, row) for row in real)
    peak = statistics.median(peaks)
    cfg = paths["padded"].trainer.cfg
    out = {
        "packing.real_tokens_per_iteration": tokens,
        "packing.padded_tokens_per_iteration": cfg.data.train_batch_size * (
            cfg.data.max_prompt_length + cfg.data.max_response_length),
        "packing.flops_per_iteration": flops,
        "packing.peak_matmul_flops": peak,
        "packing.measured_iterations": repeats,
        "packing.compiles_after_warmup": counter.count,
        "packing.response_length_mean": float(response_lens[measured].mean()),
        "packing.scale": scale.name,
        "packing.dtype": scale.dtype,
        "packing.devices": jax.device_count(),
        "packing.peak_rss_mb": peak_rss_mb(),
    }
    seconds = {}
    for name, recs in records.items():
        seconds[name] = statistics.median(r["step"] for r in recs)
        out.update(_path_figures(name, recs))
        steps = statistics.median(paths[name].decode_steps[warmup:])
        out[f"packing.{name}.decode_steps"] = steps
        out[f"packing.{name}.compactions"] = statistics.median(paths[name].compactions[warmup:])
        out[f"packing.{name}.gen_ms_per_decode_step"] = (
            1e3 * out[f"packing.{name}.gen_seconds"] / steps)
    out["packing.tokens_per_s"] = tokens / seconds["packed"]
    out["packing.padded_tokens_per_s"] = tokens / seconds["padded"]
    out["packing.speedup"] = seconds["padded"] / seconds["packed"]
    out["packing.flop_bound_ratio"] = flops / (peak * seconds["packed"])
    out["packing.padded_flop_bound_ratio"] = flops / (peak * seconds["padded"])
    if steal[1] > 0:
        out["packing.cpu_steal_fraction"] = steal[0] / steal[1]
    return out


def _path_figures(name: str, records: list[dict]) -> dict:
    """Medians of one path's step and stage seconds, and its gen / passes / update sums."""
    stages = [s for s in records[0] if s != "step"]
    for r in records:  # outside every stage: the step's metrics
        r["other"] = r["step"] - sum(r.get(s, 0.0) for s in stages)
    med = lambda f: statistics.median(f(r) for r in records)
    pre = f"packing.{name}"
    out = {f"{pre}.seconds_per_iteration": med(lambda r: r["step"]),
           f"{pre}.gen_seconds": med(lambda r: r.get("gen", 0.0)),
           f"{pre}.passes_seconds": med(lambda r: sum(r.get(s, 0.0) for s in PASSES)),
           f"{pre}.update_seconds": med(lambda r: sum(r.get(s, 0.0) for s in UPDATES))}
    out.update({f"{pre}.stage.{s}": med(lambda r, s=s: r[s]) for s in (*stages, "other")})
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=1, sort_keys=True))
