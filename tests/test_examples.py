"""The notebook-style examples run as they are, and print what they say."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    if path.name == "losses_in_a_notebook.py":
        assert "grpo, ids 7/42: [ 0.707 -0.707  0.707 -0.707]" in out
        assert "dense ids of the uids: [0 0 1 1]" in out
