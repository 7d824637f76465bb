"""End to end: a few PPO / GRPO steps on the synthetic task, (2,2,2) against (1,1,1)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_verl_metric_names import check_verl_names
from tiny_run import ROOT, algorithmic, compare, jsonl_rows, tiny

from rlhf_jax.trainer import train


def test_ppo_on_2x2x2_equals_1x1x1(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sharded = algorithmic(train(tiny(tmp_path / "a", mesh="cpu-8")))
    single = algorithmic(train(tiny(tmp_path / "b", mesh="single", **{
        "trainer.logger": "[jsonl, tensorboard, mlflow]"})))
    check_verl_names(tmp_path / "b/run", 2)  # verl's names in every tracker's files
    compare(sharded, single, atol=1e-4)
    last = sharded[-1]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/score/mean",
                "critic/advantages/mean", "critic/returns/mean", "critic/values/mean",
                "response_length/mean", "actor/reward_kl_penalty_coeff",
                "training/rollout_probs_diff_max", "val-core/synthetic/addition/reward/mean@1"):
        assert np.isfinite(last[key]), key
    rows = [json.loads(line) for line in (tmp_path / "a/run/metrics.jsonl").read_text().split("\n")
            if line]
    assert [r["training/global_step"] for r in rows] == [1, 2]
    for key in ("timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
                "perf/mfu/actor", "perf/throughput"):
        assert rows[-1][key] > 0, key


@pytest.mark.slow  # four tiny runs (~1 min); tests/test_checkpoint.py restores across meshes
def test_a_2x2x2_checkpoint_goes_on_alike_on_1x8x1_and_1x1x1(tmp_path):
    """The checkpoint saved on (2,2,2) at the end goes on, one step more, on (1,8,1) and
    (1,1,1)."""
    train(tiny(tmp_path / "a", mesh="cpu-8"))
    more = {"trainer.total_training_steps": 3, "trainer.test_freq": -1}
    on_181 = train(tiny(tmp_path / "a", mesh="{preset: cpu-8, data: 1, fsdp: 8, tensor: 1}",
                        **more))
    on_111 = train(tiny(tmp_path / "c", mesh="single", **more, **{
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(tmp_path / "a/run/checkpoints/2")}))
    assert len(on_181) == len(on_111) == 1
    compare(algorithmic(on_181), algorithmic(on_111), atol=1e-4)
    resumed = [r for r in jsonl_rows(tmp_path / "a/run") if r.get("event") == "training/resumed"]
    assert [r["from_step"] for r in resumed] == [2]


def test_bypass_mode_takes_the_engines_log_probs(tmp_path):
    """verl's bypass mode: no old_log_prob pass; the engine's log-probs under the tempered
    policy are PPO's old ones. One mini-batch, one epoch: the update starts on-policy, so its
    ratio is 1 (untempered log-probs would be off by far more at temperature 0.7)."""
    last = train(tiny(tmp_path, **{
        "algorithm.rollout_correction.bypass_mode": True,
        "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "trainer.total_training_steps": 1, "trainer.test_freq": -1,
        "trainer.sft_warmup.enable": False, "mesh": "single",
    }))[-1]
    assert last["training/old_log_prob_recomputed"] == 0.0
    assert "timing_s/old_log_prob" not in last and "training/rollout_probs_diff_max" not in last
    assert abs(last["actor/ppo_kl"]) < 1e-5 and last["actor/pg_clipfrac"] == 0.0
    assert np.isfinite(last["actor/pg_loss"]) and last["timing_s/update_actor"] > 0


def test_critic_values_from_its_update_match_a_values_pass(tmp_path):
    """One critic update a step: the values (and GAE) from that update's forward pass give
    the metrics of verl's separate values pass, which `critic.values_in_update=false` runs."""
    kw = {"actor_rollout_ref.actor.ppo_mini_batch_size": 16,
          "actor_rollout_ref.actor.ppo_epochs": 1, "trainer.total_training_steps": 2,
          "trainer.test_freq": -1, "trainer.sft_warmup.enable": False, "mesh": "single"}
    fused = train(tiny(tmp_path / "a", **kw))
    separate = train(tiny(tmp_path / "b", **kw, **{"critic.values_in_update": False}))
    assert "timing_s/values" not in fused[-1] and separate[-1]["timing_s/values"] > 0
    compare(algorithmic(fused), algorithmic(separate), atol=1e-5)
    assert abs(fused[-1]["critic/values/mean"]) > 1e-3  # step 2: a trained critic, values not 0


