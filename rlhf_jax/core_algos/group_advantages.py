"""More outcome estimators with group (prompt) baselines: OPO, GRPO pass@k, GPG, GDPO and the
vectorised RLOO of verl.

verl counterpart: `compute_opo_outcome_advantage`, `compute_grpo_passk_outcome_advantage`,
`compute_gpg_outcome_advantage`, `compute_gdpo_outcome_advantage`,
`compute_rloo_vectorized_outcome_advantage` of `verl/trainer/ppo/core_algos.py`.

As in `advantages`: `[batch, time]` arrays, `score_i = sum_t r_it`, group ids of any kind
(`groups.dense_group_ids`), segment ops under jit, and `(advantages, returns)` out with
`returns` equal to `advantages` (as verl), the row's scalar broadcast over its masked tokens.
"""

from __future__ import annotations

import jax.numpy as jnp

from rlhf_jax.core_algos.advantages import _group_scores, compute_grpo_outcome_advantage
from rlhf_jax.core_algos.groups import _replicated, dense_group_ids, group_stats, safe_sqrt, segment
from rlhf_jax.core_algos.masked import _as_mask, masked_whiten


def _broadcast(adv_b, m):
    adv = adv_b[:, None] * m
    return adv, adv


def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    """OPO (arXiv:2505.23585): the length-weighted group mean as the baseline.

    With `l_i = sum_t m_it` (response length): `b_g = sum_g l_i * score_i / sum_g l_i` for a
    group of more than one row (0 when its rows have no tokens at all), `b_g = 0` for a group
    of one; `A_i = score_i - b_g`.

    Args:
      token_level_rewards, response_mask: `[batch, time]`.
      index: `[batch]` group ids.
      epsilon: unused; kept for verl's signature.

    verl: `core_algos.compute_opo_outcome_advantage`.

    Returns:
      `(advantages, returns)`, each `[batch, time]` and 0 outside `response_mask`; for this
      outcome estimator both are the advantages, as verl's.
    """
    del epsilon
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    lengths = _replicated(jnp.sum(m, axis=-1))
    n = segment(jnp.ones_like(scores), ids)
    num, den = segment(lengths * scores, ids), segment(lengths, ids)
    baseline = jnp.where((n > 1) & (den > 0), num / jnp.where(den > 0, den, 1), 0)
    return _broadcast(scores - baseline, m)


def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index,
                                         epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """GRPO for pass@k (arXiv:2503.19595): only the best response of a group learns.

    Per group: the best row gets `A = r_max - r_second` (the two largest scores; 0 on a tie),
    divided by `std_g + epsilon` (unbiased group std) when `norm_adv_by_std_in_grpo`; every
    other row gets 0. verl raises for a group of one; under jit that cannot be, so such a
    row gets 0.

    Args:
      token_level_rewards, response_mask: `[batch, time]`.
      index: `[batch]` group ids.
      epsilon: added to the std.
      norm_adv_by_std_in_grpo: divide by the group std (`algorithm.norm_adv_by_std_in_grpo`).

    verl: `core_algos.compute_grpo_passk_outcome_advantage`.

    Returns:
      `(advantages, returns)`, each `[batch, time]` and 0 outside `response_mask`; for this
      outcome estimator both are the advantages, as verl's.
    """
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    n, _, var = group_stats(scores, ids)
    best = segment(scores, ids, "max")
    is_best = scores == best
    n_best = segment(is_best.astype(scores.dtype), ids)
    runner_up = segment(jnp.where(is_best, -jnp.inf, scores), ids, "max")
    second = jnp.where(n_best > 1, best, runner_up)
    gap = jnp.where(is_best & (n > 1), best - jnp.where(n > 1, second, best), 0)
    if norm_adv_by_std_in_grpo:
        gap = gap / (safe_sqrt(var) + epsilon)
    return _broadcast(gap, m)


