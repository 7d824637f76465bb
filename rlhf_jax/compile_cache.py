"""JAX's persistent compilation cache, on by default, and a log of what a run compiles.

    from rlhf_jax import compile_cache
    compile_cache.enable(cfg.trainer.compilation_cache_dir)   # before the first compile
    with compile_cache.CompileLog() as log:
        ...                                                    # build and train
    print(log.summary())    # "41 programs, 2.1 s compiling (38 from the cache)"

**Where.** The first of: `trainer.compilation_cache_dir` (a path, or `off`), the environment
variable `RLHF_JAX_COMPILATION_CACHE_DIR` (same values), JAX's own setting
(`JAX_COMPILATION_CACHE_DIR` / `jax.config.jax_compilation_cache_dir`, used as it is), and
`$XDG_CACHE_HOME/rlhf_jax/xla` (`~/.cache/rlhf_jax/xla`). Under a directory chosen here the
entries go into one sub-directory per version pair, `jax-<version>_jaxlib-<version>`, so an
upgrade starts afresh and the old one can be deleted whole. The cache is trusted input (JAX
loads executables from it): keep it where only you can write. It is never pruned; delete the
directory to clear it.

**What a cache entry is keyed on** (`jax._src.cache_key.get`, jax 0.10.2): the program's
StableHLO (its shapes, dtypes and sharding annotations, so the mesh's axis sizes and every
layout), the jaxlib version, the backend's platform version (PJRT plugin, CUDA/TPU runtime),
the XLA flags in `XLA_FLAGS` / `LIBTPU_INIT_ARGS` / `--xla*` argv (so the simulated CPU device
count is part of it), the compile options (device assignment, partition count, compiler
options such as the engine's), the devices' kinds and count, and the compression. A changed
mesh, flag, model or batch shape is therefore a miss, never a wrong executable. The python
`jax` version is not in the key (jax and jaxlib are released in lock step), hence the
versioned sub-directory.

**Thresholds.** JAX writes an entry only for compiles of at least 1 s and, on CPU, of some
minimum size; the trainer's programs include many small ones (the engine's inserts, the
advantage and metric programs) whose compiles add up to seconds on a small machine, so both
thresholds are lowered to cache everything (`min_compile_time_secs=0`,
`min_entry_size_bytes=-1`), unless the environment sets them
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, `JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES`).
With several processes only process 0 writes (JAX's rule); all of them read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
from pathlib import Path

from rlhf_jax.errors import ConfigError

ENV_DIR = "RLHF_JAX_COMPILATION_CACHE_DIR"
OFF = "off"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_THRESHOLDS = (  # (jax option, env variable jax reads, value that caches every program)
    ("jax_persistent_cache_min_compile_time_secs", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
     0.0),
    ("jax_persistent_cache_min_entry_size_bytes", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
     -1),
)


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/rlhf_jax/xla`, or `~/.cache/rlhf_jax/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlhf_jax" / "xla"


def versioned(path: str | Path) -> Path:
    """`path/jax-<version>_jaxlib-<version>`: one cache per version pair."""
    import jax
    import jaxlib

    return Path(path).expanduser() / f"jax-{jax.__version__}_jaxlib-{jaxlib.__version__}"


def resolve_dir(setting: str | None = None) -> Path | None:
    """The directory the cache uses for `setting` (`trainer.compilation_cache_dir`); None:
    off. See the module doc for the order of precedence."""
    for value, where in ((setting, "trainer.compilation_cache_dir"),
                         (os.environ.get(ENV_DIR), ENV_DIR)):
        if value is None or value == "":
            continue
        if str(value).strip().lower() == OFF:
            return None
        path = Path(value).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{where}: {value!r} is a file, not a directory")
        return versioned(path)
    own = _jax_dir()
    if own:
        return Path(own)
    return versioned(default_dir())


def _jax_dir() -> str | None:
    """JAX's own setting (`JAX_COMPILATION_CACHE_DIR`, `jax_compilation_cache_dir`)."""
    import jax

    return jax.config.jax_compilation_cache_dir


