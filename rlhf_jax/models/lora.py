"""LoRA adapters of the decoder's projections: `y = x W + (alpha / r) (x A) B`.

An adapted projection `<proj>` (q_proj, ..., down_proj) gets a sibling parameter subtree
`<proj>_lora` holding `a` `[in..., r]` and `b` `[r, out...]`. Each carries its kernel's
logical axes on the kernel's dimensions and `None` on the rank axis, so the adapters are
sharded like their base weight with the rank replicated. `b` starts at zero (the adapted
model starts as its base exactly); `a` is PEFT's Kaiming-uniform init (bound 1/sqrt(fan_in)).

The functions here work on parameter trees: `strip` (the base, same arrays, no copy),
`adapters` (the adapter subtrees alone), `with_adapters` (put them back), `merge`
(`W + (alpha / r) A B` folded into the kernels: a base-shaped tree), `kernels_of` /
`with_kernels` (the adapted kernels alone, and back); `save_peft` writes the adapters as a
PEFT LoRA directory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rlhf_jax.config.checks import LORA_MODULES as PROJECTIONS
from rlhf_jax.models.ops import _matmul

SUFFIX = "_lora"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Rank r, alpha, and which projections carry adapters (a subset of PROJECTIONS)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = PROJECTIONS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(nn.Module):
    """`(alpha / r) (x A) B` for x `[..., in...]`, the low-rank update of one projection."""

    in_shape: tuple[int, ...]
    in_axes: tuple[str | None, ...]
    out_shape: tuple[int, ...]
    out_axes: tuple[str | None, ...]
    spec: LoraSpec
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        nk, r = len(self.in_shape), self.spec.rank
        a_init = nn.initializers.variance_scaling(
            1.0 / 3.0, "fan_in", "uniform", in_axis=tuple(range(nk)), out_axis=-1)
        a = self.param("a", nn.with_logical_partitioning(a_init, (*self.in_axes, None)),
                       (*self.in_shape, r), self.param_dtype)
        b = self.param("b", nn.with_logical_partitioning(nn.initializers.zeros,
                                                         (None, *self.out_axes)),
                       (r, *self.out_shape), self.param_dtype)
        h = _matmul(x.astype(self.dtype), a.astype(self.dtype), nk)
        return _matmul(h, b.astype(self.dtype), 1) * jnp.asarray(self.spec.scale, self.dtype)


def adapted(module: nn.Module, name: str, x, y, in_shape, in_axes, out_shape, out_axes):
    """`y` (the output of projection `name` on `x`) plus its adapter's update when the model's
    LoRA spec (`module.cfg.lora`) targets `name`; `y` unchanged otherwise. Called inside a
    compact `__call__`: the adapter is the submodule `<name>_lora` of `module`."""
    spec = module.cfg.lora
    if spec is None or name not in spec.targets:
        return y
    delta = LoraAdapter(tuple(in_shape), tuple(in_axes), tuple(out_shape), tuple(out_axes), spec,
                        module.dtype, module.param_dtype, name=name + SUFFIX)(x)
    return y + delta.astype(y.dtype)


# --------------------------------------------------------------------- parameter trees


def is_adapter_path(path: str) -> bool:
    """Whether a `jax.tree_util.keystr` path lies inside an adapter subtree."""
    return f"{SUFFIX}'" in path


def _filter(tree, keep_adapters: bool):
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if str(k).endswith(SUFFIX):
            if keep_adapters:
                out[k] = v
            continue
        sub = _filter(v, keep_adapters)
        if keep_adapters and (not isinstance(sub, dict) or not sub):
            continue
        out[k] = sub
    return out


def strip(params):
    """The base: `params` without the adapter subtrees (the same arrays, nothing copied)."""
    return _filter(params, False)


def adapters(params):
    """The adapter subtrees of `params` alone, at their places (a pruned tree)."""
    return _filter(params, True)


def with_adapters(base, adapter_tree):
    """`base` with `adapter_tree`'s subtrees added (the inverse of `strip` / `adapters`)."""
    if not isinstance(adapter_tree, dict):
        return adapter_tree
    out = dict(base)
    for k, v in adapter_tree.items():
        out[k] = v if str(k).endswith(SUFFIX) else with_adapters(base[k], v)
    return out


def _delta(a, b, kernel):
    """`A B` shaped like `kernel` (`[L, in..., out...]` when the layers are stacked)."""
    if kernel.ndim == a.ndim + b.ndim - 2:
        return jnp.tensordot(a, b, axes=1)
    return jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(a, b)


def merge(params, spec: LoraSpec):
    """The base-shaped tree with every adapted kernel replaced by `W + (alpha / r) A B`
    (computed in float32, stored in the kernel's dtype); other arrays are the same."""

    def fold(tree):
        if not isinstance(tree, dict):
            return tree
        out = {k: fold(v) for k, v in tree.items() if not str(k).endswith(SUFFIX)}
        for k, v in tree.items():
            if str(k).endswith(SUFFIX):
                proj = str(k)[: -len(SUFFIX)]
                w = tree[proj]["kernel"]
                d = _delta(v["a"].astype(jnp.float32), v["b"].astype(jnp.float32), w)
                out[proj] = {**out[proj], "kernel": (w.astype(jnp.float32)
                                                     + spec.scale * d).astype(w.dtype)}
        return out

    return fold(params)


def kernels_of(tree, adapter_tree):
    """The kernels of `tree` that `adapter_tree`'s adapters adapt, at their places."""
    out = {}
    for k, v in adapter_tree.items():
        if str(k).endswith(SUFFIX):
            proj = str(k)[: -len(SUFFIX)]
            out[proj] = {"kernel": tree[proj]["kernel"]}
        else:
            out[k] = kernels_of(tree[k], v)
    return out


def with_kernels(tree, kernels):
    """`tree` with the kernels of `kernels` (a `kernels_of` tree) in their places."""
    if not isinstance(kernels, dict):
        return kernels
    return {**tree, **{k: with_kernels(tree[k], v) for k, v in kernels.items()}}


# ------------------------------------------------------------------------ PEFT export

_PEFT_PLACES = {p: ("self_attn" if p in PROJECTIONS[:4] else "mlp") for p in PROJECTIONS}


def peft_tensors(params, spec: LoraSpec, num_layers: int) -> dict:
    """The adapters as PEFT names them (`base_model.model.model.layers.{i}.<place>.<proj>.
    lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`), float32 host arrays."""
    import numpy as np

    out = {}
    layers = params["model"]["layers"]
    for proj in spec.targets:
        place = _PEFT_PLACES[proj]
        ad = layers[place][proj + SUFFIX]
        a, b = np.asarray(jax.device_get(ad["a"])), np.asarray(jax.device_get(ad["b"]))
        for i in range(num_layers):
            name = f"base_model.model.model.layers.{i}.{place}.{proj}"
            r = spec.rank
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(
                a[i].reshape(-1, r).T.astype(np.float32))
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(
                b[i].reshape(r, -1).T.astype(np.float32))
    return out


def save_peft(params, spec: LoraSpec, num_layers: int, out_dir, base_path: str):
    """A PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`) that
    `peft.PeftModel.from_pretrained(<the transformers base>, out_dir)` loads."""
    import json
    from pathlib import Path

    from rlhf_jax.models.hf_io import write_safetensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
        "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out / "adapter_model.safetensors", peft_tensors(params, spec, num_layers))
    return out
