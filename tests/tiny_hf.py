"""Tiny random transformers checkpoints of the supported families, and transformers' logits on
them: the reference the family tests compare against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

# Larger weights than transformers' 0.02: a wrong RoPE or window moves the logits more.
BASE = dict(vocab_size=96, intermediate_size=64, num_hidden_layers=2, rms_norm_eps=1e-6,
            initializer_range=0.1)


def make_hf_checkpoint(path: Path, model_type: str, fields: dict, seed: int = 0) -> Path:
    """A random checkpoint saved by transformers at `path` (its own config.json layout), with
    biases and norms moved off their init so that a mix-up shows."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **fields})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' float32 logits [B, T, V] of a left-padded batch (positions from 0 at
    each row's first real token, as `Model.forward` counts them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32)
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long),
                     position_ids=torch.tensor(pos, dtype=torch.long)).logits.numpy()
