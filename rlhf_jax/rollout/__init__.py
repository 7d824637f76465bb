"""Rollout: a JetStream-style engine, sampling, the RL rollout driver and resharding.

Nothing here imports jetstream; `rlhf_jax.rollout.jetstream_adapter` (the `jetstream` extra)
plugs the engine into JetStream's own orchestrator and server.
"""

from rlhf_jax.rollout.driver import RolloutBatch, generate_sequences, prompt_rows
from rlhf_jax.rollout.engine import Engine
from rlhf_jax.rollout.reshard import reshard
from rlhf_jax.rollout.sampling import SamplingParams, filter_logits, sample_tokens
from rlhf_jax.rollout.state import DecodeState, Prefix, ResultTokens, default_buckets

__all__ = [
    "DecodeState", "Engine", "Prefix", "ResultTokens", "RolloutBatch", "SamplingParams",
    "default_buckets", "filter_logits", "generate_sequences", "prompt_rows", "reshard",
    "sample_tokens",
]
