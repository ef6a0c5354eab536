"""Peak Python-heap allocation of one call (tracemalloc): the in-process memory bound of a unit test.

    out, peak = traced_peak(reconstruct, group, store)
"""
from __future__ import annotations

import tracemalloc
from typing import Any, Callable


def traced_peak(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, int]:
    """(fn(*args, **kwargs), the peak bytes tracemalloc saw allocated during the call)."""
    tracemalloc.start()
    try:
        out = fn(*args, **kwargs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, peak
