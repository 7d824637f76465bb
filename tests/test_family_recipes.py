"""Every family trains: two PPO / GRPO steps of the synthetic task from a tiny random
transformers checkpoint of Qwen2 (YaRN), Qwen3, Llama 3.x and Mistral on the (2,2,2) mesh;
and the family recipes in configs/ resolve with `--print-config`."""

import subprocess
import sys

import numpy as np
import pytest
import yaml
from tiny_hf import make_hf_checkpoint
from tiny_run import ROOT, tiny

from rlhf_jax.models import load_model_config
from rlhf_jax.trainer import train

SMALL = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             max_position_embeddings=64)  # 16: the addition task's tokenizer
# name -> (model_type, fields, recipe of the tiny run): each family's feature binds within the
# task's 11-token sequences (original contexts of 4, a window of 6).
TINY = {
    "qwen2_yarn": ("qwen2", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 4}), "grpo_tiny_cpu.yaml"),
    "qwen3": ("qwen3", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "grpo_tiny_cpu.yaml"),
    "llama3": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 4}), "ppo_tiny_cpu.yaml"),
    "mistral": ("mistral", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "grpo_tiny_cpu.yaml"),
}
RECIPES = ("grpo_gsm8k_qwen3_0_6b.yaml", "ppo_gsm8k_llama3_2_1b.yaml",
           "grpo_gsm8k_mistral_7b.yaml", "ppo_gsm8k_qwen2_5_0_5b.yaml")


@pytest.mark.parametrize("name", [  # one family by default; the others: -m slow
    n if n == "qwen3" else pytest.param(n, marks=pytest.mark.slow) for n in TINY])
def test_two_training_steps_from_a_tiny_checkpoint(name, tmp_path):
    model_type, fields, recipe = TINY[name]
    path = make_hf_checkpoint(tmp_path / "model", model_type, {**SMALL, **fields})
    want = load_model_config(path)
    history = train(tiny(tmp_path, recipe, **{
        "mesh": "cpu-8", "trainer.sft_warmup.enable": False, "trainer.test_freq": -1,
        "trainer.val_before_train": False, "trainer.save_freq": -1,
        "actor_rollout_ref.rollout.max_concurrent_decodes": 64}))
    assert len(history) == 2
    for row in history:
        for key in ("actor/pg_loss", "actor/entropy", "critic/score/mean",
                    "response_length/mean", "training/rollout_probs_diff_max"):
            assert np.isfinite(row[key]), (key, row[key])
        assert row["training/rollout_probs_diff_max"] < 1e-3  # engine == trainer's forward
    assert load_model_config(path) == want  # the run used (and left) the family's checkpoint


@pytest.mark.parametrize("recipe", RECIPES)
def test_family_recipes_resolve(recipe, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), "--config",
                          str(ROOT / "configs" / recipe), "--print-config"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    model = cfg["actor_rollout_ref"]["model"]
    assert model["path"].startswith("models/") and model["tokenizer_path"] == model["path"]
