"""Ahead-of-time compiles in a background thread: the engine's and the trainer's programs are
compiled once, off the main thread, and the results do not change."""

import threading

import jax
import numpy as np
import pytest
from tiny_run import algorithmic, compare, tiny

from rlhf_jax import precompile
from rlhf_jax.compile_cache import CompileLog
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.precompile import Precompile
from rlhf_jax.rollout import Engine, SamplingParams, driver, generate_sequences
from rlhf_jax.trainer import Trainer

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
SAMPLED = SamplingParams(temperature=0.9, max_response_length=5, eos_ids=(3,), pad_id=0)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
ENGINE_PROGRAMS = {"init", "prefill", "insert", "generate"}


def _engine(mesh, spec, slots=8):
    return Engine(Model(CFG).with_layout(mesh, spec.generate_rules), mesh, spec.generate_rules,
                  max_concurrent_decodes=slots, max_prefill_length=8, max_decode_length=5,
                  compiler_options=FAST_COMPILE)


def test_first_programs_follow_the_driver():
    mesh, spec = make_mesh(load_mesh_spec("single")), load_mesh_spec("single")
    engine = _engine(mesh, spec, slots=8)
    # 2 prompts x 4 samples fill the 8 slots: one prefill of 2, one decode to the end.
    assert driver.first_programs(engine, 2, 4) == ([2], [16])
    # 5 prompts x 4 samples: 2 prompts fill the slots, the rest wait (16-step calls).
    assert driver.first_programs(engine, 5, 4) == ([2], [16])
    assert driver.first_programs(engine, 5, 4, steps_per_call=2) == ([2], [2, 5])
    # 8 slots, 1 sample, at most 3 prompts a prefill: batches of 3 and 2.
    assert driver.first_programs(engine, 5, 1, max_prefill_batch=3) == ([2, 3], [16])
    assert driver.default_prefill_batch(512, 4, 8) == 128  # short prompts: all in one call
    assert driver.default_prefill_batch(512, 1, 512) == 16  # long ones: 16 at a time
    assert driver.default_prefill_batch(8, 16, 8) == 1


def test_engine_precompile_in_a_thread_is_used_and_changes_nothing():
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    model = Model(CFG)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.3).astype(s.dtype),
                        model.abstract_params())
    ids = rng.integers(4, CFG.vocab_size, (4, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # one shorter, left-padded prompt

    def rollout(engine):
        params = jax.device_put(host, engine.param_shardings)
        return params, lambda: generate_sequences(engine, params, ids, mask, n=2,
                                                  sampling=SAMPLED, rng=7)

    plain = rollout(_engine(mesh, spec))[1]()
    outs = []
    for race in (False, True):
        engine = _engine(mesh, spec)
        params, run = rollout(engine)
        with CompileLog() as log:
            thread = threading.Thread(target=driver.precompile, args=(engine, params),
                                      kwargs=dict(num_prompts=4, prompt_length=6, n=2,
                                                  sampling=SAMPLED))
            thread.start()
            if not race:
                thread.join()
            outs.append(run())  # racing: waits for a program the thread is compiling
            thread.join()
            outs.append(run())
        compiled = [c for c in log.compiles if c.name in ENGINE_PROGRAMS]
        # each exactly once, whoever got there first
        assert sorted(c.name for c in compiled) == sorted(ENGINE_PROGRAMS)
        assert all(v == 1 for v in engine.trace_counts.values()), engine.trace_counts
        if not race:
            assert all(c.background for c in compiled)
    for out in outs:
        np.testing.assert_array_equal(out.responses, plain.responses)
        np.testing.assert_array_equal(out.rollout_log_probs, plain.rollout_log_probs)

KW = {"trainer.sft_warmup.enable": False, "trainer.total_training_steps": 1,
      "trainer.test_freq": -1, "mesh": "single",
      "actor_rollout_ref.rollout.max_concurrent_decodes": 64}  # one fill: no refills


def _one_step(path):
    trainer = Trainer(tiny(path, "grpo_tiny_cpu.yaml", **KW))
    with CompileLog() as log:
        trainer.precompile.join()
        _, metrics = trainer.step(trainer.train_loader.batch_at(0, 0),
                                  trainer.state._replace(step=1))
    return trainer, log, metrics


def test_trainer_compiles_its_step_in_the_background(tmp_path):
    trainer, log, _ = _one_step(tmp_path)
    assert not trainer.precompile.errors, trainer.precompile.errors
    assert trainer.precompile.compiled == ["rollout/step", "log_probs", "actor_update"]
    names = {c.name for c in log.compiles if not c.background}
    assert not names & {"actor_update", "log_probs_step", "prefill", "insert", "generate"}, names


@pytest.mark.slow
def test_trainer_step_is_the_same_without_precompile(tmp_path, monkeypatch):
    _, _, metrics = _one_step(tmp_path / "a")
    monkeypatch.setenv("RLHF_JAX_PRECOMPILE", "0")
    off, _, reference = _one_step(tmp_path / "b")
    assert off.precompile.compiled == []
    compare(algorithmic([metrics]), algorithmic([reference]), atol=0.0, rel=0.0)


def test_off_with_several_processes(monkeypatch):
    """Several processes compile on first use: the background thread's argument transfers
    would be cross-process collectives interleaved with the main thread's (the 2-host slow
    tests in test_distributed.py died in gloo before this)."""
    monkeypatch.delenv("RLHF_JAX_PRECOMPILE", raising=False)
    assert precompile.enabled()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not precompile.enabled()


def test_the_first_step_waits_for_its_own_programs_only():
    """`wait` returns once the jobs the first step needs have ended; a later one (a
    validation's rollout) goes on compiling in the background, and `join` waits for it."""
    from rlhf_jax.progress import Progress

    release, order = threading.Event(), []
    jobs = [("a", lambda: order.append("a")), ("b", lambda: order.append("b")),
            ("later", lambda: (release.wait(30), order.append("later")))]
    pre = Precompile(jobs, first_step=2)
    pre.thread.start()
    pre.wait(Progress(enabled=False))
    assert order == ["a", "b"] and pre.thread.is_alive()
    release.set()
    assert pre.join().compiled == ["a", "b", "later"]
    # by default every job comes before the first step
    everything = Precompile([("a", lambda: release.wait(0.2)), ("b", lambda: None)])
    everything.thread.start()
    everything.wait(Progress(enabled=False))
    assert everything.compiled == ["a", "b"]


@pytest.mark.parametrize("before", [False, True])
def test_validation_compiles_after_the_step_unless_it_runs_first(tmp_path, monkeypatch, before):
    monkeypatch.setenv("RLHF_JAX_PRECOMPILE", "0")  # the jobs are listed, none runs
    trainer = Trainer(tiny(tmp_path, "grpo_tiny_cpu.yaml", **{
        **KW, "trainer.test_freq": 5, "trainer.val_before_train": before}))
    first, later = precompile._rollout_jobs(trainer)
    names = ([n for n, _ in first], [n for n, _ in later])
    assert names == ((["rollout/validate", "rollout/step"], []) if before
                     else (["rollout/step"], ["rollout/validate"]))
