"""Automatic rollback: injected faults restore the last good checkpoint, lower the learning
rates, log `training/rollbacks`, and the run finishes; too many rollbacks stop it."""

import contextlib
import math

import jax
import jax.numpy as jnp
import pytest
from tiny_run import jsonl_rows, tiny

from rlhf_jax.rollback import RollbackLimit, RollbackWatch
from rlhf_jax.trainer import Trainer

RUN = {"mesh": "single", "trainer.total_training_steps": 6, "trainer.save_freq": 2,
       "trainer.test_freq": -1, "trainer.rollback.max_kl": 5.0,
       "trainer.rollback.max_rollbacks": 3}


def _faults(plan):
    """A fault hook: at step s (first visit only) apply plan[s](trainer, metrics)."""
    done = set()

    def hook(trainer, metrics):
        step = trainer.global_step
        if step in plan and step not in done:
            done.add(step)
            plan[step](trainer, metrics)
        return metrics

    return hook


def nan_params(trainer, metrics):
    """A real blow-up: the actor's parameters and its loss become NaN."""
    trainer.actor = trainer.actor._replace(
        params=jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), trainer.actor.params))
    metrics["actor/pg_loss"] = math.nan


def kl_spike(trainer, metrics):
    metrics["actor/reward_kl_penalty"] = 7.0


def vf_spike(trainer, metrics):
    metrics["critic/vf_loss"] = 100.0


def test_each_trigger_rolls_back_lowers_lr_and_the_run_finishes(tmp_path):
    trainer = Trainer(tiny(tmp_path, **RUN))
    trainer.fault_hook = _faults({3: nan_params, 4: kl_spike, 6: vf_spike})
    history = trainer.run()
    assert all(m["critic/vf_loss"] > 0 for m in history[:2])  # the run has a signal
    events = [r for r in jsonl_rows(tmp_path / "run") if r.get("event") == "training/rollbacks"]
    assert [(e["failed_step"], e["restored_step"]) for e in events] == [(3, 2), (4, 2), (6, 4)]
    assert "non-finite actor/pg_loss" in events[0]["cause"]
    assert "actor/reward_kl_penalty 7 > max_kl 5" in events[1]["cause"]
    assert "critic/vf_loss 100 > " in events[2]["cause"] and "median" in events[2]["cause"]
    assert [e["lr_scale"] for e in events] == [0.5, 0.25, 0.125]
    assert trainer.global_step == 6 and trainer.rollbacks == 3
    last = history[-1]
    assert math.isfinite(last["actor/pg_loss"])  # the NaN parameters were replaced
    assert last["actor/lr"] == pytest.approx(0.125 * trainer.actor_optim.lr, rel=1e-5)
    assert float(trainer.critic.lr_scale) == 0.125
    # The checkpoint of the last step is good and holds the lowered learning rate.
    assert trainer.checkpointer.all_steps()[-1] == 6


def test_too_many_rollbacks_stop_with_a_clear_message(tmp_path):
    trainer = Trainer(tiny(tmp_path, **{**RUN, "trainer.rollback.max_rollbacks": 1}))
    trainer.fault_hook = _faults({2: kl_spike, 3: kl_spike})
    with pytest.raises(RollbackLimit, match=r"step 3: actor/reward_kl_penalty 7 > max_kl 5; "
                                            r"stopping after trainer.rollback.max_rollbacks=1"):
        trainer.run()


def test_watch_checks_and_state_round_trip():
    watch = RollbackWatch(max_kl=0.1, value_loss_spike=2.0, value_loss_floor=0.1,
                          value_loss_mads=6.0, window=4, warmup=2)
    assert watch.cause({"actor/kl_loss": 0.05, "critic/vf_loss": 10.0}) is None  # warming up
    for vf in (1.0, 1.2):
        watch.observe({"critic/vf_loss": vf})
    # median 1.1, MAD 0.1: the bound is max(2 x 1.1, 1.1 + 6 x 1.4826 x 0.1) = 2.2
    assert watch.cause({"critic/vf_loss": 2.19}) is None
    assert "critic/vf_loss 2.21 > 2.2 " in watch.cause({"critic/vf_loss": 2.21})
    assert "non-finite critic/grad_norm" in watch.cause({"critic/grad_norm": math.inf})
    assert "actor/kl_loss 0.2 > max_kl 0.1" in watch.cause({"actor/kl_loss": 0.2})
    for vf in (1.0, 1.0, 1.0, 1.0, 1.0):  # the window keeps the last 4
        watch.observe({"critic/vf_loss": vf})
    assert watch.vf_window == [1.0] * 4
    other = RollbackWatch(max_kl=0.1, value_loss_spike=2.0, window=4, warmup=2)
    other.load(watch.state())
    assert other.vf_window == watch.vf_window


