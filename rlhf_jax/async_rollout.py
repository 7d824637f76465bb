"""One-step-off-policy training (`actor_rollout_ref.hybrid_engine: false`): the next batch is
generated while the current one trains, as verl's one-step-off-policy recipe does.

    step s:   rollout thread: generate batch s + 1 + K (weights after step s - K ... )
              main thread:    old_log_prob, ref, values, adv, updates of batch s
              then            the new weights -> the rollout devices (`jax.device_put`)

With K = `async_training.max_staleness`, batch s is generated from the weights after step
`s - 1 - K` (those of step 0 for the first ones): its staleness, `s - 1 - version`, is K at
most, and a batch past the bound is never trained on. K = 0 is the synchronous schedule
(generation waits for the previous update), K = 1 the one-step-off one. The behaviour
log-probs are the sampler's own (`rollout_log_probs`); the old log-probs are recomputed
with the weights being trained, and the rollout correction (`algorithm.rollout_correction`)
weighs or rejects the tokens of the gap. Generation runs on the mesh preset's
`rollout_sizes` devices when it has them (the train mesh's otherwise); the actor's weights
go there after each update in the generate layout, device to device (`rollout.reshard`).

The run state keeps the rollout's K older weights (`RunState.behaviour`), so a checkpoint
of step c regenerates the batches in flight at c (c + 1 .. c + 1 + K) exactly: each batch's
prompts come from the loader in step order and its sampling key from its step. A resumed
run therefore equals an uninterrupted one.

Metrics: `async/staleness`, `async/idle_fraction/{train,rollout}` (the share of the step's
wall time each device group waited), `timing_s/gen_wait` (the trainer waiting for the
batch) and `timing_s/sync_wait` (the weight transfer to the rollout devices).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import time
from typing import Any, NamedTuple


class Job(NamedTuple):
    """One batch in flight: its step, the weights' version, where the loader was after
    drawing it, and the rollout thread's future `(experience, busy seconds)`."""

    step: int
    version: int
    loader: Any
    epoch: int
    batch: Any
    future: cf.Future


def with_behaviour(trainer, state):
    """`state` holding the rollout's older weights the mode keeps (a template of their
    structure for restoring a checkpoint); unchanged with the hybrid engine."""
    if trainer.cfg.actor_rollout_ref.hybrid_engine:
        return state
    k = trainer.cfg.async_training.max_staleness
    return state._replace(behaviour=(trainer.gen_params,) * k)


def start(trainer):
    """The one-step-off driver of `trainer`'s run from its current state, or None with the
    hybrid engine (the synchronous loop)."""
    if trainer.cfg.actor_rollout_ref.hybrid_engine:
        return None
    return OneStepOff(trainer)  # one host: roles.build_mesh refuses several


class OneStepOff:
    """Runs the steps of a one-step-off run: `step(state) -> (state, metrics)`."""

    def __init__(self, trainer):
        self.t = trainer
        self.k = trainer.cfg.async_training.max_staleness
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.jobs: collections.deque[Job] = collections.deque()
        self.trained = trainer.state.step  # the last step trained (or restored)
        self.launch_all(trainer.state)

    # ------------------------------------------------------------------------ the rollout

    def launch_all(self, state) -> None:
        """Starts the batches after `state.step` that the weights at hand may generate:
        K of the older weights (`state.behaviour`), then one of the current ones."""
        if state.step == 0:  # every batch up to K + 1 samples the weights of step 0
            state = state._replace(behaviour=(self.t.gen_params,) * self.k)
            self.t.state = self.t.state._replace(behaviour=state.behaviour)
        weights = (*tuple(state.behaviour), self.t.gen_params)
        for i, params in enumerate(weights):
            self._launch(state.step + 1 + i, max(0, state.step - self.k + i), params)

    def _launch(self, step: int, version: int, params) -> None:
        if step > self.t.total_steps:
            return
        batch = self.t._next_batch()  # in step order, on this thread: the loader is not shared
        loader, epoch = self.t.train_loader.get_state(), self.t.train_loader.epoch
        future = self.pool.submit(self._generate, batch, step, params)
        self.jobs.append(Job(step, version, loader, epoch, batch, future))

    def _generate(self, batch, step: int, params):
        start = time.perf_counter()
        exp = self.t.rollout(batch, step, params)
        return exp, time.perf_counter() - start

    # -------------------------------------------------------------------------- the step

    def step(self, state) -> tuple[Any, dict]:
        """Trains step `state.step + 1` on its batch (waiting for it if it is not ready)
        and starts the generation of the batch K + 1 steps on with the new weights."""
        t, start = self.t, time.perf_counter()
        job = self.jobs.popleft()
        staleness = job.step - 1 - job.version
        if job.step != state.step + 1 or staleness > self.k:  # never trained on
            raise RuntimeError(f"one-step-off: batch of step {job.step} (weights of step "
                               f"{job.version}) at step {state.step + 1}, bound {self.k}")
        exp, busy = job.future.result()
        gen_wait = time.perf_counter() - start
        state = state._replace(step=job.step, loader=job.loader, epoch=job.epoch)
        exp = t.make_experience(job.batch, state, rolled=exp)
        before = t.gen_params  # the weights of step job.step - 1
        state, metrics = t.learn(state, exp)  # ends by moving the new weights over
        if self.k:
            state = state._replace(behaviour=(*tuple(state.behaviour)[1:], before))
        self.trained = job.step
        self._launch(job.step + 1 + self.k, job.step, t.gen_params)
        metrics = t.step_metrics(exp, metrics, start)
        wall = max(metrics["timing_s/step"], 1e-9)
        sync = metrics.get("timing_s/update_weights", 0.0)
        metrics.update({
            "async/staleness": float(staleness),
            "timing_s/gen_wait": gen_wait,
            "timing_s/sync_wait": sync,
            "async/idle_fraction/train": min(1.0, (gen_wait + sync) / wall),
            "async/idle_fraction/rollout": max(0.0, 1.0 - busy / wall),
        })
        return state, metrics

    def follow(self, state) -> None:
        """After the step's hooks: a rollback restored an older state, so the batches in
        flight are dropped and those after the restored step start again."""
        if state.step == self.trained:
            return
        self.trained = state.step
        self.drain()
        self.launch_all(state)

    def drain(self) -> None:
        """Waits out the batches in flight and forgets them."""
        while self.jobs:
            try:
                self.jobs.popleft().future.result()
            except Exception:  # a batch nobody will train on: its error does not matter
                pass

    def close(self) -> None:
        for job in self.jobs:
            job.future.cancel()
        self.pool.shutdown(wait=True)
