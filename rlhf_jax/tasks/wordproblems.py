"""Synthetic grade-school word problems, written by the program: a harder embedded task.

Each problem is one of the `TEMPLATES` (2-3 operations among +, -, x and exact /) filled with
a person, an object and numbers drawn from the template's ranges; numbers up to twelve are
written in words half of the time. Its worked solution is one line per operation, then the
answer in GSM8K's format, which the existing GSM8K rule reward scores (format + answer):

    prompt:   Mia has 4 boxes of shells with seven shells in each box. Tom gives her 9 more
              shells. How many shells does Mia have?
    solution: 4 x 7 = 28. 28 + 9 = 37. #### 37

Rows are verl's GSM8K schema: the ground truth is the answer, `extra_info.answer` the worked
solution (what the SFT warm start teaches, as verl's GSM8K preprocessing stores it), and
`extra_info.template` / `extra_info.numbers` (the values of a, b, c[, d]) the structured form
the answer comes from.

The tokenizer is word-level with one token per digit, so the model can learn column
arithmetic; spaces are kept as a `▁` prefix (Metaspace), so a decoded response is the text as
written (`#### 37`, not `# # # # 3 7`). Train and validation problems are disjoint in their
(template, numbers): a stable hash of those sends each to one split only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rlhf_jax.tasks.addition import _one_file

DATA_SOURCE = "openai/gsm8k"  # routes to the GSM8K rule reward (rlhf_jax.rewards)
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
SPACE = "▁"  # Metaspace's marker of a preceding space
MAX_PROMPT_LENGTH = 48  # tokens of the longest prompt, <bos> included (checked by the tests)
MAX_RESPONSE_LENGTH = 32  # tokens of the longest solution, <eos> included
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
VAL_FRACTION = 8  # one (template, numbers) in 8 belongs to the validation split

PEOPLE = (("Tom", "he", "him"), ("Anna", "she", "her"), ("Ben", "he", "him"),
          ("Lily", "she", "her"), ("Sam", "he", "him"), ("Mia", "she", "her"),
          ("Jack", "he", "him"), ("Emma", "she", "her"), ("Leo", "he", "him"),
          ("Zoe", "she", "her"))
OBJECTS = ("apples", "pencils", "marbles", "cookies", "stickers", "shells", "cards", "eggs",
           "flowers", "coins")
GETS = ("buys", "finds", "gets", "picks")
LOSES = ("gives away", "loses", "sells")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve")
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "x": lambda x, y: x * y,
       "/": lambda x, y: x // y}
MAX_VALUE = 99  # every result lies in [0, MAX_VALUE]: two digits at most


@dataclasses.dataclass(frozen=True)
class Template:
    """A problem shape.

    Attributes:
        name: its id (stored in `extra_info.template`).
        text: the question; `{a}`.. are numbers, `{name}`/`{other}` people (`{he}`, `{him}`,
            capitalised `{He}`, of `name`), `{obj}` an object, `{gets}`/`{loses}` verbs.
        steps: `(x, op, y)` per operation, each operand an input letter or `s<i>` (the result
            of step i); the last step's result is the answer.
        ranges: inclusive `(low, high)` of each input letter.
    """

    name: str
    text: str
    steps: tuple[tuple[str, str, str], ...]
    ranges: dict[str, tuple[int, int]]


TEMPLATES = (
    Template("add_sub", "{name} has {a} {obj}. {He} {gets} {b} more {obj} and then {loses} {c}"
             " of them. How many {obj} does {name} have now?",
             (("a", "+", "b"), ("s0", "-", "c")), {"a": (10, 50), "b": (2, 30), "c": (2, 30)}),
    Template("mul_add", "{name} has {a} boxes of {obj} with {b} {obj} in each box. {other} "
             "gives {him} {c} more {obj}. How many {obj} does {name} have?",
             (("a", "x", "b"), ("s0", "+", "c")), {"a": (2, 9), "b": (2, 9), "c": (2, 30)}),
    Template("mul_sub", "{name} {gets} {a} bags with {b} {obj} in each bag and {loses} {c} "
             "of them. How many {obj} does {name} have left?",
             (("a", "x", "b"), ("s0", "-", "c")), {"a": (2, 9), "b": (2, 9), "c": (2, 30)}),
    Template("add_div", "{name} picks {a} {obj} and {other} picks {b} {obj}. They share the "
             "{obj} equally among {c} friends. How many {obj} does each friend get?",
             (("a", "+", "b"), ("s0", "/", "c")), {"a": (4, 40), "b": (4, 40), "c": (2, 5)}),
    Template("sub_mul", "A shop has {a} {obj}. It sells {b} of them. Each of the other {obj} "
             "costs {c} dollars. How many dollars are the other {obj} worth?",
             (("a", "-", "b"), ("s0", "x", "c")), {"a": (10, 30), "b": (2, 25), "c": (2, 9)}),
    Template("mul_mul_add", "{name} {gets} {a} packs of {obj} with {b} in each pack and {c} "
             "packs with {d} in each pack. How many {obj} does {he} have in all?",
             (("a", "x", "b"), ("c", "x", "d"), ("s0", "+", "s1")),
             {"a": (2, 5), "b": (2, 9), "c": (2, 5), "d": (2, 9)}),
    Template("add_add_sub", "{name} needs {d} {obj}. {He} {gets} {a} on Monday, {b} on "
             "Tuesday and {c} on Friday. How many more {obj} does {he} need?",
             (("a", "+", "b"), ("s0", "+", "c"), ("d", "-", "s1")),
             {"a": (2, 25), "b": (2, 25), "c": (2, 25), "d": (40, 99)}),
    Template("mul_add_div", "{name} has {a} rows of {obj} with {b} {obj} in each row. {He} "
             "{gets} {c} more. {He} puts all the {obj} into {d} equal groups. How many {obj} "
             "are in each group?",
             (("a", "x", "b"), ("s0", "+", "c"), ("s1", "/", "d")),
             {"a": (2, 9), "b": (2, 9), "c": (2, 20), "d": (2, 5)}),
)
_BY_NAME = {t.name: t for t in TEMPLATES}
assert len(_BY_NAME) == len(TEMPLATES)

# The architecture of the task's random-init model (HF config.json fields); vocab_size is
# the tokenizer's, rounded up to a multiple of 16.
MODEL = dict(
    model_type="qwen2", vocab_size=0, hidden_size=64, intermediate_size=176,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


# ----------------------------------------------------------------------------------- problems

def evaluate(template: str, numbers: dict[str, int]) -> list[int]:
    """The result of every step of `template` on `numbers` (the last one is the answer).

    Raises:
        ValueError: a division is not exact, or a result is negative or above MAX_VALUE.
    """
    results: list[int] = []
    for x, op, y in _BY_NAME[template].steps:
        u, v = (results[int(t[1:])] if t.startswith("s") else numbers[t] for t in (x, y))
        if op == "/" and u % v:
            raise ValueError(f"{u} / {v} is not exact")
        r = OPS[op](u, v)
        if not 0 <= r <= MAX_VALUE:
            raise ValueError(f"{u} {op} {v} = {r} is out of [0, {MAX_VALUE}]")
        results.append(r)
    return results


def solution(template: str, numbers: dict[str, int]) -> str:
    """The worked solution: one `u op v = r.` per step, then `#### <answer>`."""
    results = evaluate(template, numbers)
    value = lambda t: results[int(t[1:])] if t.startswith("s") else numbers[t]
    lines = [f"{value(x)} {op} {value(y)} = {r}."
             for (x, op, y), r in zip(_BY_NAME[template].steps, results, strict=True)]
    return " ".join(lines) + f" #### {results[-1]}"


def split_of(template: str, numbers: dict[str, int]) -> str:
    """"val" for one (template, numbers) in VAL_FRACTION, else "train" (a stable hash)."""
    key = json.dumps([template, sorted(numbers.items())]).encode()
    digest = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return "val" if digest % VAL_FRACTION == 0 else "train"


def _number_text(n: int, rng: np.random.Generator) -> str:
    return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) and rng.random() < 0.5 else str(n)


def draw(rng: np.random.Generator, split: str) -> dict:
    """One problem of `split` drawn with `rng`: template, numbers, question, solution, answer.

    The template is uniform; its numbers are drawn uniformly from its ranges until every
    step is valid (see `evaluate`) and the (template, numbers) belongs to `split`.
    """
    template = TEMPLATES[rng.integers(len(TEMPLATES))]
    while True:
        numbers = {k: int(rng.integers(lo, hi + 1)) for k, (lo, hi) in template.ranges.items()}
        try:
            answer = evaluate(template.name, numbers)[-1]
        except ValueError:
            continue
        if split_of(template.name, numbers) == split:
            break
    person = PEOPLE[rng.integers(len(PEOPLE))]
    others = [p for p in PEOPLE if p != person]
    fields = {
        "name": person[0], "he": person[1], "He": person[1].capitalize(), "him": person[2],
        "other": others[rng.integers(len(others))][0],
        "obj": OBJECTS[rng.integers(len(OBJECTS))],
        "gets": GETS[rng.integers(len(GETS))], "loses": LOSES[rng.integers(len(LOSES))],
        **{k: _number_text(v, rng) for k, v in numbers.items()},
    }
    return {"template": template.name, "numbers": numbers,
            "question": template.text.format(**fields),
            "solution": solution(template.name, numbers), "answer": answer}


# ---------------------------------------------------------------------------------- tokenizer

_PIECES = Regex(SPACE + r"?[0-9]|[.,?]")  # a digit (with its space) or punctuation alone


def words() -> list[str]:
    """Every word a question or solution can contain (digits and punctuation excluded)."""
    out = set(NUMBER_WORDS) | set(OBJECTS) | {"####", *OPS, "="}
    out |= {w for p in PEOPLE for w in (p[0], p[1], p[1].capitalize(), p[2])}
    out |= {w for verb in GETS + LOSES for w in verb.split()}
    for t in TEMPLATES:
        out |= set(re.sub(r"\{\w+\}|[.,?]", " ", t.text).split())
    return sorted(out)


def vocab() -> list[str]:
    """The token strings: special tokens, `▁<word>`, `▁<digit>`, `<digit>`, punctuation."""
    return [*SPECIAL_TOKENS, *(SPACE + w for w in words()), *(SPACE + d for d in "0123456789"),
            *"0123456789", ".", ",", "?"]


def build_tokenizer() -> Tokenizer:
    """A WordLevel tokenizer over `vocab()`: words after a Metaspace split, every digit and
    punctuation mark alone; the Metaspace decoder restores the spaces."""
    # unk is deliberately not in the vocabulary: an unexpected word fails loudly.
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab())}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always"),
        pre_tokenizers.Split(_PIECES, behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


MODEL["vocab_size"] = -(-len(vocab()) // 16) * 16

_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": MODEL["max_position_embeddings"],
    "chat_template": CHAT_TEMPLATE,
}


def make_tokenizer(out_dir: str | os.PathLike, *, overwrite: bool = True) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into `out_dir` (created if missing);
    with `overwrite=False` existing files are kept. Returns the paths written."""
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


