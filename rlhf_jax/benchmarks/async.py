"""`python scripts/bench.py async`: rewards off the critical path, and the one-step-off split.

(a) The PPO iteration of WORKLOAD.md (`ppo_workload.yaml`, one device, a separate values
pass) with a slow reward: `slow_even_fraction` sleeps `SLEEP_S` (20 ms) a sample inside the
reward function, as a sandbox or a judge would wait, then scores as the workload does. Two
trainers in turns: rewards inline (`reward.num_workers=0`) and in a pool of 8 workers
(verl's default), which scores while the old log-prob, reference and value passes run.
`async.reward_hidden_fraction` is the share of the inline reward time that no longer sits on
the step's critical path (`1 - timing_s/reward(pool) / timing_s/reward(inline)`, the pool's
being its submission plus the wait before the advantages);
`async.reward_hidden_fraction_by_iteration` is the same share read off the iteration times
(`(T_inline - T_pool) / timing_s/reward(inline)`, noisier on a shared machine).

(b) The one-step-off mode on 8 simulated CPU devices (a subprocess when this process has
fewer): the synchronous trainer on the (2,2,2) mesh against `hybrid_engine=false` on
`meshes/cpu-8-async.yaml` (train on devices 0-3, generate on 4-7, `max_staleness` 1), one
after the other (the asynchronous run's rollout thread would load the other's steps).
`async.speedup` is the synchronous seconds per iteration over the asynchronous ones. The
simulated devices share the host's cores, so the two groups' work competes for the same CPUs
there: the figure shows the mode's overheads, not the gain of devices of its own.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax

from rlhf_jax import async_rollout
from rlhf_jax.benchmarks import ppo
from rlhf_jax.benchmarks.common import (
    SMALL_MODEL,
    WORKLOAD_MODEL,
    get_scale,
    on_cpu_devices,
    scale_arg,
    workload_prompts,
)
from rlhf_jax.trainer import Trainer

SLEEP_S = 0.02  # the simulated reward's seconds a sample
WORKERS = 8  # verl's default reward.num_workers
ITERATIONS = (1, 4)  # warm-up, measured
ALL_KW = dict(iterations=(1, 2))  # what `scripts/bench.py all` runs (its 10 minutes)
SPLIT_SIZES = dict(batch=16, prompt_len=32, new_tokens=32, micro_batch=2)
SMALL_SPLIT = dict(batch=8, prompt_len=8, new_tokens=8, micro_batch=1)  # the smoke test's


def slow_even_fraction(data_source, solution_str: str, ground_truth, extra_info) -> float:
    """WORKLOAD.md's reward after `SLEEP_S` seconds of waiting (a sandbox, a judge)."""
    time.sleep(SLEEP_S)
    return ppo.even_fraction(data_source, solution_str, ground_truth, extra_info)


def _config(workdir: pathlib.Path, prompts, sizes: dict, model: dict, dtype: str,
            overrides: list[str]):
    return ppo.workload_config(workdir, prompts, model=model, dtype=dtype,
                               micro_batch=sizes["micro_batch"], overrides=[
                                   f"data.max_response_length={sizes['new_tokens']}",
                                   *overrides])


def rewards(scale: str = "workload", small: bool = False, iterations=ITERATIONS) -> dict:
    """Part (a): the slow reward inline and in the pool, in turns."""
    scale = get_scale(scale)
    sizes, model = ppo.SIZES[scale.name], scale.model or WORKLOAD_MODEL
    warmup, repeats = iterations
    if small:
        sizes, model, warmup, repeats = ppo.SMALL, SMALL_MODEL, 1, 1
    prompts = workload_prompts(warmup + repeats, sizes["batch"], sizes["prompt_len"])
    prompts = prompts % model["vocab_size"]
    slow = ["reward.custom_reward_function.path=rlhf_jax.benchmarks.async",
            "reward.custom_reward_function.name=slow_even_fraction",
            "critic.values_in_update=false"]
    with tempfile.TemporaryDirectory(prefix="rlhf_jax_bench_async_") as tmp:
        runs = {name: ppo.Run(_config(pathlib.Path(tmp, name), prompts, sizes, model,
                                      scale.dtype, [*slow, f"reward.num_workers={workers}"]))
                for name, workers in (("inline", 0), ("pool", WORKERS))}
        got: dict[str, list[dict]] = {name: [] for name in runs}
        try:
            for k in range(warmup + repeats):
                for name, run in runs.items():
                    record = run.step(k)
                    if k >= warmup:
                        got[name].append(record)
        finally:
            for run in runs.values():
                run.close()
            runs["pool"].trainer.reward_pool.close()
    med = lambda name, key: statistics.median(r[key] for r in got[name])
    inline, pool = med("inline", "reward"), med("pool", "reward")
    t_inline, t_pool = med("inline", "step"), med("pool", "step")
    return {
        "async.reward_sleep_seconds_per_sample": SLEEP_S,
        "async.reward_workers": WORKERS,
        "async.reward_samples_per_iteration": sizes["batch"],
        "async.reward_inline_seconds": inline,
        "async.reward_pool_critical_seconds": pool,
        "async.reward_hidden_fraction": 1.0 - pool / inline,
        "async.reward_inline.seconds_per_iteration": t_inline,
        "async.reward_pool.seconds_per_iteration": t_pool,
        "async.reward_hidden_fraction_by_iteration": (t_inline - t_pool) / inline,
        "async.measured_iterations": repeats,
    }


