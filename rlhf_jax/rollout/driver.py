"""RL rollouts on the engine: n samples per prompt with continuous batching over decode slots.

    out = generate_sequences(engine, gen_params, prompt_ids, prompt_mask, n=4,
                             sampling=SamplingParams(temperature=1.0, eos_ids=(2,)), rng=key)
    out.responses[i * 4 + j]      # sample j of prompt i (verl's repeat_interleave order)

Requests (i, j) get request id i*n+j and draw their randomness from (rng, id, position), so a
rollout depends on the seed only, not on the number of slots or on scheduling. After each
multi-step generate call the finished slots are read back and refilled from the queue; each
prompt is prefilled once for its n samples. Once nothing waits, an engine that `compacts`
halves its slots whenever at most half are live (a decode step's time grows with the slots:
on the packing workload, 32 slots cost 3.7x the time of 8).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Literal

import jax
import numpy as np

from rlhf_jax.batching import fetch
from rlhf_jax.errors import ConfigError, DataError
from rlhf_jax.rollout.engine import Engine
from rlhf_jax.rollout.reshard import reshard
from rlhf_jax.rollout.sampling import SamplingParams
from rlhf_jax.rollout.state import Prefix

Truncation = Literal["error", "left", "right"]


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Host arrays, N = B*n rows, prompt-major; R = sampling.max_response_length.

    `response_mask` is 1 up to and including EOS; `responses` hold the pad id after it and
    `rollout_log_probs` (sampling distribution) and `rollout_raw_log_probs` (untempered) 0.
    """

    responses: np.ndarray  # [N, R] int32
    response_mask: np.ndarray  # [N, R] int32
    rollout_log_probs: np.ndarray  # [N, R] float32
    rollout_raw_log_probs: np.ndarray  # [N, R] float32
    response_lengths: np.ndarray  # [N] int32
    prompt_index: np.ndarray  # [N] int32
    stats: dict[str, float]  # rollout/{generate_calls,decode_steps,prefill_calls,...}


def prompt_rows(prompt_ids, prompt_mask, max_len: int, truncation: Truncation = "error"):
    """The real tokens of each left-padded prompt row, checked against `max_len`.

    Returns:
      A list of int32 arrays, one per row.
    """
    ids, mask = (np.asarray(jax.device_get(x)) for x in (prompt_ids, prompt_mask))
    mask = mask.astype(bool)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise DataError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must be the "
                        f"same [batch, length] shape")
    if truncation not in ("error", "left", "right"):
        raise ConfigError(f"truncation must be 'error', 'left' or 'right', got {truncation!r}")
    rows = []
    for i in range(ids.shape[0]):
        row = ids[i][mask[i]].astype(np.int32)
        if len(row) == 0:
            raise DataError(f"prompt {i} is empty (its attention mask has no 1)")
        if len(row) > max_len:
            if truncation == "error":
                raise DataError(
                    f"prompt {i} has {len(row)} tokens, more than max_prefill_length {max_len} "
                    f"(set truncation='left' or 'right' to cut it)"
                )
            row = row[-max_len:] if truncation == "left" else row[:max_len]
        rows.append(row)
    return rows


def _pow2_at_least(x: int, cap: int) -> int:
    b = 1
    while b < x:
        b *= 2
    return min(b, cap)


# Prompt tokens per prefill call by default: prefill's activations stay those of a few
# thousand tokens, while a short-prompt rollout prefills all its prompts in one call.
PREFILL_TOKENS = 8192


