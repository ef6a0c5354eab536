"""Run tempo's own elementwise work on one thread.

tempo's backward recomputes what stock kept with ~20 small elementwise ops per element. Split over
OpenMP threads, every op ends at a barrier; on a machine whose cores are shared (other processes, a
data loader) a descheduled thread stalls each barrier, and on 2 busy cores a GELU backward measured
30x slower than on one thread (scripts/bench/tempo_training.py). On one thread it costs ~2x the idle 2-thread
time instead, and matmuls around it keep every thread. Set ONE_THREAD = False to let them spread.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

ONE_THREAD = True


@contextmanager
def one_thread() -> Iterator[None]:
    """Within the block, torch ops on this thread run single-threaded (restored on exit)."""
    threads = torch.get_num_threads()
    if not ONE_THREAD or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
