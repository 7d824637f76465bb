"""The two updates of `Trainer.learn`: the critic's (which, with `critic.values_in_update`,
also makes the values and advantages) and the actor's, each on its role's arrangement of the
step's `Experience` (padded or packed micro-batches, `Trainer._arranged`)."""

from __future__ import annotations

import jax
import numpy as np

from rlhf_jax import batching, ppo
from rlhf_jax import train_steps as ts
from rlhf_jax.experience import Experience
from rlhf_jax.recovery import RunState


def update_critic(trainer, state: RunState, exp: Experience):
    """The critic's update; with `values_in_update` it also fills the values and the
    advantages (whitened over the whole batch, as GAE's are) and returns."""
    plan = trainer.critic_plan
    order = plan.order(trainer.cfg.trainer.seed * 7919 + state.step)
    if not trainer.values_in_update:
        extra = {"values": batching.fetch(exp.values), "returns": exp.returns}
        (seqs, ex), tok, sq, _ = trainer._arranged("critic", order, exp, extra)
        critic, m = trainer.critic_update(
            state.critic, ts.CriticBatch(seqs, ex["values"], ex["returns"], tok, sq))
        return state._replace(critic=critic), exp, jax.device_get(m)
    extra = {"rewards": batching.fetch(exp.token_rewards)}
    (seqs, ex), tok, sq, unarrange = trainer._arranged("critic", order, exp, extra)
    critic, m, outs = trainer.critic_update_from_rollout(
        state.critic, ts.CriticRolloutBatch(seqs, ex["rewards"], tok, sq))
    values, adv, returns = (unarrange(x) for x in batching.fetch(outs))
    mask = jax.numpy.asarray(exp.response_mask, jax.numpy.float32)
    adv = batching.fetch(ppo.whiten(adv, mask))
    exp = exp._replace(values=values, advantages=adv, returns=returns)
    return state._replace(critic=critic), exp, jax.device_get(m)

def update_actor(trainer, state: RunState, exp: Experience):
    """The actor's update on `exp`: the new state and its metrics."""
    plan = trainer.actor_plan
    order = plan.order(trainer.cfg.trainer.seed * 7919 + state.step + 1)
    old = batching.fetch(exp.old_log_probs)
    ref = batching.fetch(exp.ref_log_probs) if exp.ref_log_probs is not None \
        else np.zeros_like(old)
    extra = {"old": old, "adv": exp.advantages, "ref": ref}
    if exp.rollout_is_weights is not None:  # rollout correction's IS weights
        extra["is_weights"] = exp.rollout_is_weights
    (seqs, ex), tok, sq, _ = trainer._arranged("actor", order, exp, extra)
    actor, m = trainer.actor_update(
        state.actor, ts.ActorBatch(seqs, ex["old"], ex["adv"], ex["ref"], tok, sq,
                                   ex.get("is_weights")))
    return state._replace(actor=actor), jax.device_get(m)
