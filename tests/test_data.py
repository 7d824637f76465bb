"""PromptDataset / PromptLoader on handmade parquet rows, and scripts/preprocess_gsm8k.py."""

import importlib.util
import json
import pathlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_jax.data import PromptDataset, PromptLoader
from rlhf_jax.errors import ConfigError, DataError
from rlhf_jax.tasks import addition
from rlhf_jax.tokenizer import load_tokenizer

BOS, PAD = 1, 0
DIGIT = {str(d): 3 + d for d in range(10)}  # the addition tokenizer's ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    addition.make_tokenizer(path)
    return load_tokenizer(path)


def write_rows(path, contents, *, prompt_key="prompt", start=0):
    """One verl row per content string; the ground truth is the content's digit count."""
    rows = [{
        "data_source": "synthetic/addition",
        prompt_key: [{"role": "user", "content": c}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(len(c.split()))},
        "extra_info": {"split": "train", "index": start + i},
    } for i, c in enumerate(contents)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def digits(n, offset=0):
    return " ".join(str((offset + i) % 10) for i in range(n))


@pytest.fixture
def ten_rows(tmp_path):
    # Row r has r+1 digits, so its prompt is r+2 tokens long and rows are told apart by length.
    return write_rows(tmp_path / "ten.parquet", [digits(r + 1) for r in range(10)])


# --- dataset ---------------------------------------------------------------------------------


def test_padding_layout_and_fields(tmp_path, tok):
    path = write_rows(tmp_path / "a.parquet", ["1 2 3", "4", "5 6 7 8 9"])
    ds = PromptDataset(path, tok, max_prompt_length=8)
    batch = ds.collate([ds[0], ds[1], ds[2]])
    np.testing.assert_array_equal(batch.input_ids, [
        [PAD, PAD, PAD, PAD, BOS, DIGIT["1"], DIGIT["2"], DIGIT["3"]],
        [PAD, PAD, PAD, PAD, PAD, PAD, BOS, DIGIT["4"]],
        [PAD, PAD, BOS, *[DIGIT[d] for d in "56789"]],
    ])
    np.testing.assert_array_equal(batch.attention_mask, (batch.input_ids != PAD).astype(int))
    np.testing.assert_array_equal(batch.position_ids[0], [0, 0, 0, 0, 0, 1, 2, 3])
    assert batch.input_ids.dtype == batch.attention_mask.dtype == np.int32
    assert batch.data_source == ["synthetic/addition"] * 3
    assert batch.ground_truth == ["3", "1", "5"]
    assert batch.extra_info[2] == {"split": "train", "index": 2}
    assert batch.uid == [f"{path}:0", f"{path}:1", f"{path}:2"]
    assert batch.raw_prompt == ["<bos>1 2 3", "<bos>4", "<bos>5 6 7 8 9"]
    assert batch.index == [0, 1, 2] and len(batch) == 3


def test_several_files_and_prompt_key(tmp_path, tok):
    a = write_rows(tmp_path / "a.parquet", ["1", "2"], prompt_key="chat")
    b = write_rows(tmp_path / "b.parquet", ["3"], prompt_key="chat")
    ds = PromptDataset([a, b], tok, prompt_key="chat", max_prompt_length=4)
    assert len(ds) == 3
    assert [ds[i]["uid"] for i in range(3)] == [f"{a}:0", f"{a}:1", f"{b}:0"]
    assert [ds[i]["index"] for i in range(3)] == [0, 1, 2]


def test_missing_file_and_column(tmp_path, tok):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match=f"^data file not found: {re.escape(missing)}$"):
        PromptDataset(missing, tok)
    path = write_rows(tmp_path / "a.parquet", ["1"], prompt_key="question")
    with pytest.raises(DataError, match=rf"{re.escape(path)} has no column 'prompt' \(columns: "
                                        r"data_source, question, ability"):
        PromptDataset(path, tok)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["just a string"]}), bad)
    with pytest.raises(DataError, match=f"{re.escape(str(bad))} row 0: column 'prompt' must be"):
        PromptDataset(str(bad), tok)
    with pytest.raises(ConfigError, match="data.truncation must be one of"):
        PromptDataset(path, tok, truncation="cut")


