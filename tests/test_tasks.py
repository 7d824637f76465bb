"""The synthetic addition task: tokenizer directory, parquet files, prepare()."""

import os
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from rlhf_jax import rewards, tasks
from rlhf_jax.data import PromptDataset, PromptLoader
from rlhf_jax.errors import ConfigError
from rlhf_jax.tasks import addition
from rlhf_jax.tokenizer import load_tokenizer

PROMPT_IDS = [1, 7, 10, 13, 11, 8, 14]  # <bos> 4 7 + 8 5 =


def test_problem_text():
    assert addition.problem(47, 85) == ("4 7 + 8 5 =", "1 3 2")
    assert addition.problem(10, 10) == ("1 0 + 1 0 =", "2 0")


def test_warm_start_smooths_over_the_answer_vocabulary(tmp_path):
    from rlhf_jax.sft import answer_vocabulary

    addition.make_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    truths = [addition.problem(a, b)[1] for a, b in ((47, 85), (10, 10), (99, 99))]
    vocab = answer_vocabulary(tok, truths, 16)  # the model's vocabulary is padded to 16
    digits = {tok.encode(d)[0] for d in "0123456789"}
    # 1 3 2, 2 0, 1 9 8 and EOS: never <pad>, <bos>, +, = or the padding id 15.
    assert set(vocab.nonzero()[0]) == {tok.encode(d)[0] for d in "012389"} | {2}
    assert set(vocab.nonzero()[0]) <= digits | set(tok.eos_token_ids)


def test_tokenizer_loads_in_ours_and_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    addition.make_tokenizer(tmp_path)
    ours = load_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "4 7 + 8 5 ="}]
    for add_generation_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == "<bos>4 7 + 8 5 ="
        assert text == hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False) == PROMPT_IDS
    assert ours.encode("<bos>47+85=") == PROMPT_IDS  # one token per character
    answer = [4, 6, 5, 2, 0, 0]  # 1 3 2 <eos> <pad> <pad>
    assert ours.decode(answer) == hf.decode(answer, skip_special_tokens=True) == "1 3 2"
    assert ours.vocab_size == len(hf) == len(addition.VOCAB) == 15
    assert (ours.pad_token_id, ours.bos_token_id, ours.eos_token_ids) == (0, 1, (2,))


def test_dataset_schema_and_rewards(tmp_path):
    path = addition.make_dataset(tmp_path / "train.parquet", 50, seed=3, split="train")
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 50
    row = rows[7]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "synthetic/addition" and row["ability"] == "arithmetic"
    assert row["extra_info"] == {"split": "train", "index": 7}
    digits = row["prompt"][0]["content"].replace(" ", "")
    a, b = int(digits[:2]), int(digits[3:5])
    assert row["prompt"] == [{"role": "user", "content": addition.problem(a, b)[0]}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": addition.spaced(a + b)}
    assert all(10 <= int(r["prompt"][0]["content"].replace(" ", "")[:2]) <= 99 for r in rows)
    assert rewards.compute_score(row["data_source"], addition.spaced(a + b),
                                 row["reward_model"]["ground_truth"]) == 1.0


def test_prepare_files_is_idempotent(tmp_path):
    train, val, model = tmp_path / "d/train.parquet", tmp_path / "d/val.parquet", tmp_path / "m"
    written = addition.prepare_files(str(train), str(val), str(model), 64, 16, seed=0)
    assert sorted(written) == sorted(map(str, [train, val, model / "tokenizer.json",
                                               model / "tokenizer_config.json"]))
    train_rows = pq.read_table(train).to_pylist()
    val_rows = pq.read_table(val).to_pylist()
    assert len(train_rows) == 64 and len(val_rows) == 16
    assert [r["prompt"] for r in train_rows[:16]] != [r["prompt"] for r in val_rows]
    assert {r["extra_info"]["split"] for r in val_rows} == {"val"}
    (model / "config.json").write_text("{}")  # the model's files are someone else's
    before = {p: os.stat(p).st_mtime_ns for p in written}
    assert addition.prepare_files(str(train), str(val), str(model), 64, 16, seed=0) == []
    assert {p: os.stat(p).st_mtime_ns for p in written} == before
    assert (model / "config.json").read_text() == "{}"


def _cfg(tmp_path, task="addition", train_files=None):
    return SimpleNamespace(
        synthetic=SimpleNamespace(task=task, num_train=32, num_val=8, seed=1),
        data=SimpleNamespace(train_files=train_files or [str(tmp_path / "train.parquet")],
                             val_files=str(tmp_path / "val.parquet")),
        actor_rollout_ref=SimpleNamespace(model=SimpleNamespace(path=str(tmp_path / "model"),
                                                                tokenizer_path=None)))


def test_prepare_from_config_feeds_the_loader(tmp_path):
    cfg = _cfg(tmp_path)
    assert len(tasks.prepare(cfg)) == 4
    tok = load_tokenizer(cfg.actor_rollout_ref.model.path)
    dataset = PromptDataset(cfg.data.train_files, tok, max_prompt_length=addition.PROMPT_LENGTH)
    batch = next(iter(PromptLoader(dataset, 8, seed=0)))
    assert batch.input_ids.shape == (8, 7) and batch.attention_mask.all()
    assert (batch.input_ids[:, 0] == 1).all() and (batch.input_ids[:, -1] == 14).all()
    assert tasks.prepare(cfg) == []


def test_prepare_errors_and_no_task(tmp_path):
    assert tasks.prepare(_cfg(tmp_path, task=None)) == []
    assert tasks.prepare(SimpleNamespace(synthetic=None)) == []
    with pytest.raises(ConfigError, match="unknown task 'sorting'"):
        tasks.prepare(_cfg(tmp_path, task="sorting"))
    with pytest.raises(ConfigError, match="data.train_files: .* exactly one file, got 2"):
        tasks.prepare(_cfg(tmp_path, train_files=["a.parquet", "b.parquet"]))
