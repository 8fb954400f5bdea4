"""Benchmarks: one module per figure, run as ``python -m benchmarks.NAME``.

Each measures ours and the reference in the same run, prints a final JSON line, and writes
``benchmarks/results/NAME.json``.
"""
