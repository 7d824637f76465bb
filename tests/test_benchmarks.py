"""Smoke tests: every benchmark's `run(small=True)` finishes and reports its figures.

No timing assertions: the machine is shared, only the shape and sanity of the output count.
"""

import math

import pytest

from rlhf_jax.benchmarks import decode, gae, memory, mfu, ppo, reshard


def _finite(out: dict, prefix: str):
    assert out and all(k.startswith(prefix) for k in out)
    for k, v in out.items():
        if isinstance(v, float):
            assert math.isfinite(v), k


def test_ppo_small():
    out = ppo.run(small=True)
    _finite(out, "ppo.")
    for stage in ppo.STAGES:
        assert out[f"ppo.stage.{stage}"] >= 0
    assert out["ppo.tokens_per_s"] > 0 and out["ppo.flop_bound_ratio"] > 0
    assert out["ppo.compiles_measured"] == 0  # every step compiled during the warm-up
    assert out["ppo.trl_tokens_per_s_reference"] == ppo.TRL_TOKENS_PER_S


def test_workload_flops_matches_workload_md():
    from rlhf_jax.benchmarks.common import workload_model_config

    flops = ppo.workload_flops(workload_model_config(), 32, 128)
    assert 270e9 < flops < 290e9  # ~260 GFLOP of matmuls + ~9 % attention


def test_gae_small():
    out = gae.run(small=True)
    _finite(out, "gae.")
    assert out["gae.max_abs_diff"] < 1e-4 and out["gae.speedup"] > 0


def test_mfu_small():
    out = mfu.run(small=True)
    _finite(out, "mfu.")
    assert 0 < out["mfu.ratio"] and out["mfu.micro_batches"] == 2


def test_memory_small():
    out = memory.run(small=True)
    _finite(out, "memory.")
    assert out["memory.mesh"] == "2x2x2"
    assert out["memory.params_ratio_to_ideal"] == pytest.approx(1.0, abs=0.1)
    assert out["memory.opt_state_ratio_to_ideal"] == pytest.approx(1.0, abs=0.1)
    assert out["memory.ratio_to_ideal"] == pytest.approx(1.0, abs=0.1)
    assert out["memory.opt_state_replicated_ratio_to_ideal"] > 3  # what init_state avoids


def test_decode_small():
    out = decode.run(small=True)
    _finite(out, "decode.")
    assert out["decode.tokens_per_s"] > 0 and out["decode.ratio_to_bound"] > 0
    assert out["decode.copy_bytes"] == out["decode.param_bytes"] + out["decode.cache_bytes"]


def test_reshard_small():
    out = reshard.run(small=True)
    _finite(out, "reshard.")
    assert out["reshard.mesh"] == "2x2x2" and out["reshard.ratio_to_copy"] > 0
    # the generate layout holds each parameter twice per fsdp pair: twice the train bytes
    assert out["reshard.bytes_written"] > 2 * out["reshard.param_bytes"]


def test_bench_script_lists_every_benchmark():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_script", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.available() == ["decode", "gae", "memory", "mfu", "ppo", "reshard", "rollout"]
    assert bench.main(["nope"]) == 2
