"""Arrays theta derives the same way in every process, kept in the user's cache directory between processes.

The LSH family's random directions (theta.base.lsh) are 1M normal draws: ~25 ms of CPU per filter process, plus
~18 ms to import numpy.random, while the filter's other threads wait for the GIL. Read back from a file they
cost ~2 ms. A file is ``$XDG_CACHE_HOME/git-theta/<name>`` (default ``~/.cache/git-theta``): the xxh3-128 of
the array's bytes, then the bytes. A file that is missing, short or does not match its hash is ignored and
written again; a directory that cannot be written only means the array is made each time.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from theta.base import scratch

_DIGEST = 16  # bytes of the xxh3-128 before the array


def directory() -> Path | None:
    """Where theta keeps derived arrays, or None when there is no home to keep them in."""
    base = os.environ.get("XDG_CACHE_HOME") or (
        os.path.join(os.environ["HOME"], ".cache") if os.environ.get("HOME") else "")
    return Path(base) / "git-theta" if base else None


def cached_array(name: str, dtype: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
    """The array ``make()`` returns (of ``dtype``, a little-endian numpy dtype string, and ``shape``), read
    from the cache file ``name`` when it holds exactly that many bytes and they match their hash."""
    where = directory()
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if where is not None:
        try:
            with open(where / name, "rb") as f:
                data = f.read(_DIGEST + nbytes + 1)
            if len(data) == _DIGEST + nbytes and xxhash.xxh3_128_digest(memoryview(data)[_DIGEST:]) == data[:_DIGEST]:
                return np.frombuffer(data, dtype, offset=_DIGEST).reshape(shape)
        except OSError:
            pass
    value = np.ascontiguousarray(make(), dtype=dtype).reshape(shape)
    if where is not None:
        _write(where, name, value)
    return value


def _write(where: Path, name: str, value: np.ndarray) -> None:
    """Give the cache file its name in one step (theta.base.scratch: a reader sees the old file or the whole new one,
    and a process killed meanwhile leaves nothing behind)."""
    fd = tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = scratch.anonymous(where)
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(xxhash.xxh3_128_digest(value))
            f.write(value.data)
        scratch.publish(fd, tmp, where / name)
        tmp = None
    except OSError:
        pass  # read-only home, full disk: the array is made again next time
    finally:
        scratch.discard(fd, tmp)
