"""rows: a group whose rows (first dimension) were removed, reordered, duplicated or appended.

Trimming an embedding vocabulary keeps most rows of the previous value unchanged: only which previous
row each new row comes from needs storing, plus the rows that are genuinely new. Rows are matched by
their raw bytes, so the result is exact bit for bit.

Stored parts: ``source`` (per new row: the index of the previous row it copies, or -1 for a new row),
delta-coded as ``source_gaps`` (int32; int64 beyond 2**31 rows) so that runs of kept rows compress to
almost nothing, and ``extra`` (the genuinely new rows, in order, in the group's dtype).
Params: ``rows`` (new row count).
"""
from __future__ import annotations

import hashlib

import numpy as np

from theta.base.errors import UpdateTypeError
from theta.storage.codec import LazyArray, decode_parts_of
from theta.updates import Encoded
from theta.updates.bounds import check_parts_fit

_MOVE_ROWS = 4096  # rows moved per block (a copy of them is the only temporary)


def row_bytes(arr: np.ndarray) -> np.ndarray:
    """(rows, bytes per row) uint8 view of a C-contiguous array."""
    arr = np.ascontiguousarray(arr)
    return arr.reshape(arr.shape[0], -1).view(np.uint8).reshape(arr.shape[0], -1) if arr.shape[0] else \
        np.zeros((0, 0), np.uint8)


COMPARE_BYTES = 16 << 20  # rows compared per chunk: bounds the temporary of the comparison


def _words(rows: np.ndarray) -> np.ndarray:
    """The same rows viewed as the widest unsigned ints dividing a row (8x fewer elements to compare)."""
    width = rows.shape[1]
    for t in (np.uint64, np.uint32, np.uint16):
        if width and width % np.dtype(t).itemsize == 0:
            return rows.view(t)
    return rows


def rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, whether two (rows, bytes) uint8 arrays of the same shape hold identical bytes."""
    a, b = _words(a), _words(b)
    out = np.empty(a.shape[0], dtype=bool)
    step = max(1, COMPARE_BYTES // max(1, a.shape[1] * a.itemsize))
    for i in range(0, a.shape[0], step):
        np.all(a[i:i + step] == b[i:i + step], axis=1, out=out[i:i + step])
    return out


def find_sources(new: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """For each row of ``new``, the index of a bit-identical row of ``previous`` (or -1)."""
    new_rows, prev_rows = row_bytes(new), row_bytes(previous)
    k = min(new.shape[0], previous.shape[0])
    # fast path: a kept prefix (vocabulary trimmed at the end) needs no hashing
    same = rows_equal(new_rows[:k], prev_rows[:k])
    sources = np.full(new.shape[0], -1, dtype=np.int64)
    sources[:k][same] = np.flatnonzero(same)
    if same.all() and new.shape[0] <= previous.shape[0]:
        return sources
    index: dict[bytes, int] = {}
    for i in range(prev_rows.shape[0] - 1, -1, -1):  # first occurrence wins
        index[hashlib.blake2b(prev_rows[i].tobytes(), digest_size=16).digest()] = i
    for i in np.flatnonzero(sources < 0):
        j = index.get(hashlib.blake2b(new_rows[i].tobytes(), digest_size=16).digest())
        if j is not None and np.array_equal(prev_rows[j], new_rows[i]):  # guard against a digest collision
            sources[i] = j
    return sources


def encode_sources(sources: np.ndarray) -> np.ndarray:
    gaps = np.empty_like(sources)
    if sources.size:
        gaps[0] = sources[0]
        np.subtract(sources[1:], sources[:-1], out=gaps[1:])
    # int32 whenever it fits (any group under 2**31 rows): zstd packs runs of 32-bit words far tighter
    # (a 30000-row trim: 120 bytes instead of 7.6 KB); apply reads any integer width
    info = np.iinfo(np.int32)
    if not gaps.size or (gaps.min() >= info.min and gaps.max() <= info.max):
        return gaps.astype(np.int32)
    return gaps


def _gathered_rows(new: np.ndarray, picked: np.ndarray):
    """``new[picked]`` (rows) as a :class:`theta.storage.codec.LazyArray` read frame by frame."""
    per_row = int(np.prod(new.shape[1:], dtype=np.int64))
    rows2 = new.reshape(new.shape[0], per_row)

    def read(a: int, b: int) -> np.ndarray:
        if per_row == 0:
            return np.empty(0, new.dtype)
        first, last = a // per_row, -(-b // per_row)
        block = rows2[picked[first:last]].reshape(-1)
        return block[a - first * per_row:b - first * per_row]

    return LazyArray(new.dtype, (int(picked.size),) + tuple(new.shape[1:]), read)


class RowsUpdate:
    name = "rows"
    incremental = True

    def encode(self, new: np.ndarray, previous: np.ndarray | None, **options) -> Encoded | None:
        if (previous is None or previous.dtype != new.dtype or new.ndim == 0 or previous.ndim != new.ndim
                or previous.shape[1:] != new.shape[1:]):
            return None
        sources = find_sources(new, previous)
        if np.all(sources < 0):
            return None  # nothing shared: a dense value is simpler
        new = np.ascontiguousarray(new)
        picked = np.flatnonzero(sources < 0)
        # lazy: the new rows gathered frame by frame while the blob is written (``new`` must stay unchanged
        # until then), instead of a copy of them beside new and previous
        extra = _gathered_rows(new, picked) if options.get("lazy") else new[picked]
        return Encoded(parts={"source_gaps": encode_sources(sources), "extra": extra},
                       params={"rows": int(new.shape[0])})

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        if previous is None:
            raise UpdateTypeError("rows update needs the previous value of its group")
        if "source_gaps" not in parts or "extra" not in parts:
            raise UpdateTypeError(f"rows update is missing parts (has {sorted(parts)}, needs source_gaps and extra)")
        sources = np.cumsum(np.asarray(parts["source_gaps"], dtype=np.int64))
        extra = parts["extra"]
        new_mask = sources < 0
        if (sources.size and sources.max() >= previous.shape[0]) or extra.shape[0] != int(new_mask.sum()) \
                or extra.shape[1:] != previous.shape[1:]:
            raise UpdateTypeError(f"rows update does not fit a previous value of shape {previous.shape}")
        out = np.empty((sources.size,) + previous.shape[1:], dtype=previous.dtype)
        kept = np.flatnonzero(~new_mask)
        for a in range(0, kept.size, _MOVE_ROWS):  # in blocks: the gathered rows are the only temporary
            dest = kept[a:a + _MOVE_ROWS]
            out[dest] = previous[sources[dest]]
        out[new_mask] = extra.astype(previous.dtype, copy=False)
        return out

    def apply_blob(self, blobs: dict, params: dict, previous: np.ndarray | None, in_place: bool) -> np.ndarray:
        """:meth:`apply` from the step's part blobs. When ``in_place`` and no row moves backwards (each kept
        row comes from the same or a later row, in order, and the value does not grow: a trim, rows deleted),
        the rows are moved within ``previous`` and the result is a view of its first rows: no second value."""
        parts = decode_parts_of(blobs)
        if not (in_place and previous is not None and previous.ndim >= 1 and previous.flags.writeable
                and previous.flags.c_contiguous and "source_gaps" in parts and "extra" in parts):
            return self.apply(parts, params, previous)
        sources = np.cumsum(np.asarray(parts["source_gaps"], dtype=np.int64))
        n, m = sources.size, previous.shape[0]
        kept = np.flatnonzero(sources >= 0)
        if n > m or (kept.size and (np.any(sources[kept] < kept) or np.any(np.diff(sources[kept]) <= 0))):
            return self.apply(parts, params, previous)
        extra = parts["extra"]
        new_mask = sources < 0
        if (kept.size and sources[kept[-1]] >= m) or extra.shape[0] != int(new_mask.sum()) \
                or extra.shape[1:] != previous.shape[1:]:
            raise UpdateTypeError(f"rows update does not fit a previous value of shape {previous.shape}")
        moved = kept[sources[kept] != kept]
        # blocks of rows in increasing order: a block reads rows at or after the ones it writes, and later blocks
        # read rows after every row this one writes, so nothing is overwritten before it is read
        for a in range(0, moved.size, _MOVE_ROWS):
            dest = moved[a:a + _MOVE_ROWS]
            previous[dest] = previous[sources[dest]]
        previous[new_mask[:n].nonzero()[0]] = extra.astype(previous.dtype, copy=False)
        return previous[:n]


def apply_grown(blobs: dict, params: dict, room: np.ndarray, previous: np.ndarray) -> np.ndarray | None:
    """A rows step that grows ``previous`` (the C-contiguous start of the buffer ``room``), applied in ``room``:
    the result is a view of its start, and ``previous`` is overwritten. Possible when the kept rows keep their
    order and none moves to an earlier position (rows appended or inserted: the positional step of a group
    grown and fine-tuned in one commit). None when the step does not grow the value, does not fit ``room`` or
    moves rows otherwise (the caller applies it as usual)."""
    check_parts_fit(blobs, previous, "rows", room.nbytes)
    parts = decode_parts_of(blobs)
    if "source_gaps" not in parts or "extra" not in parts or previous.ndim < 1:
        return None
    sources = np.cumsum(np.asarray(parts["source_gaps"], dtype=np.int64))
    n, m = sources.size, previous.shape[0]
    kept = np.flatnonzero(sources >= 0)
    extra, new_mask = parts["extra"], sources < 0
    out_bytes = n * (previous.nbytes // m if m else 0)
    if (n <= m or m == 0 or out_bytes > room.nbytes or extra.shape[0] != int(new_mask.sum())
            or extra.shape[1:] != previous.shape[1:]):
        return None
    if kept.size and (sources[kept[-1]] >= m or np.any(sources[kept] > kept) or np.any(np.diff(sources[kept]) <= 0)):
        return None
    out = room[:out_bytes].view(previous.dtype).reshape((n,) + previous.shape[1:])
    moved = kept[sources[kept] != kept]
    # blocks from the last row down: a block writes rows after every row it or a later block reads (each
    # kept row comes from the same or an earlier position), so nothing is overwritten before it is read
    for b in range(moved.size, 0, -_MOVE_ROWS):
        dest = moved[max(0, b - _MOVE_ROWS):b]
        out[dest] = out[sources[dest]]
    out[new_mask.nonzero()[0]] = extra.astype(previous.dtype, copy=False)
    return out


