"""OpenAI's completions and chat-completions requests, checked, and their response objects.

`parse(kind, body, served)` turns a request body into a `Job` (token-id prompts, sampling,
limits) or raises `ApiError`, which the HTTP layer sends as OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`). A field this server does not implement
(`stop`, `logprobs`, penalties, tools, ...) is refused with a 400 naming it, never ignored;
an unknown field is refused as OpenAI refuses it. Extensions, as vLLM names them: `top_k`,
and `return_token_ids` (each choice then carries `prompt_token_ids` and `token_ids`, the
generated ids with the EOS).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any

from rlhf_jax.errors import UserError
from rlhf_jax.rollout.sampling import SamplingParams

# Fields accepted only at their "off" value; the hint says what to do instead.
_OFF = {
    "stop": (None, [], "stop sequences are not implemented; the model stops at its EOS"),
    "echo": (False, None, "echo is not implemented"),
    "suffix": (None, None, "suffix is not implemented"),
    "best_of": (None, 1, "best_of is not implemented"),
    "frequency_penalty": (0, None, "penalties are not implemented"),
    "presence_penalty": (0, None, "penalties are not implemented"),
    "logit_bias": (None, {}, "logit_bias is not implemented"),
    "logprobs": (None, False, "log-probabilities are not returned by this server"),
    "top_logprobs": (None, 0, "log-probabilities are not returned by this server"),
    "tools": (None, [], "tool calls are not implemented"),
    "tool_choice": (None, "none", "tool calls are not implemented"),
    "parallel_tool_calls": (None, False, "tool calls are not implemented"),
    "response_format": (None, {"type": "text"}, "only text responses are implemented"),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
           "stream_options", "seed", "user", "return_token_ids"}
FIELDS = {
    "completions": _COMMON | {"prompt", "stop", "echo", "suffix", "best_of", "logprobs",
                              "frequency_penalty", "presence_penalty", "logit_bias"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "stop", "frequency_penalty",
                       "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "tools",
                       "tool_choice", "parallel_tool_calls", "response_format"},
}
MAX_N = 64


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status`, `message`, the offending `param`, a `code`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                        code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass
class Job:
    """A checked request: `prompts` (token ids) x `n` choices, each up to `max_tokens`."""

    kind: str  # "completions" | "chat"
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    max_tokens: int
    stream: bool
    include_usage: bool
    seed: int | None
    return_token_ids: bool
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _typed(body: Mapping, key: str, types, what: str, default=None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(f"'{key}' must be {what}, got {value!r}", key)
    if not isinstance(value, types):
        raise _bad(f"'{key}' must be {what}, got {value!r}", key)
    return value


def _is_off(value: Any, offs: tuple) -> bool:
    """`value` is one of `offs`; a bool only equals a bool (`logprobs: 0` is not `false`)."""
    for off in offs:
        if isinstance(value, bool) or isinstance(off, bool) or value is None or off is None:
            if value is off:
                return True
        elif value == off:
            return True
    return False


def _message_text(content: Any, i: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise _bad(f"messages[{i}].content: only text parts are implemented", "messages")
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(body: Mapping) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _bad(f"messages[{i}]: {', '.join(sorted(extra))} not implemented "
                       "(role, content and name are)", "messages")
        out.append({**m, "content": _message_text(m.get("content"), i)})
    return out


def _prompts(body: Mapping) -> list:
    """OpenAI's prompt forms: a string, strings, token ids, or lists of token ids."""
    p = body.get("prompt")
    is_ids = lambda x: isinstance(x, list) and x and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(p, str) or is_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or is_ids(x) for x in p):
        return list(p)
    raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list "
               "of lists of token ids (none empty)", "prompt")


