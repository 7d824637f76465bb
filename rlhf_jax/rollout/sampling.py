"""Next-token sampling as pure functions: greedy, temperature, top-k, top-p (nucleus).

Every request draws its randomness from `(rng, request id, response position)` with
`jax.random.fold_in`, never from the decode slot it happens to sit in, so a rollout is the same
whatever the number of slots or the order in which requests are scheduled.

Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from rlhf_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one rollout samples; hashable, so a jitted step can take it as a static argument.

    Attributes:
      temperature: logits are divided by it before filtering and sampling (0: greedy).
      top_k: keep the k most likely tokens; -1 (or 0) is off.
      top_p: keep the smallest set of most likely tokens whose mass reaches top_p (at least one).
      do_sample: False is greedy decoding (argmax); log-probs still use the tempered, filtered
        distribution, at temperature 1 when `temperature` is 0.
      max_response_length: stop after this many response tokens (None: the engine's bound).
      eos_ids: stop after any of these tokens (it is part of the response and of its mask).
      pad_id: fills responses after their end.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    max_response_length: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self):
        eos = self.eos_ids
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in eos))
        object.__setattr__(self, "top_k", -1 if int(self.top_k) <= 0 else int(self.top_k))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ConfigError(
                f"sampling max_response_length must be >= 1, got {self.max_response_length}"
            )

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def program(self) -> SamplingParams:
        """The rule a compiled rollout program is built for: greedy or not is left to a run
        time argument (`sample_tokens(greedy=...)`), so a greedy validation and a sampled
        rollout at the same effective temperature (0 reads as 1, as `filter_logits` does),
        top-k and top-p share their prefill and generate programs."""
        return dataclasses.replace(self, do_sample=True,
                                   temperature=self.temperature or 1.0)


def filter_logits(logits_bv, *, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0):
    """The logits of the sampling distribution: tempered, then top-k, then top-p filtered.

    Args:
      logits_bv: [B, V] raw logits.
      temperature: > 0 (0 is read as 1: greedy decoding scores tokens untempered).
      top_k: keep tokens whose logit is at least the k-th largest (ties at the k-th are kept).
      top_p: keep the most likely tokens until their mass reaches top_p; the most likely one
        always stays.

    Returns:
      [B, V] float32, -inf outside the support.
    """
    x = logits_bv.astype(jnp.float32) / (temperature if temperature > 0 else 1.0)
    v = x.shape[-1]
    if 0 < top_k < v:
        kth_b1 = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth_b1, x, -jnp.inf)
    if top_p < 1.0:
        sorted_bv = -jnp.sort(-x, axis=-1)  # descending
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        keep_bv = mass_before_bv < top_p  # the first token has 0 mass before it: always kept
        n_keep_b1 = jnp.sum(keep_bv, axis=-1, keepdims=True)
        threshold_b1 = jnp.take_along_axis(sorted_bv, n_keep_b1 - 1, axis=-1)
        x = jnp.where(x >= threshold_b1, x, -jnp.inf)
    return x


def request_keys(rng, request_ids_b, positions_b):
    """One key per row: `fold_in(fold_in(rng, request_id), position)`."""
    one = lambda r, p: jax.random.fold_in(jax.random.fold_in(rng, r), p)
    return jax.vmap(one)(request_ids_b, positions_b)


def first_argmax(x_bv):
    """`jnp.argmax(x, axis=-1)` (the first maximum; a NaN counts as the maximum) as two plain
    reductions, a max and then a min over the indices that reach it: on CPU, XLA's fused
    (value, index) reduction of `argmax` is several times slower, and decode samples every
    step."""
    v = x_bv.shape[-1]
    hit_bv = (x_bv == jnp.max(x_bv, axis=-1, keepdims=True)) | jnp.isnan(x_bv)
    return jnp.min(jnp.where(hit_bv, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def sample_tokens(logits_bv, keys_b, params: SamplingParams, greedy=None):
    """Draws one token per row.

    Args:
      logits_bv: [B, V] raw logits of the next position.
      keys_b: [B] PRNG keys (see `request_keys`); unused when greedy.
      params: the sampling rule.
      greedy: None: greedy as `params` says; else a traced bool scalar that decides it at
        run time (one program for a sampled and a greedy rollout of the same rule, see
        `SamplingParams.program`): a `lax.cond`, so the draw runs only when sampling and
        the tokens are those of the static choice, bit for bit.

    Returns:
      (tokens [B] int32, log_probs [B] float32 under the sampling distribution (tempered and
      filtered), raw_log_probs [B] float32 under the untempered, unfiltered softmax).
    """
    filtered_bv = filter_logits(
        logits_bv, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
    )
    def draw(x_bv):  # jax.random.categorical's Gumbel-max draw: same tokens for same keys
        v = x_bv.shape[-1]
        return first_argmax(x_bv + jax.vmap(lambda k: jax.random.gumbel(k, (v,), x_bv.dtype))(
            keys_b))

    if greedy is not None:
        tokens_b = jax.lax.cond(greedy, first_argmax, draw, filtered_bv)
    elif params.greedy:
        tokens_b = first_argmax(filtered_bv)
    else:
        tokens_b = draw(filtered_bv)
    tokens_b = tokens_b.astype(jnp.int32)
    log_probs_b = gather_log_softmax(filtered_bv, tokens_b)
    raw_log_probs_b = gather_log_softmax(logits_bv.astype(jnp.float32), tokens_b)
    return tokens_b, log_probs_b, raw_log_probs_b


def gather_log_softmax(logits_bv, tokens_b):
    """log_softmax(logits)[b, tokens[b]]: [B] float32."""
    logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    return jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]


def is_eos(tokens, eos_ids: Sequence[int]):
    """Bool array of `tokens`' shape: the token is one of `eos_ids`."""
    out = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        out |= tokens == e
    return out
