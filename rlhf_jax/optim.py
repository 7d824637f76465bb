"""Optimizer side of the training steps: a role's `TrainState`, verl's optimizer keys
(`OptimConfig`), its learning-rate schedules, AdamW, and which parameters train
(`Trainable`). `train_steps` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class TrainState(NamedTuple):
    """Parameters and optimizer state of one role, plus the rollback learning-rate scale."""

    params: Any
    opt_state: Any
    step: jax.Array  # optimizer steps taken (int32)
    lr_scale: jax.Array  # multiplies the schedule; rollback lowers it (float32)
    skipped: jax.Array  # updates skipped for a non-finite gradient norm (int32)



@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    warmup_style: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    total_steps: int = 1
    grad_clip: float = 1.0

    @classmethod
    def from_config(cls, optim, grad_clip: float, total_steps: int) -> OptimConfig:
        """verl's `*.optim` keys (and the role's `grad_clip`) as the optimizer runs them:
        warm-up steps from `lr_warmup_steps_ratio` when `lr_warmup_steps` is -1, the
        schedule's length from the run's when `total_training_steps` is -1."""
        warmup = optim.lr_warmup_steps
        if warmup < 0:
            warmup = int(optim.lr_warmup_steps_ratio * total_steps)
        total = optim.total_training_steps if optim.total_training_steps > 0 else total_steps
        return cls(
            lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
            eps=optim.eps, warmup_steps=warmup, warmup_style=optim.warmup_style,
            min_lr_ratio=optim.min_lr_ratio, total_steps=max(total, 1), grad_clip=grad_clip,
        )



def lr_schedule(cfg: OptimConfig):
    """verl's schedules: linear warm-up, then constant or cosine down to min_lr_ratio * lr."""
    warm = max(cfg.warmup_steps, 0)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = jnp.where(warm > 0, jnp.minimum(step / max(warm, 1), 1.0), 1.0)
        if cfg.warmup_style == "cosine":
            span = max(cfg.total_steps - warm, 1)
            progress = jnp.clip((step - warm) / span, 0.0, 1.0)
            cos = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            decay = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos
            return cfg.lr * jnp.where(step < warm, ramp, decay)
        return cfg.lr * ramp

    return schedule


def step_schedule(cfg: OptimConfig, updates_per_step: int = 1):
    """`lr_schedule` indexed by optimizer updates when each PPO step makes `updates_per_step`.

    verl steps its scheduler once per `update_actor` / `update_critic` call, so warm-up and
    decay are counted in training steps (as `warmup_steps` and `total_steps` are) and the
    learning rate is constant within a step: update k uses the schedule at `k // U`.
    """
    schedule, u = lr_schedule(cfg), max(int(updates_per_step), 1)
    return lambda count: schedule(jnp.asarray(count) // u)


def make_optimizer(cfg: OptimConfig, updates_per_step: int = 1) -> optax.GradientTransformation:
    """AdamW on the schedule; clipping and the rollback scale are applied by the update.

    The optimizer state does not depend on `updates_per_step` (only the learning rate read
    from its update count does), so `init_state` may build it with the default.
    """
    return optax.adamw(
        step_schedule(cfg, updates_per_step), b1=cfg.betas[0], b2=cfg.betas[1], eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Which parameters an update trains: `where(path) -> bool` over the paths of the
    parameter tree (`jax.tree_util.keystr` strings, e.g. "['model']['embed_tokens']..."),
    None for all of them. The rest is frozen: no gradient, no optimizer state, unchanged.
    (LoRA: the adapters trainable on a frozen base.)"""

    where: Any = None  # Callable[[str], bool] | None

    def split(self, params):
        """`(trainable, frozen)`: two trees of `params`' structure, each with None where the
        other holds the leaf. Everything trainable: `(params, None)`."""
        if self.where is None:
            return params, None
        pick = lambda keep: jax.tree_util.tree_map_with_path(
            lambda path, x: x if self.where(jax.tree_util.keystr(path)) == keep else None,
            params)
        return pick(True), pick(False)

    def merge(self, trainable, frozen):
        if frozen is None:
            return trainable
        return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen,
                            is_leaf=lambda x: x is None)


ALL_TRAINABLE = Trainable()


def init_state(params, tx: optax.GradientTransformation,
               trainable: Trainable = ALL_TRAINABLE) -> TrainState:
    """A fresh state; the optimizer moments inherit the parameters' shardings.

    The moments are created with explicit `out_shardings`: `jax.jit(tx.init)` alone would
    leave their layout to XLA, which replicates the zeros (4x the per-device bytes of the
    moments on a 2x2 fsdp x tensor mesh). Counts and other scalars are replicated.
    """
    mesh_of = [x.sharding.mesh for x in jax.tree.leaves(params)
               if isinstance(x.sharding, jax.sharding.NamedSharding)]
    train = trainable.split(params)[0]  # the optimizer state exists for this part only
    if not mesh_of:
        opt_state = jax.jit(tx.init)(train)
    else:
        replicated = jax.sharding.NamedSharding(mesh_of[0], jax.sharding.PartitionSpec())
        shardings = optax.tree_map_params(
            tx, lambda _, sh: sh, jax.eval_shape(tx.init, train),
            jax.tree.map(lambda x: x.sharding, train),
            transform_non_params=lambda _: replicated)
        opt_state = jax.jit(tx.init, out_shardings=shardings)(train)
    state = TrainState(
        params, opt_state, jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32),
        jnp.zeros((), jnp.int32),
    )
    # Scalars (steps, counts) go onto the parameters' mesh, replicated, so that the state's
    # shardings are the same before and after a step and the step compiles once.
    if not mesh_of:
        return state
    return jax.tree.map(
        lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
        else jax.device_put(x, replicated),
        state,
    )
