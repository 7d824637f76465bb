"""Rule rewards by data_source, worked by hand; custom reward functions from files/modules."""

import numpy as np
import pytest

from rlhf_jax import rewards
from rlhf_jax.errors import ConfigError
from rlhf_jax.rewards import addition, gsm8k
from rlhf_jax.rewards import math as math_reward

# --- GSM8K -----------------------------------------------------------------------------------


@pytest.mark.parametrize("response, truth, expected", [
    ("She sold 48/2 = 24 clips in May. 48 + 24 = 72. #### 72", "72", 1.0),
    ("#### 1,234", "1234", 1.0),                    # commas removed
    ("#### -15", "-15", 1.0),                       # negative numbers
    ("first #### 3 then corrected #### 4", "4", 1.0),  # the last match counts
    ("#### 71", "72", 0.0),                         # parsed but wrong: format_score
    ("The answer is 72.", "72", 0.0),               # no `####`: nothing parsed
    ("#### $1,234", "1234", 0.0),                   # verl's regex needs a digit after `#### `
    ("#### 72.", "72", 0.0),                        # the trailing dot is kept, as in verl
])
def test_gsm8k_strict(response, truth, expected):
    assert rewards.compute_score("openai/gsm8k", response, truth) == expected


def test_gsm8k_only_last_300_chars():
    answer = "#### 72" + " filler" * 60
    assert len(answer) > gsm8k.CLIP_CHARS
    assert gsm8k.extract_solution(answer) is None
    assert gsm8k.extract_solution(" filler" * 60 + "#### 72") == "72"


def test_gsm8k_flexible_and_scores():
    assert gsm8k.extract_solution("so 3 apples and 72 pears", "flexible") == "72"
    assert gsm8k.extract_solution("answer: -5 . .", "flexible") == "-5"  # bare dots skipped
    assert gsm8k.extract_solution("no digits here", "flexible") is None
    assert gsm8k.extract_solution("total $1,234", "flexible") == "1,234"  # kept as written
    assert gsm8k.compute_score("we get 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("we get 71", "72", method="flexible", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "72", method="flexible", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 72", 72) == 1.0  # integer ground truth
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        gsm8k.extract_solution("x", "loose")


# --- MATH ------------------------------------------------------------------------------------


def test_last_boxed_nested_and_fbox():
    assert math_reward.last_boxed(r"so \boxed{1} no, \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert math_reward.last_boxed(r"\boxed{\left\{1,{2}\right\}}") == r"\left\{1,{2}\right\}"
    assert math_reward.last_boxed(r"\fbox{7}") == "7"
    assert math_reward.last_boxed(r"$\boxed 5$.") == "5"
    assert math_reward.last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off
    assert math_reward.last_boxed("no box") is None


@pytest.mark.parametrize("answer, truth", [
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\frac12", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    ("1/2", r"\frac{1}{2}"),
    (r"\left( 3, 4 \right)", "(3,4)"),
    (r"90^\circ", "90"),
    (r"10\text{ cm}", "10"),
    (r"x = 5", "5"),
    (r"\sqrt2", r"\sqrt{2}"),
    (".5", "0.5"),
    (r"50\%", "50"),
    (r"5\!000", "5000"),
    ("7.", "7."),
])
def test_strip_string_equivalences(answer, truth):
    assert math_reward.is_equiv(answer, truth)


def test_math_scores_by_data_source():
    response = r"Thus the answer is $\boxed{\dfrac{3}{4}}$."
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                   "HuggingFaceH4/MATH-500"):
        assert rewards.compute_score(source, response, r"\frac{3}{4}") == 1.0
        assert rewards.compute_score(source, response, "3/4") == 1.0
        assert rewards.compute_score(source, response, r"\frac{4}{3}") == 0.0
        assert rewards.compute_score(source, r"the answer is \frac{3}{4}", "3/4") == 0.0
    assert not math_reward.is_equiv("03/4", r"\frac{3}{4}")  # not as int() prints it


# --- addition --------------------------------------------------------------------------------


