"""Does the server answer as the trainer's validation does? (`scripts/serve_check.py`, tests)

`validation_generations(trainer)` generates what the trainer's validation generates for every
validation prompt (`val_kwargs` sampling, the same seed), and `ask_server(url, model, rows)`
sends the same prompts, as the chat messages of the data file, to an OpenAI-compatible
server (`/v1/chat/completions`, with `return_token_ids`). `compare` counts identical prompt
ids and identical answers, and scores both with the run's reward.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from rlhf_jax.rewards import score_responses


def _messages(files: list[str], prompt_key: str) -> list[list[dict]]:
    """The chat messages of every row of `files`, in the data loader's order (index)."""
    out = []
    for path in files:
        out += pq.read_table(path, columns=[prompt_key]).column(prompt_key).to_pylist()
    return out


def validation_generations(trainer) -> list[dict]:
    """For each validation prompt: its `messages`, the trainer's `prompt_ids` and the
    `response_ids` its validation generates (EOS included), with `batch` and `row` to score.

    Greedy unless `val_kwargs` sample; the key is validation's (`trainer.seed + 2`).
    """
    import jax

    cfg = trainer.cfg
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    messages = _messages(list(cfg.data.val_files), cfg.data.prompt_key)
    seed = jax.random.key(cfg.trainer.seed + 2)
    out = []
    loader = trainer.val_loader
    loader.set_state({**loader.get_state(), "epoch": 0, "step": 0})
    for batch in loader:
        exp = trainer.generate(batch, vk.n, trainer.sampling(validate=True), seed)
        mask = exp.response_mask.astype(bool)
        for row in range(len(batch)):
            prompt = batch.input_ids[row][batch.attention_mask[row].astype(bool)]
            out.append({"messages": messages[batch.index[row]], "prompt_ids": prompt.tolist(),
                        "response_ids": exp.seqs.responses[row * vk.n][mask[row * vk.n]]
                        .tolist(), "batch": batch, "row": row})
    loader.set_state({**loader.get_state(), "epoch": 0, "step": 0})
    return out


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - a loopback URL
        return json.loads(r.read())


def ask_server(base_url: str, model: str, rows: list[dict], *, max_tokens: int,
               timeout: float = 300.0) -> list[dict]:
    """The server's greedy answer to each row's messages: `prompt_ids`, `token_ids`, `text`."""
    out = []
    for r in rows:
        resp = _post(f"{base_url}/chat/completions", {
            "model": model, "messages": r["messages"], "temperature": 0,
            "max_tokens": max_tokens, "return_token_ids": True}, timeout)
        c = resp["choices"][0]
        out.append({"prompt_ids": c["prompt_token_ids"], "token_ids": c["token_ids"],
                    "text": c["message"]["content"]})
    return out


def _score(trainer, row: dict, ids: list[int]) -> float:
    r = max(len(ids), 1)
    responses = np.full((1, r), trainer.tokenizer.pad_token_id, np.int32)
    responses[0, :len(ids)] = ids
    mask = (np.arange(r) < len(ids)).astype(np.int32)[None]
    batch = row["batch"]
    one = type(batch)(**{k: (v[row["row"]:row["row"] + 1] if isinstance(v, np.ndarray | list)
                             else v) for k, v in vars(batch).items()})
    return float(score_responses(trainer.tokenizer, one, responses, mask, 1, trainer.cfg,
                                 custom_fn=trainer.reward_fn).scores[0])


def compare(trainer, rows: list[dict], answers: list[dict]) -> dict[str, Any]:
    """Counts over the prompts: identical prompt ids, identical answers (token for token),
    and how many answers of each side score > 0.5 with the run's reward."""
    return {
        "prompts": len(rows),
        "identical_prompt_ids": sum(r["prompt_ids"] == a["prompt_ids"]
                                    for r, a in zip(rows, answers, strict=True)),
        "identical_answers": sum(r["response_ids"] == a["token_ids"]
                                 for r, a in zip(rows, answers, strict=True)),
        "trainer_correct": sum(_score(trainer, r, r["response_ids"]) > 0.5 for r in rows),
        "server_correct": sum(_score(trainer, r, a["token_ids"]) > 0.5
                              for r, a in zip(rows, answers, strict=True)),
    }
