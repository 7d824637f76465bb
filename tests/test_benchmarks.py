"""Smoke tests: every benchmark's `run(small=True)` finishes and reports its figures.

No timing assertions: the machine is shared, only the shape and sanity of the output count.
"""

import importlib
import math
import re
import sys

import numpy as np
import pytest

from rlhf_jax.benchmarks import decode, gae, lora, memory, mfu, packing, ppo, reshard, rollout
from rlhf_jax.errors import UserError


def _finite(out: dict, prefix: str):
    assert out and all(k.startswith(prefix) for k in out)
    for k, v in out.items():
        if isinstance(v, float):
            assert math.isfinite(v), k


@pytest.mark.parametrize("values_in_update", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_ppo_small(values_in_update):
    out = ppo.run(small=True, values_in_update=values_in_update)
    _finite(out, "ppo.")
    for stage in ppo.STAGES:  # the critic's update makes the values, or a values pass does
        if stage == "values" and values_in_update:
            assert "ppo.stage.values" not in out
        else:
            assert out[f"ppo.stage.{stage}"] >= 0
    assert out["ppo.tokens_per_s"] > 0 and out["ppo.flop_bound_ratio"] > 0
    assert out["ppo.compiles_measured"] == 0  # every step compiled during the warm-up
    # the launch's compiles, per program and in total
    assert out["ppo.launch_to_first_step_seconds"] > 0 and out["ppo.compile.programs"] > 0
    per_program = {k: v for k, v in out.items() if k.startswith("ppo.compile.seconds.")}
    assert {"ppo.compile.seconds.actor_update", "ppo.compile.seconds.prefill"} <= set(
        per_program)
    assert sum(per_program.values()) == pytest.approx(out["ppo.compile.seconds"])
    assert 0 <= out["ppo.compile.blocking_seconds"] <= out["ppo.compile.seconds"]
    assert out["ppo.trl_tokens_per_s_reference"] == ppo.TRL_TOKENS_PER_S
    assert out["ppo.bypass.tokens_per_s"] == pytest.approx(
        4 * 16 / out["ppo.bypass.seconds_per_iteration"])


FAKE_PEER = """
import json, pathlib, sys
log = pathlib.Path(sys.argv[0]).with_name("calls.txt")
calls = log.read_text().splitlines() if log.exists() else []
log.write_text("\\n".join([*calls, " ".join(sys.argv[1:])]))
if "--check" in sys.argv:
    print(json.dumps({"trl.versions": {"trl": "fake"}}))
    sys.exit(0)
n = int(sys.argv[sys.argv.index("--iterations") + 1])
x = [1.0, 3.0][len(calls) - 1]  # this run's measured seconds: 1 in the first run, 3 in the next
seconds = [9.0] * 2 + [x] * (n - 2)
print("TRL log line")
print(json.dumps({"trl.iteration_seconds": seconds, "trl.gen_seconds": [s / 4 for s in seconds],
                  "trl.update_seconds": [s / 2 for s in seconds],
                  "trl.rollout_other_seconds": [s / 4 for s in seconds],
                  "trl.versions": {"trl": "fake"}, "trl.checks": {"reward_ok": True}}))
"""


def _fake_peer(tmp_path, monkeypatch, source=FAKE_PEER):
    script = tmp_path / "trl_ppo.py"
    script.write_text(source)
    monkeypatch.setattr(ppo, "TRL_SCRIPT", script)
    return tmp_path / "calls.txt"


def test_ppo_runs_in_turns_with_trl(tmp_path, monkeypatch):
    """One TRL run per round between this trainer's measured iterations; TRL's figures are
    medians over its measured iterations of every run, and the ratio is ours over TRL's."""
    calls = _fake_peer(tmp_path, monkeypatch)
    out = ppo.run(small=True, trl_python=sys.executable, rounds=2)
    assert calls.read_text().splitlines() == ["--check", "--iterations 3", "--iterations 3"]
    assert out["ppo.trl.runs"] == 2 and out["ppo.measured_iterations"] == 2
    assert out["ppo.trl.seconds_per_iteration"] == pytest.approx(2.0)  # median of 1 and 3
    assert out["ppo.trl.stage.update"] == pytest.approx(1.0)
    assert out["ppo.trl.stage.gen"] == pytest.approx(0.5)
    tokens = 4 * (8 + 8)
    assert out["ppo.trl.tokens_per_s"] == pytest.approx(tokens / 2.0)
    assert out["ppo.ratio_to_trl"] == pytest.approx(out["ppo.tokens_per_s"] / (tokens / 2.0))
    assert out["ppo.bypass.ratio_to_trl"] == pytest.approx(
        out["ppo.bypass.tokens_per_s"] / (tokens / 2.0))
    assert out["ppo.trl.versions"] == {"trl": "fake"}
    if "ppo.cpu_steal_fraction" in out:
        assert 0 <= out["ppo.cpu_steal_fraction"] <= 1


@pytest.mark.parametrize("source, message", [
    ("import sys; print('Traceback ...', file=sys.stderr)\n"
     "print(\"ModuleNotFoundError: No module named 'trl'\", file=sys.stderr); sys.exit(1)",
     "trl_ppo.py exited with 1: ModuleNotFoundError: No module named 'trl'"),
    ("print('not json')", "printed no JSON object"),
    ("import json; print(json.dumps({'trl.checks': {'reward_ok': False, 'shape_ok': True}}))",
     "failed the workload checks reward_ok"),
])
def test_a_broken_trl_peer_is_one_clear_error(tmp_path, monkeypatch, source, message):
    _fake_peer(tmp_path, monkeypatch, source)
    with pytest.raises(UserError, match=re.escape(message)) as exc:
        ppo.run_trl(sys.executable, "--check")
    assert str(exc.value).startswith(f"--trl-python {sys.executable}: ")
    assert "\n" not in str(exc.value)


def test_a_missing_trl_python_fails_before_any_work(tmp_path):
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(UserError, match=f"--trl-python {re.escape(missing)}: cannot run it"):
        ppo.run(trl_python=missing)


def test_workload_flops_matches_workload_md():
    from rlhf_jax.benchmarks.common import workload_model_config

    flops = ppo.workload_flops(workload_model_config(), 32, 128)
    assert 270e9 < flops < 290e9  # ~260 GFLOP of matmuls + ~9 % attention


def test_lora_shape_ratios():
    out = lora.shape_ratios()  # the 0.5B architecture, rank 8, all-linear: the targets
    assert 0 < out["lora.optimizer_bytes_ratio"] <= 0.02
    assert 0 < out["lora.sync_bytes_ratio"] <= 0.02


@pytest.mark.slow  # four compiles (two updates, two decode steps) and the merge
def test_lora_small():
    out = lora.run(small=True)
    assert 0 < out["lora.live_bytes_ratio"] < 0.6  # no optimizer state, no ref copy for the base
    for k in ("lora.step_time_ratio", "lora.apply_over_merge", "lora.merge_seconds"):
        assert np.isfinite(out[k]) and out[k] > 0, k


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


def test_rollout_small():
    out = rollout.run(small=True)
    _finite(out, "rollout.")
    assert out["rollout.cache_speedup"] > 0 and out["rollout.decode_steps"] == 7
    assert out["rollout.nocache_token_agreement"] == 1.0  # same sampling rule and keys


def test_reshard_small():
    out = reshard.run(small=True)
    _finite(out, "reshard.")
    assert out["reshard.mesh"] == "2x2x2" and out["reshard.ratio_to_copy"] > 0
    # the generate layout holds each parameter twice per fsdp pair: twice the train bytes
    assert out["reshard.bytes_written"] > 2 * out["reshard.param_bytes"]


@pytest.mark.slow  # four small trainers, two of them on 8 simulated devices: ~2 minutes
def test_async_small():
    out = importlib.import_module("rlhf_jax.benchmarks.async").run(small=True)
    _finite(out, "async.")
    assert out["async.reward_inline_seconds"] >= 4 * 0.02  # 4 samples, 20 ms each, inline
    assert out["async.reward_hidden_fraction"] <= 1 and out["async.speedup"] > 0
    assert out["async.one_step_off.staleness"] == 1.0


def test_a_failed_cpu_subprocess_is_one_line_error():
    from rlhf_jax.benchmarks.common import on_cpu_devices

    want = (r"^rlhf_jax.benchmarks.nope on 8 simulated CPU devices exited with 1: "
            r".*No module named rlhf_jax.benchmarks.nope$")
    with pytest.raises(UserError, match=want):
        on_cpu_devices("rlhf_jax.benchmarks.nope")


def _bench_script():
    """`scripts/bench.py` as a module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_script", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_script_lists_every_benchmark():
    bench = _bench_script()
    assert bench.available() == ["async", "chunked_head", "decode", "gae", "lora", "memory", "mfu",
                                 "packing", "ppo", "reshard", "rollout"]
    assert bench.main(["nope"]) == 2
    assert bench.main(["gae", "--trl-python", sys.executable]) == 2  # TRL goes with ppo only
    assert bench.main(["ppo", "--trl-python", "/no/such/python"]) == 2  # one line, no traceback
    assert bench.main(["ppo", "--scale", "0.5b", "--trl-python", sys.executable]) == 2


def test_an_unknown_scale_is_one_line_error():
    with pytest.raises(UserError, match=r"unknown scale '7b' \(known: workload, 0.5b\)"):
        decode.run(scale="7b")


def test_the_0_5b_scale_is_qwen2_5_0_5b_in_bfloat16():
    from rlhf_jax.benchmarks.common import eos_free_sampling, get_scale

    scale = get_scale("0.5b")
    cfg = scale.model_config()
    params = cfg.num_matmul_params - cfg.vocab_size * cfg.hidden_size  # tied: one table
    assert 490e6 < params < 500e6 and cfg.tie_word_embeddings
    assert scale.dtype == "bfloat16" and eos_free_sampling(cfg, 1).pad_id == cfg.vocab_size


def _bf16_scale():
    """The 0.5b scale's settings on a 2-layer model (the sizes of each benchmark's entry)."""
    from rlhf_jax.benchmarks.common import QWEN2_5_0_5B, Scale

    tiny = dict(QWEN2_5_0_5B, vocab_size=128, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    return Scale("0.5b", tiny, dtype="bfloat16", peak_n=64)


def test_decode_runs_in_the_scale_dtype():
    scale = _bf16_scale()
    out = decode.run(scale=scale, batch=2, prompt_len=8, new_tokens=4, repeats=1)
    _finite(out, "decode.")
    cfg = scale.model_config()
    # the KV cache is held in the compute dtype: [L, B, K, S, H] keys and values, 2 bytes each
    assert out["decode.cache_bytes"] == 2 * 2 * cfg.num_hidden_layers * 2 * 1 * 12 * 16
    assert out["decode.dtype"] == "bfloat16"


def test_ppo_builds_the_scale_iteration(monkeypatch):
    """`ppo.run(scale="0.5b")` builds its trainers' config from the scale (model, dtype,
    sizes)."""
    seen = []

    class Built(Exception):
        pass

    def record(cfg):
        seen.append(cfg)
        raise Built

    monkeypatch.setattr(ppo, "Run", record)
    with pytest.raises(Built):
        ppo.run(scale="0.5b")
    cfg = seen[0]
    model = cfg.actor_rollout_ref.model
    assert model.compute_dtype == "bfloat16" and model.override_config["vocab_size"] == 151936
    d = cfg.data
    assert (d.train_batch_size, d.max_prompt_length, d.max_response_length) == (64, 128, 128)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_device == 16


def test_ppo_workload_config_is_workload_md(tmp_path):
    """`ppo_workload.yaml` on the benchmark's files: WORKLOAD.md's settings, and a tokenizer
    whose decoded ids give `even_fraction` its reward, with EOS one past the vocabulary."""
    from rlhf_jax.benchmarks.common import workload_prompts
    from rlhf_jax.rewards import load_custom_reward_fn
    from rlhf_jax.tokenizer import load_tokenizer

    cfg = ppo.workload_config(tmp_path, workload_prompts(1))
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    assert cfg.mesh.preset == "single" and arr.model.compute_dtype == "float32"
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length,
            cfg.data.max_response_length) == (32, 64, 64)
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_device) == (32, 8)
    assert (alg.gamma, alg.lam, alg.kl_ctrl.type, alg.kl_ctrl.kl_coef) == (1.0, 0.95, "fixed",
                                                                           0.001)
    assert (arr.actor.optim.lr, cfg.critic.optim.lr) == (1e-6, 1e-5)
    assert arr.actor.optim.weight_decay == cfg.critic.optim.weight_decay == 0.0
    tok = load_tokenizer(arr.model.path)
    assert tok.vocab_size == 1024 and tok.eos_token_ids == (1024,) and tok.pad_token_id == 1024
    fn = load_custom_reward_fn(cfg.reward.custom_reward_function.path,
                               cfg.reward.custom_reward_function.name)
    text = tok.decode([2, 7, 1000, 9])
    assert fn(data_source="", solution_str=text, ground_truth="", extra_info={}) == 0.5


def test_a_failed_benchmark_is_one_line_and_the_others_still_print(monkeypatch, capsys):
    import json

    bench = _bench_script()

    def broken(**kw):
        raise UserError("rlhf_jax.benchmarks.memory on 8 simulated CPU devices was killed by "
                        "signal 9: (no output)")

    monkeypatch.setattr(memory, "run", broken)
    monkeypatch.setattr(gae, "run", lambda **kw: {"gae.speedup": 21.0, "gae.scale": kw["scale"]})
    assert bench.main(["memory", "gae"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "error: memory: rlhf_jax.benchmarks.memory on 8 simulated CPU devices was killed by "
        "signal 9: (no output)"]
    figures = json.loads(out)
    assert figures["gae.speedup"] == 21.0 and figures["gae.scale"] == "workload"
    assert figures["failed"] == ["memory"] and "memory.wall_seconds" not in figures


@pytest.mark.slow  # two trainers compiled: ~35 s of CPU
def test_packing_small():
    """Workload 2 shrunk: both paths run, the packed one with verl's packing keys, and every
    rollout stopped at the forced lengths (`TrainerPath.step` checks them, and the losses)."""
    out = packing.run(small=True)
    _finite(out, "packing.")
    # the rollout key reaches the trainer's engine: 4 slots halve as responses finish
    assert out["packing.packed.compactions"] >= 1 and out["packing.padded.compactions"] >= 1
    for path in packing.PATHS:
        for part in ("seconds_per_iteration", "gen_seconds", "passes_seconds",
                     "update_seconds"):
            assert out[f"packing.{path}.{part}"] > 0
    assert out["packing.tokens_per_s"] == pytest.approx(
        out["packing.real_tokens_per_iteration"] / out["packing.packed.seconds_per_iteration"])
    assert out["packing.speedup"] == pytest.approx(
        out["packing.tokens_per_s"] / out["packing.padded_tokens_per_s"])
    assert out["packing.flop_bound_ratio"] > 0 and out["packing.padded_tokens_per_iteration"] == 64
    assert out["packing.compiles_after_warmup"] == 0  # every shape fixed by the warm-up


def test_packing_figures_from_both_paths_in_turns():
    """`packing._measure` on two fake paths: the order swaps every measured iteration, the
    figures are medians of the measured ones, tokens count real tokens only."""
    import types

    from rlhf_jax.benchmarks.common import Scale, workload_model_config

    calls = []

    class Fake:
        def __init__(self, name, seconds):
            self.name, self.seconds, self.decode_steps, self.compactions = name, seconds, [], []
            data = types.SimpleNamespace(train_batch_size=2, max_prompt_length=4,
                                         max_response_length=8)
            self.trainer = types.SimpleNamespace(actor_model=types.SimpleNamespace(
                cfg=workload_model_config()), cfg=types.SimpleNamespace(data=data))

        def step(self, k, lengths):
            calls.append((self.name, k, tuple(lengths)))
            self.decode_steps.append(float(max(lengths)))
            self.compactions.append(2.0)
            t = self.seconds * (k + 1)
            return {"gen": t / 2, "old_log_prob": t / 8, "ref": t / 8, "update_critic": t / 8,
                    "update_actor": t / 8, "step": t}

    prompt = np.array([[2, 3], [4, 1], [1, 1], [3, 3]])
    response = np.array([[5, 6], [7, 8], [2, 2], [1, 4]])
    paths = {"padded": Fake("padded", 3.0), "packed": Fake("packed", 1.0)}
    out = packing._measure(paths, response, prompt, 1, 3, Scale("workload", peak_n=64), True)
    assert [c[:2] for c in calls] == [("padded", 0), ("packed", 0), ("padded", 1), ("packed", 1),
                                      ("packed", 2), ("padded", 2), ("padded", 3), ("packed", 3)]
    assert calls[2][2] == (7, 8)  # iteration k's forced lengths
    tokens = ((4 + 1 + 7 + 8) + (1 + 1 + 2 + 2) + (3 + 3 + 1 + 4)) / 3  # iterations 1..3
    assert out["packing.real_tokens_per_iteration"] == pytest.approx(tokens)
    assert out["packing.padded_tokens_per_iteration"] == 24
    assert out["packing.packed.seconds_per_iteration"] == pytest.approx(3.0)  # median of 2, 3, 4
    assert out["packing.padded.update_seconds"] == pytest.approx(9.0 / 4)
    assert out["packing.packed.passes_seconds"] == pytest.approx(3.0 / 4)
    assert out["packing.packed.gen_ms_per_decode_step"] == pytest.approx(1e3 * 1.5 / 4)
    assert out["packing.speedup"] == pytest.approx(3.0)
    assert out["packing.tokens_per_s"] == pytest.approx(tokens / 3.0)
    assert out["packing.compiles_after_warmup"] == 0 and out["packing.measured_iterations"] == 3


def test_packing_workload_is_workload_md(tmp_path):
    """WORKLOAD.md's workload 2: prompts of 16..128 tokens, responses lognormal (median 96,
    mean ~130) in 8..512, a config of 128 + 512 tokens; the packed path's keys are verl's."""
    from rlhf_jax.benchmarks.common import workload_prompts
    from rlhf_jax.data import PromptDataset, PromptLoader
    from rlhf_jax.tokenizer import load_tokenizer

    sizes = packing.SIZES["workload"]
    p, r = packing.workload_lengths(7, **sizes)
    assert p.shape == r.shape == (7, 32) and p.min() >= 16 and p.max() <= 128
    assert r.min() >= 8 and r.max() <= 512 and 110 < r.mean() < 150
    ids = workload_prompts(7, 32, 128)
    cfg = packing.workload_config(tmp_path, ids, p, response_len=512, micro_batch=8,
                                  overrides=packing.packed_overrides(1024))
    d, arr = cfg.data, cfg.actor_rollout_ref
    assert (d.train_batch_size, d.max_prompt_length, d.max_response_length) == (32, 128, 512)
    assert arr.model.use_remove_padding and cfg.critic.model.use_remove_padding
    assert arr.actor.use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    assert arr.actor.ppo_max_token_len_per_gpu == cfg.critic.forward_max_token_len_per_gpu == 1024
    tok = load_tokenizer(arr.model.path)
    assert tok.eos_token_ids == (1024,) and tok.pad_token_id == 0  # pad in the table
    rows = PromptDataset(list(d.train_files), tok, max_prompt_length=128)
    batch = PromptLoader(rows, 32, shuffle=False).batch_at(0, 0)
    assert (batch.attention_mask.sum(-1) == p[0]).all()  # left-padded to 128, batch k = row k
    assert (batch.input_ids[0, -p[0, 0]:] == ids[0, 0, :p[0, 0]]).all()


def test_forced_lengths_stop_each_request_there():
    """The benchmark's forced EOS: `generate_sequences(max_lengths=...)` stops request i after
    exactly max_lengths[i] tokens, its tokens and log-probs those of the unlimited rollout
    (same keys), with slots refilled from a queue (3 slots, 8 requests)."""
    import jax

    from rlhf_jax.errors import DataError
    from rlhf_jax.mesh import load_mesh_spec, make_mesh
    from rlhf_jax.models import Model, ModelConfig
    from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    spec = load_mesh_spec("single")
    mesh, model = make_mesh(spec), Model(cfg)
    engine = Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=3,
                    max_prefill_length=4, max_decode_length=6, prefill_buckets=[4],
                    compiler_options={"xla_backend_optimization_level": 0})
    params = engine.load_params(rng=jax.random.key(0))
    ids = np.arange(16, dtype=np.int32).reshape(4, 4) % 29 + 3
    mask = np.ones_like(ids)
    sampling = SamplingParams(max_response_length=6, eos_ids=(32,), pad_id=0)
    full = generate_sequences(engine, params, ids, mask, n=2, sampling=sampling, rng=5)
    limits = np.array([1, 6, 2, 5, 3, 4, 6, 1])
    cut = generate_sequences(engine, params, ids, mask, n=2, sampling=sampling, rng=5,
                             max_lengths=limits)
    assert (full.response_lengths == 6).all() and (cut.response_lengths == limits).all()
    keep = np.arange(6)[None] < limits[:, None]
    assert (cut.response_mask == keep).all()
    assert (cut.responses == np.where(keep, full.responses, 0)).all()
    np.testing.assert_allclose(cut.rollout_log_probs, np.where(keep, full.rollout_log_probs, 0))
    with pytest.raises(DataError, match=r"max_lengths must be 8 \(B\*n\) response lengths in "
                                        r"\[1, 6\], got shape \(8,\)"):
        generate_sequences(engine, params, ids, mask, n=2, sampling=sampling,
                           max_lengths=limits + 1)


def test_all_runs_the_short_forms_and_a_named_benchmark_runs_in_full(monkeypatch, capsys):
    """`all` passes each module's `ALL_KW` (its 10 minutes); a benchmark named alone gets
    none of them."""
    from rlhf_jax.benchmarks import chunked_head

    bench = _bench_script()
    calls = {}
    monkeypatch.setattr(bench, "available", lambda: ["chunked_head", "gae"])
    for module in (chunked_head, gae):
        name = module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, "run", lambda name=name, **kw: calls.setdefault(name, kw)
                            and {})
    assert bench.main(["all"]) == 0
    assert calls == {"chunked_head": {"time_rows": 1, "repeats": 1, "warmup": 0,
                                      "scale": "workload"}, "gae": {"scale": "workload"}}
    calls.clear()
    assert bench.main(["chunked_head"]) == 0
    assert calls == {"chunked_head": {"scale": "workload"}}
    capsys.readouterr()
