"""A Hugging Face tokenizer directory without transformers: `tokenizers` + a jinja2 chat template.

`load_tokenizer(path)` reads what `transformers.AutoTokenizer.from_pretrained(path)` reads for a
fast tokenizer -- `tokenizer.json`, `tokenizer_config.json` (special tokens, `add_bos_token`,
`chat_template`), the legacy `special_tokens_map.json`, `chat_template.jinja`, and the
`eos_token_id` of `generation_config.json` -- and gives the same token ids and chat strings
(tests/test_tokenizer.py checks the parity on a tiny tokenizer).

What `encode(..., add_special_tokens=True)` adds is decided by tokenizer.json's post-processor,
as in transformers 5, which ignores `add_bos_token`/`add_eos_token` when tokenizer.json exists;
`Tokenizer.add_bos_token` only reports the config's flag. Prompts get their BOS from the chat
template anyway (verl encodes the rendered chat with add_special_tokens=False).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from rlhf_jax.errors import ModelError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` markers and renders their body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers' renderer shows it to a template: keys whose value is None
    dropped (templates test whether a key is there, e.g. `tool_calls`), and the reasoning
    under each of its names (Qwen3's template reads `reasoning_content`, gpt-oss's
    `thinking`), whichever one the caller used."""
    out = {k: v for k, v in dict(message).items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None


class Tokenizer:
    """A fast tokenizer plus the metadata of its HF directory.

    Build it with `load_tokenizer`; the constructor takes already-parsed pieces.
    """

    def __init__(self, backend: _BackendTokenizer, *, special_tokens: Mapping[str, str | None],
                 chat_template: str | None, extra_eos_ids: Sequence[int] = (),
                 add_bos_token: bool = False, name: str = ""):
        self._backend = backend
        self._special = {k: special_tokens.get(k) for k in _SPECIAL_NAMES}
        self.chat_template = chat_template
        self.name = name
        self.add_bos_token = add_bos_token  # the config's flag, for information (module doc)
        eos = self._id_of(self._special["eos_token"])
        ids = ([eos] if eos is not None else []) + [int(i) for i in extra_eos_ids]
        self._eos_ids = tuple(dict.fromkeys(ids))  # dedupe, keep order

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # -- special tokens ---------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self._special["pad_token"] or self.eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: the tokenizer's eos, then generation_config's."""
        return self._eos_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def pad_token_id(self) -> int | None:
        """The pad token's id; without a pad token, the (first) eos id, as verl does."""
        pad = self._id_of(self._special["pad_token"])
        return pad if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (HF's `len(tok)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False
                     ) -> list[list[int]]:
        try:
            encs = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except Exception as e:  # the Rust side: e.g. a WordLevel model without its unk token
            raise ModelError(f"tokenizer {self.name or '(unnamed)'} cannot encode "
                             f"{texts[0]!r:.40}: {e}") from None
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids],
                                    skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True
                     ) -> list[str]:
        return self._backend.decode_batch([[int(i) for i in s] for s in seqs],
                                          skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs) -> str | list[int]:
        """Render `messages` with the directory's chat template, as HF does.

        Args:
            messages: `[{"role": ..., "content": ...}, ...]`.
            add_generation_prompt: append the assistant header so the model answers next.
            tokenize: return token ids (no extra special tokens) instead of the string.
            **kwargs: extra template variables, passed through as transformers does (e.g.
                `tools`, Qwen3's `enable_thinking`, Llama 3's `date_string`).
        """
        if self.chat_template is None:
            raise ModelError(f"tokenizer {self.name or '(unnamed)'} has no chat_template")
        variables = {k: v for k, v in self._special.items() if v is not None}
        variables.update(tools=None, documents=None)
        variables.update(kwargs)
        text = _compile_template(self.chat_template).render(
            messages=[_template_message(m) for m in messages],
            add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={self.eos_token_ids}, pad_token_id={self.pad_token_id})")


def _chat_template(path: str, config: Mapping[str, Any]) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # the older "named templates" form
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the HF tokenizer directory `path` (needs `tokenizer.json`).

    Raises:
        ModelError: the directory or its tokenizer.json is missing or unreadable.
    """
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isdir(path):
        raise ModelError(f"tokenizer directory not found: {path}")
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ModelError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = _BackendTokenizer.from_file(tok_file)
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ModelError(f"cannot parse {tok_file}: {e}") from None

    config: dict[str, Any] = {}
    legacy_map = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(legacy_map):
        config.update(_read_json(legacy_map))
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        config.update(_read_json(config_file))
    special = {k: _token_text(config.get(k)) for k in _SPECIAL_NAMES}
    for key in ("bos_token", "eos_token", "pad_token"):
        if special[key] is not None and backend.token_to_id(special[key]) is None:
            raise ModelError(f"{config_file}: {key} {special[key]!r} is not in the vocabulary")

    extra_eos: list[int] = []
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        eos_id = _read_json(gen_file).get("eos_token_id")
        if isinstance(eos_id, int):
            extra_eos = [eos_id]
        elif isinstance(eos_id, list):
            extra_eos = [int(i) for i in eos_id]
    return Tokenizer(backend, special_tokens=special, chat_template=_chat_template(path, config),
                     extra_eos_ids=extra_eos, add_bos_token=bool(config.get("add_bos_token")),
                     name=path)
