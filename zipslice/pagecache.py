"""Whether a checkpoint can stay in the page cache, and letting go of pages already read when it cannot.

Streaming a checkpoint larger than memory through the page cache only pushes everything else out, and
the kernel must reclaim a page for every page read -- in a memory cgroup that reclaim is charged to the
reader itself: an 8 GiB stream under a 4 GiB limit took 10.3-10.7 s, 3.7-3.8 s with each tensor's pages
dropped right after they were copied out (scripts/bench/read.py --mem-limit 4). A checkpoint that fits
keeps its pages, so the next read of it is served from memory.
"""
from __future__ import annotations

import os

from . import memory
from .memory import cgroup_memory_limit  # noqa: F401  (its home is zipslice.memory; kept importable here)


def cache_budget() -> int:
    """Bytes of page cache this process can count on: the host's available memory, within its cgroup."""
    available = memory.host_available()
    limit = memory.cgroup_memory_limit()
    return min(available, limit) if limit else available


def too_big_to_cache(nbytes: int, budget: int | None = None) -> bool:
    """A file taking more than half of what can be cached would be evicted before it is read again."""
    return nbytes > (cache_budget() if budget is None else budget) // 2


def drop(fd: int, offset: int, nbytes: int) -> None:
    """Let the kernel drop these (clean, unmapped) pages of the file from its cache."""
    if nbytes > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system without page cache hints: nothing to let go of
            pass
