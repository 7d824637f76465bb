"""Metrics with verl's names, MFU, and the console / JSON-lines trackers."""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np

# Dense peak FLOP/s per device by `device_kind` substring (bf16 on accelerators).
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
    "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
    "TPU v6": 918e12,
}


class Timer:
    """Collects `timing_s/<name>` for one step: `with timer("gen"): ...`."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()),
            f"{prefix}/min": float(x.min())}


def data_metrics(*, scores, token_rewards, advantages, returns, response_mask, prompt_mask,
                 max_response_length: int, max_prompt_length: int, values=None):
    """verl's `compute_data_metrics`: statistics over valid tokens and sequences.

    Args (numpy): scores [N]; token_rewards, advantages, returns, values, response_mask [N, R];
      prompt_mask [N, P].
    """
    mask = response_mask.astype(bool)
    resp_len = response_mask.sum(-1)
    prompt_len = prompt_mask.sum(-1)
    out = {}
    out.update(_stats("critic/score", np.asarray(scores)))
    out.update(_stats("critic/rewards", (token_rewards * response_mask).sum(-1)))
    out.update(_stats("critic/advantages", advantages[mask]))
    out.update(_stats("critic/returns", returns[mask]))
    if values is not None:
        out.update(_stats("critic/values", values[mask]))
        ret, val = returns[mask], values[mask]
        var = np.var(ret)
        out["critic/vf_explained_var"] = float(1.0 - np.var(ret - val) / (var + 1e-5))
    out.update(_stats("response_length", resp_len.astype(np.float32)))
    out["response_length/clip_ratio"] = float(np.mean(resp_len == max_response_length))
    out.update(_stats("prompt_length", prompt_len.astype(np.float32)))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_len == max_prompt_length))
    return out


def train_flops(model_cfg, seq_lens: np.ndarray, passes: float = 1.0) -> float:
    """DESIGN.md's MFU numerator: 6*N*tokens + 6*sum(seqlen^2)*head_dim*heads*layers per pass.

    N = L*(3*h*I + h*(q+k+v+o)) + 2*V*h (`ModelConfig.num_matmul_params`).
    """
    c = model_cfg
    tokens = float(np.sum(seq_lens))
    attn = 6.0 * float(np.sum(np.asarray(seq_lens, np.float64) ** 2)) * c.head_dim
    attn *= c.num_attention_heads * c.num_hidden_layers
    return passes * (6.0 * c.num_matmul_params * tokens + attn)


def step_perf(metrics: dict, seq_lens: np.ndarray, peak_flops_per_device: float, actor_cfg,
              actor_epochs: int, critic_cfg=None, critic_epochs: int | None = None) -> dict:
    """`perf/*` of one step from its `timing_s/*` (`metrics`) and its sequence lengths:
    throughput per device and the MFU of each update (`train_flops` over the update's time
    and the devices' peak)."""
    import jax

    tokens = float(seq_lens.sum())
    devices = jax.device_count()
    seconds = metrics["timing_s/step"]
    out = {"perf/total_num_tokens": tokens, "perf/time_per_step": seconds,
           "perf/throughput": tokens / (seconds * devices)}
    peak = peak_flops_per_device * devices
    if "timing_s/update_actor" in metrics:
        flops = train_flops(actor_cfg, seq_lens, actor_epochs)
        out["perf/mfu/actor"] = flops / (metrics["timing_s/update_actor"] * peak)
    if "timing_s/update_critic" in metrics:
        flops = train_flops(critic_cfg, seq_lens, critic_epochs or actor_epochs)
        out["perf/mfu/critic"] = flops / (metrics["timing_s/update_critic"] * peak)
    return out


_MEASURED_PEAK: dict[str, float] = {}


def datasheet_peak_flops(device_kind: str) -> float | None:
    """`PEAK_FLOPS` of the first key found in `device_kind` (case-insensitive), else None."""
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in device_kind.lower()), None)


def peak_flops_per_device() -> float:
    """From the device table, or (CPU and unknown devices) measured once with a jitted matmul."""
    import jax
    import jax.numpy as jnp

    kind = jax.local_devices()[0].device_kind
    sheet = datasheet_peak_flops(kind)
    if sheet is not None:
        return sheet
    if kind not in _MEASURED_PEAK:
        n = 1024
        a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.local_devices()[0])
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        best = math.inf
        for _ in range(5):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = min(best, time.perf_counter() - t)
        _MEASURED_PEAK[kind] = 2 * n**3 / best
    return _MEASURED_PEAK[kind]
