"""Architecture hyper-parameters of the Qwen2 / Llama decoder family, read from HF config.json."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_jax.errors import ModelError

_ARCHS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: GQA attention, RoPE, RMSNorm, SwiGLU MLP."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    max_position_embeddings: int = 32768
    model_type: str = "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def num_matmul_params(self) -> int:
        """Parameters that take part in matmuls (the N of the MFU formula, embeddings included)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return L * (3 * h * i + h * (q + 2 * kv) + q * h) + 2 * self.vocab_size * h

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], overrides: Mapping[str, Any] | None = None):
        """From the dict of an HF `config.json` (Qwen2 / Qwen2.5 / Llama)."""
        hf = {**hf, **(overrides or {})}
        model_type = hf.get("model_type")
        if model_type not in _ARCHS:
            raise ModelError(f"unsupported model_type {model_type!r} (supported: qwen2, llama)")
        scaling = hf.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ModelError(f"rope_scaling {scaling!r} is not supported")
        if hf.get("use_sliding_window"):
            raise ModelError("use_sliding_window=true is not supported")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=(
                True if model_type == "qwen2" else bool(hf.get("attention_bias", False))
            ),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )

    def to_hf(self) -> dict[str, Any]:
        """The dict of an HF `config.json` that `transformers` loads as this architecture."""
        out: dict[str, Any] = {
            "architectures": [_ARCHS[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return out


def load_model_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """Reads `<path>/config.json`; a missing file is a one-line `ModelError`."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelError(f"model path {str(path)!r} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{file}: invalid JSON at line {e.lineno}: {e.msg}") from None
    try:
        return ModelConfig.from_hf(raw, overrides)
    except KeyError as e:
        raise ModelError(f"{file}: missing field {e.args[0]!r}") from None
