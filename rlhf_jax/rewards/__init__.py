"""Rule rewards chosen by a row's `data_source`, as verl's `default_compute_score` does.

    compute_score("openai/gsm8k", "... #### 72", "72")      -> 1.0
    score_batch(sources, responses, truths, extra_infos)    -> float32 [batch]

    @register_reward("my/data")                             # a scorer for more rows
    def my_score(solution_str, ground_truth, extra_info): return 1.0

A user function (`reward.custom_reward_function.path/name`) replaces the registry for every
row; it is called as `fn(data_source=, solution_str=, ground_truth=, extra_info=)` and may
return a float or a dict with a "score" key.

A scorer, too, may return such a dict: its entries are verl's `reward_extra_info`, which
`score_batch_info` collects per key (validation logs their statistics; a "pred" entry, the
extracted answer, is the vote of maj@N; dynamic sampling may filter on one). The built-in
GSM8K, MATH and addition scorers return `{"score", "pred"}`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from rlhf_jax.errors import ConfigError, UserError
from rlhf_jax.rewards import addition, gsm8k
from rlhf_jax.rewards import math as math_reward
from rlhf_jax.rewards.overlong import overlong_penalty

# (solution_str, ground_truth, extra_info) -> score, or a dict with "score" and extra info
Scorer = Callable[[str, Any, Any], float | Mapping[str, Any]]

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
def _gsm8k(solution_str: str, ground_truth: Any, extra_info: Any) -> dict:
    return gsm8k.score_and_pred(solution_str, ground_truth)


@register_reward("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def _math(solution_str: str, ground_truth: Any, extra_info: Any) -> dict:
    return math_reward.score_and_pred(solution_str, ground_truth)


@register_reward("synthetic/addition")
def _addition(solution_str: str, ground_truth: Any, extra_info: Any) -> dict:
    return addition.score_and_pred(solution_str, ground_truth)


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Mapping[str, Any] | None = None) -> float:
    """The rule reward of one response.

    Raises:
        ConfigError: no scorer is registered for `data_source`.
    """
    return _as_float(compute_result(data_source, solution_str, ground_truth, extra_info))


def compute_result(data_source: str, solution_str: str, ground_truth: Any,
                   extra_info: Mapping[str, Any] | None = None) -> float | Mapping[str, Any]:
    """What the registered scorer of `data_source` returns: a float, or a dict with "score"
    and extra info.

    Raises:
        ConfigError: no scorer is registered for `data_source`.
    """
    scorer = REGISTRY.get(data_source)
    if scorer is None:
        raise ConfigError(f"no reward function for data_source {data_source!r}; "
                          "set reward.custom_reward_function.path/name")
    return scorer(solution_str, ground_truth, extra_info)


def _module_from_file(path: str):
    # A per-path module name, so two reward files with the same basename do not collide.
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    name = f"rlhf_jax_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"custom reward file {path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: a syntax error, or its top level raised
        del sys.modules[name]
        where = f" line {e.lineno}" if isinstance(e, SyntaxError) else ""
        raise ConfigError(f"reward.custom_reward_function.path: {path}{where} cannot be "
                          f"imported: {type(e).__name__}: {_first_line(e)}") from None
    return module


def reward_fn_for(custom, *loaders) -> Callable[..., Any] | None:
    """`reward.custom_reward_function` (`custom`) loaded, or None after checking that the
    registry scores every row's data_source in the `loaders`' datasets (None skipped): an
    unknown source is refused here, before anything compiles, not at the first reward."""
    if custom.path:
        return load_custom_reward_fn(custom.path, custom.name)
    for dataset in (loader.dataset for loader in loaders if loader is not None):
        for i in range(len(dataset)):
            source = dataset[i]["data_source"]
            if source not in REGISTRY:
                raise ConfigError(
                    f"no reward function for data_source {source!r} (row {dataset[i]['uid']}; "
                    f"registered: {', '.join(sorted(REGISTRY))}); set "
                    "reward.custom_reward_function.path/name")
    return None


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
            raise ConfigError(f"custom reward module {path} cannot be imported: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
        except Exception as e:  # the module exists but its top level failed
            raise ConfigError(f"custom reward module {path} cannot be imported: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"custom reward {path} has no function {name!r}")
    if not callable(fn):
        raise ConfigError(f"custom reward {path}: {name!r} is not callable")
    return fn


class RewardError(UserError):
    """A reward function raised, or returned no finite score, on one row."""


def sample_name(source: str, i: int, extra: Any, row: str | None) -> str:
    """How an error names response `i` of a batch: its data source, row and index."""
    index = extra.get("index") if isinstance(extra, Mapping) else None
    where = f"response {i} of the batch" + ("" if row is None else f", row {row}")
    where += "" if index is None else f" (extra_info.index {index})"
    return f"data_source {source!r}, {where}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


def _as_float(value: Any) -> float:
    return float(value["score"]) if isinstance(value, Mapping) else float(value)


class Rewards(NamedTuple):
    """A batch's rewards: what each response gets, the reward function's own score, and
    verl's `reward_extra_info` (one list of N values per key; None where a row lacks it)."""

    scores: np.ndarray  # float32 [N]: raw + the overlong penalty (when on)
    raw: np.ndarray  # float32 [N]: the reward function's "score"
    info: dict[str, list]


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
    return score_batch_info(data_sources, responses, ground_truths, extra_infos,
                            custom_fn).raw


