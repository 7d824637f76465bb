"""The typed run config: verl's key tree as frozen dataclasses, from YAML plus dotted overrides.

    cfg = load_config("configs/ppo_tiny_cpu.yaml", ["actor_rollout_ref.actor.optim.lr=1e-5"])
    cfg.actor_rollout_ref.actor.clip_ratio      # 0.2
    print(to_yaml(cfg))                         # the effective config

Every config problem (unknown key, wrong type, bad enum value, impossible batch sizes) raises
`ConfigError` with one line naming the key. Derived defaults (`critic.enable`,
`critic.ppo_mini_batch_size`, `tokenizer_path`, `clip_ratio_low/high`, and the
`${trainer.project_name}`/`${trainer.experiment_name}` placeholders of
`trainer.default_local_dir`) are filled in at load, so `to_yaml` shows what the trainer uses.
Imports only the standard library, PyYAML and the jax-free `core_algos.registry` (the allowed
estimator and policy-loss names): `scripts/train.py --print-config` never loads jax.
"""

from rlhf_jax.config.checks import (
    MESHES_DIR,
    BatchPlan,
    MiniBatchPlan,
    validate_batch_arithmetic,
)
from rlhf_jax.config.coerce import FrozenDict
from rlhf_jax.config.loader import (
    config_from_dict,
    load_config,
    read_yaml,
    replace,
    to_dict,
    to_yaml,
)
from rlhf_jax.config.run_schema import (
    MeshConfig,
    RollbackConfig,
    SftWarmupConfig,
    SyntheticConfig,
    TrainerConfig,
)
from rlhf_jax.config.schema import (
    ActorConfig,
    ActorPolicyLossConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    CriticModelConfig,
    CriticOptimConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    KLCtrlConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    RolloutConfig,
    SamplingConfig,
)
from rlhf_jax.errors import ConfigError

__all__ = [
    "MESHES_DIR",
    "ActorConfig",
    "ActorPolicyLossConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "BatchPlan",
    "Config",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CriticOptimConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FrozenDict",
    "KLCtrlConfig",
    "MeshConfig",
    "MiniBatchPlan",
    "ModelConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RollbackConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SftWarmupConfig",
    "SyntheticConfig",
    "TrainerConfig",
    "config_from_dict",
    "load_config",
    "read_yaml",
    "replace",
    "to_dict",
    "to_yaml",
    "validate_batch_arithmetic",
]
