"""Jit-compiled steps of the actor and the critic: log-probs, values, and PPO updates.

Every update follows one contract, `step(state, batch) -> (state, metrics)`, with static
settings bound by `functools.partial` and `jax.jit` given explicit shardings and a donated
state; `critic_update_from_rollout` also returns what its forward pass made (the rollout's
values, advantages and returns), as a third result.

An update receives its whole PPO batch already arranged on host as `[U, K, m, ...]`: U optimizer
updates (ppo_epochs x mini-batches, shuffled), each accumulated over K micro-batches of m rows
(m = micro-batch per device x data-parallel size). Both loops are `lax.scan`s inside one
compiled call, and every loss uses the *global* token / sequence count of its mini-batch
(`core_algos`), so the result does not depend on K.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from rlhf_jax import core_algos
from rlhf_jax.forward import (  # noqa: F401  (re-exported: ts.Sequences, ts.log_probs_step, ...)
    Sequences,
    gather_slots,
    in_micro,
    log_probs_step,
    packed_log_probs_step,
    packed_values_step,
    response_logits,
    response_terms,
    response_values,
    values_step,
)
from rlhf_jax.models import Model
from rlhf_jax.optim import (  # noqa: F401  (re-exported: ts.OptimConfig, ts.init_state, ...)
    ALL_TRAINABLE,
    OptimConfig,
    Trainable,
    TrainState,
    init_state,
    lr_schedule,
    make_optimizer,
    step_schedule,
)
from rlhf_jax.packing import Packed


class ActorBatch(NamedTuple):
    seqs: Sequences  # or packing.Packed (per-token arrays then [U, M, R], in its slots)
    old_log_probs: jax.Array  # [U, K, m, R]
    advantages: jax.Array
    ref_log_probs: jax.Array  # zeros when the KL loss is off
    token_count: jax.Array  # [U] valid response tokens of each mini-batch
    seq_count: jax.Array  # [U] sequences of each mini-batch
    rollout_is_weights: jax.Array | None = None  # like old_log_probs; None: no IS weights


class CriticBatch(NamedTuple):
    seqs: Sequences  # or packing.Packed (per-token arrays then [U, M, R], in its slots)
    values: jax.Array  # [U, K, m, R] values of the rollout (the clipping anchor)
    returns: jax.Array
    token_count: jax.Array
    seq_count: jax.Array


class CriticRolloutBatch(NamedTuple):
    """A critic update that also makes the rollout's values (`critic_update_from_rollout`)."""

    seqs: Sequences  # or packing.Packed (per-token arrays then [U, M, R], in its slots)
    rewards: jax.Array  # [1, K, m, R] token-level rewards (scores and KL penalty)
    token_count: jax.Array  # [1]
    seq_count: jax.Array  # [1]


@dataclasses.dataclass(frozen=True)
class ActorLoss:
    """The actor's loss: a registered policy-loss mode (`core_algos.get_policy_loss`) with
    its settings, plus the entropy bonus and the KL loss."""

    loss_mode: str = "vanilla"  # actor.policy_loss.loss_mode
    policy: core_algos.PolicyLossConfig = core_algos.PolicyLossConfig()
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    lm_head_chunk_size: int | None = None  # actor.lm_head_chunk_size (see `response_terms`)
    # Bypass mode's rollout correction, made in the loss (`_policy_loss`); None otherwise.
    rollout_correction: core_algos.RolloutCorrection | None = None

    @classmethod
    def from_config(cls, actor, temperature: float, rollout_correction=None) -> ActorLoss:
        """From `actor_rollout_ref.actor`, the rollout temperature and
        `algorithm.rollout_correction` (it matters to the loss in bypass mode only)."""
        bypass = rollout_correction is not None and rollout_correction.bypass_mode
        return cls(
            rollout_correction=(core_algos.RolloutCorrection.from_config(rollout_correction)
                                if bypass else None),
            loss_mode=actor.policy_loss.loss_mode,
            policy=core_algos.PolicyLossConfig(
                clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low,
                clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
                tau_pos=actor.tau_pos, tau_neg=actor.tau_neg,
                clip_cov_ratio=actor.policy_loss.clip_cov_ratio,
                clip_cov_lb=actor.policy_loss.clip_cov_lb,
                clip_cov_ub=actor.policy_loss.clip_cov_ub,
                kl_cov_ratio=actor.policy_loss.kl_cov_ratio,
                ppo_kl_coef=actor.policy_loss.ppo_kl_coef, dro_beta=actor.policy_loss.dro_beta),
            loss_agg_mode=actor.loss_agg_mode, entropy_coeff=actor.entropy_coeff,
            use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef,
            kl_loss_type=actor.kl_loss_type, temperature=temperature,
            lm_head_chunk_size=actor.lm_head_chunk_size,
        )


