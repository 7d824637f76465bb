"""Timing helpers shared by the benchmarks: warm-up, median of repeats, peak RSS, versions.

    t = timed(lambda: step(x), warmup=2, repeats=5)   # blocks on the result every time
    t.median, t.min, t.times
    a, b = interleaved({"a": f, "b": g}, repeats=5)  # a figure and its reference, in turns

The workload of `/work/shared/bench/WORKLOAD.md` (model and prompts) lives here too, so that
every benchmark measures the same thing.
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
WORKLOAD_PAD_ID = 1024  # one past the vocabulary: never sampled, never embedded


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
