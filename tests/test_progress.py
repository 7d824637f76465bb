"""The console's progress: the ETA as a pure function, plain lines in a log file, and on a
real pseudo-terminal step lines fitted to its width without cutting a figure."""

import io
import os
import re
import select
import subprocess
import sys
import time

import pytest

from rlhf_jax.progress import Progress, due_count, eta_seconds, fit_fields
from rlhf_jax.trackers import ConsoleTracker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = {"critic/score/mean": 0.25, "actor/reward_kl_penalty": 0.0123, "actor/ppo_kl": 0.001,
        "critic/vf_loss": 0.3, "actor/pg_loss": -0.5, "perf/throughput": 1234.5,
        "val-core/synthetic/addition/reward/mean@1": 0.875}
KEY = ("step 3/60", "score 0.25", "pg_loss -0.5", "tok/s 1234")


def test_eta_is_steady_state_steps_plus_the_phases_still_due():
    assert eta_seconds([], 10) is None  # only the first step (compiling) measured: no ETA
    assert eta_seconds([], 0) == 0.0
    assert eta_seconds([1.0, 3.0], 10) == pytest.approx(20.0)
    # 4 validations of 5 s (two measured: 4 and 6) and 2 saves of 1 s still due
    assert eta_seconds([2.0], 10, [([4.0, 6.0], 4), ([1.0], 2), ([], 3)]) == \
        pytest.approx(20 + 20 + 2)
    # test_freq 10 of 60 steps after step 3: 10, 20, ..., 60; 55 steps: 10..50 and the end
    assert due_count(3, 60, 10) == 6 and due_count(3, 55, 10) == 6
    assert due_count(3, 55, 10, at_end=False) == 5
    assert due_count(60, 60, 10) == 0 and due_count(3, 60, 0) == 0 and due_count(3, 60, -1) == 0


def test_console_eta_leaves_out_the_first_step_and_the_validations(monkeypatch):
    clock = iter([160.0, 162.0, 169.0, 171.0])  # when each step is logged
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    t = ConsoleTracker(10, io.StringIO(), test_freq=3, save_freq=0)
    t.log({"critic/score/mean": 0.1}, 1)
    assert t.eta(1) is None
    t.log({"critic/score/mean": 0.1}, 2)  # 160 -> 162: a 2 s step
    assert t.eta(2) == pytest.approx(8 * 2.0)
    assert "step 2/10 | eta 16.0s |" in t.progress.stream.getvalue()  # tenths below a minute
    t.log({"critic/score/mean": 0.1, "timing_s/testing": 5.0}, 3)  # 7 s, 5 of them validating
    # 7 steps of 2 s; validations at 6, 9 and the end (10), 5 s each
    assert t.eta(3) == pytest.approx(7 * 2.0 + 3 * 5.0)
    t.log({"critic/score/mean": 0.1}, 2)  # a rollback: no interval across it
    assert t.step_seconds == [2.0, 2.0]


def test_plain_lines_in_a_log_file():
    out = io.StringIO()
    t = ConsoleTracker(60, out)
    t.log({"val-core/synthetic/addition/reward/mean@1": 0.5, "timing_s/testing": 1.0}, 0)
    for step in (1, 2, 3):
        t.log(STEP, step)
    p = Progress(out)
    with p.phase("saving", min_seconds=0.0):
        pass
    p.bar("validating", 4).update(1)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == "validation at step 0 | val-core/synthetic/addition/reward/mean@1 0.5"
    assert lines[1].startswith("step 1/60 | eta - | score 0.25")
    assert lines[3].startswith("step 3/60 | eta ") and lines[3].endswith(
        "| val-core/synthetic/addition/reward/mean@1 0.875")  # complete, whatever the width
    assert lines[4:] == ["saving ...", "saving: done in 0.0s"]


def test_fit_fields_leaves_out_whole_fields_by_priority():
    fields = [(0, "step 3/60"), (1, "eta 1m02s"), (6, "ppo_kl 0.001"), (3, "pg_loss -0.5")]
    assert fit_fields(fields, 200) == "step 3/60 | eta 1m02s | ppo_kl 0.001 | pg_loss -0.5"
    assert fit_fields(fields, 36) == "step 3/60 | eta 1m02s | pg_loss -0.5"
    assert fit_fields(fields, 5) == "step 3/60"


SCRIPT = """
import time
from rlhf_jax.trackers import ConsoleTracker
step = {step!r}
t = ConsoleTracker(60, test_freq=10)
for i in (1, 2, 3):
    t.log(step, i)
    time.sleep(0.05)
t.close()
print("END")
"""


def _visible_lines(raw: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return, with
    the escape sequences (tqdm's cursor moves, line clears) taken out."""
    out = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        line = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line)
        out.append(line.split("\r")[-1])
    return out


@pytest.mark.parametrize("columns", [72, 200])
def test_on_a_terminal_key_figures_are_never_cut(columns):
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {**os.environ, "PYTHONPATH": ROOT, "COLUMNS": str(columns)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(step=STEP)], stdin=child,
                            stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    raw, deadline = b"", time.time() + 60
    while time.time() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            if not chunk:
                break
            raw += chunk
        elif proc.poll() is not None:
            break
    proc.wait(10)
    os.close(main)
    text = raw.decode()
    assert "END" in text, text
    lines = [ln for ln in _visible_lines(text) if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in lines] == ["step 1/60", "step 2/60", "step 3/60"]
    for line in lines:
        assert len(line) < columns, line
    for key in KEY:
        assert key in lines[-1], (key, lines[-1])
    assert "eta " in lines[-1]
    if columns >= 200:  # a wide terminal shows everything
        assert "val-core/synthetic/addition/reward/mean@1 0.875" in lines[-1]
    assert "training" in text  # tqdm's bar was drawn
