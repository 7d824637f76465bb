"""Decoder-only transformers (Qwen2 / Llama), value heads and HF checkpoint I/O."""

from rlhf_jax.models.config import ModelConfig, load_model_config
from rlhf_jax.models.model import Model, causal_mask, positions_from_mask
from rlhf_jax.models.stacking import KVCache

__all__ = [
    "KVCache", "Model", "ModelConfig", "causal_mask", "load_model_config", "positions_from_mask",
]
