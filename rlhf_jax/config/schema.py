"""The config tree: frozen dataclasses with verl's key names and defaults.

Defaults are those of verl's `ppo_trainer.yaml` except where a comment gives the reason.
A `null` that means "same as another key" is filled in when the `Config` is built (see
`checks.resolve`), so `to_yaml(cfg)` shows the values the trainer will use. The advantage
estimators and policy-loss modes are the names registered in `core_algos.registry` (which
imports no jax).
"""

from __future__ import annotations

from typing import Annotated, Literal

from rlhf_jax.config import checks
from rlhf_jax.config.coerce import FrozenDict, NumberOrText, OneOf, Section
from rlhf_jax.config.coerce import factory as _factory
from rlhf_jax.config.coerce import section as _section
from rlhf_jax.config.run_schema import (
    MeshConfig,
    SyntheticConfig,
    TrainerConfig,
)
from rlhf_jax.core_algos.registry import adv_estimator_names, policy_loss_names
from rlhf_jax.errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16"]
LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
AdvEstimatorName = Annotated[str, OneOf(adv_estimator_names)]
PolicyLossName = Annotated[str, OneOf(policy_loss_names)]

@_section
class DataConfig(Section):
    """`data.*`: parquet files in verl's schema and the batch of prompts per step."""

    train_files: tuple[str, ...]  # a path or a list of paths
    val_files: tuple[str, ...] | None = None  # null: no validation
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step
    val_batch_size: int | None = None  # null: the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    truncation: Literal["error", "left", "right"] = "error"
    filter_overlong_prompts: bool = False
    return_raw_chat: bool = False
    tokenizer: str | None = None  # null: the actor's tokenizer


@_section
class ModelConfig(Section):
    """`actor_rollout_ref.model.*`: a HF model directory (config.json + safetensors)."""

    path: str
    tokenizer_path: str | None = None  # null -> path
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    # verl turns this on by default for its FSDP workers; here it is opt-in (tiny models).
    enable_gradient_checkpointing: bool = False
    # The layer stack as a lax.scan (true) or unrolled (false); null: unrolled up to 8 layers.
    scan_layers: bool | None = None
    override_config: FrozenDict = _factory(FrozenDict)  # HF config.json fields to replace
    # Sequence packing for the actor's and the reference's passes and the actor's update
    # (rlhf_jax.packing): rows of real tokens, no padding.
    use_remove_padding: bool = False
    # LoRA (verl's keys): adapters of rank `lora_rank` (0: off, full fine-tuning) and scale
    # lora_alpha / lora_rank on `target_modules` (all-linear or q_proj, k_proj, v_proj,
    # o_proj, gate_proj, up_proj, down_proj) less `exclude_modules`, on a frozen base.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ("all-linear",)
    exclude_modules: tuple[str, ...] | None = None


@_section
class OptimConfig(Section):
    """AdamW with warmup and a constant or cosine schedule (verl's FSDP optimizer keys)."""

    lr: float = 1e-6
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    warmup_style: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    total_training_steps: int = -1  # -1: the trainer fills in trainer.total_training_steps


@_section
class CriticOptimConfig(OptimConfig):
    """`critic.optim.*`: the same keys, verl's critic learning rate."""

    lr: float = 1e-5


@_section
class ActorPolicyLossConfig(Section):
    """`actor_rollout_ref.actor.policy_loss.*`: which registered policy loss the actor uses,
    and the settings of verl's modes (see `core_algos.PolicyLossConfig`)."""

    loss_mode: PolicyLossName = "vanilla"  # PPO clip + dual clip
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens exempted
    clip_cov_lb: float = 1.0  # clip_cov: covariance band, lower end
    clip_cov_ub: float = 5.0  # clip_cov: covariance band, upper end
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens penalised
    ppo_kl_coef: float = 0.1  # kl_cov: weight of the |log-ratio| penalty
    dro_beta: float | None = None  # dro: quadratic log-ratio penalty, required (> 0) for dro

    def __post_init__(self) -> None:
        super().__post_init__()
        path = "actor_rollout_ref.actor.policy_loss"
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{path}.{key}: must be > 0, got {getattr(self, key)}")
        if self.loss_mode == "dro" and (self.dro_beta is None or not self.dro_beta > 0):
            raise ConfigError(f"{path}.dro_beta: must be > 0 when loss_mode is dro, got "
                              f"{self.dro_beta}")


