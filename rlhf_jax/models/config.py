"""Architecture hyper-parameters of the Qwen2 / Qwen3 / Llama / Mistral decoders, read from an
HF config.json by allow-list.

A checkpoint that loads is exactly the model transformers runs, or it does not load: every
field of config.json is either read here (implemented), known not to change the maths
(ids, dtype, generation defaults: ignored), or refused with a one-line `ModelError` naming
the field and its value; an unknown field is refused unless it is null. Both layouts are
read: transformers 4's `rope_theta` + `rope_scaling` and transformers 5's `rope_parameters`.
Absent fields take the defaults of that family's transformers config class (e.g. Mistral's
`sliding_window` 4096, Qwen3's `head_dim` 128). `ModelConfig.to_hf` writes the
transformers 5 layout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_jax.errors import ModelError
from rlhf_jax.models.rope import SCALED_TYPES, RopeScaling


@dataclasses.dataclass(frozen=True)
class Family:
    """What one `model_type` computes, as data: the switches of the decoder it sets, the
    config.json fields its transformers class reads, and their defaults when absent."""

    architecture: str
    reads: frozenset[str]
    defaults: Mapping[str, Any]
    qkv_bias: bool | None  # None: config.json's attention_bias
    o_bias_follows_qkv: bool  # o_proj has a bias iff q/k/v have one
    qk_norm: bool
    window: str | None  # "layer_types" (Qwen), "all_layers" (Mistral) or None


_READS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "original_max_position_embeddings", "attention_dropout",
    "partial_rotary_factor",
})
_QWEN_WINDOW = frozenset({"sliding_window", "use_sliding_window", "layer_types"})
_QWEN_DEFAULTS = {"num_key_value_heads": 32, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096,
                  "max_window_layers": 28}
FAMILIES: dict[str, Family] = {
    # Qwen2 / Qwen2.5: q/k/v biases always (attention_bias is not read), none on o_proj.
    "qwen2": Family(
        "Qwen2ForCausalLM", _READS | _QWEN_WINDOW | {"attention_bias"}, _QWEN_DEFAULTS,
        qkv_bias=True, o_bias_follows_qkv=False, qk_norm=False, window="layer_types"),
    "qwen3": Family(
        "Qwen3ForCausalLM", _READS | _QWEN_WINDOW | {"attention_bias"},
        {**_QWEN_DEFAULTS, "head_dim": 128, "attention_bias": False},
        qkv_bias=None, o_bias_follows_qkv=True, qk_norm=True, window="layer_types"),
    "llama": Family(
        "LlamaForCausalLM", _READS | {"attention_bias", "mlp_bias"},
        {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "attention_bias": False},
        qkv_bias=None, o_bias_follows_qkv=True, qk_norm=False, window=None),
    # Mistral: no biases; its mask reads sliding_window alone (layer_types only warns).
    "mistral": Family(
        "MistralForCausalLM", _READS | {"sliding_window", "layer_types"},
        {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "sliding_window": 4096},
        qkv_bias=False, o_bias_follows_qkv=False, qk_norm=False, window="all_layers"),
}
REFUSED_TYPES = {
    **dict.fromkeys(("qwen2_moe", "qwen3_moe", "mixtral"),
                    "mixture-of-experts MLPs are not implemented"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text"),
                    "Gemma (scaled embeddings, (1 + w) RMSNorm, GeLU, soft-capping) is not "
                    "implemented"),
}
# Fields that do not change the maths: ids, dtype, labels, generation defaults, bookkeeping.
IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "_name_or_path", "name_or_path", "tokenizer_class", "id2label",
    "label2id", "num_labels", "problem_type", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size",
    "prefix", "task_specific_params", "finetuning_task", "tf_legacy_loss", "use_bfloat16",
    "pruned_heads", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "auto_map", "classifier_dropout", "max_window_layers",
    # 4.x split its matmuls into this many slices (the same products); 5.x ignores it.
    "pretraining_tp",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
# Fields a family does not read that are harmless at these values (anything else is refused).
NEUTRAL = {
    "attention_bias": lambda v: v is False,
    "mlp_bias": lambda v: v is False,
    "use_sliding_window": lambda v: v is False,
    "use_mrope": lambda v: v is False,
    "layer_types": lambda v: isinstance(v, list | tuple) and set(v) <= {"full_attention"},
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: GQA attention, RoPE, RMSNorm, SwiGLU MLP, and the
    switches that tell the families apart."""

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
    attention_bias: bool = True  # biases of q_proj, k_proj, v_proj
    max_position_embeddings: int = 32768
    model_type: str = "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    o_proj_bias: bool = False  # a bias of o_proj (Llama / Qwen3 with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm of each query and key head before RoPE
    rope_scaling: RopeScaling | None = None  # None: the default RoPE
    sliding_window: int | None = None  # every layer attends to its last `window` keys
    # LoRA adapters on the projections (`models.lora.LoraSpec`); not part of config.json.
    lora: Any = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.model_type not in FAMILIES:
            raise ModelError(_unsupported(self.model_type))
        if self.head_dim % 2:
            raise ModelError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelError(f"sliding_window={self.sliding_window} must be positive")

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def num_matmul_params(self) -> int:
        """Parameters that take part in matmuls (the N of the MFU formula, embeddings included)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return L * (3 * h * i + h * (q + 2 * kv) + q * h) + 2 * self.vocab_size * h

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], overrides: Mapping[str, Any] | None = None):
        """From the dict of an HF `config.json` (either layout); `overrides` replace fields.

        Raises:
            ModelError: an unsupported family or field (one line: the field and its value),
                or a missing size.
        """
        hf = {**hf, **(overrides or {})}
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ModelError(_unsupported(model_type))
        family = FAMILIES[model_type]
        _check_fields(hf, family)

        def get(key):  # absent: the family's transformers default
            return hf.get(key, family.defaults.get(key))

        heads = hf["num_attention_heads"]
        head_dim = get("head_dim") or hf["hidden_size"] // heads
        mpe = get("max_position_embeddings")
        theta, scaling = _rope(hf, mpe)
        bias = family.qkv_bias if family.qkv_bias is not None else bool(get("attention_bias"))
        o_bias = bias if family.o_bias_follows_qkv else False
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(get("rms_norm_eps")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=bias,
            max_position_embeddings=mpe,
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            o_proj_bias=o_bias,
            qk_norm=family.qk_norm,
            rope_scaling=scaling,
            sliding_window=_sliding_window(hf, family, mpe),
        )

    def to_hf(self) -> dict[str, Any]:
        """The dict of an HF `config.json` in transformers 5's layout that `transformers` loads
        as this architecture; `from_hf` gives this config back."""
        family = self.family
        _check_expressible(self, family)
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.to_hf())
        out: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
            "rope_parameters": rope,
            "dtype": "float32",
        }
        if family.qkv_bias is None:
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if family.window == "layer_types":
            sliding = self.sliding_window is not None
            out.update(
                use_sliding_window=sliding, sliding_window=self.sliding_window,
                max_window_layers=0 if sliding else self.num_hidden_layers,
                layer_types=[("sliding" if sliding else "full") + "_attention"]
                * self.num_hidden_layers,
            )
        elif family.window == "all_layers":
            out["sliding_window"] = self.sliding_window  # null written: absent means 4096
        eos = self.eos_token_id  # ids written even when null: Llama's default is 1 / 2
        out.update(bos_token_id=self.bos_token_id,
                   eos_token_id=list(eos) if isinstance(eos, tuple) else eos)
        return out


def _unsupported(model_type) -> str:
    if model_type in REFUSED_TYPES:
        return f"model_type {model_type!r} is not supported: {REFUSED_TYPES[model_type]}"
    return (f"unsupported model_type {model_type!r} "
            f"(supported: {', '.join(FAMILIES)})")


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(field: str, value: Any, why: str) -> ModelError:
    return ModelError(f"field {field}={_show(value)} is not supported: {why}")


def _check_fields(hf: Mapping[str, Any], family: Family) -> None:
    """Every field is read by this family, harmless, at its neutral value, or null."""
    for key, value in hf.items():
        if key in IGNORED or key in family.reads or value is None:
            continue
        if key in NEUTRAL and NEUTRAL[key](value):
            continue
        raise _refuse(key, value, f"not a field rlhf_jax reads for {hf['model_type']!r} "
                      "(null it with override_config if it does not change the model)")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _refuse("hidden_act", act, "the MLP is SwiGLU (silu)")
    for key, neutral in (("attention_dropout", (0, 0.0)), ("mlp_bias", (False,)),
                         ("partial_rotary_factor", (1, 1.0))):
        if hf.get(key) is not None and hf[key] not in neutral:
            raise _refuse(key, hf[key], f"only {neutral[-1]} is implemented")


def _rope(hf: Mapping[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) as transformers standardises them: `rope_scaling` (4.x) over
    `rope_parameters` (5.x); theta from that dict, else the top-level `rope_theta`, else
    10000; a top-level `original_max_position_embeddings` wins over the dict's."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _refuse(field, params, "RoPE per layer type is not implemented")
    theta = params.get("rope_theta")
    theta = float(hf.get("rope_theta") or 10000.0) if theta is None else float(theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise _refuse(f"{field}.partial_rotary_factor", params["partial_rotary_factor"],
                      "only 1.0 is implemented")
    if rope_type == "default":
        return theta, None
    if rope_type == "dynamic":
        raise _refuse(f"{field}.rope_type", rope_type, "dynamic NTK RoPE depends on the "
                      "batch's sequence length at run time in transformers")
    if rope_type not in SCALED_TYPES:
        raise _refuse(f"{field}.rope_type", rope_type,
                      f"implemented: default, {', '.join(SCALED_TYPES)}")
    if hf.get("original_max_position_embeddings") is not None and rope_type != "linear":
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    if rope_type != "linear":
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope_type == "yarn" and "factor" in params and params["factor"] is None:
        # transformers: a null factor is the ratio of the two lengths (an absent one fails)
        params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}[rope_type]
    missing = [k for k in required if params.get(k) is None]
    if missing:
        raise _refuse(field, params, f"rope_type {rope_type!r} needs {', '.join(missing)}")
    names = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
    used = {"linear": {"factor"},
            "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"},
            "yarn": names - {"low_freq_factor", "high_freq_factor"}}[rope_type]
    kept = {k: params[k] for k in used if params.get(k) is not None}
    for key in kept.keys() - {"truncate", "original_max_position_embeddings"}:
        kept[key] = float(kept[key])
    if "original_max_position_embeddings" in kept:
        kept["original_max_position_embeddings"] = int(kept["original_max_position_embeddings"])
    return theta, RopeScaling(rope_type=rope_type, **kept)


def _sliding_window(hf: Mapping[str, Any], family: Family, mpe: int) -> int | None:
    """The window every layer attends within, or None; refused when only some layers slide
    and the window is shorter than the model's context (it would bind)."""
    if family.window is None:
        return None
    window = hf.get("sliding_window", family.defaults.get("sliding_window"))
    if family.window == "all_layers":
        return None if window is None else int(window)
    # Qwen2 / Qwen3: layers from max_window_layers on slide, if use_sliding_window.
    if not hf.get("use_sliding_window", False):
        window = None
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", family.defaults.get("max_window_layers"))
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n)]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown or len(types) != n:
        raise _refuse("layer_types", types, f"expected {n} of full_attention, sliding_attention")
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None
    if window is None:
        raise _refuse("layer_types", types, "sliding layers without a sliding_window "
                      "(use_sliding_window false): transformers cannot run it either")
    if all(sliding):
        return int(window)
    if window >= mpe:
        return None  # never binds within max_position_embeddings
    raise _refuse("sliding_window", window, f"it binds (< max_position_embeddings {mpe}) on "
                  f"{sum(sliding)} of {n} layers; a window on some layers is not implemented")


def _check_expressible(cfg: ModelConfig, family: Family) -> None:
    """A config built by hand may hold a combination that its family cannot write."""
    want_bias = family.qkv_bias if family.qkv_bias is not None else cfg.attention_bias
    want_o = cfg.attention_bias if family.o_bias_follows_qkv else False
    if (cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) != (want_bias, want_o, family.qk_norm):
        raise ModelError(
            f"model_type {cfg.model_type!r} cannot express attention_bias={cfg.attention_bias}, "
            f"o_proj_bias={cfg.o_proj_bias}, qk_norm={cfg.qk_norm}")
    if cfg.sliding_window is not None and family.window is None:
        raise ModelError(f"model_type {cfg.model_type!r} has no sliding window")


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
    except ModelError as e:
        raise ModelError(f"{file}: {e}") from None
