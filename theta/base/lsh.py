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

_ROWS_PER_CHUNK = 64  # rows per block of the fold (each block's even and odd rows summed apart, then folded in)


_drawing = threading.Lock()  # one thread draws the directions; one asking meanwhile waits for them


@lru_cache(maxsize=1)
def _drawn() -> np.ndarray:
    return np.random.RandomState(SEED).standard_normal((POOL, K))


def _pool() -> np.ndarray:
    with _drawing:
        return _drawn()


def directions() -> None:
    """Have the family's random directions now (drawn once per process), e.g. on a thread of their own while the
    first group is read."""
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
    wide = buf[:chunk.size] if buf is not None and buf.size >= chunk.size else np.empty(chunk.size, np.uint32)
    if dt.itemsize == 2 and dt.name == "bfloat16":
        # bfloat16 is the top half of a float32: widen by shifting the bits in place, much faster than a cast
        np.copyto(wide, chunk.view(np.uint16))
        wide <<= 16
        return wide.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # float64 beyond float32's range -> inf: no signature
        np.copyto(wide.view(np.float32), chunk, casting="unsafe")
    return wide.view(np.float32)


def _row_squares(values: np.ndarray, wide: np.ndarray) -> float:
    """Σ x² of one row of POOL values (or of the last, shorter one) given as ``values`` and as float32 (``wide``):
    a float32 dot product (float64 values: a float64 one of the values themselves, not rounded)."""
    x = values if values.dtype == np.float64 else wide
    return float(np.dot(x, x))


class Folder:
    """:func:`fold` of a group given piece by piece, in order (each piece but the last a whole number of rows of
    POOL values): the same bits as the fold of the whole, so a group streamed frame by frame gets the signature
    it would get read whole. Rows are folded one at a time, in blocks of _ROWS_PER_CHUNK: each block's even and
    odd rows summed in order, then added to and subtracted from the fold.

    While a row is at hand as float32 (in cache), its sum of squares is taken too (:attr:`squares`: each row's
    float32 dot product, added in float64 in order; the same bits as :func:`squares` of the whole): the value's
    norm costs no pass of its own."""

    def __init__(self) -> None:
        self.acc = np.zeros(POOL, dtype=np.float64)
        self.rows = 0                    # rows folded so far
        self.squares = 0.0               # Σ x² of the values folded so far (see :func:`squares`)
        self._open: list | None = None   # [even, odd] sums of the block being filled row by row
        self._ended = False              # a piece that was not whole rows came: it was the last
        self._buf: np.ndarray | None = None  # a row widened to float32 (uint32 scratch, reused)

    def add(self, values: np.ndarray) -> None:
        """Fold the next values of the group (any float dtype, flat or not; complex as (re, im) pairs)."""
        with np.errstate(over="ignore", invalid="ignore"):  # NaN/Inf or float64 beyond float32: no signature
            self._add(values)

    def _add(self, values: np.ndarray) -> None:
        flat = values.reshape(-1)
        if flat.dtype.kind == "c":
            flat = flat.view(np.float32 if flat.dtype.itemsize == 8 else np.float64)
        if flat.size and self._ended:
            raise ValueError("Folder.add after a piece that was not a whole number of rows")
        if self._buf is None and flat.dtype != np.float32:
            self._buf = np.empty(POOL, np.uint32)
        full = flat.size // POOL
        for i in range(full):
            row = flat[i * POOL:(i + 1) * POOL]
            wide = _as_float32(row, self._buf)
            self.squares += _row_squares(row, wide)
            if self._open is None:
                self._open = [np.zeros(POOL, dtype=np.float64), np.zeros(POOL, dtype=np.float64)]
            target = self._open[self.rows % 2]
            np.add(target, wide, out=target)
            self.rows += 1
            if self.rows % _ROWS_PER_CHUNK == 0:
                self._close_block()
        rem = flat.size - full * POOL
        if rem:
            self._close_block()
            piece = flat[full * POOL:]
            wide = _as_float32(piece, self._buf)
            self.squares += _row_squares(piece, wide)
            tail = wide.astype(np.float64)
            if self.rows % 2:
                self.acc[:rem] -= tail
            else:
                self.acc[:rem] += tail
            self._ended = True

    def _close_block(self) -> None:
        if self._open is not None:
            self.acc += self._open[0]
            self.acc -= self._open[1]
            self._open = None

    def result(self) -> np.ndarray:
        """The fold (float64, length POOL)."""
        self._close_block()
        return self.acc


