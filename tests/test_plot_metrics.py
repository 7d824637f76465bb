"""scripts/plot_metrics.py on a synthetic run: 30 steps with a rollback at step 20."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_metrics.py"


@pytest.fixture(scope="module")
def plot_metrics():
    spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_rows():
    """Steps 1..20, a rollback to 15 at step 20, then 16..30 again; no entropy metric."""
    steps = list(range(1, 21)) + list(range(16, 31))
    rows = []
    for i, s in enumerate(steps):
        blowup = 1.0 + (5.0 if 17 <= s <= 20 and i < 20 else 0.0)
        row = {"training/global_step": s, "critic/score/mean": 1 - math.exp(-s / 10),
               "actor/reward_kl_penalty": 0.01 * blowup, "actor/ppo_kl": 0.002 * blowup,
               "actor/kl_loss": 0.005, "actor/reward_kl_penalty_coeff": 0.001 * (1 + s / 100),
               "actor/pg_loss": -0.1 / s, "critic/vf_loss": 0.5 / s,
               "actor/pg_clipfrac": 0.05, "actor/pg_clipfrac_lower": 0.01,
               "critic/vf_clipfrac": 0.1, "response_length/mean": 40 + s,
               "response_length/max": 64, "response_length/min": 10,
               "perf/throughput": 1000 + 10 * s}
        if s % 10 == 0:
            row["val-core/gsm8k/acc/mean@1"] = s / 40
        rows.append(row)
        if i == 19:
            rows.append({"training/global_step": 20, "event": "training/rollbacks",
                         "reason": "actor/ppo_kl > 0.1", "restored_step": 15})
    return rows


def test_dashboard_png_is_written(plot_metrics, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(r) for r in synthetic_rows()] + ['{"training/global_step": 31, "cri']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert plot_metrics.main([str(run)]) == 0
    png = run / "dashboard.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped 1 unreadable line" in capsys.readouterr().err
    rows, events, _ = plot_metrics.read_metrics(run / "metrics.jsonl")
    assert len(rows) == 35 and [e["training/global_step"] for e in events] == [20]
    xs, _ = plot_metrics.series(rows, "critic/score/mean")
    assert math.isnan(xs[20]) and xs[21] == 16  # the re-run after the rollback is a new segment
    out = tmp_path / "elsewhere" / "d.png"
    assert plot_metrics.main([str(run), "--out", str(out)]) == 0 and out.is_file()


def test_missing_metrics_file_is_one_line_and_exit_2(plot_metrics, tmp_path, capsys):
    assert plot_metrics.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "metrics.jsonl" in err
