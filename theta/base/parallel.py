"""theta's worker threads: one home for every pool, created lazily, shared for the process's life.

Each pool has one job so work of one kind never queues behind another (hashing a blob never waits for a
group being read ahead). hashlib, zstd, preadv and numpy release the GIL, so these threads use real cores.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from zipslice import memory

CORES = os.cpu_count() or 1
# clean reads, and smudge rebuilds, the next group(s) ahead only up to this many bytes, and clean only within
# 2 x the largest group minus what the group being encoded holds (so read-ahead never
# adds more than this to peak memory)
READ_AHEAD_BYTES = 64 << 20
READ_AHEAD_SHARE = 4  # ...and never more than this share of the memory the process really has


def read_ahead_budget() -> int:
    """READ_AHEAD_BYTES, or less in a small memory cgroup: a quarter of the memory available to the process
    (the host's, within its cgroup's limit; page cache not counted: zipslice.memory), so read-ahead never
    decides whether a small container's add fits."""
    return min(READ_AHEAD_BYTES, memory.available() // READ_AHEAD_SHARE)
READ_AHEAD_THREADS = 1  # 2 measured no faster on 2 cores, and held more memory
# groups clean may have queued on the reader at once (within READ_AHEAD_BYTES): with one, the reader idled
# while the clean thread encoded a changed group, then the clean thread waited for the sha256 and LSH of the
# next changed one (an add of every 5th group changed: 0.15 s of waits on 0.8 s)
READ_AHEAD_GROUPS = 16


DEFAULT_MAX_THREADS = 4  # the default's cap: each codec thread holds ~2 frames (~8 MiB) of the memory bound


def _threads() -> int:
    """``GIT_THETA_THREADS``: how many threads theta works on at once (default: the cores, at most
    DEFAULT_MAX_THREADS). It is the codec's thread count; 1 means no worker thread at all -- every pool runs
    its work inline, in the caller's thread, one thing after another (a one-core baseline: reading git's pipe,
    reading ahead, hashing and zstd no longer overlap). Each codec thread holds a frame being (de)compressed,
    so memory grows with it: ~2 x FRAME_BYTES per thread."""
    value = os.environ.get("GIT_THETA_THREADS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            pass  # a bad value falls back to the default rather than failing a filter
    return min(DEFAULT_MAX_THREADS, CORES)


CODEC_THREADS = _threads()  # zstd planes compressed/decompressed side by side (GIT_THETA_THREADS)
# "clean": the filter's clean of the work-tree file, started while git's bytes still arrive (one at a time)
# "start": the filter's git reads while its modules are imported (theta.commands.filter.process.serve)
_WORKERS = {"hash": 1, "read": READ_AHEAD_THREADS, "rebuild": 1, "codec": CODEC_THREADS,
            "numeric": min(2, CODEC_THREADS), "clean": 1, "start": 1}
_pools: dict[str, Executor] = {}
_lock = threading.Lock()


class Inline(Executor):
    """An executor without threads (GIT_THETA_THREADS=1): ``submit`` runs the call at once and returns its
    finished future, so callers written for pools run unchanged, one step after another."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as e:  # as a pool would: the caller sees it from result()
            f.set_exception(e)
        return f


def pool(name: str) -> Executor:
    """The pool for one kind of work: "hash", "read", "rebuild", "codec", "numeric", "clean" or "start" (an
    :class:`Inline` executor for every kind when CODEC_THREADS is 1)."""
    with _lock:
        p = _pools.get(name)
        if p is None:
            p = _pools[name] = Inline() if CODEC_THREADS <= 1 else ThreadPoolExecutor(
                max_workers=_WORKERS[name], thread_name_prefix=f"theta-{name}")
        return p
