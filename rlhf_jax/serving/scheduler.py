"""Continuous batching of server requests over the engine's decode slots, in one thread.

    scheduler = Scheduler(served.engine, served.params)
    scheduler.start()
    events = queue.Queue()
    scheduler.submit([Request(prompt=ids, sampling=s, max_tokens=16, request_id=0,
                              index=0, events=events)])
    events.get()      # ("tokens", 0, [ids...]) ... then ("done", 0, "stop" | "length")

The thread is the only one that calls the engine. Each loop it drops cancelled requests,
prefills the waiting requests that fit into the free slots (grouped by prefill bucket, in
power-of-two batches, as the rollout driver does), runs up to `steps_per_call` generate steps
and sends every request its new tokens. The engine samples all slots with one
`SamplingParams` (a static argument of its programs), so the slots hold requests of one
sampler at a time: a request with another waits until the current ones finish. A request's
randomness comes from (the server's key, its `request_id`, the position), as in training, so
a request with a fixed id samples the same tokens whatever else is being served.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Sequence

import jax
import numpy as np

from rlhf_jax.batching import fetch
from rlhf_jax.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to generate.

    Attributes:
      prompt: its token ids (at most the engine's `max_prefill_length`).
      sampling: how it samples (`max_response_length` is the engine's `max_decode_length`).
      max_tokens: its own response-length limit, in [1, max_decode_length].
      request_id: fixes its randomness (int32).
      index: its choice index, passed back with every event.
      events: receives ("tokens", index, [ids]), then ("done", index, "stop" | "length"),
        or ("error", index, message).
    """

    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    request_id: int
    index: int
    events: queue.Queue
    cancelled: bool = False

    def cancel(self) -> None:
        """Stops generating for it (the client went away); its slot is freed soon after."""
        self.cancelled = True


def _pow2_at_least(x: int, cap: int) -> int:
    b = 1
    while b < x:
        b *= 2
    return min(b, cap)


class Scheduler(threading.Thread):
    """Serves `Request`s with `engine` and `params` until `stop()` (a daemon thread).

    Args:
      engine: the rollout `Engine`.
      params: its parameters on the generate layout.
      rng: the key of every request's sampling (default key 0).
      steps_per_call: generate steps per engine call: how often new tokens stream out.
    """

    def __init__(self, engine, params, *, rng=None, steps_per_call: int = 8):
        super().__init__(name="rlhf_jax-scheduler", daemon=True)
        self.engine, self.params = engine, params
        self.rng = jax.random.key(0) if rng is None else rng
        self.steps_per_call = steps_per_call
        self._inbox: queue.Queue[Request | None] = queue.Queue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[Request | None] = [None] * engine.max_concurrent_decodes
        self._sent = [0] * engine.max_concurrent_decodes
        self._stopped = threading.Event()
        self.stats = collections.Counter()  # prefill_calls, generate_calls, requests

    def submit(self, requests: Sequence[Request]) -> None:
        for r in requests:
            self._inbox.put(r)

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(None)

    # ------------------------------------------------------------------------------ loop

    def run(self) -> None:
        state = None
        while not self._stopped.is_set():
            try:
                if state is None:
                    state = self.engine.init_decode_state(self.rng)
                state = self._loop_once(state)
            except Exception as e:  # a failing engine call fails its requests, not the server
                log.exception("serving step failed")
                message = f"generation failed: {type(e).__name__}: {e}"
                for s, r in enumerate(self._slots):
                    if r is not None:
                        r.events.put(("error", r.index, message))
                        self._slots[s] = None
                state = None
        for r in [*self._waiting, *(r for r in self._slots if r is not None)]:
            r.events.put(("error", r.index, "the server is shutting down"))

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _loop_once(self, state):
        idle = all(r is None for r in self._slots)
        self._take_inbox(block=idle and not self._waiting)
        self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        for s, r in enumerate(self._slots):
            if r is not None and r.cancelled:
                self._slots[s] = None  # its slot is overwritten by the next insert
        active = [r for r in self._slots if r is not None]
        sampler = active[0].sampling if active else (
            self._waiting[0].sampling if self._waiting else None)
        if sampler is None:
            return state
        free = [s for s, r in enumerate(self._slots) if r is None]
        admit = [r for r in self._waiting if r.sampling == sampler][:len(free)]
        if admit:
            self._waiting = collections.deque(r for r in self._waiting if r not in admit)
            state = self._insert(state, admit, free[:len(admit)], sampler)
        more = any(r.sampling == sampler for r in self._waiting)
        empty = sum(r is None for r in self._slots)
        state, _ = self.engine.generate_steps(
            self.params, state, self.steps_per_call, sampler,
            stop_when_done=empty + 1 if more else None)
        self.stats["generate_calls"] += 1
        self._emit(state)
        return state

    def _insert(self, state, requests: list[Request], slots: list[int],
                sampler: SamplingParams):
        e = self.engine
        by_bucket: dict[int, list[tuple[Request, int]]] = collections.defaultdict(list)
        for r, s in zip(requests, slots, strict=True):
            by_bucket[e.bucket_for(len(r.prompt))].append((r, s))
        cap = e.max_concurrent_decodes
        for bucket, group in sorted(by_bucket.items()):
            b = _pow2_at_least(len(group), cap)
            tokens = np.full((b, bucket), sampler.pad_id, np.int32)
            lengths = np.ones(b, np.int32)
            rids = np.zeros(b, np.int32)
            for row, (r, _) in enumerate(group):
                tokens[row, :len(r.prompt)] = r.prompt
                lengths[row] = len(r.prompt)
                rids[row] = r.request_id
            prefix, _ = e.prefill(params=self.params, padded_tokens=tokens, true_length=lengths,
                                  sampler=sampler, request_id=rids, rng=self.rng)
            state = e.bulk_insert(prefix, state, [s for _, s in group],
                                  rows=list(range(len(group))),
                                  max_lengths=[r.max_tokens for r, _ in group])
            for r, s in group:
                self._slots[s], self._sent[s] = r, 0
            self.stats["prefill_calls"] += 1
            self.stats["requests"] += len(group)
        return state

    def _emit(self, state) -> None:
        """Sends each request its new tokens; finished ones get their reason and leave."""
        generated, response, done = fetch((state.generated, state.response, state.done))
        for s, r in enumerate(self._slots):
            if r is None:
                continue
            k = int(generated[s])
            if k > self._sent[s]:
                r.events.put(("tokens", r.index, [int(t) for t in response[s, self._sent[s]:k]]))
                self._sent[s] = k
            if done[s]:
                last = int(response[s, k - 1]) if k else -1
                r.events.put(("done", r.index, "stop" if last in r.sampling.eos_ids
                              else "length"))
                self._slots[s] = None


def generate(scheduler: Scheduler, requests: Sequence[Request], timeout: float = 600.0
             ) -> list[tuple[list[int], str]]:
    """Submits `requests` (sharing one events queue) and waits: (tokens, finish) of each.

    Raises:
      RuntimeError: a request failed; TimeoutError: no event for `timeout` seconds.
    """
    events = requests[0].events if requests else None
    tokens: dict[int, list[int]] = {r.index: [] for r in requests}
    finish: dict[int, str] = {}
    scheduler.submit(requests)
    while len(finish) < len(requests):
        try:
            kind, index, value = events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from the scheduler in {timeout:.0f}s") from None
        if kind == "tokens":
            tokens[index] += value
        elif kind == "done":
            finish[index] = value
        else:
            raise RuntimeError(value)
    return [(tokens[r.index], finish[r.index]) for r in requests]