@pytest.mark.parametrize("response, expected", [
    ("1 3 2", 1.0), ("132", 1.0), (" 1 3  2 ", 1.0), ("1 3 2<eos><pad>", 1.0),
    ("1 3 2 <eos> 5", 1.0),  # what follows EOS is not part of the answer
    ("1 3", 0.0), ("1 3 2 2", 0.0), ("2 3 1", 0.0), ("", 0.0), ("<eos>", 0.0),
])
def test_addition_exact_match(response, expected):
    assert addition.compute_score(response, "1 3 2") == expected
    assert rewards.compute_score("synthetic/addition", response, "1 3 2") == expected


# --- registry, custom functions, batches -----------------------------------------------------


def test_unknown_data_source():
    with pytest.raises(ConfigError, match="no reward function for data_source 'my/data'; set "
                                          "reward.custom_reward_function.path/name"):
        rewards.compute_score("my/data", "x", "y")


def test_register_new_source():
    rewards.register("test/echo", lambda s, gt, extra: float(s == gt) * extra["w"])
    try:
        assert rewards.compute_score("test/echo", "a", "a", {"w": 0.5}) == 0.5
    finally:
        del rewards.REGISTRY["test/echo"]


def test_register_reward_decorator_scores_batches(monkeypatch):
    monkeypatch.setattr(rewards, "REGISTRY", dict(rewards.REGISTRY))  # dropped after the test

    @rewards.register_reward("test/len", "test/len-hard")
    def by_length(solution_str, ground_truth, extra_info):
        return float(len(solution_str) == int(ground_truth)) * (extra_info or {}).get("w", 1.0)

    assert rewards.REGISTRY["test/len"] is rewards.REGISTRY["test/len-hard"] is by_length
    scores = rewards.score_batch(["test/len", "test/len-hard", "openai/gsm8k"],
                                 ["abc", "ab", "#### 7"], ["3", "2", "7"], [None, {"w": 0.5}, None])
    np.testing.assert_array_equal(scores, np.array([1.0, 0.5, 1.0], np.float32))
    with pytest.raises(TypeError, match="one or more data_source names"):
        rewards.register_reward(by_length)


def test_builtin_scorers_are_registered():
    assert {"openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500", "synthetic/addition"} <= set(rewards.REGISTRY)


CUSTOM = '''
def my_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0 if solution_str == ground_truth else -1.0, "acc": 1.0}


not_a_function = 3
'''


def test_custom_reward_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    fn = rewards.load_custom_reward_fn(str(path), "my_score")
    scores = rewards.score_batch(["openai/gsm8k", "anything/else"], ["a", "b"], ["a", "c"],
                                 [None, {}], custom_fn=fn)
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, [2.0, -1.0])


def test_custom_reward_from_module(tmp_path, monkeypatch):
    (tmp_path / "reward_pkg").mkdir()
    (tmp_path / "reward_pkg" / "__init__.py").write_text("")
    (tmp_path / "reward_pkg" / "scores.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.load_custom_reward_fn("reward_pkg.scores", "my_score")
    assert fn(data_source="d", solution_str="x", ground_truth="x")["score"] == 2.0


def test_custom_reward_errors(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    with pytest.raises(ConfigError, match="custom reward file not found: .*missing.py"):
        rewards.load_custom_reward_fn(str(tmp_path / "missing.py"), "my_score")
    with pytest.raises(ConfigError, match="has no function 'other'"):
        rewards.load_custom_reward_fn(str(path), "other")
    with pytest.raises(ConfigError, match="'not_a_function' is not callable"):
        rewards.load_custom_reward_fn(str(path), "not_a_function")
    with pytest.raises(ConfigError, match="custom reward module not found: no_such.mod"):
        rewards.load_custom_reward_fn("no_such.mod", "f")


def test_score_batch_registry():
    scores = rewards.score_batch(
        ["openai/gsm8k", "synthetic/addition", "lighteval/MATH", "openai/gsm8k"],
        ["#### 72", "1 3 2", r"\boxed{2}", "72"], ["72", "1 3 2", "3", "72"], None)
    np.testing.assert_array_equal(scores, np.array([1, 1, 0, 0], np.float32))
    assert rewards.score_batch([], [], [], []).shape == (0,)
    with pytest.raises(ValueError, match="one entry per response"):
        rewards.score_batch(["openai/gsm8k"], ["a", "b"], ["a", "b"])
