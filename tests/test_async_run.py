"""Asynchronous training end to end (slow: whole tiny runs on 8 simulated devices): the
one-step-off mode with `max_staleness: 0` equals the synchronous trainer; the reward pool
scores while the old log-prob pass runs; a one-step-off run on the 4 + 4 split killed with
SIGKILL resumes to the metrics of an uninterrupted one."""

import threading

import pytest
from test_resume import _kill_after, _manifest, _resumed_steps
from tiny_run import (
    MACHINE,
    algorithmic,
    compare,
    steps_logged,
    tiny,
    tiny_overrides,
    train_script,
)

from rlhf_jax.trainer import Trainer

SHORT = {"trainer.total_training_steps": 3, "trainer.test_freq": 2,
         "trainer.sft_warmup.max_steps": 0}
ASYNC = {"actor_rollout_ref.hybrid_engine": False}


@pytest.mark.slow  # two tiny runs on (2,2,2): ~2 minutes on 2 cores
def test_max_staleness_0_equals_the_synchronous_trainer(tmp_path):
    sync = Trainer(tiny(tmp_path / "sync", **SHORT)).run()
    got = Trainer(tiny(tmp_path / "async", **SHORT, **ASYNC, **{
        "async_training.max_staleness": 0, "reward.num_workers": 2})).run()
    assert [m["async/staleness"] for m in got] == [0.0] * 3
    assert all(0 <= m[f"async/idle_fraction/{g}"] <= 1 for m in got for g in ("train",
                                                                            "rollout"))
    assert all(m["timing_s/gen_wait"] >= 0 and m["timing_s/sync_wait"] >= 0 for m in got)
    mine = ("async/",)
    compare(algorithmic(sync), [{k: v for k, v in m.items() if not k.startswith(mine)}
                                for m in algorithmic(got)], atol=1e-5, rel=0)


@pytest.mark.slow  # one tiny run: ~1 minute
def test_the_pool_scores_while_the_old_log_prob_pass_runs(tmp_path):
    """Each reward waits (30 s at most) for the old log-prob pass of its own step and scores
    1 if it comes: inline scoring, before that pass, would score 0."""
    trainer = Trainer(tiny(tmp_path, **{**SHORT, "reward.num_workers": 4,
                                        "trainer.test_freq": -1}))
    counts, cond = {"gen": 0, "old": 0}, threading.Condition()
    forward, generate = trainer.forward, trainer.generate

    def counted(name, *args):
        if name == "old":
            with cond:
                counts["old"] += 1
                cond.notify_all()
        return forward(name, *args)

    def generated(*args):
        counts["gen"] += 1  # the step whose samples are scored next
        return generate(*args)

    def waiting(data_source, solution_str, ground_truth, extra_info):
        with cond:
            step = counts["gen"]
            return float(cond.wait_for(lambda: counts["old"] >= step, timeout=30))

    trainer.forward, trainer.generate, trainer.reward_fn = counted, generated, waiting
    history = trainer.run()
    assert [m["critic/score/mean"] for m in history] == [1.0] * 3


# 48 rows / 16 per batch: 3 steps an epoch; checkpoints at 2, 4 and 6.
RUN = {"mesh": "cpu-8-async", "synthetic.num_train": 48, "trainer.total_training_steps": 6,
       "trainer.save_freq": 2, "trainer.test_freq": 3, "trainer.sft_warmup.max_steps": 2,
       "actor_rollout_ref.hybrid_engine": "false", "reward.num_workers": 2,
       "algorithm.rollout_correction.rollout_is": "token"}


@pytest.mark.slow  # three one-step-off training processes on the 4 + 4 split: ~8 minutes
def test_one_step_off_sigkill_and_resume_equals_uninterrupted_run(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    for d in (ref_dir, cut_dir):
        d.mkdir()
    ref = train_script(tiny_overrides(ref_dir, **RUN), cwd=ref_dir)
    assert ref.wait(timeout=1200) == 0, (ref_dir / "stdout.txt").read_text()[-3000:]
    # Killed as soon as checkpoint 2 is whole: batch 3 (and maybe 4) was in flight.
    _kill_after(train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir),
                _manifest(cut_dir / "run", 2))
    last = train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir)
    assert last.wait(timeout=1200) == 0, (cut_dir / "stdout.txt").read_text()[-3000:]
    assert _resumed_steps((cut_dir / "stdout.txt").read_text()) == [2]
    want, got = steps_logged(ref_dir / "run"), steps_logged(cut_dir / "run")
    assert sorted(want) == sorted(got) == list(range(1, 7))
    # Batch 2 on the weights of step 0, then each on those of the step before the last.
    assert [want[s]["async/staleness"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    assert want[4]["training/rollout_probs_diff_max"] > 0  # the gap the correction weighs
    for step in range(1, 7):
        a = {k: v for k, v in want[step].items() if not k.startswith((*MACHINE, "async/i"))}
        b = {k: v for k, v in got[step].items() if not k.startswith((*MACHINE, "async/i"))}
        assert a.keys() == b.keys(), step
        assert a == b, (step, {k: (a[k], b[k]) for k in a if a[k] != b[k]})
    from rlhf_jax.export import export_hf  # its checkpoints export as the others do

    assert export_hf(cut_dir / "run", tmp_path / "hf")[1] == 6