def test_tiny_value_losses_never_spike_below_the_floor():
    """The issue's case: a weak warm start's vf_loss 0.0018 against a history near 0.0005 is
    10 MADs out and 4x the median, yet far below the floor: no rollback."""
    watch = RollbackWatch(max_kl=0.1, value_loss_spike=2.0)
    for vf in (0.0004, 0.0005, 0.00048, 0.0005, 0.00047):
        watch.observe({"critic/vf_loss": vf})
    assert watch.cause({"critic/vf_loss": 0.001845}) is None
    assert watch.cause({"critic/vf_loss": 0.09}) is None
    assert "critic/vf_loss 0.5 >" in watch.cause({"critic/vf_loss": 0.5})


def test_one_odd_step_in_the_window_does_not_mask_the_next_spike():
    """A running mean drags after one large good step; the median does not."""
    watch = RollbackWatch(max_kl=0.1, value_loss_spike=2.0, value_loss_floor=0.1)
    for vf in (0.2, 0.21, 0.19, 0.2, 0.9, 0.2, 0.21):
        watch.observe({"critic/vf_loss": vf})
    assert watch.cause({"critic/vf_loss": 0.35}) is None  # noise: 1.75x the median
    assert watch.cause({"critic/vf_loss": 0.45}) is not None


HEALTHY = {"mesh": "single", "trainer.total_training_steps": 8, "trainer.save_freq": 1,
           "trainer.test_freq": -1}  # ppo_tiny_cpu's rollback keys, the defaults otherwise


def _rollbacks(run_dir):
    return [r for r in jsonl_rows(run_dir) if r.get("event") == "training/rollbacks"]


@pytest.mark.slow
def test_a_healthy_run_with_a_tiny_value_loss_never_rolls_back(tmp_path):
    """Also logs 3 validation generations each validation (trainer.log_val_generations)."""
    history = Trainer(tiny(tmp_path, **{**HEALTHY, "trainer.test_freq": 4,
                                        "trainer.log_val_generations": 3})).run()
    assert len(history) == 8 and not _rollbacks(tmp_path / "run")
    vf = [m["critic/vf_loss"] for m in history]
    assert max(vf) < 0.1 and max(vf) > 1.5 * min(vf)  # tiny and noisy: no fault
    gens = [r for r in jsonl_rows(tmp_path / "run") if r.get("event") == "val/generations"]
    assert [g["training/global_step"] for g in gens] == [4, 8]
    assert [len(g["samples"]) for g in gens] == [3, 3]
    assert [s["input"] for s in gens[0]["samples"]] == [s["input"] for s in gens[1]["samples"]]
    assert all(s["input"].endswith("=") and isinstance(s["score"], float)
               for g in gens for s in g["samples"])


@pytest.mark.slow
def test_a_learning_rate_blow_up_rolls_back_within_two_steps(tmp_path):
    """The README's high-lr blow-up (actor lr far too high for 8 updates a step): step 2's
    updates wreck the policy, whose KL to the reference step 3's rollout shows. The
    rollback restores step 1 (step 2's checkpoint holds the wrecked policy)."""
    cfg = tiny(tmp_path, **{**HEALTHY, "actor_rollout_ref.actor.optim.lr": 1e-1,
                            "actor_rollout_ref.actor.ppo_epochs": 4,
                            "trainer.rollback.max_rollbacks": 1})
    trainer = Trainer(cfg)
    with contextlib.suppress(RollbackLimit):
        trainer.run()
    first = _rollbacks(tmp_path / "run")[0]
    assert first["failed_step"] <= 3 and first["restored_step"] == first["failed_step"] - 2
    assert "actor/reward_kl_penalty" in first["cause"]


@pytest.mark.slow
def test_a_critic_blow_up_mid_run_rolls_back_within_two_steps(tmp_path):
    """After 4 healthy steps the critic's learning rate jumps 1e4x: its value loss leaves the
    window's median and MAD far behind, and the rollback fires at once."""
    def jump(trainer, metrics):
        trainer.critic = trainer.critic._replace(lr_scale=trainer.critic.lr_scale * 1e4)

    trainer = Trainer(tiny(tmp_path, **{**HEALTHY, "trainer.total_training_steps": 6,
                                        "trainer.rollback.max_rollbacks": 1}))
    trainer.fault_hook = _faults({4: jump})
    with contextlib.suppress(RollbackLimit):
        trainer.run()
    first = _rollbacks(tmp_path / "run")[0]
    assert first["failed_step"] in (5, 6) and "critic/vf_loss" in first["cause"]
