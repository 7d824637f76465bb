"""Benchmarks: `python scripts/bench.py [NAME ...]`, each NAME one listed below, or `all`.

Each name is a module `rlhf_jax/benchmarks/<name>.py` with `run() -> dict` of flat
`"<name>.<metric>"` figures; `all` (the default) runs every such module. Every headline
figure is a ratio to a reference measured in the same run, on the same machine:

- `ppo.tokens_per_s`, `ppo.flop_bound_ratio` (iteration FLOPs over measured matmul peak x
  seconds), `ppo.stage.<stage>` seconds: one PPO iteration of WORKLOAD.md, (1,1,1) mesh. With
  `--trl-python PYTHON` (an environment with torch, transformers and trl 1.12), also TRL's PPO
  on the same workload, in turns with ours: `ppo.trl.*` and `ppo.ratio_to_trl`. Start-up:
  `ppo.launch_to_first_step_seconds` and the launch's XLA compiles, `ppo.compile.seconds` (in
  total), `ppo.compile.blocking_seconds` and `ppo.compile.seconds.<program>` (e.g.
  `ppo.compile.seconds.actor_update`).
- `packing.speedup`, `packing.tokens_per_s`, `packing.flop_bound_ratio` (real tokens): WORKLOAD.md's
  workload 2 (variable lengths) on the real trainer, packed (verl's use_remove_padding +
  use_dynamic_bsz) over padded to 128 + 512, in turns; `packing.compiles_after_warmup`.
- `async.reward_hidden_fraction`: the PPO iteration with a reward that sleeps 20 ms a sample,
  inline against a pool of 8 workers (`reward.num_workers`), in turns: the share of the reward
  time no longer on the step's critical path. `async.speedup`: the one-step-off split (4 + 4 of
  8 simulated CPU devices, `actor_rollout_ref.hybrid_engine=false`) over the synchronous
  trainer on (2,2,2); on shared CPU cores it shows the mode's overheads, not a gain.
- `mfu.ratio`: train-step model FLOP/s over the measured f32 matmul peak.
- `reshard.ratio_to_copy`: train -> generate layout seconds over a copy of the same bytes.
- `gae.speedup`: verl's NumPy GAE loop seconds over the compiled GAE's.
- `decode.ratio_to_bound`: KV-cache decode tokens/s over reading params + cache once a step.
- `memory.ratio_to_ideal`: per-device training-state bytes over total / (fsdp x tensor).
- `lora.optimizer_bytes_ratio`, `lora.sync_bytes_ratio` (Qwen2.5-0.5B shapes, rank 8
  all-linear: adapters over full fine-tuning), `lora.step_time_ratio` (actor update, LoRA over
  full, in turns), `lora.live_bytes_ratio` (actor state + reference), `lora.apply_over_merge`
  (the engine applying adapters in its matmuls over merging them at each sync).
- `chunked_head.temp_bytes_ratio`, `chunked_head.time_ratio`: the actor update with the LM
  head in chunks over the full-logits one (Qwen2.5-0.5B head, 2 layers, 4 x 2048 tokens).

`--scale 0.5b` runs them on the Qwen2.5-0.5B architecture with bfloat16 compute at sizes for
one accelerator, against a bfloat16 matmul peak (`--scale workload`, the default: WORKLOAD.md's
model in float32, sized for the 2-core CPU machine). `reshard` and `memory` need 8 devices:
with fewer they run in a subprocess on 8 simulated CPU devices, at either scale.

`all` aims at 10 minutes on the 2-core machine (it took 11 min 36 s with `--trl-python` on an
AMD EPYC, `packing` 213 s of it) by running a few of them shorter, as their module's
`ALL_KW` says (named alone they run in full): `chunked_head` times its updates on 1 row,
once each, with no warm-up call (they are compiled ahead; the memory figures stay those of
4 rows); `ppo` leaves out the bypass-mode trainer (`ppo.bypass.*`);
`async` measures 2 iterations after 1 warm-up in each part instead of 4; `packing` warms up
with 1 iteration instead of 2; `rollout` times each path once. Each benchmark's settings are
in its figures (`chunked_head.time_rows`, `packing.measured_iterations`, ...).

The object also holds `<name>.wall_seconds`, the versions, the devices and the peak RSS.
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
    from rlhf_jax.benchmarks.common import SCALES

    names = available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("benchmarks", nargs="*", default=["all"], metavar="NAME",
                   help=f"one or more of: {', '.join(names)}, all (default)")
    p.add_argument("--trl-python", metavar="PYTHON",
                   help="ppo: also run TRL's PPO on the workload with this Python, in turns")
    p.add_argument("--scale", default="workload", choices=sorted(SCALES),
                   help="workload (default: WORKLOAD.md's model, float32, for the CPU) or "
                        "0.5b (Qwen2.5-0.5B architecture, bfloat16 compute, for an accelerator)")
    args = p.parse_args(argv)
    chosen = names if "all" in args.benchmarks else args.benchmarks
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"error: unknown benchmark {unknown[0]!r} (known: {', '.join(names)}, all)",
              file=sys.stderr)
        return 2
    if args.trl_python and "ppo" not in chosen:
        print("error: --trl-python goes with the ppo benchmark", file=sys.stderr)
        return 2
    if args.trl_python and args.scale != "workload":
        print("error: --trl-python runs TRL on WORKLOAD.md's model: it goes with "
              "--scale workload only", file=sys.stderr)
        return 2
    from rlhf_jax.benchmarks.common import device_info, peak_rss_mb, versions
    from rlhf_jax.errors import UserError

    result: dict = {}
    try:
        if args.trl_python:  # before the other benchmarks, whose minutes a failure would waste
            from rlhf_jax.benchmarks import ppo

            ppo.check_trl(args.trl_python, ppo.TRL_SCRIPT)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = []
    for name in chosen:
        module = importlib.import_module(f"rlhf_jax.benchmarks.{name}")
        kw = {**(getattr(module, "ALL_KW", {}) if "all" in args.benchmarks else {}),
              "scale": args.scale}
        if name == "ppo" and args.trl_python:
            kw["trl_python"] = args.trl_python
        t0 = time.perf_counter()
        try:
            result.update(module.run(**kw))
        except UserError as exc:  # one line; the other benchmarks' figures still count
            print(f"error: {name}: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        result[f"{name}.wall_seconds"] = time.perf_counter() - t0
    result.update({"scale": args.scale, "devices": device_info(), "versions": versions(),
                   "peak_rss_mb": peak_rss_mb()})
    if failed:
        result["failed"] = failed
    print(json.dumps(result, indent=1, sort_keys=True))
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
