"""Write GSM8K in verl's parquet schema (as verl's examples/data_preprocess/gsm8k.py does).

    python scripts/preprocess_gsm8k.py --input train.jsonl --output-dir ~/data/gsm8k --split train

The input is a .jsonl or .parquet file with `question` and `answer` columns (the openai/gsm8k
layout); the output is DIR/<split>.parquet.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_jax.errors import DataError, UserError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def read_rows(path: str) -> list[dict]:
    """The rows of a .jsonl or .parquet file, each with `question` and `answer`."""
    if not os.path.isfile(path):
        raise DataError(f"input file not found: {path}")
    if path.endswith(".parquet"):
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"cannot read parquet {path}: {e}") from None
    else:
        with open(path, encoding="utf-8") as f:
            try:
                rows = [json.loads(line) for line in f if line.strip()]
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not JSON lines ({e})") from None
    if not rows:
        raise DataError(f"{path} has no rows")
    for i, row in enumerate(rows):
        missing = [c for c in ("question", "answer") if c not in row]
        if missing:
            raise DataError(f"{path} row {i} has no column {missing[0]!r} "
                            f"(columns: {', '.join(row)})")
    return rows


def final_answer(answer: str, where: str) -> str:
    """The number after `####`, commas removed."""
    match = _FINAL.search(answer)
    if match is None:
        raise DataError(f"{where}: answer has no '#### <number>' line")
    return match.group(1).replace(",", "")


def to_verl(rows: list[dict], split: str, where: str) -> list[dict]:
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": row["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule",
                         "ground_truth": final_answer(row["answer"], f"{where} row {i}")},
        "extra_info": {"split": split, "index": i, "answer": row["answer"],
                       "question": row["question"]},
    } for i, row in enumerate(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help=".jsonl or .parquet with question/answer")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    try:
        rows = to_verl(read_rows(args.input), args.split, args.input)
        out_dir = os.path.expanduser(args.output_dir)
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, f"{args.split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