@_section
class ActorConfig(Section):
    """`actor_rollout_ref.actor.*`: the PPO policy update."""

    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_device: int | None = None  # null: whole mini-batch per device
    ppo_epochs: int = 1
    shuffle: bool = True
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # null -> clip_ratio
    clip_ratio_high: float | None = None  # null -> clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound of the policy loss, > 1
    tau_pos: float = 1.0  # sapo's gate temperature for A > 0 (policy_loss.loss_mode=sapo)
    tau_neg: float = 1.05  # sapo's gate temperature for A <= 0
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # a kl_penalty kind, see AlgorithmConfig
    grad_clip: float = 1.0
    optimizer_offload: bool = False
    # Token-budget micro-batches (needs model.use_remove_padding): each device's micro-batch
    # is one packed row of ppo_max_token_len_per_gpu tokens.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # Ours (verl's nearest, model.use_fused_kernels, is a bool of CUDA kernels): log-probs and
    # entropy through the LM head in chunks of this many tokens a device, never the float32
    # logits of a whole micro-batch (update and old log-probs); 0: off; null: on when those
    # logits would exceed 256 MiB a device, chunks of ~128 MiB. See rlhf_jax/models/head.py.
    lm_head_chunk_size: int | None = None
    # sum_v pi_v^2 per token from the old-log-prob pass: computed whenever the estimator
    # reads it (optimal_token_baseline, tir_optimal_token_baseline), true or false; true
    # with another estimator is refused (verl also logs variance_proxy/*, not here)
    calculate_sum_pi_squared: bool = False
    optim: OptimConfig = _factory(OptimConfig)
    policy_loss: ActorPolicyLossConfig = _factory(ActorPolicyLossConfig)


@_section
class RefConfig(Section):
    """`actor_rollout_ref.ref.*`: the frozen reference policy."""

    param_offload: bool = False
    log_prob_micro_batch_size_per_device: int | None = None
    log_prob_use_dynamic_bsz: bool | None = None  # null -> actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null -> actor.ppo_max_token_len_per_gpu
    lm_head_chunk_size: int | None = None  # as actor.lm_head_chunk_size, for ref log-probs


@_section
class SamplingConfig(Section):
    """`actor_rollout_ref.rollout.val_kwargs.*`: sampling for validation (greedy by default)."""

    n: int = 1
    temperature: float = 0.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    do_sample: bool = False


@_section
class RolloutConfig(Section):
    """`actor_rollout_ref.rollout.*`: generation with the JetStream-style engine."""

    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    do_sample: bool = True
    max_concurrent_decodes: int = 64  # decode slots of the engine (at most)
    # verl's: the share of a device's memory for the rollout's weights and KV cache; the
    # slots shrink to fit it (rlhf_jax/rollout/memory.py; on CPU a share of host RAM).
    gpu_memory_utilization: float = 0.5
    prefill_buckets: tuple[int, ...] | None = None  # null: powers of two up to max_prompt_length
    # Not verl's (vLLM does it inside): once no request waits, the decode slots halve each
    # time at most half are live, when responses may run this long (null: never; shorter
    # responses keep one generate program). rlhf_jax/rollout/driver.py.
    compact_slots_min_response_length: int | None = 32
    log_prob_micro_batch_size_per_device: int | None = None
    log_prob_use_dynamic_bsz: bool | None = None  # null -> actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null -> actor.ppo_max_token_len_per_gpu
    # verl's default is false; here the engine's log-probs feed training/rollout_probs_diff_*.
    calculate_log_probs: bool = True
    val_kwargs: SamplingConfig = _factory(SamplingConfig)


