"""The synthetic task of the embedded default config: add two 2-digit numbers, digit by digit.

Every digit is one token. The prompt is `<bos> 4 7 + 8 5 =` (7 tokens), the answer the digits
of the sum then `<eos>` (`1 3 2 <eos>`, at most 4 tokens); a, b are drawn from 10..99. The data
is verl-schema parquet and the tokenizer a real HF tokenizer directory, so the tiny run goes
through exactly the code paths of a GSM8K run.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from rlhf_jax.errors import ConfigError

DATA_SOURCE = "synthetic/addition"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
VOCAB = (*SPECIAL_TOKENS, *"0123456789", "+", "=")
PROMPT_LENGTH = 7  # <bos> d d + d d =
MAX_RESPONSE_LENGTH = 4  # up to three digits, then <eos>
# The template prints bos then the message contents; add_generation_prompt adds nothing.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 64,
    "chat_template": CHAT_TEMPLATE,
}


# The architecture of the task's random-init model (HF config.json fields).
MODEL = dict(
    model_type="qwen2", vocab_size=16, hidden_size=64, intermediate_size=176,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)

def spaced(number: int) -> str:
    """`132` -> `"1 3 2"`: one token per digit."""
    return " ".join(str(number))


def problem(a: int, b: int) -> tuple[str, str]:
    """The (user message, ground truth) of `a + b`."""
    return f"{spaced(a)} + {spaced(b)} =", spaced(a + b)


def build_tokenizer() -> Tokenizer:
    """A WordLevel tokenizer over VOCAB that splits every non-space character."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    # unk is deliberately not in the vocabulary: an unexpected character fails loudly.
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex("."), behavior="isolated"),
    ])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def make_tokenizer(out_dir: str | os.PathLike, *, overwrite: bool = True) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`.

    Args:
        out_dir: the model directory (created if missing).
        overwrite: if False, files that already exist are left alone.

    Returns:
        The paths written.
    """
    out_dir = os.path.expanduser(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    written = []
    tok_file = os.path.join(out_dir, "tokenizer.json")
    if overwrite or not os.path.exists(tok_file):
        build_tokenizer().save(tok_file)
        written.append(tok_file)
    config_file = os.path.join(out_dir, "tokenizer_config.json")
    if overwrite or not os.path.exists(config_file):
        with open(config_file, "w", encoding="utf-8") as f:
            json.dump(_TOKENIZER_CONFIG, f, indent=2)
        written.append(config_file)
    return written


_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
])


def make_dataset(path: str | os.PathLike, n: int, seed: int, *, split: str = "train") -> str:
    """Write `n` addition problems drawn with `seed` as verl-schema parquet at `path`."""
    path = os.path.expanduser(os.fspath(path))
    pairs = np.random.default_rng(seed).integers(10, 100, size=(n, 2))
    rows = []
    for i, (a, b) in enumerate(pairs.tolist()):
        prompt, truth = problem(a, b)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": i},
        })
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_SCHEMA), path)
    return path


def prepare_files(train_path: str, val_path: str | None, tokenizer_dir: str, num_train: int,
                  num_val: int, seed: int) -> list[str]:
    """Create the train/val parquet files and the tokenizer files that do not exist yet.

    Never overwrites. Validation problems are drawn with `seed + 1`, so train and val use
    different random streams.

    Returns:
        The paths written (empty when everything already existed).
    """
    written = []
    for path, n, split_seed, split in ((train_path, num_train, seed, "train"),
                                       (val_path, num_val, seed + 1, "val")):
        if path and not os.path.exists(os.path.expanduser(path)):
            written.append(make_dataset(path, n, split_seed, split=split))
    written += make_tokenizer(tokenizer_dir, overwrite=False)
    return written


def _one_file(files: str | list[str] | tuple[str, ...] | None, key: str) -> str | None:
    if files is None or isinstance(files, str):
        return files or None
    if len(files) != 1:
        raise ConfigError(f"{key}: the synthetic task writes exactly one file, got {len(files)}")
    return files[0]


def prepare(cfg) -> list[str]:
    """`prepare_files` from a Config: `cfg.synthetic`, `cfg.data`, the model's tokenizer dir."""
    model = cfg.actor_rollout_ref.model
    return prepare_files(
        train_path=_one_file(cfg.data.train_files, "data.train_files"),
        val_path=_one_file(cfg.data.val_files, "data.val_files"),
        tokenizer_dir=model.tokenizer_path or model.path,
        num_train=cfg.synthetic.num_train,
        num_val=cfg.synthetic.num_val,
        seed=cfg.synthetic.seed,
    )
