"""Plot a run's dashboard: `python scripts/plot_metrics.py RUN_DIR [--out PNG]`.

Reads `RUN_DIR/metrics.jsonl` (the jsonl tracker's lines) and writes one PNG (default
`RUN_DIR/dashboard.png`) with score, KL, KL coefficient, losses, clip fractions, entropy,
response length and throughput against `training/global_step`. Rollback events
(`"event": "training/rollbacks"` lines) are dashed red verticals on every panel. After a
rollback the steps repeat: the re-run is drawn as a new segment, so the discarded excursion
stays visible. A missing metrics file prints one line (`error: ...`) and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rlhf_jax.paths import METRICS

STEP = "training/global_step"
ROLLBACK_EVENTS = ("training/rollbacks",)

# (title, keys); a key ending in "/*" takes every metric with that prefix.
PANELS = (
    ("score", ("critic/score/mean", "val-core/*")),
    ("KL", ("actor/reward_kl_penalty", "actor/ppo_kl", "actor/kl_loss")),
    ("KL coefficient", ("actor/reward_kl_penalty_coeff", "actor/kl_coef")),
    ("losses", ("actor/pg_loss", "critic/vf_loss")),
    ("clip fractions", ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean", "response_length/max",
                         "response_length/min")),
    ("throughput (tokens/s)", ("perf/throughput",)),
)


def read_metrics(path: Path) -> tuple[list[dict], list[dict], int]:
    """Returns (metric rows, event rows, unreadable line count), in file order."""
    rows, events, bad = [], [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # e.g. the last line of a killed run
                bad += 1
                continue
            if not isinstance(row, dict) or STEP not in row:
                bad += 1
            elif "event" in row:
                events.append(row)
            else:
                rows.append(row)
    return rows, events, bad


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """x, y of one metric in file order, with a NaN break wherever the step goes back."""
    xs, ys, last = [], [], None
    for row in rows:
        v = row.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        step = row[STEP]
        if last is not None and step <= last:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(step)
        ys.append(float(v))
        last = step
    return xs, ys


def expand(keys: tuple[str, ...], rows: list[dict]) -> list[str]:
    present = sorted({k for row in rows for k in row})
    out = []
    for key in keys:
        if key.endswith("/*"):
            out += [k for k in present if k.startswith(key[:-1])]
        elif key in present:
            out.append(key)
    return out


def plot(rows: list[dict], events: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5), constrained_layout=True)
    rollbacks = sorted({e[STEP] for e in events if e.get("event") in ROLLBACK_EVENTS})
    for ax, (name, keys) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        drawn = 0
        for key in expand(keys, rows):
            xs, ys = series(rows, key)
            if not xs:
                continue
            sparse = key.startswith("val-core/") or len(xs) < 3
            ax.plot(xs, ys, marker="o" if sparse else None, markersize=3, label=key)
            drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    color="gray", fontsize=14)
            ax.set_xlabel("")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for i, step in enumerate(rollbacks):
            ax.axvline(step, color="red", linestyle="--", linewidth=1,
                       label="rollback" if i == 0 else None)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run folder holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None,
                        help="output PNG (default: RUN_DIR/dashboard.png)")
    args = parser.parse_args(argv)
    path = args.run_dir / METRICS
    if not path.is_file():
        print(f"error: {path} not found (run with trainer.logger including 'jsonl')",
              file=sys.stderr)
        return 2
    rows, events, bad = read_metrics(path)
    if bad:
        print(f"warning: skipped {bad} unreadable line(s) in {path}", file=sys.stderr)
    out = args.out or args.run_dir / "dashboard.png"
    n_rollbacks = sum(e.get("event") in ROLLBACK_EVENTS for e in events)
    plot(rows, events, out, title=f"{args.run_dir}: {len(rows)} logged steps, "
                                  f"{n_rollbacks} rollback{'s' * (n_rollbacks != 1)}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