@_section
class ActorRolloutRefConfig(Section):
    """`actor_rollout_ref.*`: one backbone shared by the actor, the rollout and the reference."""

    model: ModelConfig
    actor: ActorConfig = _factory(ActorConfig)
    ref: RefConfig = _factory(RefConfig)
    rollout: RolloutConfig = _factory(RolloutConfig)
    # verl's switch: true generates on the training devices between steps; false is the
    # one-step-off-policy mode (rlhf_jax/async_rollout.py, `async_training.*`): the next
    # batch is generated, on the mesh preset's `rollout_sizes` devices, while a step trains.
    hybrid_engine: bool = True


@_section
class CriticModelConfig(Section):
    """`critic.model.*`: null path: initialise the value model from the actor's backbone."""

    path: str | None = None
    tokenizer_path: str | None = None  # null -> the actor's tokenizer
    override_config: FrozenDict = _factory(FrozenDict)
    enable_gradient_checkpointing: bool = False
    scan_layers: bool | None = None  # null: unrolled up to 8 layers
    use_remove_padding: bool = False  # sequence packing for the critic's pass and update
    # LoRA (verl's keys): adapters of rank `lora_rank` (0: off, full fine-tuning) and scale
    # lora_alpha / lora_rank on `target_modules` (all-linear or q_proj, k_proj, v_proj,
    # o_proj, gate_proj, up_proj, down_proj) less `exclude_modules`, on a frozen base
    # (the value head `score` trains whole).
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ("all-linear",)
    exclude_modules: tuple[str, ...] | None = None


@_section
class CriticConfig(Section):
    """`critic.*`: the value model and its clipped value loss."""

    enable: bool | None = None  # null -> true iff algorithm.adv_estimator needs values (gae)
    model: CriticModelConfig = _factory(CriticModelConfig)
    optim: CriticOptimConfig = _factory(CriticOptimConfig)
    ppo_mini_batch_size: int | None = None  # null -> the actor's
    ppo_micro_batch_size_per_device: int | None = None  # null: whole mini-batch per device
    ppo_epochs: int | None = None  # null -> the actor's
    shuffle: bool = True
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    optimizer_offload: bool = False
    use_dynamic_bsz: bool | None = None  # null -> actor_rollout_ref.actor.use_dynamic_bsz
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int | None = None  # null -> ppo_max_token_len_per_gpu
    # GAE with one critic update a step (one epoch, one mini-batch): that update's forward
    # pass makes the rollout's values (and returns); false: a separate values pass, as verl
    values_in_update: bool = True


@_section
class RewardModelModelConfig(Section):
    path: str | None = None


@_section
class OverlongBufferConfig(Section):
    """`reward_model.overlong_buffer.*`: DAPO's overlong reward shaping. A response longer
    than `max_response_length - len` tokens gets `-(excess / len) * penalty_factor` added to
    its score (0 down to -penalty_factor at the hard limit); `log` adds `overlong_reward` and
    `overlong` to the reward's extra info (validation logs them, as verl does)."""

    enable: bool = False
    len: int = 0  # tokens of the buffer before data.max_response_length, > 0 when enabled
    penalty_factor: float = 0.0
    log: bool = False


@_section
class RewardModelConfig(Section):
    """`reward_model.*`: a learned reward model (off: rule rewards by data_source)."""

    enable: bool = False
    model: RewardModelModelConfig = _factory(RewardModelModelConfig)
    micro_batch_size_per_device: int | None = None
    overlong_buffer: OverlongBufferConfig = _factory(OverlongBufferConfig)


@_section
class CustomRewardFunctionConfig(Section):
    """A scoring function `name(data_source, solution_str, ground_truth, extra_info)`."""

    path: str | None = None  # a dotted module path or a .py file
    name: str = "compute_score"