# ------------------------------------------------------------------------------------ parquet

_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([
        ("split", pa.string()), ("index", pa.int64()), ("question", pa.string()),
        ("answer", pa.string()), ("template", pa.string()),
        ("numbers", pa.list_(pa.int64())),
    ])),
])


def make_dataset(path: str | os.PathLike, n: int, seed: int, *, split: str = "train") -> str:
    """Write `n` problems of `split` drawn with `seed` as verl-schema parquet at `path`."""
    path = os.path.expanduser(os.fspath(path))
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p = draw(rng, split)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p["question"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p["answer"])},
            "extra_info": {"split": split, "index": i, "question": p["question"],
                           "answer": p["solution"], "template": p["template"],
                           "numbers": [p["numbers"][k] for k in sorted(p["numbers"])]},
        })
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_SCHEMA), path)
    return path


def prepare_files(train_path: str, val_path: str | None, tokenizer_dir: str, num_train: int,
                  num_val: int, seed: int) -> list[str]:
    """Create the train/val parquet files and the tokenizer files that do not exist yet
    (never overwrites); validation draws with `seed + 1`. Returns the paths written."""
    written = []
    for path, n, split_seed, split in ((train_path, num_train, seed, "train"),
                                       (val_path, num_val, seed + 1, "val")):
        if path and not os.path.exists(os.path.expanduser(path)):
            written.append(make_dataset(path, n, split_seed, split=split))
    written += make_tokenizer(tokenizer_dir, overwrite=False)
    return written


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
