"""The run's config sections: the training loop, checkpoints and recovery (`trainer.*`, with
`trainer.rollback.*` and `trainer.sft_warmup.*`), the synthetic task (`synthetic.*`) and the
device mesh (`mesh`). `rlhf_jax.config.schema.Config` holds them beside verl's sections.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from rlhf_jax.config.coerce import Section
from rlhf_jax.config.coerce import factory as _factory
from rlhf_jax.config.coerce import section as _section

Logger = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


@_section
class RollbackConfig(Section):
    """`trainer.rollback.*`: restore the last checkpoint and scale the learning rates by
    lr_factor when KL > max_kl, a loss is NaN, or the value loss spikes (rollback.py): above
    value_loss_floor, value_loss_spike x the median of the last `window` good steps, and
    value_loss_mads (scaled) MADs above that median, once warmup_steps good steps are in."""

    enable: bool = True
    max_kl: float = 0.1
    value_loss_spike: float = 2.0
    value_loss_floor: float = 0.1  # ours: 0.5 E[(V - R)^2] of 0.1 is an error of ~0.45
    value_loss_mads: float = 6.0
    window: int = 20
    warmup_steps: int = 3
    lr_factor: float = 0.5
    max_rollbacks: int = 3


@_section
class SftWarmupConfig(Section):
    """`trainer.sft_warmup.*`: supervised steps on the task's answers before RL, until the
    validation score reaches target_score or max_steps (the synthetic task starts from noise)."""

    enable: bool = False
    max_steps: int = 0
    target_score: float = 0.15
    lr: float = 1e-3
    batch_size: int = 64
    eval_every: int = 25
    # e: targets (1 - e) * one-hot + e * uniform over the answer vocabulary (see sft.py)
    label_smoothing: float = 0.0


@_section
class TrainerConfig(Section):
    """`trainer.*`: the loop, logging, checkpoints and recovery."""

    total_epochs: int = 30
    total_training_steps: int | None = None  # null: total_epochs x steps per epoch
    save_freq: int = -1  # -1: never
    test_freq: int = -1  # -1: never
    # verl validates before training by default; here it is opt-in.
    val_before_train: bool = False
    logger: tuple[Logger, ...] = ("console",)
    project_name: str = "rlhf_jax"
    experiment_name: str = "default"
    # ${trainer.project_name} and ${trainer.experiment_name} are filled in at load time.
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None  # required when resume_mode is resume_path
    critic_warmup: int = 0  # steps that update only the critic
    # Stop once the mean critic/score/mean of the last 5 steps reaches this (null: never).
    early_stop_score: float | None = None
    max_ckpt_to_keep: int | None = None  # null: keep all
    seed: int = 0
    # Validation samples (input, output, score) logged as a `val/generations` event.
    log_val_generations: int = 0
    # Steps traced by jax.profiler into <default_local_dir>/profile (verl's key; null: none).
    profile_steps: tuple[int, ...] | None = None
    # Ours: JAX's persistent compilation cache (a directory, or "off"); null: the env
    # RLHF_JAX_COMPILATION_CACHE_DIR, else JAX's own setting, else ~/.cache/rlhf_jax/xla
    # (see rlhf_jax/compile_cache.py).
    compilation_cache_dir: str | None = None
    rollback: RollbackConfig = _factory(RollbackConfig)
    sft_warmup: SftWarmupConfig = _factory(SftWarmupConfig)


@_section
class SyntheticConfig(Section):
    """`synthetic.*`: when task is set, the trainer writes the task's parquet files, tokenizer
    and a random-init model at data.train_files / val_files / actor model path if missing."""

    task: Literal["addition", "wordproblems"] | None = None
    num_train: int = 2048
    num_val: int = 256
    seed: int = 0


@_section
class MeshConfig(Section):
    """`mesh`: a preset from meshes/ (or a .yaml path), with optional axis-size overrides.

    `mesh: single` is short for `mesh: {preset: single}`. Sizes are >= 1 or -1 ("the rest").
    """

    scalar_field: ClassVar[str] = "preset"

    preset: str = "cpu-8"
    data: int | None = None
    fsdp: int | None = None
    tensor: int | None = None
    dcn_data: int | None = None
    dcn_fsdp: int | None = None
    dcn_tensor: int | None = None
