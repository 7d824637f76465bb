"""GSM8K rule reward with verl's semantics (verl/utils/reward_score/gsm8k.py).

Only the last 300 characters are searched. `strict` takes the last `#### <number>` and removes
`,` and `$`; `flexible` takes the last number-like run anywhere, skipping bare `.`s, and keeps it
as written (so, as in verl, `1,234` or `72.` do not equal `1234` / `72`).
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_INVALID = ("", ".")
INVALID = "[INVALID]"  # the pred of a response without an answer (verl's math_dapo)


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in `solution_str`, or None when nothing parses."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(tail)):
        if candidate not in _INVALID:
            return candidate
    return None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for the right answer, `format_score` for a parsed wrong one, 0 for none."""
    return score_and_pred(solution_str, ground_truth, method, format_score, score)["score"]


def score_and_pred(solution_str: str, ground_truth: str, method: str = "strict",
                   format_score: float = 0.0, score: float = 1.0) -> dict:
    """`compute_score` with the extracted answer: `{"score": float, "pred": str}`; `pred` is
    INVALID when nothing parses (the vote of validation's maj@N)."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return {"score": 0.0, "pred": INVALID}
    value = float(score) if answer == str(ground_truth) else float(format_score)
    return {"score": value, "pred": answer}
