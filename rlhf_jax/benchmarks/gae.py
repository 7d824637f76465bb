"""GAE benchmark: the compiled reverse scan against verl's NumPy loop over time.

- `gae.jax_seconds`: jitted `core_algos.compute_gae_advantage_return` (reverse `lax.scan`,
  then masked whitening) on `[512, 2048]` float32 rewards / values / mask.
- `gae.numpy_seconds`: verl's algorithm as a reverse Python loop over time, vectorised over
  the batch with NumPy, whitening included.
- `gae.speedup` = numpy_seconds / jax_seconds (target >= 20). The two are timed in turns
  (`interleaved`: NumPy once, then the compiled version `JAX_CALLS` times), so both see the
  same load of a shared machine; each figure is a median;
  `gae.max_abs_diff` checks that both compute the same advantages and returns.
"""

from __future__ import annotations

import jax
import numpy as np

from rlhf_jax import core_algos
from rlhf_jax.benchmarks.common import Timing, interleaved


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


JAX_CALLS = 5  # compiled calls per NumPy call in each turn (the NumPy loop is ~20x longer)


def run(*, small: bool = False, batch: int = 512, time: int = 2048, repeats: int = 25) -> dict:
    """Both GAE implementations on the same `[batch, time]` arrays."""
    if small:
        batch, time, repeats = 8, 16, 1
    gamma, lam = 1.0, 0.95
    rewards, values, mask = inputs(batch, time)
    fn = jax.jit(core_algos.compute_gae_advantage_return)
    dev = jax.device_put((rewards, values, mask))
    fns = {"numpy": lambda: numpy_gae(rewards, values, mask, gamma, lam)}
    fns.update({f"jax{i}": lambda: fn(*dev, gamma, lam) for i in range(JAX_CALLS)})
    timings = interleaved(fns, warmup=1, repeats=repeats)
    t_np = timings[0]
    t_jax = Timing(tuple(t for tm in timings[1:] for t in tm.times))
    got = jax.device_get(fn(*dev, gamma, lam))
    want = numpy_gae(rewards, values, mask, gamma, lam)
    diff = max(float(np.max(np.abs(g - w) * mask)) for g, w in zip(got, want, strict=True))
    return {
        "gae.jax_seconds": t_jax.median,
        "gae.numpy_seconds": t_np.median,
        "gae.speedup": t_np.median / t_jax.median,
        "gae.max_abs_diff": diff,
        "gae.shape": f"{batch}x{time}",
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, sort_keys=True))
