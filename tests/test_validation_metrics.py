"""Validation at N (rlhf_jax/validation.py): verl's bootstrap figures against a plain loop
written from its description, maj@N worked by hand, and the val-core / val-aux names."""

import itertools
from collections import Counter

import numpy as np
import pytest

from rlhf_jax import validation as V


def _reference(values, preds, k, seed=42, n_boot=1000):
    """best/worst/maj of k draws, one bootstrap sample at a time (global numpy RNG, as verl)."""
    np.random.seed(seed)
    idx = np.random.choice(len(values), size=(n_boot, k), replace=True)
    best, worst, maj = [], [], []
    for row in idx:
        drawn = [values[i] for i in row]
        best.append(max(drawn))
        worst.append(min(drawn))
        if preds is not None:
            votes = [preds[i] for i in row]
            counts = Counter(votes)
            top = max(counts.values())
            winner = next(v for v in votes if counts[v] == top)  # first seen of the most voted
            maj.append(drawn[votes.index(winner)])
    out = {f"best@{k}/mean": np.mean(best), f"best@{k}/std": np.std(best),
           f"worst@{k}/mean": np.mean(worst), f"worst@{k}/std": np.std(worst)}
    if preds is not None:
        out.update({f"maj@{k}/mean": np.mean(maj), f"maj@{k}/std": np.std(maj)})
    return out


def test_sample_sizes_are_powers_of_two_then_n():
    assert V.sample_sizes(1) == []
    assert V.sample_sizes(2) == [2]
    assert V.sample_sizes(5) == [2, 4, 5]
    assert V.sample_sizes(8) == [2, 4, 8]
    assert V.sample_sizes(16) == [2, 4, 8, 16]


def test_majority_value_by_hand():
    votes = np.array([[0, 1, 1, 0],   # 2 - 2 tie: the vote seen first (0) wins
                      [2, 1, 1, 0],   # 1 has two votes: its first response's value
                      [5, 6, 7, 8],   # all different: the first response
                      [3, 3, 3, 3]])
    values = np.array([[1.0, 0.0, 0.5, 0.25],
                       [0.1, 0.2, 0.3, 0.4],
                       [0.7, 0.0, 0.0, 0.0],
                       [0.9, 0.1, 0.1, 0.1]])
    np.testing.assert_array_equal(V.majority_values(votes, values), [1.0, 0.2, 0.7, 0.9])


def test_prompt_metrics_match_the_reference_loop():
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 8):
        values = rng.integers(0, 3, n).astype(float) / 2
        preds = [str(v) for v in rng.integers(0, 3, n)]
        codes = {p: i for i, p in enumerate(dict.fromkeys(preds))}
        got = V.prompt_metrics(values, np.array([codes[p] for p in preds]))
        want = {f"mean@{n}": values.mean(), f"std@{n}": values.std()}
        for k in V.sample_sizes(n):
            want.update(_reference(list(values), preds, k))
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-12), (n, key)


def test_maj_at_n_against_the_exact_expectation():
    """3 responses answer 7, 8, 8 with values 1, 0, 0: enumerating all 27 draws of 3 gives
    the exact E[maj@3]; 1000 bootstrap draws land near it (their std error is ~0.015)."""
    values, votes = np.array([1.0, 0.0, 0.0]), np.array([0, 1, 1])
    exact = []
    for draw in itertools.product(range(3), repeat=3):
        counts = Counter(votes[list(draw)])
        top = max(counts.values())
        winner = next(votes[i] for i in draw if counts[votes[i]] == top)
        exact.append(values[next(i for i in draw if votes[i] == winner)])
    m = V.prompt_metrics(values, votes)
    assert m["maj@3/mean"] == pytest.approx(np.mean(exact), abs=0.05)
    assert np.mean(exact) == pytest.approx(7 / 27)  # 8 wins unless 7 is drawn twice or more
    assert m["best@3/mean"] == pytest.approx(1 - (2 / 3) ** 3, abs=0.05)
    assert m["worst@3/mean"] == pytest.approx((1 / 3) ** 3, abs=0.05)
    assert m["mean@3"] == pytest.approx(1 / 3) and m["std@3"] == pytest.approx(np.std(values))


