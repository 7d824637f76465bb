"""The persistent compilation cache's directory and thresholds, and the compile log."""

import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from tiny_run import ROOT

from rlhf_jax import compile_cache
from rlhf_jax.errors import ConfigError

# A fresh process: enable the cache at argv[1] (or "off"), compile one tiny program, print
# what the log saw.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from rlhf_jax import compile_cache
path = compile_cache.enable(None if sys.argv[1] == "-" else sys.argv[1])
with compile_cache.CompileLog() as log:
    jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
print(json.dumps({"path": str(path) if path else None,
                  "compiles": [[c.name, c.cached] for c in log.compiles]}))
"""


def _fresh_process(setting: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                                  compile_cache.ENV_DIR))}
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], env={**clean, **env},
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_program_from_the_cache(tmp_path):
    first = _fresh_process(str(tmp_path / "xla"))
    second = _fresh_process(str(tmp_path / "xla"))
    path = compile_cache.versioned(tmp_path / "xla")
    assert first["path"] == second["path"] == str(path) and any(path.iterdir())
    assert [c for c in first["compiles"] if c[0] == "<lambda>"] == [["<lambda>", False]]
    assert [c for c in second["compiles"] if c[0] == "<lambda>"] == [["<lambda>", True]]
    # the environment variable names the directory when the config does not; "off" is off
    via_env = _fresh_process("-", **{compile_cache.ENV_DIR: str(tmp_path / "xla")})
    assert via_env["path"] == str(path) and ["<lambda>", True] in via_env["compiles"]
    off = _fresh_process("off", **{compile_cache.ENV_DIR: str(tmp_path / "xla")})
    assert off["path"] is None and ["<lambda>", False] in off["compiles"]


def test_which_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(compile_cache, "_jax_dir", lambda: None)  # JAX's own: unset
    assert compile_cache.resolve_dir(None) == compile_cache.versioned(tmp_path / "xdg/rlhf_jax/xla")
    assert compile_cache.versioned("x").name == f"jax-{jax.__version__}_jaxlib-{jaxlib.__version__}"
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "env"))
    assert compile_cache.resolve_dir(None) == compile_cache.versioned(tmp_path / "env")
    assert compile_cache.resolve_dir(str(tmp_path / "cfg")) == compile_cache.versioned(
        tmp_path / "cfg")  # the config key first
    assert compile_cache.resolve_dir("OFF") is None
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="trainer.compilation_cache_dir: .* is a file"):
        compile_cache.resolve_dir(str(tmp_path / "file"))


def test_compile_log_names_programs_and_threads():
    def body(x):
        return jnp.sin(x) @ jnp.cos(x).T

    main = jax.jit(body)
    other = jax.jit(lambda x: jnp.exp(x) - 1)
    with compile_cache.CompileLog() as log:
        main(jnp.ones((3, 5))).block_until_ready()
        t = threading.Thread(target=lambda: other(jnp.ones(7)).block_until_ready())
        t.start()
        t.join()
    got = {c.name: c.background for c in log.compiles}
    assert got["body"] is False and got["<lambda>"] is True
    fig = log.figures()
    assert fig["compile.programs"] == len(log.compiles)
    assert fig["compile.seconds.body"] > 0
    assert fig["compile.blocking_seconds"] <= fig["compile.seconds"]
    assert "programs" in log.summary()
