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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlhf_jax import core_algos
from rlhf_jax.models import Model, head
from rlhf_jax.packing import Packed


class TrainState(NamedTuple):
    """Parameters and optimizer state of one role, plus the rollback learning-rate scale."""

    params: Any
    opt_state: Any
    step: jax.Array  # optimizer steps taken (int32)
    lr_scale: jax.Array  # multiplies the schedule; rollback lowers it (float32)
    skipped: jax.Array  # updates skipped for a non-finite gradient norm (int32)


class Sequences(NamedTuple):
    """Token rows that carry their own layout, `[..., B, T]`; what every forward pass reads.

    `positions` are the RoPE positions and `segment_ids` say which tokens attend to which: a
    query sees the earlier keys of its own segment (0 is padding, never seen). The last W
    positions of a row hold its `targets` window: `targets[..., w]` is the token at
    position T - W + w, predicted from the one before it, and `loss_mask` marks the targets
    that count (the response tokens). A padded rollout row (`padded`) is one segment, its
    window the response; a packed row holds several segments, its window the whole row
    after the first token. Both are batches for the same functions.
    """

    input_ids: jax.Array  # [..., B, T] int32
    positions: jax.Array  # [..., B, T] int32
    segment_ids: jax.Array  # [..., B, T] int32, 0 on padding
    targets: jax.Array  # [..., B, W] int32, the tokens of the last W positions
    loss_mask: jax.Array  # [..., B, W] int32, 1 on the targets that count

    @classmethod
    def padded(cls, input_ids, attention_mask, responses, response_mask) -> Sequences:
        """Rollout rows `prompt (left-padded) + response (right-padded)`: one segment each,
        positions counted from the first real token, the response as the targets window.
        numpy in, numpy out (jax arrays: jax)."""
        xp = jnp if isinstance(attention_mask, jax.Array) else np
        mask = attention_mask.astype(xp.int32)
        positions = xp.maximum(xp.cumsum(mask, axis=-1) - 1, 0).astype(xp.int32)
        return cls(input_ids.astype(xp.int32), positions, mask, responses.astype(xp.int32),
                   response_mask.astype(xp.int32))

    @property
    def responses(self):
        return self.targets

    @property
    def response_mask(self):
        return self.loss_mask

    @property
    def head_slice(self) -> slice:
        """The positions whose outputs predict the targets (static: from the shapes)."""
        w = self.targets.shape[-1]
        return slice(-w - 1, -1)


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
class OptimConfig:
    lr: float
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    warmup_style: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    total_steps: int = 1
    grad_clip: float = 1.0

    @classmethod
    def from_config(cls, optim, grad_clip: float, total_steps: int) -> OptimConfig:
        """verl's `*.optim` keys (and the role's `grad_clip`) as the optimizer runs them:
        warm-up steps from `lr_warmup_steps_ratio` when `lr_warmup_steps` is -1, the
        schedule's length from the run's when `total_training_steps` is -1."""
        warmup = optim.lr_warmup_steps
        if warmup < 0:
            warmup = int(optim.lr_warmup_steps_ratio * total_steps)
        total = optim.total_training_steps if optim.total_training_steps > 0 else total_steps
        return cls(
            lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
            eps=optim.eps, warmup_steps=warmup, warmup_style=optim.warmup_style,
            min_lr_ratio=optim.min_lr_ratio, total_steps=max(total, 1), grad_clip=grad_clip,
        )


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


def lr_schedule(cfg: OptimConfig):
    """verl's schedules: linear warm-up, then constant or cosine down to min_lr_ratio * lr."""
    warm = max(cfg.warmup_steps, 0)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = jnp.where(warm > 0, jnp.minimum(step / max(warm, 1), 1.0), 1.0)
        if cfg.warmup_style == "cosine":
            span = max(cfg.total_steps - warm, 1)
            progress = jnp.clip((step - warm) / span, 0.0, 1.0)
            cos = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            decay = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos
            return cfg.lr * jnp.where(step < warm, ramp, decay)
        return cfg.lr * ramp

    return schedule


