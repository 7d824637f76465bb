"""LoRA export (issue 27): the PEFT adapter directory loads with `peft` onto the transformers
base and gives the logits of the adapted model; the merged export gives them in plain
transformers."""

import dataclasses
import json

import jax
import numpy as np
import peft  # in the test extra (pyproject.toml)
import torch
import transformers
from tiny_hf import make_hf_checkpoint

from rlhf_jax import lora
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, load_model_config
from rlhf_jax.models import lora as mlora
from rlhf_jax.models.hf_io import load_hf_params, save_hf


def test_peft_and_merged_exports_reproduce_the_adapted_logits(tmp_path):
    base_dir = make_hf_checkpoint(tmp_path / "base", "qwen2", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    spec = mlora.LoraSpec(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                   "down_proj"))  # gate_proj excluded
    mesh_spec = load_mesh_spec("single")
    mesh = make_mesh(mesh_spec, jax.devices()[:1])
    cfg = load_model_config(base_dir)
    model = Model(dataclasses.replace(cfg, lora=spec))
    bare = lora.base_model(model)
    base = load_hf_params(bare, base_dir, bare.shardings(mesh, mesh_spec.train_rules))
    params = lora.init_adapters(model, base, mesh, mesh_spec.train_rules, jax.random.key(1))
    rng = np.random.default_rng(0)  # trained-looking adapters: B away from 0
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + rng.normal(0, 0.1, x.shape).astype(x.dtype)
        if "'b'" in jax.tree_util.keystr(p) else x, params)
    ids = np.array([[5, 9, 17, 33, 2, 64, 7], [11, 3, 3, 80, 41, 6, 28]], np.int32)
    ours = np.asarray(model.forward(params, ids, np.ones_like(ids)))

    out = mlora.save_peft(params, spec, cfg.num_hidden_layers, tmp_path / "peft", str(base_dir))
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["lora_alpha"] == 8.0
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        plain = torch_base(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(torch_base, out)
    with torch.no_grad():
        theirs = adapted(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - plain).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)

    merged_dir = save_hf(bare, mlora.merge(params, spec), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        m = merged(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(m, ours, atol=1e-4, rtol=0)