@_section
class RewardConfig(Section):
    custom_reward_function: CustomRewardFunctionConfig = _factory(CustomRewardFunctionConfig)
    # verl's key (its default 8): threads that score a batch's samples while the old
    # log-prob, reference and value passes run (rlhf_jax/reward_pool.py). 0 here: inline,
    # one sample after the other, before those passes (the behaviour before the pool).
    num_workers: int = 0
    timeout_s: float | None = None  # a sample scoring longer fails the step (null: no bound)


@_section
class AsyncTrainingConfig(Section):
    """`async_training.*`: the one-step-off-policy mode (`hybrid_engine: false`)."""

    # Steps a batch's weights may lag the weights it trains: step s trains on samples of the
    # policy after step s - 1 - max_staleness. 0 is the synchronous schedule. (verl's fully
    # async `staleness_threshold` is a share of samples, a different bound.)
    max_staleness: int = 1


@_section
class KLCtrlConfig(Section):
    """`algorithm.kl_ctrl.*`: the coefficient beta of KL-in-reward (the adaptive one moves)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@_section
class RolloutCorrectionConfig(Section):
    """`algorithm.rollout_correction.*`: verl's rollout correction (its yaml's defaults:
    diagnostics only). Importance weights `pi_old / pi_rollout` of each token (`token`) or
    sequence (`sequence`), truncated at `rollout_is_threshold` (or IcePop for "lower_upper"),
    multiply the policy loss; `rollout_rs` takes tokens / sequences whose divergence is out
    of `rollout_rs_threshold` out of the loss. `bypass_mode`: PPO's old log-probs are the
    rollout engine's own (no old_log_prob pass) and the correction is made in the loss,
    against the current policy, with `loss_type` ppo_clip or reinforce. The `rollout_corr/*`
    diagnostics are logged in every mode. See rlhf_jax/core_algos/rollout_corr.py."""

    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: Annotated[str | float, NumberOrText()] = 2.0  # U, or "lower_upper"
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # comma-separated: token_k1, seq_sum_k3, seq_max_k2, ...
    rollout_rs_threshold: Annotated[str | float, NumberOrText()] | None = None  # one per option
    bypass_mode: bool = False
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"  # bypass mode's loss


@_section
class FilterGroupsConfig(Section):
    """`algorithm.filter_groups.*`: DAPO's dynamic sampling. Each step generates batches of
    fresh prompts until data.train_batch_size prompts have groups whose `metric` is not the
    same for every response, then trains on the first of them (see dynamic_sampling.py)."""

    enable: bool = False
    metric: str | None = None  # acc | score | seq_reward | seq_final_reward | a reward info key
    max_num_gen_batches: int = 0  # <= 0: no limit
    max_inflight_gen_batches: int = 1  # verl's async replay buffer; one at a time here


@_section
class AlgorithmConfig(Section):
    """`algorithm.*`: advantages and the KL penalty."""

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: AdvEstimatorName = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # kl|k1|abs|mse|k2|low_var_kl|k3 (optionally with "+") or full
    kl_ctrl: KLCtrlConfig = _factory(KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = _factory(RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = _factory(FilterGroupsConfig)


@_section
class Config(Section):
    """The whole run: one immutable tree, validated on construction."""

    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig = _factory(CriticConfig)
    reward_model: RewardModelConfig = _factory(RewardModelConfig)
    reward: RewardConfig = _factory(RewardConfig)
    async_training: AsyncTrainingConfig = _factory(AsyncTrainingConfig)
    algorithm: AlgorithmConfig = _factory(AlgorithmConfig)
    trainer: TrainerConfig = _factory(TrainerConfig)
    synthetic: SyntheticConfig = _factory(SyntheticConfig)
    mesh: MeshConfig = _factory(MeshConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, section in checks.resolve(self).items():
            object.__setattr__(self, name, section)
        checks.validate(self)
