"""Smoke tests: every benchmark's `run(small=True)` finishes and reports its figures.

No timing assertions: the machine is shared, only the shape and sanity of the output count.
"""

import math

import pytest

from rlhf_jax.benchmarks import gae, memory, mfu, ppo


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