def test_grpo_without_critic(tmp_path):
    history = train(tiny(tmp_path, "grpo_tiny_cpu.yaml"))
    last = history[-1]
    assert "critic/vf_loss" not in last and "actor/kl_loss" in last
    assert np.isfinite(last["actor/pg_loss"])


def _run(args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _prepared(tmp: Path) -> list[str]:
    from rlhf_jax.roles import ensure_model_weights
    from rlhf_jax.tasks.addition import MODEL, prepare_files

    prepare_files(str(tmp / "train.parquet"), str(tmp / "val.parquet"), str(tmp / "model"),
                  64, 16, 0)
    (tmp / "model/config.json").write_text(json.dumps(MODEL))
    ensure_model_weights(tmp / "model", MODEL, 0)
    return [f"data.train_files={tmp / 'train.parquet'}", f"data.val_files={tmp / 'val.parquet'}",
            f"actor_rollout_ref.model.path={tmp / 'model'}",
            f"trainer.default_local_dir={tmp / 'run'}", "trainer.sft_warmup.enable=false",
            "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
            "trainer.val_before_train=false", "synthetic.task=null"]


def _write_rows(path: Path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    base = _prepared(tmp_path)
    row = {"data_source": "synthetic/addition",
           "prompt": [{"role": "user", "content": "1 2 + 3 4 ="}], "ability": "arithmetic",
           "reward_model": {"style": "rule", "ground_truth": "4 6"}, "extra_info": {"i": 0}}
    _write_rows(tmp_path / "noprompt.parquet", [{k: v for k, v in row.items() if k != "prompt"}])
    long = dict(row, prompt=[{"role": "user", "content": "1 2 + 3 4 = 5 6 7 8 9 1 2 3"}])
    _write_rows(tmp_path / "long.parquet", [row] * 20 + [long] + [row] * 11)
    _write_rows(tmp_path / "unknown.parquet", [dict(row, data_source="nobody/knows")] * 32)
    cases = {
        "data file not found": [f"data.train_files={tmp_path / 'missing.parquet'}"],
        "has no column 'prompt'": [f"data.train_files={tmp_path / 'noprompt.parquet'}"],
        "row 20": [f"data.train_files={tmp_path / 'long.parquet'}"],
        "no reward function for data_source 'nobody/knows'": [
            f"data.train_files={tmp_path / 'unknown.parquet'}"],
        "has no config.json": [f"actor_rollout_ref.model.path={tmp_path / 'nowhere'}",
                               f"actor_rollout_ref.model.tokenizer_path={tmp_path / 'model'}"],
        "micro": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_device=4",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
        "do not split into mini-batches of 5": ["actor_rollout_ref.actor.ppo_mini_batch_size=5"],
        "'full' needs both policies' logits": ["algorithm.kl_penalty=full"],
    }
    config = ["--config", str(ROOT / "configs/ppo_tiny_cpu.yaml")]
    # One case as a real process (exit status, nothing but the line on stderr) ...
    out = _run([*config, *base, *cases.pop("data file not found")], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: data file not found") \
        and out.stderr.count("\n") == 1, out.stderr[-2000:]
    # ... the others through the script's main() in this process (no jax start-up each).
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts/train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for needle, extra in cases.items():
        capsys.readouterr()
        code = script.main([*config, *base, *extra])
        err = capsys.readouterr().err
        assert code == 2, (needle, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (needle, err[-2000:])
        assert needle in lines[0], (needle, lines[0])
