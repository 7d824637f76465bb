"""The run loop's hooks: what happens between two training steps, each with an `every`.

    loop = HookList()
    loop.add(checkpoint, every=cfg.trainer.save_freq, at_end=True)
    ...
    state = loop.run(state, info)      # after each step, in the order they were added

A hook is `fn(state: RunState, info: StepInfo) -> RunState`: it reads the step's metrics
from `info`, may add to them (validation), end the step early (a rollback sets
`info.rolled_back` and the later hooks are skipped) or ask the run to stop (`info.stop`), and
returns the run state, replaced where it acts on it (a rollback restores an older one).
(levanter's `Trainer.add_hook(fn, every=n)` in spirit.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rlhf_jax import paths
from rlhf_jax.checkpoint import signals_held


@dataclasses.dataclass
class StepInfo:
    """What the hooks of one step see and say."""

    step: int
    metrics: dict
    final: bool  # the last step of the run
    stop: bool = False  # a hook ends the run after this step
    rolled_back: bool = False  # a hook undid this step: the later hooks do not run


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn` after every `every`-th step (0 or less: never), and after the last one (the
    run's end or an early stop) when `at_end`. From the first hook with `held` on, a SIGTERM
    waits until the step's last hook has run (`checkpoint.signals_held`)."""

    name: str
    fn: Callable[[Any, StepInfo], Any]
    every: int = 1
    at_end: bool = False
    held: bool = False

    def due(self, info: StepInfo) -> bool:
        if self.every > 0 and info.step % self.every == 0:
            return True
        return self.at_end and (info.final or info.stop)


class HookList:
    """Hooks in the order they run after each step."""

    def __init__(self):
        self.hooks: list[Hook] = []

    def add(self, name: str, fn, *, every: int = 1, at_end: bool = False,
            held: bool = False) -> None:
        self.hooks.append(Hook(name, fn, every, at_end, held))

    def run(self, state, info: StepInfo):
        with contextlib.ExitStack() as stack:
            holding = False
            for hook in self.hooks:
                if info.rolled_back:
                    break
                if hook.held and not holding:
                    stack.enter_context(signals_held())
                    holding = True
                if hook.due(info):
                    state = hook.fn(state, info)
        return state

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hooks]


# ------------------------------------------------------------------ the trainer's hooks


def trainer_hooks(trainer) -> HookList:
    """After each step, in this order: the test fault hook, rollback, scores (the window of
    the early stop, which it decides), validation, checkpoint, trackers, profiler.

    The early stop is decided before validation and checkpoint, so a run that stops early
    ends, as one that reaches its last step, with a validation and a checkpoint; both are
    timed (verl's `timing_s/testing`, `timing_s/save_checkpoint`) before the trackers log
    the step."""
    t = trainer.cfg.trainer
    hooks = HookList()
    hooks.add("fault", functools.partial(_fault, trainer))
    if t.rollback.enable:
        hooks.add("rollback", functools.partial(_rollback, trainer))
    hooks.add("scores", functools.partial(_scores, trainer))
    if t.test_freq > 0:
        hooks.add("validation", functools.partial(_validation, trainer), every=t.test_freq,
                  at_end=True)
    # Held from the checkpoint on: a SIGTERM during a save stops the run once the step's
    # metrics are logged, so the checkpoint it resumes from is never of an unlogged step.
    hooks.add("checkpoint", functools.partial(_checkpoint, trainer), every=t.save_freq,
              at_end=True, held=True)
    hooks.add("trackers", functools.partial(_trackers, trainer))
    if t.profile_steps:
        hooks.add("profiler", functools.partial(_profiler, trainer))
    return hooks

def _fault(trainer, state, info: StepInfo):
    if trainer.fault_hook is None:
        return state
    trainer.state = state
    info.metrics = trainer.fault_hook(trainer, info.metrics)
    return trainer.state

def _rollback(trainer, state, info: StepInfo):
    cause = trainer.watch.cause(info.metrics)
    if cause is None:
        trainer.watch.observe(info.metrics)
        return state._replace(watch=trainer.watch.state())
    trainer.history.append(info.metrics)
    trainer.log(info.metrics)
    state, event = trainer.recovery.roll_back(
        state, cause, newest=trainer.watch.newest_restorable(info.step, info.metrics))
    trainer._restored(state)
    trainer.log(event)
    info.rolled_back = True
    return state

def _scores(trainer, state, info: StepInfo):
    """The last 5 steps' mean score, and the early stop (`trainer.early_stop_score`)."""
    t = trainer.cfg.trainer
    recent = (*state.recent_scores, info.metrics["critic/score/mean"])[-5:]
    if t.early_stop_score is not None and len(recent) == 5 \
            and np.mean(recent) >= t.early_stop_score:
        info.stop = True
        trainer.progress.note(f"early stop at step {state.step}: mean score of the last 5 "
                              f"steps {np.mean(recent):.3f} >= {t.early_stop_score}")
    return state._replace(recent_scores=recent)

def _validation(trainer, state, info: StepInfo):
    info.metrics.update(trainer.validate())  # with timing_s/testing
    return state

def _checkpoint(trainer, state, info: StepInfo):
    start = time.perf_counter()
    with trainer.progress.phase(f"saving checkpoint {state.step}", min_seconds=2.0):
        trainer.recovery.save(state)
    info.metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
    return state

def _trackers(trainer, state, info: StepInfo):
    trainer.history.append(info.metrics)
    trainer.log(info.metrics)
    return state

def _profiler(trainer, state, info: StepInfo):
    """`trainer.profile_steps`: a `jax.profiler` trace of those steps, in
    `<run>/profile` (TensorBoard's profile plugin and Perfetto read it); a run of
    consecutive steps is one trace."""
    steps = set(trainer.cfg.trainer.profile_steps)
    last = info.final or info.stop
    if info.step in steps and ((info.step + 1) not in steps or last):
        jax.profiler.stop_trace()
    elif (info.step + 1) in steps and not last:
        jax.profiler.start_trace(str(trainer.run_dir / paths.PROFILE))
    return state
