"""An HF model directory as a served model: engine, parameters, tokenizer, sampling defaults.

    served = load_served_model("outputs/ppo_tiny_cpu/hf", mesh="single")
    ids = served.encode("4 7 + 8 5 =")          # the trainer's chat-template formatting
    sampling = served.sampling(temperature=0)   # greedy, the run's eos and pad ids

The sampling defaults are those of the directory's `generation_config.json` read as
transformers reads it (`do_sample` false: greedy; else `temperature`, `top_p`, `top_k`, with
transformers' defaults 1.0, 1.0 and 50 for absent fields); `scripts/export_hf.py` writes the
rollout config's there. Without the file the server decodes greedily.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhf_jax.errors import DataError, ModelError
from rlhf_jax.prompts import PromptError, encode_prompts
from rlhf_jax.rollout.sampling import SamplingParams

GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The sampling a request gets for the fields it does not set (transformers' meaning)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_new_tokens: int | None = None

    @classmethod
    def read(cls, model_dir: str | Path) -> GenerationDefaults:
        """The defaults of `model_dir/generation_config.json`; greedy if there is none."""
        path = Path(model_dir) / GENERATION_CONFIG
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{path} is not a JSON object")
        fields = {f.name: raw[f.name] for f in dataclasses.fields(cls)
                  if raw.get(f.name) is not None}
        try:
            out = cls(**fields)
            return dataclasses.replace(out, do_sample=bool(out.do_sample),
                                       temperature=float(out.temperature),
                                       top_p=float(out.top_p), top_k=int(out.top_k))
        except (TypeError, ValueError) as e:
            raise ModelError(f"{path}: {e}") from None


@dataclasses.dataclass
class ServedModel:
    """What a server needs of one model.

    Attributes:
      name: the id clients name it by (`/v1/models`).
      engine: the rollout engine on the generate layout.
      params: the parameters on that layout.
      tokenizer: an `rlhf_jax.tokenizer.Tokenizer` (None: token-id prompts only).
      defaults: the sampling of requests that set none.
      eos_ids, pad_id: where a response stops, what fills it after.
      raw_prompts: text prompts are tokenized as they are, without the chat template.
    """

    name: str
    engine: Any
    params: Any
    tokenizer: Any
    defaults: GenerationDefaults
    eos_ids: tuple[int, ...]
    pad_id: int
    raw_prompts: bool = False

    @property
    def vocab_size(self) -> int:
        return self.engine.model.cfg.vocab_size

    def sampling(self, *, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None) -> SamplingParams:
        """The `SamplingParams` of a request; None fields take the defaults. Temperature 0
        (or a greedy default with no temperature given) is greedy decoding, as the
        trainer's validation with `val_kwargs.temperature: 0`; every greedy request shares
        one sampler, so they decode together."""
        d = self.defaults
        greedy = temperature == 0 or (temperature is None and not d.do_sample)
        common = dict(max_response_length=self.engine.max_decode_length, eos_ids=self.eos_ids,
                      pad_id=self.pad_id)
        if greedy:
            return SamplingParams(temperature=1.0, do_sample=False, **common)
        return SamplingParams(temperature=d.temperature if temperature is None else temperature,
                              top_p=d.top_p if top_p is None else top_p,
                              top_k=d.top_k if top_k is None else top_k, do_sample=True,
                              **common)

    def encode(self, prompt: str | Sequence[int] | Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of a prompt: a text (one user message through the chat template, as in
        training, unless `raw_prompts`), chat messages (the chat template), or token ids
        (taken as they are).

        Raises:
          DataError: the prompt is empty, malformed, out of the vocabulary or longer than
            the engine's `max_prefill_length`.
        """
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise DataError("this server has no tokenizer: send token ids, not text")
            try:
                if isinstance(prompt, str) and self.raw_prompts:
                    ids = self.tokenizer.encode(prompt)
                else:
                    ids = encode_prompts(self.tokenizer, [prompt])[1][0]
            except PromptError as e:
                raise DataError(str(e)) from None
            except Exception as e:  # the tokenizer's own (Rust) errors
                raise DataError(f"cannot tokenize {prompt[:80]!r}: {e}") from None
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise DataError(f"token id {bad[0]} is outside the vocabulary "
                                f"[0, {self.vocab_size})")
        if not ids:
            raise DataError("the prompt is empty")
        if len(ids) > self.engine.max_prefill_length:
            raise DataError(f"the prompt has {len(ids)} tokens, more than the server's "
                            f"max_prefill_length {self.engine.max_prefill_length}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids (special tokens such as EOS left out)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids))


def load_served_model(model_dir: str | Path, *, mesh: str = "single", name: str | None = None,
                      max_concurrent_decodes: int = 8, max_prefill_length: int = 256,
                      max_decode_length: int = 256, raw_prompts: bool = False,
                      sampling_overrides: Mapping[str, Any] | None = None,
                      compiler_options: Mapping[str, Any] | None = None) -> ServedModel:
    """Loads `model_dir` (config.json, safetensors, tokenizer files) onto the generate
    layout of the mesh preset `mesh` and builds its engine.

    Args:
      model_dir: an HF directory.
      mesh: a preset of meshes/ (its generate rules place the parameters and KV cache).
      name: the served model id (default: the directory's name).
      max_concurrent_decodes, max_prefill_length, max_decode_length: the engine's slots and
        its longest prompt and response.
      raw_prompts: tokenize text prompts as they are (no chat template).
      sampling_overrides: fields of `GenerationDefaults` that replace the file's.
      compiler_options: XLA options of the engine's programs (`Engine`).
    """
    from rlhf_jax.mesh import load_mesh_spec, make_mesh
    from rlhf_jax.models.hf_io import load_hf_model
    from rlhf_jax.rollout.engine import Engine

    path = Path(model_dir)
    spec = load_mesh_spec(mesh)
    jax_mesh = make_mesh(spec)
    model, params = load_hf_model(path, jax_mesh, spec.generate_rules)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from rlhf_jax.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
    if tokenizer is not None:
        eos, pad = tuple(tokenizer.eos_token_ids), tokenizer.pad_token_id
    else:
        eos = model.cfg.eos_token_id
        eos, pad = (() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)), None
    defaults = GenerationDefaults.read(path)
    if sampling_overrides:
        defaults = dataclasses.replace(defaults, **dict(sampling_overrides))
    served = ServedModel(name or path.absolute().name, None, None, tokenizer, defaults, eos,
                         0 if pad is None else int(pad), raw_prompts)
    served.engine = Engine(model, jax_mesh, spec.generate_rules,
                           max_concurrent_decodes=max_concurrent_decodes,
                           max_prefill_length=max_prefill_length,
                           max_decode_length=max_decode_length,
                           compiler_options=compiler_options)
    served.engine.default_sampling = served.engine.resolve_sampling(served.sampling())
    served.params = params
    return served
