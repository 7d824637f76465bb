"""The PPO loop: gen -> reward -> old_log_prob -> ref -> values -> adv -> update_critic ->
update_actor -> update_weights -> testing, with verl's metric names.

`train(cfg)` is the whole run; `Trainer.step()` one iteration, readable top to bottom.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import numpy as np

from rlhf_jax import batching, distributed, offload, ppo, roles, sft, tasks
from rlhf_jax import train_steps as ts
from rlhf_jax.checkpoint import Checkpointer
from rlhf_jax.config import to_dict, to_yaml, validate_batch_arithmetic
from rlhf_jax.core_algos import get_kl_controller
from rlhf_jax.data import PromptDataset, PromptLoader
from rlhf_jax.errors import ConfigError
from rlhf_jax.metrics import Timer, data_metrics, peak_flops_per_device, train_flops
from rlhf_jax.recovery import Recovery
from rlhf_jax.rewards import load_custom_reward_fn, score_batch
from rlhf_jax.rollback import RollbackWatch
from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences, reshard
from rlhf_jax.tokenizer import load_tokenizer
from rlhf_jax.trackers import make_trackers


@dataclasses.dataclass
class Rollout:
    """One step's sequences on host, prompt-major (row i*n + j = sample j of prompt i)."""

    prompt_ids: np.ndarray  # [N, P]
    prompt_mask: np.ndarray  # [N, P]
    responses: np.ndarray  # [N, R]
    response_mask: np.ndarray  # [N, R]
    rollout_log_probs: np.ndarray  # [N, R]
    index: np.ndarray  # [N] prompt id within the batch (the GRPO group)

    @property
    def input_ids(self):
        return np.concatenate([self.prompt_ids, self.responses], axis=1)

    @property
    def attention_mask(self):
        return np.concatenate([self.prompt_mask, self.response_mask], axis=1)


