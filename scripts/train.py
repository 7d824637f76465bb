"""Train a policy with PPO: `python scripts/train.py --config configs/X.yaml [key=value ...]`.

Overrides use verl's dotted keys (`actor_rollout_ref.actor.optim.lr=1e-6`, `mesh=gpu-8`);
on several hosts run it on every host (see README "Multi-host", or scripts/launch_ray.py);
`--print-config` prints the effective config as YAML and exits without importing jax.
Every failure prints one line (`error: ...`; a bug also names a file with its traceback)
and exits with status 2; SIGTERM stops the run the same way, and the same command resumes it.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from rlhf_jax.config import load_config, to_yaml
from rlhf_jax.errors import Interrupted, one_line
from rlhf_jax.paths import DEFAULT_CONFIG


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="a YAML config (default: configs/ppo_tiny_cpu.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective config as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, values in YAML: a.b=1e-6 a.c=[1,2] a.d=null")
    # Intermixed: flags may follow the overrides (`train.py a.b=1 --print-config`).
    return parser.parse_intermixed_args(argv)


def _interrupt(signum, frame):
    # Raised in the main thread wherever it is: the trainer's `finally` still waits for
    # a checkpoint being written, and the next run resumes from the newest complete one.
    raise Interrupted(f"stopped by {signal.Signals(signum).name}; the newest complete "
                      "checkpoint is kept, and the same command resumes from it")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(to_yaml(cfg))
            return 0
        # Several hosts (a TPU pod slice, JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
        # JAX_PROCESS_ID, SLURM): join them before jax starts; alone, this does nothing.
        importlib.import_module("rlhf_jax.distributed").initialize()
        # JAX's persistent compilation cache (trainer.compilation_cache_dir): a second run
        # of the same config loads its programs instead of compiling them.
        compile_cache = importlib.import_module("rlhf_jax.compile_cache")
        cache_dir = compile_cache.enable(cfg.trainer.compilation_cache_dir)
        try:  # lazy: jax loads only when training
            trainer = importlib.import_module("rlhf_jax.trainer")
        except ModuleNotFoundError as exc:
            if exc.name != "rlhf_jax.trainer":
                raise
            print("error: the trainer is not built yet", file=sys.stderr)
            return 2
        with compile_cache.CompileLog() as log:
            trainer.train(cfg)
        print(f"compile: {log.summary()}; cache: {cache_dir or 'off'}")
    except (Exception, KeyboardInterrupt) as exc:  # every failure: one line, exit 2
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
