"""Checks and guards of a run before its first step: the run directory and its lock, the
tokenizer against the model, and configs that train nothing (warned about once).

    with RunLock(cfg):            # a second run on cfg.trainer.default_local_dir refuses
        warn_degenerate(cfg)      # one `warning: ...` line on stderr per degenerate setting
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

from rlhf_jax.errors import ConfigError, ModelError

LOCK = "run.lock"


def run_dir(cfg) -> Path:
    """`trainer.default_local_dir`, created if missing.

    Raises:
        ConfigError: it cannot be created or is not a directory.
    """
    path = Path(cfg.trainer.default_local_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"trainer.default_local_dir: cannot create {path}: "
                          f"{e.strerror or e}") from None
    return path


class RunLock:
    """An exclusive `flock` on `<run dir>/run.lock` while a run trains there; the kernel drops
    it when the process ends, however it ends (a SIGKILLed run leaves no stale lock)."""

    def __init__(self, cfg):
        self.path = run_dir(cfg) / LOCK
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ConfigError(f"trainer.default_local_dir {self.path.parent} is in use by "
                              f"another run (pid {holder}, lock {self.path}); wait for it "
                              "to end or choose another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def check_vocab(tokenizer, vocab_size: int, model_path) -> None:
    """The tokenizer's ids must all have a row in the model's embedding.

    Raises:
        ModelError: the tokenizer can produce ids >= `vocab_size`.
    """
    if tokenizer.vocab_size > vocab_size:
        raise ModelError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, more "
                         f"than the vocab_size {vocab_size} of the model at {model_path}; use the "
                         "model's own tokenizer (actor_rollout_ref.model.tokenizer_path)")


def degenerate(cfg) -> list[str]:
    """One line for each setting that leaves the algorithm with nothing to learn from."""
    from rlhf_jax.core_algos import get_adv_estimator  # jax: only once training

    arr, out = cfg.actor_rollout_ref, []
    est = get_adv_estimator(cfg.algorithm.adv_estimator)
    if "index" in est.needs and arr.rollout.n == 1:
        out.append(f"algorithm.adv_estimator {est.name} compares the rollout.n responses of a "
                   "prompt, and actor_rollout_ref.rollout.n is 1: every advantage is 0 and the "
                   "actor does not learn; set rollout.n >= 2")
    if arr.actor.optim.lr == 0:
        out.append("actor_rollout_ref.actor.optim.lr is 0: the actor does not learn")
    if cfg.critic.enable and cfg.critic.optim.lr == 0:
        out.append("critic.optim.lr is 0: the critic does not learn")
    roles = [("actor_rollout_ref.model.path", arr.model.path)]
    if cfg.critic.enable and cfg.critic.model.path:
        roles.append(("critic.model.path", cfg.critic.model.path))
    for key, path in roles:  # a synthetic task writes its weights later
        path = Path(path).expanduser()
        if cfg.synthetic.task is None and (path / "config.json").is_file() \
                and not any(path.glob("*.safetensors")):
            out.append(f"{key} {path} has a config.json but no *.safetensors weights: it "
                       "starts from random weights")
    return out


def warn_degenerate(cfg) -> None:
    """`degenerate(cfg)` as `warning: ...` lines on stderr, once, before the run starts."""
    for line in degenerate(cfg):
        print(f"warning: {line}", file=sys.stderr, flush=True)