def test_truncation_modes(tmp_path, tok):
    path = write_rows(tmp_path / "a.parquet", ["1 2", "1 2 3 4 5 6"])  # 3 and 7 tokens
    with pytest.raises(DataError, match=f"{re.escape(path)} row 1: prompt has 7 tokens, more than "
                                        "max_prompt_length 4"):
        PromptDataset(path, tok, max_prompt_length=4)
    full = [BOS, *[DIGIT[d] for d in "123456"]]
    expect = {"left": full[-4:], "right": full[:4], "middle": full[:2] + full[-2:]}
    for mode, ids in expect.items():
        ds = PromptDataset(path, tok, max_prompt_length=4, truncation=mode)
        assert ds[1]["input_ids"].tolist() == ids, mode
        assert ds[0]["input_ids"].tolist() == [BOS, DIGIT["1"], DIGIT["2"]]
        assert ds.collate([ds[1]]).attention_mask.all()


def test_filter_overlong(tmp_path, tok, caplog):
    path = write_rows(tmp_path / "a.parquet", ["1", "1 2 3 4 5", "2", "1 2 3 4"])
    with caplog.at_level("INFO", logger="rlhf_jax.data"):
        ds = PromptDataset(path, tok, max_prompt_length=4, filter_overlong_prompts=True)
    assert ds.num_filtered == 2 and len(ds) == 2
    assert [ds[i]["uid"] for i in range(2)] == [f"{path}:0", f"{path}:2"]
    assert "filtered 2 of 4 prompts longer than 4 tokens" in caplog.text
    with pytest.raises(DataError, match="no usable rows"):
        PromptDataset(path, tok, max_prompt_length=1, filter_overlong_prompts=True)


# --- loader ----------------------------------------------------------------------------------


def rows_of(batch):
    return [int(i) for i in batch.index]


def epoch_rows(loader):
    return [rows_of(b) for b in loader]


def test_epochs_shuffle_and_determinism(ten_rows, tok):
    ds = PromptDataset(ten_rows, tok, max_prompt_length=12)
    loader = PromptLoader(ds, 3, shuffle=True, seed=7)
    assert loader.steps_per_epoch == len(loader) == 3  # drop_remainder
    e0, e1 = epoch_rows(loader), epoch_rows(loader)
    assert loader.epoch == 2
    assert len(e0) == 3 and all(len(b) == 3 for b in e0)
    assert len(set(sum(e0, []))) == 9  # no repeats within an epoch
    assert e0 != e1  # reshuffled per epoch
    again = PromptLoader(ds, 3, shuffle=True, seed=7)
    assert epoch_rows(again) == e0
    assert epoch_rows(PromptLoader(ds, 3, shuffle=True, seed=8)) != e0
    plain = PromptLoader(ds, 4, shuffle=False, drop_remainder=False)
    assert epoch_rows(plain) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # the rows carry their own tokens: row r has r+2 real tokens
    batch = PromptLoader(ds, 3, seed=7).batch_at(0, 0)
    assert batch.attention_mask.sum(1).tolist() == [r + 2 for r in rows_of(batch)]


def test_resume_mid_epoch_and_at_epoch_boundary(ten_rows, tok):
    ds = PromptDataset(ten_rows, tok, max_prompt_length=12)
    reference = PromptLoader(ds, 3, seed=5)
    expected = epoch_rows(reference) + epoch_rows(reference)  # two epochs, 6 batches

    for taken in range(7):  # stop after `taken` batches, save, resume in a new loader
        live = PromptLoader(ds, 3, seed=5)
        got = []
        while len(got) < taken:
            got += epoch_rows_until(live, taken - len(got))
        state = json.loads(json.dumps(live.get_state()))
        resumed = PromptLoader(ds, 3, seed=5)
        resumed.set_state(state)
        rest = []
        while len(got) + len(rest) < 6:
            rest += epoch_rows(resumed)
        assert got + rest == expected, taken
    state = PromptLoader(ds, 3, seed=5).get_state()
    assert state == {"epoch": 0, "step": 0, "num_rows": 10, "batch_size": 3, "shuffle": True,
                     "seed": 5, "drop_remainder": True}


def epoch_rows_until(loader, n):
    """Up to n batches of the current epoch, without ending the epoch's loop."""
    out = []
    for batch in loader:
        out.append(rows_of(batch))
        if len(out) == n:
            break
    return out


