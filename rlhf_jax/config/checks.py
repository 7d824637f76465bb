"""Cross-field rules of the config: derived defaults, ranges, and the batch arithmetic.

Everything that can be checked without devices runs when a `Config` is built;
`validate_batch_arithmetic` needs the mesh's data-parallel size and runs once the mesh exists.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_jax.core_algos.registry import get_adv_estimator
from rlhf_jax.core_algos.rollout_corr_spec import RolloutCorrection, SpecError
from rlhf_jax.errors import ConfigError
from rlhf_jax.paths import MESHES_DIR

if TYPE_CHECKING:
    from rlhf_jax.config.schema import Config

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")

_ARR = "actor_rollout_ref"
_OPTIMS = (f"{_ARR}.actor.optim", "critic.optim")
_SAMPLING = (f"{_ARR}.rollout", f"{_ARR}.rollout.val_kwargs")


Rule = tuple[Callable[[Any], bool], str]


def _rule(test: Callable[[Any], bool], text: str) -> Rule:
    return test, text


_GE1 = _rule(lambda v: v >= 1, "must be >= 1")
_GE0 = _rule(lambda v: v >= 0, "must be >= 0")
_GT0 = _rule(lambda v: v > 0, "must be > 0")
_UNIT = _rule(lambda v: 0 <= v <= 1, "must be in [0, 1]")
_FREQ = _rule(lambda v: v == -1 or v >= 1, "must be -1 (never) or >= 1")
_TOP_K = _rule(lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")

# (key path, rule); a null value is skipped (its meaning is documented in the schema).
_RULES = (
    *[(p, _GE1) for p in (
        "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
        "data.val_batch_size", f"{_ARR}.actor.ppo_mini_batch_size",
        f"{_ARR}.actor.ppo_micro_batch_size_per_device", f"{_ARR}.actor.ppo_epochs",
        f"{_ARR}.ref.log_prob_micro_batch_size_per_device", f"{_ARR}.rollout.n",
        f"{_ARR}.rollout.max_concurrent_decodes",
        f"{_ARR}.rollout.log_prob_micro_batch_size_per_device",
        f"{_ARR}.rollout.val_kwargs.n", "critic.ppo_mini_batch_size",
        f"{_ARR}.actor.ppo_max_token_len_per_gpu", f"{_ARR}.ref.log_prob_max_token_len_per_gpu",
        f"{_ARR}.rollout.log_prob_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu",
        "critic.ppo_micro_batch_size_per_device", "critic.ppo_epochs",
        "reward_model.micro_batch_size_per_device", "algorithm.kl_ctrl.horizon",
        "trainer.total_epochs", "trainer.total_training_steps", "trainer.max_ckpt_to_keep",
        "trainer.sft_warmup.batch_size", "trainer.sft_warmup.eval_every",
        "trainer.rollback.window",
        "synthetic.num_train", "synthetic.num_val",
    )],
    *[(p, _GE0) for p in (
        "trainer.critic_warmup", "trainer.rollback.max_rollbacks",
        "trainer.rollback.warmup_steps", "trainer.rollback.value_loss_floor",
        "trainer.rollback.value_loss_mads", "trainer.log_val_generations",
        "trainer.sft_warmup.max_steps", f"{_ARR}.actor.kl_loss_coef", "reward.num_workers",
        "async_training.max_staleness", "algorithm.kl_ctrl.kl_coef",
        f"{_ARR}.actor.lm_head_chunk_size", f"{_ARR}.ref.lm_head_chunk_size",
    )],
    ("trainer.save_freq", _FREQ),
    ("trainer.test_freq", _FREQ),
    ("algorithm.gamma", _UNIT),
    ("algorithm.lam", _UNIT),
    (f"{_ARR}.actor.clip_ratio", _GT0),
    (f"{_ARR}.actor.clip_ratio_low", _rule(lambda v: 0 <= v < 1, "must be in [0, 1)")),
    (f"{_ARR}.actor.clip_ratio_high", _GE0),
    (f"{_ARR}.actor.clip_ratio_c", _rule(lambda v: v > 1, "must be > 1 (the dual-clip bound)")),
    (f"{_ARR}.actor.grad_clip", _GT0),
    ("critic.grad_clip", _GT0),
    ("critic.cliprange_value", _GT0),
    ("algorithm.kl_ctrl.target_kl", _GT0),
    ("trainer.rollback.max_kl", _GT0),
    ("trainer.rollback.value_loss_spike", _rule(lambda v: v > 1, "must be > 1")),
    ("trainer.rollback.lr_factor", _rule(lambda v: 0 < v <= 1, "must be in (0, 1]")),
    ("trainer.sft_warmup.lr", _GT0),
    ("reward.timeout_s", _GT0),
    (f"{_ARR}.rollout.gpu_memory_utilization", _rule(lambda v: 0 < v <= 1, "must be in (0, 1]")),
    ("trainer.sft_warmup.label_smoothing", _rule(lambda v: 0 <= v < 1, "must be in [0, 1)")),
    *[(f"{o}.{k}", r) for o in _OPTIMS for k, r in (
        ("lr", _GE0), ("weight_decay", _GE0), ("eps", _GT0), ("lr_warmup_steps_ratio", _UNIT),
        ("min_lr_ratio", _UNIT), ("lr_warmup_steps", _rule(lambda v: v >= -1, "must be >= -1")),
        ("total_training_steps", _rule(lambda v: v == -1 or v >= 1, "must be -1 or >= 1")),
    )],
    *[(f"{s}.{k}", r) for s in _SAMPLING for k, r in (
        ("temperature", _GE0), ("top_k", _TOP_K),
        ("top_p", _rule(lambda v: 0 < v <= 1, "must be in (0, 1]")),
    )],
)


# verl keys accepted (so verl configs load) whose other values are not implemented here:
# (key path, the one value that runs, why / what to do instead).
_ONLY = (
    ("data.reward_fn_key", "data_source",
     "rewards are looked up by the data_source column (rlhf_jax.rewards.register_reward)"),
    ("data.return_raw_chat", False, "the rollout engine takes token ids, never the raw chat"),
    (f"{_ARR}.rollout.calculate_log_probs", True,
     "the engine always returns the sampled tokens' log-probs (rollout_probs_diff, bypass)"),
    ("algorithm.filter_groups.max_inflight_gen_batches", 1,
     "dynamic sampling generates one batch, scores and filters it, then the next"),
)


def _get(cfg: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), cfg)


def _fail(path: str, message: str) -> None:
    raise ConfigError(f"{path}: {message}")


def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def resolve(cfg: Config) -> dict[str, Any]:
    """Fills in the `null -> other key` defaults; returns the sections that changed."""
    out: dict[str, Any] = {}
    arr, critic, trainer = cfg.actor_rollout_ref, cfg.critic, cfg.trainer
    model = dataclasses.replace(
        arr.model, tokenizer_path=_default(arr.model.tokenizer_path, arr.model.path)
    )
    actor = dataclasses.replace(
        arr.actor,
        clip_ratio_low=_default(arr.actor.clip_ratio_low, arr.actor.clip_ratio),
        clip_ratio_high=_default(arr.actor.clip_ratio_high, arr.actor.clip_ratio),
    )
    budget = lambda s: dataclasses.replace(
        s, log_prob_use_dynamic_bsz=_default(s.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz),
        log_prob_max_token_len_per_gpu=_default(s.log_prob_max_token_len_per_gpu,
                                                actor.ppo_max_token_len_per_gpu))
    ref, rollout = budget(arr.ref), budget(arr.rollout)
    if (model, actor, ref, rollout) != (arr.model, arr.actor, arr.ref, arr.rollout):
        out["actor_rollout_ref"] = dataclasses.replace(arr, model=model, actor=actor, ref=ref,
                                                       rollout=rollout)
    new_critic = dataclasses.replace(
        critic,
        enable=_default(critic.enable, _needs_values(cfg)),
        ppo_mini_batch_size=_default(critic.ppo_mini_batch_size, actor.ppo_mini_batch_size),
        ppo_epochs=_default(critic.ppo_epochs, actor.ppo_epochs),
        use_dynamic_bsz=_default(critic.use_dynamic_bsz, actor.use_dynamic_bsz),
        forward_max_token_len_per_gpu=_default(critic.forward_max_token_len_per_gpu,
                                               critic.ppo_max_token_len_per_gpu),
        model=dataclasses.replace(
            critic.model, tokenizer_path=_default(critic.model.tokenizer_path, model.tokenizer_path)
        ),
    )
    if new_critic != critic:
        out["critic"] = new_critic
    local_dir = _interpolate(trainer)
    if local_dir != trainer.default_local_dir:
        out["trainer"] = dataclasses.replace(trainer, default_local_dir=local_dir)
    return out


def _needs_values(cfg: Config) -> bool:
    """Whether the advantage estimator takes critic values (gae)."""
    return "values" in get_adv_estimator(cfg.algorithm.adv_estimator).needs


def _interpolate(trainer: Any) -> str:
    names = {"project_name": trainer.project_name, "experiment_name": trainer.experiment_name}
    names.update({f"trainer.{k}": v for k, v in list(names.items())})

    def sub(match: re.Match) -> str:
        if match.group(1) not in names:
            _fail("trainer.default_local_dir", f"unknown interpolation {match.group(0)!r} "
                  "(known: ${trainer.project_name}, ${trainer.experiment_name})")
        return names[match.group(1)]

    return _INTERPOLATION.sub(sub, trainer.default_local_dir)


def check_kl_kind(value: str, path: str) -> None:
    """`kl|k1|abs|mse|k2|low_var_kl|k3`, each optionally with `+`, or `full`."""
    base = value[:-1] if value.endswith("+") else value
    if value == "full" or base in KL_KINDS:
        return
    if base == "full":
        _fail(path, "'full+' is not allowed: '+' (k2 gradient) applies to the sampled estimators")
    _fail(path, f"{value!r} is not one of {', '.join(KL_KINDS)} (each optionally with '+'), full")


def _check_mesh(mesh: Any) -> None:
    preset = Path(mesh.preset)
    if preset.suffix in (".yaml", ".yml"):
        if not preset.is_file():
            _fail("mesh.preset", f"mesh file not found: {mesh.preset}")
    elif not (MESHES_DIR / f"{mesh.preset}.yaml").is_file():
        known = ", ".join(sorted(p.stem for p in MESHES_DIR.glob("*.yaml"))) or "none"
        _fail("mesh.preset", f"unknown mesh preset {mesh.preset!r} (known: {known})")
    for group in (("data", "fsdp", "tensor"), ("dcn_data", "dcn_fsdp", "dcn_tensor")):
        sizes = [getattr(mesh, name) for name in group]
        for name, size in zip(group, sizes, strict=True):
            if size is not None and (size == 0 or size < -1):
                _fail(f"mesh.{name}", f"must be >= 1 or -1 (the remaining devices), got {size}")
        if sizes.count(-1) > 1:
            _fail("mesh", f"at most one of {', '.join(group)} may be -1")


def _check_mini_batch(role: str, mini: int, cfg: Config) -> None:
    train, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    path = f"{role}.ppo_mini_batch_size"
    if mini > train:
        _fail(path, f"{mini} prompts is more than data.train_batch_size {train}")
    if train % mini:
        _fail(path, f"data.train_batch_size {train} x rollout.n {n} sequences do not split into "
              f"mini-batches of {mini} x {n} (both sizes count prompts)")


def _check_dapo(cfg: Config) -> None:
    """DAPO's keys: the overlong buffer fits in the response budget; dynamic sampling names
    the metric it filters on."""
    buf, path = cfg.reward_model.overlong_buffer, "reward_model.overlong_buffer"
    if buf.enable:
        if buf.len < 1:
            _fail(f"{path}.len", f"must be >= 1 when {path}.enable is true, got {buf.len}")
        if buf.len > cfg.data.max_response_length:
            _fail(f"{path}.len", f"{buf.len} is more than data.max_response_length "
                  f"{cfg.data.max_response_length}")
        if buf.penalty_factor < 0:
            _fail(f"{path}.penalty_factor", f"must be >= 0, got {buf.penalty_factor}")
    groups, path = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    if groups.enable and not groups.metric:
        _fail(f"{path}.metric", f"must be set when {path}.enable is true "
              "(acc, score, seq_reward, seq_final_reward or a key the reward function returns)")
    if groups.enable and groups.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        _fail(f"{path}.metric", "seq_final_reward with algorithm.use_kl_in_reward=true needs the "
              "KL penalty before filtering, which runs after it here; use seq_reward")


def _check_async(cfg: Config) -> None:
    """The reward pool's and the one-step-off mode's keys take effect, or are refused."""
    if cfg.reward.timeout_s is not None and cfg.reward.num_workers == 0:
        _fail("reward.timeout_s", "bounds the reward pool's samples: set reward.num_workers "
              ">= 1 (inline scoring has no timeout)")
    if cfg.actor_rollout_ref.hybrid_engine:
        if cfg.async_training.max_staleness != 1:
            _fail("async_training.max_staleness", "is read by the one-step-off mode only: "
                  f"set {_ARR}.hybrid_engine=false")
        return
    if cfg.algorithm.filter_groups.enable:
        _fail(f"{_ARR}.hybrid_engine", "false (one-step-off) generates one batch a step; "
              "dynamic sampling (algorithm.filter_groups) draws several: turn one off")
    if cfg.actor_rollout_ref.model.lora_rank > 0:
        _fail(f"{_ARR}.hybrid_engine", "false (one-step-off) keeps the rollout's full weights "
              f"of past steps; with LoRA ({_ARR}.model.lora_rank > 0) it is not supported yet: "
              "turn one off")


def _check_sum_pi_squared(cfg) -> None:
    """sum_pi_squared comes from the old-log-prob pass, for the estimators that read it."""
    needs = "sum_pi_squared" in get_adv_estimator(cfg.algorithm.adv_estimator).needs
    if cfg.actor_rollout_ref.actor.calculate_sum_pi_squared and not needs:
        _fail(f"{_ARR}.actor.calculate_sum_pi_squared", "only the estimators that read it "
              "(optimal_token_baseline, tir_optimal_token_baseline) use it here, and they "
              "turn it on themselves (verl's variance_proxy/* metrics are not implemented)")
    if needs and cfg.algorithm.rollout_correction.bypass_mode:
        _fail("algorithm.rollout_correction.bypass_mode", f"{cfg.algorithm.adv_estimator!r} "
              "needs sum_pi_squared from the old-log-prob pass, which bypass mode skips")


def _check_rollout_correction(cfg: Config) -> None:
    """`algorithm.rollout_correction`: modes and thresholds parse (`RolloutCorrection`), and
    the bypass-mode settings fit the rollout and the policy loss."""
    rc, path = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    try:
        RolloutCorrection.from_config(rc)
    except SpecError as exc:
        _fail(f"{path}.{exc.key}", exc.message)
    rollout, loss_mode = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor.policy_loss
    if rc.loss_type == "reinforce" and not rc.bypass_mode:
        _fail(f"{path}.loss_type", "'reinforce' is bypass mode's loss; set bypass_mode=true "
              "or loss_type=ppo_clip")
    if rc.loss_type == "reinforce" and loss_mode.loss_mode != "vanilla":
        _fail(f"{path}.loss_type", f"'reinforce' replaces {_ARR}.actor.policy_loss.loss_mode, "
              f"which must then be vanilla (got {loss_mode.loss_mode!r})")
    if rc.bypass_mode and (not rollout.do_sample or rollout.top_k > 0 or rollout.top_p < 1.0):
        # The engine's log-probs are under the filtered (or greedy) sampling rule, not the
        # tempered policy that the actor's loss compares them with.
        _fail(f"{path}.bypass_mode",
              f"needs plain sampling ({_ARR}.rollout.do_sample=true, top_k=-1, top_p=1.0), "
              f"got do_sample={rollout.do_sample}, top_k={rollout.top_k}, "
              f"top_p={rollout.top_p}")


def _check_packing(cfg: Config) -> None:
    """Token budgets need packing (a budget is filled by packed rows) and must hold the
    longest sequence, max_prompt_length + max_response_length."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    roles = [(f"{_ARR}.model", arr.model.use_remove_padding, (
        (f"{_ARR}.actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        (f"{_ARR}.ref", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
        (f"{_ARR}.rollout", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")))]
    if critic.enable:
        roles.append(("critic.model", critic.model.use_remove_padding, (
            ("critic", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
            ("critic", "use_dynamic_bsz", "forward_max_token_len_per_gpu"))))
    for model, packed, budgets in roles:
        for role, flag, key in budgets:
            if not _get(cfg, f"{role}.{flag}"):
                continue
            if not packed:
                _fail(f"{role}.{flag}", f"token-budget micro-batches are packed rows here: set "
                      f"{model}.use_remove_padding=true (or {flag}=false)")
            budget = _get(cfg, f"{role}.{key}")
            if budget < longest:
                _fail(f"{role}.{key}", f"{budget} tokens is smaller than one sequence "
                      f"(max_prompt_length + max_response_length = {longest})")


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(target_modules, exclude_modules=None, where: str = "") -> tuple[str, ...]:
    """verl's `target_modules` (`all-linear` or projection names) less `exclude_modules`, in
    the decoder's order; a ConfigError (one line, listing the valid names) for another name.
    `all-linear` is every projection of the layers (as PEFT's, the LM head left out)."""
    names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    valid = ", ".join(LORA_MODULES)
    chosen: set[str] = set()
    for name in names:
        if name not in ("all-linear", *LORA_MODULES):
            _fail(f"{where}target_modules", f"unknown module {name!r}; valid: all-linear, {valid}")
        chosen.update(LORA_MODULES if name == "all-linear" else (name,))
    for name in exclude_modules or ():
        if name not in LORA_MODULES:
            _fail(f"{where}exclude_modules", f"unknown module {name!r}; valid: {valid}")
        chosen.discard(name)
    if not chosen:
        _fail(f"{where}target_modules", "no module left to adapt after exclude_modules")
    return tuple(m for m in LORA_MODULES if m in chosen)


def _check_lora(cfg: Config) -> None:
    models = [(f"{_ARR}.model.", cfg.actor_rollout_ref.model)]
    if cfg.critic.enable:
        models.append(("critic.model.", cfg.critic.model))
    for where, m in models:
        if m.lora_rank < 0:
            _fail(f"{where}lora_rank", f"must be >= 0 (0: LoRA off), got {m.lora_rank}")
        if m.lora_rank > 0:
            if m.lora_alpha <= 0:
                _fail(f"{where}lora_alpha", f"must be > 0, got {m.lora_alpha}")
            lora_targets(m.target_modules, m.exclude_modules, where)


def validate(cfg: Config) -> None:
    """Raises ConfigError (one line, naming the key) for the first rule the config breaks."""
    for path, (test, text) in _RULES:
        value = _get(cfg, path)
        if value is not None and not test(value):
            _fail(path, f"{text}, got {value}")
    show = lambda v: str(v).lower() if isinstance(v, bool) else repr(v)
    for path, only, why in _ONLY:
        if _get(cfg, path) != only:
            _fail(path, f"only {show(only)} is supported, got {show(_get(cfg, path))}: {why}")
    arr, data, trainer = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    for opt in _OPTIMS:
        if not all(0 <= b < 1 for b in _get(cfg, opt).betas):
            _fail(f"{opt}.betas", f"each must be in [0, 1), got {list(_get(cfg, opt).betas)}")
    for path in _SAMPLING:
        sampling = _get(cfg, path)
        if sampling.do_sample and sampling.temperature <= 0:
            _fail(f"{path}.temperature", "must be > 0 when do_sample is true "
                  "(set do_sample=false for greedy decoding)")
    _check_rollout_correction(cfg)
    _check_packing(cfg)
    _check_lora(cfg)
    check_kl_kind(cfg.algorithm.kl_penalty, "algorithm.kl_penalty")
    check_kl_kind(arr.actor.kl_loss_type, f"{_ARR}.actor.kl_loss_type")
    _check_mini_batch(f"{_ARR}.actor", arr.actor.ppo_mini_batch_size, cfg)
    if cfg.critic.enable:
        _check_mini_batch("critic", cfg.critic.ppo_mini_batch_size, cfg)
    elif _needs_values(cfg):
        _fail("critic.enable", f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a "
              "critic")
    _check_sum_pi_squared(cfg)
    if not data.train_files:
        _fail("data.train_files", "must name at least one file")
    if data.val_files is None and (trainer.test_freq > 0 or trainer.val_before_train):
        raise ConfigError("data.val_files is required when trainer.test_freq > 0 or "
                          "trainer.val_before_train is true")
    buckets = arr.rollout.prefill_buckets
    if buckets is not None:
        path = f"{_ARR}.rollout.prefill_buckets"
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            _fail(path, f"must be increasing positive lengths, got {list(buckets)}")
        if buckets[-1] < data.max_prompt_length:
            _fail(path, f"the largest bucket {buckets[-1]} is shorter than "
                  f"data.max_prompt_length {data.max_prompt_length}")
    compact = arr.rollout.compact_slots_min_response_length
    if compact is not None and compact < 1:
        _fail(f"{_ARR}.rollout.compact_slots_min_response_length",
              f"must be >= 1 or null (never compact), got {compact}")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_from_path is required when trainer.resume_mode is "
                          "resume_path")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError("reward_model.model.path is required when reward_model.enable is true")
    if not cfg.reward.custom_reward_function.name:
        _fail("reward.custom_reward_function.name", "must not be empty")
    # An empty path is the working directory: a run would write (or read a model) there.
    for path in ("trainer.default_local_dir", f"{_ARR}.model.path"):
        if not str(_get(cfg, path)).strip():
            _fail(path, "must not be empty")
    _check_dapo(cfg)
    _check_async(cfg)
    if cfg.synthetic.task is not None:
        for key, files in (("train_files", data.train_files), ("val_files", data.val_files)):
            if files is not None and len(files) != 1:
                _fail(f"data.{key}", f"synthetic.task writes one file here, got {len(files)}")
    _check_mesh(cfg.mesh)


@dataclasses.dataclass(frozen=True)
class MiniBatchPlan:
    """How one role's PPO update splits a step's sequences (sizes count sequences)."""

    mini_batch_size: int  # sequences per optimizer step, all devices together
    num_mini_batches: int  # optimizer steps per PPO epoch
    micro_batch_size_per_device: int
    grad_accum_steps: int  # micro-batches accumulated into one optimizer step


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The batch sizes of one training step on a mesh with `data_parallel_size` batch shards."""

    data_parallel_size: int
    sequences: int  # data.train_batch_size x rollout.n
    sequences_per_device: int
    actor: MiniBatchPlan
    critic: MiniBatchPlan | None  # None when the critic is disabled


def _plan(role: str, prompts: int, micro: int | None, cfg: Config, dp: int) -> MiniBatchPlan:
    n = cfg.actor_rollout_ref.rollout.n
    mini = prompts * n
    what = f"a mini-batch of {mini} sequences ({prompts} prompts x rollout.n {n})"
    if micro is None:
        if mini % dp:
            _fail(f"{role}.ppo_mini_batch_size", f"{what} does not split over "
                  f"data-parallel size {dp} (mesh data x fsdp)")
        micro = mini // dp
    elif mini < micro * dp:
        _fail(f"{role}.ppo_micro_batch_size_per_device", f"{what} is smaller than micro-batch "
              f"{micro} x data-parallel size {dp} = {micro * dp}; some devices would get no "
              "sequences (verl computed NaN losses here)")
    elif mini % (micro * dp):
        _fail(f"{role}.ppo_micro_batch_size_per_device", f"{what} is not a multiple of "
              f"micro-batch {micro} x data-parallel size {dp} = {micro * dp}")
    sequences = cfg.data.train_batch_size * n
    return MiniBatchPlan(mini, sequences // mini, micro, mini // (micro * dp))


def validate_batch_arithmetic(cfg: Config, data_parallel_size: int) -> BatchPlan:
    """Checks the batch sizes against the mesh's data-parallel size (data x fsdp).

    Args:
      cfg: a loaded config (its load-time checks already passed).
      data_parallel_size: the number of batch shards of the train layout.

    Returns:
      The per-role split of a step's sequences into mini- and micro-batches.
    """
    dp = data_parallel_size
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"data-parallel size must be an int >= 1, got {dp!r}")
    n = cfg.actor_rollout_ref.rollout.n
    sequences = cfg.data.train_batch_size * n
    if sequences % dp:
        _fail("data.train_batch_size", f"{cfg.data.train_batch_size} prompts x rollout.n {n} = "
              f"{sequences} sequences do not split over data-parallel size {dp} (mesh data x fsdp)")
    actor = cfg.actor_rollout_ref.actor
    critic = cfg.critic
    return BatchPlan(
        data_parallel_size=dp,
        sequences=sequences,
        sequences_per_device=sequences // dp,
        actor=_plan(f"{_ARR}.actor", actor.ppo_mini_batch_size,
                    actor.ppo_micro_batch_size_per_device, cfg, dp),
        critic=_plan("critic", critic.ppo_mini_batch_size,
                     critic.ppo_micro_batch_size_per_device, cfg, dp) if critic.enable else None,
    )
