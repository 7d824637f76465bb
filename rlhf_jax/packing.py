"""Sequence packing with token-budget micro-batches (verl's `use_remove_padding` and
`use_dynamic_bsz`), arranged on host with numpy.

A padded rollout row spends the actor's, the reference's and the critic's FLOPs on padding
(the prompt's left padding and everything after the response's EOS). Here each group of
sequences (a mini-batch of an update, or the whole batch of a forward pass) is

1. balanced over the data-parallel ranks: each rank gets the same number of sequences,
   chosen greedily (longest first, to the rank with the fewest tokens) so that their token
   sums are close;
2. on each rank, packed first-fit-decreasing into rows of exactly `budget` tokens, one row a
   micro-batch: the sequences lie end to end, positions restart at 0 for each one, segment
   ids tell them apart (attention never crosses two segments), the rest of the row is
   padding (segment 0).

Every shape is static: rows `[K, dp, budget]` with K = sequences per rank (the most
micro-batches a rank can need, one sequence each), so one program serves every step; the
micro-batches that no rank fills are skipped at run time (`active`, a `lax.cond`).

The per-token inputs of the losses (old log-probs, advantages, ...) stay per sequence, in
slots `[M, R]` (rank d's sequences in the d-th block of M / dp slots, so each rank's slots
sit on its own devices): `where[slot, r]` is the flat index of response token r's
prediction in the rows `[K * dp * W]` (W = budget - 1, the targets window), -1 past the
response. `Packed.per_slot` gathers any per-token array of the rows into the slots.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from rlhf_jax.errors import ConfigError


class Packed(NamedTuple):
    """A group of M sequences packed into micro-batch rows (host numpy or device arrays).

    Leading axes (e.g. U updates) may precede every field's own axes.
    """

    rows: object  # train_steps.Sequences [K, dp, T]: the packed rows, one row a rank
    active: np.ndarray  # [K] bool: a rank holds a sequence in micro-batch k
    where: np.ndarray  # [M, R] int32: flat index into [K * dp * (T - 1)], -1 off the response
    micro: np.ndarray  # [M] int32: the micro-batch of each slot (-1: an empty slot)
    response_mask: np.ndarray  # [M, R] int32: the response tokens of each slot


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """How to pack the groups of one call: sequences per group (M), data-parallel ranks,
    the row length in tokens (the per-rank budget) and the prompt / response widths of the
    padded rows they come from."""

    group: int  # M sequences per group
    dp: int
    budget: int  # tokens per row (per rank, per micro-batch)
    prompt_len: int  # P of the padded rows
    response_len: int  # R

    def __post_init__(self):
        if self.group % self.dp:
            raise ConfigError(f"{self.group} sequences cannot be split over {self.dp} "
                              "data-parallel ranks")
        if self.budget < self.prompt_len + self.response_len:
            raise ConfigError(
                f"token budget {self.budget} per device is smaller than one sequence "
                f"(max_prompt_length + max_response_length = "
                f"{self.prompt_len + self.response_len}); raise the *_max_token_len_per_gpu")

    @property
    def per_rank(self) -> int:
        return self.group // self.dp

    @property
    def micro_batches(self) -> int:
        """K: the most micro-batches a rank can need. First fit leaves at most one row at
        most half full, so a rank's `per_rank` sequences of at most P + R tokens fill fewer
        than 2 x their tokens / budget + 1 rows (and never more rows than sequences)."""
        most = self.per_rank * (self.prompt_len + self.response_len)
        return min(self.per_rank, 2 * most // self.budget + 1)


def lengths(attention_mask: np.ndarray, response_mask: np.ndarray) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """(prompt tokens, response tokens) of each padded row (a prompt left-padded, a response
    that is a prefix of its window)."""
    r = response_mask.shape[-1]
    prompt = attention_mask[:, :-r].sum(-1).astype(np.int64)
    response = response_mask.sum(-1).astype(np.int64)
    return prompt, response


def balance(tokens: np.ndarray, dp: int) -> list[np.ndarray]:
    """Splits positions `0..len(tokens)-1` into `dp` lists of equal size whose token sums
    are close: longest first, each to the rank with the fewest tokens that still has room."""
    n = len(tokens)
    per = n // dp
    load = np.zeros(dp, np.int64)
    out: list[list[int]] = [[] for _ in range(dp)]
    for i in np.argsort(-tokens, kind="stable"):
        room = [d for d in range(dp) if len(out[d]) < per]
        d = min(room, key=lambda r: (load[r], r))
        out[d].append(int(i))
        load[d] += tokens[i]
    return [np.asarray(x, np.int64) for x in out]


def first_fit(tokens: np.ndarray, budget: int) -> list[list[int]]:
    """First-fit decreasing bins of at most `budget` tokens: lists of positions."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-tokens, kind="stable"):
        t = int(tokens[i])
        for b, free in enumerate(room):
            if t <= free:
                bins[b].append(int(i))
                room[b] -= t
                break
        else:
            bins.append([int(i)])
            room.append(budget - t)
    return bins