@dataclasses.dataclass(frozen=True)
class CriticLoss:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


# ------------------------------------------------------------------------------------ updates


def _token_terms(model: Model, params, seqs: Sequences, loss: ActorLoss):
    """Log-probs of the targets and their entropy over the window, `[B, W]` each. With no
    entropy bonus the entropy is a metric only: no backward pass through it."""
    return response_terms(model, params, seqs, loss.temperature, loss.lm_head_chunk_size,
                          entropy_grad=bool(loss.entropy_coeff))


def _policy_loss(logp, mask, old_logp, adv, denoms, loss: ActorLoss, rollout_is_weights):
    """The registered policy loss (IS weights applied), or in bypass mode verl's bypass
    loss, corrected against the current policy; `(pg_loss, metrics with their prefixes)`."""
    policy_loss = functools.partial(core_algos.get_policy_loss(loss.loss_mode),
                                    config=loss.policy)
    if loss.rollout_correction is None:
        pg_loss, pg_metrics = policy_loss(old_logp, logp, adv, mask,
                                          loss_agg_mode=loss.loss_agg_mode,
                                          rollout_is_weights=rollout_is_weights, **denoms)
        return pg_loss, {f"actor/{k}": v for k, v in pg_metrics.items()}
    pg_loss, pg_metrics, corr_metrics = core_algos.compute_policy_loss_bypass_mode(
        old_logp, logp, adv, mask, correction=loss.rollout_correction,
        ppo_clip_loss=policy_loss, loss_agg_mode=loss.loss_agg_mode, **denoms)
    return pg_loss, {**{f"actor/{k}": v for k, v in pg_metrics.items()}, **corr_metrics}


def _actor_objective(logp, entropy, mask, old_logp, adv, ref_logp, token_count, seq_count,
                     loss: ActorLoss, rollout_is_weights=None):
    """The actor's loss from per-token terms `[S, R]` of whole sequences (one a row)."""
    denoms = dict(global_token_count=token_count, global_seq_count=seq_count)
    pg_loss, pg_metrics = _policy_loss(logp, mask, old_logp, adv, denoms, loss,
                                       rollout_is_weights)
    entropy = core_algos.agg_loss(entropy, mask, loss.loss_agg_mode, **denoms)
    total = pg_loss - loss.entropy_coeff * entropy
    metrics = {"actor/pg_loss": pg_loss, "actor/entropy": entropy}
    metrics.update(pg_metrics)
    if loss.use_kl_loss:
        kl = core_algos.kl_penalty(logp, ref_logp, loss.kl_loss_type)
        kl_loss = core_algos.agg_loss(kl, mask, loss.loss_agg_mode, **denoms)
        total = total + loss.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss
    return total, metrics


def _actor_micro_loss(params, mb, token_count, seq_count, *, model: Model, loss: ActorLoss):
    seqs, old_logp, adv, ref_logp, is_weights = mb
    logp, entropy = _token_terms(model, params, seqs, loss)
    return _actor_objective(logp, entropy, seqs.response_mask, old_logp, adv, ref_logp,
                            token_count, seq_count, loss, rollout_is_weights=is_weights)


