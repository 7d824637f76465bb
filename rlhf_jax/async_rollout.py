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

On several hosts (`roles.build_mesh`) each host's rollout devices are a mesh of their own
and generate the host's share of the batch's prompts (their sampling keys follow their place
in the whole batch, so the tokens are those one host would sample); the training thread
joins the shares into the step's batch on every host (`distributed.allgather_objects`), and
the trained weights reach each host's rollout devices by one all-gather on the train mesh.
The rollout thread so runs no collective across hosts: every collective is the training
thread's, in the same order on every host.

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
import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import distributed
from rlhf_jax.experience import Experience, collect_rewards


class Job(NamedTuple):
    """One batch in flight: its step, the weights' version, where the loader was after
    drawing it, and the rollout thread's future `(experience, busy seconds)`."""

    step: int
    version: int
    loader: Any
    epoch: int
    batch: Any
    future: cf.Future


# A copy of train-layout weights the update will not donate away (several hosts).
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def with_behaviour(trainer, state):
    """`state` holding the rollout's older weights the mode keeps (a template of their
    structure for restoring a checkpoint); unchanged with the hybrid engine. They are kept
    in the generate layout on the rollout devices, or on several hosts, where each host's
    rollout devices are its own, in the train layout (a checkpoint's arrays span hosts)."""
    if trainer.cfg.actor_rollout_ref.hybrid_engine:
        return state
    k = trainer.cfg.async_training.max_staleness
    if not k:
        return state
    # A copy: the update (and the SFT warm start) donate the train state's arrays.
    kept = _copy(state.actor.params) if trainer.layouts.rollout_per_host else trainer.gen_params
    return state._replace(behaviour=(kept,) * k)


def start(trainer):
    """The one-step-off driver of `trainer`'s run from its current state, or None with the
    hybrid engine (the synchronous loop)."""
    if trainer.cfg.actor_rollout_ref.hybrid_engine:
        return None
    return OneStepOff(trainer)


class OneStepOff:
    """Runs the steps of a one-step-off run: `step(state) -> (state, metrics)`."""

    def __init__(self, trainer):
        self.t = trainer
        self.k = trainer.cfg.async_training.max_staleness
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.jobs: collections.deque[Job] = collections.deque()
        self.trained = trainer.state.step  # the last step trained (or restored)
        self.per_host = trainer.layouts.rollout_per_host
        self.launch_all(trainer.state)

    # ------------------------------------------------------------------------ the rollout

    def launch_all(self, state) -> None:
        """Starts the batches after `state.step` that the weights at hand may generate:
        K of the older weights (`state.behaviour`), then one of the current ones."""
        t = self.t
        if state.step == 0:  # every batch up to K + 1 samples the weights of step 0
            if not self.per_host:
                t.state = t.state._replace(behaviour=(t.gen_params,) * self.k)
            older = (t.gen_params,) * self.k
        elif self.per_host:  # train layout -> this host's rollout devices
            older = tuple(t.weight_sync(params)[0] for params in state.behaviour)
        else:
            older = tuple(state.behaviour)
        for i, params in enumerate((*older, t.gen_params)):
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
        if not self.per_host:
            return self.t.rollout(batch, step, params), time.perf_counter() - start
        lo, hi = _share(len(batch.input_ids))
        exp = self.t.rollout(_prompts(batch, lo, hi), step, params, prompt_offset=lo)
        exp = collect_rewards(exp)  # the pool's futures cannot leave this host
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
        if self.per_host:  # every host's share of the batch, on every host
            exp, busy = _joined(distributed.allgather_objects((exp, busy)))
        gen_wait = time.perf_counter() - start
        state = state._replace(step=job.step, loader=job.loader, epoch=job.epoch)
        exp = t.make_experience(job.batch, state, rolled=exp)
        before = t.gen_params  # the weights of step job.step - 1
        if self.per_host and self.k:  # kept in the train layout, which the update donates
            before = _copy(state.actor.params)
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


# ------------------------------------------------------------------ several hosts' shares


def _share(prompts: int) -> tuple[int, int]:
    """This host's prompts `[lo, hi)` of a batch of `prompts` (equal shares in host order:
    the launcher makes data.train_batch_size a multiple of the host count)."""
    hosts, me = jax.process_count(), jax.process_index()
    if prompts % hosts:
        raise RuntimeError(f"one-step-off: a batch of {prompts} prompts does not split "
                           f"over {hosts} hosts")
    per = prompts // hosts
    return me * per, (me + 1) * per


def _prompts(batch, lo: int, hi: int):
    """Rows `[lo, hi)` of a `PromptBatch`."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name)[lo:hi]
                                         for f in dataclasses.fields(batch)})


def _joined(parts: list[tuple[Experience, float]]) -> tuple[Experience, float]:
    """The hosts' rollouts of their shares (in host order) as the one of the whole batch,
    and the longest host's generation time. The stages' times are the slowest host's."""
    exps = [e for e, _ in parts]
    offsets = np.cumsum([0] + [e.index.max() + 1 for e in exps[:-1]])  # prompts a share
    fields = {}
    for name in Experience._fields:
        values = [getattr(e, name) for e in exps]
        if name == "index":
            fields[name] = np.concatenate([v + o for v, o in zip(values, offsets, strict=True)])
        elif name == "times":
            fields[name] = {k: max(v.get(k, 0.0) for v in values) for k in values[0]}
        elif all(v is None for v in values) or name == "metrics" and not any(values):
            continue
        elif name in ("seqs", "rollout_log_probs", "scores", "reward_baselines"):
            fields[name] = jax.tree.map(lambda *xs: np.concatenate(xs), *values)
        else:
            raise RuntimeError(f"one-step-off: the rollout filled Experience.{name}, which "
                               "the hosts' shares do not join")
    return Experience(**fields), max(busy for _, busy in parts)
