"""The forward passes every step reads: `Sequences` (token rows that carry their own layout)
and the log-probs, entropy and values over their targets, padded or packed
(`rlhf_jax.packing`). `train_steps` re-exports every name here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import core_algos
from rlhf_jax.models import Model, head


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



# ----------------------------------------------------------------------------- forward passes


def response_logits(model: Model, params, seqs: Sequences, temperature: float = 1.0):
    """Logits that predict each target token: [B, W, V] (divided by the temperature)."""
    logits_bwv = model.forward(params, seqs.input_ids, head_slice=seqs.head_slice,
                               positions=seqs.positions, segment_ids=seqs.segment_ids)
    return logits_bwv / temperature


def response_terms(model: Model, params, seqs: Sequences, temperature: float = 1.0,
                   chunk_size: int | None = None, *, with_entropy: bool = True,
                   entropy_grad: bool = False, with_sum_pi_squared: bool = False):
    """Log-probs of the targets and their entropy, `[B, W]` each (entropy None without
    `with_entropy`; no gradient through it without `entropy_grad`). With
    `with_sum_pi_squared` a third `[B, W]`, `sum_v pi_v^2` of each target's distribution
    (`core_algos.sum_pi_squared_from_logits`; the optimal token baseline's), no gradient.

    `chunk_size` (`lm_head_chunk_size`: tokens a device puts through the LM head at once,
    0 off, None automatic; `head.chunk_positions`) picks the chunked head, which never
    builds the float32 logits of the whole micro-batch (`head.model_token_terms`); else
    they come from the full logits."""
    chunk = head.chunk_positions(chunk_size, model, seqs.targets.shape)
    if chunk:
        out = head.model_token_terms(
            model, params, seqs.input_ids, seqs.positions, seqs.segment_ids, seqs.head_slice,
            seqs.targets, chunk=chunk, temperature=temperature, with_entropy=with_entropy,
            entropy_grad=entropy_grad, with_sum_pi_squared=with_sum_pi_squared)
        return (out[0], out[1] if with_entropy else None, *out[2:])
    logits = response_logits(model, params, seqs, temperature)
    logp = core_algos.logprobs_from_logits(logits, seqs.targets)
    spi = ((jax.lax.stop_gradient(core_algos.sum_pi_squared_from_logits(logits)),)
           if with_sum_pi_squared else ())
    if not with_entropy:
        return logp, None, *spi
    ent_logits = logits if entropy_grad else jax.lax.stop_gradient(logits)
    return logp, core_algos.entropy_from_logits(ent_logits), *spi


def response_values(model: Model, params, seqs: Sequences):
    """Values of the state before each target token, zero outside the loss mask: [B, W]."""
    values_bw = model.forward(params, seqs.input_ids, head_slice=seqs.head_slice,
                              positions=seqs.positions, segment_ids=seqs.segment_ids)
    return values_bw * seqs.loss_mask


def log_probs_step(params, seqs: Sequences, *, model: Model, temperature: float,
                   with_entropy: bool = False, lm_head_chunk_size: int | None = None,
                   with_sum_pi_squared: bool = False):
    """Log-probs (and entropy, and sum_pi_squared) of the responses, micro-batched over the
    leading axis.

    Args:
      seqs: arrays `[K, m, ...]`; K chunks run one after another (bounds activation memory).
      lm_head_chunk_size: the role's `lm_head_chunk_size` (`response_terms`).
      with_sum_pi_squared: also `sum_v pi_v^2` per token (`response_terms`).
    Returns:
      log_probs `[K, m, R]`; a tuple `(log_probs, entropy, sum_pi_squared)` of those asked
      for if `with_entropy` or `with_sum_pi_squared`, each `[K, m, R]`.
    """

    params = model.split_layers(params)  # once, not per chunk

    def one(chunk: Sequences):
        logp, ent, *spi = response_terms(
            model, params, chunk, temperature, lm_head_chunk_size, with_entropy=with_entropy,
            entropy_grad=True, with_sum_pi_squared=with_sum_pi_squared)
        out = (logp, *((ent,) if with_entropy else ()), *spi)
        return out if len(out) > 1 else logp

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
                          lm_head_chunk_size: int | None = None,
                          with_sum_pi_squared: bool = False):
    """`log_probs_step` on packed rows: log-probs `[M, R]` in the group's slots (with
    `with_sum_pi_squared`, the tuple `(log_probs, sum_pi_squared)`)."""
    params = model.split_layers(params)
    rows = packed.rows
    n_out = 2 if with_sum_pi_squared else 1
    zeros = (jnp.zeros(rows.targets.shape[1:], jnp.float32),) * n_out

    def fn(chunk):
        logp, _, *spi = response_terms(model, params, chunk, temperature, lm_head_chunk_size,
                                       with_entropy=False,
                                       with_sum_pi_squared=with_sum_pi_squared)
        return tuple(x.astype(jnp.float32) for x in (logp, *spi))

    out = tuple(gather_slots(x, packed.where) for x in _packed_map(fn, packed, zeros))
    return out if with_sum_pi_squared else out[0]


def packed_values_step(params, packed, *, model: Model):
    """`values_step` on packed rows: values `[M, R]` in the group's slots."""
    params = model.split_layers(params)
    zeros = jnp.zeros(packed.rows.targets.shape[1:], jnp.float32)
    fn = lambda chunk: response_values(model, params, chunk).astype(jnp.float32)
    return gather_slots(_packed_map(fn, packed, zeros), packed.where)