def _actor_packed_micro_loss(params, mb, token_count, seq_count, *, model: Model,
                             loss: ActorLoss):
    """`_actor_micro_loss` on micro-batch k of packed rows: the rows' per-token terms are
    gathered into the slots of the group, the slots of other micro-batches masked out."""
    rows, k, (packed, old_logp, adv, ref_logp, is_weights) = mb
    logp, entropy = _token_terms(model, params, rows, loss)
    slot = functools.partial(gather_slots, where=packed.where, micro=packed.micro, k=k)
    mask = packed.response_mask * in_micro(packed, k)
    return _actor_objective(slot(logp), slot(entropy), mask, old_logp, adv, ref_logp,
                            token_count, seq_count, loss, rollout_is_weights=is_weights)


def _value_loss(vpreds, returns, old_values, mask, token_count, seq_count, loss: CriticLoss):
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
        vpreds, returns, old_values, mask, cliprange_value=loss.cliprange_value,
        loss_agg_mode=loss.loss_agg_mode, global_token_count=token_count,
        global_seq_count=seq_count,
    )
    vpred_mean = jnp.sum(vpreds * mask) / jnp.maximum(token_count, 1)
    metrics = {
        "critic/vf_loss": vf_loss, "critic/vf_clipfrac": vf_clipfrac,
        "critic/vpred_mean": vpred_mean,
    }
    return vf_loss, metrics


def _critic_micro_loss(params, mb, token_count, seq_count, *, model: Model, loss: CriticLoss):
    seqs, old_values, returns = mb
    vpreds = response_values(model, params, seqs)
    return _value_loss(vpreds, returns, old_values, seqs.response_mask, token_count, seq_count,
                       loss)


def _critic_rollout_micro_loss(params, mb, token_count, seq_count, *, model: Model,
                               loss: CriticLoss, gamma: float, lam: float):
    """The critic's loss on a micro-batch whose values and GAE returns come from this very
    forward pass: the values are its predictions (no gradient), as a separate values pass
    with the same parameters would give them. Aux: (metrics, (values, advantages, returns))."""
    seqs, rewards = mb
    vpreds = response_values(model, params, seqs)
    values = jax.lax.stop_gradient(vpreds)
    adv, returns = core_algos.compute_gae_return(rewards, values, seqs.response_mask, gamma, lam)
    vf_loss, metrics = _value_loss(vpreds, returns, values, seqs.response_mask, token_count,
                                   seq_count, loss)
    return vf_loss, (metrics, (values, adv, returns))


def _critic_packed_micro_loss(params, mb, token_count, seq_count, *, model: Model,
                              loss: CriticLoss):
    rows, k, (packed, old_values, returns) = mb
    vpreds = gather_slots(response_values(model, params, rows), packed.where, packed.micro, k)
    mask = packed.response_mask * in_micro(packed, k)
    return _value_loss(vpreds, returns, old_values, mask, token_count, seq_count, loss)


def _critic_packed_rollout_micro_loss(params, mb, token_count, seq_count, *, model: Model,
                                      loss: CriticLoss, gamma: float, lam: float):
    """`_critic_rollout_micro_loss` on micro-batch k of packed rows; its outputs hold the
    slots of micro-batch k (0 elsewhere), so they add up over the micro-batches."""
    rows, k, (packed, rewards) = mb
    vpreds = gather_slots(response_values(model, params, rows), packed.where, packed.micro, k)
    here = in_micro(packed, k)
    mask = packed.response_mask * here
    values = jax.lax.stop_gradient(vpreds)
    adv, returns = core_algos.compute_gae_return(rewards * here, values, mask, gamma, lam)
    vf_loss, metrics = _value_loss(vpreds, returns, values, mask, token_count, seq_count, loss)
    return vf_loss, (metrics, (values, adv * here, returns * here))


