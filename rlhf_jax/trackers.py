"""Experiment trackers: `trainer.logger: [console, jsonl, tensorboard, wandb, mlflow]`.

Every tracker has `log(metrics, step)`, `event(name, info, step)` and `close()`. `log` also
takes an event dict (one with an `"event"` key, e.g. `{"event": "rollback", "reason": ...}`)
and hands it to `event`. Optional backends are imported when `make_trackers` runs, so a
missing package fails before anything compiles.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlhf_jax.errors import ConfigError
from rlhf_jax.paths import METRICS
from rlhf_jax.progress import Progress, due_count, duration, eta_seconds, fit_fields

STEP_KEY = "training/global_step"
# Which package each optional tracker imports.
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


def _plain(v: Any) -> Any:
    """numpy / jax scalars -> Python numbers; everything else unchanged."""
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        return v.item()
    return v


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        v = _plain(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


class Tracker:
    """Base: routes event dicts passed to `log` to `event`."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if "event" in metrics:
            info = {k: v for k, v in metrics.items() if k != "event"}
            self.event(str(metrics["event"]), info, step)
        else:
            self.log_metrics(metrics, step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def event(self, name: str, info: Mapping[str, Any], step: int) -> None:
        """A discrete event (rollback, resume, ...) at `step`; default: log `event/<name>`=1."""
        self.log_metrics({f"event/{name}": 1.0}, step)

    log_event = event

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------- console


class ConsoleTracker(Tracker):
    """A line per step and an ETA; on a terminal a bar below the lines, and each line fitted
    to the terminal's width by leaving out the least important figures (never cut); in a
    log file plain, complete lines."""

    COLUMNS = (  # (key, label, priority: the lowest is kept first on a narrow terminal)
        ("critic/score/mean", "score", 2),
        ("actor/reward_kl_penalty", "kl_penalty", 7),
        ("actor/ppo_kl", "ppo_kl", 6),
        ("critic/vf_loss", "vf_loss", 5),
        ("actor/pg_loss", "pg_loss", 3),
        ("perf/throughput", "tok/s", 4),
    )
    PHASES = ("timing_s/testing", "timing_s/save_checkpoint")

    def __init__(self, total_steps: int, stream=None, *, tty: bool | None = None,
                 test_freq: int = 0, save_freq: int = 0):
        self.total = max(int(total_steps), 1)
        self.progress = Progress(stream, tty=tty)
        self.tty = self.progress.tty
        self.every = {"timing_s/testing": test_freq, "timing_s/save_checkpoint": save_freq}
        self.phase_seconds: dict[str, list[float]] = {k: [] for k in self.PHASES}
        self.step_seconds: list[float] = []  # steady state: from one step's end to the next's
        self.last: tuple[int, float] | None = None  # (step, when it was logged)
        self._bar = None

    def eta(self, step: int) -> float | None:
        periodic = [(self.phase_seconds[k], due_count(step, self.total, self.every[k]))
                    for k in self.PHASES]
        return eta_seconds(self.step_seconds, self.total - step, periodic)

    def _observe(self, metrics: Mapping[str, Any], step: int) -> None:
        now = time.perf_counter()
        phases = 0.0
        for k in self.PHASES:
            if k in metrics:
                self.phase_seconds[k].append(float(metrics[k]))
                phases += float(metrics[k])
        if self.last is not None and step == self.last[0] + 1:
            self.step_seconds.append(now - self.last[1] - phases)
        self.last = (step, now)  # a rollback or a resume starts a new measurement

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if all(k.startswith("val-") or k in self.PHASES for k in metrics):  # before training
            for k in self.PHASES:
                if k in metrics:
                    self.phase_seconds[k].append(float(metrics[k]))
            fields = [(0, f"validation at step {step}")] + [
                (1, f"{k} {_fmt(metrics[k])}") for k in sorted(metrics)
                if k.startswith("val-core/")]
            self._write(fields)
            return
        self._observe(metrics, step)
        eta = self.eta(step)
        eta_text = "eta -" if eta is None else f"eta {duration(eta)}"  # 0.6s, 4m05s
        fields = [(0, f"step {step}/{self.total}"), (1, eta_text)]
        for key, label, priority in self.COLUMNS:
            if key in metrics:
                fields.append((priority, f"{label} {_fmt(metrics[key])}"))
        for key in sorted(k for k in metrics if k.startswith("val-core/")):
            fields.append((8, f"{key} {_fmt(metrics[key])}"))
        self._write(fields)
        if self.tty:
            if self._bar is None:
                self._bar = self.progress.bar("training", self.total, initial=step)
            self._bar.set(step, eta_text)

    def _write(self, fields) -> None:
        if self.tty:
            self.progress.note(fit_fields(fields, self.progress.width))
        else:
            self.progress.note(" | ".join(text for _, text in fields))

    def event(self, name: str, info: Mapping[str, Any], step: int) -> None:
        details = " ".join(f"{k}={_plain(v)}" for k, v in info.items())
        self.progress.note(f"event {name} at step {step}: {details}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _fmt(v: Any) -> str:
    v = _plain(v)
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)



# ----------------------------------------------------------------------------------- jsonl


class JsonlTracker(Tracker):
    """One JSON object per line in `<run_dir>/metrics.jsonl`, flushed every step."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def _write(self, row: dict) -> None:
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()  # a killed run keeps every line written so far

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self._write({STEP_KEY: step, **{k: _plain(v) for k, v in metrics.items()}})

    def event(self, name: str, info: Mapping[str, Any], step: int) -> None:
        self._write({STEP_KEY: step, "event": name, **{k: _plain(v) for k, v in info.items()}})

    log_event = event

    def close(self) -> None:
        self._file.close()


def _drop_torn_line(path: Path) -> None:
    """A run killed while writing a line left it without its newline: cut it off, so the
    resumed run's rows start on a line of their own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


# ----------------------------------------------------------------------------- tensorboard


class TensorBoardTracker(Tracker):
    """Scalars under `<run_dir>/tensorboard` (tensorboardX); events and config as text."""

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any]):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(Path(run_dir) / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str)
                             + "\n```", 0)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        # The Summary proto itself, not `add_scalar`: tensorboardX's `add_scalar` rewrites
        # tags outside `[-/\w.]` (`mean@1` -> `mean_1`); TensorBoard takes any tag, and
        # verl's writer (torch's) keeps its names as they are.
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in _numeric(metrics).items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)
        self.writer.flush()

    def event(self, name: str, info: Mapping[str, Any], step: int) -> None:
        self.writer.add_scalar(f"event/{name}", 1.0, step)
        self.writer.add_text(f"event/{name}", json.dumps(info, default=str), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ----------------------------------------------------------------------------------- wandb


class WandbTracker(Tracker):
    """Weights & Biases; offline (files under `<run_dir>/wandb`) unless WANDB_MODE says else.

    Metrics are plotted against `training/global_step`, which may go back after a rollback
    (wandb's own step may not).
    """

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any], project: str,
                 experiment: str):
        import wandb

        self.run = wandb.init(project=project, name=experiment, dir=str(run_dir),
                              config=dict(config), mode=os.environ.get("WANDB_MODE", "offline"))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log({**_numeric(metrics), STEP_KEY: step})

    def event(self, name: str, info: Mapping[str, Any], step: int) -> None:
        self.run.log({f"event/{name}": 1.0, STEP_KEY: step})
        self.run.summary[f"event/{name}/{step}"] = json.dumps(info, default=str)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------------- mlflow


