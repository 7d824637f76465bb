"""Synthetic tasks that write their own data and tokenizer, selected by `synthetic.task`."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_jax.errors import ConfigError
from rlhf_jax.tasks import addition, wordproblems

TASKS = {"addition": addition, "wordproblems": wordproblems}
# What a task writes into the model directory (a run stopped half-way leaves some of them).
_OWN_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors")


def prepare(cfg) -> list[str]:
    """Write the files of `cfg.synthetic.task` that do not exist yet; no task -> nothing.

    Returns:
        The paths written.
    """
    synthetic = cfg.synthetic
    if synthetic is None or not synthetic.task:
        return []
    if synthetic.task not in TASKS:
        raise ConfigError(f"synthetic.task: unknown task {synthetic.task!r} "
                          f"(known: {', '.join(sorted(TASKS))})")
    model = Path(cfg.actor_rollout_ref.model.path)
    others = [] if not model.is_dir() or (model / "config.json").is_file() else \
        sorted(p.name for p in model.iterdir() if p.name not in _OWN_FILES)
    if others:
        raise ConfigError(f"actor_rollout_ref.model.path: {model} holds other files "
                          f"({', '.join(others[:3])}) but no config.json; the synthetic task "
                          "writes its model only into a new or empty directory (is the path "
                          "mistyped?)")
    written = TASKS[synthetic.task].prepare(cfg)
    if written:
        print(f"synthetic.task {synthetic.task}: wrote {', '.join(map(str, written))}",
              flush=True)
    return written


def prepare_model(cfg) -> None:
    """At `actor_rollout_ref.model.path`, the task model's `config.json` and random-init
    weights (seed `synthetic.seed`), each unless it exists; call after `prepare`."""
    task = TASKS[cfg.synthetic.task]
    path = Path(cfg.actor_rollout_ref.model.path)
    if not (path / "config.json").is_file():
        print(f"synthetic.task {cfg.synthetic.task}: no model at "
              f"actor_rollout_ref.model.path {path}: writing a random-init one there",
              flush=True)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(task.MODEL, indent=2))
    from rlhf_jax.roles import ensure_model_weights  # jax and the model: only when needed

    ensure_model_weights(path, task.MODEL, cfg.synthetic.seed)


def prepare_on_every_host(cfg) -> None:
    """`prepare` and `prepare_model` in every process of the job: process 0 writes the files
    first; the others then find them (a shared disk) or write their own identical copy (same
    seed), never while another process is writing. No task -> nothing."""
    if cfg.synthetic.task is None:
        return
    import jax

    from rlhf_jax import distributed

    for turn in (0, 1):
        if (jax.process_index() == 0) == (turn == 0):
            prepare(cfg)
            prepare_model(cfg)
        distributed.barrier(f"rlhf_jax-synthetic-{turn}")
