"""Rule rewards chosen by a row's `data_source`, as verl's `default_compute_score` does.

    compute_score("openai/gsm8k", "... #### 72", "72")      -> 1.0
    score_batch(sources, responses, truths, extra_infos)    -> float32 [batch]

    @register_reward("my/data")                             # a scorer for more rows
    def my_score(solution_str, ground_truth, extra_info): return 1.0

A user function (`reward.custom_reward_function.path/name`) replaces the registry for every
row; it is called as `fn(data_source=, solution_str=, ground_truth=, extra_info=)` and may
return a float or a dict with a "score" key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlhf_jax.errors import ConfigError
from rlhf_jax.rewards import addition, gsm8k
from rlhf_jax.rewards import math as math_reward

Scorer = Callable[[str, Any, Any], float]  # (solution_str, ground_truth, extra_info) -> score

REGISTRY: dict[str, Scorer] = {}


def register(data_source: str, scorer: Scorer) -> None:
    """Score rows whose `data_source` is `data_source` with `scorer` (replacing any other)."""
    REGISTRY[data_source] = scorer


def register_reward(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator: `scorer(solution_str, ground_truth, extra_info) -> float` scores the rows
    of each of `data_sources` (a later registration of the same source replaces it).

        @register_reward("my/data", "my/data-hard")
        def my_score(solution_str, ground_truth, extra_info): ...
    """
    if not data_sources or not all(isinstance(s, str) for s in data_sources):
        raise TypeError("register_reward takes one or more data_source names: "
                        "@register_reward('my/data')")

    def decorator(scorer: Scorer) -> Scorer:
        for source in data_sources:
            register(source, scorer)
        return scorer

    return decorator


@register_reward("openai/gsm8k")
def _gsm8k(solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    return gsm8k.compute_score(solution_str, ground_truth)


@register_reward("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def _math(solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    return math_reward.compute_score(solution_str, ground_truth)


@register_reward("synthetic/addition")
def _addition(solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    return addition.compute_score(solution_str, ground_truth)


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Mapping[str, Any] | None = None) -> float:
    """The rule reward of one response.

    Raises:
        ConfigError: no scorer is registered for `data_source`.
    """
    scorer = REGISTRY.get(data_source)
    if scorer is None:
        raise ConfigError(f"no reward function for data_source {data_source!r}; "
                          "set reward.custom_reward_function.path/name")
    return float(scorer(solution_str, ground_truth, extra_info))


def _module_from_file(path: str):
    # A per-path module name, so two reward files with the same basename do not collide.
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    name = f"rlhf_jax_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"custom reward file {path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """Import the function `name` from a `.py` file or a dotted module path.

    Raises:
        ConfigError: the file or module does not exist, or has no callable `name`.
    """
    expanded = os.path.expanduser(path)
    if expanded.endswith(".py") or os.sep in expanded:
        if not os.path.isfile(expanded):
            raise ConfigError(f"custom reward file not found: {path}")
        module = _module_from_file(expanded)
    else:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name is not None and path.startswith(e.name):
                raise ConfigError(f"custom reward module not found: {path}") from None
            raise  # the module exists but one of its own imports failed
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"custom reward {path} has no function {name!r}")
    if not callable(fn):
        raise ConfigError(f"custom reward {path}: {name!r} is not callable")
    return fn


def _as_float(value: Any) -> float:
    return float(value["score"]) if isinstance(value, Mapping) else float(value)


def score_batch(data_sources: Sequence[str], responses: Sequence[str],
                ground_truths: Sequence[Any], extra_infos: Sequence[Any] | None = None,
                custom_fn: Callable[..., Any] | None = None) -> np.ndarray:
    """Scores of a batch of decoded responses.

    Args:
        data_sources, responses, ground_truths, extra_infos: one entry per row
            (`extra_infos=None` means no extra info for any row).
        custom_fn: when set, scores every row instead of the registry (verl semantics).

    Returns:
        float32 [batch].
    """
    n = len(responses)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError("score_batch: all arguments need one entry per response")
    scores = np.empty(n, np.float32)
    for i, (source, response, truth, extra) in enumerate(
            zip(data_sources, responses, ground_truths, extra_infos, strict=True)):
        if custom_fn is not None:
            scores[i] = _as_float(custom_fn(data_source=source, solution_str=response,
                                            ground_truth=truth, extra_info=extra))
        else:
            scores[i] = compute_score(source, response, truth, extra)
    return scores
