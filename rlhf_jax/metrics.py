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
                 max_response_length: int, max_prompt_length: int, values=None,
                 sampled_mask=None):
    """verl's `compute_data_metrics`: statistics over valid tokens and sequences.

    As verl's, the score and reward statistics leave out aborted responses (length 0) and
    `response_length_non_aborted/*` and `response/aborted_ratio` report them (the engine
    always samples at least one token, so the ratio is 0 unless a custom path aborts).

    Args (numpy): scores [N]; token_rewards, advantages, returns, values, response_mask [N, R];
      prompt_mask [N, P]; sampled_mask [N, R], the responses as sampled (before rollout
      correction's rejection emptied some loss masks), which tells the aborted ones; None:
      response_mask.
    """
    mask = response_mask.astype(bool)
    resp_len = response_mask.sum(-1)
    prompt_len = prompt_mask.sum(-1)
    kept = (resp_len if sampled_mask is None else np.asarray(sampled_mask).sum(-1)) > 0
    out = {}
    out.update(_stats("critic/score", np.asarray(scores)[kept]))
    out.update(_stats("critic/rewards", (token_rewards * response_mask).sum(-1)[kept]))
    out.update(_stats("critic/advantages", advantages[mask]))
    out.update(_stats("critic/returns", returns[mask]))
    if values is not None:
        out.update(_stats("critic/values", values[mask]))
        ret, val = returns[mask], values[mask]
        var = np.var(ret)
        out["critic/vf_explained_var"] = float(1.0 - np.var(ret - val) / (var + 1e-5))
    out.update(_stats("response_length", resp_len.astype(np.float32)))
    out["response_length/clip_ratio"] = float(np.mean(resp_len == max_response_length))
    nan = float("nan")
    live = resp_len[kept].astype(np.float32)
    out.update(_stats("response_length_non_aborted", live) or dict.fromkeys(
        [f"response_length_non_aborted/{k}" for k in ("mean", "max", "min")], nan))
    out["response_length_non_aborted/clip_ratio"] = (
        float(np.mean(live == max_response_length)) if live.size else nan)
    out["response/aborted_ratio"] = float(np.mean(~kept))
    out.update(_stats("prompt_length", prompt_len.astype(np.float32)))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_len == max_prompt_length))
    return out


# verl's `compute_timing_metrics`: the stages it divides by a token count, and which count.
PER_TOKEN_STAGES = {"gen": "response", "ref": "all", "values": "all", "adv": "all",
                    "update_critic": "all", "update_actor": "all"}


def timing_per_token_ms(metrics: dict, prompt_tokens: float, response_tokens: float) -> dict:
    """verl's `timing_per_token_ms/<stage>`: a stage's `timing_s/<stage>` in milliseconds per
    token (response tokens for `gen`, prompt + response tokens for the others; 0 when there
    are none), for the stages of `PER_TOKEN_STAGES` that the step timed."""
    count = {"response": float(response_tokens), "all": float(prompt_tokens + response_tokens)}
    out = {}
    for stage, which in PER_TOKEN_STAGES.items():
        seconds = metrics.get(f"timing_s/{stage}")
        if seconds is not None:
            n = count[which]
            out[f"timing_per_token_ms/{stage}"] = seconds * 1000 / n if n > 0 else 0.0
    return out


def memory_metrics() -> dict[str, float]:
    """verl's `perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb` (the peak over
    this process's devices, in GiB) and `perf/cpu_memory_used_gb` (the host's used memory,
    psutil's `virtual_memory().used`, as verl's).

    From each device's allocator statistics (`peak_bytes_in_use`; reserved: the allocator's
    pool, `peak_pool_bytes` / `pool_bytes`, else `peak_bytes_reserved`). A backend without
    statistics (the CPU one, whose arrays live in host memory) reports the process's peak
    resident memory for both.
    """
    import resource

    import jax
    import psutil

    allocated = reserved = 0.0
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(s for s in stats):
        for s in stats:
            peak = s.get("peak_bytes_in_use", s.get("bytes_in_use", 0))
            pool = s.get("peak_pool_bytes") or s.get("pool_bytes") or s.get(
                "peak_bytes_reserved") or peak
            allocated, reserved = max(allocated, peak), max(reserved, pool)
    else:  # ru_maxrss is in KiB on Linux
        allocated = reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    gib = 1024.0**3
    return {"perf/max_memory_allocated_gb": allocated / gib,
            "perf/max_memory_reserved_gb": reserved / gib,
            "perf/cpu_memory_used_gb": psutil.virtual_memory().used / gib}


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
