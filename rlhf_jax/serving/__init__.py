"""Serving a trained policy: the rollout engine behind an OpenAI-compatible HTTP endpoint
(standard library only) and, with the `jetstream` extra, JetStream's gRPC server.

`load_served_model` builds the engine of an HF directory (what `scripts/export_hf.py` writes)
with the sampling defaults of its `generation_config.json`; prompts go through
`rlhf_jax.prompts.encode_prompts`, the trainer's own formatting. Nothing here imports
jetstream or TensorFlow.
"""

from rlhf_jax.serving.loading import GenerationDefaults, ServedModel, load_served_model
from rlhf_jax.serving.scheduler import Request, Scheduler

__all__ = ["GenerationDefaults", "Request", "Scheduler", "ServedModel", "load_served_model"]
