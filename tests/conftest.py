"""Every test runs on CPU with 8 simulated host devices, so sharded paths use a real mesh.

`RLHF_JAX_TEST_PLATFORM=cuda` (or `tpu`) runs them on that backend's devices instead, for a
check on an accelerator machine: matmuls at full float32 precision, as on CPU, and a test whose
mesh needs more devices than the machine has is reported as skipped, with the count.
"""

import os
import re

import pytest

PLATFORM = os.environ.get("RLHF_JAX_TEST_PLATFORM", "cpu")
if PLATFORM == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _flag = "--xla_force_host_platform_device_count=8"
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
else:
    os.environ["JAX_PLATFORMS"] = PLATFORM
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One XLA compilation cache for the whole test run (subprocesses inherit it through the
# environment): the many tiny trainers of the end-to-end tests compile the same programs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="rlhf_jax_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


_TOO_FEW_DEVICES = re.compile(r"needs \d+ devices but \d+ (are|is) available")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Off CPU: a test whose mesh needs more devices than this machine has is a skip."""
    outcome = yield
    report = outcome.get_result()
    if PLATFORM == "cpu" or call.excinfo is None:
        return
    message = str(call.excinfo.value)
    if _TOO_FEW_DEVICES.search(message):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"{PLATFORM}: {message.splitlines()[0]}")


def pytest_sessionfinish(session):
    """In a pytest-xdist worker, after its last test: should the process still run
    `RLHF_JAX_TEST_EXIT_TIMEOUT_S` seconds later (default 300; a thread that never ends holds
    the interpreter's exit, and the whole run waits for the worker), print every thread's
    stack and exit 1."""
    if hasattr(session.config, "workerinput"):
        import faulthandler

        faulthandler.dump_traceback_later(
            float(os.environ.get("RLHF_JAX_TEST_EXIT_TIMEOUT_S", "300")), exit=True)
