"""Train on several hosts: `launch_ray.py --config X.yaml --num-hosts N [key=value ...]`.

Connects to a Ray cluster (`--address`, e.g. `auto` on a node of a running cluster) or starts
a local one, reserves one placement-group bundle per host (STRICT_SPREAD: one node each),
starts one `HostWorker` actor per bundle, gives every actor the jax coordinator address of
actor 0 and runs the trainer in all of them; together they form one `jax.distributed` job
over one global mesh. The first actor to fail brings the job down: the others are killed, its
error is printed on one line and the launcher exits 2, as scripts/train.py does for every
failure (a configuration error, a host that raises, a host whose process dies).

A local cluster has one node, so its actors share it (placement SPREAD); that is a test set-up
(`--cpu-devices-per-host 4` simulates 4 CPU devices per process), not a multi-host run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlhf_jax.config import load_config
from rlhf_jax.errors import UserError, one_line

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "ppo_tiny_cpu.yaml"
PLACEMENTS = {"strict_spread": "STRICT_SPREAD", "spread": "SPREAD", "pack": "PACK"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="a YAML config")
    p.add_argument("--num-hosts", type=int, required=True, help="processes (one per host)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto', 'host:6379', 'ray://host:10001'); "
                        "default: start a local one-node cluster")
    p.add_argument("--placement", choices=["auto", *PLACEMENTS], default="auto",
                   help="placement-group strategy; auto: strict_spread on a cluster joined "
                        "with --address, spread on a local cluster")
    p.add_argument("--cpus-per-host", type=float, default=1.0, help="Ray CPUs per actor")
    p.add_argument("--gpus-per-host", type=float, default=0.0, help="Ray GPUs per actor")
    p.add_argument("--resources-per-host", default="{}",
                   help='other Ray resources per actor as JSON, e.g. \'{"TPU": 4}\'')
    p.add_argument("--cpu-devices-per-host", type=int, default=None,
                   help="run on the CPU backend with this many simulated devices per process")
    p.add_argument("--coordinator-port", type=int, default=0,
                   help="port of jax's coordinator on actor 0's node (default: a free one)")
    p.add_argument("--placement-timeout", type=float, default=300.0,
                   help="seconds to wait for the cluster to fit all hosts")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return p.parse_intermixed_args(argv)


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _cause(exc: BaseException) -> str:
    """The one-line message of an actor's failure."""
    import ray.exceptions

    if isinstance(exc, ray.exceptions.RayTaskError):  # the actor raised: its own exception
        cause = exc.cause if exc.cause is not None else exc
        if isinstance(cause, UserError):
            return str(cause).strip().splitlines()[0]
        lines = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {lines[0] if lines else ''}"
    lines = str(exc).strip().splitlines()  # the actor's process died (killed, os._exit, OOM)
    return f"its process died ({type(exc).__name__}: {lines[0] if lines else ''})"


def _actor_env(args) -> dict[str, str]:
    """Environment of every actor: forwarded RLHF_JAX_* variables and the CPU simulation."""
    env = {k: v for k, v in os.environ.items() if k.startswith("RLHF_JAX_")}
    env["PYTHONUNBUFFERED"] = "1"
    if args.cpu_devices_per_host is not None:
        import re

        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       os.environ.get("XLA_FLAGS", "")).strip()
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                            f"{args.cpu_devices_per_host}").strip()
    return env


# ------------------------------------------------------------------------- the per-host worker
# Defined in the launcher, so the library never imports the trainer from `distributed`. Ray
# ships an actor class of `__main__` to its workers by value (cloudpickle): the class and the
# helpers below travel with it; what they import (rlhf_jax, jax, ray) comes from each node's
# own environment.

FAULT_ENV = "RLHF_JAX_TEST_FAULT"  # tests only: "<process>:<step>:<raise|exit>"


def _parse_fault(spec: str) -> tuple[int, int, str]:
    from rlhf_jax.distributed import DistributedError

    try:
        process, step, mode = spec.split(":")
        process, step = int(process), int(step)
    except ValueError:
        raise DistributedError(f"{FAULT_ENV}={spec!r} is not <process>:<step>:<raise|exit>") \
            from None
    if mode not in ("raise", "exit"):
        raise DistributedError(f"{FAULT_ENV}={spec!r}: mode must be 'raise' or 'exit'")
    return process, step, mode


def _fire(process: int, step: int, mode: str) -> None:
    if mode == "exit":
        print(f"injected fault: process {process} exits at step {step}", flush=True)
        os._exit(3)
    raise RuntimeError(f"injected fault: process {process} fails at step {step}")


def _fault_hook(spec: str):
    """The test fault of `FAULT_ENV`: process p fails (raises, or exits at once) after step s;
    step 0 is right after joining the job, before the trainer is built. None without it."""
    if not spec:
        return None
    process, step, mode = _parse_fault(spec)
    import jax

    if jax.process_index() == process and step == 0:
        _fire(process, step, mode)

    def hook(trainer, metrics):
        if jax.process_index() == process and trainer.global_step == step:
            _fire(process, step, mode)
        return metrics

    return hook


