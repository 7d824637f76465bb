"""DAPO's dynamic sampling (`algorithm.filter_groups`), as verl's DAPO trainer does it.

A step generates rollout.n responses for each prompt of a batch and scores them; a group
(one prompt's responses) whose `metric` is the same for every response carries no GRPO
signal and is dropped. While fewer than data.train_batch_size prompts are kept, the step
draws the next batch of fresh prompts from the train loader and generates again; past
`max_num_gen_batches` generation batches (<= 0: no limit) it stops with a one-line error.
The kept groups, in the order they were generated, are cut to the first train_batch_size.

    exp = fill(sample, next_batch, batch, n=4, prompts=64, metric="acc", max_num_gen_batches=10)

Host-side numpy: nothing here is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rlhf_jax.errors import ConfigError
from rlhf_jax.experience import Experience
from rlhf_jax.rewards import Rewards

# Sums of the token-level scores: with the KL in the reward off (the config refuses
# seq_final_reward with it on), both are the score the response gets, shaping included.
SEQ_METRICS = ("seq_reward", "seq_final_reward")


def group_metric(metric: str, rewards: Rewards) -> np.ndarray:
    """The value each response's group is judged by, float64 [N].

    `seq_reward` / `seq_final_reward`: the reward the response gets (overlong penalty
    included). Any other name: that entry of the reward's extra info; without one, `acc`
    and `score` are the reward function's score (verl's DAPO reward manager records a float
    score as `acc`; the built-in rule rewards return `{"score", "pred"}`).

    Raises:
        ConfigError: the reward returns no such entry, or a value that is not a number.
    """
    path = "algorithm.filter_groups.metric"
    if metric in SEQ_METRICS:
        return np.asarray(rewards.scores, np.float64)
    if metric not in rewards.info:
        if metric in ("acc", "score"):
            return np.asarray(rewards.raw, np.float64)
        known = ", ".join(dict.fromkeys([*SEQ_METRICS, "acc", "score", *sorted(rewards.info)]))
        raise ConfigError(f"{path}: the reward function returns no {metric!r} (known: {known})")
    values = rewards.info[metric]
    bad = [v for v in values if not isinstance(v, int | float | np.number | np.bool_)]
    if bad:
        raise ConfigError(f"{path}: the reward's {metric!r} must be a number for every "
                          f"response, got {bad[0]!r}")
    return np.asarray(values, np.float64)


def kept_groups(values: np.ndarray, n: int) -> np.ndarray:
    """bool [G]: the groups of `values` ([G * n], prompt-major) whose values differ
    (population std > 0); a group of one response is always kept (verl's rule)."""
    groups = np.asarray(values, np.float64).reshape(-1, n)
    return (groups.std(axis=1) > 0) | (n == 1)


def take_rows(exp: Experience, rows: np.ndarray) -> Experience:
    """`exp` with only `rows` of every per-row field (host arrays; metrics kept)."""
    return exp._replace(**{f: _rows(getattr(exp, f), rows) for f in _row_fields(exp)})


def concat(parts: list[Experience]) -> Experience:
    """The rows of `parts` one after the other (metrics and times of the first)."""
    first = parts[0]
    return first._replace(**{f: _cat([getattr(p, f) for p in parts]) for f in _row_fields(first)})


def _row_fields(exp: Experience) -> list[str]:
    return [f for f in exp._fields if f not in ("kl", "metrics", "times")]


def _rows(x: Any, rows: np.ndarray) -> Any:
    if x is None:
        return None
    if isinstance(x, tuple):  # a NamedTuple of arrays (`Sequences`)
        return type(x)(*(_rows(v, rows) for v in x))
    return np.asarray(x)[rows]


def _cat(xs: list) -> Any:
    if xs[0] is None:
        return None
    if isinstance(xs[0], tuple):
        return type(xs[0])(*(_cat(list(v)) for v in zip(*xs, strict=True)))
    return np.concatenate([np.asarray(x) for x in xs], axis=0)


def fill(sample: Callable[[Any, int], tuple[Experience, Rewards]], next_batch: Callable[[], Any],
         batch: Any, *, n: int, prompts: int, metric: str,
         max_num_gen_batches: int) -> Experience:
    """Generation batches until `prompts` groups pass the filter; their experience.

    Args:
        sample: `sample(batch, k) -> (exp, rewards)`: generation batch k (0, 1, ...) of
            `batch`'s prompts, scored (`exp.scores` filled), prompt-major rows.
        next_batch: the next batch of prompts from the train loader (its position moves).
        batch: the step's first batch of prompts.
        n: responses per prompt (rollout.n).
        prompts: groups to train on (data.train_batch_size).
        metric, max_num_gen_batches: `algorithm.filter_groups.*`.

    Returns:
        The experience of the first `prompts` kept groups (`index` renumbered 0..prompts-1),
        with the metrics `train/num_gen_batches` and `training/filter_groups/*`: groups
        evicted (metric all equal), discarded as surplus, and kept (trained + surplus);
        verl's `*_samples` count groups, as its replay buffer's do.

    Raises:
        ConfigError: `max_num_gen_batches` batches kept fewer than `prompts` groups.
    """
    parts, kept, evicted, k = [], 0, 0, 0
    while True:
        exp, rewards = sample(batch, k)
        k += 1
        ok = kept_groups(group_metric(metric, rewards), n)
        parts.append(take_rows(exp, np.flatnonzero(np.repeat(ok, n))))
        kept, evicted = kept + int(ok.sum()), evicted + int((~ok).sum())
        if kept >= prompts:
            break
        if 0 < max_num_gen_batches <= k:
            raise ConfigError(
                f"algorithm.filter_groups.max_num_gen_batches: {k} generation batches kept "
                f"{kept} of {prompts} prompts whose {metric} differs within the group; the "
                "data may be too hard or too easy for the policy (0: no limit)")
        batch = next_batch()
    exp = take_rows(concat(parts), np.arange(prompts * n))
    return exp._replace(index=np.repeat(np.arange(prompts), n)).with_metrics(**{
        "train/num_gen_batches": float(k),
        "training/filter_groups/evicted_samples": float(evicted),
        "training/filter_groups/discarded_surplus_samples": float(kept - prompts),
        "training/filter_groups/kept_groups": float(kept),
    })
