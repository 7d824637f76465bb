"""Qwen2.5, Qwen3, Llama 3.x and Mistral checkpoints as transformers 5 writes them load as the
model transformers runs: logits, the rollout engine's KV-cache path, and the export back.

Each family is a tiny random checkpoint with non-default values (rope_theta far from 1e4,
scaled RoPE whose original context is shorter than the test sequence, odd head counts, GQA and
MQA, tied and untied heads, biases and norms moved off their init) saved by transformers
itself, and a 44-token left-padded batch.
"""

import jax
import numpy as np
import pytest
from tiny_hf import BASE, hf_logits, make_hf_checkpoint

from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import load_model_config
from rlhf_jax.models.hf_io import load_hf_model, save_hf
from rlhf_jax.rollout import Engine, SamplingParams

ATOL = 1e-4
# name -> (model_type, config fields, overrides that load it wrong: what the test must see)
FAMILIES = {
    "qwen2_5": ("qwen2", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
    "qwen2_yarn": ("qwen2", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 16}),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "llama3_1": ("llama", dict(  # MQA, tied like Llama 3.2 1B / 3B
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    "llama_linear": ("llama", dict(  # 5 heads (no tensor split), all biases of attention
        hidden_size=40, num_attention_heads=5, num_key_value_heads=5,
        max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e5, "factor": 2.5}),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}),
    "qwen3": ("qwen3", dict(  # head_dim 12 != 32 / 3, q/k norm, 3 heads on 1 kv head
        hidden_size=32, num_attention_heads=3, num_key_value_heads=1, head_dim=12,
        max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
    "mistral": ("mistral", dict(  # a window of 16 binds at 44 tokens; G = 3
        hidden_size=48, num_attention_heads=6, num_key_value_heads=2, sliding_window=16,
        max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        {"sliding_window": None}),
}
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def batch(t: int = 44):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, BASE["vocab_size"], size=(3, t)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :7] = 0  # left padding of different lengths
    mask[1, :1] = 0
    return ids, mask


def _mesh(name):
    spec = load_mesh_spec(name)
    return make_mesh(spec), spec


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF dir, transformers' logits on `batch()`), built once."""
    tmp = tmp_path_factory.mktemp("families")
    ids, mask = batch()
    out = {}
    for name, (model_type, fields, _) in FAMILIES.items():
        path = make_hf_checkpoint(tmp / name, model_type, fields)
        out[name] = path, hf_logits(path, ids, mask)
    return out


def _max_diff(got, want, mask):
    valid = mask.astype(bool)
    return float(np.abs(got[valid] - want[valid]).max())


@pytest.mark.parametrize("mesh", ["single", "cpu-8"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(checkpoints, name, mesh):
    path, want = checkpoints[name]
    ids, mask = batch()
    m, spec = _mesh(mesh)
    model, params = load_hf_model(path, m, spec.train_rules)
    got = np.asarray(jax.jit(model.forward)(params, ids, mask))
    diff = _max_diff(got, want, mask)
    print(f"{name} {mesh}: max |dlogit| {diff:.2e}")
    assert diff <= ATOL, diff
    if mesh == "single":  # the test sees it when the family's feature is dropped
        wrong, params = load_hf_model(path, m, spec.train_rules, overrides=FAMILIES[name][2])
        assert _max_diff(np.asarray(jax.jit(wrong.forward)(params, ids, mask)), want,
                         mask) > 20 * ATOL


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_loads_in_transformers_with_the_same_logits(checkpoints, name, tmp_path):
    path, want = checkpoints[name]
    ids, mask = batch()
    m, spec = _mesh("cpu-8")
    model, params = load_hf_model(path, m, spec.train_rules)
    out = save_hf(model, params, tmp_path / "export")
    assert load_model_config(out) == model.cfg
    written = (out / "config.json").read_text()
    assert '"rope_parameters"' in written and '"rope_scaling"' not in written  # 5.x layout
    diff = _max_diff(hf_logits(out, ids, mask), want, mask)
    print(f"{name} export: max |dlogit| {diff:.2e}")
    assert diff <= ATOL, diff


def _greedy_by_full_forward(model, params, prompt, steps, width):
    """(token, log-prob) of greedy decoding by the full forward, left-padded to `width`."""
    fwd = jax.jit(model.forward)
    out, seq = [], list(prompt)
    for _ in range(steps):
        x = np.zeros((1, width), np.int32)
        m = np.zeros((1, width), np.int32)
        x[0, width - len(seq):], m[0, width - len(seq):] = seq, 1
        logits = np.asarray(fwd(params, x, m))[0, -1]
        tok = int(logits.argmax())
        out.append((tok, float(np.asarray(jax.nn.log_softmax(logits))[tok])))
        seq.append(tok)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rollout_follows_the_full_forward(checkpoints, name):
    """prefill + insert + generate with the KV cache (generate layout, (2,2,2)) give the
    full forward's greedy tokens and next-token log-probs, past the scaled RoPE's original
    context and Mistral's window."""
    path, _ = checkpoints[name]
    m, spec = _mesh("cpu-8")
    model, train_params = load_hf_model(path, m, spec.train_rules)
    steps = 5
    engine = Engine(model, m, spec.generate_rules, max_concurrent_decodes=4,
                    max_prefill_length=32, max_decode_length=steps,
                    compiler_options=FAST_COMPILE, sampling=SamplingParams(do_sample=False))
    params = engine.load_params(train_params)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, BASE["vocab_size"], n).tolist() for n in (21, 13)]
    tokens = np.zeros((2, 32), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    prefix, _ = engine.prefill(params=params, padded_tokens=tokens,
                               true_length=[len(p) for p in prompts])
    state = engine.bulk_insert(prefix, engine.init_decode_state(), [1, 3], rows=[0, 1])
    state, _ = engine.generate_steps(params, state, steps - 1)
    for slot, prompt in ((1, prompts[0]), (3, prompts[1])):
        want = _greedy_by_full_forward(model, train_params, prompt, steps, width=28)
        np.testing.assert_array_equal(np.asarray(state.response[slot]), [t for t, _ in want])
        np.testing.assert_allclose(np.asarray(state.log_probs[slot]), [lp for _, lp in want],
                                   atol=ATOL)