def test_names_core_and_aux_and_average_over_prompts():
    # two prompts of source a (4 responses each), one of source b
    sources = ["a"] * 8 + ["b"] * 4
    uids = ["p0"] * 4 + ["p1"] * 4 + ["q"] * 4
    reward = [1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    infos = {"reward": [float(x) for x in reward], "pred": list("ABAACCCD") + list("EEEE")}
    out = V.validation_metrics(sources, uids, infos)
    assert out["val-core/a/reward/mean@4"] == pytest.approx((0.75 + 0.25) / 2)
    assert out["val-aux/a/reward/std@4"] == pytest.approx(
        (np.std([1, 0, 1, 1]) + np.std([0, 0, 0, 1])) / 2)
    p0 = V.prompt_metrics(np.array([1.0, 0, 1, 1]), np.array([0, 1, 0, 0]))
    p1 = V.prompt_metrics(np.array([0.0, 0, 0, 1]), np.array([0, 0, 0, 1]))
    # verl's rule: mean / maj / best at the largest N are core (their std figures too)
    for name in ("maj@4/mean", "best@4/mean", "maj@4/std", "best@4/std"):
        assert out[f"val-core/a/reward/{name}"] == pytest.approx((p0[name] + p1[name]) / 2)
    for name in ("worst@4/mean", "worst@4/std", "best@2/mean", "maj@2/mean"):
        assert f"val-aux/a/reward/{name}" in out and f"val-core/a/reward/{name}" not in out
    assert len(out) == 2 * (2 + 6 * 2)  # a and b: mean@4, std@4, 6 figures at k = 2 and 4
    assert out["val-core/b/reward/maj@4/mean"] == 1.0 and out["val-aux/b/reward/std@4"] == 0
    assert not any("/pred/" in k for k in out)  # the votes are not a variable
    # with an "acc" variable, acc is the core one and reward goes to val-aux
    with_acc = V.validation_metrics(sources, uids, {**infos, "acc": [bool(x) for x in reward]})
    assert "val-core/a/acc/mean@4" in with_acc and "val-aux/a/reward/mean@4" in with_acc
    # without preds: no maj
    assert not any("maj@" in k for k in V.validation_metrics(sources, uids,
                                                             {"reward": infos["reward"]}))


def test_n_of_one_logs_mean_at_one_only():
    out = V.validation_metrics(["s", "s"], ["x", "y"], {"reward": [1.0, 0.0], "pred": ["1", "2"]})
    assert out == {"val-core/s/reward/mean@1": 0.5}


def test_figures_are_seeded_and_leave_numpy_global_rng_alone():
    values, votes = np.linspace(0, 1, 6), np.array([0, 1, 0, 2, 1, 0])
    np.random.seed(123)
    before = np.random.random()
    np.random.seed(123)
    a = V.prompt_metrics(values, votes)
    after = np.random.random()
    assert a == V.prompt_metrics(values, votes) and before == after


def test_response_length_metrics_per_source():
    out = V.response_length_metrics(["a", "b", "a", "a"], np.array([3, 8, 8, 1]), 8)
    assert out == {"val-aux/a/response_length/mean": 4.0, "val-aux/a/response_length/max": 8.0,
                   "val-aux/a/response_length/min": 1.0,
                   "val-aux/a/response_length/clip_ratio": pytest.approx(1 / 3),
                   "val-aux/b/response_length/mean": 8.0, "val-aux/b/response_length/max": 8.0,
                   "val-aux/b/response_length/min": 8.0,
                   "val-aux/b/response_length/clip_ratio": 1.0}


def test_join_infos_fills_missing_keys_with_none():
    joined = V.join_infos([(2, {"reward": [1.0, 0.0]}),
                           (1, {"reward": [0.5], "pred": ["7"]})])
    assert joined == {"reward": [1.0, 0.0, 0.5], "pred": [None, None, "7"]}
    with pytest.raises(ValueError, match="'pred': 1 values for 2 rows"):
        V.join_infos([(2, {"pred": ["7"]})])


def test_built_in_rewards_give_the_answer_as_pred():
    from rlhf_jax import rewards

    got = rewards.score_batch_info(
        ["openai/gsm8k", "openai/gsm8k", "synthetic/addition", "HuggingFaceH4/MATH-500"],
        ["so #### 1,234", "no answer", "4 6<eos>7", r"\boxed{\dfrac{1}{2}}"],
        ["1234", "5", "4 6", "0.5"])
    np.testing.assert_array_equal(got.scores, [1.0, 0.0, 1.0, 1.0])
    assert got.info["pred"] == ["1234", "[INVALID]", "46", r"\frac{1}{2}"]
    assert rewards.compute_score("openai/gsm8k", "#### 72", "72") == 1.0  # still a float
    assert rewards.score_batch(["synthetic/addition"], ["1"], ["2"]).tolist() == [0.0]
