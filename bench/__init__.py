"""Benchmarks: `python -m bench.<name> [--quick]`; the last line is one JSON object."""
