"""DAPO's overlong reward shaping (`reward_model.overlong_buffer`), verl's DAPO reward manager.

A response of L tokens (EOS included) under a hard limit of R tokens, with a buffer of the
last B of them, gets

    penalty = min(-(L - (R - B)) / B * penalty_factor, 0)

added to its score: 0 up to R - B tokens, then a linear ramp to -penalty_factor at L = R.
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths: np.ndarray, *, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """The penalty of each response.

    Args:
        lengths: int [N], valid response tokens (the response mask's sum).
        max_response_length: R, the hard limit (data.max_response_length).
        buffer_len: B > 0, the buffer (reward_model.overlong_buffer.len), B <= R.
        penalty_factor: the penalty at L = R.

    Returns:
        float32 [N], <= 0.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"buffer_len must be in (0, {max_response_length}], got {buffer_len}")
    excess = np.asarray(lengths, np.float64) - (max_response_length - buffer_len)
    return np.minimum(-excess / buffer_len * penalty_factor, 0.0).astype(np.float32)
