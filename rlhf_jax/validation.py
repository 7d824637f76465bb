"""Validation metrics at N, as verl's `process_validation_metrics` computes them.

Each validation prompt gets N responses (rollout.val_kwargs.n). For every data source and
every numeric variable of the reward (`reward`, the score each response gets, and the
numeric entries of the reward's extra info) the prompt's N values give

    mean@N, std@N                        (population std; only for N > 1)
    best@k/{mean,std}, worst@k/{mean,std}  max / min of k responses drawn with replacement,
                                          1000 bootstrap draws, for k = 2, 4, 8, ... < N, and N
    maj@k/{mean,std}                     the value of the majority answer ("pred") of k draws

averaged over the source's prompts. The bootstrap draws come from a RandomState seeded with
42 for every call, as in verl, so a resumed run logs the same figures. Names follow verl's
`_validate`: `val-core/<source>/<var>/<metric>` for the core variable (`acc` if the reward
returns one, else `reward`) and the mean / maj / best metrics at the largest N; everything
else is `val-aux/...`. Ours: `val-aux/<source>/response_length/{mean,max,min,clip_ratio}`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

SEED = 42  # verl's default seed of process_validation_metrics
N_BOOTSTRAP = 1000


def sample_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for N = n responses: 2, 4, 8, ... below n, then n."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


@functools.lru_cache(maxsize=64)
def bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int = N_BOOTSTRAP,
                      seed: int = SEED) -> np.ndarray:
    """int [n_bootstrap, subset_size]: draws with replacement from range(n_data), the ones
    verl's `bootstrap_metric` makes (`np.random.seed(seed); np.random.choice(...)`)."""
    idx = np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size),
                                             replace=True)
    idx.flags.writeable = False  # shared by the cache
    return idx


def majority_index(votes: np.ndarray) -> np.ndarray:
    """The position of the majority answer in each row of `votes` ([..., k] vote codes):
    the first response that gave the most frequent vote; a tie goes to the vote seen first
    (verl's `calc_maj_val`). int [...]."""
    same = votes[..., :, None] == votes[..., None, :]  # [..., k, k]
    counts = same.sum(-1)
    earlier = np.tril(np.ones(same.shape[-2:], bool), -1)  # [j, i]: i < j
    first = ~(same & earlier).any(-1)  # no earlier response with the same vote
    return np.argmax(np.where(first, counts, -1), axis=-1)  # first max: the vote seen first


