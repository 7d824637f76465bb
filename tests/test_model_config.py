"""config.json by allow-list (`rlhf_jax.models.config`): both RoPE layouts, transformers'
defaults for absent fields, `to_hf` round trips, and a one-line refusal per unsupported field,
also from `scripts/train.py` (exit 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from rlhf_jax.errors import ModelError
from rlhf_jax.models import ModelConfig, load_model_config
from rlhf_jax.models.rope import RopeScaling

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "attention_factor": 0.9, "beta_fast": 16.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def _v5(model_type, **fields):
    """config.json as transformers 5.24 writes it."""
    return transformers.AutoConfig.for_model(model_type, **{**SIZES, **fields}).to_dict()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "mistral"])
@pytest.mark.parametrize("scaling", [None, *SCALINGS])
def test_transformers_4_and_5_layouts_read_alike(model_type, scaling):
    """`rope_theta` + `rope_scaling` (4.x, "type" key) and `rope_parameters` (5.x): one
    config, and the theta is never the 1e4 fallback."""
    params = {"rope_type": "default"} if scaling is None else dict(SCALINGS[scaling])
    new = _v5(model_type, max_position_embeddings=64,
              rope_parameters={**params, "rope_theta": 1e6})
    assert "rope_theta" not in new and new["rope_parameters"]["rope_theta"] == 1e6
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = 1e6
    if scaling is not None:
        legacy = {k: v for k, v in params.items() if k != "rope_type"}
        old["rope_scaling"] = {"type": params["rope_type"], **legacy}
    cfg = ModelConfig.from_hf(new)
    assert cfg == ModelConfig.from_hf(old)
    assert cfg.rope_theta == 1e6
    assert (cfg.rope_scaling is None) == (scaling is None)
    # transformers reads the 4.x layout to the same rope_parameters
    assert transformers.AutoConfig.for_model(**old).rope_parameters == {
        **new["rope_parameters"], **({"type": scaling} if scaling else {})}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "mistral"])
def test_absent_fields_take_transformers_defaults(model_type):
    """Only the sizes given: head_dim, kv heads, context, window, eps, tying as the family's
    transformers config class fills them in (Qwen3 head_dim 128, Mistral window 4096...)."""
    heads = 8 if model_type == "mistral" else 32  # divisible by the kv default, 8 or 32
    given = {**SIZES, "num_attention_heads": heads, "hidden_size": 8 * heads}
    del given["num_key_value_heads"]
    hf = transformers.AutoConfig.for_model(model_type, **given)
    cfg = ModelConfig.from_hf({"model_type": model_type, **given})
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or 8)
    assert cfg.head_dim == (128 if model_type == "qwen3" else 8)
    assert cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.sliding_window == getattr(hf, "sliding_window", None)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert cfg.qk_norm == (model_type == "qwen3")
    assert cfg.attention_bias == (model_type == "qwen2")


FULL = {  # every implemented field away from its default, per family
    "qwen2": ModelConfig(**SIZES, head_dim=12, rope_theta=1e6, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=64,
                         model_type="qwen2", bos_token_id=1, eos_token_id=(2, 3),
                         rope_scaling=RopeScaling("yarn", 4.0, 16, attention_factor=0.9),
                         sliding_window=24),
    "qwen3": ModelConfig(**SIZES, head_dim=12, rope_theta=1e6, model_type="qwen3",
                         attention_bias=True, o_proj_bias=True, qk_norm=True,
                         rope_scaling=RopeScaling("linear", 2.0)),
    "llama": ModelConfig(**SIZES, head_dim=8, rope_theta=5e5, model_type="llama",
                         attention_bias=False, tie_word_embeddings=True, eos_token_id=7,
                         max_position_embeddings=128,
                         rope_scaling=RopeScaling("llama3", 8.0, 16, 1.0, 4.0)),
    "mistral": ModelConfig(**SIZES, head_dim=8, rope_theta=1e6, model_type="mistral",
                           attention_bias=False, max_position_embeddings=4096,
                           sliding_window=None),
}


@pytest.mark.parametrize("model_type", list(FULL))
def test_to_hf_round_trips_in_transformers_5_layout(model_type):
    cfg = FULL[model_type]
    hf = cfg.to_hf()
    assert ModelConfig.from_hf(json.loads(json.dumps(hf))) == cfg
    assert "rope_theta" not in hf and "rope_scaling" not in hf
    ref = transformers.AutoConfig.for_model(**hf)
    assert set(hf) <= set(ref.to_dict()) | {"head_dim"}  # fields transformers 5 writes
    assert ModelConfig.from_hf(ref.to_dict()) == cfg  # and what it writes back reads alike
    assert ref.rope_parameters["rope_theta"] == cfg.rope_theta
    assert getattr(ref, "sliding_window", None) == cfg.sliding_window


def test_the_default_runs_model_reads_back_from_its_export():
    """The synthetic task writes its config in the 4.x layout; `save_hf` rewrites it in the
    5.x one, which the trainer then reads: the same config, so the same compiled model."""
    from rlhf_jax.tasks.addition import MODEL

    cfg = ModelConfig.from_hf(MODEL)
    assert cfg.rope_scaling is None and cfg.sliding_window is None and not cfg.qk_norm
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_to_hf_refuses_a_combination_its_family_cannot_write():
    with pytest.raises(ModelError, match="cannot express"):
        ModelConfig(**SIZES, head_dim=8, model_type="llama", qk_norm=True).to_hf()
    with pytest.raises(ModelError, match="no sliding window"):
        ModelConfig(**SIZES, head_dim=8, model_type="llama", attention_bias=False,
                    sliding_window=8).to_hf()


def test_harmless_fields_are_ignored():
    base = _v5("llama")
    noisy = {**base, "pad_token_id": 0, "torch_dtype": "bfloat16", "use_cache": False,
             "initializer_range": 0.5, "pretraining_tp": 2, "temperature": 0.6,
             "_name_or_path": "x", "some_future_flag": None, "layer_types": None}
    assert ModelConfig.from_hf(noisy) == ModelConfig.from_hf(base)


def test_sliding_window_on_every_layer_is_read_otherwise_refused_or_harmless():
    assert ModelConfig.from_hf(_v5("mistral", sliding_window=16)).sliding_window == 16
    assert ModelConfig.from_hf(_v5("mistral", sliding_window=None)).sliding_window is None
    every = _v5("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert ModelConfig.from_hf(every).sliding_window == 16
    # the window on layers 1.. only, but never shorter than the context: no effect
    wide = _v5("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=1,
               max_position_embeddings=64)
    assert ModelConfig.from_hf(wide).sliding_window is None
    # use_sliding_window false: Qwen2.5's configs carry a window that nothing uses
    assert ModelConfig.from_hf(_v5("qwen2", sliding_window=4096)).sliding_window is None


# (model_type, fields, what the one-line message must name)
REFUSED = {
    "hidden_act": ("llama", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    "mlp_bias": ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    "mlp_bias_qwen2": ("qwen2", {"mlp_bias": True}, "mlp_bias=true"),
    "attention_dropout": ("qwen2", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    "partial_rotary_factor": ("llama", {"partial_rotary_factor": 0.5},
                              "partial_rotary_factor=0.5"),
    "rope_dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
                     'rope_type="dynamic"'),
    "rope_dynamic_v4": ("qwen2", {"rope_theta": 1e6, "rope_scaling": {"type": "dynamic",
                                                                      "factor": 2.0}},
                        'rope_scaling.rope_type="dynamic"'),
    "rope_longrope": ("llama", {"rope_parameters": {
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 16}}, 'rope_type="longrope"'),
    "rope_unknown": ("qwen3", {"rope_parameters": {"rope_type": "ntk-by-parts"}},
                     'rope_type="ntk-by-parts"'),
    "rope_llama3_incomplete": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}},
        "needs low_freq_factor, high_freq_factor"),
    "rope_yarn_without_factor": ("qwen2", {"rope_parameters": {"rope_type": "yarn"}},
                                 "needs factor"),
    "rope_per_layer_type": ("qwen2", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
        "RoPE per layer type"),
    "rope_partial_in_parameters": ("qwen3", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
        "rope_parameters.partial_rotary_factor=0.25"),
    "sliding_window_some_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                                             "max_window_layers": 1,
                                             "max_position_embeddings": 64},
                                   "sliding_window=16"),
    "layer_types_without_window": ("qwen3", {
        "layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": False},
        'layer_types=["sliding_attention", "full_attention"]'),
    "layer_types_unknown": ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]},
                            "layer_types="),
    "sliding_window_llama": ("llama", {"sliding_window": 16}, "sliding_window=16"),
    "attn_logit_softcapping": ("llama", {"attn_logit_softcapping": 50.0},
                               "attn_logit_softcapping=50.0"),
    "final_logit_softcapping": ("qwen2", {"final_logit_softcapping": 30.0},
                                "final_logit_softcapping=30.0"),
    "quantization_config": ("llama", {"quantization_config": {"quant_method": "gptq",
                                                              "bits": 4}},
                            'quantization_config={"bits": 4'),
    "use_mrope": ("qwen2", {"use_mrope": True}, "use_mrope=true"),
    "unknown_field": ("mistral", {"use_qk_norm": True}, "use_qk_norm=true"),
    "moe_qwen2": ("qwen2_moe", {}, "'qwen2_moe' is not supported: mixture-of-experts"),
    "moe_qwen3": ("qwen3_moe", {}, "'qwen3_moe' is not supported: mixture-of-experts"),
    "moe_mixtral": ("mixtral", {}, "'mixtral' is not supported: mixture-of-experts"),
    "gemma": ("gemma", {}, "'gemma' is not supported: Gemma"),
    "gemma2": ("gemma2", {}, "'gemma2' is not supported: Gemma"),
    "gemma3": ("gemma3", {}, "'gemma3' is not supported: Gemma"),
    "gemma3_text": ("gemma3_text", {}, "'gemma3_text' is not supported: Gemma"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_field_is_a_one_line_error(case, tmp_path):
    model_type, fields, names = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": model_type, **SIZES, **fields}))
    with pytest.raises(ModelError) as err:
        load_model_config(tmp_path)
    message = str(err.value)
    assert "\n" not in message and names in message, message
    assert message.startswith(str(tmp_path / "config.json"))


def test_refused_config_exits_2_from_train_script(tmp_path):
    """`scripts/train.py` on a checkpoint it cannot run exactly: `error: ...`, one line, exit
    2, before anything compiles."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_run import tiny_overrides

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_v5("llama", vocab_size=16, mlp_bias=True)))
    (model / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), *tiny_overrides(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "mlp_bias=true" in lines[-1], lines
    assert not any("Traceback" in line for line in lines)
