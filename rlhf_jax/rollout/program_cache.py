"""Jitted programs built once per key and compiled once, whichever thread asks first: the
rollout engine's program table (`rollout.engine.Engine` mixes it in).

A background `precompile` compiles a program from its arguments' shapes (`_compiled`); a call
in another thread that needs the same program meanwhile waits for it (`_jit`) instead of
compiling it a second time. `trace_counts` counts the traces of each key (tests check that
each program traces once).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax


def abstract(tree):
    """The shapes, dtypes and shardings of the arrays (or shape structs) in `tree`, the rest
    as it is: what compiling a program for them needs, without their memory. An uncommitted
    array, which jit may place anywhere, keeps no sharding."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding if getattr(x, "committed", True) else None)
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else x, tree)


class ProgramCache:
    """The table of jitted functions by key, and the programs being compiled."""

    def _reset_programs(self) -> None:
        """An empty table (a new engine, or one with other shapes)."""
        self.trace_counts: collections.Counter[tuple] = collections.Counter()
        self._jits: dict[tuple, Any] = {}
        # Programs a `precompile` (maybe in another thread) is compiling: key -> (done, thread).
        self._pending: dict[tuple, tuple[threading.Event, int]] = {}
        self._lock = threading.Lock()

    def _jit(self, key: tuple, build):
        """The jitted function of `key`, built once; its traces are counted in `trace_counts`.

        While another thread's `precompile` compiles it, this waits for that compile rather
        than compiling the program a second time.
        """
        with self._lock:
            if key not in self._jits:
                self._jits[key] = build()
            fn, pending = self._jits[key], self._pending.get(key)
        if pending is not None and pending[1] != threading.get_ident():
            pending[0].wait()
        return fn

    def _traced(self, key: tuple) -> None:
        self.trace_counts[key] += 1  # a Python side effect: runs once per trace

    def _claim(self, key: tuple, build) -> bool:
        """Builds `key`'s function for this thread to compile; False if it exists already
        (built, so compiled or being compiled by its first caller)."""
        with self._lock:
            if key in self._jits:
                return False
            self._jits[key] = build()
            self._pending[key] = (threading.Event(), threading.get_ident())
            return True

    def _compiled(self, call) -> Any:
        """Compiles the program of `call` = `(key, build, args)` without running it (if no
        one built it before) and returns its outputs' shapes and shardings."""
        key, build, args = call
        shapes = abstract(args)
        claimed = self._claim(key, build)
        fn = self._jits[key]
        try:
            if claimed:
                fn.lower(*shapes).compile()
            return jax.eval_shape(fn, *shapes)
        finally:
            if claimed:
                with self._lock:
                    self._pending.pop(key)[0].set()
