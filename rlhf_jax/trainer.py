"""The PPO loop with verl's metric names, as one step contract:

    exp = trainer.make_experience(batch, state)   # gen -> reward -> old_log_prob -> ref ->
                                                  # values -> adv: fills an `Experience`
    state, metrics = trainer.learn(state, exp)    # update_critic -> update_actor ->
                                                  # update_weights

`make_experience` reads the run state and writes nothing but the `Experience` it returns,
so an asynchronous trainer can make step t + 1's while `learn` runs step t's. Which stage
fills which field is chosen once, from the config (`experience_stages`): bypass mode fills
the old log-probs from the rollout, the fused critic (`critic.values_in_update`) leaves the
values and advantages to its update. `run()` is the loop: one `RunState`, the step, and the
hooks (rollback, validation, trackers, early stop, checkpoint, profiler) after it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import (
    async_rollout,
    batching,
    dynamic_sampling,
    lora,
    offload,
    packing,
    paths,
    preflight,
    programs,
    reward_pool,
    roles,
    sft,
    tasks,
    updates,
)
from rlhf_jax import train_steps as ts
from rlhf_jax import validation as val_metrics
from rlhf_jax.checkpoint import Checkpointer
from rlhf_jax.config import to_dict, to_yaml, validate_batch_arithmetic
from rlhf_jax.core_algos import get_adv_estimator, get_kl_controller
from rlhf_jax.data import make_loaders
from rlhf_jax.errors import ConfigError
from rlhf_jax.experience import Experience, experience_stages
from rlhf_jax.hooks import StepInfo, trainer_hooks
from rlhf_jax.metrics import Timer, data_metrics, memory_metrics, step_perf, timing_per_token_ms
from rlhf_jax.progress import Progress
from rlhf_jax.recovery import Recovery, RunState
from rlhf_jax.rewards import Rewards, reward_fn_for, score_responses
from rlhf_jax.rollback import RollbackWatch
from rlhf_jax.rollout import SamplingParams, generate_sequences
from rlhf_jax.tokenizer import load_tokenizer
from rlhf_jax.trackers import make_trackers


class Trainer:
    """Holds the roles, data and trackers of one run and its `RunState`; `run()` trains to
    the end."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.progress = Progress()  # phase lines and bars on the console
        self.layouts = roles.build_mesh(cfg)
        # The validated split of a step's sequences, as each role's update walks it.
        checked = validate_batch_arithmetic(cfg, self.layouts.dp)
        a = cfg.actor_rollout_ref.actor
        self.actor_plan = batching.Plan.of(checked.actor, checked, a.ppo_epochs, a.shuffle)
        self.critic_plan = None if checked.critic is None else batching.Plan.of(
            checked.critic, checked, cfg.critic.ppo_epochs or a.ppo_epochs, cfg.critic.shuffle)
        self.pack_budgets = packing.budgets(cfg, checked)  # token budgets (None: padded)
        if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full":
            raise ConfigError("algorithm.kl_penalty: 'full' needs both policies' logits, which "
                              "the KL in the reward does not keep; use kl, abs, mse or low_var_kl")
        self.estimator = get_adv_estimator(cfg.algorithm.adv_estimator)
        if "values" in self.estimator.needs and not cfg.critic.enable:
            raise ConfigError(f"algorithm.adv_estimator: {self.estimator.name!r} needs a "
                              "critic's values; set critic.enable=true")
        self.run_dir = preflight.run_dir(cfg)
        tasks.prepare_on_every_host(cfg)
        model_cfg = cfg.actor_rollout_ref.model
        self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path)
        self._build_data()
        self.reward_fn = reward_fn_for(cfg.reward.custom_reward_function, self.train_loader,
                                       self.val_loader)
        self.reward_pool = reward_pool.from_config(cfg)  # None: rewards scored inline
        self.offload = offload.plan(cfg)  # before the first state is placed
        self.state = self._build_roles()
        t = cfg.trainer
        self.trackers = [] if jax.process_index() else make_trackers(
            t.logger, self.run_dir, total_steps=self.total_steps, config=to_dict(cfg),
            project=t.project_name, experiment=t.experiment_name, test_freq=t.test_freq,
            save_freq=t.save_freq)
        self.checkpointer = Checkpointer(self.run_dir / paths.CHECKPOINTS,
                                         max_to_keep=t.max_ckpt_to_keep)
        self.recovery = Recovery(cfg, self.checkpointer, self.trainable, self.lora_bases)
        self.watch = RollbackWatch.from_config(t.rollback)
        self.state = async_rollout.with_behaviour(self, self.state._replace(
            watch=self.watch.state(), loader=self.train_loader.get_state()))
        self.stages = experience_stages(self)
        # Test-only: `fault_hook(trainer, metrics) -> metrics` runs after each step, before the
        # rollback checks (tests inject NaNs and spikes with it; no config key reaches it).
        self.fault_hook = None
        self.hooks = trainer_hooks(self)
        from rlhf_jax import precompile  # the step's programs compile while the run starts

        self.precompile = precompile.start(self)

    # ----------------------------------------------------------------------- run state

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, state: RunState) -> None:
        """Installs `state`; with host offload its reference and optimizer states go to
        pinned host memory (the jitted steps bring them back for their call)."""
        off = self.offload
        if off["ref"].enabled:
            state = state._replace(ref=off["ref"].to_host(state.ref))
        for role in ("actor", "critic"):
            s = getattr(state, role)
            if off[role].enabled and s is not None:
                state = state._replace(**{role: s._replace(
                    opt_state=off[role].to_host(s.opt_state))})
        self._state = state

    def _field(name: str):  # a property factory, run once while the class body executes
        def get(self):
            return getattr(self._state, name)

        def set_(self, value):
            self.state = self._state._replace(**{name: value})

        return property(get, set_, doc=f"`self.state.{name}`")

    actor = _field("actor")
    critic = _field("critic")
    ref_params = _field("ref")
    kl_state = _field("kl")
    global_step = _field("step")
    rollbacks = _field("rollbacks")
    del _field

    # ------------------------------------------------------------------------------ set-up

    def _build_data(self):
        self.train_loader, self.val_loader = make_loaders(self.cfg, self.tokenizer)
        t = self.cfg.trainer
        per_epoch = self.train_loader.steps_per_epoch
        self.total_steps = t.total_training_steps or t.total_epochs * per_epoch

    def _build_roles(self) -> RunState:
        cfg, lay = self.cfg, self.layouts
        arr = cfg.actor_rollout_ref
        rng = jax.random.key(cfg.trainer.seed)
        self.actor_model = roles.actor_model(cfg).with_layout(lay.mesh, lay.spec.train_rules)
        preflight.check_vocab(self.tokenizer, self.actor_model.cfg.vocab_size, arr.model.path)
        params = roles.load_or_init(self.actor_model, arr.model.path, lay, rng)
        self.actor_optim = ts.OptimConfig.from_config(arr.actor.optim, arr.actor.grad_clip,
                                                      self.total_steps)
        actor, t = roles.train_state(self.actor_model, params, self.actor_optim)
        self.trainable = {"actor": t}  # what each role's update trains (LoRA: the adapters)
        need_ref = cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
        # LoRA: the reference is the actor's frozen base run without its adapters (no copy)
        self.ref_from_base = need_ref and self.actor_model.cfg.lora is not None
        ref = jax.tree.map(jnp.copy, params) if need_ref and not self.ref_from_base else None
        critic, self.critic_model, path = None, None, None
        if cfg.critic.enable:
            self.critic_model, path = roles.critic_model(cfg)
            self.critic_model = self.critic_model.with_layout(lay.mesh, lay.spec.train_rules)
            critic_params = roles.load_or_init(self.critic_model, path, lay,
                                               jax.random.fold_in(rng, 1))
            self.critic_optim = ts.OptimConfig.from_config(cfg.critic.optim, cfg.critic.grad_clip,
                                                           self.total_steps)
            critic, self.trainable["critic"] = roles.train_state(
                self.critic_model, critic_params, self.critic_optim)
        self.lora_bases = lora.Bases({"actor": self.actor_model, "critic": self.critic_model},
                                     {"actor": arr.model.path, "critic": path}, lay)
        self.weight_sync = roles.weight_sync(self.actor_model, lay)
        self.gen_params, self.sync_bytes = self.weight_sync(actor.params)
        self.engine, self.rollout_budget = roles.engine(
            cfg, self.weight_sync.engine_model(self.actor_model), lay, self.gen_params)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        programs.compile_steps(self, actor, critic)
        return RunState(actor, critic, ref, self.kl_ctrl.init())

    # ---------------------------------------------------------------- experience stages

    @property
    def values_in_update(self) -> bool:
        """Whether the critic's update makes the rollout's values (`critic.values_in_update`):
        GAE, and one optimizer update a step (one epoch of one mini-batch)."""
        cfg = self.cfg
        return (cfg.critic.enable and cfg.critic.values_in_update
                and cfg.algorithm.adv_estimator == "gae" and self.critic_plan.updates == 1)

    # -------------------------------------------------------------------- make_experience

    def sampling(self, validate: bool = False, greedy: bool = False) -> SamplingParams:
        ro = self.cfg.actor_rollout_ref.rollout
        src = ro.val_kwargs if validate else ro
        greedy = greedy or not src.do_sample or src.temperature == 0
        return SamplingParams(
            temperature=src.temperature if src.temperature > 0 else 1.0, top_k=src.top_k,
            top_p=src.top_p, do_sample=not greedy,
            max_response_length=self.cfg.data.max_response_length,
            eos_ids=tuple(self.tokenizer.eos_token_ids), pad_id=self.tokenizer.pad_token_id,
        )

    def generate(self, batch, n: int, sampling: SamplingParams, seed, params=None,
                 prompt_offset: int = 0) -> Experience:
        """`n` responses for each prompt of `batch` from the engine's current weights (or
        `params`, in the generate layout); `batch` is the prompts from `prompt_offset` on
        of the step's batch (their sampling keys follow their place in it)."""
        out = generate_sequences(
            self.engine, self.gen_params if params is None else params, batch.input_ids,
            batch.attention_mask, n=n, sampling=sampling, rng=seed,
            prompt_offset=prompt_offset,
        )
        responses, response_mask = np.asarray(out.responses), np.asarray(out.response_mask)
        seqs = ts.Sequences.padded(
            np.concatenate([np.repeat(batch.input_ids, n, axis=0), responses], axis=1),
            np.concatenate([np.repeat(batch.attention_mask, n, axis=0), response_mask], axis=1),
            responses, response_mask)
        return Experience(seqs, np.repeat(np.arange(len(batch.input_ids)), n),
                          np.asarray(out.rollout_log_probs))

    def score(self, batch, exp: Experience, n: int) -> np.ndarray:
        """float32 [B * n]: the reward each response of `exp` gets (`reward(...).scores`)."""
        return self.reward(batch, exp, n).scores

    def reward(self, batch, exp: Experience, n: int) -> Rewards:
        """The responses' rewards: the reward function's scores and extra info, with DAPO's
        overlong penalty (`reward_model.overlong_buffer`) when it is on; with a reward pool
        (`reward.num_workers`) its workers score the samples."""
        if self.reward_pool is not None:
            return reward_pool.submit(self, batch, exp, n).result()
        return score_responses(self.tokenizer, batch, exp.seqs.targets, exp.response_mask, n,
                               self.cfg, custom_fn=self.reward_fn)

    def _chunks(self, seqs: ts.Sequences):
        """The rows on the mesh as `[K, m, ...]` chunks for the forward passes."""
        n = seqs.input_ids.shape[0]
        per_dev = packing.forward_micro_per_device(self.cfg)
        chunk = min(per_dev * self.layouts.dp if per_dev else n, n)
        host = jax.tree.map(lambda x: batching.chunked(x, chunk), seqs)
        return batching.put(host, self.layouts.mesh, self.layouts.batch_axes, lead=1)

    def forward(self, name: str, params, seqs: ts.Sequences, chunks) -> Any:
        """One forward pass over the step's sequences (`programs.forward`)."""
        return programs.forward(self, name, params, seqs, chunks)

    def _sampled(self, batch, seed, timer: Timer, params=None, defer: bool = False,
                 prompt_offset: int = 0) -> tuple[Experience, Rewards | None]:
        """gen (and ReMax's gen_max) -> reward on `batch`: the scored experience and the
        rewards it was scored with; with `defer` and a reward pool, the experience with its
        rewards in flight (`pending_rewards`; the "reward" stage collects them) and None."""
        n = self.cfg.actor_rollout_ref.rollout.n
        with timer("gen"):
            exp = self.generate(batch, n, self.sampling(), seed, params, prompt_offset)
        if "reward_baselines" in self.estimator.needs:
            with timer("gen_max"):  # verl's ReMax: one greedy response per prompt
                greedy = self.generate(batch, 1, self.sampling(greedy=True), seed, params,
                                       prompt_offset)
        with timer("reward"):
            rewards = None
            if defer and self.reward_pool is not None:
                exp = exp._replace(pending_rewards=reward_pool.submit(self, batch, exp, n))
            else:
                rewards = self.reward(batch, exp, n)
                exp = exp._replace(scores=rewards.scores)
            if "reward_baselines" in self.estimator.needs:
                exp = exp._replace(reward_baselines=np.repeat(self.score(batch, greedy, 1), n))
        return exp, rewards

    def rollout(self, batch, step: int, params=None, prompt_offset: int = 0) -> Experience:
        """Step `step`'s sampled experience of `batch` (gen, reward), with its times: the
        first half of `make_experience`, which the one-step-off mode runs on its own (on
        several hosts, each host on its share of the prompts, from `prompt_offset`)."""
        timer = Timer()
        seed = jax.random.fold_in(jax.random.key(self.cfg.trainer.seed + 1), step)
        exp, _ = self._sampled(batch, seed, timer, params, defer=True,
                               prompt_offset=prompt_offset)
        return exp._replace(times=timer.times)

    def make_experience(self, batch, state: RunState, rolled: Experience | None = None
                        ) -> Experience:
        """Step `state.step`'s experience of `batch`: every field a stage fills, the
        metrics of the stages and their times. Reads `state`, changes nothing, except that
        DAPO's dynamic sampling (`algorithm.filter_groups`) draws more batches of prompts
        from the train loader until enough groups pass (`step` records where it is).
        `rolled`: the batch's `rollout`, made already (the one-step-off mode)."""
        n = self.cfg.actor_rollout_ref.rollout.n
        seed = jax.random.fold_in(jax.random.key(self.cfg.trainer.seed + 1), state.step)
        timer = Timer()
        groups = self.cfg.algorithm.filter_groups
        if rolled is not None:
            exp, timer.times = rolled, dict(rolled.times)
        elif groups.enable:  # generation batch k > 0 samples with its own key
            sample = lambda b, k: self._sampled(b, jax.random.fold_in(seed, k) if k else seed,
                                                timer)
            exp = dynamic_sampling.fill(
                sample, self._next_batch, batch, n=n, prompts=self.cfg.data.train_batch_size,
                metric=groups.metric, max_num_gen_batches=groups.max_num_gen_batches)
        else:
            exp, _ = self._sampled(batch, seed, timer, defer=True)
        chunks = functools.cache(lambda: self._chunks(exp.seqs))  # padded passes only
        for stage in self.stages:
            if stage.name is None:
                exp = stage.fn(state, exp, chunks)
            else:
                with timer(stage.name):
                    exp = stage.fn(state, exp, chunks)
        return exp._replace(times=timer.times)

    # ------------------------------------------------------------------------------ learn

    def _arranged(self, role: str, order, exp: Experience, extra: dict):
        """`role`'s update batch on the mesh, padded or packed by its token budget
        (`batching.arrange`)."""
        plan = programs.pack_plan(self, role, order[0].size)
        return batching.arrange(exp.seqs, extra, order, self.layouts.mesh,
                                self.layouts.batch_axes, plan)

    def learn(self, state: RunState, exp: Experience) -> tuple[RunState, dict]:
        """update_critic -> update_actor (after `trainer.critic_warmup` steps) ->
        update_weights on `exp`; the new state and the step's metrics (the experience's
        included)."""
        cfg, timer = self.cfg, Timer()
        metrics = dict(exp.metrics)
        if exp.kl is not None:  # the adaptive controller follows the batch's KL
            state = state._replace(kl=self.kl_ctrl.update(state.kl, exp.kl,
                                                          len(exp.scores)))
        if state.critic is not None:
            with timer("update_critic"):
                state, exp, m = updates.update_critic(self, state, exp)
                metrics.update(m)
        if state.step >= cfg.trainer.critic_warmup:
            with timer("update_actor"):
                state, m = updates.update_actor(self, state, exp)
                metrics.update(m)
            with timer("update_weights"):
                self.sync_weights(state.actor.params)
            metrics["perf/sync_bytes"] = self.sync_bytes  # bytes moved by update_weights
        metrics.update(data_metrics(
            scores=exp.scores, token_rewards=batching.fetch(exp.token_rewards),
            advantages=exp.advantages, returns=exp.returns,
            values=None if exp.values is None else batching.fetch(exp.values),
            response_mask=exp.response_mask, prompt_mask=exp.prompt_mask,
            sampled_mask=exp.sampled_mask, max_response_length=cfg.data.max_response_length,
            max_prompt_length=cfg.data.max_prompt_length,
        ))
        times = dict(exp.times)
        for k, v in timer.times.items():
            times[k] = times.get(k, 0.0) + v
        return state, {**metrics, **{f"timing_s/{k}": v for k, v in times.items()}}

    def step(self, batch, state: RunState | None = None) -> tuple[RunState, dict]:
        """One training step: `make_experience` then `learn`, with the step's `perf/*`.
        `state.step` is the step being made (1 for the first)."""
        state = self.state if state is None else state
        start = time.perf_counter()
        exp = self.make_experience(batch, state)
        if self.cfg.algorithm.filter_groups.enable:  # the loader after the batches it drew
            state = state._replace(loader=self.train_loader.get_state(),
                                   epoch=self.train_loader.epoch)
        state, metrics = self.learn(state, exp)
        return state, self.step_metrics(exp, metrics, start)

    def step_metrics(self, exp: Experience, metrics: dict, start: float) -> dict:
        """The step's metrics with its time (since `start`), `perf/*` and memory."""
        metrics["timing_s/step"] = time.perf_counter() - start
        c = self.cfg
        metrics.update(step_perf(
            metrics, exp.seqs.segment_ids.sum(-1), self.peak_flops, self.actor_model.cfg,
            c.actor_rollout_ref.actor.ppo_epochs, self.critic_model.cfg if c.critic.enable
            else None, c.critic.ppo_epochs))
        metrics.update(timing_per_token_ms(metrics, exp.prompt_mask.sum(), exp.sampled_mask.sum()))
        metrics.update(memory_metrics())
        return {k: float(v) for k, v in metrics.items()}

    def validate(self) -> dict:
        """verl's `val-core/...` and `val-aux/...` metrics of `val_kwargs.n` responses per
        validation prompt (`validation.run`), and its time (`timing_s/testing`)."""
        start = time.perf_counter()
        out = {} if self.val_loader is None else val_metrics.run(self)
        return {**out, "timing_s/testing": time.perf_counter() - start} if out else out

    def sync_weights(self, params=None, rebase: bool = False) -> None:
        """update_weights: the actor's parameters (with LoRA: its adapters; the frozen base
        too with `rebase`), train layout -> the engine's generate layout (`lora.WeightSync`)."""
        params = self.state.actor.params if params is None else params
        self.gen_params, self.sync_bytes = self.weight_sync(params, rebase)
        jax.block_until_ready(self.gen_params)

    def log(self, metrics: dict) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, self.global_step)

    # --------------------------------------------------------------------------------- run

    def _restored(self, state: RunState) -> None:
        """Installs a restored state: the data loader, the watch and the engine's weights
        follow it."""
        self.state = state
        self.train_loader.set_state(state.loader)
        self.watch.load(state.watch)
        self.sync_weights(rebase=True)  # a restore may have loaded another LoRA base

    def _next_batch(self):
        try:
            return next(self.train_loader)
        except StopIteration:  # an epoch ended: the loader moved to the next one
            return next(self.train_loader)

    def _next_step(self) -> tuple[RunState, dict]:
        """The synchronous step: the next batch, made into experience and learnt."""
        batch = self._next_batch()
        return self.step(batch, self.state._replace(
            step=self.global_step + 1, loader=self.train_loader.get_state(),
            epoch=self.train_loader.epoch))

    def start(self) -> None:
        """Resumes from a checkpoint (`trainer.resume_mode`), or starts afresh: the SFT
        warm start, validation before training, the rollback target of step 0."""
        t = self.cfg.trainer
        with self.progress.phase("restoring the latest checkpoint"):
            got = self.recovery.restore(self.state)  # before writing: it may refuse the directory
        (self.run_dir / paths.RUN_CONFIG).write_text(to_yaml(self.cfg))
        if got is not None:
            state, origin = got
            self._restored(state)
            print(f"resumed from {origin} at step {state.step} "
                  f"(epoch {self.train_loader.epoch})", flush=True)
            self.log({"event": "training/resumed", "from_step": state.step, "path": origin})
            return
        self.state = sft.warm_start(self, self.state)
        if t.val_before_train:
            self.log(self.validate())
        if t.rollback.enable:  # the rollback target until the first save
            self.recovery.save(self.state)

    def run(self) -> list[dict]:
        """Trains to `total_steps` (or the early stop); returns every logged step's metrics."""
        self.history: list[dict] = []
        pipeline = None
        try:
            self.start()
            if self.global_step + 1 in (self.cfg.trainer.profile_steps or ()):
                jax.profiler.start_trace(str(self.run_dir / paths.PROFILE))  # the hook stops it
            if self.global_step < self.total_steps:
                self.precompile.wait(self.progress)  # says so while the step's programs compile
                pipeline = async_rollout.start(self)  # None: the synchronous loop
            while self.global_step < self.total_steps:
                with self.progress.phase(f"step {self.global_step + 1}, the first of this "
                                         "process (its programs' first calls)",
                                         min_seconds=5.0) \
                        if not self.history else contextlib.nullcontext():
                    state, metrics = self._next_step() if pipeline is None \
                        else pipeline.step(self.state)
                metrics["training/epoch"] = float(state.epoch)
                info = StepInfo(state.step, metrics, final=state.step == self.total_steps)
                self.state = state
                self.state = self.hooks.run(self.state, info)
                if pipeline is not None:
                    pipeline.follow(self.state)  # a rollback restarts the batches in flight
                if info.stop:
                    break
        finally:
            if pipeline is not None:
                pipeline.close()
            self.checkpointer.close()
            for tracker in self.trackers:
                tracker.close()
        return self.history


def train(cfg) -> list[dict]:
    """Runs `cfg` to `trainer.total_training_steps`; returns the metrics of every step."""
    start = time.perf_counter()
    with preflight.RunLock(cfg):  # a second run on this directory refuses
        preflight.warn_degenerate(cfg)
        with Progress().phase("setting up the run (data, tokenizer, models, mesh)",
                              min_seconds=1.0):
            trainer = Trainer(cfg)
        history = trainer.run()
    print(f"done: {trainer.global_step} steps in {time.perf_counter() - start:.1f}s, "
          f"metrics in {trainer.run_dir / paths.METRICS}")
    return history
