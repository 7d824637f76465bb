"""Orbax checkpoints: a sharded state pytree plus a JSON `meta` dict per step.

One step on disk (orbax's layout, plus our size manifest):
```
<directory>/<step>/state/...               the pytree (OCDBT/zarr), written asynchronously
<directory>/<step>/meta/metadata           JSON: step, epoch, loader state, config, good, ...
<directory>/<step>/rlhf_manifest.json      size (and CRC32 of small files) of every file above
```
Restore goes INTO a caller-given abstract tree whose leaves carry shardings on the current
mesh, so a run saved on a (2,2,2) mesh resumes on (1,8,1) or one device, and NamedTuples
(optax states, `TrainState`) come back as themselves.

`meta["good"]` is the caller's verdict: a checkpoint saved while a rollback trigger fires is
`good=False` and `restore_latest_good` never returns it. That method also steps past damaged
checkpoints (truncated or missing files, unreadable metadata) with one warning line each.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlhf_jax.errors import UserError

MANIFEST = "rlhf_manifest.json"
_CRC_MAX_BYTES = 1 << 20  # small files (metadata) also get a CRC32; big ones only a size
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's marker of a save that never finished
_SAVE_OVERHEAD = 1 << 20  # orbax's metadata files, our manifest


def _no_replica_slices() -> None:
    """In one process, orbax writes each replicated shard whole instead of splitting it
    between its replicas ("replica-parallel" saving, its CPU default): that split slices every
    replicated array eagerly (`jax.lax.slice_in_dim` on a device array, a compiled `slice`
    program per shape and device set), 88 compiles on the first save of the (2,2,2) GRPO
    recipe, which blocked its first step for 18-64 s. It only spreads the writing over hosts;
    in one process the same bytes are written either way, and restoring reads both layouts.
    Several processes keep orbax's default."""
    if jax.process_count() != 1:
        return
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_use_replica_parallel", False) and type(handler) is \
            ocp.type_handlers.ArrayHandler:
        absl = logging.getLogger("absl")  # orbax warns of every override
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                override=True)
        finally:
            absl.setLevel(level)


class CheckpointError(UserError):
    """No checkpoint to restore, or the requested one is damaged (names step and path)."""


class DamagedCheckpoint(CheckpointError):
    """One checkpoint cannot be restored; `reason` says which file or what orbax reported."""

    def __init__(self, step: int, path: Path, reason: str):
        super().__init__(f"checkpoint step {step} at {path} is damaged: {reason}")
        self.step, self.path, self.reason = step, path, reason


class DiskFull(CheckpointError):
    """The disk cannot hold the next checkpoint (says how much it needs)."""


class CheckpointWarning(UserWarning):
    """A damaged or half-written checkpoint was skipped."""


class Restored(NamedTuple):
    step: int
    state: Any
    meta: dict


class Skipped(NamedTuple):
    step: int
    path: str
    reason: str
    damaged: bool  # False: intact but marked good=False


class GoodRestore(NamedTuple):
    step: int
    state: Any
    meta: dict
    skipped: tuple[Skipped, ...]  # newer checkpoints passed over, newest first


