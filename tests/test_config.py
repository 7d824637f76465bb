"""The typed config (rlhf_jax.config) and the entry point scripts/train.py."""

import dataclasses
import re
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from rlhf_jax.config import (
    Config,
    ConfigError,
    DataConfig,
    FrozenDict,
    MeshConfig,
    config_from_dict,
    load_config,
    replace,
    to_dict,
    to_yaml,
    validate_batch_arithmetic,
)
from rlhf_jax.core_algos import adv_estimator_names
from rlhf_jax.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train.py"
TINY = ROOT / "configs" / "ppo_tiny_cpu.yaml"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MINIMAL = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=model"]


def minimal(*overrides: str) -> Config:
    return load_config(None, [*MINIMAL, *overrides])


def run_script(*args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, str(SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- the script, as a subprocess

@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.actor.clip_ration=0.1"],
     "unknown config key 'actor_rollout_ref.actor.clip_ration' "
     "(did you mean 'actor_rollout_ref.actor.clip_ratio'?)"),
    (["actor_rollout_ref.actor.ppo_epochs=two"],
     "actor_rollout_ref.actor.ppo_epochs: expected int, got str 'two'"),
    (["algorithm.kl_ctrl.type=adaptiv"],
     "algorithm.kl_ctrl.type: 'adaptiv' is not one of fixed, adaptive"),
    (["algorithm.adv_estimator=ppo"],  # the names registered in core_algos.registry
     "algorithm.adv_estimator: 'ppo' is not one of " + ", ".join(adv_estimator_names())),
    (["actor_rollout_ref.model.path=null"], "actor_rollout_ref.model.path is required"),
    (["--config", "configs/no_such.yaml"], "config file not found: configs/no_such.yaml"),
    (["foo"], "no '=' in override 'foo' (expected key.path=value)"),
    (["data.train_batch_size=96"],
     "actor_rollout_ref.actor.ppo_mini_batch_size: data.train_batch_size 96 x rollout.n 2 "
     "sequences do not split into mini-batches of 64 x 2 (both sizes count prompts)"),
])
def test_script_errors_are_one_line_with_exit_code_2(args, message):
    proc = run_script(*args, "--print-config")
    assert proc.returncode == 2
    assert proc.stderr == f"error: {message}\n"
    assert proc.stdout == ""


