"""Benchmarks: `python scripts/bench.py [rollout|ppo|...|all]` prints one JSON object.

Each name is a module `rlhf_jax/benchmarks/<name>.py` with `run() -> dict` of flat
`"<name>.<metric>"` figures; `all` runs every such module. The object also holds the
versions, the devices and the peak RSS of the run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time

NOT_BENCHMARKS = {"common"}


def available() -> list[str]:
    import rlhf_jax.benchmarks as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                  if m.name not in NOT_BENCHMARKS and not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    names = available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("benchmarks", nargs="*", default=["all"], metavar="NAME",
                   help=f"one or more of: {', '.join(names)}, all (default)")
    args = p.parse_args(argv)
    chosen = names if "all" in args.benchmarks else args.benchmarks
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"error: unknown benchmark {unknown[0]!r} (known: {', '.join(names)}, all)",
              file=sys.stderr)
        return 2
    from rlhf_jax.benchmarks.common import device_info, peak_rss_mb, versions

    result: dict = {}
    for name in chosen:
        t0 = time.perf_counter()
        result.update(importlib.import_module(f"rlhf_jax.benchmarks.{name}").run())
        result[f"{name}.wall_seconds"] = time.perf_counter() - t0
    result.update({"devices": device_info(), "versions": versions(),
                   "peak_rss_mb": peak_rss_mb()})
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
