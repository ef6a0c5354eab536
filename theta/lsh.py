"""Euclidean locality-sensitive hashing (E2LSH) of float parameter groups.

Used by clean to decide cheaply whether a changed group might still be "close" to its previous version
(then confirmed with an exact allclose), without reading the previous value for groups that clearly changed.

Family (parameters recorded in the metadata's ``checkpoint.lsh``, see :data:`PARAMS`):

- ``K = 16`` hash functions ``h_i(x) = rint(<a_i, x> / w)``, bucket width ``w = 1e-6``.
- The random directions ``a_i`` come from a fixed pool: ``POOL = 65536`` standard normals per function,
  drawn with numpy's legacy ``RandomState(SEED)`` (stable across numpy versions). A group longer than the pool
  reuses it cyclically: element ``k`` of row ``r = k // POOL`` meets ``pool[k % POOL]`` with sign ``(-1)^r``.
  That is the same as projecting the sign-alternated row sum ("fold") of the group, so hashing costs one
  streaming pass over the values plus 16 dot products of length POOL.
- Values are hashed as float32 (bf16/f16/float8 widened exactly; float64 rounded; complex as (re, im) pairs),
  accumulated in float64. Groups with NaN/Inf, and int/bool groups, get no signature (exact comparison only).

Each ``<a_i, d>`` of a difference ``d`` is ~ N(0, |d|^2), so ``w * |sig_a - sig_b| / sqrt(K)`` estimates the
Euclidean distance of two values. :func:`maybe_close` says "maybe close" when that estimate is within
``SLACK`` times the largest distance allclose(rtol, atol) could allow, plus the rounding of the buckets;
the caller then runs the exact allclose. A wrong "maybe" costs one comparison; a wrong "far" would only store
a near-identical value again (probability < 1e-9 per group with ``SLACK = 6``).
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np

from zipslice import dtypes

K = 16
POOL = 1 << 16
SEED = 20240917
BUCKET_WIDTH = 1e-6
SLACK = 6.0
PARAMS = {"family": "e2lsh-fold", "k": K, "pool": POOL, "seed": SEED, "w": BUCKET_WIDTH}

_ROWS_PER_CHUNK = 64  # rows of POOL elements widened to float32 at a time (16 MiB)


_drawing = threading.Lock()  # one thread draws the directions; one asking meanwhile waits for them


@lru_cache(maxsize=1)
def _drawn() -> np.ndarray:
    return np.random.RandomState(SEED).standard_normal((POOL, K))


def _pool() -> np.ndarray:
    with _drawing:
        return _drawn()


def directions() -> None:
    """Draw the family's random directions now (once per process, ~20 ms), e.g. on a thread of their own
    before the first signature is needed."""
    _pool()


def hashable(dtype_name: str) -> bool:
    return dtypes.get(dtype_name).is_float


def _as_float32(chunk: np.ndarray, buf: np.ndarray | None = None) -> np.ndarray:
    """A 1-d float32 view/copy of a chunk of a float group's values (``buf``: optional uint32 scratch)."""
    dt = chunk.dtype
    if dt == np.float32:
        return chunk
    if dt.kind == "c":
        return _as_float32(chunk.view(np.float32 if dt.itemsize == 8 else np.float64), buf)
    if dt.itemsize == 2 and dt.name == "bfloat16":
        # bfloat16 is the top half of a float32: widen by shifting the bits in place, much faster than a cast
        wide = buf[:chunk.size] if buf is not None and buf.size >= chunk.size else np.empty(chunk.size, np.uint32)
        np.copyto(wide, chunk.view(np.uint16))
        wide <<= 16
        return wide.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # float64 beyond float32's range -> inf: no signature
        return chunk.astype(np.float32)


def fold(values: np.ndarray) -> np.ndarray:
    """Sign-alternated sum of the rows of ``values`` laid out in rows of POOL (float64, length POOL)."""
    flat = values.reshape(-1)
    if flat.dtype.kind == "c":
        flat = flat.view(np.float32 if flat.dtype.itemsize == 8 else np.float64)
    acc = np.zeros(POOL, dtype=np.float64)
    n = flat.size
    full = n // POOL
    step = _ROWS_PER_CHUNK
    buf = np.empty(min(full, step) * POOL, np.uint32) if flat.dtype.name == "bfloat16" and full else None
    for r0 in range(0, full, step):
        r1 = min(full, r0 + step)
        rows = _as_float32(flat[r0 * POOL:r1 * POOL], buf).reshape(r1 - r0, POOL)
        # rows r0, r0+2, ... get +1 when r0 is even
        even, odd = rows[0::2].sum(axis=0, dtype=np.float64), rows[1::2].sum(axis=0, dtype=np.float64)
        if r0 % 2 == 0:
            acc += even
            acc -= odd
        else:
            acc -= even
            acc += odd
    rem = n - full * POOL
    if rem:
        tail = _as_float32(flat[full * POOL:]).astype(np.float64)
        if full % 2:
            acc[:rem] -= tail
        else:
            acc[:rem] += tail
    return acc


def signature(values: np.ndarray) -> list[int] | None:
    """The K-integer E2LSH signature of a float array (see :func:`hashable`), or None when it has NaN/Inf."""
    # the fold of a group shorter than the pool is zero beyond its length: those terms add exactly nothing
    # (einsum sums over p in order: the same bits), and a bias or norm vector costs 20 µs instead of 0.6 ms
    used = min(POOL, values.size * (2 if values.dtype.kind == "c" else 1))
    with np.errstate(over="ignore", invalid="ignore"):
        # not BLAS: no thread pool, same result everywhere
        proj = np.einsum("pk,p->k", _pool()[:used], fold(values)[:used])
    if not np.all(np.isfinite(proj)):
        return None
    return [int(v) for v in np.rint(proj / BUCKET_WIDTH)]


def l2norm(values: np.ndarray) -> float:
    """Euclidean norm of a float group's values (as float32 values, accumulated in float64), in chunks."""
    flat = values.reshape(-1)
    if flat.dtype.kind == "c":
        flat = flat.view(np.float32 if flat.dtype.itemsize == 8 else np.float64)
    total = 0.0
    chunk = POOL * _ROWS_PER_CHUNK
    for s in range(0, flat.size, chunk):
        c = _as_float32(flat[s:s + chunk])
        total += float(np.dot(c, c))
    return math.sqrt(total)


def estimated_distance(a: list[int], b: list[int]) -> float:
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return BUCKET_WIDTH * float(np.sqrt(np.dot(d, d) / len(d)))


def maybe_close(new_sig: list[int] | None, old_sig: list[int] | None, numel: int, norm: float,
                rtol: float, atol: float) -> bool:
    """False only when the signatures show the values are too far apart for allclose(rtol, atol) to hold.

    Missing signatures (NaN/Inf values, another LSH family) give True: the caller must compare exactly.
    """
    if new_sig is None or old_sig is None or len(new_sig) != len(old_sig):
        return True
    allowed = atol * math.sqrt(numel) + rtol * norm
    return estimated_distance(new_sig, old_sig) <= SLACK * allowed + 2 * BUCKET_WIDTH