def parse(kind: str, body: Any, served) -> Job:
    """Checks a `/v1/completions` (`kind="completions"`) or `/v1/chat/completions`
    (`"chat"`) body against `served` (a `ServedModel`) and encodes its prompts as the
    trainer does (`ServedModel.encode`).

    Raises:
      ApiError: 400 for a malformed or unsupported request, 404 for another model's name.
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for key, (off, alt, hint) in _OFF.items():
        if key in FIELDS[kind] and not _is_off(body.get(key), (None, off, alt)):
            raise _bad(f"'{key}': {hint}", key)
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required", "model")
    if model != served.name:
        raise ApiError(404, f"The model `{model}` does not exist (this server has "
                            f"`{served.name}`)", "model", "model_not_found")
    engine_max = served.engine.max_decode_length
    limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    default_max = min(served.defaults.max_new_tokens or engine_max, engine_max)
    max_tokens = _typed(body, limit_key, int, "an integer", default_max)
    if not 1 <= max_tokens <= engine_max:
        raise _bad(f"'{limit_key}' must lie in [1, {engine_max}] (the server's "
                   f"max_decode_length), got {max_tokens}", limit_key)
    temperature = _typed(body, "temperature", (int, float), "a number")
    if temperature is not None and not 0 <= temperature <= 2:
        raise _bad(f"'temperature' must lie in [0, 2], got {temperature}", "temperature")
    top_p = _typed(body, "top_p", (int, float), "a number")
    if top_p is not None and not 0 < top_p <= 1:
        raise _bad(f"'top_p' must lie in (0, 1], got {top_p}", "top_p")
    top_k = _typed(body, "top_k", int, "an integer")
    if top_k is not None and top_k < -1:
        raise _bad(f"'top_k' must be -1 (off), 0 (off) or positive, got {top_k}", "top_k")
    n = _typed(body, "n", int, "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise _bad(f"'n' must lie in [1, {MAX_N}], got {n}", "n")
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", Mapping, "an object", {})
    if options and not stream:
        raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if set(options) - {"include_usage"}:
        raise _bad("'stream_options' knows only include_usage", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    seed = _typed(body, "seed", int, "an integer")
    _typed(body, "user", str, "a string")
    return_ids = _typed(body, "return_token_ids", bool, "a boolean", False)
    raw = [_messages(body)] if kind == "chat" else _prompts(body)
    param = "messages" if kind == "chat" else "prompt"
    try:
        prompts = [served.encode(p) for p in raw]
        sampling = served.sampling(temperature=temperature, top_p=top_p, top_k=top_k)
    except UserError as e:
        raise _bad(str(e), param) from None
    return Job(kind, prompts, n, sampling, max_tokens, stream, include_usage, seed, return_ids)


def request_ids(job: Job, counter) -> list[int]:
    """The int32 request id of each choice: from `seed` (the same seed, prompt and
    parameters give the same answer) or else from the server's running `counter`."""
    total = len(job.prompts) * job.n
    if job.seed is not None:
        return [(job.seed * 1_000_003 + c) % 2**31 for c in range(total)]
    return [next(counter) % 2**31 for _ in range(total)]


# ------------------------------------------------------------------------------ responses


def usage(job: Job, completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _head(job: Job, model: str, chunk: bool) -> dict:
    obj = {"chat": "chat.completion", "completions": "text_completion"}[job.kind]
    if chunk and job.kind == "chat":
        obj += ".chunk"
    return {"id": job.object_id, "object": obj, "created": job.created, "model": model}


def choice(job: Job, index: int, text: str | None, finish: str | None, *, ids=None,
           first: bool = False, chunk: bool = False) -> dict:
    """One entry of `choices`: a whole answer, or (chunk) a streamed delta."""
    out: dict[str, Any] = {"index": index}
    if job.kind == "chat":
        if chunk:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            out["delta"] = delta
        else:
            out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text or ""
    out.update(logprobs=None, finish_reason=finish)
    if job.return_token_ids:
        if first or not chunk:
            out["prompt_token_ids"] = job.prompts[index // job.n]
        out["token_ids"] = list(ids or [])
    return out


def response(job: Job, model: str, answers: list[tuple[str, list[int], str]]) -> dict:
    """The whole response: `answers` holds (text, ids, finish_reason) of each choice."""
    return {**_head(job, model, False),
            "choices": [choice(job, i, text, finish, ids=ids)
                        for i, (text, ids, finish) in enumerate(answers)],
            "usage": usage(job, sum(len(ids) for _, ids, _ in answers))}


def chunk(job: Job, model: str, choices: list[dict], usage_: dict | None = None) -> dict:
    """One server-sent event's object."""
    out = {**_head(job, model, True), "choices": choices}
    if job.include_usage:
        out["usage"] = usage_
    return out
