"""The engine's data: a prefill's `Prefix`, the slots' `DecodeState`, `ResultTokens`.

JetStream's engine API passes these between `prefill`, `insert` and `generate`
(`rollout/engine.py`); all are pytrees of arrays. Shapes: L layers, S slots, C cache length,
T prefill bucket, R max_decode_length, K kv heads, H head dim, m samples per prompt.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlhf_jax.models.stacking import KVCache


@struct.dataclass
class SlotData:
    """One slot's share of a `ResultTokens`."""

    tokens: Any  # [samples, t]
    valid: Any  # [samples, t]
    lengths: Any  # [samples]
    log_probs: Any  # [samples, t]


@struct.dataclass
class ResultTokens:
    """Tokens of one engine call for every row: JetStream's fields plus log-probs.

    `log_probs` are under the sampling distribution (tempered, top-k/top-p filtered);
    `raw_log_probs` under the untempered softmax. `lengths` count the response so far.
    """

    tokens: Any  # [b, t] int32
    valid: Any  # [b, t] bool
    lengths: Any  # [b] int32
    log_probs: Any  # [b, t] float32
    raw_log_probs: Any  # [b, t] float32
    samples_per_slot: int = struct.field(pytree_node=False, default=1)

    def copy_to_host_async(self) -> None:
        for x in jax.tree.leaves(self):
            if isinstance(x, jax.Array):
                x.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return jax.tree.map(np.asarray, self)

    def get_result_at_slot(self, slot: int) -> SlotData:
        lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        return SlotData(self.tokens[lo:hi], self.valid[lo:hi], self.lengths[lo:hi],
                        self.log_probs[lo:hi])


@struct.dataclass
class Prefix:
    """The KV cache of b right-padded prompts and the first token of m samples of each.

    Sample j of row r is request `request_id[r] + j`; its first token was drawn with
    `(rng, request id, 0)` and `done` says whether it already ends the response.
    """

    cache: KVCache  # [L, b, K, T, H] (keys [L, b, K, H, T] on CPU: `transposed_keys`)
    true_length: Any  # [b] int32 tokens in the cache
    request_id: Any  # [b] int32 request of sample 0
    tokens: Any  # [b, m] int32 first response token
    log_probs: Any  # [b, m] float32
    raw_log_probs: Any  # [b, m] float32
    done: Any  # [b, m] bool


@struct.dataclass
class DecodeState:
    """Everything `generate` transforms; rows are decode slots.

    A slot holds one request: `tokens` is its last sampled token, not yet fed to the model,
    whose keys go to cache row `write_index` (= its RoPE position); `generated` counts its
    response tokens, which accumulate in `response` / `log_probs` / `raw_log_probs`.
    An empty or finished slot has `done` set and is left untouched by `generate`.
    `max_length` is the request's own response-length limit (at most the sampler's).
    """

    cache: KVCache  # [L, S, K, C, H] (keys [L, S, K, H, C] on CPU: `transposed_keys`)
    tokens: Any  # [S] int32
    write_index: Any  # [S] int32
    generated: Any  # [S] int32
    done: Any  # [S] bool
    request_id: Any  # [S] int32
    response: Any  # [S, R] int32 (0 after `generated`)
    log_probs: Any  # [S, R] float32 (0 after `generated`)
    raw_log_probs: Any  # [S, R] float32
    rng: Any  # raw key data
    steps: Any  # [] int32 generate steps run on this state
    max_length: Any  # [S] int32 the slot's response-length limit


def default_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_prefill_length`, then `max_prefill_length`."""
    out, b = [], smallest
    while b < max_prefill_length:
        out.append(b)
        b *= 2
    return (*out, max_prefill_length)


def key_data(rng) -> jax.Array:
    """Raw uint32 data of a typed key, an old-style key, or an int seed."""
    if isinstance(rng, int | np.integer):
        rng = jax.random.key(int(rng))
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return jnp.asarray(rng, jnp.uint32)
