"""Rewards off the critical path: a batch's samples scored by a pool of worker threads while
the step goes on (verl's `reward.num_workers`; 0 scores inline, as before).

    pool = RewardPool(num_workers=8, timeout_s=30.0)
    pending = pool.submit(inputs, custom_fn=fn)    # right after generation
    ...                                           # old_log_prob, ref, values run meanwhile
    rewards = pending.result()                    # just before the advantages

Each sample is scored by `rewards.score_row`, the inline path's own check, so a failing
sample's error is the same one line naming its data source and row. The results come back
in row order whatever order the workers finish in. A sample running longer than `timeout_s`
is a `RewardError` naming it (its thread cannot be stopped; it is left to finish alone).
Threads suit scorers that wait (a sandbox, an HTTP judge, `time.sleep`) or release the GIL;
a pure-Python scorer that computes gains nothing from them.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlhf_jax.rewards import (
    RewardError,
    RewardInputs,
    Rewards,
    collect_info,
    reward_inputs,
    sample_name,
    score_row,
    shaped,
)


class PendingRewards:
    """The rewards of one submitted batch, in flight; `result()` waits for them."""

    def __init__(self, futures: list[cf.Future], starts: list, inputs: RewardInputs,
                 timeout_s: float | None, finish: Callable[[Rewards], Rewards]):
        self.futures, self.starts, self.inputs = futures, starts, inputs
        self.timeout_s, self.finish = timeout_s, finish
        self._done: Rewards | None = None

    def _wait(self, i: int) -> tuple[float, Any]:
        fut, t = self.futures[i], self.timeout_s
        while True:
            if t is None:
                return fut.result()
            start = self.starts[i]
            left = 0.05 if start is None else start + t - time.monotonic()
            try:
                return fut.result(timeout=max(left, 0.0))
            except cf.TimeoutError:
                if start is None:  # still queued behind other samples: not its time yet
                    continue
                x = self.inputs
                at = sample_name(x.data_sources[i], i, x.extra_infos[i], x.rows[i])
                for f in self.futures:
                    f.cancel()
                raise RewardError(f"the reward function took more than reward.timeout_s={t}s "
                                  f"on {at}") from None

    def result(self) -> Rewards:
        """The batch's `Rewards` in row order (waits for the slowest sample)."""
        if self._done is None:
            n = len(self.futures)
            scores, info = np.empty(n, np.float32), {}
            try:
                for i in range(n):
                    scores[i], result = self._wait(i)
                    collect_info(info, i, n, result)
            except BaseException:
                for f in self.futures:
                    f.cancel()
                raise
            self._done = self.finish(Rewards(scores, scores, info))
        return self._done


class RewardPool:
    """`num_workers` threads that score samples (`submit`); `close()` ends them."""

    def __init__(self, num_workers: int, timeout_s: float | None = None):
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(num_workers, thread_name_prefix="reward")

    def submit(self, inputs: RewardInputs, custom_fn=None,
               finish: Callable[[Rewards], Rewards] = lambda r: r) -> PendingRewards:
        """Starts scoring every sample of `inputs`; `finish` shapes the whole batch's
        rewards once they are in (the overlong penalty)."""
        n = len(inputs.responses)
        starts: list[float | None] = [None] * n

        def one(i: int):
            starts[i] = time.monotonic()
            x = inputs
            return score_row(i, x.data_sources[i], x.responses[i], x.ground_truths[i],
                             x.extra_infos[i], x.rows[i], custom_fn)

        futures = [self._pool.submit(one, i) for i in range(n)]
        return PendingRewards(futures, starts, inputs, self.timeout_s, finish)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def from_config(cfg) -> RewardPool | None:
    """The pool of `reward.num_workers` threads; None for 0 (inline scoring)."""
    r = cfg.reward
    return RewardPool(r.num_workers, r.timeout_s) if r.num_workers else None


def submit(trainer, batch, exp, n: int) -> PendingRewards:
    """Starts scoring the `n` responses per prompt of `batch` in `exp` on the trainer's
    pool, as `Trainer.reward` scores them inline (the overlong penalty included)."""
    x = reward_inputs(trainer.tokenizer, batch, exp.seqs.targets, exp.response_mask, n)
    return trainer.reward_pool.submit(x, trainer.reward_fn,
                                      finish=lambda r: shaped(r, x.lengths, trainer.cfg))
