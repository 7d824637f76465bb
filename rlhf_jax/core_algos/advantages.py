"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (+baseline), ReMax.

verl counterpart: the `compute_*_advantage*` functions of `verl/trainer/ppo/core_algos.py`,
same names, same arguments (minus verl's `config` object), same numbers.

Shapes: `[batch, time]` over response tokens, `mask` 1 up to and including EOS. Every
estimator returns `(advantages, returns)`, both `[batch, time]`. Time recurrences are reverse
`jax.lax.scan`s (GAE and REINFORCE++ first check for prefix masks, where their recurrence is
a discounted reverse cumulative sum done as matrix products) and group statistics are
`jax.ops.segment_sum`s, so everything runs under `jax.jit` with static shapes. The functions
are differentiable, but advantages are targets: a trainer computes them outside its gradient
(verl wraps them in `torch.no_grad`).

Group ids (`index`): verl groups by a Python dict over prompt uids; here `index` is a
`[batch]` array of any integer ids (under jit), or of any hashable labels such as verl's
string uids (called eagerly); `groups.dense_group_ids` maps them to `[0, batch)` first. The
`num_groups` argument of the group estimators is kept for compatibility and unused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.core_algos.groups import _replicated, dense_group_ids, group_stats, safe_sqrt
from rlhf_jax.core_algos.masked import _as_mask, masked_whiten

# Time steps per block of `_reverse_scan_time`: a [batch, 128] float32 block of 512 rows is
# 256 KiB, so a block's inputs and outputs stay in the CPU's L2 cache while it is scanned.
TIME_BLOCK = 128


def _reverse_scan_time(step, carry, *xs_bt, block: int | None = None):
    """Runs `step(carry, x_t) -> (carry, y_t)` from the last time step to the first.

    The time axis is cut into blocks of `block` steps, last block first: each block is sliced
    out of the `[batch, time]` inputs, transposed to `[block, batch]`, scanned, transposed
    back and written into place. A scan reads one `[batch]` column per step, so the
    transposes are needed; done per block they stay in cache, where transposing the whole
    `[batch, time]` arrays (and transposed reads fused into the consumers of the output) costs
    several times the recurrence itself on CPU. A time axis of at most `block` steps is one
    block.

    Args:
      xs_bt: arrays `[batch, time]`; the scan walks their time axis.
      block: time steps per block (default `TIME_BLOCK`).

    Returns:
      The stacked outputs `y` as `[batch, time]`.
    """
    t = xs_bt[0].shape[1]
    block = TIME_BLOCK if block is None else block

    def scan_block(carry, start, size):
        blk = tuple(jax.lax.dynamic_slice_in_dim(x, start, size, axis=1).T for x in xs_bt)
        carry, ys_tb = jax.lax.scan(step, carry, blk, reverse=True)
        return carry, ys_tb.T

    if t <= block:
        return scan_block(carry, 0, t)[1]
    n, rem = divmod(t, block)
    y_dtype = jax.eval_shape(step, carry, tuple(x[:, 0] for x in xs_bt))[1].dtype
    out_bt = jnp.zeros_like(xs_bt[0], dtype=y_dtype)  # keeps the batch sharding
    if rem:  # the partial block at the end runs first
        carry, ys = scan_block(carry, n * block, rem)
        out_bt = jax.lax.dynamic_update_slice_in_dim(out_bt, ys, n * block, axis=1)

    def body(j, state):
        carry, out_bt = state
        start = (n - 1 - j) * block
        carry, ys = scan_block(carry, start, block)
        return carry, jax.lax.dynamic_update_slice_in_dim(out_bt, ys, start, axis=1)

    return jax.lax.fori_loop(0, n, body, (carry, out_bt))[1]


def _next(x_bt):
    """`x` one time step ahead: `out[:, t] = x[:, t + 1]`, 0 after the last step."""
    return jnp.concatenate([x_bt[:, 1:], jnp.zeros_like(x_bt[:, :1])], axis=1)


# Time steps per block of `_discounted_reverse_cumsum`: the in-block sums are one
# [rows, 32] x [32, 32] product; larger blocks cost more FLOPs, smaller ones more levels.
SUM_BLOCK = 32


def _discounted_reverse_cumsum(w_bt, discount, block: int | None = None):
    """`y_t = sum_{s >= t} discount^(s - t) w_s` along the time axis of `[batch, time]`.

    The time axis is cut into blocks of `block` steps. One matrix product with the constant
    `[block, block]` matrix `discount^(s - t) [s >= t]` gives every in-block sum; the sums at
    the block starts obey the same recurrence with `discount^block` over blocks (recursively),
    and each position adds `discount^(block - t')` times the next block's start value. A
    handful of passes over the arrays and no loop over time: on CPU, where a scan pays a few
    microseconds per step and transposes are slow, several times faster than the scan.
    Precision is `HIGHEST`, so TPUs do not round the sums to bfloat16.
    """
    b_rows, t = w_bt.shape
    block = min(SUM_BLOCK if block is None else block, t)
    n = -(-t // block)
    if n * block > t:  # trailing zeros add nothing to earlier sums
        w_bt = jnp.pad(w_bt, ((0, 0), (0, n * block - t)))
    k = jnp.arange(block)
    ahead = k[None, :] - k[:, None]  # [t', s'] = s' - t'
    powers = jnp.where(ahead >= 0, discount ** jnp.maximum(ahead, 0).astype(w_bt.dtype), 0)
    y = jnp.einsum("bns,ts->bnt", w_bt.reshape(b_rows, n, block), powers.astype(w_bt.dtype),
                   precision=jax.lax.Precision.HIGHEST)
    if n > 1:
        starts = _discounted_reverse_cumsum(y[:, :, 0], discount**block, block)
        y = y + _next(starts)[:, :, None] * (discount ** (block - k).astype(w_bt.dtype))
    return y.reshape(b_rows, n * block)[:, :t]


def _is_prefix_mask(m_bt):
    """True when every row is 0/1 with its ones first (`1..1 0..0`, all-zero rows included).

    A min over int8 rather than `jnp.all`: XLA:CPU lowers this boolean reduction to a slower
    reduce-window tree (0.47 against 0.31 ms at [512, 2048]; 5-10 % of the whole GAE)."""
    if m_bt.size == 0:
        return jnp.asarray(True)
    ok = ((m_bt == 0) | (m_bt == 1)) & (m_bt >= _next(m_bt))
    return jnp.min(ok.astype(jnp.int8)) == 1


def compute_gae_return(token_level_rewards, values, response_mask, gamma, lam):
    """GAE before whitening: `(advantages, returns)`, each `[batch, time]`.

    Reverse scan with `next_v = last = 0` after the last token:
    `delta = r_t + gamma * next_v - V_t; gae = delta + gamma * lam * last;
    next_v = V_t * m_t + (1 - m_t) * next_v; last = gae * m_t + (1 - m_t) * last; A_t = last`,
    and `returns = A + values`. Every row is its own recurrence, so a micro-batch of rows gets
    the same numbers as the whole batch (the critic's update computes its returns this way,
    `train_steps.critic_update_from_rollout`).

    Args:
      token_level_rewards: `[batch, time]` rewards r_t.
      values: `[batch, time]` critic values V_t of the state before token t.
      response_mask: `[batch, time]`, 0/1.
      gamma: discount (float or scalar array).
      lam: GAE lambda (float or scalar array).

    Returns:
      `(advantages, returns)`, each `[batch, time]`: the GAE advantages before whitening and
      `advantages + values`.
    """
    rewards = jnp.asarray(token_level_rewards)
    values = jnp.asarray(values).astype(rewards.dtype)
    m = _as_mask(response_mask, rewards)
    gamma = jnp.asarray(gamma, rewards.dtype)
    lam = jnp.asarray(lam, rewards.dtype)

    def step(carry, x):
        next_v, last = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_v - v_t
        gae = delta + gamma * lam * last
        next_v = v_t * m_t + (1 - m_t) * next_v
        last = gae * m_t + (1 - m_t) * last
        return (next_v, last), last

    # each branch also adds the values, so that the sum fuses with the pass that makes `adv`
    def scan(rewards, values, m):
        zeros_b = jnp.zeros_like(rewards[:, 0])  # keeps the batch sharding of explicit meshes
        adv = _reverse_scan_time(step, (zeros_b, zeros_b), rewards, values, m)
        return adv, adv + values

    def prefix(rewards, values, m):
        td = m * (rewards + gamma * _next(m) * _next(values) - values)
        adv = _discounted_reverse_cumsum(td, gamma * lam)
        return adv, adv + values

    return jax.lax.cond(_is_prefix_mask(m), prefix, scan, rewards, values, m)


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016), masked tokens skipped.

    `compute_gae_return` (the recurrence, `returns = A + values`), then
    `advantages = masked_whiten(A, mask)` over the whole batch. The unwhitened advantages
    are `returns - values`.

    Args:
      token_level_rewards: `[batch, time]` rewards per token (an outcome score sits on the
        last response token).
      values: `[batch, time]` critic values V_t of the state before token t.
      response_mask: `[batch, time]` 1 on the response (loss) tokens, 0 elsewhere.
      gamma: discount (float or scalar array).
      lam: GAE lambda (float or scalar array).

    Returns:
      `(advantages, returns)`, each `[batch, time]`.

    verl: `core_algos.compute_gae_advantage_return`.
    """
    adv, returns = compute_gae_return(token_level_rewards, values, response_mask, gamma, lam)
    return masked_whiten(adv, _as_mask(response_mask, adv)), returns


def _group_scores(token_level_rewards, response_mask, index):
    """`(rewards, mask, scores [batch] replicated, dense group ids)` of an outcome estimator."""
    rewards = jnp.asarray(token_level_rewards)
    m = _as_mask(response_mask, rewards)
    scores = _replicated(jnp.sum(rewards, axis=-1))
    return rewards, m, scores, dense_group_ids(index)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, num_groups=None):
    """GRPO outcome advantage (Shao et al. 2024); Dr.GRPO without the std (Liu et al. 2025).

    `score_i = sum_t r_it`; per group g: mean and unbiased std of its scores (a group of one
    gets mean 0, std 1). `A_i = (score_i - mean_g) / (std_g + epsilon)`, or
    `A_i = score_i - mean_g` when `norm_adv_by_std_in_grpo=False` (Dr.GRPO). A zero-variance
    group gets A = 0. Broadcast over tokens and multiplied by the mask.

    Args:
      token_level_rewards: `[batch, time]`.
      response_mask: `[batch, time]`, 0/1.
      index: `[batch]` group ids (any integers; or string uids, called eagerly).
      epsilon: added to the std.
      norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr.GRPO).
      num_groups: unused (ids are remapped to `[0, batch)`); kept for compatibility.

    Returns:
      `(advantages, returns)`, each `[batch, time]`; `returns` is `advantages` (as verl).

    verl: `core_algos.compute_grpo_outcome_advantage`.
    """
    del num_groups
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    n, mean, var = group_stats(scores, ids)
    single = n <= 1
    mean = jnp.where(single, 0, mean)
    if norm_adv_by_std_in_grpo:
        std = jnp.where(single, 1, safe_sqrt(var))
        adv_b = (scores - mean) / (std + epsilon)
    else:
        adv_b = scores - mean
    adv = adv_b[:, None] * m
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   num_groups=None):
    """RLOO outcome advantage (Ahmadian et al. 2024): leave-one-out baseline per group.

    For a group of n > 1: `A_i = score_i * n / (n - 1) - mean_g * n / (n - 1)`, i.e.
    `score_i` minus the mean of the other n - 1 scores; a group of one keeps its score
    (baseline 0, as verl). Broadcast over tokens and multiplied by the mask.

    Args:
      token_level_rewards: `[batch, time]`.
      response_mask: `[batch, time]`, 0/1.
      index: `[batch]` group ids (any integers; or string uids, called eagerly).
      epsilon: unused; kept for verl's signature.
      num_groups: unused (ids are remapped to `[0, batch)`); kept for compatibility.

    Returns:
      `(advantages, returns)`, each `[batch, time]`; `returns` is `advantages` (as verl).

    verl: `core_algos.compute_rloo_outcome_advantage`.
    """
    del epsilon, num_groups
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    n, mean, _ = group_stats(scores, ids)
    scale = n / jnp.maximum(n - 1, 1)
    adv_b = jnp.where(n > 1, scores * scale - mean * scale, scores)
    adv = adv_b[:, None] * m
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    """REINFORCE++ (Hu 2025): whitened discounted return-to-go.

    Reverse scan: `G' = r_t + gamma * G; R_t = G' * m_t; G = G' * m_t + G * (1 - m_t)`: a
    masked token (an observation span of a multi-turn response, or padding) has return 0 and
    neither adds its reward nor discounts, so the running return crosses it unchanged and the
    rewards after the span reach the tokens before it (verl's fix #7278; before it the return
    restarted at masked tokens). `advantages = masked_whiten(R, m) * m`. On prefix masks
    (`1..1 0..0` rows) the scan is a discounted reverse cumulative sum:
    `R = m * sum_{s >= t} gamma^(s - t) m_s r_s`.

    Args:
      token_level_rewards: `[batch, time]`.
      response_mask: `[batch, time]`, 0/1.
      gamma: discount (float or scalar array).

    Returns:
      `(advantages, returns)`, each `[batch, time]`; `returns` is the return-to-go R.

    verl: `core_algos.compute_reinforce_plus_plus_outcome_advantage` (gamma from its config).
    """
    rewards = jnp.asarray(token_level_rewards)
    m = _as_mask(response_mask, rewards)
    gamma = jnp.asarray(gamma, rewards.dtype)

    def step(running, x):
        r_t, m_t = x
        new = r_t + gamma * running
        return new * m_t + running * (1 - m_t), new * m_t

    def scan(rewards, m):
        return _reverse_scan_time(step, jnp.zeros_like(rewards[:, 0]), rewards, m)

    def prefix(rewards, m):
        return _discounted_reverse_cumsum(rewards * m, gamma) * m

    returns = jax.lax.cond(_is_prefix_mask(m), prefix, scan, rewards, m)
    advantages = masked_whiten(returns, m) * m
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask,
                                                           index, epsilon=1e-6,
                                                           num_groups=None):
    """REINFORCE++ with a group-mean baseline: `masked_whiten((score - mean_g) * m) * m`.

    `score_i = sum_t r_it`; a group of one has mean 0. The centred score is broadcast over
    tokens, masked, and whitened over all masked tokens of the batch.

    Args:
      token_level_rewards: `[batch, time]`.
      response_mask: `[batch, time]`, 0/1.
      index: `[batch]` group ids (any integers; or string uids, called eagerly).
      epsilon: unused; kept for verl's signature.
      num_groups: unused (ids are remapped to `[0, batch)`); kept for compatibility.

    Returns:
      `(advantages, returns)`, each `[batch, time]`; `returns` is `advantages` (as verl).

    verl: `core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage`.
    """
    del epsilon, num_groups
    _, m, scores, ids = _group_scores(token_level_rewards, response_mask, index)
    n, mean, _ = group_stats(scores, ids)
    centred = scores - jnp.where(n > 1, mean, 0)
    adv = masked_whiten(centred[:, None] * m, m) * m
    return adv, adv


def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    """ReMax (Li et al. 2023): return-to-go minus the greedy response's reward.

    `returns_t = sum_{s >= t} r_s * m_s`; `advantages = returns - b[:, None] * m`.

    Args:
      token_level_rewards: `[batch, time]`.
      reward_baselines: `[batch]` reward of the greedy response of each prompt.
      response_mask: `[batch, time]`, 0/1.

    Returns:
      `(advantages, returns)`, each `[batch, time]`.

    verl: `core_algos.compute_remax_outcome_advantage`.
    """
    rewards = jnp.asarray(token_level_rewards)
    m = _as_mask(response_mask, rewards)
    returns = jnp.flip(jnp.cumsum(jnp.flip(rewards * m, -1), axis=-1), -1)
    baselines = jnp.asarray(reward_baselines).astype(rewards.dtype)
    return returns - baselines[:, None] * m, returns
