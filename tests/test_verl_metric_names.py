"""verl's metric names, exactly, in every tracker's own files, from a real (tiny) run that
stops early: the early stop still ends with a validation and a checkpoint."""

import pytest
from test_trackers import read_tfrecords
from tiny_run import jsonl_rows, tiny

from rlhf_jax.trackers import _mlflow_key
from rlhf_jax.trainer import train

# What verl's compute_data_metrics, compute_timing_metrics and compute_throughout_metrics,
# its workers' memory metrics, and its trainer's testing / save_checkpoint timers log for
# this run's stages (a critic whose update also gives the values and advantages: no
# separate `values` or `adv` stage; KL in the reward: a `ref` pass).
VERL = [
    *(f"critic/{k}/{s}" for k in ("score", "rewards", "advantages", "returns", "values")
      for s in ("mean", "max", "min")),
    "critic/vf_explained_var",
    *(f"{k}/{s}" for k in ("response_length", "response_length_non_aborted", "prompt_length")
      for s in ("mean", "max", "min", "clip_ratio")),
    "response/aborted_ratio",
    *(f"timing_s/{k}" for k in ("gen", "reward", "old_log_prob", "ref", "update_critic",
                                "update_actor", "update_weights", "step", "testing",
                                "save_checkpoint")),
    *(f"timing_per_token_ms/{k}" for k in ("gen", "ref", "update_critic", "update_actor")),
    "perf/total_num_tokens", "perf/time_per_step", "perf/throughput",
    "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
    "actor/lr", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr",
    "training/global_step", "training/epoch",
    "val-core/synthetic/addition/reward/mean@1",
]


def check_verl_names(run_dir, step: int) -> None:
    """Every name of `VERL` in `run_dir`'s metrics.jsonl, TensorBoard event file (read back
    with the protobuf, tags as written) and MLflow file store (verl's sanitisation) at
    `step`."""
    from mlflow.tracking import MlflowClient

    rows = {r["training/global_step"]: r for r in jsonl_rows(run_dir) if "event" not in r}
    missing = [k for k in VERL if k not in rows[step]]
    assert not missing, missing
    row = rows[step]
    tokens = row["perf/total_num_tokens"] - row["prompt_length/mean"] * len_of(row)
    assert row["timing_per_token_ms/gen"] == pytest.approx(row["timing_s/gen"] * 1e3 / tokens)

    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    tags = {v.tag for ev in read_tfrecords(events) if ev.step == step for v in ev.summary.value}
    missing = [k for k in VERL if k != "training/global_step" and k not in tags]
    assert not missing, missing  # `mean@1` as it is: no `_` for `@`

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf_jax").experiment_id])
    logged = set(run.data.metrics)
    assert "val-core/synthetic/addition/reward/mean_at_1" in logged  # verl's sanitisation
    missing = [k for k in VERL if k != "training/global_step" and _mlflow_key(k) not in logged]
    assert not missing, missing


def len_of(row) -> float:
    """The sequences of a step, from its token count and mean lengths."""
    return row["perf/total_num_tokens"] / (row["prompt_length/mean"]
                                            + row["response_length/mean"])


def test_mlflow_keys_are_sanitised_as_verl_does():
    assert _mlflow_key("val-core/a/reward/mean@1") == "val-core/a/reward/mean_at_1"
    assert _mlflow_key("a//b@4/c+d") == "a/b_at_4/c_d"
    assert _mlflow_key("timing_s/update_actor") == "timing_s/update_actor"


@pytest.mark.slow
def test_an_early_stop_ends_with_validation_and_checkpoint(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = tiny(tmp_path, mesh="single", **{
        "trainer.sft_warmup.enable": False, "trainer.total_training_steps": 8,
        "trainer.early_stop_score": -1.0, "trainer.test_freq": 4, "trainer.save_freq": 4,
        "trainer.logger": "[console, jsonl, tensorboard, mlflow]"})
    history = train(cfg)
    out = capsys.readouterr().out
    assert "early stop at step 5" in out and len(history) == 5
    last = history[-1]
    # the early stop at step 5 (not a multiple of 4) still validates and saves
    assert "val-core/synthetic/addition/reward/mean@1" in last and last["timing_s/testing"] > 0
    assert last["timing_s/save_checkpoint"] > 0 and (tmp_path / "run/checkpoints/5").is_dir()
    assert "timing_s/testing" not in history[2]  # step 3: neither validates nor saves
    check_verl_names(tmp_path / "run", 5)


def test_early_stop_is_decided_before_the_final_validation_and_checkpoint():
    from types import SimpleNamespace

    from rlhf_jax.hooks import StepInfo, trainer_hooks
    from rlhf_jax.progress import Progress
    from rlhf_jax.recovery import RunState

    calls, logged = [], []
    t = SimpleNamespace(rollback=SimpleNamespace(enable=False), test_freq=10, save_freq=10,
                        early_stop_score=0.5, profile_steps=None)
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(trainer=t), fault_hook=None, history=[], progress=Progress(),
        validate=lambda: calls.append("validate") or {"val-core/x/reward/mean@1": 1.0},
        recovery=SimpleNamespace(save=lambda s: calls.append(f"save {s.step}")),
        log=logged.append)
    hooks = trainer_hooks(trainer)
    assert hooks.names == ["fault", "scores", "validation", "checkpoint", "trackers"]
    state = RunState(actor=None, critic=None, ref=None, kl=None, step=0)
    for step in range(1, 6):
        state = state._replace(step=step)
        info = StepInfo(step, {"critic/score/mean": 0.6}, final=False)
        state = hooks.run(state, info)
    assert info.stop and calls == ["validate", "save 5"]  # step 5: the early stop
    assert state.recent_scores == (0.6,) * 5
    assert "val-core/x/reward/mean@1" in logged[-1] and "timing_s/save_checkpoint" in logged[-1]