class MlflowTracker(Tracker):
    """MLflow run `experiment` in experiment `project`; a file store under `<run_dir>/mlruns`
    unless MLFLOW_TRACKING_URI is set. Config keys become dotted params."""

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any], project: str,
                 experiment: str):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store only on request; it is what needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir).absolute() / "mlruns").as_uri()
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
        self._log_params(config)

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(_mlflow_key(k)[:250], str(v)[:6000])
                  for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in _numeric(metrics).items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def event(self, name: str, info: Mapping[str, Any], step: int) -> None:
        self.log_metrics({f"event/{name}": 1.0}, step)
        self.client.set_tag(self.run_id, _mlflow_key(f"event/{name}/{step}"),
                            json.dumps(info, default=str)[:8000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    r"""verl's MLflow sanitisation (`verl/utils/tracking.py`): `@` -> `_at_`, runs of `/`
    -> one, any other character MLflow refuses (outside `[/\w.\- :]`) -> `_`; a name
    MLflow takes is kept as it is."""
    key = re.sub(r"/+", "/", key.replace("@", "_at_"))
    return re.sub(r"[^/\w.\- :]", "_", key)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ----------------------------------------------------------------------------------- build


def check_available(names: Iterable[str]) -> None:
    """Raises ConfigError (one line) for an unknown tracker or one whose package is missing."""
    for name in names:
        if name in ("console", "jsonl"):
            continue
        if name not in PACKAGES:
            raise ConfigError(f"trainer.logger: unknown tracker {name!r} (console, jsonl, "
                              f"{', '.join(PACKAGES)})")
        try:
            importlib.import_module(PACKAGES[name])
        except ImportError:
            raise ConfigError(f"trainer.logger {name!r} needs {PACKAGES[name]}: "
                              "pip install 'rlhf_jax[trackers]'") from None


def make_trackers(names: Iterable[str], run_dir: str | Path, *, total_steps: int,
                  config: Mapping[str, Any], project: str, experiment: str,
                  test_freq: int = 0, save_freq: int = 0) -> list[Tracker]:
    """Builds the trackers of `trainer.logger`, in order; duplicates are ignored.

    Args:
      names: tracker names (console, jsonl, tensorboard, wandb, mlflow).
      run_dir: the run's output folder (metrics.jsonl, tensorboard/, wandb/, mlruns/).
      total_steps: for the console's progress and ETA.
      test_freq, save_freq: `trainer.test_freq` / `save_freq`, for the console's ETA (the
        validations and checkpoints still due, at their measured durations).
      config: the resolved config as a plain dict (logged as hyper-parameters).
      project, experiment: `trainer.project_name`, `trainer.experiment_name`.
    """
    names = list(dict.fromkeys(names))
    check_available(names)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    build = {
        "console": lambda: ConsoleTracker(total_steps, test_freq=test_freq, save_freq=save_freq),
        "jsonl": lambda: JsonlTracker(run_dir),
        "tensorboard": lambda: TensorBoardTracker(run_dir, config),
        "wandb": lambda: WandbTracker(run_dir, config, project, experiment),
        "mlflow": lambda: MlflowTracker(run_dir, config, project, experiment),
    }
    out: list[Tracker] = []
    try:
        for name in names:
            out.append(build[name]())
    except Exception:
        for tracker in out:
            tracker.close()
        raise
    return out

