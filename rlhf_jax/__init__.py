"""rlhf_jax: verl's PPO trainer in JAX/Flax, on a named (data, fsdp, tensor) mesh.

Submodules are imported lazily so that `import rlhf_jax.core_algos` in a notebook pulls in
nothing but jax and numpy.
"""

__version__ = "0.1.0"
