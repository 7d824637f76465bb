"""A reward for the dynamic-sampling tests: groups of some prompts carry no signal.

Prompts whose answer starts with an even digit score 0.5 whatever the response (their groups
are all equal, so dynamic sampling drops them); the others score a value that changes with
the response text. The dict's "pred" (the response) is the vote of validation's maj@N.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    del data_source, extra_info
    truth = str(ground_truth).replace(" ", "")
    text = solution_str.replace(" ", "")
    if int(truth[0]) % 2 == 0:
        score = 0.5
    else:
        score = (sum(ord(c) * (i + 1) for i, c in enumerate(text)) % 101) / 101
    return {"score": score, "pred": text}


def constant_score(data_source, solution_str, ground_truth, extra_info=None):
    """The same score for every response: no group ever passes dynamic sampling."""
    del data_source, solution_str, ground_truth, extra_info
    return 1.0
