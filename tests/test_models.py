"""Parity with transformers (Qwen2, Llama), HF import/export, and parameter sharding."""

import dataclasses
import functools
import json
import os
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rlhf_jax.errors import ModelError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig, load_model_config
from rlhf_jax.models import model as model_module
from rlhf_jax.models.hf_io import load_hf_model, save_hf
from rlhf_jax.models.model import UNROLL_MAX_LAYERS
from rlhf_jax.models.ops import rope_table
from rlhf_jax.models.stacking import per_layer_params, stacked_params

GOLDEN = Path(__file__).parent / "golden" / "param_specs.json"

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)


def _hf_model(kind: str, tmp: Path, **extra) -> Path:
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False, **extra)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=True, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY, num_labels=1, **extra)
        model = transformers.Qwen2ForTokenClassification(cfg)
    with torch.no_grad():  # non-trivial biases and norms, so a mix-up shows
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    out = tmp / kind
    model.save_pretrained(out, safe_serialization=True)
    return out


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], size=(3, 9)).astype(np.int32)
    mask = np.ones((3, 9), np.int32)
    mask[0, :4] = 0  # left padding of different lengths
    mask[1, :1] = 0
    return ids, mask


def _hf_out(path: Path, ids, mask, value: bool = False):
    cls = (
        transformers.AutoModelForTokenClassification
        if value else transformers.AutoModelForCausalLM
    )
    model = cls.from_pretrained(path, attn_implementation="eager", torch_dtype=torch.float32)
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        ).logits.numpy()
    return out[..., 0] if value else out


