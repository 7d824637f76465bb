"""GAE benchmark: the compiled reverse scan against verl's NumPy loop over time.

- `gae.jax_seconds`: jitted `core_algos.compute_gae_advantage_return` (reverse `lax.scan`,
  then masked whitening) on `[512, 2048]` float32 rewards / values / mask.
- `gae.numpy_seconds`: verl's algorithm as a reverse Python loop over time, vectorised over
  the batch with NumPy, whitening included.
- `gae.speedup` = numpy_seconds / jax_seconds (target >= 20). The two are timed in turns of
  equal length, so both see the same load of a shared machine: NumPy once, then the compiled
  version for as many calls as fill the NumPy call's time (`gae.jax_calls_per_turn`, from
  the warm-up turn). Each figure is a median over its calls.
- `gae.jax_seconds_first_in_turn`: the median of the first compiled call of each turn. It
  is slower, and not GAE's cost: the single-threaded NumPy call leaves the second core idle
  for ~80 ms, and the compiled GAE, which uses both, waits for it to wake up (a compiled
  call after an 80 ms sleep is as slow). In a trainer the advantage step follows the values
  pass, with every core busy.
- `gae.max_abs_diff` checks that both compute the same advantages and returns.
"""

from __future__ import annotations

import math
import statistics

import jax
import numpy as np

from rlhf_jax import core_algos
from rlhf_jax.benchmarks.common import get_scale, timed


def numpy_gae(rewards, values, mask, gamma: float, lam: float):
    """verl's `compute_gae_advantage_return`, loop over time: (advantages, returns)."""
    b, t = rewards.shape
    next_v = np.zeros(b, rewards.dtype)
    last = np.zeros(b, rewards.dtype)
    adv = np.empty_like(rewards)
    for i in reversed(range(t)):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_v - values[:, i]
        gae = delta + gamma * lam * last
        next_v = values[:, i] * m + (1 - m) * next_v
        last = gae * m + (1 - m) * last
        adv[:, i] = last
    returns = adv + values
    n = mask.sum()
    mean = (adv * mask).sum() / (n + 1e-8)
    var = (np.square(adv - mean) * mask).sum() / (n + 1e-8) * (n / (n - 1))
    return (adv - mean) / np.sqrt(var + 1e-8), returns


def inputs(batch: int, time: int, seed: int = 0):
    """Random rewards and values, right-padded masks of random lengths (float32)."""
    rng = np.random.default_rng(seed)
    rewards = rng.standard_normal((batch, time)).astype(np.float32) * 0.1
    values = rng.standard_normal((batch, time)).astype(np.float32)
    lengths = rng.integers(1, time + 1, size=batch)
    mask = (np.arange(time)[None] < lengths[:, None]).astype(np.float32)
    return rewards, values, mask


def run(*, small: bool = False, scale="workload", batch: int = 512, time: int = 2048,
        repeats: int = 25) -> dict:
    """Both GAE implementations on the same `[batch, time]` arrays (float32 at every scale:
    GAE has no model)."""
    get_scale(scale)
    if small:
        batch, time, repeats = 8, 16, 1
    gamma, lam = 1.0, 0.95
    rewards, values, mask = inputs(batch, time)
    fn = jax.jit(core_algos.compute_gae_advantage_return)
    dev = jax.device_put((rewards, values, mask))
    run_numpy = lambda: numpy_gae(rewards, values, mask, gamma, lam)
    run_jax = lambda: fn(*dev, gamma, lam)
    run_jax()  # compiles
    # the warm-up turn sizes the others: as many compiled calls as fill one NumPy call
    warm_np = timed(run_numpy, warmup=0, repeats=1).min
    calls = max(5, math.ceil(warm_np / timed(run_jax, warmup=0, repeats=5).min))
    t_np, t_jax, first = [], [], []
    for _ in range(repeats):
        t_np.append(timed(run_numpy, warmup=0, repeats=1).min)
        times = timed(run_jax, warmup=0, repeats=calls).times
        t_jax += times
        first.append(times[0])
    got = jax.device_get(fn(*dev, gamma, lam))
    want = numpy_gae(rewards, values, mask, gamma, lam)
    diff = max(float(np.max(np.abs(g - w) * mask)) for g, w in zip(got, want, strict=True))
    return {
        "gae.jax_seconds": statistics.median(t_jax),
        "gae.numpy_seconds": statistics.median(t_np),
        "gae.speedup": statistics.median(t_np) / statistics.median(t_jax),
        "gae.jax_seconds_first_in_turn": statistics.median(first),
        "gae.jax_calls_per_turn": calls,
        "gae.max_abs_diff": diff,
        "gae.shape": f"{batch}x{time}",
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, sort_keys=True))
