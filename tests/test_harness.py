"""The test harness itself (`tests/conftest.py`): a pytest-xdist worker whose interpreter
cannot exit does not hold the whole run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

STUCK = """
import threading
import time


def test_leaves_a_thread_that_never_ends():
    threading.Thread(target=lambda: time.sleep(10**6), name="never-ends").start()
"""


def test_a_worker_held_by_a_thread_that_never_ends_exits_with_its_stacks(tmp_path):
    """The run reports the test and ends; the worker prints the stuck thread's stack."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_stuck.py").write_text(STUCK)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "1", "-q", "-p",
         "no:cacheprovider", "test_stuck.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "RLHF_JAX_TEST_EXIT_TIMEOUT_S": "3"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out[-2000:]
    assert 'test_stuck.py", line 7 in <lambda>' in out, out[-2000:]
