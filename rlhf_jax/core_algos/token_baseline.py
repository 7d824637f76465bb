"""The Optimal Token Baseline (OTB): a per-time-step group baseline weighted by path variance.

verl counterpart: `compute_optimal_token_baseline_advantage` and
`compute_multi_turn_optimal_token_baseline_advantage` (`tir_optimal_token_baseline`) of
`verl/trainer/ppo/core_algos.py`.

For a token t of row i: `G_t = sum_{s >= t} m_s r_s` (reward to go),
`w_t = 1 - 2 pi_t + sum_v pi_v^2` (`pi_t = exp(old_log_prob)`, the squared gradient norm of
the log-softmax at the sampled token), times `rho_t^2` with rollout importance weights, and
`W_t = sum_{s <= t} m_s w_s`. In each group (prompt) of more than one row the baseline of
step t is `B_t = sum_i G_it W_it m_it / (sum_i W_it m_it + epsilon)`; a group of one has
`B = 0`. `A = (G - B) * m`, and `returns = G`. `sum_pi_squared` comes from the actor's forward
pass (verl's `actor.calculate_sum_pi_squared`).
"""

from __future__ import annotations

import jax.numpy as jnp

from rlhf_jax.core_algos.groups import _replicated, dense_group_ids, segment
from rlhf_jax.core_algos.masked import _as_mask


def _reward_to_go(rewards, m):
    return jnp.flip(jnp.cumsum(jnp.flip(rewards * m, -1), axis=-1), -1)


def _path_weights(old_log_probs, sum_pi_squared, rollout_is_weights, m):
    """`W_t = sum_{s <= t} m_s w_s` with `w = (1 - 2 exp(old) + sum_pi^2) * rho^2`."""
    w = 1.0 - 2.0 * jnp.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * jnp.square(jnp.asarray(rollout_is_weights).astype(w.dtype))
    return jnp.cumsum(w * m, axis=-1)


def _baseline(returns, weights, mask, ids, members, lengths, epsilon, handle_zero_tail):
    """The group baseline `[batch, time]` over time positions `0..time-1` of each row.

    Args:
      returns, weights, mask: `[batch, time]` (G, W and the positions that count).
      ids: dense group ids `[batch]`.
      members: `[batch]` bool, the rows that belong to their group (others add nothing).
      lengths: `[batch]` int response lengths.
      epsilon, handle_zero_tail: see `compute_optimal_token_baseline_advantage`.
    """
    inside = members[:, None] & (mask != 0)
    gw = _replicated(jnp.where(inside, returns * weights * mask, 0))
    ww = _replicated(jnp.where(inside, weights * mask, 0))
    base = segment(gw, ids) / (segment(ww, ids) + epsilon)
    n = segment(members.astype(jnp.int32), ids)
    base = jnp.where((n > 1)[:, None], base, 0)
    if handle_zero_tail:
        # the unique longest row of a group: no baseline past the second-longest row's end
        lengths = jnp.where(members, lengths, -1)
        longest = segment(lengths, ids, "max")
        n_longest = segment((members & (lengths == longest)).astype(jnp.int32), ids)
        second = segment(jnp.where(lengths == longest, -1, lengths), ids, "max")
        tail = (members & (n > 1) & (n_longest == 1) & (lengths == longest)
                & (longest > second))
        t = jnp.arange(returns.shape[-1])
        base = jnp.where(tail[:, None] & (t[None, :] >= second[:, None]), 0, base)
    return base


def _inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
            rollout_is_weights):
    """`(mask, rewards to go, path weights)` of an OTB call's arguments."""
    rewards = jnp.asarray(token_level_rewards)
    m = _as_mask(response_mask, rewards)
    weights = _path_weights(jnp.asarray(old_log_probs).astype(rewards.dtype),
                            jnp.asarray(sum_pi_squared).astype(rewards.dtype),
                            rollout_is_weights, m)
    return m, _reward_to_go(rewards, m), weights


