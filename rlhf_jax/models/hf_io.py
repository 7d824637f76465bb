"""HF checkpoint import/export: config.json + (index-sharded) *.safetensors <-> sharded params.

Import never holds the whole model on host: each parameter is built with
`jax.make_array_from_callback`, whose callback reads only the tensors (one layer at a time) that
the requested shard needs, from memory-mapped safetensors files. Export writes one tensor at a
time. The safetensors format (8-byte header size, JSON header, raw little-endian bytes) is read
and written here directly so that bfloat16 works through `ml_dtypes` without torch.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from rlhf_jax.errors import ModelError
from rlhf_jax.models.config import load_model_config
from rlhf_jax.models.model import Model

_ST_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "generation_config.json", "chat_template.jinja",
)


# ----------------------------------------------------------------------------- name mapping
# Qwen2, Qwen3, Llama and Mistral name their tensors alike; the families differ only in which
# tensors exist, and `ModelConfig`'s switches say that. Each entry: our path inside a layer's
# params, the HF name after `model.layers.{i}.`, the converters (HF -> ours, ours -> HF), and
# the switch of `ModelConfig` that makes the tensor exist (None: always).


def _t(w, cfg):
    return w.T


def _heads_in(n_attr):
    def to_ours(w, cfg):  # [N*H, D] -> [D, N, H]   (bias [N*H] -> [N, H])
        n = getattr(cfg, n_attr)
        return w.reshape(n, cfg.head_dim) if w.ndim == 1 else w.T.reshape(-1, n, cfg.head_dim)

    def to_hf(w, cfg):
        return w.reshape(-1) if w.ndim == 2 else w.reshape(w.shape[0], -1).T

    return to_ours, to_hf


def _o_in(w, cfg):  # [D, N*H] -> [N, H, D]
    return w.T.reshape(cfg.num_attention_heads, cfg.head_dim, -1)


def _o_out(w, cfg):
    return w.reshape(-1, w.shape[-1]).T


def _same(w, cfg):
    return w


_SAME, _T, _O = (_same, _same), (_t, _t), (_o_in, _o_out)
_Q, _KV = _heads_in("num_attention_heads"), _heads_in("num_key_value_heads")
LAYER_TENSORS = (
    (("input_layernorm", "scale"), "input_layernorm.weight", _SAME, None),
    (("post_attention_layernorm", "scale"), "post_attention_layernorm.weight", _SAME, None),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", _T, None),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", _T, None),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", _T, None),
    (("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", _Q, None),
    (("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", _KV, None),
    (("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", _KV, None),
    (("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", _O, None),
    (("self_attn", "q_proj", "bias"), "self_attn.q_proj.bias", _Q, "attention_bias"),
    (("self_attn", "k_proj", "bias"), "self_attn.k_proj.bias", _KV, "attention_bias"),
    (("self_attn", "v_proj", "bias"), "self_attn.v_proj.bias", _KV, "attention_bias"),
    (("self_attn", "o_proj", "bias"), "self_attn.o_proj.bias", _SAME, "o_proj_bias"),
    (("self_attn", "q_norm", "scale"), "self_attn.q_norm.weight", _SAME, "qk_norm"),
    (("self_attn", "k_norm", "scale"), "self_attn.k_norm.weight", _SAME, "qk_norm"),
)


def _param_map(model: Model) -> list[tuple[tuple[str, ...], str, Callable, Callable]]:
    """(our path inside params, HF name with {i} for the layer, to_ours(w_hf, cfg), to_hf(w, cfg))
    of every tensor of `model`."""
    cfg = model.cfg
    out = [(("model", "layers") + path, "model.layers.{i}." + name, a, b)
           for path, name, (a, b), switch in LAYER_TENSORS
           if switch is None or getattr(cfg, switch)]
    out += [
        (("model", "embed_tokens", "embedding"), "model.embed_tokens.weight", _same, _same),
        (("model", "norm", "scale"), "model.norm.weight", _same, _same),
    ]
    if model.kind == "value":
        out += [
            (("score", "kernel"), "score.weight", _t, _t),
            (("score", "bias"), "score.bias", _same, _same),
        ]
    elif not cfg.tie_word_embeddings:
        out.append((("lm_head", "kernel"), "lm_head.weight", _t, _t))
    return out


# ------------------------------------------------------------------------- safetensors files


def _read_header(file: Path) -> tuple[int, dict]:
    """The header length and tensor entries of a .safetensors file, checked against its size.

    Raises:
        ModelError: the header is unreadable or the file is shorter than the header says.
    """
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} beyond the file's {size} bytes")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelError(f"{file} is not a readable safetensors file: {e}") from None
    if 8 + n + end > size:
        raise ModelError(f"{file} is truncated: {size} bytes, its header needs {8 + n + end}")
    return n, header


class SafetensorsDir:
    """Memory-mapped read access to every tensor of an HF checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ModelError(f"{index} is unreadable: {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ModelError(f"model path {str(path)!r} has no *.safetensors files")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise ModelError(f"{index}: names missing file {name}")
            n, header = _read_header(file)
            for key, info in header.items():
                self._where[key] = (file, info, 8 + n)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ModelError(f"{self.path}: checkpoint has no tensor {name!r}")
        file, info, base = self._where[name]
        start, end = info["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, dtype)
        return np.memmap(file, dtype=dtype, mode="r", offset=base + start, shape=shape)


def write_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes one .safetensors file (tensors are written in order, one at a time)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        size = arr.size * arr.dtype.itemsize
        header[name] = {
            "dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


# ----------------------------------------------------------------------------------- import


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _load_one(files: SafetensorsDir, model: Model, hf_name: str, to_ours, spec, sharding):
    """One parameter; stacked layers (`{i}` in the name) are read one layer at a time."""
    stacked = "{i}" in hf_name
    want = tuple(spec.shape[1:] if stacked else spec.shape)
    last: dict = {}

    def read(i):
        name = hf_name.format(i=i)
        if name not in last:  # every device shard of a layer reuses the one read
            last.clear()
            w_hf = files.get(name)
            w = np.asarray(to_ours(w_hf, model.cfg))
            if w.shape != want:
                raise ModelError(
                    f"{files.path}: tensor {name!r} has shape {w_hf.shape}, "
                    f"expected one that maps to {want}"
                )
            last[name] = w.astype(spec.dtype)
        return last[name]

    def callback(index):
        if not stacked:
            return read(None)[index]
        layers = range(*index[0].indices(model.cfg.num_hidden_layers))
        return np.stack([read(i)[index[1:]] for i in layers])

    return jax.make_array_from_callback(spec.shape, sharding, callback)


def load_hf_params(model: Model, path: str | Path, shardings) -> dict:
    """Reads an HF checkpoint into parameters laid out by `shardings` (a tree like params).

    A value model loaded from a causal-LM checkpoint (no `score.*` tensors) gets a zero head:
    the critic initialised from the actor's backbone.
    """
    files = SafetensorsDir(path)
    abstract = model.abstract_params()
    params: dict = {}
    for ours, hf_name, to_ours, _ in _param_map(model):
        spec = _get(abstract, ours)
        sharding = _get(shardings, ours)
        if ours[0] == "score" and hf_name not in files:
            arr = jax.device_put(np.zeros(spec.shape, spec.dtype), sharding)
            _set(params, ours, arr)
            continue
        _set(params, ours, _load_one(files, model, hf_name, to_ours, spec, sharding))
    return params


def load_hf_model(path: str | Path, mesh, rules, *, kind: str = "lm", dtype: str = "float32",
                  param_dtype: str = "float32", remat: bool = False, overrides=None):
    """`(Model, params)` from an HF directory, parameters sharded on `mesh` under `rules`."""
    model = Model(load_model_config(path, overrides), kind, dtype, param_dtype, remat)
    return model, load_hf_params(model, path, model.shardings(mesh, rules))


# ----------------------------------------------------------------------------------- export


def _host(x) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_tensors(model: Model, params) -> Iterator[tuple[str, np.ndarray]]:
    for ours, hf_name, _, to_hf in _param_map(model):
        value = _get(params, ours)
        if "{i}" in hf_name:
            for i in range(model.cfg.num_hidden_layers):
                yield hf_name.format(i=i), np.ascontiguousarray(to_hf(_host(value[i]), model.cfg))
        else:
            yield hf_name, np.ascontiguousarray(to_hf(_host(value), model.cfg))


def save_hf(model: Model, params, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
            max_shard_bytes: int = 4 << 30) -> Path:
    """Writes `config.json` and safetensors (index-sharded above `max_shard_bytes`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = model.cfg.to_hf()
    if model.kind == "value":
        arch = hf_cfg["architectures"][0].replace("ForCausalLM", "ForTokenClassification")
        hf_cfg.update(architectures=[arch], num_labels=1, id2label={"0": "LABEL_0"},
                      label2id={"LABEL_0": 0})
    leaves = jax.tree.leaves(params)
    hf_cfg["dtype"] = str(leaves[0].dtype) if leaves else "float32"
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    # Host memory holds one shard at most: each is written as soon as it is full.
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        file = out / f"shard-{len(written):05d}.tmp"
        write_safetensors(file, shard)
        written.append((file, list(shard)))
        shard.clear()

    for name, arr in _hf_tensors(model, params):
        if shard and sum(a.nbytes for a in shard.values()) + arr.nbytes > max_shard_bytes:
            flush()
        shard[name] = arr
        total += arr.nbytes
    flush()
    if len(written) == 1:
        written[0][0].replace(out / "model.safetensors")
    else:
        weight_map = {}
        for k, (file, names) in enumerate(written):
            fname = f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
            file.replace(out / fname)
            weight_map.update(dict.fromkeys(names, fname))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copy(src, out / name)
    return out

