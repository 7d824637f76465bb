"""How a prompt becomes token ids, in training and in serving alike.

The trainer's data loader (`rlhf_jax.data.PromptDataset`) and the server (`scripts/serve.py`:
its JetStream tokenizer and its OpenAI endpoint) both call `encode_prompts`, so the two
cannot drift apart: chat messages are rendered with the tokenizer's chat template
(`add_generation_prompt=True`; the template writes the BOS where the model has one) and the
text is tokenized without adding special tokens, as verl encodes its rendered chats. A
plain-text prompt is one user message, `[{"role": "user", "content": text}]`, which is the
form of every row of the synthetic tasks and of verl's GSM8K data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from rlhf_jax.errors import DataError
from rlhf_jax.tokenizer import Tokenizer


class PromptError(DataError):
    """Prompt `index` cannot be rendered (a malformed message list, or the template failed)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def as_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict]:
    """A text prompt as the one user message it is in the training data; messages as they are."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def check_messages(messages: Any) -> str | None:
    """None if `messages` is a non-empty list of {role, content} dicts, else what is wrong."""
    ok = isinstance(messages, list | tuple) and len(messages) > 0 and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in messages)
    if not ok:
        return ("must be a non-empty list of {role, content} messages, got "
                f"{str(messages)[:80]!r}")
    return None


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[Any]
                   ) -> tuple[list[str], list[list[int]]]:
    """The rendered text and the token ids of each prompt, as the trainer sees them.

    Args:
        tokenizer: the run's tokenizer (it must have a chat template).
        prompts: each a list of {role, content} messages or a text (one user message).

    Returns:
        (texts, ids): the chat-template renderings and their token ids (no special tokens
        added beyond what the template writes).

    Raises:
        PromptError: a prompt is not a message list, or its template rendering failed.
    """
    texts = []
    for i, prompt in enumerate(prompts):
        messages = as_messages(prompt) if isinstance(prompt, str) else prompt
        problem = check_messages(messages)
        if problem is not None:
            raise PromptError(i, problem)
        try:
            texts.append(tokenizer.apply_chat_template(list(messages),
                                                       add_generation_prompt=True))
        except jinja2.TemplateError as e:
            raise PromptError(i, f"chat template failed: {e}") from None
    return texts, _tokenize(tokenizer, texts)


def _tokenize(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    try:
        return tokenizer.encode_batch(texts) if texts else []
    except Exception:  # the Rust side raises plain Exceptions: find the prompt and say why
        for i, text in enumerate(texts):
            try:
                tokenizer.encode(text)
            except Exception as e:
                raise PromptError(i, f"cannot tokenize {text[:80]!r}: {e}") from None
        raise


def truncate(ids: list[int], limit: int, mode: str) -> list[int]:
    """`ids` cut to `limit` tokens: "left" keeps the end, "right" the start, "middle" both
    ends (`data.truncation`)."""
    if mode == "left":
        return ids[-limit:]
    if mode == "right":
        return ids[:limit]
    head = limit // 2
    return ids[:head] + ids[len(ids) - (limit - head):]
