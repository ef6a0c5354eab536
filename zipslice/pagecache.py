"""Whether a checkpoint can stay in the page cache, letting go of pages already read when it cannot, and
writing without piling up dirty pages.

Streaming a checkpoint larger than memory through the page cache only pushes everything else out, and
the kernel must reclaim a page for every page read -- in a memory cgroup that reclaim is charged to the
reader itself: an 8 GiB stream under a 4 GiB limit took 10.3-10.7 s, 3.7-3.8 s with each tensor's pages
dropped right after they were copied out (scripts/bench/read.py --mem-limit 4). A checkpoint that fits
keeps its pages, so the next read of it is served from memory.

Writing is the other half: a dirty page cannot be reclaimed until the disk has it, and a memory cgroup's
limit counts it (cgroup v1 has no per-group dirty throttling). Writing 2 GiB in 8 MiB pieces inside a
128 MiB cgroup was OOM-killed with 64 MiB pieces and took 4.4 s at the limit with 8 MiB ones; with
:class:`WriteBehind` (writeback started every 8 MiB, the window before it waited for and let go of) it took
1.5-1.8 s at a 27 MiB peak (8 to 64 MiB windows: 1.5-2.0 s, peaks 27 to 127 MiB).
"""
from __future__ import annotations

import ctypes
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


#: bytes written between two writeback starts: at most two such windows are dirty or in flight
WRITE_WINDOW = 8 << 20
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* (linux/fs.h)


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def sync_range(fd: int, offset: int, nbytes: int, wait: bool) -> None:
    """Start writeback of the dirty pages of ``[offset, offset + nbytes)`` (``nbytes`` 0: to the end of the
    file); ``wait``: and wait until they are on disk. Where sync_file_range is missing, fdatasync the file."""
    if _sync_file_range is None:
        if wait:
            os.fdatasync(fd)
        return
    flags = _WAIT_BEFORE | _WRITE | _WAIT_AFTER if wait else _WRITE
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        if wait:  # a file system without it (some FUSE ones): the data must still reach the disk
            os.fdatasync(fd)
        elif err not in (0, 22, 29, 38):  # EINVAL, ESPIPE, ENOSYS: nothing to start
            raise OSError(err, os.strerror(err))


class WriteBehind:
    """Keep the dirty pages of a file being written within two :data:`WRITE_WINDOW` s, whatever its size.

    Call :meth:`wrote` with how far the file has been written (front to back). Every window, writeback of the
    new bytes is started and the window before it is waited for -- the disk works while the writer computes
    the next bytes -- then let go of from the page cache once the file is too big to stay cached (as a
    reader drops behind: :func:`too_big_to_cache`). The final fsync of the file still decides durability.
    ``sequential=False`` (a writer that places its bytes itself, HDF5): each window waits for the whole file.
    ``let_go``: drop written pages always (True), never (False), or once the file is too big to cache (None).
    """

    def __init__(self, fd: int, window: int = WRITE_WINDOW, sequential: bool = True, let_go: bool | None = None):
        self.fd, self.window, self.sequential = fd, window, sequential
        self._drop = let_go
        self._budget: int | None = None
        self.started = 0   # writeback started for bytes before this
        self.settled = 0   # bytes before this are on disk
        self.dropped = 0   # and those before this let go of
        self.end = 0

    def dropping(self) -> bool:
        if self._drop is not None:
            return self._drop
        if self._budget is None:
            self._budget = cache_budget()
        return too_big_to_cache(self.end, self._budget)

    def due(self, end: int) -> bool:
        """Whether writing up to ``end`` completes a window (a buffered writer flushes, then calls :meth:`wrote`)."""
        return max(self.end, end) - self.started >= self.window

    def wrote(self, end: int) -> None:
        """The file now holds the bytes before ``end``."""
        if not self.due(end):
            self.end = max(self.end, end)
            return
        self.end = max(self.end, end)
        if not self.sequential:
            sync_range(self.fd, 0, 0, wait=True)
            self.started = self.settled = self.end
        else:
            sync_range(self.fd, self.started, self.end - self.started, wait=False)
            if self.started > self.settled:
                sync_range(self.fd, self.settled, self.started - self.settled, wait=True)
                self.settled = self.started
            self.started = self.end
        if self.settled > self.dropped and self.dropping():
            drop(self.fd, self.dropped, self.settled - self.dropped)  # (from the start, once it became too big)
            self.dropped = self.settled