def _update(state: TrainState, micro_batches, counts, *, model: Model, micro_loss, tx,
            schedule, grad_clip: float, prefix: str, with_outputs: bool = False,
            trainable: Trainable = ALL_TRAINABLE):
    """All optimizer updates of one PPO update: scan over U updates, each over K micro-batches.

    Only `trainable`'s part of the parameters is differentiated and updated.
    `with_outputs`: `micro_loss`'s aux is `(metrics, outputs)`, and the outputs of every
    micro-batch come back stacked `[U, K, ...]` as a third result (packed: `[U, ...]`, the
    sum of the micro-batches', each of which fills its own slots).

    `micro_batches` is `(Sequences [U, K, m, ...], per-token arrays [U, K, m, R]...)` or,
    packed, `(packing.Packed [U, ...], per-token arrays in its slots [U, M, R]...)`; the
    micro loss gets one micro-batch, resp. `(rows of micro-batch k, k, the group)`."""

    packed = isinstance(micro_batches[0], Packed)

    def one_update(state: TrainState, xs):
        mbs, token_count, seq_count = xs
        # Split outside the gradient: the micro-batches' gradients accumulate per layer and
        # are stacked once, instead of each scattering into zeros of the stacked shape.
        train, frozen_stacked = trainable.split(state.params)
        frozen = None if frozen_stacked is None else model.split_layers(frozen_stacked)
        loss_of_trainable = lambda p, *a: micro_loss(trainable.merge(p, frozen), *a)
        grad_fn = jax.value_and_grad(loss_of_trainable, has_aux=True)
        params = model.split_layers(train)

        def grads_of(mb):
            (_, aux), g = grad_fn(params, mb, token_count, seq_count)
            m, out = aux if with_outputs else (aux, None)
            return g, m, out

        if packed:  # micro-batch k: its rows, k, and the group's slots (whole)
            group = mbs
            micro_xs = (group[0].rows, group[0].active, jnp.arange(group[0].active.shape[0]))
            as_mb = lambda xs: (xs[0], xs[2], group)
        else:
            micro_xs, as_mb = mbs, lambda xs: xs
        first = as_mb(jax.tree.map(lambda x: x[0], micro_xs))
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                             jax.eval_shape(grads_of, first))

        def accumulate(carry, xs):
            grads, metrics = carry
            if packed:  # a micro-batch that no rank fills is skipped
                g, m, out = jax.lax.cond(xs[1], grads_of, lambda _: zeros, as_mb(xs))
            else:
                g, m, out = grads_of(xs)
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, metrics, m)), out

        (grads, metrics), outputs = jax.lax.scan(accumulate, (zeros[0], zeros[1]), micro_xs)
        if packed and with_outputs:  # each micro-batch filled its own slots
            outputs = jax.tree.map(lambda x: jnp.sum(x, axis=0), outputs)
        grads = model.stack_layers(grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        scale = jnp.minimum(1.0, grad_clip / (grad_norm + 1e-6)) if grad_clip > 0 else 1.0
        grads = jax.tree.map(lambda g: jnp.where(finite, g * scale, 0.0), grads)
        updates, opt_state = tx.update(grads, state.opt_state, train)
        params = trainable.merge(optax.apply_updates(
            train, jax.tree.map(lambda u: u * state.lr_scale, updates)), frozen_stacked)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = TrainState(
            keep(params, state.params), keep(opt_state, state.opt_state),
            state.step + finite.astype(jnp.int32), state.lr_scale,
            state.skipped + (~finite).astype(jnp.int32),
        )
        metrics = dict(metrics)
        metrics[f"{prefix}/grad_norm"] = grad_norm
        metrics[f"{prefix}/lr"] = schedule(state.step) * state.lr_scale
        return new_state, (metrics, outputs)

    state, (metrics, outputs) = jax.lax.scan(one_update, state, (micro_batches, *counts))
    out = {k: jnp.mean(v) for k, v in metrics.items()}
    out[f"{prefix}/skipped_updates"] = state.skipped
    return (state, out, outputs) if with_outputs else (state, out)


def actor_update(state: TrainState, batch: ActorBatch, *, model: Model, loss: ActorLoss,
                 optim: OptimConfig, trainable: Trainable = ALL_TRAINABLE):
    """PPO actor update: clip + dual clip + entropy + optional KL loss -> (state, metrics)."""
    micro_loss = functools.partial(
        _actor_packed_micro_loss if isinstance(batch.seqs, Packed) else _actor_micro_loss,
        model=model, loss=loss)
    mbs = (batch.seqs, batch.old_log_probs, batch.advantages, batch.ref_log_probs,
           batch.rollout_is_weights)
    updates = batch.token_count.shape[0]  # U optimizer updates make one training step
    state, metrics = _update(
        state, mbs, (batch.token_count, batch.seq_count), model=model, micro_loss=micro_loss,
        tx=make_optimizer(optim, updates), schedule=step_schedule(optim, updates),
        grad_clip=optim.grad_clip, prefix="actor", trainable=trainable,
    )
    if loss.use_kl_loss:
        metrics["actor/kl_coef"] = jnp.asarray(loss.kl_loss_coef, jnp.float32)
    return state, metrics


def critic_update(state: TrainState, batch: CriticBatch, *, model: Model, loss: CriticLoss,
                  optim: OptimConfig, trainable: Trainable = ALL_TRAINABLE):
    """Clipped value-loss update of the critic. Returns (state, metrics)."""
    micro_loss = functools.partial(
        _critic_packed_micro_loss if isinstance(batch.seqs, Packed) else _critic_micro_loss,
        model=model, loss=loss)
    mbs = (batch.seqs, batch.values, batch.returns)
    updates = batch.token_count.shape[0]
    return _update(
        state, mbs, (batch.token_count, batch.seq_count), model=model, micro_loss=micro_loss,
        tx=make_optimizer(optim, updates), schedule=step_schedule(optim, updates),
        grad_clip=optim.grad_clip, prefix="critic", trainable=trainable,
    )


def critic_update_from_rollout(state: TrainState, batch: CriticRolloutBatch, *, model: Model,
                               loss: CriticLoss, optim: OptimConfig, gamma: float, lam: float,
                               trainable: Trainable = ALL_TRAINABLE):
    """The critic's values pass, GAE and update in one call, for one optimizer update a step.

    With a single update (one epoch of one mini-batch) the update's forward pass runs on the
    parameters a separate values pass would use, so it yields the rollout's values: each
    micro-batch takes them from its own forward pass (no gradient), computes its GAE returns
    (every row is its own recurrence) and the clipped value loss against them. One forward
    pass of the critic a step instead of two; the same numbers as `values_step`, GAE and
    `critic_update`, up to float rounding.

    Returns:
      `(state, metrics, (values, advantages, returns))`, the last three `[1, K, m, R]` in the
      batch's order, the advantages before whitening.
    """
    if batch.token_count.shape[0] != 1:
        raise ValueError("critic_update_from_rollout makes exactly one optimizer update, "
                         f"got a batch of {batch.token_count.shape[0]}")
    micro_loss = functools.partial(
        _critic_packed_rollout_micro_loss if isinstance(batch.seqs, Packed)
        else _critic_rollout_micro_loss, model=model, loss=loss, gamma=gamma, lam=lam)
    return _update(
        state, (batch.seqs, batch.rewards), (batch.token_count, batch.seq_count), model=model,
        micro_loss=micro_loss, tx=make_optimizer(optim, 1), schedule=step_schedule(optim, 1),
        grad_clip=optim.grad_clip, prefix="critic", with_outputs=True, trainable=trainable,
    )