def one_step_off(scale: str = "workload", small: bool = False,
                 iterations=ITERATIONS) -> dict:
    """Part (b), on 8 devices: the synchronous trainer, then the one-step-off one."""
    scale = get_scale(scale)
    sizes, model = SPLIT_SIZES, scale.model or WORKLOAD_MODEL
    warmup, repeats = iterations
    if small:
        sizes, model, warmup, repeats = SMALL_SPLIT, SMALL_MODEL, 2, 2
    prompts = workload_prompts(warmup + repeats + 2, sizes["batch"], sizes["prompt_len"])
    prompts = prompts % model["vocab_size"]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="rlhf_jax_bench_async_") as tmp:
        sync = ppo.Run(_config(pathlib.Path(tmp, "sync"), prompts, sizes, model, scale.dtype,
                               ["mesh=cpu-8"]))
        try:
            times = [sync.step(k)["step"] for k in range(warmup + repeats)][warmup:]
        finally:
            sync.close()
        out["async.sync.seconds_per_iteration"] = statistics.median(times)
        trainer = Trainer(_config(pathlib.Path(tmp, "async"), prompts, sizes, model,
                                  scale.dtype, ["mesh=cpu-8-async",
                                                "actor_rollout_ref.hybrid_engine=false"]))
        pipe = async_rollout.OneStepOff(trainer)
        state, records = trainer.state, []
        try:
            for _ in range(warmup + repeats):
                state, metrics = pipe.step(state)
                jax.block_until_ready((state.actor, state.critic))
                records.append(metrics)
        finally:
            pipe.close()
            trainer.checkpointer.close()
    med = lambda key: statistics.median(m[key] for m in records[warmup:])
    out.update({
        "async.one_step_off.seconds_per_iteration": med("timing_s/step"),
        "async.speedup": out["async.sync.seconds_per_iteration"] / med("timing_s/step"),
        "async.one_step_off.gen_seconds": med("timing_s/gen"),
        "async.one_step_off.gen_wait_seconds": med("timing_s/gen_wait"),
        "async.one_step_off.sync_wait_seconds": med("timing_s/sync_wait"),
        "async.one_step_off.idle_fraction.train": med("async/idle_fraction/train"),
        "async.one_step_off.idle_fraction.rollout": med("async/idle_fraction/rollout"),
        "async.one_step_off.staleness": med("async/staleness"),
        "async.split": "4 train + 4 rollout of 8 simulated CPU devices",
    })
    return out


def run(*, small: bool = False, scale="workload", iterations=ITERATIONS) -> dict:
    """Both parts, `iterations` = (warm-up, measured) each; (b) in a subprocess with 8 CPU
    devices when this process has fewer."""
    name = get_scale(scale).name
    out = rewards(name, small, tuple(iterations))
    if jax.device_count() >= 8:
        out.update(one_step_off(name, small, tuple(iterations)))
    else:
        out.update(on_cpu_devices("rlhf_jax.benchmarks.async", "--scale", name,
                                  "--iterations", *map(str, iterations),
                                  *(["--small"] if small else [])))
    return out


if __name__ == "__main__":
    if "--in-process" in sys.argv:
        at = sys.argv.index("--iterations") if "--iterations" in sys.argv else None
        its = ITERATIONS if at is None else tuple(int(x) for x in sys.argv[at + 1:at + 3])
        print(json.dumps(one_step_off(scale_arg(sys.argv), "--small" in sys.argv, its)))
    else:
        print(json.dumps(run(), indent=1, sort_keys=True))
