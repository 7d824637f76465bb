"""The jitted programs of the rollout `Engine` (`engine.py`): the model on new tokens with
logits at one position, and the builders of prefill, insert and the multi-token generate
loop (one decode step for every slot). A mixin: the `Engine` holds the mesh, the layouts,
the slot count and the jit cache these read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlhf_jax.mesh import activation_rules
from rlhf_jax.models.model import cache_mask
from rlhf_jax.models.stacking import KVCache, per_layer_params
from rlhf_jax.models.transformer import cache_position_axes, decode_chunks
from rlhf_jax.rollout.sampling import SamplingParams, is_eos, request_keys, sample_tokens
from rlhf_jax.rollout.state import DecodeState, Prefix, ResultTokens


class EnginePrograms:
    """Builders of the `Engine`'s jitted prefill, insert and generate programs."""

    def _apply_last(self, params, ids_bt, positions_bt, mask_bts, cache, write_index_b, last_b):
        """The model on T new tokens, with logits only at row b's position `last_b[b]`."""
        tie = self.model.cfg.tie_word_embeddings

        def fn(module, ids, pos, mask, kv, wi, last):
            x_btd, new_cache = module.model(ids, pos, mask, kv, wi)
            x_b1d = jnp.take_along_axis(x_btd, last[:, None, None], axis=1)
            logits = module.model.attend(x_b1d) if tie else module.lm_head(x_b1d)
            return logits[:, 0].astype(jnp.float32), new_cache

        with activation_rules(self._mesh, self.rules):
            return self.model.module.apply(
                {"params": params}, ids_bt, positions_bt, mask_bts, cache, write_index_b,
                last_b, method=fn,
            )

    def _build_prefill(self, key, b: int, t: int, t0: int, m: int, sampler: SamplingParams):
        def prefill(params, existing, tokens_bt, lengths_b, rids_b, rng_data, greedy):
            self._traced(key)
            zeros = self.model.init_cache(b, t)
            if existing is None:
                cache, start_b = zeros, jnp.zeros((b,), jnp.int32)
            else:
                cache = KVCache(*(jnp.concatenate([old, new], axis=axis) for old, new, axis
                                  in zip(existing.cache, zeros, cache_position_axes(),
                                         strict=True)))
                start_b = existing.true_length
            positions_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
            mask_bts = cache_mask(start_b, t, t0 + t)
            logits_bv, cache = self._apply_last(params, tokens_bt, positions_bt, mask_bts,
                                                cache, start_b, lengths_b - 1)
            rids_bm = rids_b[:, None] + jnp.arange(m, dtype=jnp.int32)[None]
            keys = request_keys(jax.random.wrap_key_data(rng_data), rids_bm.reshape(-1),
                                jnp.zeros((b * m,), jnp.int32))
            tok, lp, raw = sample_tokens(jnp.repeat(logits_bv, m, axis=0), keys, sampler,
                                         greedy)
            done = is_eos(tok, sampler.eos_ids) | (sampler.max_response_length <= 1)
            prefix = Prefix(cache, start_b + lengths_b, rids_b, *(
                x.reshape(b, m) for x in (tok, lp, raw, done)))
            result = ResultTokens(tok[:, None], jnp.ones((b * m, 1), bool),
                                  jnp.ones((b * m,), jnp.int32), lp[:, None], raw[:, None],
                                  samples_per_slot=m)
            return prefix, result

        row = self._sharding(("cache_batch",), (b,))
        rep = NamedSharding(self._mesh, P())
        prev = None if t0 == 0 else self._prefix_shardings(b, t0, m)
        res = self._result_shardings(b * m, 1)
        return jax.jit(
            prefill,
            in_shardings=(self.param_shardings, prev,
                          self._sharding(("cache_batch", None), (b, t)), row, row, rep, rep),
            out_shardings=(self._prefix_shardings(b, t0 + t, m),
                           res.replace(samples_per_slot=m)),
            **self._jit_kw,
        )

    def _build_insert(self, key, b: int, t: int, m: int):
        r = self.max_decode_length

        def insert(state: DecodeState, prefix: Prefix, rows_k, samples_k, slots_k, lims_k):
            self._traced(key)
            first_kr = jnp.arange(r)[None] == 0
            pick = lambda x: x[rows_k, samples_k]

            def put(x, v):
                return x.at[slots_k].set(v, mode="drop")

            def put_first(x, v_k, fill):
                return put(x, jnp.where(first_kr, v_k[:, None], fill).astype(x.dtype))

            # the prefix's T positions into the slots, on each array's positions axis
            at = lambda axis: (slice(None), slots_k, *[slice(None)] * (axis - 2), slice(None, t))
            cache = KVCache(*(
                c.at[at(axis)].set(p[:, rows_k], mode="drop") for c, p, axis
                in zip(state.cache, prefix.cache, cache_position_axes(), strict=True)))
            return dataclasses.replace(
                state, cache=cache, tokens=put(state.tokens, pick(prefix.tokens)),
                write_index=put(state.write_index, prefix.true_length[rows_k]),
                generated=put(state.generated, jnp.ones_like(slots_k)),
                done=put(state.done, pick(prefix.done) | (lims_k <= 1)),
                max_length=put(state.max_length, lims_k),
                request_id=put(state.request_id, prefix.request_id[rows_k] + samples_k),
                response=put_first(state.response, pick(prefix.tokens), 0),
                log_probs=put_first(state.log_probs, pick(prefix.log_probs), 0.0),
                raw_log_probs=put_first(state.raw_log_probs, pick(prefix.raw_log_probs), 0.0),
            )

        st = self.decode_state_shardings()
        rep = NamedSharding(self._mesh, P())
        return jax.jit(insert, in_shardings=(st, self._prefix_shardings(b, t, m), rep, rep, rep,
                                             rep),
                       out_shardings=st, donate_argnums=0, **self._jit_kw)

    def _step(self, params, state: DecodeState, sampler: SamplingParams, greedy=None):
        """One token for every slot: (new state, tokens [S], valid [S], lp [S], raw [S])."""
        s = self._slots
        active_s = ~state.done
        wi_s = state.write_index
        mask_sts = cache_mask(wi_s, 1, self.cache_length)
        logits_sv, cache = self._apply_last(params, state.tokens[:, None], wi_s[:, None],
                                            mask_sts, state.cache, wi_s, jnp.zeros((s,), jnp.int32))
        keys = request_keys(jax.random.wrap_key_data(state.rng), state.request_id,
                            state.generated)
        tok_s, lp_s, raw_s = sample_tokens(logits_sv, keys, sampler, greedy)
        col_sr = (jnp.arange(self.max_decode_length)[None] == state.generated[:, None])
        col_sr &= active_s[:, None]
        generated_s = state.generated + active_s
        limit_s = jnp.minimum(state.max_length, sampler.max_response_length)
        finished_s = is_eos(tok_s, sampler.eos_ids) | (generated_s >= limit_s)
        new = dataclasses.replace(
            state, cache=cache, tokens=jnp.where(active_s, tok_s, state.tokens),
            write_index=wi_s + active_s, generated=generated_s,
            done=state.done | (active_s & finished_s),
            response=jnp.where(col_sr, tok_s[:, None], state.response),
            log_probs=jnp.where(col_sr, lp_s[:, None], state.log_probs),
            raw_log_probs=jnp.where(col_sr, raw_s[:, None], state.raw_log_probs),
            steps=state.steps + 1,
        )
        return new, (tok_s, active_s, lp_s, raw_s)

    def _build_generate(self, key, k: int, sampler: SamplingParams):
        s = self._slots

        def generate(params, state: DecodeState, stop_when_done, greedy):
            self._traced(key)
            zi, zf = jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32)
            bufs = (zi, jnp.zeros((s, k), bool), zf, zf)

            def cond(carry):
                i, st, _ = carry
                n_done = jnp.sum(st.done)
                return (i < k) & (n_done < s) & (n_done < stop_when_done)

            # Each layer's weights are split out once per call, outside the loop, as the
            # cache is (`per_layer_params`).
            step_params = per_layer_params(params) if k > 1 else params

            def body(carry):
                i, st, bufs = carry
                st, outs = self._step(step_params, st, sampler, greedy)
                bufs = tuple(jax.lax.dynamic_update_slice(b_, o[:, None], (0, i))
                             for b_, o in zip(bufs, outs, strict=True))
                return i + 1, st, bufs

            # Several steps carry the cache per layer, on CPU in chunks of positions (one
            # split and one stack per call, no copy of a layer's block per step; see
            # `KVCache`, `decode_chunks`).
            axes = cache_position_axes()
            if k > 1:
                chunks = decode_chunks(self.cache_length)
                state = dataclasses.replace(state, cache=state.cache.per_layer(chunks, axes))
            _, state, (tok, valid, lp, raw) = jax.lax.while_loop(cond, body, (0, state, bufs))
            if k > 1:
                state = dataclasses.replace(state, cache=state.cache.stacked(axes))
            return state, ResultTokens(tok, valid, state.generated, lp, raw)

        st = self.decode_state_shardings()
        rep = NamedSharding(self._mesh, P())
        return jax.jit(generate, in_shardings=(self.param_shardings, st, rep, rep),
                       out_shardings=(st, self._result_shardings(s, k)), donate_argnums=1,
                       **self._jit_kw)

    def _build_compact(self, key, small):
        """The live slots `idx` of the state gathered into the `small` engine's slots."""

        def compact(state: DecodeState, idx_s, valid_s):
            self._traced(key)
            rows = lambda x: x[idx_s]
            return DecodeState(
                KVCache(*(c[:, idx_s] for c in state.cache)), rows(state.tokens),
                rows(state.write_index), rows(state.generated),
                jnp.where(valid_s, rows(state.done), True), rows(state.request_id),
                rows(state.response), rows(state.log_probs), rows(state.raw_log_probs),
                state.rng, state.steps, rows(state.max_length),
            )

        rep = NamedSharding(self._mesh, P())
        return jax.jit(compact, in_shardings=(self.decode_state_shardings(), rep, rep),
                       out_shardings=small.decode_state_shardings(), **self._jit_kw)
