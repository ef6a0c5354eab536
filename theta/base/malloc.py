"""glibc's allocator, as theta's long-running processes use it: one home for its two settings.

- :func:`reuse_freed_memory`: the filter keeps what it frees for its next allocations, whichever thread
  frees and allocates them (fresh pages are the dearest thing a clean touches on a small virtual machine);
- :func:`give_back_freed_memory`: before a group is held whole after a frame pass, what the pass freed is
  returned, so the kept memory and the group never add up past the bound.

Both are no-ops (False) where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache


@lru_cache(maxsize=None)
def _glibc(name: str):
    """glibc's function ``name``, or None where the C library has none by that name (not glibc)."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


def reuse_freed_memory() -> bool:
    """Let glibc keep memory the filter frees for its next allocations instead of returning it to the kernel at
    once: every codec frame, code-word block and read buffer otherwise comes back as fresh pages the kernel
    must fault in and zero (``clear_page`` was 13% of a 20% `git add`'s CPU samples in perf). Blocks up to
    32 MiB (glibc's largest ``M_MMAP_THRESHOLD``) come from the heap; up to 256 MiB freed at its top is kept.

    And one heap for every thread (``M_ARENA_MAX`` 1): glibc gives each new thread an arena of its own, so a
    frame freed by the in-order thread was never reused by a codec thread, and each arena grew to its own
    high-water mark in fresh pages. The filter's threads allocate few, large blocks, so they do not queue
    on the one arena's lock. Measured with ``scripts/bench/partial_add.py``
    (docs/design/performance.md): a full fine-tune's add faster, and the peak RSS of every add lower by 10-20%.
    False where the C library has no ``mallopt`` (not glibc)."""
    mallopt = _glibc("mallopt")
    if mallopt is None:  # not glibc: its own defaults
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return (bool(mallopt(m_arena_max, 1)) and bool(mallopt(m_mmap_threshold, 32 << 20))
            and bool(mallopt(m_trim_threshold, 256 << 20)))


def give_back_freed_memory() -> bool:
    """Return the memory this process freed and glibc kept (:func:`reuse_freed_memory`) to the kernel
    (``malloc_trim``): a frame pass leaves its frames' worth in the heap, and a group then read whole comes on
    top of it (a "50% pruned" add of the benchmark peaked at 336 MiB, over its bound of 329 MiB; 318 MiB with
    this). False where the C library has no ``malloc_trim``."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