def default_prefill_batch(slots: int, n: int, max_prefill_length: int) -> int:
    """Prompts per prefill call when the caller names none: as many as the slots take at
    once (`slots // n`), at most `PREFILL_TOKENS // max_prefill_length` but never capped
    below 16 (the engine's bound before, whatever the prompt length).

    Each prefill and each insert is one dispatch to every device; on a mesh of simulated CPU
    devices a dispatch costs more than the prefill of a short prompt, so fewer, larger
    calls decide the rollout's time there (the tiny GRPO recipe: 1 prefill of 128 prompts
    instead of 8 of 16).
    """
    return max(1, min(max(slots // n, 1), max(16, PREFILL_TOKENS // max_prefill_length)))


def _decode_steps(engine: Engine, steps_per_call: int, waiting: bool) -> int:
    """Steps of the next generate call: a few while requests wait for a slot, else to the
    end."""
    return steps_per_call if waiting else max(steps_per_call, engine.max_decode_length)


def first_programs(engine: Engine, num_prompts: int, n: int, *, steps_per_call: int = 16,
                   max_prefill_batch: int | None = None) -> tuple[list[int], list[int]]:
    """The prefill batch sizes and the generate step counts that `generate_sequences` runs
    first for `num_prompts` prompts (of one prefill bucket) with `n` samples each: those of
    its first fill of the slots and of its last generate call. Refills of a few slots
    later on may prefill smaller batches."""
    slots = engine.max_concurrent_decodes
    mpb = max_prefill_batch or default_prefill_batch(slots, n, engine.max_prefill_length)
    first = -(-min(num_prompts * n, slots) // n)  # prompts whose samples fill the slots
    batches = sorted({_pow2_at_least(min(mpb, first - lo), mpb) for lo in range(0, first, mpb)})
    waiting = num_prompts * n > slots
    steps = sorted({_decode_steps(engine, steps_per_call, w) for w in {waiting, False}})
    return batches, steps


def precompile(engine: Engine, params, *, num_prompts: int, prompt_length: int, n: int = 1,
               sampling: SamplingParams | None = None, steps_per_call: int = 16,
               max_prefill_batch: int | None = None, stop=lambda: False,
               limited: bool = False) -> None:
    """Compiles ahead of time, without running them, the engine programs that
    `generate_sequences` needs first for `num_prompts` prompts of up to `prompt_length`
    tokens, `n` samples each (`first_programs`; `limited`: called with `max_lengths`); see
    `Engine.precompile` (for a background thread; `params` may be shapes; `stop()` true: no
    more programs)."""
    batches, steps = first_programs(engine, num_prompts, n, steps_per_call=steps_per_call,
                                    max_prefill_batch=max_prefill_batch)
    engine.precompile(params, prefill_batches=batches, length=prompt_length, num_samples=n,
                      generate_steps=steps, sampler=engine.resolve_sampling(sampling),
                      stop=stop, limited=limited)


class _Rollout:
    """The host-side bookkeeping of one `generate_sequences` call."""

    def __init__(self, engine: Engine, params, rows, n: int, sampling: SamplingParams, rng,
                 max_prefill_batch: int, max_lengths: np.ndarray | None = None,
                 prompt_offset: int = 0):
        self.engine, self.params, self.rows, self.n = engine, params, rows, n
        self.prompt_offset = prompt_offset
        self.max_lengths = max_lengths
        self.sampling, self.rng = sampling, rng
        self.max_prefill_batch = max_prefill_batch
        self.total = len(rows) * n
        self.next_request = 0
        self.slot_request = [-1] * engine.max_concurrent_decodes
        self.prefixes: dict[int, tuple[Prefix, int]] = {}  # prompt -> (prefix, row in it)
        self.stats = collections.Counter()

    def _prefill(self, prompts: list[int]) -> None:
        """Prefills prompts not yet cached, grouped by bucket, in power-of-two batches."""
        e = self.engine
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        for i in prompts:
            by_bucket[e.bucket_for(len(self.rows[i]))].append(i)
        for bucket, group in sorted(by_bucket.items()):
            for lo in range(0, len(group), self.max_prefill_batch):
                chunk = group[lo:lo + self.max_prefill_batch]
                b = _pow2_at_least(len(chunk), self.max_prefill_batch)
                tokens = np.full((b, bucket), self.sampling.pad_id, np.int32)
                lengths = np.ones(b, np.int32)
                rids = np.zeros(b, np.int32)
                for r, i in enumerate(chunk):
                    tokens[r, :len(self.rows[i])] = self.rows[i]
                    lengths[r] = len(self.rows[i])
                    rids[r] = (self.prompt_offset + i) * self.n
                prefix, _ = e.prefill(params=self.params, padded_tokens=tokens,
                                      true_length=lengths, sampler=self.sampling,
                                      request_id=rids, rng=self.rng, num_samples=self.n)
                for r, i in enumerate(chunk):
                    self.prefixes[i] = (prefix, r)
                self.stats["prefill_calls"] += 1
                self.stats["prefill_prompts"] += len(chunk)
                self.stats["prefill_tokens"] += b * bucket

    def refill(self, state):
        """Inserts queued requests into every free slot; returns the new state."""
        free = [s for s, r in enumerate(self.slot_request) if r < 0]
        take = list(range(self.next_request, min(self.total, self.next_request + len(free))))
        if not take:
            return state
        self.next_request += len(take)
        self._prefill(sorted({r // self.n for r in take} - set(self.prefixes)))
        groups: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
        for slot, rid in zip(free, take, strict=False):
            prefix, row = self.prefixes[rid // self.n]
            groups[id(prefix)].append((slot, row, rid % self.n))
            self.slot_request[slot] = rid
        by_id = {id(p): p for p, _ in self.prefixes.values()}
        for key, items in groups.items():
            slots, rows, samples = zip(*items, strict=True)
            lims = None if self.max_lengths is None else [
                self.max_lengths[self.slot_request[s]] for s in slots]
            state = self.engine.bulk_insert(by_id[key], state, slots, rows=rows,
                                            samples=samples, max_lengths=lims)
            self.stats["insert_calls"] += 1
        # Prompts whose n samples are all inserted need their prefix no more.
        still_needed = self.next_request // self.n
        self.prefixes = {i: v for i, v in self.prefixes.items() if i >= still_needed}
        return state

    def busy(self) -> bool:
        return any(r >= 0 for r in self.slot_request)

    def compact(self, state):
        """While at most half the slots hold a request (and the engine `compacts`), moves
        them into an engine of half the slots; returns the new state."""
        while self.engine.compacts(self.sampling, self.max_lengths is not None):
            live = [s for s, r in enumerate(self.slot_request) if r >= 0]
            half = self.engine.max_concurrent_decodes // 2
            if not live or len(live) > half:
                break
            self.engine, state = self.engine.compacted(state, live)
            self.slot_request = [self.slot_request[s] for s in live] + [-1] * (half - len(live))
            self.stats["compactions"] += 1
        return state


def generate_sequences(engine: Engine, params, prompt_ids, prompt_mask, *, n: int = 1,
                       sampling: SamplingParams | None = None, rng=0,
                       truncation: Truncation = "error", steps_per_call: int = 16,
                       refill_min_free: int = 1,
                       max_prefill_batch: int | None = None,
                       max_lengths=None, prompt_offset: int = 0) -> RolloutBatch:
    """Samples n responses for each prompt of a left-padded batch.

    Args:
      engine: the rollout `Engine`.
      params: policy parameters (moved to the engine's generate layout if they are not there).
      prompt_ids: [B, P] int32, left-padded.
      prompt_mask: [B, P], 1 on real tokens.
      n: samples per prompt.
      sampling: the sampling rule (default: the engine's).
      rng: a PRNG key or an int seed; with the request id and position it fixes every token.
      truncation: a prompt longer than `engine.max_prefill_length` is an error, or is cut on
        the left (keep the end) or the right (keep the start).
      steps_per_call: the most generate steps per jitted call while prompts wait for a slot.
        Once none wait, the slots decode to the end in one call (up to
        `engine.max_decode_length` steps; it stops when every slot is done): nothing is left
        to refill, so more calls would only add host round trips.
      refill_min_free: while requests wait, a call returns as soon as this many slots have
        finished, so they are refilled at once (1: after every finish).
      max_prefill_batch: prompts per prefill call (default: `default_prefill_batch`).
      max_lengths: [B*n] int, request i*n+j's own response-length limit, in
        [1, sampling.max_response_length] (None: the sampler's for every request).
      prompt_offset: the prompts are those from `prompt_offset` on of a larger batch (one
        host's share): sample j of prompt i samples as request (prompt_offset + i) * n + j,
        so the shares together give the whole batch's tokens.

    Returns:
      A `RolloutBatch` of B*n rows, row i*n+j = sample j of prompt i.
    """
    if n < 1:
        raise ConfigError(f"rollout n must be >= 1, got {n}")
    sampling = engine.resolve_sampling(sampling)
    rows = prompt_rows(prompt_ids, prompt_mask, engine.max_prefill_length, truncation)
    rng = jax.random.key(rng) if isinstance(rng, int | np.integer) else rng
    params = reshard(params, engine.param_shardings)
    slots = engine.max_concurrent_decodes
    r = sampling.max_response_length
    if max_lengths is not None:
        max_lengths = np.asarray(max_lengths)
        if max_lengths.shape != (len(rows) * n,) or not np.all((max_lengths >= 1)
                                                               & (max_lengths <= r)):
            raise DataError(f"max_lengths must be {len(rows) * n} (B*n) response lengths in "
                            f"[1, {r}], got shape {max_lengths.shape}")
    run = _Rollout(engine, params, rows, n, sampling, rng, max_prefill_batch
                   or default_prefill_batch(slots, n, engine.max_prefill_length), max_lengths,
                   prompt_offset)
    responses = np.full((run.total, r), sampling.pad_id, np.int32)
    log_probs = np.zeros((run.total, r), np.float32)
    raw_log_probs = np.zeros((run.total, r), np.float32)
    lengths = np.zeros(run.total, np.int32)

    state = run.refill(engine.init_decode_state(rng))
    while run.busy():
        # With requests waiting, return as soon as `refill_min_free` slots can take them;
        # with none, decode to the end in one call, or, where the engine compacts, until at
        # most half the slots are live, which then decode on in half the slots.
        waiting = run.next_request < run.total
        e = run.engine
        s = e.max_concurrent_decodes
        empty = sum(r < 0 for r in run.slot_request)
        compact = not waiting and e.compacts(sampling, max_lengths is not None)
        stop = empty + refill_min_free if waiting else s - s // 2 if compact else None
        steps = _decode_steps(e, steps_per_call, waiting)
        state, _ = e.generate_steps(params, state, steps, sampling, stop_when_done=stop)
        run.stats["generate_calls"] += 1
        # The one sync per call: which slots finished. `fetch` gathers the slots of every
        # host, so all processes see the same slots finish and refill them alike.
        done = fetch(state.done)
        finished = [s for s, rid in enumerate(run.slot_request) if rid >= 0 and done[s]]
        if finished:
            resp, lp, raw, gen = fetch(
                (state.response, state.log_probs, state.raw_log_probs, state.generated)
            )
            for s in finished:
                rid, k = run.slot_request[s], int(gen[s])
                responses[rid, :k] = resp[s, :k]
                log_probs[rid, :k] = lp[s, :k]
                raw_log_probs[rid, :k] = raw[s, :k]
                lengths[rid] = k
                run.slot_request[s] = -1
            state = run.refill(state)
        if compact:
            state = run.compact(state)
    run.stats["decode_steps"] = int(fetch(state.steps))
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    run.stats["tokens_generated"] = int(lengths.sum())
    return RolloutBatch(
        responses=responses, response_mask=mask, rollout_log_probs=log_probs,
        rollout_raw_log_probs=raw_log_probs, response_lengths=lengths,
        prompt_index=np.repeat(np.arange(len(rows), dtype=np.int32), n),
        stats={f"rollout/{k}": float(v) for k, v in sorted(run.stats.items())},
    )