def test_script_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_files: [a.parquet\nmesh: single\n")
    proc = run_script("--config", str(bad), "--print-config")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {bad}:3:")
    assert "invalid YAML" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.fixture
def script_main():
    return runpy.run_path(str(SCRIPT))["main"]  # in-process: the trainer can be faked


def test_script_without_trainer_says_so(script_main, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rlhf_jax.trainer", None)  # import -> ModuleNotFoundError
    assert script_main([]) == 2
    assert capsys.readouterr().err == "error: the trainer is not built yet\n"


def test_script_turns_user_errors_of_the_trainer_into_one_line(script_main, monkeypatch, capsys):
    def train(cfg):
        raise DataError(f"{cfg.data.train_files[0]}: row 3 has no prompt")

    monkeypatch.setitem(sys.modules, "rlhf_jax.trainer", types.SimpleNamespace(train=train))
    assert script_main(["data.train_files=x.parquet"]) == 2
    assert capsys.readouterr().err == "error: x.parquet: row 3 has no prompt\n"


def test_script_default_config_prints_without_importing_jax():
    proc = run_script("--print-config", importtime=True)
    assert proc.returncode == 0
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "rlhf_jax.config" in modules
    assert not {m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "numpy", "flax")}
    assert config_from_dict(yaml.safe_load(proc.stdout)) == load_config(TINY)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_script_prints_every_config(path):
    proc = run_script("--config", str(path), "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert config_from_dict(yaml.safe_load(proc.stdout)) == load_config(path)


def test_flags_may_follow_overrides():
    proc = run_script("trainer.experiment_name=late", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["trainer"]["experiment_name"] == "late"


# ---------------------------------------------------------------- defaults and derived values

def test_defaults_are_verls():
    cfg = minimal()
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_files == ("train.parquet",)
    assert (cfg.data.max_prompt_length, cfg.data.train_batch_size) == (512, 1024)
    assert arr.actor.ppo_mini_batch_size == 256 and arr.actor.clip_ratio_c == 3.0
    assert arr.actor.loss_agg_mode == "token-mean" and arr.actor.kl_loss_type == "low_var_kl"
    assert arr.actor.policy_loss.loss_mode == "vanilla" and cfg.algorithm.adv_estimator == "gae"
    assert arr.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert arr.actor.optim.betas == (0.9, 0.999)
    assert arr.rollout.val_kwargs.do_sample is False and arr.rollout.top_k == -1
    assert cfg.critic.cliprange_value == 0.5
    assert cfg.algorithm.kl_ctrl == dataclasses.replace(cfg.algorithm.kl_ctrl, type="fixed",
                                                        kl_coef=0.001, horizon=10000, target_kl=0.1)
    assert cfg.trainer.logger == ("console",) and cfg.trainer.resume_mode == "auto"
    assert cfg.reward.custom_reward_function.name == "compute_score"
    assert cfg.mesh == MeshConfig(preset="cpu-8")


def test_derived_defaults_are_filled_in():
    cfg = minimal("actor_rollout_ref.actor.ppo_epochs=3", "trainer.experiment_name=e1")
    assert cfg.actor_rollout_ref.model.tokenizer_path == "model"
    assert cfg.critic.model.tokenizer_path == "model"
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.2
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.2
    assert cfg.critic.enable is True
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs) == (256, 3)
    assert cfg.trainer.default_local_dir == "checkpoints/rlhf_jax/e1"
    assert minimal("algorithm.adv_estimator=grpo").critic.enable is False
    assert minimal("algorithm.adv_estimator=remax").critic.enable is False
    assert minimal("trainer.default_local_dir=out/${project_name}").trainer.default_local_dir == (
        "out/rlhf_jax")


@pytest.mark.parametrize("override", ["actor_rollout_ref.rollout.top_k=5",
                                      "actor_rollout_ref.rollout.top_p=0.9",
                                      "actor_rollout_ref.rollout.do_sample=false"])
def test_bypass_mode_needs_plain_sampling(override):
    assert minimal("algorithm.rollout_correction.bypass_mode=true").algorithm.rollout_correction
    with pytest.raises(ConfigError, match=r"^algorithm.rollout_correction.bypass_mode: needs "
                                          r"plain sampling \(actor_rollout_ref.rollout"):
        minimal("algorithm.rollout_correction.bypass_mode=true", override)
    with pytest.raises(ConfigError, match="removed from verl's rollout correction"):
        minimal("algorithm.rollout_correction.rollout_token_veto_threshold=1e-4")


def test_scan_layers_reaches_the_models(tmp_path):
    import json

    from rlhf_jax import roles

    hf = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    path = f"actor_rollout_ref.model.path={tmp_path}"
    cfg = load_config(None, ["data.train_files=t.parquet", path])
    assert roles.actor_model(cfg).scan_layers is None
    assert not roles.actor_model(cfg).scans_layers  # 2 layers: unrolled
    cfg = load_config(None, ["data.train_files=t.parquet", path,
                             "actor_rollout_ref.model.scan_layers=true",
                             "critic.model.scan_layers=false"])
    assert roles.actor_model(cfg).scans_layers
    assert roles.critic_model(cfg)[0].scan_layers is False


# ---------------------------------------------------------------- overrides

def test_overrides_nested_list_null_and_strings():
    cfg = load_config(TINY, [
        "actor_rollout_ref.actor.clip_ratio=0.3",
        "trainer.logger=[console, wandb]",
        "actor_rollout_ref.rollout.prefill_buckets=[4,8]",
        "data.val_files=null",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "data.train_files=[a.parquet, b.parquet]",
        "synthetic.task=null",
        "trainer.experiment_name=2024",
        "+trainer.project_name=p",
        "actor_rollout_ref.model.override_config.rope_theta=1e4",
    ])
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.3
    assert cfg.trainer.logger == ("console", "wandb")
    assert cfg.actor_rollout_ref.rollout.prefill_buckets == (4, 8)
    assert cfg.data.val_files is None
    assert cfg.data.train_files == ("a.parquet", "b.parquet")
    assert cfg.trainer.experiment_name == "2024" and cfg.trainer.project_name == "p"
    assert cfg.actor_rollout_ref.model.override_config == {"rope_theta": 10000.0}
    assert minimal("trainer.logger=jsonl").trainer.logger == ("jsonl",)


def test_float_coercion():
    cfg = minimal("actor_rollout_ref.actor.optim.lr=1e-6", "algorithm.gamma=1",
                  "critic.optim.eps=1E-5")
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert type(cfg.algorithm.gamma) is float and cfg.algorithm.gamma == 1.0
    assert cfg.critic.optim.eps == 1e-5
    tiny = load_config(TINY)  # `lr: 5e-4` in the file is a string to PyYAML
    assert type(tiny.actor_rollout_ref.actor.optim.lr) is float
    assert tiny.actor_rollout_ref.actor.optim.lr == 5e-4


def test_mesh_string_dict_and_sizes(tmp_path):
    assert minimal("mesh=single").mesh == MeshConfig(preset="single")
    assert minimal("mesh={preset: gpu-8, fsdp: 4}").mesh == MeshConfig(preset="gpu-8", fsdp=4)
    tiny = load_config(TINY, ["mesh.fsdp=-1", "mesh.dcn_data=2"])  # `mesh: cpu-8` in the file
    assert tiny.mesh == MeshConfig(preset="cpu-8", fsdp=-1, dcn_data=2)
    assert load_config(TINY, ["mesh.fsdp=4", "mesh=single"]).mesh == MeshConfig(preset="single")
    custom = tmp_path / "mine.yaml"
    custom.write_text("sizes: {data: 1, fsdp: 1, tensor: 1}\n")
    assert minimal(f"mesh={custom}").mesh.preset == str(custom)


# ---------------------------------------------------------------- load-time errors

@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
     "did you mean 'actor_rollout_ref.actor.ppo_micro_batch_size_per_device'?"),
    ("custom_reward_function.path=x", "did you mean 'reward.custom_reward_function'?"),
    ("actor_rollout_ref.actor.gamma=1", "did you mean 'algorithm.gamma'?"),
    ("trainer.n_gpus_per_node=8", "a verl key; devices come from the mesh"),
    ("data.seed.x=1", "data.seed is a value, not a section"),
    ("actor_rollout_ref.actor.ppo_epochs=true", "ppo_epochs: expected int, got bool True"),
    ("actor_rollout_ref.actor.optim.lr=fast", "optim.lr: expected float, got str 'fast'"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "betas: expected a list of 2 values, got 1"),
    ("trainer.logger=[console, slack]", "trainer.logger[1]: 'slack' is not one of console"),
    ("data.truncation=3", "data.truncation: expected one of error, left, right, got int 3"),
    ("actor_rollout_ref.actor.clip_ratio_c=1.0", "clip_ratio_c: must be > 1"),
    ("algorithm.lam=1.5", "algorithm.lam: must be in [0, 1], got 1.5"),
    ("algorithm.gamma=-0.1", "algorithm.gamma: must be in [0, 1]"),
    ("trainer.resume_mode=resume_path", "trainer.resume_from_path is required when"),
    ("algorithm.kl_penalty=full+", "algorithm.kl_penalty: 'full+' is not allowed"),
    ("algorithm.kl_penalty=k4", "'k4' is not one of kl, k1, abs, mse, k2, low_var_kl, k3"),
    ("actor_rollout_ref.actor.kl_loss_type=mse2", "actor.kl_loss_type: 'mse2' is not one of"),
    ("actor_rollout_ref.rollout.temperature=0", "rollout.temperature: must be > 0 when do_sample"),
    ("actor_rollout_ref.rollout.top_p=0", "rollout.top_p: must be in (0, 1]"),
    ("critic.enable=false", "critic.enable: algorithm.adv_estimator=gae needs a critic"),
    ("algorithm.adv_estimator=3", "algorithm.adv_estimator: expected one of "
     + ", ".join(adv_estimator_names()) + ", got int 3"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspox",
     "actor_rollout_ref.actor.policy_loss.loss_mode: 'gspox' is not one of vanilla, "),
    ("actor_rollout_ref.actor.policy_loss.mode=x",
     "did you mean 'actor_rollout_ref.actor.policy_loss.loss_mode'?"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=2048", "2048 prompts is more than"),
    ("data.train_batch_size=1000", "data.train_batch_size 1000 x rollout.n 1 sequences do not"),
    ("critic.ppo_mini_batch_size=300", "critic.ppo_mini_batch_size: data.train_batch_size 1024"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_device=0", "must be >= 1, got 0"),
    ("critic.ppo_micro_batch_size_per_device=-2", "critic.ppo_micro_batch_size_per_device"),
    ("trainer.test_freq=5", "data.val_files is required when trainer.test_freq > 0"),
    ("trainer.save_freq=0", "trainer.save_freq: must be -1 (never) or >= 1, got 0"),
    ("actor_rollout_ref.rollout.prefill_buckets=[256]", "largest bucket 256 is shorter than"),
    ("actor_rollout_ref.rollout.compact_slots_min_response_length=0",
     "actor_rollout_ref.rollout.compact_slots_min_response_length: must be >= 1 or null"),
    ("trainer.default_local_dir=ck/${user}", "unknown interpolation '${user}'"),
    ("mesh=nope", "mesh.preset: unknown mesh preset 'nope' (known: "),
    ("mesh.fsdp=0", "mesh.fsdp: must be >= 1 or -1"),
    ("mesh={fsdp: -1, tensor: -1}", "mesh: at most one of data, fsdp, tensor may be -1"),
    ("reward_model.enable=true", "reward_model.model.path is required"),
    ("data.max_prompt_length=[1", "cannot parse '[1' as YAML"),
    ("data..seed=1", "empty key segment"),
])
def test_load_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        minimal(override)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_yaml_file_errors(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("data:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:3: duplicate key 'data.seed'"):
        load_config(dup)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(top)
    with pytest.raises(ConfigError, match=r"^data: expected a mapping, got str 'x'$"):
        config_from_dict({"data": "x"})
    with pytest.raises(ConfigError, match=r"^data.train_files is required$"):
        load_config(None, ["actor_rollout_ref.model.path=m"])


# ---------------------------------------------------------------- immutability and round trips

def test_config_is_immutable_and_hashable():
    cfg = minimal("actor_rollout_ref.model.override_config={rope_scaling: {factor: 2.0}}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor_rollout_ref.actor.clip_ratio = 0.5
    overrides = cfg.actor_rollout_ref.model.override_config
    assert isinstance(overrides, FrozenDict) and overrides["rope_scaling"]["factor"] == 2.0
    with pytest.raises(TypeError):
        overrides["x"] = 1
    assert hash(cfg) == hash(minimal(
        "actor_rollout_ref.model.override_config={rope_scaling: {factor: 2.0}}"))


def test_python_construction_is_normalised_and_validated():
    data = DataConfig(train_files="a.parquet", max_prompt_length=8)
    assert data.train_files == ("a.parquet",)
    with pytest.raises(ConfigError, match="DataConfig.seed: expected int, got str"):
        DataConfig(train_files="a.parquet", seed="1")
    cfg = Config(data=data, actor_rollout_ref={"model": {"path": "m"}})
    assert cfg == minimal("data.train_files=a.parquet", "data.max_prompt_length=8",
                          "actor_rollout_ref.model.path=m")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_round_trip(path, tmp_path):
    cfg = load_config(path)
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg
    assert config_from_dict(to_dict(cfg)) == cfg


def test_replace_returns_a_validated_copy():
    cfg = load_config(TINY)
    lr = cfg.actor_rollout_ref.actor.optim.lr
    halved = replace(cfg, "actor_rollout_ref.actor.optim.lr", lr * 0.5)
    assert halved.actor_rollout_ref.actor.optim.lr == lr * 0.5
    assert cfg.actor_rollout_ref.actor.optim.lr == lr
    assert halved.critic == cfg.critic
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.actor.optim.lr'"):
        replace(cfg, "actor_rollout_ref.actor.optim.lrr", 1.0)
    with pytest.raises(ConfigError, match="algorithm.lam: must be in"):
        replace(cfg, "algorithm.lam", 2.0)


def test_shipped_configs():
    tiny = load_config(TINY)
    assert tiny.synthetic.task == "addition" and tiny.mesh.preset == "cpu-8"
    assert tiny.critic.enable and tiny.algorithm.kl_ctrl.type == "adaptive"
    grpo = load_config(ROOT / "configs" / "grpo_tiny_cpu.yaml")
    assert not grpo.critic.enable and grpo.actor_rollout_ref.actor.use_kl_loss
    seed = load_config(ROOT / "configs" / "ppo_gsm8k_qwen2_5_7b.yaml")
    actor = seed.actor_rollout_ref.actor
    assert seed.data.train_batch_size == 1024
    assert (actor.ppo_mini_batch_size, actor.ppo_epochs, actor.optim.lr) == (256, 4, 1e-6)
    assert (seed.algorithm.kl_ctrl.target_kl, seed.trainer.save_freq) == (0.02, 1000)
    assert seed.actor_rollout_ref.model.compute_dtype == "bfloat16"


# ---------------------------------------------------------------- batch arithmetic on a mesh

def test_batch_plan_of_the_tiny_config():
    plan = validate_batch_arithmetic(load_config(TINY), data_parallel_size=4)
    assert (plan.sequences, plan.sequences_per_device) == (256, 64)
    assert plan.actor.mini_batch_size == 128 and plan.actor.num_mini_batches == 2
    assert (plan.actor.micro_batch_size_per_device, plan.actor.grad_accum_steps) == (32, 1)
    assert plan.critic == plan.actor


def test_batch_plan_with_micro_batches_and_no_critic():
    cfg = minimal("data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                  "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=2")
    plan = validate_batch_arithmetic(cfg, 8)
    assert plan.critic is None
    assert (plan.actor.mini_batch_size, plan.actor.num_mini_batches) == (64, 4)
    assert plan.actor.grad_accum_steps == 4  # 64 sequences / (2 per device x 8 devices)


@pytest.mark.parametrize("overrides, dp, message", [
    # the NaN case: 4 sequences per mini-batch, but 2 per device x 4 devices wanted
    (["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=2"], 4,
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_device: a mini-batch of 4 sequences "
     "(4 prompts x rollout.n 1) is smaller than micro-batch 2 x data-parallel size 4 = 8"),
    (["data.train_batch_size=24", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=2"], 4,
     "is not a multiple of micro-batch 2 x data-parallel size 4 = 8"),
    (["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"], 4,
     "data.train_batch_size: 6 prompts x rollout.n 1 = 6 sequences do not split over "
     "data-parallel size 4"),
    (["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=6"], 4,
     "actor_rollout_ref.actor.ppo_mini_batch_size: a mini-batch of 6 sequences"),
    (["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
      "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_device=2"], 4,
     "critic.ppo_micro_batch_size_per_device: a mini-batch of 4 sequences"),
])
def test_batch_arithmetic_errors(overrides, dp, message):
    with pytest.raises(ConfigError) as info:
        validate_batch_arithmetic(minimal(*overrides), dp)
    assert message in str(info.value)


def test_batch_arithmetic_rejects_a_bad_data_parallel_size():
    with pytest.raises(ConfigError, match="data-parallel size must be an int >= 1"):
        validate_batch_arithmetic(load_config(TINY), 0)


@pytest.mark.parametrize("override, needle", [
    ("actor_rollout_ref.rollout.calculate_log_probs=false", "always returns"),
    ("data.return_raw_chat=true", "raw chat"),
    ("data.reward_fn_key=source", "data_source column"),
])
def test_verl_keys_we_do_not_implement_are_refused_not_ignored(override, needle):
    from rlhf_jax.config import load_config

    path = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: only .* is supported.*{needle}"):
        load_config(ROOT / "configs/ppo_tiny_cpu.yaml", [override])
