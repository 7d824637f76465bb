"""The synthetic word-problem task: generator, tokenizer, GSM8K reward, recipe config."""

import operator
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlhf_jax import rewards, sft, tasks
from rlhf_jax.config import load_config
from rlhf_jax.errors import ConfigError
from rlhf_jax.tasks import wordproblems as wp
from rlhf_jax.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/grpo_wordproblems_cpu.yaml"

# Each template's answer from its numbers, written out independently of its `steps`.
ANSWERS = {
    "add_sub": lambda a, b, c: a + b - c,
    "mul_add": lambda a, b, c: a * b + c,
    "mul_sub": lambda a, b, c: a * b - c,
    "add_div": lambda a, b, c: (a + b) / c,
    "sub_mul": lambda a, b, c: (a - b) * c,
    "mul_mul_add": lambda a, b, c, d: a * b + c * d,
    "add_add_sub": lambda a, b, c, d: d - (a + b + c),
    "mul_add_div": lambda a, b, c, d: (a * b + c) / d,
}
_OPS = {"+": operator.add, "-": operator.sub, "x": operator.mul, "/": operator.truediv}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("wp")
    train, val, model = root / "train.parquet", root / "val.parquet", root / "model"
    wp.prepare_files(str(train), str(val), str(model), 400, 100, seed=3)
    return (pq.read_table(train).to_pylist(), pq.read_table(val).to_pylist(),
            load_tokenizer(model))


def _numbers(row) -> dict[str, int]:
    return dict(zip("abcd", row["extra_info"]["numbers"], strict=False))


def test_generator_is_deterministic_and_covers_every_template(tmp_path):
    a = wp.make_dataset(tmp_path / "a.parquet", 200, seed=5)
    b = wp.make_dataset(tmp_path / "b.parquet", 200, seed=5)
    c = wp.make_dataset(tmp_path / "c.parquet", 200, seed=6)
    rows_a, rows_b = pq.read_table(a).to_pylist(), pq.read_table(b).to_pylist()
    assert rows_a == rows_b
    assert rows_a != pq.read_table(c).to_pylist()
    assert {r["extra_info"]["template"] for r in rows_a} == set(ANSWERS) == set(wp._BY_NAME)


def test_answers_match_the_structured_form(files):
    train, val, _ = files
    for row in train + val:
        info, numbers = row["extra_info"], _numbers(row)
        expected = ANSWERS[info["template"]](*numbers.values())
        assert expected == int(expected) and 0 <= expected <= wp.MAX_VALUE
        assert row["reward_model"]["ground_truth"] == str(int(expected))
        # every step of the worked solution is true arithmetic, and the last one is the answer
        steps = re.findall(r"(\d+) ([-+x/]) (\d+) = (\d+)\.", info["answer"])
        assert len(steps) == len(wp._BY_NAME[info["template"]].steps) in (2, 3)
        for u, op, v, r in steps:
            assert _OPS[op](int(u), int(v)) == int(r)
        assert info["answer"].endswith(f"= {int(expected)}. #### {int(expected)}")
        # the question states every number, in digits or (up to twelve) in words
        question = row["prompt"][0]["content"]
        assert question == info["question"] and question.endswith("?")
        for n in numbers.values():
            forms = [str(n)] + ([wp.NUMBER_WORDS[n]] if n < len(wp.NUMBER_WORDS) else [])
            assert any(re.search(rf"\b{f}\b", question) for f in forms), (n, question)


def test_numbers_appear_in_words_and_in_digits(files):
    questions = " ".join(r["prompt"][0]["content"] for r in files[0])
    assert re.search(r"\b(two|three|four|five|six|seven|eight|nine)\b", questions)
    assert re.search(r"\b[2-9]\b", questions)


def test_evaluate_refuses_invalid_numbers():
    assert wp.evaluate("add_div", {"a": 10, "b": 5, "c": 5}) == [15, 3]
    with pytest.raises(ValueError, match="not exact"):
        wp.evaluate("add_div", {"a": 10, "b": 5, "c": 4})
    with pytest.raises(ValueError, match="out of"):
        wp.evaluate("add_sub", {"a": 10, "b": 2, "c": 30})


def test_splits_are_disjoint(files):
    train, val, _ = files
    key = lambda r: (r["extra_info"]["template"], tuple(r["extra_info"]["numbers"]))
    assert not {key(r) for r in train} & {key(r) for r in val}
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    assert {r["extra_info"]["split"] for r in val} == {"val"}
    assert all(wp.split_of(t, dict(zip("abcd", n, strict=False))) == "val"
               for t, n in map(key, val))


