"""Compiled versions of the core_algos functions, with no static argument names to know.

`jax.jit(ca.kl_penalty)(logp, ref, "low_var_kl")` fails: jit traces every argument and a
string is not an array. Here every function is jitted with the arguments that are not arrays
(strings, modes, booleans, Python numbers, None, config objects) made static call by call,
so the same call as the eager one compiles:

    from rlhf_jax.core_algos import jitted
    kl = jitted.kl_penalty(logp, ref, "low_var_kl")                 # compiled once per mode
    loss, m = jitted.compute_policy_loss(old, logp, adv, mask, loss_agg_mode="seq-mean-token-sum")
    f = jitted.jit(my_loss)                                          # any function of yours

Inside a function you jit yourself, call the plain functions with the string as a Python
constant (a closure or `functools.partial`): it is then part of the program, not an input.
A Python number becomes static too (one compile per value): pass an array (`jnp.float32(x)`)
for a coefficient you sweep.
"""

from __future__ import annotations

import functools
import inspect

import jax
import numpy as np

_DYNAMIC = (jax.Array, np.ndarray, np.generic)


def _is_array_tree(value) -> bool:
    """`value` holds arrays (an array, or a tuple / list / dict of them): traced."""
    leaves = jax.tree.leaves(value)
    return bool(leaves) and any(isinstance(x, _DYNAMIC) for x in leaves)


def jit(fn):
    """`fn` under `jax.jit`, its non-array arguments static, whatever their names.

    Args:
      fn: a function of arrays and options (strings, booleans, Python numbers, None,
        hashable config objects).

    Returns:
      A function with `fn`'s signature and results. Each call binds its arguments to
      `fn`'s parameters by name; the ones that hold no array are static (a new value compiles
      once more), the others are traced. A static argument must be hashable.
    """
    sig = inspect.signature(fn)
    programs: dict[tuple[str, ...], object] = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        named = {}
        for name, value in bound.arguments.items():
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                raise TypeError(f"jitted.jit: {fn.__name__} takes *{name}; wrap it first")
            else:
                named[name] = value
        static = tuple(sorted(k for k, v in named.items() if not _is_array_tree(v)))
        program = programs.get(static)
        if program is None:
            program = programs[static] = jax.jit(fn, static_argnames=static)
        return program(**named)

    call.__wrapped__ = fn
    return call


@functools.cache
def _jitted(name: str):
    from rlhf_jax import core_algos

    fn = getattr(core_algos, name)
    if not inspect.isfunction(fn):
        raise AttributeError(f"core_algos.{name} is not a function")
    return jit(fn)


def __getattr__(name: str):
    from rlhf_jax import core_algos

    if name.startswith("_") or name not in core_algos.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _jitted(name)