def step_schedule(cfg: OptimConfig, updates_per_step: int = 1):
    """`lr_schedule` indexed by optimizer updates when each PPO step makes `updates_per_step`.

    verl steps its scheduler once per `update_actor` / `update_critic` call, so warm-up and
    decay are counted in training steps (as `warmup_steps` and `total_steps` are) and the
    learning rate is constant within a step: update k uses the schedule at `k // U`.
    """
    schedule, u = lr_schedule(cfg), max(int(updates_per_step), 1)
    return lambda count: schedule(jnp.asarray(count) // u)


def make_optimizer(cfg: OptimConfig, updates_per_step: int = 1) -> optax.GradientTransformation:
    """AdamW on the schedule; clipping and the rollback scale are applied by the update.

    The optimizer state does not depend on `updates_per_step` (only the learning rate read
    from its update count does), so `init_state` may build it with the default.
    """
    return optax.adamw(
        step_schedule(cfg, updates_per_step), b1=cfg.betas[0], b2=cfg.betas[1], eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Which parameters an update trains: `where(path) -> bool` over the paths of the
    parameter tree (`jax.tree_util.keystr` strings, e.g. "['model']['embed_tokens']..."),
    None for all of them. The rest is frozen: no gradient, no optimizer state, unchanged.
    (LoRA: the adapters trainable on a frozen base.)"""

    where: Any = None  # Callable[[str], bool] | None

    def split(self, params):
        """`(trainable, frozen)`: two trees of `params`' structure, each with None where the
        other holds the leaf. Everything trainable: `(params, None)`."""
        if self.where is None:
            return params, None
        pick = lambda keep: jax.tree_util.tree_map_with_path(
            lambda path, x: x if self.where(jax.tree_util.keystr(path)) == keep else None,
            params)
        return pick(True), pick(False)

    def merge(self, trainable, frozen):
        if frozen is None:
            return trainable
        return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen,
                            is_leaf=lambda x: x is None)


ALL_TRAINABLE = Trainable()


def init_state(params, tx: optax.GradientTransformation,
               trainable: Trainable = ALL_TRAINABLE) -> TrainState:
    """A fresh state; the optimizer moments inherit the parameters' shardings.

    The moments are created with explicit `out_shardings`: `jax.jit(tx.init)` alone would
    leave their layout to XLA, which replicates the zeros (4x the per-device bytes of the
    moments on a 2x2 fsdp x tensor mesh). Counts and other scalars are replicated.
    """
    mesh_of = [x.sharding.mesh for x in jax.tree.leaves(params)
               if isinstance(x.sharding, jax.sharding.NamedSharding)]
    train = trainable.split(params)[0]  # the optimizer state exists for this part only
    if not mesh_of:
        opt_state = jax.jit(tx.init)(train)
    else:
        replicated = jax.sharding.NamedSharding(mesh_of[0], jax.sharding.PartitionSpec())
        shardings = optax.tree_map_params(
            tx, lambda _, sh: sh, jax.eval_shape(tx.init, train),
            jax.tree.map(lambda x: x.sharding, train),
            transform_non_params=lambda _: replicated)
        opt_state = jax.jit(tx.init, out_shardings=shardings)(train)
    state = TrainState(
        params, opt_state, jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32),
        jnp.zeros((), jnp.int32),
    )
    # Scalars (steps, counts) go onto the parameters' mesh, replicated, so that the state's
    # shardings are the same before and after a step and the step compiles once.
    if not mesh_of:
        return state
    return jax.tree.map(
        lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
        else jax.device_put(x, replicated),
        state,
    )


# ----------------------------------------------------------------------------- forward passes


def response_logits(model: Model, params, seqs: Sequences, temperature: float = 1.0):
    """Logits that predict each target token: [B, W, V] (divided by the temperature)."""
    logits_bwv = model.forward(params, seqs.input_ids, head_slice=seqs.head_slice,
                               positions=seqs.positions, segment_ids=seqs.segment_ids)
    return logits_bwv / temperature


def response_terms(model: Model, params, seqs: Sequences, temperature: float = 1.0,
                   chunk_size: int | None = None, *, with_entropy: bool = True,
                   entropy_grad: bool = False):
    """Log-probs of the targets and their entropy, `[B, W]` each (entropy None without
    `with_entropy`; no gradient through it without `entropy_grad`).

    `chunk_size` (`lm_head_chunk_size`: tokens a device puts through the LM head at once,
    0 off, None automatic; `head.chunk_positions`) picks the chunked head, which never
    builds the float32 logits of the whole micro-batch (`head.model_token_terms`); else
    they come from the full logits."""
    chunk = head.chunk_positions(chunk_size, model, seqs.targets.shape)
    if chunk:
        logp, ent = head.model_token_terms(
            model, params, seqs.input_ids, seqs.positions, seqs.segment_ids, seqs.head_slice,
            seqs.targets, chunk=chunk, temperature=temperature, with_entropy=with_entropy,
            entropy_grad=entropy_grad)
        return logp, (ent if with_entropy else None)
    logits = response_logits(model, params, seqs, temperature)
    logp = core_algos.logprobs_from_logits(logits, seqs.targets)
    if not with_entropy:
        return logp, None
    ent_logits = logits if entropy_grad else jax.lax.stop_gradient(logits)
    return logp, core_algos.entropy_from_logits(ent_logits)


def response_values(model: Model, params, seqs: Sequences):
    """Values of the state before each target token, zero outside the loss mask: [B, W]."""
    values_bw = model.forward(params, seqs.input_ids, head_slice=seqs.head_slice,
                              positions=seqs.positions, segment_ids=seqs.segment_ids)
    return values_bw * seqs.loss_mask


def log_probs_step(params, seqs: Sequences, *, model: Model, temperature: float,
                   with_entropy: bool = False, lm_head_chunk_size: int | None = None):
    """Log-probs (and entropy) of the responses, micro-batched over the leading axis.

    Args:
      seqs: arrays `[K, m, ...]`; K chunks run one after another (bounds activation memory).
      lm_head_chunk_size: the role's `lm_head_chunk_size` (`response_terms`).
    Returns:
      log_probs `[K, m, R]` (and entropy `[K, m, R]` if `with_entropy`).
    """

    params = model.split_layers(params)  # once, not per chunk

    def one(chunk: Sequences):
        logp, ent = response_terms(model, params, chunk, temperature, lm_head_chunk_size,
                                   with_entropy=with_entropy, entropy_grad=True)
        return (logp, ent) if with_entropy else logp

    return jax.lax.map(one, seqs)


def values_step(params, seqs: Sequences, *, model: Model):
    """Critic values `[K, m, R]` of `[K, m, ...]` chunks."""
    params = model.split_layers(params)
    return jax.lax.map(lambda chunk: response_values(model, params, chunk), seqs)


def gather_slots(x_rows, where, micro=None, k=None):
    """Per-token values of packed rows `[..., W]` -> the slots `[M, R]` of their sequences
    (`packing.Packed.where`), 0 off the responses. With `micro` and `k`, `x_rows` are the
    rows of micro-batch k alone, and the slots of other micro-batches get 0."""
    flat = x_rows.reshape(-1)
    n = flat.shape[0]
    if k is None:
        idx = jnp.where(where >= 0, where, n)
    else:
        idx = jnp.where((where >= 0) & (micro[:, None] == k), where - k * n, n)
    return jnp.take(flat, idx, mode="fill", fill_value=0)


def in_micro(packed, k):
    """`[M, 1]` 1 on the slots whose sequence is in micro-batch k."""
    return (packed.micro == k)[:, None].astype(packed.response_mask.dtype)


def _packed_map(fn, packed, zeros):
    """`fn(rows)` over the micro-batches of `packed` (rows `[K, dp, T]`), skipping those no
    rank fills; results stacked `[K, ...]`."""
    def one(xs):
        rows, on = xs
        return jax.lax.cond(on, fn, lambda _: zeros, rows)

    return jax.lax.map(one, (packed.rows, packed.active))


def packed_log_probs_step(params, packed, *, model: Model, temperature: float,
                          lm_head_chunk_size: int | None = None):
    """`log_probs_step` on packed rows: log-probs `[M, R]` in the group's slots."""
    params = model.split_layers(params)
    rows = packed.rows
    zeros = jnp.zeros(rows.targets.shape[1:], jnp.float32)
    fn = lambda chunk: response_terms(model, params, chunk, temperature, lm_head_chunk_size,
                                      with_entropy=False)[0].astype(jnp.float32)
    return gather_slots(_packed_map(fn, packed, zeros), packed.where)


def packed_values_step(params, packed, *, model: Model):
    """`values_step` on packed rows: values `[M, R]` in the group's slots."""
    params = model.split_layers(params)
    zeros = jnp.zeros(packed.rows.targets.shape[1:], jnp.float32)
    fn = lambda chunk: response_values(model, params, chunk).astype(jnp.float32)
    return gather_slots(_packed_map(fn, packed, zeros), packed.where)


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
