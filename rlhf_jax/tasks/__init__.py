"""Synthetic tasks that write their own data and tokenizer, selected by `synthetic.task`."""

from __future__ import annotations

from rlhf_jax.errors import ConfigError
from rlhf_jax.tasks import addition

TASKS = {"addition": addition}


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
    return TASKS[synthetic.task].prepare(cfg)