def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                  f_norm=1.0):
    """GPG (arXiv:2504.02546): group-centred scores scaled up by the share of zero scores.

    `alpha = batch / max(#{i: score_i != 0}, 1)` over the whole batch; per group the mean
    (0 for a group of one); `A_i = alpha * (score_i - mean_g) / f_norm`. verl's `alpha`
    argument is overwritten by this formula, so it is not taken here.

    Args:
      token_level_rewards, response_mask: `[batch, time]`.
      index: `[batch]` group ids.
      epsilon: unused; kept for verl's signature.
      f_norm: a constant divisor (verl's default 1).

    verl: `core_algos.compute_gpg_outcome_advantage`.

    Returns:
      `(advantages, returns)`, each `[batch, time]` and 0 outside `response_mask`; for this
      outcome estimator both are the advantages, as verl's.
    """
    del epsilon
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    n, mean, _ = group_stats(scores, ids)
    alpha = scores.shape[0] / jnp.maximum(jnp.count_nonzero(scores), 1).astype(scores.dtype)
    return _broadcast(alpha * (scores - jnp.where(n > 1, mean, 0)) / f_norm, m)


def compute_gdpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, reward_components=None,
                                   reward_weights=None):
    """GDPO (arXiv:2601.05242): GRPO on each reward dimension apart, summed, then whitened.

    For each dimension k with scores `s_k` (`[batch]`): `A_k` = the GRPO advantage of `s_k`
    in its group (`compute_grpo_outcome_advantage`); `A = sum_k w_k A_k` (`w` default 1);
    `advantages = masked_whiten(A * m, m) * m` over the batch. Without components the one
    dimension is the summed token-level reward (verl's fallback), i.e. whitened GRPO.

    Args:
      token_level_rewards, response_mask: `[batch, time]`.
      index: `[batch]` group ids.
      epsilon, norm_adv_by_std_in_grpo: as GRPO.
      reward_components: `[K, batch]` per-dimension scores (verl reads them from the reward
        function's extra outputs named by `algorithm.gdpo_reward_keys`), or None.
      reward_weights: `[K]` weights (`algorithm.gdpo_reward_weights`), or None for ones.

    verl: `core_algos.compute_gdpo_outcome_advantage`.

    Returns:
      `(advantages, returns)`, each `[batch, time]` and 0 outside `response_mask`; for this
      outcome estimator both are the advantages, as verl's.
    """
    rewards = jnp.asarray(token_level_rewards)
    m = _as_mask(response_mask, rewards)
    if reward_components is None:
        components = jnp.sum(rewards, axis=-1)[None]
    else:
        components = jnp.asarray(reward_components).astype(rewards.dtype)
    k = components.shape[0]
    weights = (jnp.ones((k,), rewards.dtype) if reward_weights is None
               else jnp.asarray(reward_weights, rewards.dtype))
    ids = dense_group_ids(index)
    ones = jnp.ones((rewards.shape[0], 1), rewards.dtype)
    total = jnp.zeros((rewards.shape[0],), rewards.dtype)
    for j in range(k):  # K is small and static
        adv_j, _ = compute_grpo_outcome_advantage(
            components[j][:, None], ones, ids, epsilon=epsilon,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        total = total + weights[j] * adv_j[:, 0]
    adv = masked_whiten(total[:, None] * m, m) * m
    return adv, adv


def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index,
                                              epsilon=1e-6):
    """verl's vectorised RLOO: `A_i = (n score_i - sum_g) / (n - 1)` for groups of n > 1, and
    0 for a group of one (the loop version, `compute_rloo_outcome_advantage`, keeps the score
    there).

    verl: `core_algos.compute_rloo_vectorized_outcome_advantage`.

    Args:
      token_level_rewards: `[batch, time]` rewards per token (an outcome score sits on the
        last response token).
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      index: `[batch]` group labels: any integers (under jit too) or, called eagerly, verl's
        string uids.
      epsilon: added to the denominator (the group std or count).

    Returns:
      `(advantages, returns)`, each `[batch, time]` and 0 outside `response_mask`; for this
      outcome estimator both are the advantages, as verl's.
    """
    del epsilon
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    n = segment(jnp.ones_like(scores), ids)
    total = segment(scores, ids)
    return _broadcast(jnp.where(n > 1, (n * scores - total) / jnp.maximum(n - 1, 1), 0), m)