class PieceFolder:
    """:class:`Folder` of a group given in pieces of any length, in order: whole rows are folded as they come,
    the start of a row waits for its rest. The same fold as the group read whole."""

    def __init__(self) -> None:
        self.folder = Folder()
        self._carry: np.ndarray | None = None

    def add(self, values: np.ndarray) -> None:
        flat = values.reshape(-1)
        if flat.dtype.kind == "c":
            flat = flat.view(np.float32 if flat.dtype.itemsize == 8 else np.float64)
        if self._carry is not None:
            flat = np.concatenate([self._carry, flat])
            self._carry = None
        whole = flat.size - flat.size % POOL
        if whole:
            self.folder.add(flat[:whole])
        if whole < flat.size:
            self._carry = flat[whole:].copy()

    def result(self) -> np.ndarray:
        if self._carry is not None:
            self.folder.add(self._carry)
            self._carry = None
        return self.folder.result()


def fold(values: np.ndarray) -> np.ndarray:
    """Sign-alternated sum of the rows of ``values`` laid out in rows of POOL (float64, length POOL)."""
    f = Folder()
    f.add(values)
    return f.result()


def signature_of_fold(folded: np.ndarray, size: int) -> list[int] | None:
    """The signature of a group of ``size`` values (complex: 2 per element) from its :func:`fold`."""
    # the fold of a group shorter than the pool is zero beyond its length: those terms add exactly nothing
    # (einsum sums over p in order: the same bits), and a bias or norm vector costs 20 µs instead of 0.6 ms
    used = min(POOL, size)
    with np.errstate(over="ignore", invalid="ignore"):
        # not BLAS: no thread pool, same result everywhere
        proj = np.einsum("pk,p->k", _pool()[:used], folded[:used])
    if not np.all(np.isfinite(proj)):
        return None
    return [int(v) for v in np.rint(proj / BUCKET_WIDTH)]


def signature(values: np.ndarray) -> list[int] | None:
    """The K-integer E2LSH signature of a float array (see :func:`hashable`), or None when it has NaN/Inf."""
    return signed(values)[0]


def signed(values: np.ndarray) -> tuple[list[int] | None, float]:
    """:func:`signature` and :func:`squares` of a float array, from one pass over it (:class:`Folder`)."""
    f = Folder()
    f.add(values)
    return signature_of_fold(f.result(), values.size * (2 if values.dtype.kind == "c" else 1)), f.squares


def squares(values: np.ndarray) -> float:
    """Sum of the squares of a float group's values, row by row of POOL values as :class:`Folder` takes them
    (each row's float32 dot product, float64 for float64 values, added in float64): the bits of
    ``Folder.squares``, computed alone. Its square root is the norm :func:`maybe_close` is given. A sum past
    float32's range is inf: a norm only widens maybe_close's bound, so an inf one costs an exact comparison,
    never a wrong reuse."""
    flat = values.reshape(-1)
    if flat.dtype.kind == "c":
        flat = flat.view(np.float32 if flat.dtype.itemsize == 8 else np.float64)
    buf = None if flat.dtype == np.float32 else np.empty(min(POOL, flat.size), np.uint32)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(0, flat.size, POOL):
            row = flat[s:s + POOL]
            total += _row_squares(row, _as_float32(row, buf))
    return total


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