class Checkpointer:
    """Saves and restores `(state, meta)` per step under `directory` with orbax.

    Args:
      directory: the run's checkpoint folder (created if missing).
      max_to_keep: keep this many newest checkpoints (None: all); the newest good one is
        always kept as well. Pruning happens when the next save starts, at `wait()`/`close()`.
      async_save: `save` returns once the arrays are on host; files are written behind.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
                 async_save: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():  # before orbax's threads
            raise CheckpointError(f"{self.directory} is a file, not a checkpoint directory; "
                                  "move it away or set another trainer.default_local_dir")
        self.max_to_keep = max_to_keep
        self._warn_unfinished()
        _no_replica_slices()
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))
        self._good: dict[int, bool] = {}
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._need = 0  # bytes the save in flight needs
        self._failed = False  # a save failed (and was reported)

    # ------------------------------------------------------------------------------- saving

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> None:
        """Starts saving `state` (pytree of arrays) and `meta` (JSON dict with `good: bool`).

        Returns once the arrays are copied off the devices, so the caller may donate them;
        `wait()` blocks until the files are on disk. An existing checkpoint at `step` (e.g. a
        good=False one left before a rollback) is replaced only with `force=True`.
        """
        if not isinstance(meta.get("good"), bool):
            raise CheckpointError("checkpoint meta needs a bool 'good' entry")
        try:
            json.dumps(meta, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {e}") from None
        self._finish_writer()
        if step in self._mgr.all_steps():
            if not force:
                raise CheckpointError(f"checkpoint step {step} already exists in "
                                      f"{self.directory}; pass force=True to replace it")
            self._mgr.delete(step)
        state = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.asarray(x), state)
        self._check_space(step, state, meta)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta))
        with signals_held():
            # force: the trainer decides when to save (also below the latest step after a
            # rollback).
            self._mgr.save(step, args=args, force=True)
            self._good[step] = meta["good"]
            self._writer = threading.Thread(target=self._finalize, args=(step,), daemon=True,
                                            name=f"rlhf_jax-checkpoint-{step}")
            self._writer.start()

    def _check_space(self, step: int, state: Any, meta: dict) -> None:
        """Refuses a save the disk cannot hold (the checkpoints already there stay intact)."""
        need = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(state)) + len(json.dumps(meta)) + _SAVE_OVERHEAD
        if jax.process_count() > 1:  # each host writes its own shards
            need = need // jax.process_count() + _SAVE_OVERHEAD
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise DiskFull(f"disk full: checkpoint step {step} needs about {_mb(need)} in "
                           f"{self.directory}, {_mb(free)} are free; the checkpoints there "
                           f"are intact ({_steps(self.all_steps())}); free space or set "
                           "trainer.default_local_dir on a larger disk")
        self._need = need

    def wait(self) -> None:
        """Blocks until the last save is on disk (with its manifest) and old steps are pruned."""
        self._finish_writer()

    def _finalize(self, step: int) -> None:
        try:
            self._mgr.wait_until_finished()
            if jax.process_index() == 0:
                _write_manifest(self._step_dir(step))
        except BaseException as e:  # re-raised in the caller's thread by _finish_writer
            self._writer_error = e

    def _finish_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            err, self._writer_error = self._writer_error, None
            self._failed = True
            if _no_space(err):
                raise DiskFull(f"disk full while saving a checkpoint in {self.directory} (it "
                               f"needs about {_mb(self._need)}); the older checkpoints are "
                               f"intact ({_steps(self.all_steps())}): free space or set "
                               "trainer.default_local_dir on a larger disk") from None
            raise CheckpointError(f"saving a checkpoint in {self.directory} failed: "
                                  f"{_one_line(err)}") from None
        self._prune()

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        steps = sorted(self._mgr.all_steps())
        keep = set(steps[-self.max_to_keep:])
        good = [s for s in steps if self._is_good(s)]
        if good:
            keep.add(good[-1])
        for s in steps:
            if s not in keep:
                self._mgr.delete(s)
                self._good.pop(s, None)

    # ---------------------------------------------------------------------------- restoring

    def latest_step(self) -> int | None:
        """The highest step on disk, or None (a save still in flight counts)."""
        steps = self._mgr.all_steps()
        return max(steps) if steps else None

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def restore(self, step: int | None = None, *, target_state: Any,
                shardings: Any = None) -> Restored:
        """Restores `step` (default: the latest) into the structure of `target_state`.

        Args:
          step: which checkpoint; None for the latest.
          target_state: pytree of `jax.ShapeDtypeStruct` or arrays giving structure, shapes and
            dtypes (NamedTuples come back as themselves).
          shardings: matching pytree of `NamedSharding`s on the current mesh, one sharding for
            every leaf, or None to use the leaves' own `.sharding`.

        Raises:
          CheckpointError: no such checkpoint; `DamagedCheckpoint` if it is damaged.
        """
        self._finish_writer()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.directory}")
        elif step not in self._mgr.all_steps():
            raise CheckpointError(f"no checkpoint step {step} in {self.directory} "
                                  f"(have {self.all_steps()})")
        return self._restore(step, _abstract(target_state, shardings))

    def restore_latest_good(self, *, target_state: Any, shardings: Any = None,
                            newest: int | None = None) -> GoodRestore | None:
        """The newest checkpoint with `meta["good"]` that restores intact (of the steps up to
        `newest`, when given); None if there are none.

        Damaged newer checkpoints are skipped with one `CheckpointWarning` each, naming the
        damaged and the restored step; all passed-over steps are listed in `.skipped`.

        Raises:
          CheckpointError: checkpoints exist, but none is both good and intact.
        """
        self._finish_writer()
        steps = sorted((s for s in self._mgr.all_steps() if newest is None or s <= newest),
                       reverse=True)
        if not steps:
            return None
        abstract = _abstract(target_state, shardings)
        skipped: list[Skipped] = []
        for step in steps:
            path = str(self._step_dir(step))
            try:
                meta = self._read_meta(step)
            except Exception as e:  # any failure to read is damage, whatever orbax raises
                skipped.append(Skipped(step, path, f"meta unreadable: {_one_line(e)}", True))
                continue
            if meta.get("good") is not True:
                skipped.append(Skipped(step, path, "marked good=False", False))
                continue
            try:
                restored = self._restore(step, abstract)
            except DamagedCheckpoint as e:
                skipped.append(Skipped(step, path, e.reason, True))
                continue
            for s in skipped:
                if s.damaged:
                    warnings.warn(f"checkpoint step {s.step} at {s.path} is damaged ({s.reason}); "
                                  f"restored step {step} at {path} instead",
                                  CheckpointWarning, stacklevel=2)
            return GoodRestore(step, restored.state, restored.meta, tuple(skipped))
        raise CheckpointError(f"no good, intact checkpoint in {self.directory}: " + "; ".join(
            f"step {s.step}: {s.reason}" for s in skipped))

    def _restore(self, step: int, abstract: Any) -> Restored:
        path = self._step_dir(step)
        problem = _check_manifest(path)
        if problem is None:
            try:
                out = self._mgr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
                return Restored(step, out["state"], dict(out["meta"]))
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                problem = _one_line(e)
        raise DamagedCheckpoint(step, path, problem)

    def read_meta(self, step: int) -> dict:
        """The JSON part of checkpoint `step` (raises what orbax raises if it is damaged)."""
        return self._read_meta(step)

    def _read_meta(self, step: int) -> dict:
        out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def _is_good(self, step: int) -> bool:
        if step not in self._good:
            try:
                self._good[step] = self._read_meta(step).get("good") is True
            except Exception:
                self._good[step] = False
        return self._good[step]

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _warn_unfinished(self) -> None:
        if not self.directory.is_dir():
            return
        for p in sorted(self.directory.glob(f"*{_TMP_SUFFIX}*")):
            warnings.warn(f"ignoring partly written checkpoint {p} (a save that never finished; "
                          "removed at the next save)", CheckpointWarning, stacklevel=3)

    # ------------------------------------------------------------------------------ closing

    def close(self) -> None:
        """Waits for the last save and releases orbax's threads."""
        try:
            self._finish_writer()
        finally:
            try:
                self._mgr.close()
            except Exception as e:  # orbax raises a failed save's error once more
                if not self._failed:
                    raise CheckpointError(f"closing the checkpoints in {self.directory} "
                                          f"failed: {_one_line(e)}") from None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def signals_held():
    """A SIGTERM whose handler raises (scripts/train.py's) waits until the block is done:
    raised inside orbax's save, it would leave orbax's threads half-way; after it, `close()`
    waits for the save to finish. The run loop holds it from a step's checkpoint to its last
    hook (hooks.py), so a step whose checkpoint is written has its metrics logged too.
    Nested blocks deliver a held signal once, when the outermost ends."""
    handler = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    pending = []
    signal.signal(signal.SIGTERM, lambda *sig: pending.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)
        for sig in pending[:1]:
            handler(*sig)


