"""A JetStream-style engine (prefill / insert / generate) on the generate layout of the mesh.

The method names and signatures follow JetStream's current `engine_api.Engine`; nothing here
imports jetstream (`rollout/jetstream_adapter.py` does). The KV cache and every per-slot array
of the decode state live on the mesh's generate layout (slots over `cache_batch`, KV heads over
`cache_heads`); each jitted function has explicit in/out shardings and donates the state.

    engine = Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=64,
                    max_prefill_length=512, max_decode_length=256)
    prefix, first = engine.prefill(params=p, padded_tokens=ids_bt, true_length=len_b)
    state = engine.bulk_insert(prefix, engine.init_decode_state(rng), slots=[0, 1])
    state, out = engine.generate_steps(p, state, 8)   # 8 tokens for every slot, one dispatch

Shapes: L layers, S slots, C cache length (max_prefill_length + max_decode_length), T prefill
bucket, R max_decode_length, V vocabulary, K kv heads, H head dim; the KV cache is
[L, S, K, C, H].
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlhf_jax.errors import ConfigError, DataError
from rlhf_jax.mesh import Rules, logical_to_pspec
from rlhf_jax.models.model import Model
from rlhf_jax.models.stacking import KVCache
from rlhf_jax.rollout.engine_programs import EnginePrograms
from rlhf_jax.rollout.program_cache import ProgramCache
from rlhf_jax.rollout.reshard import reshard
from rlhf_jax.rollout.sampling import SamplingParams
from rlhf_jax.rollout.state import DecodeState, Prefix, ResultTokens, default_buckets, key_data


class Engine(EnginePrograms, ProgramCache):
    """Prefill, insert and generate for one model on one mesh (generate layout).

    Args:
      model: a causal LM `Model`.
      mesh: the `(data, fsdp, tensor)` mesh.
      rules: the generate-layout rules (`MeshSpec.generate_rules`).
      max_concurrent_decodes: decode slots S.
      max_prefill_length: the longest prompt.
      max_decode_length: the longest response R; the cache holds C = prompt + response tokens.
      prefill_buckets: prompt lengths prefill pads to (default: powers of two, then the max).
      sampling: the default `SamplingParams` when a call passes `sampler=None`.
      compiler_options: XLA options for every jitted function (e.g. tests lower
        `xla_backend_optimization_level` to compile faster).
      compact_min_length: rollouts whose sampler allows responses of at least this many
        tokens compact the slots as they finish (`compacts`, `compacted`; None: never).
    """

    def __init__(self, model: Model, mesh, rules: Rules, *, max_concurrent_decodes: int = 64,
                 max_prefill_length: int = 512, max_decode_length: int = 512,
                 prefill_buckets: Sequence[int] | None = None,
                 sampling: SamplingParams | None = None,
                 compiler_options: dict[str, Any] | None = None,
                 compact_min_length: int | None = None):
        if model.kind != "lm":
            raise ConfigError("the rollout engine needs a causal LM, got a value model")
        for name, v in (("max_concurrent_decodes", max_concurrent_decodes),
                        ("max_prefill_length", max_prefill_length),
                        ("max_decode_length", max_decode_length)):
            if v < 1:
                raise ConfigError(f"rollout engine: {name} must be >= 1, got {v}")
        buckets = sorted(set(prefill_buckets or default_buckets(max_prefill_length)))
        if buckets[0] < 1 or buckets[-1] > max_prefill_length:
            raise ConfigError(
                f"prefill_buckets {tuple(buckets)} must lie in [1, max_prefill_length "
                f"{max_prefill_length}]"
            )
        if buckets[-1] < max_prefill_length:
            buckets.append(max_prefill_length)
        self.model = model
        self._mesh = mesh
        self.rules = rules
        self._slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self.max_decode_length = max_decode_length
        self.cache_length = max_prefill_length + max_decode_length
        self.prefill_buckets = tuple(buckets)
        self.default_sampling = self.resolve_sampling(sampling or SamplingParams())
        self.param_shardings = model.shardings(mesh, rules)
        # Traces per jitted function (`ProgramCache`), keyed ("prefill", b, T, T0, m, rule),
        # ("insert", b, T, m), ("generate", steps, rule), ("init", key shape); rule: the
        # sampler's `program()` (greedy or not is an argument).
        self._reset_programs()
        self._jit_kw = {"compiler_options": dict(compiler_options)} if compiler_options else {}
        self._replicated = NamedSharding(mesh, P())
        self.compact_min_length = compact_min_length
        self._smaller: dict[int, Engine] = {}  # `smaller(s)`: shared by all of them

    # ------------------------------------------------------------------ JetStream properties

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def mesh(self):
        return self._mesh

    @property
    def colocated_cpus(self):
        return None

    # ------------------------------------------------------------------------- shardings

    def _sharding(self, names, shape) -> NamedSharding:
        return NamedSharding(self._mesh, logical_to_pspec(names, shape, self._mesh, self.rules))

    def _prefix_shardings(self, b: int, t: int, m: int = 1) -> Prefix:
        cache = KVCache(*(self._sharding(axes, shape)
                          for shape, axes in self.model.cache_shapes(b, t)))
        row = self._sharding(("cache_batch",), (b,))
        bm = self._sharding(("cache_batch", None), (b, m))
        return Prefix(cache, row, row, bm, bm, bm, bm)

    def _result_shardings(self, b: int, t: int) -> ResultTokens:
        bt = self._sharding(("cache_batch", None), (b, t))
        return ResultTokens(bt, bt, self._sharding(("cache_batch",), (b,)), bt, bt)

    def decode_state_shardings(self, slots: int | None = None) -> DecodeState:
        """Shardings of the decode state (of `slots` slots; default: the engine's)."""
        s, r = slots or self._slots, self.max_decode_length
        cache = KVCache(*(self._sharding(axes, shape)
                          for shape, axes in self.model.cache_shapes(s, self.cache_length)))
        row = self._sharding(("cache_batch",), (s,))
        rows = self._sharding(("cache_batch", None), (s, r))
        rep = NamedSharding(self._mesh, P())
        return DecodeState(cache, row, row, row, row, row, rows, rows, rows, rep, rep, row)

    def get_prefix_destination_sharding(self, batch: int = 1, length: int | None = None,
                                        num_samples: int = 1):
        """Shardings of a `Prefix` of `batch` prompts padded to `length` on this engine."""
        return self._prefix_shardings(batch, length or self._max_prefill, num_samples)

    # ---------------------------------------------------------------------------- helpers

    def resolve_sampling(self, sampler: SamplingParams | None) -> SamplingParams:
        """`sampler` (or the engine's default) with its length limit filled in and checked."""
        s = sampler or self.default_sampling
        if s.max_response_length is None:
            return dataclasses.replace(s, max_response_length=self.max_decode_length)
        if s.max_response_length > self.max_decode_length:
            raise ConfigError(
                f"sampling max_response_length {s.max_response_length} exceeds the engine's "
                f"max_decode_length {self.max_decode_length}"
            )
        return s

    def bucket_for(self, length: int) -> int:
        """The smallest prefill bucket that holds `length` tokens."""
        for b in self.prefill_buckets:
            if length <= b:
                return b
        raise DataError(
            f"a prompt of {length} tokens exceeds max_prefill_length {self._max_prefill}"
        )

    # ------------------------------------------------------------------------------ state

    def load_params(self, params=None, *, path=None, rng=None):
        """Parameters on the generate layout: resharded from `params`, read from an HF
        directory `path`, or random from `rng`."""
        if params is not None:
            return reshard(params, self.param_shardings)
        if path is not None:
            from rlhf_jax.models.hf_io import load_hf_model

            _, loaded = load_hf_model(path, self._mesh, self.rules)
            return reshard(loaded, self.param_shardings)
        return self.model.init(rng if rng is not None else jax.random.key(0), self._mesh,
                               self.rules)

    def init_decode_state(self, rng=None) -> DecodeState:
        """All slots empty (done); `rng` seeds every request's sampling (default key 0)."""
        key, build, args = self._init_call(rng)
        return self._jit(key, build)(*args)

    def _init_call(self, rng):
        """`(key, build, args)` of `init_decode_state(rng)`."""
        rng_data = key_data(0 if rng is None else rng)

        def build():
            def init(rng_data):
                self._traced(("init", rng_data.shape))
                return self._empty_state(self._slots, rng_data)

            return jax.jit(init, out_shardings=self.decode_state_shardings(),
                           **self._jit_kw)

        return ("init", rng_data.shape), build, (jax.device_put(rng_data, self._replicated),)

    def _empty_state(self, s: int, rng_data) -> DecodeState:
        """`s` empty slots (traced inside `init_decode_state`)."""
        r = self.max_decode_length
        cache = self.model.init_cache(s, self.cache_length)
        zi = jnp.zeros((s,), jnp.int32)
        return DecodeState(
            cache, zi, zi, zi, jnp.ones((s,), bool), zi, jnp.zeros((s, r), jnp.int32),
            jnp.zeros((s, r), jnp.float32), jnp.zeros((s, r), jnp.float32), rng_data,
            jnp.zeros((), jnp.int32), jnp.full((s,), r, jnp.int32),
        )

    def decode_state_bytes(self, slots: int | None = None) -> int:
        """Bytes of the decode state (of `slots` slots; default: the engine's) on the device
        that holds the most of it: KV cache and per-slot buffers, on the generate layout."""
        s = slots or self._slots
        shapes = jax.eval_shape(lambda: self._empty_state(s, jnp.zeros((2,), jnp.uint32)))
        per_device = jax.tree.map(
            lambda x, sh: math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize, shapes,
            self.decode_state_shardings(s))
        return int(sum(jax.tree.leaves(per_device)))

    def with_slots(self, slots: int) -> Engine:
        """The same engine with `slots` decode slots (nothing compiled carried over)."""
        if slots < 1:
            raise ConfigError(f"rollout engine: max_concurrent_decodes must be >= 1, got {slots}")
        out = copy.copy(self)
        out._slots = slots
        out._reset_programs()
        out._smaller = {}
        return out

    # ------------------------------------------------------------------------- compaction

    @property
    def min_slots(self) -> int:
        """The fewest slots compaction leaves: the devices the slot axis is split over."""
        return math.prod(self._mesh.shape[a] for a in dict(self.rules).get("cache_batch", ()))

    def compacts(self, sampler: SamplingParams, limited: bool = False) -> bool:
        """Whether a rollout with `sampler` compacts its slots as they finish: responses of
        at least `compact_min_length` tokens (a compaction, one gather of the live slots'
        cache rows, pays back only over many decode steps; the short-response runs keep one
        program), slots left to halve, and responses that can end before the cap: an EOS
        id the model can sample, or (`limited`) requests with lengths of their own. (With
        neither, every slot finishes at the last step, so the smaller engines' programs
        would be compiled for nothing.)"""
        sampler = self.resolve_sampling(sampler)
        vocab = self.model.cfg.vocab_size
        ends_early = limited or any(0 <= e < vocab for e in sampler.eos_ids)
        return (ends_early and self.compact_min_length is not None
                and sampler.max_response_length >= self.compact_min_length
                and self._slots // 2 >= self.min_slots)

    def smaller(self, slots: int) -> Engine:
        """This engine with `slots` < S slots, one per size (its programs compile once)."""
        with self._lock:
            if slots not in self._smaller:
                small = self.with_slots(slots)
                small._smaller = self._smaller
                self._smaller[slots] = small
            return self._smaller[slots]

    def compacted(self, state: DecodeState, keep: Sequence[int]
                  ) -> tuple[Engine, DecodeState]:
        """Not in JetStream's API: the slots `keep` (in that order) of `state` moved into a
        state of S / 2 slots (`len(keep)` <= S / 2), on `smaller(S // 2)`, which the rollout
        goes on with; the other new slots are empty (done). A slot's request decodes on
        unchanged: its randomness depends on its request id and position, never its slot.
        `state` is consumed (its buffers are not reused)."""
        key, build, args = self._compact_call(state, keep)
        return self.smaller(self._slots // 2), self._jit(key, build)(*args)

    def _compact_call(self, state, keep: Sequence[int]):
        """`(key, build, args)` of `compacted(state, keep)`."""
        s = self._slots // 2
        if not 1 <= s or len(keep) > s:
            raise ConfigError(f"cannot compact {len(keep)} live slots of {self._slots} into {s}")
        idx = np.zeros(s, np.int32)
        idx[:len(keep)] = keep
        valid = np.arange(s) < len(keep)
        key, small = ("compact", s), self.smaller(s)
        return key, lambda: self._build_compact(key, small), (
            state, *jax.device_put((idx, valid), self._replicated))

    def free_resource(self, slot: int) -> None:
        """Nothing to free: the dense cache row is overwritten by the next `insert`."""
        del slot

    # ---------------------------------------------------------------------------- prefill

    def prefill(self, *, params, existing_prefix: Prefix | None = None, padded_tokens,
                true_length, sampler: SamplingParams | None = None, request_id=None,
                rng=None, num_samples: int = 1) -> tuple[Prefix, ResultTokens]:
        """KV cache and first sampled token(s) of right-padded prompts.

        Args:
          params: parameters on the generate layout.
          existing_prefix: a `Prefix` the new tokens continue (same batch size).
          padded_tokens: [T] or [b, T] int32, right-padded; padded further to a bucket.
          true_length: int or [b]: real tokens per row.
          sampler: the sampling rule of the first token (default: the engine's).
          request_id: int or [b]: the request of each row (default 0..b-1); sample j of row r
            is request `request_id[r] + j`. With `rng` it fixes all of the request's tokens.
          rng: the rollout key (default key 0); pass the same key to `init_decode_state`.
          num_samples: m first tokens per row, one per sample, for `bulk_insert`.

        Returns:
          (Prefix with cache [L, b, T', K, H], ResultTokens [b*m, 1] with samples_per_slot m).
        """
        key, build, args = self._prefill_call(params, existing_prefix, padded_tokens,
                                              true_length, sampler, request_id, rng, num_samples)
        return self._jit(key, build)(*args)

    def _prefill_call(self, params, existing_prefix, padded_tokens, true_length, sampler,
                      request_id, rng, num_samples):
        """`(key, build, args)` of `prefill(...)`."""
        sampler = self.resolve_sampling(sampler)
        tokens = padded_tokens if isinstance(padded_tokens, jax.Array) else np.asarray(
            padded_tokens, np.int32
        )
        if tokens.ndim == 1:
            tokens = tokens[None]
        b, t = tokens.shape
        lengths = np.broadcast_to(np.asarray(true_length, np.int32), (b,)).copy()
        t0 = 0 if existing_prefix is None else existing_prefix.cache.length
        if existing_prefix is None and t > self._max_prefill:
            raise DataError(f"prefill of {t} tokens exceeds max_prefill_length "
                            f"{self._max_prefill}")
        if np.any(lengths < 1) or np.any(lengths > t):
            raise DataError(f"prefill true_length {lengths.tolist()} must lie in [1, {t}]")
        bucket = self.bucket_for(t) if existing_prefix is None else t
        if t0 + bucket > self.cache_length:
            raise DataError(f"prefix of {t0} + {bucket} tokens exceeds the cache length "
                            f"{self.cache_length}")
        if bucket > t:
            pad = ((0, 0), (0, bucket - t))
            tokens = jnp.pad(tokens, pad) if isinstance(tokens, jax.Array) else np.pad(tokens,
                                                                                         pad)
        rids = np.arange(b, dtype=np.int32) if request_id is None else np.broadcast_to(
            np.asarray(request_id, np.int32), (b,)).copy()
        rng_data = key_data(0 if rng is None else rng)
        rule = sampler.program()  # greedy or not: an argument (`SamplingParams.program`)
        key = ("prefill", b, bucket, t0, num_samples, rule)
        build = lambda: self._build_prefill(key, b, bucket, t0, num_samples, rule)
        row = self._sharding(("cache_batch",), (b,))
        tokens, lengths, rids, rng_data, greedy = jax.device_put(  # no implicit transfers
            (tokens, lengths, rids, rng_data, np.bool_(sampler.greedy)),
            (self._sharding(("cache_batch", None), tokens.shape), row, row, self._replicated,
             self._replicated))
        return key, build, (params, existing_prefix, tokens, lengths, rids, rng_data, greedy)

    # ----------------------------------------------------------------------------- insert

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               request_id: Any = None) -> DecodeState:
        """Puts sample 0 of prefix row 0 into `slot`.

        `request_id` only labels the request, as in JetStream: its randomness was fixed by
        the `request_id` given to `prefill`.
        """
        del request_id
        return self.bulk_insert(prefix, decode_state, [slot])

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int], *,
                    rows: Sequence[int] | None = None,
                    samples: Sequence[int] | None = None,
                    max_lengths: Sequence[int] | None = None) -> DecodeState:
        """Puts prefix samples into decode slots (the state is donated).

        Args:
          prefix: from `prefill`.
          decode_state: the state to insert into.
          slots: target slots.
          rows: the prefix row of each slot (default 0: JetStream's one prefix, many slots).
          samples: the sample of each slot (default 0, 1, ... modulo the prefix's samples).
          max_lengths: each slot's response-length limit (default: the sampler's alone); the
            slot finishes after that many tokens, as at the sampler's limit.

        One compile per prefix shape: the slot list is padded to `max_concurrent_decodes`.
        """
        key, build, args = self._insert_call(prefix, decode_state, slots, rows=rows,
                                             samples=samples, max_lengths=max_lengths)
        return self._jit(key, build)(*args)

    def _insert_call(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int], *,
                     rows=None, samples=None, max_lengths=None):
        """`(key, build, args)` of `bulk_insert(...)`."""
        k = len(slots)
        b, t = prefix.cache.v.shape[1], prefix.cache.length
        m = prefix.tokens.shape[1]
        if k > self._slots:
            raise ConfigError(f"bulk_insert of {k} slots into {self._slots}")
        pad = lambda x, fill: np.concatenate(
            [np.asarray(x, np.int32), np.full(self._slots - k, fill, np.int32)])
        rows_ = pad(np.zeros(k) if rows is None else rows, 0)
        samples_ = pad(np.arange(k) % m if samples is None else samples, 0)
        slots_ = pad(slots, self._slots)  # out of range: dropped by the scatter
        r = self.max_decode_length
        lims_ = pad(np.full(k, r) if max_lengths is None else max_lengths, r)
        key = ("insert", b, t, m)
        return key, lambda: self._build_insert(key, b, t, m), (
            decode_state, prefix, *jax.device_put((rows_, samples_, slots_, lims_),
                                                  self._replicated))

    # --------------------------------------------------------------------------- generate

    def generate(self, params, decode_state: DecodeState,
                 sampler: SamplingParams | None = None) -> tuple[DecodeState, ResultTokens]:
        """One token for every active slot (the state is donated)."""
        return self.generate_steps(params, decode_state, 1, sampler)

    def generate_steps(self, params, decode_state: DecodeState, num_steps: int,
                       sampler: SamplingParams | None = None, *,
                       stop_when_done: int | None = None):
        """Up to `num_steps` generate steps in one jitted `while_loop`.

        The loop stops early once every slot is done, or once at least `stop_when_done`
        slots are done (finished or empty; a dynamic argument: no recompile), so that a
        caller with queued requests can refill a finished slot at once. ResultTokens are
        [S, num_steps]; steps not run are not valid.
        """
        key, build, args = self._generate_call(params, decode_state, num_steps, sampler,
                                               stop_when_done)
        return self._jit(key, build)(*args)

    def _generate_call(self, params, decode_state, num_steps, sampler, stop_when_done):
        """`(key, build, args)` of `generate_steps(...)`."""
        sampler = self.resolve_sampling(sampler)
        rule = sampler.program()
        key = ("generate", num_steps, rule)
        stop = self._slots if stop_when_done is None else stop_when_done
        return key, lambda: self._build_generate(key, num_steps, rule), (
            params, decode_state, *jax.device_put((np.int32(stop), np.bool_(sampler.greedy)),
                                                  self._replicated))

    # ----------------------------------------------------------- ahead-of-time compiling

    def precompile(self, params, *, prefill_batches: Sequence[int], length: int,
                   num_samples: int = 1, generate_steps: Sequence[int] = (),
                   sampler: SamplingParams | None = None, stop=lambda: False,
                   limited: bool = False) -> None:
        """Compiles the programs of a rollout ahead of time, running none of them: the
        decode state's init, a prefill of b prompts padded to `length`'s bucket with
        `num_samples` samples and its `bulk_insert` (for each b of `prefill_batches`), and
        `generate_steps` of each step count of `generate_steps`, for `sampler`; where the
        rollout `compacts` (`limited`: its requests have lengths of their own), each
        compaction and the longest generate of each smaller engine.

        Meant for a background thread: no device memory is used (the arguments are
        shapes), and a call in another thread that needs one of these programs while it
        compiles waits for it instead of compiling it twice. Programs built before are
        skipped. `params` may be arrays or `jax.ShapeDtypeStruct`s with shardings. `stop()`
        true: no more programs (checked before each).
        """
        state = self._compiled(self._init_call(None))
        bucket = self.bucket_for(length)
        for b in prefill_batches:
            if stop():
                return
            tokens = np.zeros((b, bucket), np.int32)
            prefix, _ = self._compiled(self._prefill_call(
                params, None, tokens, np.ones(b, np.int32), sampler, None, None, num_samples))
            if stop():
                return
            state = self._compiled(self._insert_call(prefix, state, [0]))
        for steps in generate_steps:
            if stop():
                return
            state, _ = self._compiled(self._generate_call(params, state, steps, sampler, None))
        engine = self
        while engine.compacts(sampler, limited) and generate_steps:  # its smaller engines
            if stop():
                return
            state = engine._compiled(engine._compact_call(state, []))
            engine = engine.smaller(engine._slots // 2)
            state, _ = engine._compiled(engine._generate_call(
                params, state, max(generate_steps), sampler, None))
