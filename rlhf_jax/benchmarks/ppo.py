"""PPO benchmark: one iteration of `/work/shared/bench/WORKLOAD.md`, timed on the real trainer.

`rlhf_jax.trainer.Trainer`, built from `ppo_workload.yaml` (workload 1 as a config, on the
`single` mesh), runs `Trainer.step` on each batch: engine rollout (EOS disabled: the EOS and pad
id is 1024, one past the vocabulary) -> reward (fraction of even response ids, on the last
token, through the trainer's custom-reward path) -> old log-probs -> ref log-probs (frozen
initial policy) -> adv (k1 KL 0.001 in the reward, GAE gamma 1 lam 0.95) -> critic update ->
actor update (one mini-batch of 32, micro-batch 8, AdamW, no clipping, no weight decay) ->
update_weights (train -> generate layout). The files the trainer reads are written into a
temporary directory: the prompts as parquet (read in file order, batch k = the loader's
batch k), and a model directory with the workload's config.json (no weights: random init)
and a tokenizer whose tokens are named by their ids (so `even_fraction` reads the ids back
from the decoded text) with EOS 1024 in generation_config.json. 2 warm-up + 5 measured
iterations, a fresh batch of prompts each; every figure is a median over the measured ones.
With one critic update an iteration, the trainer's default (`critic.values_in_update`) takes
the rollout's values from that update's forward pass, so there is no separate `values` stage;
`values_in_update=False` runs verl's separate values pass.

- `ppo.seconds_per_iteration`, `ppo.tokens_per_s` (= 32 * 128 / median seconds): wall
  seconds of `Trainer.step`, until the new actor and critic states are ready.
- `ppo.stage.<name>`: median seconds of each of the trainer's `timing_s/<name>` stages that
  run (gen, reward, old_log_prob, ref, values, adv, update_critic, update_actor,
  update_weights); `ppo.stage.other` is the rest of the iteration (the step's metrics).
- `ppo.flop_bound_ratio`: model FLOPs of the iteration / (measured matmul peak x seconds);
  the peak (`mfu.matmul_peak_flops`, best of 5 jitted 1024 x 1024 f32 matmuls) is sampled
  after every measured iteration and the median taken. Target: >= 0.7 (~1.5x TRL).
  FLOPs follow WORKLOAD.md: N = matmul parameters without the embedding lookup (3.16M);
  rollout 2N per token, old/ref/values 3 x 2N, updates 2 x 6N, plus attention counted over
  the full 128 x 128 score matrix of every pass (4 L heads head_dim T^2 per forward, x3 per
  update), which gives WORKLOAD.md's ~9 %.
- `ppo.trl_tokens_per_s_reference`: TRL's figure from WORKLOAD.md, a reference measured
  there (idle machine, 2026-12-02), not in this run.
- With `trl_python` (`scripts/bench.py ppo --trl-python PYTHON`, the Python of an environment
  with torch, transformers and trl 1.12): TRL's PPOTrainer on the same workload
  (`benchmarks/peers/trl_ppo.py` at the repository's top level, a subprocess), in turns with
  this trainer: warm-up, then `rounds` times one TRL run (2 warm-up + `repeats` iterations)
  and `repeats` iterations here. `ppo.trl.*` are TRL's figures (medians over every measured
  TRL iteration), `ppo.ratio_to_trl` our tokens/s over TRL's, both from this run.
  Target: >= 1.5.
- `ppo.bypass.*`: the same iteration with verl's bypass mode
  (`algorithm.rollout_correction.bypass_mode=true`, a second `Trainer`): the old log-probs
  are the engine's, taken while sampling, as TRL takes them; no old_log_prob stage. Run right
  after each measured iteration on the same prompts: `seconds_per_iteration`, `tokens_per_s`
  and, with TRL, `ratio_to_trl`. The main figures above keep verl's default (recomputed).
- `ppo.cpu_steal_fraction`: the share of CPU time the hypervisor took during the measured
  iterations (Linux `/proc/stat`; absent elsewhere): a slow run of a shared VM shows here.
- `ppo.compiles_measured`: XLA compilations during the measured iterations (0 if every step
  compiles once).
- `ppo.launch_to_first_step_seconds`: from building the `Trainer` (data, model, mesh,
  engine) to the end of its first step, which waits for every program the step needs (the
  trainer compiles them in a background thread from its construction on, `precompile`).
- `ppo.compile.seconds` (XLA backend compiles in total), `ppo.compile.blocking_seconds` (on
  the main thread: what the first step waited for), `ppo.compile.programs`,
  `ppo.compile.cache_hits` (programs the persistent cache served: 0 unless the environment
  turned it on, `JAX_COMPILATION_CACHE_DIR`), `ppo.compile.trace_seconds`,
  `ppo.compile.lower_seconds` and `ppo.compile.seconds.<program>` (e.g.
  `ppo.compile.seconds.actor_update`; programs of one name summed): the compiles of that
  launch, from `jax.monitoring` events (`rlhf_jax.compile_cache.CompileLog`). The first
  warm-up iteration is this first step.

At `scale="0.5b"` (for one accelerator): the same iteration on the Qwen2.5-0.5B architecture
(`actor_rollout_ref.model.override_config`) with bfloat16 compute, 64 prompts of 128 tokens,
128 new tokens each, micro-batch 16, against a bfloat16 8192^3 matmul peak, 1 warm-up and 3
measured iterations. TRL's run belongs to the workload scale only.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers

from rlhf_jax.benchmarks.common import (
    SMALL_MODEL,
    WORKLOAD_MODEL,
    cpu_ticks,
    get_scale,
    peak_rss_mb,
    workload_prompts,
)
from rlhf_jax.benchmarks.mfu import CompileCounter, matmul_peak_flops
from rlhf_jax.compile_cache import CompileLog
from rlhf_jax.config import load_config
from rlhf_jax.errors import UserError
from rlhf_jax.trainer import Trainer

TRL_TOKENS_PER_S = 1368.0  # WORKLOAD.md, TRL 1.12 PPO on the idle 2-core machine
TRL_SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "peers" / "trl_ppo.py"
TRL_WARMUP = 2  # the warm-up iterations of every TRL run (benchmarks/peers/trl_ppo.py)
WORKLOAD_CONFIG = pathlib.Path(__file__).with_name("ppo_workload.yaml")
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
          "update_actor", "update_weights")  # the trainer's timing_s/<stage>, in order
DATA_SOURCE = "bench/even_fraction"


def even_fraction(data_source, solution_str: str, ground_truth, extra_info) -> float:
    """WORKLOAD.md's reward (`reward.custom_reward_function`): the fraction of even ids in
    the response. The benchmark's tokenizer names every token by its id, so the decoded
    response is its ids separated by spaces."""
    ids = solution_str.split()
    return sum(int(i) % 2 == 0 for i in ids) / max(len(ids), 1)


def workload_flops(model_cfg, batch: int, seq_len: int) -> float:
    """Model FLOPs of one PPO iteration by WORKLOAD.md's accounting (see the module doc)."""
    c = model_cfg
    n = c.num_matmul_params - c.vocab_size * c.hidden_size  # the embedding is a gather
    attn = 4.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len**2
    forward = batch * (2.0 * n * seq_len + attn)
    return forward * (1 + 3) + 3 * forward * 2  # rollout, old/ref/values, actor+critic


