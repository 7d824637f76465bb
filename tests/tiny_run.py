"""The tiny PPO run the end-to-end tests share, in process (`tiny`) or as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Metrics that measure the machine, not the algorithm.
MACHINE = ("timing_s/", "timing_per_token_ms/", "perf/")


def tiny_overrides(tmp: Path, **extra) -> list[str]:
    """Overrides that shrink a tiny_cpu config to a few-second run under `tmp`."""
    overrides = {
        "data.train_files": str(tmp / "data/train.parquet"),
        "data.val_files": str(tmp / "data/val.parquet"),
        "actor_rollout_ref.model.path": str(tmp / "model"),
        "trainer.default_local_dir": str(tmp / "run"),
        "data.train_batch_size": 16,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_device": 1,
        "actor_rollout_ref.rollout.max_concurrent_decodes": 16,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.val_before_train": False,
        "trainer.logger": "[jsonl]",
        "trainer.sft_warmup.max_steps": 4,
        "trainer.sft_warmup.eval_every": 2,
        "trainer.sft_warmup.target_score": 2.0,  # never reached: exactly 4 steps
        "trainer.sft_warmup.batch_size": 16,
        "synthetic.num_train": 64,
        "synthetic.num_val": 16,
        "reward.custom_reward_function.path": str(ROOT / "tests/dense_reward.py"),
    }
    overrides.update(extra)
    return [f"{k}={v}" for k, v in overrides.items()]


def tiny(tmp: Path, config: str = "ppo_tiny_cpu.yaml", **extra):
    from rlhf_jax.config import load_config

    return load_config(ROOT / "configs" / config, tiny_overrides(tmp, **extra))


def train_script(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    """`scripts/train.py args` in a subprocess (stdout and stderr to files under cwd)."""
    out = open(cwd / "stdout.txt", "a")
    return subprocess.Popen([sys.executable, str(ROOT / "scripts/train.py"), *args], cwd=cwd,
                            stdout=out, stderr=subprocess.STDOUT, text=True, **kw)


def algorithmic(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(MACHINE)} for m in history]


def compare(a: list[dict], b: list[dict], atol: float, rel: float = 1e-4) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], abs=atol, rel=rel), (step, k)


def jsonl_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def steps_logged(run_dir: Path) -> dict[int, dict]:
    """The last metrics row of each step in `metrics.jsonl` (events left out)."""
    out = {}
    for row in jsonl_rows(run_dir):
        if "event" not in row:
            out[row["training/global_step"]] = row
    return out
