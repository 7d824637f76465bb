"""MATH rule reward: the last `\\boxed{...}` of the response against the ground truth.

Equivalence is string equality after normalisation; `strip_string` follows the Hendrycks MATH
normaliser that verl uses (verl/utils/reward_score/math.py) step by step, in the same order.
"""

from __future__ import annotations

import re

_SLASH_FRACTION = re.compile(r"^(-?(?:0|[1-9]\d*))/(0|[1-9]\d*)$")  # ints as int() prints them


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced), or of `\\boxed x`."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    space_form = text.rfind("\\boxed ")
    if space_form > start:  # `\boxed 5$`: up to the closing dollar
        return text[space_form + len("\\boxed "):].split("$")[0]
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for i in range(opening, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1:i]
    return None  # unbalanced: the answer was cut off


def _fix_fracs(s: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`."""
    head, *parts = s.split("\\frac")
    out = [head]
    for part in parts:
        if part.startswith("{"):
            out.append(part)
        elif len(part) < 2:
            return s
        elif part[1] == "{":
            out.append("{" + part[0] + "}" + part[1:])
        else:
            out.append("{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "\\frac".join(out)


def _fix_sqrt(s: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}`."""
    head, *parts = s.split("\\sqrt")
    fixed = [p if not p or p[0] == "{" else "{" + p[0] + "}" + p[1:] for p in parts]
    return "\\sqrt".join([head, *fixed])


def _fix_slash(s: str) -> str:
    r"""`3/4` -> `\frac{3}{4}` for plain integers only."""
    m = _SLASH_FRACTION.match(s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def strip_string(s: str) -> str:
    """Normalise a MATH answer so that equal answers compare equal as strings."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = s.split("\\text{ ")[0]  # units on the right: `5\text{ cm}`
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, *rhs = s.split("=")
    if len(rhs) == 1 and len(lhs) <= 2:  # `x = 5` -> `5`
        s = rhs[0]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return strip_string(a) == strip_string(b)


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer is equivalent to `ground_truth`, else 0.0."""
    return score_and_pred(solution_str, ground_truth)["score"]


def score_and_pred(solution_str: str, ground_truth: str) -> dict:
    """`compute_score` with the answer: `{"score": float, "pred": str}`, the last boxed
    answer normalised by `strip_string` (equivalent answers vote alike), "[INVALID]" if none."""
    answer = last_boxed(solution_str)
    if answer is None:
        return {"score": 0.0, "pred": "[INVALID]"}
    return {"score": 1.0 if is_equiv(answer, str(ground_truth)) else 0.0,
            "pred": strip_string(answer)}
