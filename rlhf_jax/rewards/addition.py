"""Reward of the synthetic addition task: exact match of the generated digits, 1.0 or 0.0."""

from __future__ import annotations

EOS_TEXT = "<eos>"


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 iff the response's digits before EOS equal the ground truth's; spaces are ignored.

    A response decoded with `skip_special_tokens=False` is cut at its first `<eos>`. Anything
    generated after the answer (a missing EOS) makes it wrong: there is no partial credit.
    """
    return score_and_pred(solution_str, ground_truth)["score"]


def score_and_pred(solution_str: str, ground_truth: str) -> dict:
    """`compute_score` with the answer it read: `{"score": float, "pred": str}`, the digits
    before EOS without spaces ("[INVALID]" when there are none)."""
    answer = "".join(solution_str.split(EOS_TEXT, 1)[0].split())
    truth = "".join(str(ground_truth).split())
    return {"score": 1.0 if answer and answer == truth else 0.0,
            "pred": answer or "[INVALID]"}