def enable(setting: str | None = None) -> Path | None:
    """Turns the persistent cache on at `resolve_dir(setting)` (or off) and lowers its
    thresholds; returns the directory (None: off).

    Call it before the first compile that should be cached; calling it again with the same
    directory changes nothing. A directory that cannot be created turns the cache off with
    a warning rather than failing the run.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = resolve_dir(setting)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        import warnings

        warnings.warn(f"compilation cache off: cannot create {path} ({exc.strerror})",
                      stacklevel=2)
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    for option, env, value in _THRESHOLDS:
        if env not in os.environ:
            jax.config.update(option, value)
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        cc.reset_cache()  # the next compile opens the cache at the new path
    return path


# ----------------------------------------------------------------------------- the log


def program_name(fun_name: str) -> str:
    """`jit(actor_update)` -> `actor_update`."""
    if fun_name.startswith("jit(") and fun_name.endswith(")"):
        return fun_name[4:-1]
    return fun_name


@dataclasses.dataclass(frozen=True)
class Compile:
    """One backend compilation: the program, its seconds, whether the persistent cache
    served it, and whether it ran off the main thread (a background precompile)."""

    name: str
    seconds: float
    cached: bool
    background: bool


class CompileLog:
    """The backend compilations while it is active (a context manager), from
    `jax.monitoring` events; thread-safe, so background compiles are logged too.

    Also sums the seconds spent tracing to jaxprs and lowering to StableHLO.
    """

    _active: list[CompileLog] = []
    _lock = threading.Lock()
    _registered = False
    _hit = threading.local()  # a cache hit, until the thread's compile event reads it

    def __init__(self):
        self.compiles: list[Compile] = []
        self.trace_seconds = 0.0
        self.lower_seconds = 0.0

    @classmethod
    def _register(cls) -> None:
        import jax

        with cls._lock:
            if cls._registered:
                return
            jax.monitoring.register_event_listener(cls._on_event)
            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            cls._registered = True

    @classmethod
    def _on_event(cls, event: str, **_) -> None:
        if event == _CACHE_HIT:
            cls._hit.value = True

    @classmethod
    def _on_duration(cls, event: str, seconds: float, **kw) -> None:
        if event == _BACKEND_COMPILE:
            hit = getattr(cls._hit, "value", False)
            cls._hit.value = False
            c = Compile(program_name(str(kw.get("fun_name", "?"))), float(seconds), hit,
                        threading.current_thread() is not threading.main_thread())
            with cls._lock:
                for log in cls._active:
                    log.compiles.append(c)
        elif event in (_TRACE, _LOWER):
            with cls._lock:
                for log in cls._active:
                    if event == _TRACE:
                        log.trace_seconds += float(seconds)
                    else:
                        log.lower_seconds += float(seconds)

    def __enter__(self) -> CompileLog:
        self._register()
        with self._lock:
            self._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active.remove(self)

    @contextlib.contextmanager
    def paused(self):
        """Not logging inside the block."""
        with self._lock:
            self._active.remove(self)
        try:
            yield
        finally:
            with self._lock:
                self._active.append(self)

    # ------------------------------------------------------------------------ figures

    @property
    def seconds(self) -> float:
        """Backend-compile seconds in total (cache loads included)."""
        return sum(c.seconds for c in self.compiles)

    @property
    def blocking_seconds(self) -> float:
        """Backend-compile seconds on the main thread: what the run waited for."""
        return sum(c.seconds for c in self.compiles if not c.background)

    def per_program(self) -> dict[str, float]:
        """Seconds per program name (same-named programs summed), largest first."""
        out: collections.Counter[str] = collections.Counter()
        for c in self.compiles:
            out[c.name] += c.seconds
        return dict(out.most_common())

    def figures(self, prefix: str = "compile") -> dict[str, float]:
        """Flat figures: `<prefix>.seconds` (total), `.blocking_seconds`, `.programs`,
        `.cache_hits`, `.background_programs`, `.trace_seconds`, `.lower_seconds` and
        `<prefix>.seconds.<program>` for each program."""
        out = {
            f"{prefix}.seconds": self.seconds,
            f"{prefix}.blocking_seconds": self.blocking_seconds,
            f"{prefix}.programs": float(len(self.compiles)),
            f"{prefix}.cache_hits": float(sum(c.cached for c in self.compiles)),
            f"{prefix}.background_programs": float(sum(c.background for c in self.compiles)),
            f"{prefix}.trace_seconds": self.trace_seconds,
            f"{prefix}.lower_seconds": self.lower_seconds,
        }
        out.update({f"{prefix}.seconds.{k}": v for k, v in self.per_program().items()})
        return out

    def summary(self) -> str:
        """One line: programs, seconds (on the main thread / in the background), cache hits
        and the three largest programs."""
        top = ", ".join(f"{k} {v:.2f}s" for k, v in list(self.per_program().items())[:3])
        bg = self.seconds - self.blocking_seconds
        return (f"{len(self.compiles)} programs, {self.seconds:.1f}s compiling "
                f"({self.blocking_seconds:.1f}s blocking, {bg:.1f}s in the background; "
                f"{sum(c.cached for c in self.compiles)} from the cache)"
                + (f"; largest: {top}" if top else ""))
