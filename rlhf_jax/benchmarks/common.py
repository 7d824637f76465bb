"""Timing helpers shared by the benchmarks: warm-up, median of repeats, peak RSS, versions.

    t = timed(lambda: step(x), warmup=2, repeats=5)   # blocks on the result every time
    t.median, t.min, t.times
    a, b = interleaved({"a": f, "b": g}, repeats=5)  # a figure and its reference, in turns

The workload of `/work/shared/bench/WORKLOAD.md` (model and prompts) lives here too, so that
every benchmark measures the same thing, and so do the scales the benchmarks run at
(`get_scale`): `workload`, the default, for the 2-core CPU machine, and `0.5b`, the Qwen2.5-0.5B
architecture with bfloat16 compute, for one accelerator (`scripts/bench.py --scale 0.5b`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# WORKLOAD.md: Qwen2 architecture, random init, float32.
WORKLOAD_MODEL = dict(
    model_type="qwen2", vocab_size=1024, hidden_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=688, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-6,
)

# The Qwen2.5-0.5B architecture (random init): 494M parameters, 136M of them the tied
# embedding.
QWEN2_5_0_5B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, rope_theta=1e6,
    tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
)

# The one-layer model of the decode, rollout and ppo smoke tests (`run(small=True)`).
SMALL_MODEL = dict(model_type="qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                   max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Scale:
    """The model and precision the benchmarks run at.

    `model`: an HF config dict, or None for each benchmark's own model at the `workload`
    scale (WORKLOAD.md's; `mfu` uses a larger one). `dtype`: the compute dtype (parameters
    and optimizer state stay float32). `peak_n`: the size of the square matmul whose FLOP/s
    is the measured peak, in `dtype`. Each benchmark keeps its batch sizes per scale.
    """

    name: str
    model: dict | None = None
    dtype: str = "float32"
    peak_n: int = 1024

    def model_config(self, default: dict | None = None):
        from rlhf_jax.models import ModelConfig

        return ModelConfig.from_hf(self.model or default or WORKLOAD_MODEL)


SCALES = {
    "workload": Scale("workload"),
    "0.5b": Scale("0.5b", QWEN2_5_0_5B, dtype="bfloat16", peak_n=8192),
}


def get_scale(name: str | Scale) -> Scale:
    """`SCALES[name]`; an unknown name is a one-line `UserError`."""
    if isinstance(name, Scale):
        return name
    if name not in SCALES:
        from rlhf_jax.errors import UserError

        raise UserError(f"unknown scale {name!r} (known: {', '.join(SCALES)})")
    return SCALES[name]


def datasheet_peak(dtype: str) -> float | None:
    """The datasheet's dense bfloat16 matmul FLOP/s of this process's first device
    (`metrics.datasheet_peak_flops`), for a bfloat16 benchmark off CPU; else None."""
    import jax

    from rlhf_jax.metrics import datasheet_peak_flops

    device = jax.devices()[0]
    if dtype != "bfloat16" or device.platform == "cpu":
        return None
    return datasheet_peak_flops(device.device_kind)


def eos_free_sampling(cfg, new_tokens: int):
    """Plain ancestral sampling at temperature 1 with EOS disabled (WORKLOAD.md): the only EOS
    and the pad id is one past the vocabulary, never sampled and never embedded."""
    from rlhf_jax.rollout import SamplingParams

    pad = cfg.vocab_size
    return SamplingParams(temperature=1.0, max_response_length=new_tokens, eos_ids=(pad,),
                          pad_id=pad)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of each measured repeat (warm-up excluded)."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)


def block(x):
    """Waits for every array in `x` (a pytree) and returns it."""
    import jax

    return jax.block_until_ready(x)


def timed(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5,
          setup: Callable[[], Any] | None = None) -> Timing:
    """Runs `fn` `warmup` times unmeasured, then `repeats` times, blocking on each result.

    `setup`, if given, runs before every call outside the clock (e.g. a fresh input).
    """
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        block(fn())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return Timing(tuple(times))


def interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int = 1,
                repeats: int = 5) -> list[Timing]:
    """Times several functions in turns (f, g, f, g, ...), blocking on each result.

    A figure and its reference measured this way see the same load of a shared machine,
    which back-to-back runs of `timed` do not. Returns one `Timing` per function, in order.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return [Timing(tuple(times[k])) for k in fns]


def peak_rss_mb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) CPU ticks of the machine so far, from Linux `/proc/stat`; None elsewhere.

    Steal is the time a hypervisor ran something else while this VM had work: the share of it
    over an interval tells a slow run of a shared machine from a slow program.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def versions(packages=("jax", "jaxlib", "flax", "numpy", "optax")) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def device_info() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {"platform": devices[0].platform, "device_count": len(devices),
            "device_kind": devices[0].device_kind}


def workload_model_config():
    from rlhf_jax.models import ModelConfig

    return ModelConfig.from_hf(WORKLOAD_MODEL)


def workload_prompts(iterations: int, batch: int = 32, length: int = 64) -> np.ndarray:
    """[iterations, batch, length] int32 prompt ids, as every peer benchmark draws them."""
    rng = np.random.default_rng(0)
    return rng.integers(3, WORKLOAD_MODEL["vocab_size"], size=(iterations, batch, length)).astype(
        np.int32)


def on_cpu_devices(module: str, *args: str, devices: int = 8) -> dict:
    """The JSON object that `python -m <module> --in-process *args` prints on its last line,
    run with `devices` simulated CPU devices: for a benchmark whose mesh needs more devices
    than this process has."""
    import json
    import os
    import subprocess

    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    out = subprocess.run([sys.executable, "-m", module, "--in-process", *args], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        from rlhf_jax.errors import UserError

        how = (f"was killed by signal {-out.returncode}" if out.returncode < 0
               else f"exited with {out.returncode}")
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"{module} on {devices} simulated CPU devices {how}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def scale_arg(argv: list[str]) -> str:
    """The NAME of `--scale NAME` in a benchmark module's command line (default workload)."""
    return argv[argv.index("--scale") + 1] if "--scale" in argv else "workload"