def pack_group(plan: PackPlan, input_ids: np.ndarray, attention_mask: np.ndarray,
               response_mask: np.ndarray):
    """Packs the M padded rows of one group. Returns `(fields, slots)`: the fields of a
    `Packed` (rows as a dict of Sequences fields) and `slots[M]`, the group position of the
    sequence in each slot (slot order: rank-major)."""
    k_max, dp, t = plan.micro_batches, plan.dp, plan.budget
    w = t - 1
    p_width, r_width = plan.prompt_len, plan.response_len
    prompt, response = lengths(attention_mask, response_mask)
    total = prompt + response
    ids = np.zeros((k_max, dp, t), np.int32)
    pos = np.zeros((k_max, dp, t), np.int32)
    seg = np.zeros((k_max, dp, t), np.int32)
    mask = np.zeros((k_max, dp, w), np.int32)
    where = np.full((plan.group, r_width), -1, np.int32)
    micro = np.full(plan.group, -1, np.int32)
    slots = np.zeros(plan.group, np.int64)
    active = np.zeros(k_max, bool)
    for d, members in enumerate(balance(total, dp)):
        slots[d * plan.per_rank:(d + 1) * plan.per_rank] = members
        slot_of = {int(g): d * plan.per_rank + c for c, g in enumerate(members)}
        bins = first_fit(total[members], t)
        assert len(bins) <= k_max, (len(bins), k_max)  # the first-fit bound above
        for k, chunk in enumerate(bins):
            active[k] = True
            offset = 0
            for segment, local in enumerate(chunk, start=1):
                g = int(members[local])
                p, r = int(prompt[g]), int(response[g])
                tokens = input_ids[g, p_width - p:p_width + r]
                ids[k, d, offset:offset + p + r] = tokens
                pos[k, d, offset:offset + p + r] = np.arange(p + r)
                seg[k, d, offset:offset + p + r] = segment
                first = offset + p - 1  # the window index predicting response token 0
                mask[k, d, first:first + r] = 1
                s = slot_of[g]
                where[s, :r] = (k * dp + d) * w + first + np.arange(r)
                micro[s] = k
                offset += p + r
    rows = dict(input_ids=ids, positions=pos, segment_ids=seg, targets=ids[..., 1:],
                loss_mask=mask)
    fields = dict(rows=rows, active=active, where=where, micro=micro,
                  response_mask=response_mask[slots].astype(np.int32))
    return fields, slots


def pack(plan: PackPlan, seqs, groups: np.ndarray):
    """Packs `groups[U, M]` (row indices into the padded `seqs`, host `Sequences` [N, ...])
    into a `Packed` with a leading U axis, and returns it with `slots[U, M]` (the row index
    of each slot's sequence)."""
    from rlhf_jax.train_steps import Sequences

    packed, slots = [], []
    for group in groups:
        fields, s = pack_group(plan, seqs.input_ids[group], seqs.segment_ids[group],
                               seqs.loss_mask[group])
        packed.append(fields)
        slots.append(group[s])
    stack = lambda *xs: np.stack(xs)
    rows = Sequences(**{k: stack(*[p["rows"][k] for p in packed]) for k in Sequences._fields})
    return Packed(rows, stack(*[p["active"] for p in packed]),
                  stack(*[p["where"] for p in packed]), stack(*[p["micro"] for p in packed]),
                  stack(*[p["response_mask"] for p in packed])), np.stack(slots)


def to_slots(x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """A per-sequence host array `[N, ...]` in the slot order `[U, M, ...]`."""
    return x[slots]


def from_slots(x: np.ndarray, slots: np.ndarray, n: int) -> np.ndarray:
    """Undoes `to_slots` for slots that visit every row once: `[U, M, ...] -> [N, ...]`."""
    flat = slots.reshape(-1)
    out = np.zeros((n, *x.shape[slots.ndim:]), x.dtype)
    out[flat] = x.reshape(flat.size, *x.shape[slots.ndim:])
    return out


def forward_micro_per_device(cfg) -> int | None:
    """Sequences a device scores at once in the padded old-log-prob / values passes (None:
    the whole batch)."""
    a = cfg.actor_rollout_ref
    return a.rollout.log_prob_micro_batch_size_per_device or a.actor.ppo_micro_batch_size_per_device


def budgets(cfg, checked) -> dict[str, int | None]:
    """Tokens a rank's row holds in each packed pass and update of a step (None: padded).

    With `use_dynamic_bsz` (verl's `*_use_dynamic_bsz`) the budget is verl's
    `*_max_token_len_per_gpu`; without it, the tokens of the role's padded micro-batch
    (micro-batch size per device x (max_prompt_length + max_response_length)), so a packed
    micro-batch never needs more memory than the padded one it replaces, and holds as many
    sequences as fit.

    Args:
      cfg: the resolved Config.
      checked: its `validate_batch_arithmetic` plan (micro-batch sizes per role).
    Returns:
      `{"old", "ref", "values", "actor", "critic"}` -> tokens per row, or None.
    """
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    per_device_batch = checked.sequences_per_device
    fwd = forward_micro_per_device(cfg) or per_device_batch
    fixed = lambda micro: min(micro, per_device_batch) * longest

    def pick(packed, dynamic, budget, micro):
        if not packed:
            return None
        return budget if dynamic else fixed(micro)

    out = {
        "old": pick(arr.model.use_remove_padding, arr.rollout.log_prob_use_dynamic_bsz,
                    arr.rollout.log_prob_max_token_len_per_gpu, fwd),
        "ref": pick(arr.model.use_remove_padding, arr.ref.log_prob_use_dynamic_bsz,
                    arr.ref.log_prob_max_token_len_per_gpu,
                    arr.ref.log_prob_micro_batch_size_per_device or fwd),
        "actor": pick(arr.model.use_remove_padding, arr.actor.use_dynamic_bsz,
                      arr.actor.ppo_max_token_len_per_gpu,
                      checked.actor.micro_batch_size_per_device),
        "values": None, "critic": None,
    }
    if checked.critic is not None:
        out["values"] = pick(critic.model.use_remove_padding, critic.use_dynamic_bsz,
                             critic.forward_max_token_len_per_gpu, fwd)
        out["critic"] = pick(critic.model.use_remove_padding, critic.use_dynamic_bsz,
                             critic.ppo_max_token_len_per_gpu,
                             checked.critic.micro_batch_size_per_device)
    return out
