"""Compile a run's step programs in a background thread while the run starts.

A run waits for XLA before its first step: the rollout engine's programs (decode state,
prefill, insert, generate) for the SFT warm start's sampled evaluation, validation and the
step, then the forward passes and the updates. All of their shapes follow from the config,
so `start(trainer)` compiles them ahead of time (`jit(...).lower(shapes).compile()`, nothing
runs, no device memory is used) in a background thread, while the main thread reads data, warms
up with SFT and validates. A program the main thread reaches before its background compile
ends waits for it, instead of compiling it a second time; one it reaches first is compiled
by it as before and skipped here. The programs are the very ones the step calls (the same
jitted functions, with the shapes and shardings of the step's own batch arranging), so the
step's results do not change; with the persistent cache (`compile_cache`) a second run
loads them instead.

Best effort: what this cannot build ahead (packed batches, whose shapes follow the data; a
role with host offload) is compiled on first use, as without it, and an error in a job is
kept in `Precompile.errors` and printed, never raised.

    pre = precompile.start(trainer)     # at the end of Trainer.__init__
    ...
    pre.join(); pre.compiled            # the programs it compiled, in order
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

import jax
import numpy as np

from rlhf_jax import train_steps as ts
from rlhf_jax.models.lora import strip as lora_strip
from rlhf_jax.rollout import driver
from rlhf_jax.rollout.program_cache import abstract

SFT_EVAL_PROMPTS = 256  # the prompts of the SFT warm start's sampled evaluation (sft.py)


def _main_ended() -> bool:
    """The main thread has finished: the process is exiting."""
    return not threading.main_thread().is_alive()


class _Gated:
    """A step function whose first calls wait until the background compile of it ends."""

    def __init__(self, fn, done: threading.Event):
        self._fn, self._done = fn, done
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kw):
        self._done.wait()
        return self._fn(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._fn, name)


class Precompile:
    """The background compile of one trainer's programs (see the module doc)."""

    def __init__(self, jobs: list[tuple[str, Callable[[], None]]], gates=(),
                 first_step: int | None = None):
        self.jobs = jobs
        self.gates = list(gates)  # the `_Gated` step functions, opened when their job ends
        self.compiled: list[str] = []
        self.errors: dict[str, str] = {}
        # Set once the first `first_step` jobs (all of them by default) have ended: what the
        # run's first step needs; the rest (e.g. a later validation's) compile meanwhile.
        self.first_step = len(jobs) if first_step is None else first_step
        self.step_ready = threading.Event()
        # Not a daemon: the interpreter must not tear XLA down under a running compile (it
        # aborts); once the main thread has ended, the jobs left are dropped instead.
        self.thread = threading.Thread(target=self._run, name="rlhf_jax-precompile")

    def _run(self) -> None:
        try:
            for i, (name, job) in enumerate(self.jobs):
                if i == self.first_step:
                    self.step_ready.set()
                if _main_ended():
                    break
                try:
                    job()
                    self.compiled.append(name)
                except Exception as exc:  # noqa: BLE001 - it compiles on first use instead
                    self.errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    print(f"precompile: {name} skipped ({self.errors[name]})", flush=True)
        finally:
            self.step_ready.set()
            for gate in self.gates:
                gate._done.set()

    def join(self, timeout: float | None = None) -> Precompile:
        self.thread.join(timeout)
        return self

    def wait(self, progress) -> None:
        """Waits for the programs of the first step (`step_ready`), with a `progress` phase
        line when the wait is not short (the first step would otherwise wait for them,
        silently, inside its timings). Jobs after them go on in the background."""
        if self.thread.is_alive() and not self.step_ready.is_set():
            with progress.phase("compiling the step's programs", min_seconds=1.0,
                                done=lambda: f"{len(self.compiled)} programs compiled"):
                self.step_ready.wait()  # `_run` sets it at the latest when it ends


# ------------------------------------------------------------------------------ the jobs


def _rollout_jobs(trainer) -> tuple[list, list]:
    """The engine's programs for the SFT evaluation, validation and the step's rollout, in
    the order the run needs them: `(before the first step's, after it)`. Validation comes
    after the step's programs unless it runs before training."""
    cfg = trainer.cfg
    length = cfg.data.max_prompt_length
    params = abstract(trainer.gen_params)
    ro, t = cfg.actor_rollout_ref.rollout, cfg.trainer

    def job(num_prompts, n, sampling):
        return lambda: driver.precompile(trainer.engine, params, num_prompts=num_prompts,
                                         prompt_length=length, n=n, sampling=sampling,
                                         stop=_main_ended)

    jobs, later = [], []
    eval_loader = trainer.val_loader or trainer.train_loader
    if t.sft_warmup.enable and t.sft_warmup.max_steps > 0:
        prompts = min(len(eval_loader.dataset), SFT_EVAL_PROMPTS)
        jobs.append(("rollout/sft_eval", job(prompts, 1, trainer.sampling())))
    if trainer.val_loader is not None and (t.val_before_train or t.test_freq > 0):
        prompts = min(trainer.val_loader.batch_size, len(trainer.val_loader.dataset))
        (jobs if t.val_before_train else later).append(
            ("rollout/validate", job(prompts, ro.val_kwargs.n, trainer.sampling(validate=True))))
    jobs.append(("rollout/step", job(cfg.data.train_batch_size, ro.n, trainer.sampling())))
    return jobs, later


