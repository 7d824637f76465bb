"""LoRA training of a role (verl's `lora_rank`, `lora_alpha`, `target_modules`,
`exclude_modules`): adapters on a frozen base (`models.lora`), and what a run does with them.

- **Trainable part**: the adapters (and a critic's value head); the update differentiates
  only them and the optimizer state exists only for them (`optim.Trainable`).
- **Reference policy**: the actor's own base arrays run without the adapters (`strip`, no
  copy), so no second copy of the weights is kept.
- **Weight sync**: `WeightSync` moves only the adapters train -> generate layout at each
  sync; the base moves once (and again only when it changes, e.g. after the SFT warm start
  or a restore). The engine runs the base model on `W + (alpha / r) A B` merged on the
  generate side at each sync (faster than applying them in its matmuls: `WeightSync`).
- **Checkpoints** hold the trainable part and its optimizer state, plus a `BaseRef` (the
  base's HF directory and a fingerprint of its files) checked on restore and export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax

from rlhf_jax.checkpoint import CheckpointError
from rlhf_jax.config.checks import lora_targets
from rlhf_jax.models import Model
from rlhf_jax.models.lora import (
    LoraSpec,
    adapters,
    is_adapter_path,
    kernels_of,
    merge,
    strip,
    with_adapters,
    with_kernels,
)
from rlhf_jax.optim import ALL_TRAINABLE, Trainable
from rlhf_jax.rollout import reshard


def spec_of(model_cfg) -> LoraSpec | None:
    """The adapters a `*.model` config section asks for; None when `lora_rank` is 0."""
    if model_cfg.lora_rank <= 0:
        return None
    return LoraSpec(model_cfg.lora_rank, float(model_cfg.lora_alpha),
                    lora_targets(model_cfg.target_modules, model_cfg.exclude_modules))


def _adapter_or_head(path: str) -> bool:
    return is_adapter_path(path) or path.startswith("['score']")


def trainable(model: Model) -> Trainable:
    """What `model`'s update trains: everything without LoRA; else its adapters (and the
    value head of a value model, which has no base to adapt)."""
    if model.cfg.lora is None:
        return ALL_TRAINABLE
    return Trainable(_adapter_or_head if model.kind == "value" else is_adapter_path)


def base_model(model: Model) -> Model:
    """`model` without adapters: the reference policy, the merged export."""
    if model.cfg.lora is None:
        return model
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, lora=None))


def init_adapters(model: Model, base_params, mesh, rules, rng):
    """`base_params` with fresh adapters of `model` (B = 0) attached, born sharded by the
    same rules as their kernels; the base's random init is never computed (it is not an
    output of the compiled init)."""
    shardings = adapters(model.shardings(mesh, rules))
    fresh = jax.jit(lambda r: adapters(nn.meta.unbox(model._init_boxed(r))),
                    out_shardings=shardings)(rng)
    return with_adapters(base_params, fresh)


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


# -------------------------------------------------------------------------- weight sync


class WeightSync:
    """update_weights: the actor's parameters as the engine reads them, generate layout.

    Full fine-tuning moves every parameter at every sync. With LoRA the base is frozen: it
    moves once and stays in the generate layout, and each sync moves the adapters alone (a
    few MB for a 0.5B model at rank 8), then folds `W + (alpha / r) A B` into a copy of
    the adapted kernels on the generate side: the engine runs the base model on merged
    weights. Merging won over applying the adapters in the engine's matmuls on the
    benchmark (`python scripts/bench.py lora`: `lora.apply_over_merge` > 1, i.e. a rollout
    of 128 decode steps with the adapters applied took longer than one merge and the same
    steps on merged weights). The base moves again only when the caller says it changed
    (`rebase`: the SFT warm start, a restore). Memory: the generate copy of the base plus
    the merged kernels.

    `__call__(params, rebase) -> (generate-layout params of the engine's model, bytes moved)`.
    `gather`: where the generate layout is on this host's devices alone (the one-step-off
    mode on several hosts), what first makes a host-local copy of the train-layout params
    (`distributed.host_local_copy`); None: the layouts share a device set, nothing first.
    """

    def __init__(self, model: Model, gen_shardings, gather: Callable | None = None):
        self.spec = model.cfg.lora
        self.shardings = gen_shardings
        self.gather = gather
        if gather is not None and self.spec is not None:
            raise ValueError("a host-local generate layout moves full weights only (no LoRA)")
        self._gen_base = None
        if self.spec is not None:
            ad_sh, base_sh = adapters(gen_shardings), strip(gen_shardings)
            self._merge = jax.jit(
                lambda base, ad: kernels_of(merge(with_adapters(base, ad), self.spec), ad),
                out_shardings=kernels_of(base_sh, ad_sh))

    def engine_model(self, model: Model) -> Model:
        """The model the engine runs: the base on merged weights (LoRA), else `model`."""
        return base_model(model)

    def __call__(self, params, rebase: bool = False) -> tuple[Any, int]:
        """`rebase`: the frozen base changed too (the warm start, a restore); it moves then,
        and at the first call."""
        if self.spec is None:
            local = params if self.gather is None else self.gather(params)
            return reshard(local, self.shardings), nbytes(params)
        moved = 0
        if self._gen_base is None or rebase:
            base = strip(params)
            # a copy where the layouts agree: the update donates the train-layout arrays
            self._gen_base = jax.tree.map(lambda new, old: new.copy() if new is old else new,
                                          reshard(base, strip(self.shardings)), base)
            moved = nbytes(base)
        ad = adapters(params)
        gen = reshard(ad, adapters(self.shardings))
        return with_kernels(self._gen_base, self._merge(self._gen_base, gen)), \
            moved + nbytes(ad)


# -------------------------------------------------------------------------- base reference


def fingerprint(path: str | Path) -> str:
    """A digest of an HF directory's weight files: names, sizes, and the first and last
    MiB of each (cheap for a 70B checkpoint, and it changes with any rewrite we make)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class BaseRef:
    """Where a LoRA run's frozen base comes from: an HF directory and its `fingerprint`."""

    path: str
    fingerprint: str

    @classmethod
    def of(cls, path: str | Path) -> BaseRef:
        return cls(str(Path(path).resolve()), fingerprint(path))

    def meta(self) -> dict:
        return {"path": self.path, "fingerprint": self.fingerprint}

    @classmethod
    def from_meta(cls, meta: dict) -> BaseRef:
        """The checkpoint's base, after checking its directory still holds those weights."""
        if not meta:
            raise CheckpointError("the checkpoint names no LoRA base (it predates LoRA runs "
                                  "or is damaged)")
        ref = cls(meta["path"], meta["fingerprint"])
        if not any(Path(ref.path).glob("*.safetensors")):
            raise CheckpointError(f"the checkpoint's LoRA base {ref.path} has no weights "
                                  "(*.safetensors); restore it there first")
        got = fingerprint(ref.path)
        if got != ref.fingerprint:
            raise CheckpointError(f"the LoRA base at {ref.path} changed since the checkpoint "
                                  f"(fingerprint {got} != {ref.fingerprint})")
        return ref


