"""What the console shows while a run works: phase lines, progress bars, the ETA.

    progress = Progress()                       # sys.stdout; a terminal or not
    with progress.phase("validating"):          # "validating ..." once it takes > 3 s,
        ...                                     # then "validating: done in 12.3s"
    bar = progress.bar("sft warm start", total=1500)
    bar.update(1, "loss 1.9")                   # a tqdm bar on a terminal; nothing in a file
    progress.note("one line")                   # above the bars on a terminal

On a terminal the bars are tqdm's, redrawn in place below the lines already printed; in a
log file (not a tty) the output is plain lines only: no bar, no carriage return, no escape.
The ETA is a pure function of measured durations (`eta_seconds`): steady-state steps (the
first step of a process, which compiles, is never one of them) plus the validations and
checkpoints still due, each at its own measured mean duration.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Sequence


def isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def duration(seconds: float) -> str:
    """`12.3s`, `4m05s`, `2h03m`."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ------------------------------------------------------------------------------------ ETA


def due_count(step: int, total: int, every: int, at_end: bool = True) -> int:
    """How many times a hook with `every` (and `at_end`) runs after `step`, up to `total`."""
    if every <= 0 or step >= total:
        return 0
    n = total // every - step // every
    return n + int(at_end and total % every != 0)


def eta_seconds(step_seconds: Sequence[float], remaining: int,
                periodic: Sequence[tuple[Sequence[float], int]] = ()) -> float | None:
    """Seconds to the end of the run from steady-state durations.

    Args:
      step_seconds: durations of the steps measured so far at steady state, with the time
        of the periodic phases taken out: from the end of one step to the end of the next,
        so the first step of a process (which includes compiling) is never among them.
      remaining: steps still to run.
      periodic: `(durations, count)` per periodic phase (validation, checkpoint): its
        measured durations and how many times it is still due (`due_count`); a phase never
        measured yet counts 0.

    Returns:
      `remaining * mean(step_seconds) + sum(count * mean(durations))`, or None while no
      steady-state step has been measured (and steps remain).
    """
    if remaining <= 0:
        return 0.0
    if not step_seconds:
        return None
    out = remaining * sum(step_seconds) / len(step_seconds)
    for durations, count in periodic:
        if durations and count > 0:
            out += count * sum(durations) / len(durations)
    return out


# ---------------------------------------------------------------------------- step lines


def fit_fields(fields: Sequence[tuple[int, str]], width: int, sep: str = " | ") -> str:
    """The fields that fit in `width` characters, whole, in their given order.

    Args:
      fields: `(priority, text)`; a lower priority is kept first. Fields are never cut:
        the ones of lowest importance are left out until the line fits.
      width: the characters available (the terminal's width).

    Returns:
      The kept texts joined by `sep`; the first field alone if even it does not fit.
    """
    kept: set[int] = set()
    used = 0
    for i in sorted(range(len(fields)), key=lambda i: fields[i][0]):
        extra = len(fields[i][1]) + (len(sep) if kept else 0)
        if used + extra <= width or not kept:
            kept.add(i)
            used += extra
    return sep.join(text for i, (_, text) in enumerate(fields) if i in kept)


# -------------------------------------------------------------------------------- output


class _NoBar:
    """A bar in a log file: nothing is drawn."""

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        pass

    def set(self, n: int, postfix: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, bar):
        self._bar = bar

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        if postfix is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(n)

    def set(self, n: int, postfix: str | None = None) -> None:
        """Shows `n` done (and `postfix`) now."""
        if postfix is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.n = n
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


class Progress:
    """Lines, phases and bars on one stream (`sys.stdout` by default)."""

    def __init__(self, stream=None, *, tty: bool | None = None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stdout
        self.tty = isatty(self.stream) if tty is None else tty
        self.enabled = enabled
        self._lock = threading.Lock()

    @property
    def width(self) -> int:
        """Columns of the terminal (one left free: a full line wraps on some terminals)."""
        return max(shutil.get_terminal_size((120, 24)).columns - 1, 20)

    def note(self, text: str) -> None:
        """One line; on a terminal above the bars, which are redrawn under it."""
        if not self.enabled:
            return
        with self._lock:
            if self.tty:
                from tqdm import tqdm

                tqdm.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def bar(self, desc: str, total: int, *, initial: int = 0, unit: str = "step"):
        """A progress bar of `total` units on a terminal (tqdm), nothing in a log file."""
        if not (self.enabled and self.tty):
            return _NoBar()
        from tqdm import tqdm

        return _Bar(tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
                         leave=False, dynamic_ncols=True, mininterval=0.5,
                         bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}"))

    @contextlib.contextmanager
    def phase(self, name: str, min_seconds: float = 3.0, done: str = "done"):
        """`name ...` once the phase has run `min_seconds`, and `name: <done> in <time>` at
        its end if it took that long; a shorter phase prints nothing. `done` may be a
        callable, read at the end (e.g. a count only known then)."""
        start = time.perf_counter()
        timer = threading.Timer(min_seconds, lambda: self.note(f"{name} ..."))
        timer.daemon = True
        timer.start()
        try:
            yield
        except BaseException:
            timer.cancel()
            if time.perf_counter() - start >= min_seconds:
                self.note(f"{name}: failed after {duration(time.perf_counter() - start)}")
            raise
        timer.cancel()
        took = time.perf_counter() - start
        if took >= min_seconds:
            said = done() if callable(done) else done
            self.note(f"{name}: {said} in {duration(took)}")