class HostWorker:
    """One host's process of a multi-host run (a Ray actor, one per placement bundle)."""

    def coordinator_address(self, port: int = 0) -> str:
        """`ip:port` on this node for jax's coordinator service (a free port if 0)."""
        import socket

        import ray

        if not port:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(self, coordinator_address: str, num_processes: int, process_id: int,
            config: str, overrides: list[str], cpu_devices: int | None = None,
            cwd: str | None = None) -> dict:
        """Joins the job, trains `config` with `overrides`; returns a summary of the run.

        `cwd` (the launcher's directory) is where relative paths in the overrides point, on
        nodes that have it.
        """
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        from rlhf_jax.distributed import initialize

        initialize(coordinator_address, num_processes, process_id, cpu_devices=cpu_devices)
        import jax

        from rlhf_jax.trainer import Trainer

        cfg = load_config(config, list(overrides))
        hook = _fault_hook(os.environ.get(FAULT_ENV, ""))
        trainer = Trainer(cfg)
        if hook is not None:
            trainer.fault_hook = hook
        history = trainer.run()
        return {"process": jax.process_index(), "processes": jax.process_count(),
                "devices": jax.device_count(), "steps": trainer.global_step,
                "run_dir": str(trainer.run_dir), "last": history[-1] if history else {}}


def launch(args) -> int:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = args.num_hosts
    extra = json.loads(args.resources_per_host)
    local = args.address is None
    if local:
        need = max(n * args.cpus_per_host, os.cpu_count() or 1)
        ray.init(num_cpus=int(-(-need // 1)), num_gpus=int(n * args.gpus_per_host) or None,
                 resources={k: n * v for k, v in extra.items()} or None,
                 include_dashboard=False, log_to_driver=True)
    else:
        ray.init(address=args.address, log_to_driver=True)
    strategy = args.placement
    if strategy == "auto":
        strategy = "spread" if local else "strict_spread"
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    print(f"launch_ray: {n} hosts on a {'local ' if local else ''}Ray cluster of {nodes} "
          f"node(s), placement {PLACEMENTS[strategy]}"
          + (" (a local cluster is one node: the hosts share it; a test set-up)" if local
             else ""), flush=True)
    bundle = {"CPU": args.cpus_per_host, **extra}
    if args.gpus_per_host:
        bundle["GPU"] = args.gpus_per_host
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=PLACEMENTS[strategy])
    workers = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=args.placement_timeout)
        if not ready:
            return _fail(f"the Ray cluster ({nodes} node(s)) cannot place {n} hosts of "
                         f"{bundle} with {PLACEMENTS[strategy]} within "
                         f"{args.placement_timeout:g}s", 2)
        actor = ray.remote(HostWorker)
        env = _actor_env(args)
        for i in range(n):
            workers.append(actor.options(
                num_cpus=args.cpus_per_host, num_gpus=args.gpus_per_host, resources=extra,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env}, max_restarts=0, name=None,
            ).remote())
        coordinator = ray.get(workers[0].coordinator_address.remote(args.coordinator_port))
        print(f"launch_ray: jax coordinator at {coordinator}", flush=True)
        config = str(Path(args.config).resolve())
        refs = {w.run.remote(coordinator, n, i, config, args.overrides,
                             args.cpu_devices_per_host, os.getcwd()): i
                for i, w in enumerate(workers)}
        pending = list(refs)
        results = {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i = refs[done[0]]
            try:
                results[i] = ray.get(done[0])
            except Exception as e:  # the first failure ends the job
                return _fail(f"host {i} of {n} failed: {_cause(e)}", 2)
            print(f"launch_ray: host {i} finished ({results[i]['steps']} steps)", flush=True)
        r = results[0]
        print(f"launch_ray: done: {n} hosts, {r['devices']} devices, {r['steps']} steps, "
              f"run in {r['run_dir']}", flush=True)
        return 0
    finally:
        for w in workers:  # an actor still blocked in a collective is killed, not awaited
            ray.kill(w, no_restart=True)
        remove_placement_group(pg)
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.num_hosts < 1:
            raise UserError(f"--num-hosts must be >= 1, got {args.num_hosts}")
        try:
            extra = json.loads(args.resources_per_host)
        except ValueError as e:
            raise UserError(f"--resources-per-host is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise UserError("--resources-per-host must be a JSON object")
        cfg = load_config(args.config, args.overrides)  # fails here, before any actor starts
        b = cfg.data.train_batch_size
        if b % args.num_hosts:
            raise UserError(f"data.train_batch_size {b} is not a multiple of --num-hosts "
                            f"{args.num_hosts} (each host reads an equal share)")
    except UserError as e:
        return _fail(str(e), 2)
    start = time.perf_counter()
    try:
        code = launch(args)
    except (Exception, KeyboardInterrupt) as exc:  # Ray itself failed (start, join, placement)
        code = _fail(one_line(exc), 2)
    print(f"launch_ray: exit {code} after {time.perf_counter() - start:.1f}s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
