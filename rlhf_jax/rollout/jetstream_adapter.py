"""The rollout engine as a `jetstream.engine.engine_api.Engine` of google-jetstream 0.2.2.

The only module that imports jetstream (the optional `jetstream` extra:
`pip install google-jetstream==0.2.2`). `JetStreamEngine` wraps an `Engine` for JetStream's own
orchestrator (`jetstream.core.orchestrator.Driver`) and gRPC server (`jetstream.core.server_lib`);
`serve()` starts that server on a local port. RL rollouts do not go through here: the
orchestrator cannot swap parameters between steps, so the trainer drives the engine directly.

0.2.2 is older than the API `Engine` follows: its `prefill` returns only the prefix, its
`generate` takes no sampler and its `ResultTokens` pack tokens, validity and lengths into one
int32 array. The first token of a request is sampled by `prefill` but only `generate` can
stream it, so the adapter emits each slot's tokens one step late (step t streams token t),
and a response's last token one step after it is sampled.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from rlhf_jax.errors import ConfigError, UserError
from rlhf_jax.prompts import encode_prompts
from rlhf_jax.rollout.engine import Engine
from rlhf_jax.rollout.sampling import SamplingParams
from rlhf_jax.rollout.state import DecodeState, Prefix

# token_utils.pad_tokens (used by the orchestrator) only knows these prefill lengths.
_JETSTREAM_BUCKETS = tuple(16 * 2**i for i in range(12))


def _delete_pytree(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def patch_orchestrator() -> None:
    """Makes 0.2.2's orchestrator run on jax 0.10.2 and keeps its logging quiet.

    Its `delete_pytree` calls `jax.tree_map`, which jax has removed; importing it sets the
    root logger to DEBUG, which we undo.
    """
    root = logging.getLogger()
    level = root.level
    from jetstream.core import orchestrator

    root.setLevel(level)
    if not hasattr(jax, "tree_map"):
        orchestrator.delete_pytree = _delete_pytree


class _Tokenizer(tokenizer_api.Tokenizer):
    """JetStream's tokenizer interface over `rlhf_jax.tokenizer.Tokenizer` (or ids only).

    Text is formatted as the trainer formatted its prompts (`rlhf_jax.prompts`: the chat
    template, with its BOS), unless `encode` says otherwise.
    """

    def __init__(self, tokenizer, *, bos_id: int, pad_id: int, eos_ids: tuple[int, ...],
                 encode=None):
        self._tok, self._bos, self._pad, self._eos = tokenizer, bos_id, pad_id, eos_ids
        self._encode = encode

    def encode(self, s: str, **kwargs):
        if self._encode is not None:
            ids = self._encode(s)
        elif self._tok is None:
            raise UserError("this server has no tokenizer: send token_content, not text")
        else:
            ids = encode_prompts(self._tok, [s])[1][0]
        return token_utils.pad_tokens(
            np.asarray(ids, np.int32), self._bos, self._pad,
            is_bos=kwargs.get("is_bos", True), prefill_lengths=kwargs.get("prefill_lengths"),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs) -> str:
        del kwargs
        return "" if self._tok is None else self._tok.decode(list(token_ids))

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos[0] if self._eos else -1

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._eos)


class JetStreamEngine(engine_api.Engine):
    """An `Engine` behind JetStream 0.2.2's interface.

    Args:
      engine: the rollout engine; its `max_prefill_length` must be 16 * 2^k (JetStream's
        padding knows no other lengths).
      params: parameters on the engine's generate layout (`load_params()` returns them).
      sampling: how every request samples (default: the engine's); `eos_ids` stop a request.
      tokenizer: an `rlhf_jax.tokenizer.Tokenizer` for text requests (None: token ids only);
        text is formatted as in training (`rlhf_jax.prompts.encode_prompts`: the chat
        template writes the BOS where the model has one).
      bos_id: the id JetStream's orchestrator prepends to every prompt; None (what
        `scripts/serve.py` passes) drops that first token again, so token-id requests are
        taken as they are and text requests get the template's BOS only.
      encode: text -> token ids instead of the chat template (`serve.py --raw-prompts`).
      rng: the key all requests' sampling derives from (request ids count up from 0).
    """

    def __init__(self, engine: Engine, params=None, *, sampling: SamplingParams | None = None,
                 tokenizer=None, bos_id: int | None = None, rng=None, encode=None):
        if engine.max_prefill_length not in _JETSTREAM_BUCKETS:
            raise ConfigError(
                f"JetStream pads prompts to 16 * 2^k tokens; max_prefill_length "
                f"{engine.max_prefill_length} is not one of them"
            )
        self.engine = engine
        self.params = params
        self.sampling = engine.resolve_sampling(sampling)
        self.rng = jax.random.key(0) if rng is None else rng
        self._strip_bos = bos_id is None
        self._tokenizer = tokenizer
        self._encode_text = encode
        self._bos = self.sampling.pad_id if bos_id is None else bos_id
        self._ids = itertools.count()
        patch_orchestrator()
        st = engine.decode_state_shardings()
        self._emit = jax.jit(_emit, in_shardings=(st, st.generated),
                             out_shardings=(st.generated, st.response), donate_argnums=1)

    # ---------------------------------------------------------------------- JetStream API

    def prefill(self, *, params, existing_prefix: Prefix | None = None, padded_tokens,
                true_length: int) -> Prefix:
        tokens = jnp.asarray(padded_tokens, jnp.int32)
        t = tokens.shape[-1]
        true_length = min(int(true_length), t)  # pad_tokens keeps the last t of a long prompt
        if self._strip_bos and existing_prefix is None and true_length > 1:
            tokens = jnp.concatenate([tokens[..., 1:], jnp.zeros_like(tokens[..., :1])], axis=-1)
            true_length -= 1
        prefix, _ = self.engine.prefill(
            params=params, existing_prefix=existing_prefix, padded_tokens=tokens,
            true_length=true_length, sampler=self.sampling, request_id=next(self._ids),
            rng=self.rng,
        )
        return prefix

    def generate(self, params, decode_state) -> tuple[Any, engine_api.ResultTokens]:
        state, emitted = decode_state
        state, _ = self.engine.generate(params, state, self.sampling)
        emitted, data = self._emit(state, emitted)
        result = engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                         length_idx=(2, 3), samples_per_slot=1)
        return (state, emitted), result

    def insert(self, prefix: Prefix, decode_state, slot: int):
        state, emitted = decode_state
        state = self.engine.insert(prefix, state, slot)
        return state, emitted.at[slot].set(0)

    def init_decode_state(self, *args, **kwargs):
        del args, kwargs
        state = self.engine.init_decode_state(self.rng)
        return state, jnp.zeros_like(state.generated)

    def load_params(self, *args, **kwargs):
        del args, kwargs
        if self.params is None:
            self.params = self.engine.load_params()
        return self.params

    def free_resource(self, slot: int) -> None:
        self.engine.free_resource(slot)

    def get_prefix_destination_sharding(self) -> Any:
        return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="rlhf_jax")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters):
        del metadata
        return _Tokenizer(self._tokenizer, bos_id=self._bos, pad_id=self.sampling.pad_id,
                          eos_ids=self.sampling.eos_ids, encode=self._encode_text)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self):
        return self.engine.mesh

    @property
    def colocated_cpus(self):
        return None


def _emit(state: DecodeState, emitted_s):
    """Streams the next unsent response token of every slot: (emitted, data [S, 3] int32)."""
    valid_s = emitted_s < state.generated
    last = state.response.shape[1] - 1
    idx_s1 = jnp.minimum(emitted_s, last)[:, None]
    tok_s = jnp.take_along_axis(state.response, idx_s1, axis=1)[:, 0]
    emitted_s = emitted_s + valid_s
    return emitted_s, jnp.stack([tok_s, valid_s.astype(jnp.int32), emitted_s], axis=1)


def serve(adapter: JetStreamEngine, *, port: int, host: str = "127.0.0.1",
          threads: int | None = None):
    """Starts JetStream's gRPC server (`server_lib.run`) for one interleaved engine.

    Returns:
      The running `server_lib.JetStreamServer` (`.stop()` ends it).
    """
    patch_orchestrator()
    from jetstream.core import config_lib, server_lib

    devices = list(adapter.mesh.devices.flat)
    config = type("RlhfJaxServer", (config_lib.ServerConfig,), {
        "interleaved_slices": (f"device={len(devices)}",),
        "interleaved_engine_create_fns": (lambda _devices: adapter,),
    })
    server_lib._HOST = host  # server_lib binds "[::]" (all interfaces) otherwise
    return server_lib.run(port=port, config=config, devices=devices, threads=threads)
