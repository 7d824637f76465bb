"""Benchmarks behind `python scripts/bench.py NAME`: one module per benchmark, each with a
`run(...) -> dict` of flat `"<name>.<metric>"` keys; `common` holds the timing helpers."""
