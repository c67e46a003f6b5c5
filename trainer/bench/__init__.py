"""Benchmarks: `python -m trainer.bench SCENARIO [--quick] [--seed S] [--json PATH] [--plot PATH]`."""
