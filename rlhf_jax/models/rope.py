"""RoPE variants as pure functions of the config: inverse frequencies [H/2] and the factor
that scales cos and sin.

transformers computes both once per model (`ROPE_INIT_FUNCTIONS` in
`transformers/modeling_rope_utils.py`) in float32 torch ops; the functions here repeat each
formula in float32 NumPy, in the same order of operations, so that a checkpoint with scaled
RoPE gets the frequencies transformers gives it (to a float32 rounding of `pow`). They run
once, at trace time: the decoder bakes the result into the graph as a constant.

The default RoPE is not here: the decoder keeps computing it in the graph
(`ops.rope_table`), bit for bit as before. `dynamic` (NTK) is not implemented: transformers
recomputes its frequencies from the longest position of each batch while it runs, so it is no
fixed function of the config (`rlhf_jax.models.config` refuses it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

SCALED_TYPES = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE: the `rope_type` and its parameters from config.json (`None`: unset,
    transformers' default applies). Frozen and hashable, so a `ModelConfig` holding one stays
    a static argument of `jit`."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn

    def to_hf(self) -> dict[str, Any]:
        """The set fields, as config.json's `rope_parameters` holds them (theta aside)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


def _exponents(dim: int) -> np.ndarray:
    """`arange(0, dim, 2) / dim` in float32, the exponent of theta in every variant."""
    return np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)


def default_inv_freq(theta: float, dim: int) -> np.ndarray:
    """`1 / theta^(2i/dim)`, float32 [dim/2]: the original RoPE (and the base of the others)."""
    return np.float32(1.0) / (np.float32(theta) ** _exponents(dim))


def linear_inv_freq(theta: float, dim: int, factor: float) -> np.ndarray:
    """Position interpolation: every frequency divided by `factor` (positions / factor)."""
    return default_inv_freq(theta, dim) / np.float32(factor)


def llama3_inv_freq(theta: float, dim: int, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Llama 3.1's scaling: wavelengths longer than `original / low_freq_factor` are divided
    by `factor`, those shorter than `original / high_freq_factor` kept, and the ones between
    interpolated smoothly in `original / wavelength`."""
    inv = default_inv_freq(theta, dim)
    old = original_max_position_embeddings
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv)
    smooth = (np.float32(old) / wavelen - np.float32(low_freq_factor)) / np.float32(
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, theta: float,
                           original: int, truncate: bool) -> tuple[float, float]:
    """The dims whose wavelength turns `beta_fast` and `beta_slow` times within the original
    context: below the first, frequencies extrapolate; above the second, they interpolate."""
    def dim_of(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(theta: float, dim: int, factor: float, original_max_position_embeddings: int,
                  beta_fast: float | None = None, beta_slow: float | None = None,
                  truncate: bool | None = None) -> np.ndarray:
    """YaRN (Peng et al. 2023): a linear ramp over the dims between the correction range's
    bounds blends the interpolated (`/ factor`) and the original frequencies."""
    pos_freqs = np.float32(theta) ** _exponents(dim)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    low, high = _yarn_correction_range(beta_fast or 32, beta_slow or 1, dim, theta,
                                       original_max_position_embeddings,
                                       True if truncate is None else truncate)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def yarn_attention_factor(factor: float, attention_factor: float | None = None,
                          mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """YaRN's factor on cos and sin (so `mscale^2` on the attention logits): the configured
    one, else `0.1 ln(factor) + 1` (a ratio of two of them with `mscale` and
    `mscale_all_dim`, as DeepSeek writes it)."""
    if attention_factor is not None:
        return float(attention_factor)

    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)


@functools.lru_cache(maxsize=64)
def rope_frequencies(theta: float, head_dim: int, scaling: RopeScaling | None
                     ) -> tuple[np.ndarray | None, float]:
    """(inverse frequencies [H/2] float32, or None for the default RoPE that the decoder
    computes in its graph; the factor on cos and sin). Cached: computed once per config."""
    if scaling is None:
        return None, 1.0
    s = scaling
    if s.rope_type == "linear":
        return linear_inv_freq(theta, head_dim, s.factor), 1.0
    if s.rope_type == "llama3":
        return llama3_inv_freq(theta, head_dim, s.factor, s.low_freq_factor, s.high_freq_factor,
                               s.original_max_position_embeddings), 1.0
    if s.rope_type == "yarn":
        inv = yarn_inv_freq(theta, head_dim, s.factor, s.original_max_position_embeddings,
                            s.beta_fast, s.beta_slow, s.truncate)
        return inv, yarn_attention_factor(s.factor, s.attention_factor, s.mscale,
                                          s.mscale_all_dim)
    raise ValueError(f"rope_type {s.rope_type!r} is not one of {', '.join(SCALED_TYPES)}")
