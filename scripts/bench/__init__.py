"""Benchmarks: each script runs the peer side by side with ours and prints ratios (docs/benchmarks.md)."""
