"""Prompt data in verl's parquet schema, batched into fixed-shape, left-padded arrays.

    dataset = PromptDataset(["train.parquet"], tokenizer, max_prompt_length=512)
    loader = PromptLoader(dataset, 1024, shuffle=True, seed=1)
    for epoch in range(loader.epoch, total_epochs):
        for batch in loader:            # one epoch; then StopIteration and epoch += 1
            ...                         # batch.input_ids: int32 [B, P]
    state = loader.get_state()          # small JSON dict; set_state(state) resumes exactly

Rows: `data_source`, `prompt` (a list of {role, content}; `prompt_key`), `reward_model`
{style, ground_truth}, `extra_info`. Every prompt is rendered with the tokenizer's chat template
(add_generation_prompt=True) and tokenized up front, so overlong rows are known (and can be
filtered) before training starts. The order of an epoch is grain's index shuffle of the row ids
with seed `seed + epoch`, so a position (epoch, step) fully determines a batch: that is the
whole checkpoint, and it does not depend on how many hosts read the data.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_jax import prompts as prompts_lib
from rlhf_jax.errors import ConfigError, DataError, ModelError
from rlhf_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One (host's share of a) batch of prompts; arrays are left-padded to P.

    Attributes:
        input_ids: int32 [B, P], pad id on the left.
        attention_mask: int32 [B, P], 1 on prompt tokens.
        position_ids: int32 [B, P], 0 at the first prompt token (and on the padding).
        data_source, ground_truth, extra_info, uid, raw_prompt, index: one entry per row;
            `uid` is "file:row", `raw_prompt` the chat text, `index` the row's position in the
            concatenated files.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    data_source: list[str]
    ground_truth: list[Any]
    extra_info: list[dict]
    uid: list[str]
    raw_prompt: list[str]
    index: list[int]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _read_parquet(path: str, prompt_key: str) -> pa.Table:
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise DataError(f"data file not found: {path}")
    try:
        table = pq.read_table(expanded)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read parquet {path}: {e}") from None
    if prompt_key not in table.column_names:
        raise DataError(f"{path} has no column {prompt_key!r} "
                        f"(columns: {', '.join(table.column_names)})")
    return table


def _column(table: pa.Table, name: str, default: Any) -> list:
    if name not in table.column_names:
        return [default] * table.num_rows
    return table.column(name).to_pylist()


def _as_dict(value: Any, where: str, column: str) -> dict:
    """A struct cell (dict) or map cell (list of pairs) as a dict; null -> {}."""
    if value is None:
        return {}
    try:
        return dict(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: column {column!r} must be a struct, got {value!r:.80}") from None


class PromptDataset:
    """All prompt rows of `files`, chat-templated and tokenized (random access by position).

    Args:
        files: one parquet path or several (concatenated in order).
        tokenizer: a `rlhf_jax.tokenizer.Tokenizer` with a chat template.
        prompt_key: the column that holds the messages.
        max_prompt_length: P, the padded prompt width.
        truncation: what to do with a prompt longer than P: "error" (DataError), "left"
            (keep the last P tokens), "right" (keep the first P), "middle" (keep both ends).
        filter_overlong_prompts: drop overlong rows instead (before any truncation);
            `num_filtered` says how many.
    """

    def __init__(self, files: str | Sequence[str], tokenizer: Tokenizer, *,
                 prompt_key: str = "prompt", max_prompt_length: int = 512,
                 truncation: str = "error", filter_overlong_prompts: bool = False):
        if truncation not in TRUNCATION_MODES:
            raise ConfigError(f"data.truncation must be one of {TRUNCATION_MODES}, "
                              f"got {truncation!r}")
        if max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if tokenizer.pad_token_id is None:
            raise ModelError(f"tokenizer {tokenizer.name} has neither a pad nor an eos token")
        self.files = [files] if isinstance(files, str | os.PathLike) else list(files)
        if not self.files:
            raise ConfigError("no data files given")
        self.files = [os.fspath(f) for f in self.files]
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.num_filtered = 0
        self._rows: list[dict] = []
        offset = 0
        for path in self.files:
            table = _read_parquet(path, prompt_key)
            self._add_file(path, table, offset, truncation, filter_overlong_prompts)
            offset += table.num_rows
        if filter_overlong_prompts and self.num_filtered:
            log.info("filtered %d of %d prompts longer than %d tokens", self.num_filtered,
                     offset, max_prompt_length)
        if not self._rows:
            raise DataError(f"no usable rows in {', '.join(self.files)}")

    def _add_file(self, path: str, table: pa.Table, offset: int, truncation: str,
                  filter_overlong: bool) -> None:
        limit = self.max_prompt_length
        prompts = table.column(self.prompt_key).to_pylist()
        for row, messages in enumerate(prompts):  # verl's schema: messages, never a text
            problem = prompts_lib.check_messages(messages)
            if problem is not None:
                raise DataError(f"{path} row {row}: column {self.prompt_key!r} {problem}")
        try:  # the server formats its prompts with this same function
            texts, token_ids = prompts_lib.encode_prompts(self.tokenizer, prompts)
        except prompts_lib.PromptError as e:
            raise DataError(f"{path} row {e.index}: {e}") from None
        if "reward_model" not in table.column_names:  # verl's reward reads its ground_truth
            raise DataError(f"{path} has no column 'reward_model' ({{style, ground_truth}} in "
                            "verl's schema: the reward function needs each row's ground_truth)")
        sources = _column(table, "data_source", "")
        rewards = table.column("reward_model").to_pylist()
        extras = _column(table, "extra_info", None)
        for row, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
            if len(ids) > limit:
                if filter_overlong:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(f"{path} row {row}: prompt has {len(ids)} tokens, more than "
                                    f"max_prompt_length {limit} (set data.truncation or "
                                    "data.filter_overlong_prompts)")
                ids = prompts_lib.truncate(ids, limit, truncation)
            where = f"{path} row {row}"
            reward = _as_dict(rewards[row], where, "reward_model")
            self._rows.append({
                "input_ids": np.asarray(ids, np.int32),
                "data_source": sources[row],
                "ground_truth": reward.get("ground_truth"),
                "extra_info": _as_dict(extras[row], where, "extra_info"),
                "uid": f"{path}:{row}",
                "raw_prompt": text,
                "index": offset + row,
            })

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict:
        """Row `i`: its unpadded `input_ids` (int32 [L], L <= P) and the metadata fields."""
        return self._rows[i]

    def collate(self, rows: Sequence[Mapping[str, Any]]) -> PromptBatch:
        """Left-pad `rows` into a PromptBatch of width max_prompt_length."""
        b, p = len(rows), self.max_prompt_length
        input_ids = np.full((b, p), self.pad_token_id, np.int32)
        mask = np.zeros((b, p), np.int32)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            if n:
                input_ids[i, p - n:] = row["input_ids"]
                mask[i, p - n:] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
        return PromptBatch(
            input_ids=input_ids, attention_mask=mask, position_ids=positions,
            **{k: [row[k] for row in rows]
               for k in ("data_source", "ground_truth", "extra_info", "uid", "raw_prompt",
                         "index")})


class PromptLoader:
    """Batches of a PromptDataset, one epoch per `for` loop, resumable from `get_state()`.

    Epoch e visits the rows in grain's shuffle order with seed `seed + e` (or in file order
    when `shuffle=False`). Global batch s of an epoch is positions [s*B, (s+1)*B) of that order;
    host `shard_index` of `shard_count` gets rows [i*B/k, (i+1)*B/k) of it, so the hosts'
    batches together are the single-process batch.

    Args:
        dataset: the rows.
        batch_size: B, the global batch size (prompts); must divide by shard_count.
        shuffle: reshuffle every epoch.
        seed: shuffle seed, 0 <= seed < 2**32 - epochs.
        drop_remainder: drop the last partial batch (training); otherwise it is smaller.
        shard_index, shard_count: this process's share (jax.process_index/process_count).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_remainder: bool = True, shard_index: int = 0,
                 shard_count: int = 1):
        if batch_size < 1 or batch_size % shard_count:
            raise ConfigError(f"batch size {batch_size} must be a positive multiple of the "
                              f"{shard_count} data shards (hosts)")
        if not 0 <= shard_index < shard_count:
            raise ConfigError(f"shard_index {shard_index} is not in [0, {shard_count})")
        if drop_remainder and len(dataset) < batch_size:
            raise DataError(f"{len(dataset)} rows in {', '.join(dataset.files)} are fewer than "
                            f"one batch of {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_remainder = drop_remainder
        self.shard_index = shard_index
        self.shard_count = shard_count
        order = grain.MapDataset.range(len(dataset))
        self._order = order.shuffle(seed=self.seed) if shuffle else order
        self._epoch = 0
        self._step = 0

    @property
    def steps_per_epoch(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_remainder else -(-n // b)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (advances when an epoch's loop ends)."""
        return self._epoch

    @property
    def step(self) -> int:
        """Batches already taken from the current epoch."""
        return self._step

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> PromptBatch:
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
            raise StopIteration
        batch = self.batch_at(self._epoch, self._step)
        self._step += 1
        return batch

    def batch_at(self, epoch: int, step: int) -> PromptBatch:
        """This shard's part of global batch `step` of `epoch` (no state change)."""
        n = len(self.dataset)
        lo = step * self.batch_size
        size = min(self.batch_size, n - lo)
        k, i = self.shard_count, self.shard_index
        begin, end = lo + size * i // k, lo + size * (i + 1) // k
        rows = [self.dataset[self._order[epoch * n + pos]] for pos in range(begin, end)]
        return self.dataset.collate(rows)

    def _fingerprint(self) -> dict:
        return {"num_rows": len(self.dataset), "batch_size": self.batch_size,
                "shuffle": self.shuffle, "seed": self.seed,
                "drop_remainder": self.drop_remainder}

    def get_state(self) -> dict:
        """JSON-able position; a finished epoch reads as the start of the next one."""
        epoch, step = self._epoch, self._step
        if step >= self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        return {"epoch": epoch, "step": step, **self._fingerprint()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `get_state()`'s result (of a loader over the same data and settings).

        Raises:
            DataError: the state was saved with other data, batch size, seed or shuffle.
        """
        saved = {k: state.get(k) for k in self._fingerprint()}
        if saved != self._fingerprint():
            raise DataError(f"data loader state {saved} does not match this loader "
                            f"{self._fingerprint()}")
        epoch, step = int(state["epoch"]), int(state["step"])
        if not (epoch >= 0 and 0 <= step <= self.steps_per_epoch):
            raise DataError(f"data loader state has an invalid position epoch={epoch} "
                            f"step={step}")
        self._epoch, self._step = epoch, step


def make_loaders(cfg, tokenizer) -> tuple[PromptLoader, PromptLoader | None]:
    """The run's train loader and its validation loader (None without `data.val_files`):
    each process reads its shard of every batch and the hosts' shards are joined, so every
    process holds the global batch (`distributed.gathered`)."""
    import jax

    from rlhf_jax import distributed

    d = cfg.data
    ds_kw = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                 truncation=d.truncation, filter_overlong_prompts=d.filter_overlong_prompts)
    shard = dict(shard_index=jax.process_index(), shard_count=jax.process_count())
    train = distributed.gathered(PromptLoader(
        PromptDataset(list(d.train_files), tokenizer, **ds_kw), d.train_batch_size,
        shuffle=d.shuffle, seed=d.seed, **shard))
    val = None
    if d.val_files:
        rows = PromptDataset(list(d.val_files), tokenizer, **ds_kw)
        val = distributed.gathered(PromptLoader(
            rows, d.val_batch_size or len(rows), shuffle=False, drop_remainder=False, **shard))
    return train, val
