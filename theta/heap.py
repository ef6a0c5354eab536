"""Keep the C heap's resident size close to what is in use (glibc only; a no-op elsewhere).

glibc serves a large allocation with its own mmap and returns it on free, but by default it raises that
threshold to the size of every large block freed (up to 32 MiB), after which group-sized temporaries (codec
frames, delta codes, decoded planes) come from the heap and stay resident after they are freed. Over a
commit of many groups that kept ~50-90 MiB more than in use (measured by scripts/bench/git.py). A fixed
threshold of 1 MiB and a trim threshold of 4 MiB keep the heap at what is in use, for a few more mmap calls.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 32 << 20

_done = False


def bound_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); True when applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt): its allocator returns memory on its own terms
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
