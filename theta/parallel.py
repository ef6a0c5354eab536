"""theta's worker threads: one home for every pool, created lazily, shared for the process's life.

Each pool has one job so work of one kind never queues behind another (hashing a blob never waits for a
group being read ahead). hashlib, zstd, preadv and numpy release the GIL, so these threads use real cores.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

CORES = os.cpu_count() or 1
# clean reads, and smudge rebuilds, the next group(s) ahead only up to this many bytes (so read-ahead never
# adds more than this to peak memory)
READ_AHEAD_BYTES = 64 << 20
READ_AHEAD_THREADS = 1  # 2 measured no faster on 2 cores, and held more memory
CODEC_THREADS = min(2, CORES)  # zstd planes compressed/decompressed side by side

_WORKERS = {"hash": 1, "read": READ_AHEAD_THREADS, "rebuild": 1, "codec": CODEC_THREADS, "numeric": 2}
_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(name: str) -> ThreadPoolExecutor:
    """The pool for one kind of work: "hash", "read", "rebuild", "codec" or "numeric"."""
    with _lock:
        p = _pools.get(name)
        if p is None:
            p = _pools[name] = ThreadPoolExecutor(max_workers=_WORKERS[name], thread_name_prefix=f"theta-{name}")
        return p
