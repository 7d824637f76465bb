"""The trainer's compiled programs: the actor's and the critic's updates and the forward
passes (old / ref log-probs, values), padded and packed, each a `jax.jit` with explicit
shardings (and host offload of what the config offloads)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from rlhf_jax import batching, lora, offload, packing
from rlhf_jax import train_steps as ts
from rlhf_jax.metrics import peak_flops_per_device
from rlhf_jax.models.lora import strip


def compile_steps(trainer, actor: ts.TrainState, critic: ts.TrainState | None) -> None:
    """Sets `trainer`'s step functions: `actor_update`, `log_probs` / `ref_log_probs` and
    their packed twins, and with a critic `critic_update`, `critic_update_from_rollout`,
    `values`, `packed_values`; plus `peak_flops`. Compiled on first call (or ahead, by
    `precompile`)."""
    cfg, off = trainer.cfg, trainer.offload
    arr = cfg.actor_rollout_ref
    temperature = arr.rollout.temperature
    loss = ts.ActorLoss.from_config(arr.actor, temperature, cfg.algorithm.rollout_correction)
    # Compiled for device memory; an offloaded opt_state comes there per call.
    state_sh = offload.device_shardings(jax.tree.map(lambda x: x.sharding, actor))
    trainer.actor_update = offload.onloaded(jax.jit(
        functools.partial(ts.actor_update, model=trainer.actor_model, loss=loss,
                          optim=trainer.actor_optim, trainable=trainer.trainable["actor"]),
        in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0,
    ), off["actor"], "opt_state")

    def policy_pass(step, chunk_size, spi=False, base=False):  # the actor's / the ref's
        kw = {"with_entropy": False} if step is ts.log_probs_step else {}
        # base: the LoRA actor's reference, its base without the adapters (`lora.strip`)
        model = lora.base_model(trainer.actor_model) if base else trainer.actor_model
        return offload.onloaded(jax.jit(
            functools.partial(step, model=model, temperature=temperature,
                              lm_head_chunk_size=chunk_size, with_sum_pi_squared=spi, **kw),
            in_shardings=(strip(state_sh.params) if base else state_sh.params, None)),
            off["ref"])

    actor_chunk, ref_chunk = arr.actor.lm_head_chunk_size, arr.ref.lm_head_chunk_size
    # the old log-probs with sum_pi_squared when the estimator reads it (verl's
    # actor.calculate_sum_pi_squared): a tuple `(log_probs, sum_pi_squared)`
    spi = ("sum_pi_squared" in trainer.estimator.needs
           or trainer.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared)
    for step, name in ((ts.log_probs_step, "log_probs"),
                       (ts.packed_log_probs_step, "packed_log_probs")):
        fn = policy_pass(step, actor_chunk, spi)  # old log-probs (and ref's, when the same)
        setattr(trainer, name, fn)
        same = ref_chunk == actor_chunk and not spi and not trainer.ref_from_base
        setattr(trainer, name.replace("log_probs", "ref_log_probs"),
                fn if same else policy_pass(step, ref_chunk, base=trainer.ref_from_base))
    if critic is not None:
        c, alg = cfg.critic, cfg.algorithm
        critic_sh = offload.device_shardings(jax.tree.map(lambda x: x.sharding, critic))
        kw = dict(model=trainer.critic_model, optim=trainer.critic_optim,
                  trainable=trainer.trainable["critic"],
                  loss=ts.CriticLoss(c.cliprange_value, c.loss_agg_mode))
        for name, fn, outs in (
            ("critic_update", functools.partial(ts.critic_update, **kw), (None,)),
            ("critic_update_from_rollout", functools.partial(
                ts.critic_update_from_rollout, gamma=float(alg.gamma), lam=float(alg.lam),
                **kw), (None, None)),
        ):
            step = jax.jit(fn, in_shardings=(critic_sh, None),
                           out_shardings=(critic_sh, *outs), donate_argnums=0)
            setattr(trainer, name, offload.onloaded(step, off["critic"], "opt_state"))
        for name, step in (("values", ts.values_step), ("packed_values", ts.packed_values_step)):
            setattr(trainer, name, jax.jit(functools.partial(step, model=trainer.critic_model),
                                           in_shardings=(critic_sh.params, None)))
    trainer.peak_flops = peak_flops_per_device()


def pack_plan(trainer, role: str, group: int) -> packing.PackPlan | None:
    """How `role`'s groups of `group` sequences pack (None: padded; `Trainer.pack_budgets`)."""
    budget, d = trainer.pack_budgets[role], trainer.cfg.data
    return None if budget is None else packing.PackPlan(
        group, trainer.layouts.dp, budget, d.max_prompt_length, d.max_response_length)


def forward(trainer, name: str, params, seqs: ts.Sequences, chunks):
    """One forward pass over a step's sequences, `name` old (log-probs), ref or values:
    `[N, R]`, padded (`chunks()`: the padded rows on the mesh) or packed by the pass's token
    budget. The old pass of an estimator that reads sum_pi_squared gives the tuple
    `(log_probs, sum_pi_squared)`."""
    plan = pack_plan(trainer, name, seqs.input_ids.shape[0])
    if plan is None:
        fn = getattr(trainer, {"old": "log_probs", "ref": "ref_log_probs"}.get(name, name))
        return jax.block_until_ready(jax.tree.map(batching.unchunk, fn(params, chunks())))
    n = seqs.input_ids.shape[0]
    host, slots = packing.pack(plan, seqs, np.arange(n)[None])
    one = batching.put_packed(jax.tree.map(lambda x: x[0], host), trainer.layouts.mesh,
                              trainer.layouts.batch_axes, lead=0)
    fn = getattr(trainer, {"old": "packed_log_probs", "ref": "packed_ref_log_probs",
                           "values": "packed_values"}[name])
    return jax.tree.map(lambda x: packing.from_slots(x[None], slots, n),
                        batching.fetch(fn(params, one)))