def _dummy_experience(trainer):
    """A step's `Experience` of zeros (one token prompts, full-length responses): the
    shapes the step's forward passes and updates see."""
    from rlhf_jax.experience import Experience

    cfg = trainer.cfg
    n = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    prompt_mask = np.zeros((n, p), np.int32)
    prompt_mask[:, -1] = 1
    responses = np.zeros((n, r), np.int32)
    response_mask = np.ones((n, r), np.int32)
    seqs = ts.Sequences.padded(np.concatenate([np.zeros((n, p), np.int32), responses], 1),
                               np.concatenate([prompt_mask, response_mask], 1), responses,
                               response_mask)
    return Experience(seqs, np.arange(n), np.zeros((n, r), np.float32))


def _padded(trainer, role: str) -> bool:
    budgets = getattr(trainer, "pack_budgets", None) or {}
    owner = {"old": "ref", "values": "critic"}.get(role, role)  # the offload it runs under
    return budgets.get(role) is None and not trainer.offload[owner].enabled


def _step_jobs(trainer, gates: dict) -> list[tuple[str, Callable[[], None]]]:
    """The forward passes (old log-probs, ref, values) and the updates (critic, actor) of a
    padded step, each gating the trainer attribute it compiles."""
    cfg, state = trainer.cfg, trainer.state
    # Shapes now: the SFT warm start donates (deletes) these very arrays.
    actor, ref, critic = abstract((state.actor, state.ref, state.critic))
    if trainer.ref_from_base:  # the LoRA actor's base is its reference
        ref = lora_strip(actor.params)
    r = cfg.data.max_response_length
    jobs = []

    def add(name: str, attr: str, args: Callable[[], tuple]):
        fn = getattr(trainer, attr, None)
        if fn is None or not hasattr(fn, "lower"):
            return
        done = threading.Event()
        gates[attr] = _Gated(fn, done)

        def job():
            try:
                fn.lower(*abstract(args())).compile()
            finally:
                done.set()

        jobs.append((name, job))

    exp = _dummy_experience(trainer)
    zeros = np.zeros((exp.seqs.input_ids.shape[0], r), np.float32)
    forwards = [("old", "log_probs", actor.params)]
    if ref is not None and getattr(trainer, "ref_log_probs", None) is not None \
            and trainer.ref_log_probs is not trainer.log_probs:
        forwards.append(("ref", "ref_log_probs", ref))
    if critic is not None and not trainer.values_in_update:
        forwards.append(("values", "values", critic.params))
    for role, attr, params in forwards:
        if _padded(trainer, role):
            add(attr, attr, lambda params=params: (params, trainer._chunks(exp.seqs)))
    if critic is not None and _padded(trainer, "critic"):
        order = trainer.critic_plan.order(0)
        if trainer.values_in_update:
            def critic_args():
                (seqs, ex), tok, sq, _ = trainer._arranged("critic", order, exp,
                                                            {"rewards": zeros})
                return critic, ts.CriticRolloutBatch(seqs, ex["rewards"], tok, sq)

            add("critic_update_from_rollout", "critic_update_from_rollout", critic_args)
        else:
            def critic_args():
                extra = {"values": zeros, "returns": zeros}
                (seqs, ex), tok, sq, _ = trainer._arranged("critic", order, exp, extra)
                return critic, ts.CriticBatch(seqs, ex["values"], ex["returns"], tok, sq)

            add("critic_update", "critic_update", critic_args)
    if _padded(trainer, "actor"):
        order = trainer.actor_plan.order(0)

        def actor_args():
            extra = {"old": zeros, "adv": zeros, "ref": zeros}
            (seqs, ex), tok, sq, _ = trainer._arranged("actor", order, exp, extra)
            return actor, ts.ActorBatch(seqs, ex["old"], ex["adv"], ex["ref"], tok, sq)

        add("actor_update", "actor_update", actor_args)
    return jobs


def enabled() -> bool:
    """Off when the environment sets `RLHF_JAX_PRECOMPILE=0` (every program then compiles on
    first use, as without this module), and with several processes: there a transfer of the
    engine's arguments is a collective across processes (jax checks that each passes the
    same value), and a background thread's collectives interleave with the main thread's in
    an order that differs between hosts (a 2-host run died in gloo with mismatched sizes)."""
    return os.environ.get("RLHF_JAX_PRECOMPILE", "1") != "0" and jax.process_count() == 1


def start(trainer) -> Precompile:
    """Starts compiling `trainer`'s rollout and step programs in a background thread; the
    trainer's step functions it compiles are wrapped so that a call waits for their compile.
    The SFT evaluation's rollout (and validation's, when it runs before training) come
    first, then the step's programs in the order a step runs them, then validation's (the
    engine waits on its own programs the same way)."""
    gates: dict = {}
    jobs, later = [], []
    if enabled():
        jobs, later = _rollout_jobs(trainer)
        jobs += _step_jobs(trainer, gates)
    pre = Precompile(jobs + later, gates.values(), first_step=len(jobs))
    for attr, gated in gates.items():
        for alias in ("log_probs", "ref_log_probs"):  # one jitted function, two names
            if attr == "log_probs" and getattr(trainer, alias, None) is gated._fn:
                setattr(trainer, alias, gated)
        setattr(trainer, attr, gated)
    pre.thread.start()
    return pre
