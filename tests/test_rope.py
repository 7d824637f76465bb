"""RoPE variants (`rlhf_jax.models.rope`) against transformers' own RoPE initialisation
(`ROPE_INIT_FUNCTIONS`) and rotary embedding modules, on real and tiny configs."""

import math

import jax
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rlhf_jax.models import ModelConfig
from rlhf_jax.models.ops import rope_table
from rlhf_jax.models.rope import (
    RopeScaling,
    default_inv_freq,
    llama3_inv_freq,
    rope_frequencies,
    yarn_attention_factor,
)

LLAMA_3_1_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=131072)
QWEN2_5_7B = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                  max_position_embeddings=131072)
# (model_type, config fields): each rope_type with several parameter sets.
CONFIGS = {
    "linear-llama": ("llama", dict(**LLAMA_3_1_8B, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "linear-qwen2-head64": ("qwen2", dict(
        hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
        rope_parameters=dict(rope_type="linear", rope_theta=1e6, factor=4.5))),
    "llama3-3.1-8b": ("llama", dict(**LLAMA_3_1_8B, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192))),
    "llama3-3.2-1b": ("llama", dict(hidden_size=2048, num_attention_heads=32, head_dim=64,
                                    max_position_embeddings=131072, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192))),
    "llama3-tiny": ("llama", dict(hidden_size=32, num_attention_heads=4,
                                  max_position_embeddings=128, rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16))),
    "yarn-qwen2.5": ("qwen2", dict(**QWEN2_5_7B, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768))),
    "yarn-attention-factor": ("qwen3", dict(hidden_size=64, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=32,
                                            max_position_embeddings=4096, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=512,
        attention_factor=0.8, beta_fast=16.0, beta_slow=2.0))),
    "yarn-mscale": ("mistral", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                    max_position_embeddings=4096, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64,
        mscale=1.0, mscale_all_dim=0.707, truncate=False))),
    "yarn-null-factor": ("llama", dict(hidden_size=32, num_attention_heads=4,
                                       max_position_embeddings=256, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=None, original_max_position_embeddings=32))),
}


def _rotary_module(hf):
    """The family's own rotary embedding module (without building the model)."""
    names = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral"}
    modeling = getattr(transformers.models, hf.model_type)
    modeling = getattr(modeling, f"modeling_{hf.model_type}")
    return getattr(modeling, f"{names[hf.model_type]}RotaryEmbedding")(hf)


def _hf_config(model_type, fields):
    return transformers.AutoConfig.for_model(
        model_type, vocab_size=64, intermediate_size=64, num_hidden_layers=1, **fields)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frequencies_and_attention_factor_equal_transformers(name):
    hf = _hf_config(*CONFIGS[name])
    rope_type = hf.rope_parameters["rope_type"]
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[rope_type](hf)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.rope_scaling.rope_type == rope_type
    inv, factor = rope_frequencies(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    assert inv.dtype == np.float32 and inv.shape == (cfg.head_dim // 2,)
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("name", ["yarn-qwen2.5", "yarn-attention-factor", "llama3-tiny"])
def test_rope_table_equals_transformers_rotary_embedding(name):
    """cos and sin at positions far past the original context, the attention factor
    included, as the model's rotary module computes them."""
    model_type, fields = CONFIGS[name]
    hf = _hf_config(model_type, fields)
    module = _rotary_module(hf)
    pos = np.array([[0, 1, 17, 500, 4095], [3, 64, 1000, 2047, 40000]], np.int32)
    want_cos, want_sin = module(torch.zeros(1, dtype=torch.float32), torch.tensor(pos))
    cfg = ModelConfig.from_hf(hf.to_dict())
    cos, sin = jax.jit(lambda p: rope_table(
        p, cfg.head_dim, cfg.rope_theta,
        *rope_frequencies(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)))(pos)
    # float32 angles of up to 4e4 rad: a rounding of the product moves cos by ~4e4 * 6e-8
    np.testing.assert_allclose(cos, want_cos.numpy(), atol=5e-3, rtol=0)
    np.testing.assert_allclose(sin, want_sin.numpy(), atol=5e-3, rtol=0)
    near = pos < 2048
    np.testing.assert_allclose(np.asarray(cos)[near], want_cos.numpy()[near], atol=2e-4)


@pytest.mark.parametrize("theta,head_dim", [(10000.0, 8), (1e6, 64), (5e5, 128)])
def test_default_rope_is_transformers_default(theta, head_dim):
    """The default RoPE stays the decoder's in-graph expression (`rope_frequencies` gives no
    table for it), and its frequencies are transformers'."""
    hf = _hf_config("qwen2", dict(hidden_size=head_dim * 2, num_attention_heads=2,
                                  rope_parameters=dict(rope_type="default", rope_theta=theta)))
    module = _rotary_module(hf)
    assert rope_frequencies(theta, head_dim, None) == (None, 1.0)
    np.testing.assert_allclose(default_inv_freq(theta, head_dim), module.inv_freq.numpy(),
                               rtol=1e-6)
    pos = np.arange(48, dtype=np.int32).reshape(2, 24)
    want_cos, want_sin = module(torch.zeros(1), torch.tensor(pos))
    cos, sin = jax.jit(rope_table, static_argnums=(1, 2))(pos, head_dim, theta)
    # XLA's and torch's float32 pow differ by an ulp or two, times angles of up to ~47 rad
    np.testing.assert_allclose(cos, want_cos.numpy(), atol=1e-5)
    np.testing.assert_allclose(sin, want_sin.numpy(), atol=1e-5)


def test_llama3_bands_by_hand():
    """Worked case: original context 16, low / high frequency factors 1 / 4, factor 8:
    wavelengths above 16 / 1 are divided by 8, those below 16 / 4 kept, and 2 pi (between)
    blended with weight (16 / 2 pi - 1) / (4 - 1) on the original."""
    inv = default_inv_freq(10000.0, 8)  # 1, 0.1, 0.01, 0.001: wavelengths 2 pi / inv
    np.testing.assert_allclose(inv, [1, 0.1, 0.01, 0.001], rtol=1e-6)
    got = llama3_inv_freq(10000.0, 8, 8.0, 1.0, 4.0, 16)
    smooth = (16 / (2 * math.pi) - 1) / 3
    np.testing.assert_allclose(got[0], (1 - smooth) * inv[0] / 8 + smooth * inv[0], rtol=1e-6)
    np.testing.assert_allclose(got[1:], inv[1:] / 8, rtol=1e-6)


def test_yarn_attention_factor_by_hand():
    assert yarn_attention_factor(1.0) == 1.0
    assert yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert yarn_attention_factor(4.0, attention_factor=0.5) == 0.5
    ratio = (0.1 * 2 * math.log(4.0) + 1) / (0.1 * 0.5 * math.log(4.0) + 1)
    assert yarn_attention_factor(4.0, mscale=2.0, mscale_all_dim=0.5) == pytest.approx(ratio)


def test_scaling_is_hashable_and_round_trips():
    s = RopeScaling("yarn", 4.0, 32, attention_factor=0.9)
    assert hash(s) == hash(RopeScaling("yarn", 4.0, 32, attention_factor=0.9))
    assert s.to_hf() == {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32, "attention_factor": 0.9}
