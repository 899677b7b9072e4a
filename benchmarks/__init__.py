"""Speed and memory claims, each measured as a ratio against a baseline in the same run.

Every module exposes ``main(argv=None) -> dict`` and runs as ``python -m benchmarks.<name> [--quick]``; results
go to ``benchmarks/results/<name>.json`` through ``benchmarks._common.write_results``.
"""
