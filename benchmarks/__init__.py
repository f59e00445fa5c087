"""Measurement scripts (run from a source checkout as `python -m benchmarks.<name>`); never tests."""