def score_row(i: int, source: str, response: str, truth: Any, extra: Any, row: str | None,
              custom_fn: Callable[..., Any] | None = None) -> tuple[float, Any]:
    """Response `i`'s score and the scorer's whole result, checked: a scorer that raises,
    or returns no finite score, is a one-line `RewardError` naming the sample. The inline
    path (`score_batch_info`) and the worker pool (`reward_pool`) both score through it."""
    at = sample_name(source, i, extra, row)
    try:
        if custom_fn is not None:
            result = custom_fn(data_source=source, solution_str=response,
                               ground_truth=truth, extra_info=extra)
        else:
            result = compute_result(source, response, truth, extra)
    except ConfigError:
        raise
    except Exception as e:  # the scorer is user code: name the row it failed on
        raise RewardError(f"the reward function raised on {at}: {type(e).__name__}: "
                          f"{_first_line(e)}") from None
    try:
        score = _as_float(result)
    except (TypeError, ValueError, KeyError):
        raise RewardError(f"the reward function returned {result!r:.80} on {at}: want "
                          "a float or a dict with a float 'score'") from None
    if not np.isfinite(score):
        raise RewardError(f"the reward function returned {np.float32(score)} on {at}")
    return score, result


def collect_info(info: dict[str, list], i: int, n: int, result: Any) -> None:
    """Adds row `i`'s dict entries (verl's `reward_extra_info`) to `info`, N values a key."""
    if isinstance(result, Mapping):
        for key, value in result.items():
            info.setdefault(key, [None] * n)[i] = value


def score_batch_info(data_sources: Sequence[str], responses: Sequence[str],
                     ground_truths: Sequence[Any], extra_infos: Sequence[Any] | None = None,
                     custom_fn: Callable[..., Any] | None = None,
                     rows: Sequence[str] | None = None) -> Rewards:
    """`score_batch` with the entries of dict results gathered per key, as verl's reward
    managers do (a float result adds none). `scores` equals `raw` (no shaping yet).
    `rows` name each response's data row ("file:row") in the error of a failing scorer."""
    n = len(responses)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError("score_batch: all arguments need one entry per response")
    scores = np.empty(n, np.float32)
    info: dict[str, list] = {}
    for i, (source, response, truth, extra) in enumerate(
            zip(data_sources, responses, ground_truths, extra_infos, strict=True)):
        scores[i], result = score_row(i, source, response, truth, extra,
                                      None if rows is None else rows[i], custom_fn)
        collect_info(info, i, n, result)
    return Rewards(scores, scores, info)


def with_overlong_penalty(rewards: Rewards, lengths: np.ndarray, *, max_response_length: int,
                          buffer_len: int, penalty_factor: float, log: bool = False) -> Rewards:
    """DAPO's overlong reward shaping added to `rewards.scores` (see `overlong.py`); with
    `log`, verl's `overlong_reward` (the penalty) and `overlong` (penalty < 0) join the info."""
    penalty = overlong_penalty(lengths, max_response_length=max_response_length,
                               buffer_len=buffer_len, penalty_factor=penalty_factor)
    info = rewards.info
    if log:
        info = {**info, "overlong_reward": [float(p) for p in penalty],
                "overlong": [bool(p < 0) for p in penalty]}
    return Rewards((rewards.scores + penalty).astype(np.float32), rewards.raw, info)


class RewardInputs(NamedTuple):
    """What the scorer of each of N responses is called with (prompt-major rows), and the
    responses' lengths (DAPO's overlong penalty reads them)."""

    data_sources: list
    responses: list[str]
    ground_truths: list
    extra_infos: list
    rows: list
    lengths: np.ndarray


def reward_inputs(tokenizer, batch, responses: np.ndarray, response_mask: np.ndarray,
                  n: int) -> RewardInputs:
    """`n` responses per prompt of `batch`, each decoded up to its length, with its row's
    data source, ground truth, extra info and name."""
    lengths = response_mask.sum(-1)
    texts = [tokenizer.decode(r[: int(k)].tolist())
             for r, k in zip(responses, lengths, strict=True)]
    rep = lambda xs: [x for x in xs for _ in range(n)]
    return RewardInputs(rep(batch.data_source), texts, rep(batch.ground_truth),
                        rep(batch.extra_info), rep(batch.uid), lengths)


def shaped(rewards: Rewards, lengths: np.ndarray, cfg) -> Rewards:
    """`rewards` with DAPO's overlong penalty when `cfg.reward_model.overlong_buffer` is on."""
    buf = cfg.reward_model.overlong_buffer
    if not buf.enable:
        return rewards
    return with_overlong_penalty(
        rewards, lengths, max_response_length=cfg.data.max_response_length,
        buffer_len=buf.len, penalty_factor=buf.penalty_factor, log=buf.log)


def score_responses(tokenizer, batch, responses: np.ndarray, response_mask: np.ndarray, n: int,
                    cfg, custom_fn=None) -> Rewards:
    """The rewards of `n` responses per prompt of `batch` (prompt-major): each decoded up to
    its length and scored by its row's data source (`score_batch_info`), with DAPO's overlong
    penalty when `cfg.reward_model.overlong_buffer` is on."""
    x = reward_inputs(tokenizer, batch, responses, response_mask, n)
    rewards = score_batch_info(x.data_sources, x.responses, x.ground_truths, x.extra_infos,
                               custom_fn=custom_fn, rows=x.rows)
    return shaped(rewards, x.lengths, cfg)