def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index,
                                             old_log_probs, sum_pi_squared,
                                             rollout_is_weights=None, handle_zero_tail=True,
                                             epsilon=1e-8):
    """Optimal Token Baseline advantages (see the module doc), on the time axis as it is.

    `handle_zero_tail`: in a group whose longest row is unique and longer than the second
    longest, that row's baseline is 0 from the second-longest length on (positions counted
    from the start of the row, as verl, which assumes padding at the end).

    Args:
      token_level_rewards, response_mask: `[batch, time]`.
      index: `[batch]` group ids.
      old_log_probs: `[batch, time]` log-probs of the sampled tokens under the rollout policy.
      sum_pi_squared: `[batch, time]` `sum_v pi_v^2` of each step's next-token distribution.
      rollout_is_weights: `[batch, time]` rollout importance weights, or None.
      handle_zero_tail: see above.
      epsilon: added to the baseline's denominator.

    Returns:
      `(advantages, returns)`, each `[batch, time]`; returns are the rewards to go.

    verl: `core_algos.compute_optimal_token_baseline_advantage`.
    """
    m, returns, weights = _inputs(token_level_rewards, response_mask, old_log_probs,
                                  sum_pi_squared, rollout_is_weights)
    ids = dense_group_ids(index)
    lengths = _replicated(jnp.sum(m, axis=-1).astype(jnp.int32))
    members = jnp.ones(ids.shape, bool)
    base = _baseline(returns, weights, m, ids, members, lengths, epsilon, handle_zero_tail)
    return (returns - base) * m, returns


def _compact(x, keep):
    """Moves each row's kept entries to its front, in order, zeros after: a stable sort of
    the row's positions by `not keep`, then a gather (row-local, so a sharded batch stays)."""
    order = jnp.argsort(~keep, axis=-1, stable=True)
    first = jnp.arange(x.shape[-1])[None, :] < jnp.sum(keep, axis=-1, keepdims=True)
    return jnp.where(first, jnp.take_along_axis(x, order, axis=-1), 0)


def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards, response_mask,
                                                        index, old_log_probs, sum_pi_squared,
                                                        rollout_is_weights=None,
                                                        handle_zero_tail=True,
                                                        epsilon=1e-8):
    """OTB for multi-turn (tool-integrated) responses: time steps are counted over the valid
    tokens only, so observation spans masked inside a response do not misalign the rows.

    Each row's valid tokens (mask != 0) are moved to the front, keeping their order; the
    baseline is computed over these positions (a row with no valid token belongs to no
    group; a group of one gets no baseline), the zero tail uses the rows' valid-token counts,
    and the advantages are put back at the valid positions. `W` and `G` are those of the
    uncompacted row (`G` sums the rewards of later valid tokens; `returns` is `G`).

    Args:
      token_level_rewards, response_mask: `[batch, time]`; the mask may have holes
        (observation spans of a multi-turn response).
      index: `[batch]` group labels: any integers (under jit too) or, called eagerly, verl's
        string uids.
      old_log_probs: `[batch, time]` log-probs of the sampled tokens under the rollout policy.
      sum_pi_squared: `[batch, time]` `sum_v pi_v^2` of each step's next-token distribution.
      rollout_is_weights: `[batch, time]` rollout importance weights, or None.
      handle_zero_tail: as in `compute_optimal_token_baseline_advantage`.
      epsilon: added to the baseline's denominator.

    Returns:
      `(advantages, returns)`, each `[batch, time]`; returns are the rewards to go.

    verl: `core_algos.compute_multi_turn_optimal_token_baseline_advantage`.
    """
    m, returns, weights = _inputs(token_level_rewards, response_mask, old_log_probs,
                                  sum_pi_squared, rollout_is_weights)
    keep = m != 0
    pos = jnp.cumsum(keep, axis=-1) - 1
    lengths = _replicated(jnp.sum(keep, axis=-1).astype(jnp.int32))
    t = jnp.arange(returns.shape[-1])
    compact_mask = (t[None, :] < lengths[:, None]).astype(returns.dtype)
    ids = dense_group_ids(index)
    base = _baseline(_compact(returns, keep), _compact(weights, keep), compact_mask,
                     ids, lengths > 0, lengths, epsilon, handle_zero_tail)
    base_at = jnp.take_along_axis(base, jnp.clip(pos, 0, returns.shape[-1] - 1), axis=-1)
    return (returns - base_at) * m, returns

