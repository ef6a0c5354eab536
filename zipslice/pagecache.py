"""Whether a checkpoint can stay in the page cache, and letting go of pages already read when it cannot.

Streaming a checkpoint larger than memory through the page cache only pushes everything else out, and
the kernel must reclaim a page for every page read -- in a memory cgroup that reclaim is charged to the
reader itself: an 8 GiB stream under a 4 GiB limit took 10.3-10.7 s, 3.7-3.8 s with each tensor's pages
dropped right after they were copied out (scripts/bench/read.py --mem-limit 4). A checkpoint that fits
keeps its pages, so the next read of it is served from memory.
"""
from __future__ import annotations

import os

# cgroup v1 reports "no limit" as a huge number (2**63 rounded down to a page)
_NO_LIMIT = 1 << 60


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup and its ancestors (page cache included), or None."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):  # v1: the limit file already covers the ancestors
            return _v1_limit(os.path.join(root, "memory"), path)
    for line in lines:
        if line.startswith("0::"):
            return _v2_limit(root, line[3:])
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) is no limit


def _v1_limit(base: str, path: str) -> int | None:
    # inside a container the path names the host's hierarchy while base is already the container's own
    for d in (os.path.join(base, path.lstrip("/")), base):
        try:
            with open(os.path.join(d, "memory.stat")) as f:
                for line in f:
                    if line.startswith("hierarchical_memory_limit "):
                        limit = int(line.split()[1])
                        return limit if limit < _NO_LIMIT else None
        except (OSError, ValueError):
            pass
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        if limit is not None:
            return limit if limit < _NO_LIMIT else None
    return None


def _v2_limit(root: str, path: str) -> int | None:
    limits = []
    d = os.path.join(root, path.lstrip("/"))
    while True:
        limit = _read_int(os.path.join(d, "memory.max"))
        if limit is not None:
            limits.append(limit)
        if os.path.normpath(d) == os.path.normpath(root):
            break
        d = os.path.dirname(d)
    return min(limits) if limits else None


def cache_budget() -> int:
    """Bytes of page cache this process can count on: the host's available memory, within its cgroup."""
    import psutil

    available = psutil.virtual_memory().available
    limit = cgroup_memory_limit()
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
