"""Reward of the synthetic addition task: exact match of the generated digits, 1.0 or 0.0."""

from __future__ import annotations

EOS_TEXT = "<eos>"


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 iff the response's digits before EOS equal the ground truth's; spaces are ignored.

    A response decoded with `skip_special_tokens=False` is cut at its first `<eos>`. Anything
    generated after the answer (a missing EOS) makes it wrong: there is no partial credit.
    """
    answer = solution_str.split(EOS_TEXT, 1)[0]
    answer = "".join(answer.split())
    truth = "".join(str(ground_truth).split())
    return 1.0 if answer and answer == truth else 0.0