# ------------------------------------------------------------------- the trainer's inputs


def write_model_dir(path: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """An HF model directory without weights: WORKLOAD.md's config.json and a word-level
    tokenizer of `vocab_size` tokens named by their ids ("0", "1", ...), whose only EOS (and
    so the pad id) is `vocab_size`, one past the vocabulary: never sampled, never embedded."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(WORKLOAD_MODEL))
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab_size}))
    return path


def write_prompts(path: pathlib.Path, prompts: np.ndarray) -> pathlib.Path:
    """`[iterations, B, P]` prompt ids as verl-schema parquet rows, batch after batch: a
    loader in file order gives batch k as `prompts[k]`."""
    rows = [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "user", "content": " ".join(map(str, ids))}],
             "reward_model": {"style": "rule", "ground_truth": ""}}
            for ids in prompts.reshape(-1, prompts.shape[-1]).tolist()]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def model_overrides(model: dict) -> dict:
    """The fields of the HF config `model` that differ from WORKLOAD.md's model."""
    return {k: v for k, v in model.items() if WORKLOAD_MODEL.get(k) != v}


def workload_config(workdir: pathlib.Path, prompts: np.ndarray, *, model: dict | None = None,
                    dtype: str = "float32", micro_batch: int | None = None,
                    overrides: Sequence[str] = ()):
    """The `Config` of `ppo_workload.yaml` on the files it needs, written into `workdir`.

    Args:
      prompts: `[iterations, B, P]` prompt ids; B and P set the batch and prompt length when
        they differ from the workload's.
      model: the HF config of the model (None: WORKLOAD.md's); a different one goes in as
        `actor_rollout_ref.model.override_config`. dtype: its compute dtype.
      micro_batch: the micro-batch rows per device (None: the workload's 8).
      overrides: more `key=value` config overrides, applied last (e.g. the response length,
        `algorithm.rollout_correction.bypass_mode=true`).
    """
    _, b, p = prompts.shape
    model = model or WORKLOAD_MODEL
    model_dir = write_model_dir(workdir / "model", model["vocab_size"])
    data = workdir / "prompts.parquet"
    if not data.exists():
        write_prompts(data, prompts)
    arr = "actor_rollout_ref"
    items = [f"data.train_files=[{data}]", f"{arr}.model.path={model_dir}",
             f"{arr}.model.compute_dtype={dtype}",
             f"{arr}.model.override_config={json.dumps(model_overrides(model))}",
             f"trainer.default_local_dir={workdir / 'run'}"]
    if b != 32 or p != 64:
        items += [f"data.train_batch_size={b}", f"{arr}.actor.ppo_mini_batch_size={b}",
                  f"{arr}.rollout.max_concurrent_decodes={b}", f"data.max_prompt_length={p}",
                  f"{arr}.rollout.prefill_buckets=[{p}]"]
    if micro_batch is not None:
        items += [f"{arr}.actor.ppo_micro_batch_size_per_device={micro_batch}",
                  f"critic.ppo_micro_batch_size_per_device={micro_batch}"]
    return load_config(WORKLOAD_CONFIG, [*items, *overrides])


class Run:
    """One `Trainer` and its run state, stepped by the benchmark: `step(k)` trains on the
    loader's batch k (file order) as training step `state.step + 1`."""

    def __init__(self, cfg):
        self.trainer = Trainer(cfg)
        self.state = self.trainer.state

    def step(self, k: int) -> dict[str, float]:
        """Seconds of each `timing_s/<stage>` and of the whole step (`step`), which ends when
        the new actor and critic states are ready."""
        batch = self.trainer.train_loader.batch_at(0, k)
        state = self.state._replace(step=self.state.step + 1)
        t0 = time.perf_counter()
        state, metrics = self.trainer.step(batch, state)
        jax.block_until_ready((state.actor, state.critic))
        seconds = time.perf_counter() - t0
        self.state = state  # the step donated the old actor and critic states
        out = {name.removeprefix("timing_s/"): v for name, v in metrics.items()
               if name.startswith("timing_s/") and name != "timing_s/step"}
        return {**out, "step": seconds}

    def close(self):
        self.trainer.checkpointer.close()


# ------------------------------------------------------------------------------------- TRL


def run_trl(python: str, *args: str) -> dict:
    """The JSON object of `TRL_SCRIPT *args` run by `python`; a `UserError` naming
    `python` if it cannot run, fails, or its run breaks one of the workload's checks."""
    cmd = [python, str(TRL_SCRIPT), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise UserError(f"--trl-python {python}: cannot run it ({exc.strerror})") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"--trl-python {python}: {TRL_SCRIPT.name} exited with "
                        f"{proc.returncode}: {last}")
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise UserError(f"--trl-python {python}: {TRL_SCRIPT.name} printed no JSON object "
                        f"on its last line") from None
    failed = sorted(k for k, v in out.get("trl.checks", {}).items() if v is False)
    if failed:
        raise UserError(f"--trl-python {python}: TRL's run failed the workload checks "
                        f"{', '.join(failed)}")
    return out


@functools.cache
def check_trl(python: str, script: pathlib.Path) -> dict:
    """`run_trl(python, "--check")` once per Python and script: the versions it reports, or
    the `UserError` of a broken environment, before any benchmark runs."""
    return run_trl(python, "--check")


def _trl_figures(runs: list[dict], tokens: int) -> dict:
    """Medians over the measured iterations of every TRL run."""
    pooled = lambda key: statistics.median(x for r in runs for x in r[key][TRL_WARMUP:])
    seconds = pooled("trl.iteration_seconds")
    return {
        "ppo.trl.seconds_per_iteration": seconds,
        "ppo.trl.tokens_per_s": tokens / seconds,
        "ppo.trl.stage.gen": pooled("trl.gen_seconds"),
        "ppo.trl.stage.rollout_other": pooled("trl.rollout_other_seconds"),
        "ppo.trl.stage.update": pooled("trl.update_seconds"),
        "ppo.trl.runs": len(runs),
        "ppo.trl.versions": runs[0]["trl.versions"],
    }


# ------------------------------------------------------------------------------------- run

SIZES = {  # per scale: prompts per iteration, their length, new tokens, micro-batch rows
    "workload": dict(batch=32, prompt_len=64, new_tokens=64, micro_batch=8),
    "0.5b": dict(batch=64, prompt_len=128, new_tokens=128, micro_batch=16),
}
SMALL = dict(batch=4, prompt_len=8, new_tokens=8, micro_batch=2)  # the smoke test's sizes
ITERATIONS = {"workload": (2, 5), "0.5b": (1, 3)}  # per scale: (warm-up, measured)
ALL_KW = dict(bypass=False)  # what `scripts/bench.py all` runs (its 10 minutes)


def run(*, small: bool = False, scale="workload", warmup: int | None = None,
        repeats: int | None = None, trl_python: str | None = None, rounds: int = 2,
        values_in_update: bool = True, overrides: Sequence[str] = (),
        bypass: bool = True) -> dict:
    """The WORKLOAD.md iteration, or with `small=True` a shrunken one for the smoke test.

    `scale`: `workload` (WORKLOAD.md) or `0.5b` (see the module doc). `trl_python`: also run
    TRL's PPO on the workload, `rounds` times, in turns with this trainer's measured
    iterations (see the module doc). `values_in_update`: `critic.values_in_update`.
    `overrides`: more `key=value` config overrides of both trainers (e.g.
    `actor_rollout_ref.rollout.max_concurrent_decodes=16` to try a rollout setting).
    `bypass`: also the bypass-mode trainer (`ppo.bypass.*`), in turns.
    At least one warm-up iteration runs: the first is the launch's first step.
    """
    scale = get_scale(scale)
    warmup = max(1, ITERATIONS[scale.name][0] if warmup is None else warmup)
    repeats = ITERATIONS[scale.name][1] if repeats is None else repeats
    if trl_python is not None:
        if scale.name != "workload":
            raise UserError(f"--trl-python runs TRL on WORKLOAD.md's model: it does not go "
                            f"with --scale {scale.name}")
        check_trl(trl_python, TRL_SCRIPT)  # a broken environment fails before any work
    sizes, model = SIZES[scale.name], scale.model or WORKLOAD_MODEL
    if small:
        sizes, model, warmup, repeats = SMALL, SMALL_MODEL, 1, 1
    rounds = rounds if trl_python is not None else 1
    prompts = workload_prompts(warmup + repeats * rounds, sizes["batch"], sizes["prompt_len"])
    prompts = prompts % model["vocab_size"]
    overrides = [f"data.max_response_length={sizes['new_tokens']}",
                 f"critic.values_in_update={str(values_in_update).lower()}", *overrides]
    with tempfile.TemporaryDirectory(prefix="rlhf_jax_bench_ppo_") as tmp:
        kw = dict(model=model, dtype=scale.dtype, micro_batch=sizes["micro_batch"])
        cfg = workload_config(pathlib.Path(tmp), prompts, **kw, overrides=overrides)
        with CompileLog() as log:  # the launch: build, then the first warm-up step
            t0 = time.perf_counter()
            main = Run(cfg)
            main.step(0)
            launch = time.perf_counter() - t0
        bypass = bypass and Run(workload_config(pathlib.Path(tmp, "bypass"), prompts, **kw,
                                                overrides=[*overrides, "algorithm."
                                                           "rollout_correction.bypass_mode=true"]))
        try:
            out = _measure(main, bypass or None, warmup, repeats, rounds, trl_python, scale,
                           small)
        finally:
            main.close()
            if bypass:
                bypass.close()
    out["ppo.launch_to_first_step_seconds"] = launch
    out.update(log.figures("ppo.compile"))
    return out


def _measure(main: Run, bypass: Run | None, warmup: int, repeats: int, rounds: int,
             trl_python: str | None, scale, small: bool) -> dict:
    counter = CompileCounter()
    records, bypassed, peaks, trl_runs, steal = [], [], [], [], [0, 0]
    for i in range(warmup):
        if i:  # run() made the first
            main.step(i)
        if bypass is not None:
            bypass.step(i)
    for r in range(rounds):
        if trl_python is not None:
            trl_runs.append(run_trl(trl_python, "--iterations", str(TRL_WARMUP + repeats)))
        for j in range(repeats):
            k = warmup + r * repeats + j
            before = cpu_ticks()
            with counter.counting(True):
                records.append(main.step(k))
            after = cpu_ticks()
            if before and after:
                steal = [steal[0] + after[0] - before[0], steal[1] + after[1] - before[1]]
            # the peak right after each iteration, under the same load of a shared machine
            peaks.append(matmul_peak_flops(64 if small else scale.peak_n,
                                           repeats=3 if small else 5,
                                           dtype=jnp.dtype(scale.dtype)))
            if bypass is not None:
                with counter.counting(True):
                    bypassed.append(bypass.step(k))
    cfg = main.trainer.cfg
    batch, seq_len = cfg.data.train_batch_size, cfg.data.max_prompt_length \
        + cfg.data.max_response_length
    peak = statistics.median(peaks)
    med = lambda k: statistics.median(r[k] for r in records)
    seconds = med("step")
    tokens = batch * seq_len
    flops = workload_flops(main.trainer.actor_model.cfg, batch, seq_len)
    out = {
        "ppo.seconds_per_iteration": seconds,
        "ppo.seconds_min": min(r["step"] for r in records),
        "ppo.tokens_per_s": tokens / seconds,
        "ppo.flops_per_iteration": flops,
        "ppo.peak_matmul_flops": peak,
        "ppo.bound_seconds": flops / peak,
        "ppo.flop_bound_ratio": flops / (peak * seconds),
        "ppo.measured_iterations": len(records),
        "ppo.compiles_measured": counter.count,
        "ppo.devices": jax.device_count(),
        "ppo.scale": scale.name,
        "ppo.dtype": scale.dtype,
        "ppo.peak_rss_mb": peak_rss_mb(),
    }
    if scale.name == "workload":  # WORKLOAD.md's TRL figure is for its model only
        out["ppo.trl_tokens_per_s_reference"] = TRL_TOKENS_PER_S
        out["ppo.ratio_to_trl_reference"] = tokens / seconds / TRL_TOKENS_PER_S
    if steal[1] > 0:
        out["ppo.cpu_steal_fraction"] = steal[0] / steal[1]
    if bypassed:
        bypass_seconds = statistics.median(r["step"] for r in bypassed)
        out["ppo.bypass.seconds_per_iteration"] = bypass_seconds
        out["ppo.bypass.tokens_per_s"] = tokens / bypass_seconds
    if trl_runs:
        out.update(_trl_figures(trl_runs, tokens))
        out["ppo.ratio_to_trl"] = out["ppo.tokens_per_s"] / out["ppo.trl.tokens_per_s"]
        if bypassed:
            out["ppo.bypass.ratio_to_trl"] = (out["ppo.bypass.tokens_per_s"]
                                              / out["ppo.trl.tokens_per_s"])
    stages = [s for s in records[0] if s != "step"]
    for r in records:  # outside every stage: the step's metrics
        r["other"] = r["step"] - sum(r.get(s, 0.0) for s in stages)
    out.update({f"ppo.stage.{s}": med(s) for s in (*stages, "other")})
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=1, sort_keys=True))