def _mesh(name, **sizes):
    spec = load_mesh_spec(name, sizes)
    return make_mesh(spec), spec


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    return {k: _hf_model(k, tmp) for k in ("qwen2", "llama", "value")}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_match_transformers_and_export_round_trips(hf_dirs, arch, tmp_path):
    ids, mask = _batch()
    want = _hf_out(hf_dirs[arch], ids, mask)
    mesh, spec = _mesh("cpu-8")
    model, params = load_hf_model(hf_dirs[arch], mesh, spec.train_rules)
    got = np.asarray(jax.jit(model.forward)(params, ids, mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=0)

    out = save_hf(model, params, tmp_path / "export", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()  # small shards force an index
    again = _hf_out(out, ids, mask)
    np.testing.assert_allclose(again[valid], want[valid], atol=1e-4, rtol=0)


def test_value_model_matches_token_classification(hf_dirs, tmp_path):
    ids, mask = _batch()
    want = _hf_out(hf_dirs["value"], ids, mask, value=True)
    mesh, spec = _mesh("single")
    model, params = load_hf_model(hf_dirs["value"], mesh, spec.train_rules, kind="value")
    got = np.asarray(model.forward(params, ids, mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=0)
    save_hf(model, params, tmp_path / "critic")
    np.testing.assert_allclose(
        _hf_out(tmp_path / "critic", ids, mask, value=True)[valid], want[valid], atol=1e-4
    )


def test_critic_from_causal_lm_checkpoint_gets_zero_head(hf_dirs):
    mesh, spec = _mesh("single")
    model, params = load_hf_model(hf_dirs["qwen2"], mesh, spec.train_rules, kind="value")
    assert float(jnp.abs(params["score"]["kernel"]).sum()) == 0.0
    ids, mask = _batch()
    assert np.all(np.asarray(model.forward(params, ids, mask)) == 0.0)


def test_sharded_forward_equals_single_device(hf_dirs):
    ids, mask = _batch()
    outs = []
    for name in ("single", "cpu-8"):
        mesh, spec = _mesh(name)
        model, params = load_hf_model(hf_dirs["qwen2"], mesh, spec.train_rules)
        outs.append(np.asarray(jax.jit(model.forward)(params, ids, mask)))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "value"])
def test_head_slice_is_the_full_output_sliced(hf_dirs, arch):
    """`forward(..., head_slice)` runs the head on those positions only, with the same
    numbers as slicing the full output, on one device and sharded (tied and untied heads)."""
    ids, mask = _batch()
    cut = slice(-5, -1)
    for name in ("single", "cpu-8"):
        mesh, spec = _mesh(name)
        kind = "value" if arch == "value" else "lm"
        model, params = load_hf_model(hf_dirs[arch], mesh, spec.train_rules, kind=kind)
        full = np.asarray(jax.jit(model.forward)(params, ids, mask))
        part = np.asarray(jax.jit(functools.partial(model.forward, head_slice=cut))(
            params, ids, mask))
        assert part.shape == full[:, cut].shape
        np.testing.assert_allclose(part, full[:, cut], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", pytest.param("value", marks=pytest.mark.slow)])
def test_head_slice_trims_the_last_layer(hf_dirs, arch):
    """Unrolled, the last layer runs queries, attention output and MLP on the sliced positions
    only: on one device the compiled gradient has fewer FLOPs than slicing the full output,
    by at least that MLP and the head on the other positions (forward and backward); sharded
    (2,2,2), the values and gradients are the scanned stack's, also rematerialised."""
    ids, mask = _batch()
    cut = slice(-4, -1)
    kind = "value" if arch == "value" else "lm"
    weight = jnp.asarray(np.random.default_rng(1).standard_normal(
        (ids.shape[0], 3) + (() if kind == "value" else (TINY["vocab_size"],))), jnp.float32)

    def step(model, head_slice):
        def loss(p):
            out = model.forward(p, ids, mask, head_slice)
            return jnp.sum(jnp.sin(out if head_slice else out[:, cut]) * weight)

        return jax.jit(jax.value_and_grad(loss))

    mesh, spec = _mesh("single")
    base, params = load_hf_model(hf_dirs[arch], mesh, spec.train_rules, kind=kind)
    b, t = ids.shape
    d, v = TINY["hidden_size"], TINY["vocab_size"] if kind == "lm" else 1
    trimmed = 2 * d * (3 * TINY["intermediate_size"] + v) * b * (t - 3)
    for remat in (False, True):
        model = dataclasses.replace(base, scan_layers=False, remat=remat)
        full, part = (step(model, s).lower(params).compile().cost_analysis()["flops"]
                      for s in (None, cut))
        # the forward's products, and the backward's two per product
        assert full - part >= 3 * trimmed, (remat, full, part, trimmed)

    mesh, spec = _mesh("cpu-8")
    base, params = load_hf_model(hf_dirs[arch], mesh, spec.train_rules, kind=kind)
    want = step(dataclasses.replace(base, scan_layers=True), cut)(params)
    for remat in (False, True):
        got = step(dataclasses.replace(base, scan_layers=False, remat=remat), cut)(params)
        chex.assert_trees_all_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", pytest.param("value", marks=pytest.mark.slow)])
def test_scanned_and_unrolled_layers_agree(hf_dirs, arch):
    """The layer stack as a `lax.scan` and unrolled over per-layer weights (with and without
    rematerialisation) give the same outputs and the same gradients, sharded (2,2,2); the
    per-layer split goes back to the stacked parameters exactly."""
    ids, mask = _batch()
    mesh, spec = _mesh("cpu-8")
    kind = "value" if arch == "value" else "lm"
    base, params = load_hf_model(hf_dirs[arch], mesh, spec.train_rules, kind=kind)
    split = per_layer_params(params)
    assert isinstance(split["model"]["layers"], tuple) and len(split["model"]["layers"]) == 2
    chex.assert_trees_all_equal(stacked_params(split), params)
    assert stacked_params(params) is params and per_layer_params(split) is split

    def loss(model, p):
        out = model.forward(p, ids, mask)
        return jnp.sum(jnp.sin(out) * (mask if out.ndim == 2 else mask[..., None]))

    outs = {}
    # (scanned and rematerialised: test_scanned_and_unrolled_layers_update_alike)
    for scan, remat in ((True, False), (False, False), (False, True)):
        model = dataclasses.replace(base, scan_layers=scan, remat=remat)
        assert model.scans_layers is scan
        out = jax.jit(model.forward)(params, ids, mask)
        grads = jax.jit(jax.grad(functools.partial(loss, model)))(params)
        outs[scan, remat] = (np.asarray(out), jax.device_get(grads))
    for key, (out, grads) in outs.items():
        np.testing.assert_allclose(out, outs[True, False][0], atol=2e-6, rtol=0, err_msg=key)
        chex.assert_trees_all_close(grads, outs[True, False][1], atol=1e-6, rtol=1e-5)
    # either form of the parameters runs either way: the forward follows the form it gets
    np.testing.assert_allclose(np.asarray(jax.jit(base.forward)(split, ids, mask)),
                               outs[True, False][0], atol=2e-6, rtol=0)


def test_rope_table_is_computed_once_per_forward():
    """On CPU the cos / sin table is one buffer for every layer's rotations: the compiled
    forward evaluates cosine once (not once per layer and head), and the table is right."""
    model = Model(load_model_config_dict(num_hidden_layers=3))
    mesh, spec = _mesh("single")
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    ids, mask = _batch()
    forward = lambda p: model.forward(p, ids, mask)
    for fn in (forward, jax.grad(lambda p: jnp.sum(forward(p)))):
        hlo = jax.jit(fn).lower(params).compile().as_text()
        assert hlo.count(" cosine(") == 1
    pos = np.arange(12, dtype=np.int32).reshape(2, 6)
    cos, sin = jax.jit(rope_table, static_argnums=(1, 2))(pos, 8, 10000.0)
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    angle = np.concatenate([pos[..., None] * inv] * 2, -1)
    np.testing.assert_allclose(cos, np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angle), atol=1e-6)


def test_scan_layers_default_unrolls_shallow_models_only():
    assert not Model(load_model_config_dict()).scans_layers  # 2 layers
    assert Model(load_model_config_dict(num_hidden_layers=UNROLL_MAX_LAYERS + 1)).scans_layers
    assert not Model(load_model_config_dict(num_hidden_layers=12), scan_layers=False).scans_layers


def test_train_layout_splits_big_matrices_over_fsdp_and_tensor():
    cfg = load_model_config_dict(hidden_size=128, intermediate_size=256, vocab_size=512)
    mesh, spec = _mesh("cpu-8")
    model = Model(cfg)
    params = model.init(jax.random.key(0), mesh, spec.train_rules)
    for w in (
        params["model"]["layers"]["mlp"]["gate_proj"]["kernel"],
        params["model"]["embed_tokens"]["embedding"],
        params["lm_head"]["kernel"],
    ):
        per_device = {s.device: s.data.nbytes for s in w.addressable_shards}
        assert len(per_device) == 8
        assert set(per_device.values()) == {w.nbytes // 4}  # fsdp (2) x tensor (2)
    gen = jax.device_put(params, model.shardings(mesh, spec.generate_rules))
    w = gen["model"]["layers"]["mlp"]["gate_proj"]["kernel"]
    assert {s.data.nbytes for s in w.addressable_shards} == {w.nbytes // 2}  # tensor only


def load_model_config_dict(**kw):
    from rlhf_jax.models import ModelConfig

    base = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    base.update(kw)
    if "hidden_size" in kw:
        base["head_dim"] = base["hidden_size"] // base["num_attention_heads"]
    return ModelConfig(**base)


def _specs(model, mesh, rules):
    shardings = model.shardings(mesh, rules)
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    return {"/".join(k.key for k in path): str(s.spec) for path, s in flat}


def test_partition_specs_match_golden_file():
    mesh, spec = _mesh("cpu-8")
    got = {}
    for kind in ("lm", "value"):
        model = Model(load_model_config_dict(), kind=kind)
        got[kind] = {
            "train": _specs(model, mesh, spec.train_rules),
            "generate": _specs(model, mesh, spec.generate_rules),
        }
    if os.environ.get("RLHF_JAX_UPDATE_GOLDEN"):  # rewrite on purpose, then review the diff
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(GOLDEN.read_text())


def test_model_path_without_config_json(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        load_model_config(tmp_path)


def test_unsupported_architecture_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="unsupported model_type 'gpt2'"):
        load_model_config(tmp_path)


def test_bf16_round_trip(hf_dirs, tmp_path):
    mesh, spec = _mesh("single")
    model, params = load_hf_model(hf_dirs["qwen2"], mesh, spec.train_rules, param_dtype="bfloat16")
    assert params["lm_head"]["kernel"].dtype == jnp.bfloat16
    save_hf(model, params, tmp_path / "bf16")
    model2, params2 = load_hf_model(tmp_path / "bf16", mesh, spec.train_rules,
                                    param_dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_parameter_shapes_are_traced_once_per_architecture(monkeypatch):
    """`abstract_params` / `logical_axes` / `shardings` trace flax's init once per
    architecture and dtype (a run asks for them for the actor, its reference, the critic and
    the engine); a model on another mesh shares the trace, another dtype does not."""
    cfg = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model_module._boxed_shapes.cache_clear()
    traces = []
    original = Model._init_boxed
    monkeypatch.setattr(Model, "_init_boxed",
                        lambda self, rng: (traces.append(self.dtype), original(self, rng))[1])
    mesh = make_mesh(load_mesh_spec("single"))
    model = Model(cfg)
    first = model.abstract_params()
    assert model.logical_axes() and model.shardings(mesh, ()) is not None
    assert model.with_layout(mesh, ()).abstract_params() == first
    assert traces == ["float32"]
    Model(cfg, dtype="bfloat16").abstract_params()
    assert traces == ["float32", "bfloat16"]
