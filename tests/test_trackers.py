"""Trackers: records written and read back with each backend's own reader."""

import io
import json
import struct
import sys

import numpy as np
import pytest

from rlhf_jax.errors import ConfigError
from rlhf_jax.trackers import ConsoleTracker, JsonlTracker, make_trackers

CONFIG = {"trainer": {"project_name": "p", "logger": ["jsonl"]}, "actor": {"lr": 1e-6}}
STEP1 = {"critic/score/mean": np.float32(0.25), "actor/ppo_kl": 0.001, "actor/pg_loss": -0.5,
         "critic/vf_loss": 0.3, "perf/throughput": 1234.5, "val-core/gsm8k/acc/mean@1": 0.5}
ROLLBACK = {"event": "rollback", "reason": "actor/ppo_kl > 0.1", "restored_step": 1}


def kw(**extra):
    return dict(total_steps=10, config=CONFIG, project="proj", experiment="exp", **extra)


def test_jsonl_lines_are_flushed_each_step_and_carry_events(tmp_path):
    (tracker,) = make_trackers(["jsonl"], tmp_path, **kw())
    tracker.log(STEP1, 1)
    tracker.log({"critic/score/mean": 0.5}, 2)
    tracker.log(ROLLBACK, 2)  # an event dict from the trainer
    tracker.log_event("resume", {"from_step": 1}, 3)
    # Read before close: a killed run keeps what was logged.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    tracker.close()
    assert rows[0] == {"training/global_step": 1, **{k: float(v) for k, v in STEP1.items()}}
    assert rows[1] == {"training/global_step": 2, "critic/score/mean": 0.5}
    assert rows[2] == {"training/global_step": 2, "event": "rollback",
                       "reason": "actor/ppo_kl > 0.1", "restored_step": 1}
    assert rows[3] == {"training/global_step": 3, "event": "resume", "from_step": 1}
    JsonlTracker(tmp_path).close()  # appends, never truncates
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_console_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    tracker = ConsoleTracker(10, out)
    tracker.log(STEP1, 1)
    tracker.log(ROLLBACK, 1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines[0].startswith("step 1/10 | eta ")
    for part in ("score 0.25", "ppo_kl 0.001", "pg_loss -0.5", "vf_loss 0.3", "tok/s 1234",
                 "val-core/gsm8k/acc/mean@1 0.5"):
        assert part in lines[0]
    assert lines[1] == "event rollback at step 1: reason=actor/ppo_kl > 0.1 restored_step=1"


def test_missing_package_fails_at_start_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    with pytest.raises(ConfigError) as err:
        make_trackers(["console", "tensorboard"], tmp_path, **kw())
    assert str(err.value) == ("trainer.logger 'tensorboard' needs tensorboardX: "
                              "pip install 'rlhf_jax[trackers]'")
    with pytest.raises(ConfigError, match="unknown tracker 'neptune'"):
        make_trackers(["neptune"], tmp_path, **kw())


def read_tfrecords(path):
    """TensorBoard event files are TFRecords: u64 length, u32 crc, data, u32 crc."""
    from tensorboardX.proto.event_pb2 import Event

    data, pos, events = path.read_bytes(), 0, []
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
        pos += 12 + n + 4
    return events


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboardX")
    (tracker,) = make_trackers(["tensorboard"], tmp_path, **kw())
    tracker.log(STEP1, 1)
    tracker.log({"critic/score/mean": 0.75, "note": "text is skipped"}, 2)
    tracker.log(ROLLBACK, 2)
    tracker.close()
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = {}
    for ev in read_tfrecords(path):
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                scalars.setdefault(v.tag, []).append((ev.step, round(v.simple_value, 6)))
    assert scalars["critic/score/mean"] == [(1, 0.25), (2, 0.75)]
    assert scalars["perf/throughput"] == [(1, 1234.5)]
    assert scalars["val-core/gsm8k/acc/mean@1"] == [(1, 0.5)]  # verl's name, as it is
    assert scalars["event/rollback"] == [(2, 1.0)]


def test_mlflow_local_file_store_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tracker,) = make_trackers(["mlflow"], tmp_path, **kw())
    tracker.log(STEP1, 1)
    tracker.log({"critic/score/mean": 0.75}, 2)
    tracker.log(ROLLBACK, 2)
    tracker.close()
    assert (tmp_path / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    at_1 = client.get_metric_history(run.info.run_id, "val-core/gsm8k/acc/mean_at_1")
    assert at_1[0].value == 0.5  # verl's sanitisation: @ -> _at_
    assert run.data.params["actor.lr"] == "1e-06"
    assert json.loads(run.data.tags["event/rollback/2"])["restored_step"] == 1


def test_wandb_runs_offline_without_network(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tracker,) = make_trackers(["wandb"], tmp_path, **kw())
    try:
        assert tracker.run.settings.mode == "offline"
        tracker.log(STEP1, 1)
        tracker.log(ROLLBACK, 1)
        tracker.close()
    finally:
        wandb.teardown()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("run-*.wandb"))