def pruned(trainable_: Trainable, state):
    """A `TrainState` with the frozen parameters left out (None): what a checkpoint holds."""
    if trainable_.where is None:
        return state
    return state._replace(params=trainable_.split(state.params)[0])


def unpruned(trainable_: Trainable, restored, current):
    """A restored pruned `TrainState` with `current`'s frozen parameters put back."""
    if trainable_.where is None:
        return restored
    frozen = trainable_.split(current.params)[1]
    return restored._replace(params=trainable_.merge(restored.params, frozen))


class Bases:
    """The frozen bases of a run's LoRA roles (`{"actor": model, "critic": model}`, the
    roles without adapters left out): where each comes from, for the checkpoints' meta,
    and a restored role's base swapped for the checkpoint's when that is another one
    (a run that warm-started its base resumes on the base it saved)."""

    def __init__(self, models: dict[str, Model], paths: dict[str, str | Path], layouts):
        self.models = {r: m for r, m in models.items() if m is not None and m.cfg.lora}
        self.refs = {r: BaseRef.of(paths[r]) for r in self.models}
        self.mesh, self.rules = layouts.mesh, layouts.spec.train_rules

    def set(self, role: str, path: str | Path) -> None:
        if role in self.models:
            self.refs[role] = BaseRef.of(path)

    def meta(self) -> dict:
        return {r: ref.meta() for r, ref in self.refs.items()}

    def restored(self, role: str, state, meta: dict):
        """`state` (a restored role) on the base the checkpoint names."""
        if role not in meta:
            raise CheckpointError(f"the checkpoint names no LoRA base of the {role}")
        ref = BaseRef.from_meta(meta[role])
        if ref.path == self.refs[role].path:
            return state
        from rlhf_jax.models.hf_io import load_hf_params

        model = self.models[role]
        bare = base_model(model)
        base = load_hf_params(bare, ref.path, bare.shardings(self.mesh, self.rules))
        t = trainable(model)
        full = with_adapters(base, adapters(state.params))
        self.refs[role] = ref
        return state._replace(params=t.merge(t.split(state.params)[0], t.split(full)[1]))