def test_state_after_last_batch_is_next_epoch(ten_rows, tok):
    ds = PromptDataset(ten_rows, tok, max_prompt_length=12)
    live = PromptLoader(ds, 3, seed=5)
    for _ in range(3):
        next(live)
    assert live.epoch == 0 and live.get_state()["epoch"] == 1
    assert live.get_state()["step"] == 0
    resumed = PromptLoader(ds, 3, seed=5)
    resumed.set_state(live.get_state())
    assert resumed.epoch == 1
    assert rows_of(next(resumed)) == rows_of(live.batch_at(1, 0))
    with pytest.raises(StopIteration):
        next(live)  # the live loader still ends its epoch-0 loop first
    assert rows_of(next(live)) == rows_of(resumed.batch_at(1, 0))


def test_state_mismatch(ten_rows, tok):
    ds = PromptDataset(ten_rows, tok, max_prompt_length=12)
    state = PromptLoader(ds, 3, seed=5).get_state()
    with pytest.raises(DataError, match="does not match this loader"):
        PromptLoader(ds, 2, seed=5).set_state(state)
    with pytest.raises(DataError, match="invalid position"):
        PromptLoader(ds, 3, seed=5).set_state({**state, "step": 9})


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_shards_union_is_single_process_batch(ten_rows, tok, drop_remainder):
    ds = PromptDataset(ten_rows, tok, max_prompt_length=12)
    single = PromptLoader(ds, 4, seed=3, drop_remainder=drop_remainder)
    shards = [PromptLoader(ds, 4, seed=3, drop_remainder=drop_remainder, shard_index=i,
                           shard_count=2) for i in range(2)]
    for _ in range(2):  # two epochs
        whole = list(single)
        parts = [list(s) for s in shards]
        assert len(whole) == len(parts[0]) == len(parts[1]) == (2 if drop_remainder else 3)
        for w, p0, p1 in zip(whole, *parts, strict=True):
            assert rows_of(p0) + rows_of(p1) == rows_of(w)
            np.testing.assert_array_equal(np.concatenate([p0.input_ids, p1.input_ids]),
                                          w.input_ids)
            assert len(p0) == len(w) // 2


def test_loader_argument_errors(ten_rows, tok):
    ds = PromptDataset(ten_rows, tok, max_prompt_length=12)
    with pytest.raises(ConfigError, match="multiple of the 3 data shards"):
        PromptLoader(ds, 4, shard_count=3)
    with pytest.raises(ConfigError, match="shard_index 2 is not in"):
        PromptLoader(ds, 4, shard_index=2, shard_count=2)
    with pytest.raises(DataError, match="10 rows in .* fewer than one batch of 16"):
        PromptLoader(ds, 16)


# --- scripts/preprocess_gsm8k.py -------------------------------------------------------------

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "preprocess_gsm8k.py"
GSM8K = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A house costs $1,200 plus $34. Total?", "answer": "1200 + 34.\n#### 1,234"},
    {"question": "What is 3 - 8?", "answer": "3 - 8 = -5\n#### -5"},
]


@pytest.fixture(scope="module")
def preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_preprocess_gsm8k(tmp_path, preprocess, fmt, tok):
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    else:
        pq.write_table(pa.Table.from_pylist(GSM8K), src)
    assert preprocess(["--input", str(src), "--output-dir", str(tmp_path / "out"),
                       "--split", "test"]) == 0
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["reward_model"] for r in rows] == [
        {"style": "rule", "ground_truth": g} for g in ("72", "1234", "-5")]
    assert rows[2]["prompt"] == [{"role": "user", "content": "What is 3 - 8? Let's think step "
                                  "by step and output the final answer after \"####\"."}]
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"}
    assert {r["ability"] for r in rows} == {"math"}
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, **GSM8K[1]}


def test_preprocess_gsm8k_errors(tmp_path, preprocess, capsys):
    assert preprocess(["--input", str(tmp_path / "none.jsonl"), "--output-dir", "x"]) == 2
    assert capsys.readouterr().err == f"error: input file not found: {tmp_path}/none.jsonl\n"
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"question": "q", "solution": "#### 1"}) + "\n")
    assert preprocess(["--input", str(src), "--output-dir", str(tmp_path)]) == 2
    assert "row 0 has no column 'answer' (columns: question, solution)" in capsys.readouterr().err
    src.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    assert preprocess(["--input", str(src), "--output-dir", str(tmp_path)]) == 2
    assert "row 0: answer has no '#### <number>' line" in capsys.readouterr().err
