"""Benchmarks: each script runs the peer side by side with ours and prints ratios (docs/benchmarks.md)."""

# A script here runs with this folder first on sys.path: never name one after a package it imports
# (safetensors.py would shadow the safetensors library, tempo.py the tempo package).
