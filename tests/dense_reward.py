"""A partial-credit reward for the tiny test runs: the share of answer characters in place.

The synthetic task's exact match is 0 for every sample of a barely warmed-up model, which
leaves advantages, value loss and KL at zero; this score gives the short test runs signal.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    del data_source, extra_info
    want, got = str(ground_truth).replace(" ", ""), solution_str.replace(" ", "")
    hits = sum(a == b for a, b in zip(want, got, strict=False))
    return hits / max(len(want), len(got), 1)