def _abstract(target: Any, shardings: Any) -> Any:
    """Leaves -> `ShapeDtypeStruct(shape, dtype, sharding)` for orbax's restore."""
    def leaf(x, sharding):
        if sharding is None:
            raise CheckpointError(f"restore: no sharding for a leaf of shape {np.shape(x)}; "
                                  "pass shardings= on the current mesh")
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

    if shardings is None:
        return jax.tree.map(lambda x: leaf(x, getattr(x, "sharding", None)), target)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: leaf(x, shardings), target)
    return jax.tree.map(leaf, target, shardings)


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(step_dir: Path) -> None:
    entries = {}
    for p in _files(step_dir):
        size = p.stat().st_size
        crc = zlib.crc32(p.read_bytes()) if size <= _CRC_MAX_BYTES else None
        entries[str(p.relative_to(step_dir))] = {"size": size, "crc32": crc}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": entries}, indent=1, sort_keys=True))
    os.replace(tmp, step_dir / MANIFEST)


def _check_manifest(step_dir: Path) -> str | None:
    """None if every file the manifest lists is there, whole; else what is wrong.

    A checkpoint without a manifest (the run stopped right after orbax finished) is left to
    orbax's own checks.
    """
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{MANIFEST} unreadable: {_one_line(e)}"
    for rel, want in entries.items():
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{rel} is {size} bytes, {want['size']} were written"
        if want["crc32"] is not None and zlib.crc32(p.read_bytes()) != want["crc32"]:
            return f"{rel} has a wrong CRC32"
    return None


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _steps(steps: list[int]) -> str:
    return "steps " + ", ".join(map(str, steps)) if steps else "none yet"


def _no_space(e: BaseException | None) -> bool:
    """ENOSPC anywhere in the chain of causes (orbax and tensorstore wrap it, or only name
    it in their message)."""
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) \
                or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"