class Trainer(Recovery):
    """Holds the roles, data and trackers of one run; `run()` trains to the end."""

    # Host offload (`ref.param_offload`, `actor.optimizer_offload`, `critic.optimizer_offload`):
    # each assignment puts these in pinned host memory (a no-op without offload); the jitted
    # steps bring them to device memory for their call only (`offload.onloaded`).
    actor = offload.Offloaded("actor", "opt_state")
    critic = offload.Offloaded("critic", "opt_state")
    ref_params = offload.Offloaded("ref")

    def __init__(self, cfg):
        self.cfg = cfg
        self.layouts = roles.build_mesh(cfg)
        validate_batch_arithmetic(cfg, self.layouts.dp)
        if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full":
            raise ConfigError("algorithm.kl_penalty: 'full' needs both policies' logits, which "
                              "the KL in the reward does not keep; use kl, abs, mse or low_var_kl")
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self._prepare_synthetic()
        model_cfg = cfg.actor_rollout_ref.model
        self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path)
        self._build_data()
        self._build_roles()
        self.reward_fn = None
        fn = cfg.reward.custom_reward_function
        if fn.path:
            self.reward_fn = load_custom_reward_fn(fn.path, fn.name)
        t = cfg.trainer
        self.trackers = [] if jax.process_index() else make_trackers(
            t.logger, self.run_dir, total_steps=self.total_steps, config=to_dict(cfg),
            project=t.project_name, experiment=t.experiment_name)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints",
                                         max_to_keep=t.max_ckpt_to_keep)
        self.watch = RollbackWatch(t.rollback.max_kl, t.rollback.value_loss_spike)
        self.rollbacks = 0
        self.recent_scores: list[float] = []  # critic/score/mean of the last 5 steps
        self.global_step = 0
        # Test-only: `fault_hook(trainer, metrics) -> metrics` runs after each step, before the
        # rollback checks (tests inject NaNs and spikes with it; no config key reaches it).
        self.fault_hook = None

    # ------------------------------------------------------------------------------ set-up

    def _prepare_synthetic(self):
        if self.cfg.synthetic.task is None:
            return
        # Process 0 writes the files first; the others then find them (a shared disk) or write
        # their own identical copy (same seed), never while another process is writing.
        for turn in (0, 1):
            if (jax.process_index() == 0) == (turn == 0):
                tasks.prepare(self.cfg)
                tasks.prepare_model(self.cfg)
            distributed.barrier(f"rlhf_jax-synthetic-{turn}")

    def _build_data(self):
        d = self.cfg.data
        ds_kw = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                     truncation=d.truncation, filter_overlong_prompts=d.filter_overlong_prompts)
        shard = dict(shard_index=jax.process_index(), shard_count=jax.process_count())
        self.train_loader = PromptLoader(
            PromptDataset(list(d.train_files), self.tokenizer, **ds_kw), d.train_batch_size,
            shuffle=d.shuffle, seed=d.seed, **shard,
        )
        self.train_loader = distributed.gathered(self.train_loader)  # hosts' shards joined
        self.val_loader = None
        if d.val_files:
            val = PromptDataset(list(d.val_files), self.tokenizer, **ds_kw)
            self.val_loader = distributed.gathered(PromptLoader(
                val, d.val_batch_size or len(val), shuffle=False, drop_remainder=False, **shard))
        t = self.cfg.trainer
        per_epoch = self.train_loader.steps_per_epoch
        self.total_steps = t.total_training_steps or t.total_epochs * per_epoch

    def _build_roles(self):
        cfg, lay = self.cfg, self.layouts
        arr = cfg.actor_rollout_ref
        self.offload = offload.plan(cfg)  # before the first assignment of actor, ref, critic
        rng = jax.random.key(cfg.trainer.seed)
        self.actor_model = roles.actor_model(cfg).with_layout(lay.mesh, lay.spec.train_rules)
        params = roles.load_or_init(self.actor_model, arr.model.path, lay, rng)
        self.actor_optim = roles.optim_config(arr.actor.optim, arr.actor.grad_clip,
                                              self.total_steps)
        self.actor = ts.init_state(params, ts.make_optimizer(self.actor_optim))
        need_ref = cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
        self.ref_params = jax.tree.map(lambda x: x.copy(), params) if need_ref else None
        self.critic = None
        if cfg.critic.enable:
            self.critic_model, path = roles.critic_model(cfg)
            self.critic_model = self.critic_model.with_layout(lay.mesh, lay.spec.train_rules)
            critic_params = roles.load_or_init(self.critic_model, path, lay,
                                               jax.random.fold_in(rng, 1))
            self.critic_optim = roles.optim_config(cfg.critic.optim, cfg.critic.grad_clip,
                                                   self.total_steps)
            self.critic = ts.init_state(critic_params, ts.make_optimizer(self.critic_optim))
        self.gen_shardings = self.actor_model.shardings(lay.mesh, lay.spec.generate_rules)
        self.gen_params = reshard(self.actor.params, self.gen_shardings)
        ro, d = arr.rollout, cfg.data
        self.engine = Engine(
            self.actor_model.with_layout(lay.mesh, lay.spec.generate_rules), lay.mesh,
            lay.spec.generate_rules,
            max_concurrent_decodes=ro.max_concurrent_decodes,
            max_prefill_length=d.max_prompt_length, max_decode_length=d.max_response_length,
            prefill_buckets=ro.prefill_buckets,
        )
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.kl_state = self.kl_ctrl.init()
        self._compile_steps()

    def _compile_steps(self):
        cfg, lay = self.cfg, self.layouts
        a = cfg.actor_rollout_ref.actor
        temperature = cfg.actor_rollout_ref.rollout.temperature
        loss = ts.ActorLoss(
            clip_ratio=a.clip_ratio, clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode, entropy_coeff=a.entropy_coeff,
            use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
            temperature=temperature,
        )
        # Compiled for device memory; an offloaded opt_state comes there per call.
        state_sh = offload.device_shardings(jax.tree.map(lambda x: x.sharding, self.actor))
        self.actor_update = jax.jit(
            functools.partial(ts.actor_update, model=self.actor_model, loss=loss,
                              optim=self.actor_optim),
            in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0,
        )
        params_sh = state_sh.params
        self.log_probs = jax.jit(
            functools.partial(ts.log_probs_step, model=self.actor_model,
                              temperature=temperature, with_entropy=False),
            in_shardings=(params_sh, None),
        )
        self.actor_update = offload.onloaded(self.actor_update, self.offload["actor"],
                                             "opt_state")
        self.log_probs = offload.onloaded(self.log_probs, self.offload["ref"])
        if self.critic is not None:
            c = cfg.critic
            critic_sh = offload.device_shardings(jax.tree.map(lambda x: x.sharding, self.critic))
            kw = dict(model=self.critic_model, optim=self.critic_optim,
                      loss=ts.CriticLoss(c.cliprange_value, c.loss_agg_mode))
            alg = cfg.algorithm
            for name, fn, outs in (
                ("critic_update", functools.partial(ts.critic_update, **kw), (None,)),
                ("critic_update_from_rollout", functools.partial(
                    ts.critic_update_from_rollout, gamma=float(alg.gamma), lam=float(alg.lam),
                    **kw), (None, None)),
            ):
                step = jax.jit(fn, in_shardings=(critic_sh, None),
                               out_shardings=(critic_sh, *outs), donate_argnums=0)
                setattr(self, name, offload.onloaded(step, self.offload["critic"], "opt_state"))
            self.values = jax.jit(functools.partial(ts.values_step, model=self.critic_model),
                                  in_shardings=(critic_sh.params, None))
        self.peak_flops = peak_flops_per_device()
        del lay

    # ------------------------------------------------------------------------------ pieces

    def sampling(self, validate: bool = False) -> SamplingParams:
        ro = self.cfg.actor_rollout_ref.rollout
        src = ro.val_kwargs if validate else ro
        greedy = not src.do_sample or src.temperature == 0
        return SamplingParams(
            temperature=src.temperature if src.temperature > 0 else 1.0, top_k=src.top_k,
            top_p=src.top_p, do_sample=not greedy,
            max_response_length=self.cfg.data.max_response_length,
            eos_ids=tuple(self.tokenizer.eos_token_ids), pad_id=self.tokenizer.pad_token_id,
        )

    def generate(self, batch, n: int, sampling: SamplingParams, seed) -> Rollout:
        out = generate_sequences(
            self.engine, self.gen_params, batch.input_ids, batch.attention_mask, n=n,
            sampling=sampling, rng=seed,
        )
        return Rollout(
            prompt_ids=np.repeat(batch.input_ids, n, axis=0),
            prompt_mask=np.repeat(batch.attention_mask, n, axis=0),
            responses=np.asarray(out.responses), response_mask=np.asarray(out.response_mask),
            rollout_log_probs=np.asarray(out.rollout_log_probs),
            index=np.repeat(np.arange(len(batch.input_ids)), n),
        )

    def score(self, batch, ro: Rollout, n: int) -> np.ndarray:
        texts = [
            self.tokenizer.decode(r[: int(m.sum())].tolist())
            for r, m in zip(ro.responses, ro.response_mask, strict=True)
        ]
        rep = lambda xs: [x for x in xs for _ in range(n)]
        return score_batch(rep(batch.data_source), texts, rep(batch.ground_truth),
                           rep(batch.extra_info), custom_fn=self.reward_fn)

    def _chunk(self):
        a = self.cfg.actor_rollout_ref
        per_dev = (a.rollout.log_prob_micro_batch_size_per_device
                   or a.actor.ppo_micro_batch_size_per_device)
        return None if per_dev is None else per_dev * self.layouts.dp

    def _seqs(self, ro: Rollout, chunk: int | None):
        n = ro.responses.shape[0]
        chunk = min(chunk or n, n)
        arrays = ts.Sequences(ro.input_ids, ro.attention_mask, ro.responses, ro.response_mask)
        host = jax.tree.map(lambda x: batching.chunked(x.astype(np.int32), chunk), arrays)
        return batching.put(host, self.layouts.mesh, self.layouts.batch_axes, lead=1)

    def _plan(self, section, n_rows: int, n: int) -> batching.Plan:
        a = self.cfg.actor_rollout_ref.actor
        mini = (section.ppo_mini_batch_size or a.ppo_mini_batch_size) * n
        per_dev = section.ppo_micro_batch_size_per_device
        micro = mini if per_dev is None else per_dev * self.layouts.dp
        return batching.Plan(n_rows, mini, micro, section.ppo_epochs or a.ppo_epochs,
                             section.shuffle)

    def _values_in_update(self, n_rows: int, n: int) -> bool:
        """Whether the critic's update makes the rollout's values (`critic.values_in_update`):
        GAE, and one optimizer update a step (one epoch of one mini-batch)."""
        cfg = self.cfg
        return (cfg.critic.values_in_update and cfg.algorithm.adv_estimator == "gae"
                and self._plan(cfg.critic, n_rows, n).updates == 1)

    def _arranged(self, plan: batching.Plan, order, ro: Rollout, extra: dict):
        seqs = ts.Sequences(ro.input_ids.astype(np.int32), ro.attention_mask.astype(np.int32),
                            ro.responses.astype(np.int32), ro.response_mask.astype(np.int32))
        host = jax.tree.map(lambda x: x[order], (seqs, extra))
        mask = host[0].response_mask
        token_count = mask.sum(axis=(1, 2, 3)).astype(np.float32)
        seq_count = (mask.sum(-1) > 0).sum(axis=(1, 2)).astype(np.float32)
        dev = batching.put(host, self.layouts.mesh, self.layouts.batch_axes, lead=2)
        return dev, jax.numpy.asarray(token_count), jax.numpy.asarray(seq_count)

    # -------------------------------------------------------------------------------- step

    def step(self, batch) -> dict:
        cfg, timer = self.cfg, Timer()
        n = cfg.actor_rollout_ref.rollout.n
        seed = jax.random.fold_in(jax.random.key(cfg.trainer.seed + 1), self.global_step)
        metrics: dict = {}
        with timer("step"):
            with timer("gen"):
                ro = self.generate(batch, n, self.sampling(), seed)
            with timer("reward"):
                scores = self.score(batch, ro, n)
            seqs = self._seqs(ro, self._chunk())
            flat = lambda x: batching.unchunk(x)
            mask = jax.numpy.asarray(ro.response_mask, jax.numpy.float32)
            if cfg.algorithm.rollout_correction.bypass_mode:
                # verl's bypass mode: the engine's log-probs of the tokens it sampled (the
                # policy that generated them) are PPO's old log-probs; no forward pass.
                old_logp = jax.numpy.asarray(ro.rollout_log_probs) * mask
                metrics["training/old_log_prob_recomputed"] = 0.0
            else:
                with timer("old_log_prob"):
                    old_logp = flat(self.log_probs(self.actor.params, seqs)).block_until_ready()
                metrics["training/old_log_prob_recomputed"] = 1.0
                mx, mean = ppo.rollout_probs_diff(jax.numpy.asarray(ro.rollout_log_probs),
                                                  old_logp, mask)
                metrics["training/rollout_probs_diff_max"] = float(mx)
                metrics["training/rollout_probs_diff_mean"] = float(mean)
            ref_logp = None
            if self.ref_params is not None:
                with timer("ref"):
                    ref_logp = flat(self.log_probs(self.ref_params, seqs)).block_until_ready()
            # One critic update a step (GAE): its forward pass gives the values.
            fused = self.critic is not None and self._values_in_update(len(scores), n)
            values = None
            if self.critic is not None and not fused:
                with timer("values"):
                    values = flat(self.values(self.critic.params, seqs)).block_until_ready()
            with timer("adv"):
                token_scores = ppo.token_level_scores(jax.numpy.asarray(scores), mask)
                token_rewards = token_scores
                if cfg.algorithm.use_kl_in_reward:
                    beta = self.kl_state.kl_coef
                    token_rewards, current_kl = ppo.kl_in_reward(
                        token_scores, old_logp, ref_logp, mask, beta,
                        kind=cfg.algorithm.kl_penalty,
                    )
                    self.kl_state = self.kl_ctrl.update(self.kl_state, current_kl, len(scores))
                    metrics["actor/reward_kl_penalty"] = float(current_kl)
                    metrics["actor/reward_kl_penalty_coeff"] = float(beta)
                alg = cfg.algorithm
                if not fused:
                    adv, returns = batching.fetch(ppo.advantages(
                        token_rewards,
                        values if values is not None else jax.numpy.zeros_like(mask), mask,
                        jax.numpy.asarray(ro.index, jax.numpy.int32),
                        estimator=alg.adv_estimator, gamma=float(alg.gamma),
                        lam=float(alg.lam), norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                    ))
            host = batching.fetch({"old": old_logp, "ref": ref_logp, "values": values})
            if self.critic is not None:
                with timer("update_critic"):
                    plan = self._plan(cfg.critic, len(scores), n)
                    order = plan.order(cfg.trainer.seed * 7919 + self.global_step)
                    extra = ({"rewards": batching.fetch(token_rewards)} if fused else
                             {"values": host["values"], "returns": returns})
                    (seqs_c, ex), tok, sq = self._arranged(plan, order, ro, extra)
                    if fused:
                        self.critic, m, outs = self.critic_update_from_rollout(
                            self.critic, ts.CriticRolloutBatch(seqs_c, ex["rewards"], tok, sq))
                        host["values"], adv, returns = (
                            batching.unarrange(x, order) for x in batching.fetch(outs))
                    else:
                        self.critic, m = self.critic_update(
                            self.critic, ts.CriticBatch(seqs_c, ex["values"], ex["returns"],
                                                        tok, sq))
                    metrics.update(jax.device_get(m))
                if fused:
                    with timer("adv"):  # whitened over the whole batch, as GAE's are
                        adv = batching.fetch(ppo.whiten(adv, mask))
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    plan = self._plan(cfg.actor_rollout_ref.actor, len(scores), n)
                    order = plan.order(cfg.trainer.seed * 7919 + self.global_step + 1)
                    ref = host["ref"] if host["ref"] is not None else np.zeros_like(host["old"])
                    extra = {"old": host["old"], "adv": adv, "ref": ref}
                    (seqs_a, ex), tok, sq = self._arranged(plan, order, ro, extra)
                    self.actor, m = self.actor_update(
                        self.actor, ts.ActorBatch(seqs_a, ex["old"], ex["adv"], ex["ref"], tok, sq)
                    )
                    metrics.update(jax.device_get(m))
                with timer("update_weights"):
                    self.sync_weights()
        metrics.update(data_metrics(
            scores=scores, token_rewards=batching.fetch(token_rewards), advantages=adv,
            returns=returns, values=host["values"], response_mask=ro.response_mask,
            prompt_mask=ro.prompt_mask, max_response_length=cfg.data.max_response_length,
            max_prompt_length=cfg.data.max_prompt_length,
        ))
        metrics.update(timer.metrics())
        metrics.update(self._perf(ro, timer.times, cfg.actor_rollout_ref.actor.ppo_epochs))
        return {k: float(v) for k, v in metrics.items()}

    def _perf(self, ro: Rollout, times: dict, epochs: int) -> dict:
        seq_lens = ro.attention_mask.sum(-1)
        tokens = float(seq_lens.sum())
        devices = jax.device_count()
        out = {
            "perf/total_num_tokens": tokens, "perf/time_per_step": times["step"],
            "perf/throughput": tokens / (times["step"] * devices),
        }
        peak = self.peak_flops * devices
        if "update_actor" in times:
            flops = train_flops(self.actor_model.cfg, seq_lens, epochs)
            out["perf/mfu/actor"] = flops / (times["update_actor"] * peak)
        if "update_critic" in times:
            c_epochs = self.cfg.critic.ppo_epochs or epochs
            flops = train_flops(self.critic_model.cfg, seq_lens, c_epochs)
            out["perf/mfu/critic"] = flops / (times["update_critic"] * peak)
        return out

    def validate(self) -> dict:
        if self.val_loader is None:
            return {}
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        sums: dict[str, list[float]] = {}
        seed = jax.random.key(self.cfg.trainer.seed + 2)
        for batch in self.val_loader:
            ro = self.generate(batch, vk.n, self.sampling(validate=True), seed)
            scores = self.score(batch, ro, vk.n)
            for src, s in zip([x for x in batch.data_source for _ in range(vk.n)], scores,
                              strict=True):
                sums.setdefault(src, []).append(float(s))
        self.val_loader.set_state({**self.val_loader.get_state(), "epoch": 0, "step": 0})
        return {f"val-core/{src}/reward/mean@{vk.n}": float(np.mean(v))
                for src, v in sums.items()}

    # --------------------------------------------------------------------------------- run

    def sync_weights(self) -> None:
        """update_weights: the actor's parameters, train layout -> generate layout."""
        self.gen_params = reshard(self.actor.params, self.gen_shardings)
        jax.block_until_ready(self.gen_params)

    def log(self, metrics: dict) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, self.global_step)

    # --------------------------------------------------------------------------------- run

    def _next_batch(self):
        try:
            return next(self.train_loader)
        except StopIteration:  # an epoch ended: the loader moved to the next one
            return next(self.train_loader)

    def run(self) -> list[dict]:
        """Trains to `total_steps` (or the early stop); returns every logged step's metrics."""
        t, rb = self.cfg.trainer, self.cfg.trainer.rollback
        history = []
        try:
            if not self.restore():
                sft.warm_start(self)
                if t.val_before_train:
                    self.log(self.validate())
                if rb.enable:  # the rollback target until the first save
                    self.save()
            while self.global_step < self.total_steps:
                batch = self._next_batch()
                self.global_step += 1
                metrics = self.step(batch)
                metrics["training/epoch"] = float(self.train_loader.epoch)
                if self.fault_hook is not None:
                    metrics = self.fault_hook(self, metrics)
                cause = self.watch.cause(metrics) if rb.enable else None
                if cause is not None:
                    history.append(metrics)
                    self.log(metrics)
                    self.roll_back(cause)
                    continue
                self.watch.observe(metrics)
                if t.test_freq > 0 and (self.global_step % t.test_freq == 0
                                        or self.global_step == self.total_steps):
                    metrics.update(self.validate())
                history.append(metrics)
                self.log(metrics)
                self.recent_scores = [*self.recent_scores, metrics["critic/score/mean"]][-5:]
                stop = (t.early_stop_score is not None and len(self.recent_scores) == 5
                        and np.mean(self.recent_scores) >= t.early_stop_score)
                if stop or self.global_step == self.total_steps or (
                        t.save_freq > 0 and self.global_step % t.save_freq == 0):
                    self.save()
                if stop:
                    print(f"early stop at step {self.global_step}: mean score of the last 5 "
                          f"steps {np.mean(self.recent_scores):.3f} >= {t.early_stop_score}",
                          flush=True)
                    break
        finally:
            self.checkpointer.close()
            for tracker in self.trackers:
                tracker.close()
        return history


def train(cfg) -> list[dict]:
    """Runs `cfg` to `trainer.total_training_steps`; returns the metrics of every step."""
    start = time.perf_counter()
    trainer = Trainer(cfg)
    history = trainer.run()
    print(f"done: {trainer.global_step} steps in {time.perf_counter() - start:.1f}s, "
          f"metrics in {trainer.run_dir / 'metrics.jsonl'}")
    return history