def test_solutions_score_one_with_the_gsm8k_reward(files):
    train, _, tok = files
    for row in train[:100]:
        truth = row["reward_model"]["ground_truth"]
        ids = tok.encode(row["extra_info"]["answer"]) + list(tok.eos_token_ids)
        response = tok.decode(ids)  # what the trainer scores: the decoded response
        assert row["data_source"] == "openai/gsm8k"
        assert rewards.compute_score(row["data_source"], response, truth) == 1.0
        wrong = response.replace(f"#### {truth}", f"#### {int(truth) + 1}")
        assert rewards.compute_score(row["data_source"], wrong, truth) == 0.0
        no_format = response.replace("#### ", "")
        assert rewards.compute_score(row["data_source"], no_format, truth) == 0.0


def test_tokenizer_round_trips_with_one_token_per_digit(files):
    train, val, tok = files
    for row in train + val:
        question, solution = row["prompt"][0]["content"], row["extra_info"]["answer"]
        prompt = tok.apply_chat_template(row["prompt"])
        assert prompt == "<bos>" + question
        ids = tok.encode(prompt)
        assert len(ids) <= wp.MAX_PROMPT_LENGTH and ids[0] == tok.bos_token_id
        assert tok.decode(ids) == question
        sol_ids = tok.encode(solution)
        assert len(sol_ids) + 1 <= wp.MAX_RESPONSE_LENGTH
        assert tok.decode(sol_ids + [tok.eos_token_id, tok.pad_token_id]) == solution
    assert tok.encode("#### 407") == [tok.token_to_id(t) for t in ("▁####", "▁4", "0", "7")]
    assert tok.vocab_size == len(wp.vocab()) <= wp.MODEL["vocab_size"]
    with pytest.raises(Exception, match="(?i)unk"):  # a word outside the vocabulary fails
        tok.encode("Tom has 3 bananas.")


def test_tokenizer_loads_in_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    wp.make_tokenizer(tmp_path)
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Mia has twelve eggs. How many eggs does Mia have?"}]
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    ids = ours.encode("12 x 3 = 36. #### 36")
    assert ours.decode(ids) == hf.decode(ids) == "12 x 3 = 36. #### 36"


def test_warm_start_teaches_the_worked_solution(files):
    row = files[0][0]
    assert sft.target(row["reward_model"]["ground_truth"], row["extra_info"]) == \
        row["extra_info"]["answer"]
    assert sft.target("1 3 2", {"split": "train", "index": 0}) == "1 3 2"  # addition rows


def test_recipe_config_loads_and_prepares(tmp_path):
    cfg = load_config(CONFIG, [f"data.train_files={tmp_path}/train.parquet",
                               f"data.val_files={tmp_path}/val.parquet",
                               f"actor_rollout_ref.model.path={tmp_path}/model",
                               "synthetic.num_train=64", "synthetic.num_val=16"])
    assert cfg.synthetic.task == "wordproblems"
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.critic.enable
    assert cfg.data.max_prompt_length == wp.MAX_PROMPT_LENGTH
    assert cfg.data.max_response_length == wp.MAX_RESPONSE_LENGTH
    assert len(tasks.prepare(cfg)) == 4
    assert pq.read_table(tmp_path / "val.parquet").num_rows == 16
    with pytest.raises(ConfigError, match="synthetic.task"):
        load_config(CONFIG, ["synthetic.task=wordproblem"])


def test_prepare_model_writes_the_task_architecture(tmp_path):
    cfg = load_config(CONFIG, [f"data.train_files={tmp_path}/train.parquet",
                               f"data.val_files={tmp_path}/val.parquet",
                               f"actor_rollout_ref.model.path={tmp_path}/model",
                               "synthetic.num_train=8", "synthetic.num_val=8"])
    tasks.prepare(cfg)
    tasks.prepare_model(cfg)
    from rlhf_jax.models import load_model_config

    model = load_model_config(tmp_path / "model")
    assert model.vocab_size == wp.MODEL["vocab_size"] >= len(wp.vocab())
    assert (tmp_path / "model/model.safetensors").is_file()
    assert np.all([load_tokenizer(tmp_path / "model").token_to_id(t) is not None
                   for t in wp.vocab()])