def majority_values(votes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The value of each row's majority answer (`majority_index`). [..., k] -> [...]."""
    return np.take_along_axis(values, majority_index(votes)[..., None], axis=-1)[..., 0]


def prompt_metrics(values: np.ndarray, votes: np.ndarray | None = None,
                   seed: int = SEED) -> dict[str, Any]:
    """Each prompt's metrics from its N responses (`group_metrics` of one variable)."""
    one = np.ndim(values) == 1
    out = group_metrics({"x": np.atleast_2d(values)},
                        None if votes is None else np.atleast_2d(votes), seed)["x"]
    return {name: float(v[0]) if one else v for name, v in out.items()}


def group_metrics(variables: dict[str, np.ndarray], votes: np.ndarray | None = None,
                  seed: int = SEED) -> dict[str, dict[str, np.ndarray]]:
    """Each prompt's metrics from its N responses, for several variables at once.

    Args:
        variables: name -> [U, N] the responses' values (U prompts).
        votes: [U, N] vote codes (equal code = same answer), for maj@k; None: no maj.

    Returns:
        variable -> metric name -> [U].
    """
    out: dict[str, dict[str, np.ndarray]] = {}
    values = {var: np.asarray(v, np.float64) for var, v in variables.items()}
    if not values:
        return out
    u, n = next(iter(values.values())).shape
    for var, x in values.items():
        out[var] = {f"mean@{n}": x.mean(1)}
        if n > 1:
            out[var][f"std@{n}"] = x.std(1)
    for k in sample_sizes(n):
        idx = bootstrap_indices(n, k, N_BOOTSTRAP, seed)
        win = None if votes is None else np.concatenate(  # [U, n_bootstrap], in chunks
            [majority_index(np.asarray(votes)[i:i + 64, idx]) for i in range(0, u, 64)])
        for var, x in values.items():
            draws = x[:, idx]  # [U, n_bootstrap, k]
            stats = {"best": draws.max(-1), "worst": draws.min(-1)}
            if win is not None:
                stats["maj"] = np.take_along_axis(draws, win[..., None], axis=-1)[..., 0]
            for name, stat in stats.items():
                out[var][f"{name}@{k}/mean"], out[var][f"{name}@{k}/std"] = (stat.mean(1),
                                                                           stat.std(1))
    return out


def _numeric(values: Sequence[Any]) -> bool:
    return bool(values) and all(isinstance(v, int | float | np.number | np.bool_) for v in values)


def process_validation_metrics(data_sources: Sequence[str], uids: Sequence[Any],
                               infos: dict[str, Sequence[Any]],
                               seed: int = SEED) -> dict[str, dict[str, dict[str, float]]]:
    """`{source: {variable: {metric: value}}}`: each prompt's (`uid`'s) metrics of every
    numeric variable of `infos` (one entry per response), averaged over the source's
    prompts. A "pred" variable is the vote of maj@k; a variable with anything but numbers
    among a source's prompts of one N is skipped there."""
    groups: dict[str, dict[Any, list[int]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups.setdefault(source, {}).setdefault(uid, []).append(i)
    preds = infos.get("pred")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source, by_uid in groups.items():
        sums: dict[str, dict[str, list[np.ndarray]]] = {}
        by_n: dict[int, list[list[int]]] = {}
        for rows in by_uid.values():
            by_n.setdefault(len(rows), []).append(rows)
        for prompts in by_n.values():
            rows = np.array(prompts)  # [U, N]
            votes = None
            if preds is not None:
                votes = np.empty(rows.shape, np.int64)
                for u, r in enumerate(prompts):  # codes in order of appearance, per prompt
                    codes: dict[Any, int] = {}
                    votes[u] = [codes.setdefault(preds[i], len(codes)) for i in r]
            variables = {}
            for var, column in infos.items():
                vals = [column[i] for i in rows.reshape(-1)]
                if _numeric(vals):
                    variables[var] = np.array(vals, np.float64).reshape(rows.shape)
            for var, metrics in group_metrics(variables, votes, seed).items():
                for name, per_prompt in metrics.items():
                    sums.setdefault(var, {}).setdefault(name, []).append(per_prompt)
        out[source] = {var: {name: float(np.concatenate(v).mean()) for name, v in m.items()}
                       for var, m in sums.items()}
    return out


def validation_metrics(data_sources: Sequence[str], uids: Sequence[Any],
                       infos: dict[str, Sequence[Any]], seed: int = SEED) -> dict[str, float]:
    """The flat `val-core/...` / `val-aux/...` metrics of `process_validation_metrics`."""
    out = {}
    for source, by_var in process_validation_metrics(data_sources, uids, infos, seed).items():
        core = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                is_core = (var == core and name.startswith(("mean", "maj", "best"))
                           and f"@{n_max}" in name)
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = value
    return out


def response_length_metrics(data_sources: Sequence[str], lengths: np.ndarray,
                            max_response_length: int) -> dict[str, float]:
    """`val-aux/<source>/response_length/{mean,max,min,clip_ratio}` (the training
    `response_length/*` per source; clip_ratio: the share that hit the limit)."""
    lengths = np.asarray(lengths, np.float64)
    sources = np.asarray(data_sources, dtype=object)
    out = {}
    for source in dict.fromkeys(data_sources):
        x = lengths[sources == source]
        prefix = f"val-aux/{source}/response_length"
        out.update({f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()),
                    f"{prefix}/min": float(x.min()),
                    f"{prefix}/clip_ratio": float(np.mean(x == max_response_length))})
    return out


def join_infos(parts: Sequence[tuple[int, dict[str, Sequence[Any]]]]) -> dict[str, list]:
    """One info dict from per-batch `(rows, info)` parts; a key a part lacks is None there."""
    total = sum(rows for rows, _ in parts)
    out: dict[str, list] = {}
    start = 0
    for rows, info in parts:
        for key, values in info.items():
            if len(values) != rows:
                raise ValueError(f"reward info {key!r}: {len(values)} values for {rows} rows")
            out.setdefault(key, [None] * total)[start:start + rows] = list(values)
        start += rows
    return out


def run(trainer) -> dict[str, float]:
    """Generates `val_kwargs.n` responses for every prompt of `trainer.val_loader` (from the
    start, seeded) and returns `validation_metrics` and `response_length_metrics` of them."""
    import jax

    vk = trainer.cfg.actor_rollout_ref.rollout.val_kwargs
    rep = lambda xs: [x for x in xs for _ in range(vk.n)]
    sources, uids, lengths, infos = [], [], [], []
    samples: list[tuple[str, str, float]] = []  # for trainer.log_val_generations
    seed = jax.random.key(trainer.cfg.trainer.seed + 2)
    loader = trainer.val_loader
    bar = trainer.progress.bar("validating", len(loader), unit="batch")
    with trainer.progress.phase(f"validating ({len(loader)} batches, n={vk.n})"):
        for batch in loader:
            exp = trainer.generate(batch, vk.n, trainer.sampling(validate=True), seed)
            rewards = trainer.reward(batch, exp, vk.n)
            infos.append((len(rewards.scores),
                          {"reward": rewards.scores.tolist(), **rewards.info}))
            sources += rep(batch.data_source)
            uids += rep(batch.uid)
            lengths.append(exp.response_mask.sum(-1))
            if trainer.cfg.trainer.log_val_generations:
                outputs = [trainer.tokenizer.decode(r[: int(k)].tolist()) for r, k in
                           zip(np.asarray(exp.seqs.targets), lengths[-1], strict=True)]
                samples += zip(rep(batch.raw_prompt), outputs, rewards.scores.tolist(),
                               strict=True)
            bar.update(1)
    bar.close()
    loader.set_state({**loader.get_state(), "epoch": 0, "step": 0})
    if samples:
        trainer.log({"event": "val/generations",
                     "samples": pick_generations(samples, trainer.cfg.trainer.log_val_generations)})
    return {**validation_metrics(sources, uids, join_infos(infos)),
            **response_length_metrics(sources, np.concatenate(lengths),
                                      trainer.cfg.data.max_response_length)}


def pick_generations(samples: Sequence[tuple[str, str, float]], n: int) -> list[dict]:
    """`trainer.log_val_generations`: n of the (input, output, score) samples, picked as
    verl's `_maybe_log_val_generations` picks them (sorted by input, shuffled by a
    RandomState seeded with 42, the first n), so each validation logs the same prompts."""
    picked = sorted(samples, key=lambda x: x[0])
    np.random.RandomState(SEED).shuffle(picked)
    return [{"input": i, "output": o, "score": float(sc)} for i, o, sc in picked[:n]]
