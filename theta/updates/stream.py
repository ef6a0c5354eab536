"""A group's value in blocks of elements, in order, without ever holding the whole value.

A merge reads ours, theirs and the ancestor side by side; rebuilding the three (plus the result) would cost
four groups of memory. A :class:`GroupSource` instead yields the value block by block: the chain's dense first
step is decoded frame by frame, and each later ``delta`` (code words) or ``sparse`` step is applied to the block
from its own blob, also frame by frame. Memory: one block and a few codec frames per step, whatever the group's
size. Each pass re-reads the blobs (the page cache keeps them); the first complete pass checks the value's
hash against the group's name, in the name's algorithm (theta.base.valuehash; ChainError at its end, before anything
built on it is stored).

``ia3`` and ``low-rank`` steps stream too: the block is scaled by the vector's elements at its positions, or
``R @ C`` of the rows the block covers is added to it (the same per-element arithmetic as the whole-value
``apply``, so the same bits), then their fixes are applied like a sparse step's. A *positional* ``rows`` step
(the rows before it kept in place, cut or followed by appended rows: a trim, a growth) streams as well: the
steps before it cover the start of each block, its appended rows the rest. Chains with other ``rows`` steps
(rows moved), a change of dtype or delta blobs of the old ``planes`` layout are read by position
(:class:`PositionalSource`, at the end of this module): the same blocks, a block per step and a frame per blob
in memory.
"""
from __future__ import annotations

import bisect
import itertools
import threading
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from zipslice import dtypes

from theta.base import valuehash
from theta.base.errors import ChainError, IntegrityError, MergeError, MetadataError, UpdateTypeError
from theta.storage import codec
from theta.updates import DTYPE_KEY, bounds, step_layout
from theta.updates.delta import OPS, _uncombine, from_planes, raw_words
from theta.updates.ia3 import check_vector, compute_dtype
from theta.updates.low_rank import Factors, add_low_rank, check_factors

if TYPE_CHECKING:
    from theta.storage.metadata import GroupMeta
    from theta.storage.store import LfsStore

STREAMED_STEPS = ("delta", "sparse", "ia3", "low-rank", "rows")
BLOCK = 1 << 20  # elements per block of a pass over a whole value (a squash, a check): 4 MiB of float32


class _Cursor:
    """The elements of an array blob in order, any number at a time (frames decoded a few ahead)."""

    def __init__(self, blob: memoryview, zeros: bool = False):
        _, shape = codec.array_info(blob)
        self.size = int(np.prod(shape, dtype=np.int64))
        # one frame decoded ahead per cursor: a merge reads a cursor per step of each of its three chains, and
        # the codec's default (2 per thread) would hold ~5 frames per cursor, so a merge of 8-step chains would
        # exceed its memory bound on frames alone; the cursors together keep the threads busy. ``zeros``: a
        # frame of zeros is taken as a read-only run (codec.is_zero_run), never decoded
        self._frames = codec.iter_decode_array(blob, ahead=1, zeros=zeros)
        self._frame = np.empty(0)
        self._at = 0

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` elements (fresh memory or a slice of a frame nothing else uses)."""
        pieces = []
        while n > 0:
            if self._at == self._frame.size:
                try:
                    _, self._frame = next(self._frames)
                except StopIteration:
                    raise IntegrityError("a blob holds fewer elements than its step needs") from None
                self._at = 0
            k = min(n, self._frame.size - self._at)
            pieces.append(self._frame[self._at:self._at + k])
            self._at += k
            n -= k
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else self._frame[:0]

    def close(self) -> None:
        self._frames.close()


class _Delta:
    def __init__(self, blobs: dict, params: dict, word: np.dtype, size: int):
        op = params.get("op")
        if op not in OPS or "codes" not in blobs:
            raise UpdateTypeError(f"delta step is malformed for streaming (op {op!r}, parts {sorted(blobs)})")
        dt, shape = codec.array_info(blobs["codes"])
        if dt != word or int(np.prod(shape, dtype=np.int64)) != size:
            raise UpdateTypeError(f"delta codes are {list(shape)} x {dt}, expected {size} x {word}")
        # a code of 0 leaves the word as it was, except in split codes (their low bits are stored whole): the
        # unchanged frames of a partial change (a few rows of a 1 GB embedding) are skipped, not decoded
        self.op, self.codes = op, _Cursor(blobs["codes"], zeros=not op.startswith("split"))

    def apply(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        codes = self.codes.take(words.size)
        if not codec.is_zero_run(codes):
            _uncombine(codes, words, self.op, out=words)

    def close(self) -> None:
        self.codes.close()


class _Sparse:
    """Sorted flat indices (``gaps``: first index, then differences) and their new values, consumed as blocks
    pass."""

    def __init__(self, blobs: dict, value_dtype: np.dtype, size: int):
        if "gaps" not in blobs or "values" not in blobs:
            raise UpdateTypeError(f"sparse update is missing parts (has {sorted(blobs)}, needs gaps and values)")
        self.gaps, self.values = _Cursor(blobs["gaps"]), _Cursor(blobs["values"])
        if self.gaps.size != self.values.size or self.gaps.size > size:
            raise UpdateTypeError(f"sparse update does not fit a group of {size} elements "
                                  f"({self.gaps.size} indices, {self.values.size} values)")
        self.value_dtype, self.size = value_dtype, size
        self.left = self.gaps.size
        self.carry = 0
        self.idx = np.empty(0, np.int64)
        self.val = np.empty(0, value_dtype)

    def apply(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        end = start + block.size
        while (self.idx.size == 0 or self.idx[-1] < end) and self.left:
            m = min(self.left, 1 << 20)
            idx = np.cumsum(self.gaps.take(m), dtype=np.int64)
            idx += self.carry
            self.carry = int(idx[-1])
            self.idx = np.concatenate([self.idx, idx])
            self.val = np.concatenate([self.val, self.values.take(m).astype(self.value_dtype, copy=False)])
            self.left -= m
        cut = int(np.searchsorted(self.idx, end, side="left"))
        here, vals = self.idx[:cut], self.val[:cut]
        if here.size and (here[0] < start or here[-1] >= self.size):
            raise UpdateTypeError(f"sparse update indices are not increasing within a group of {self.size} elements")
        block[here - start] = vals
        self.idx, self.val = self.idx[cut:], self.val[cut:]
        if end >= self.size and (self.idx.size or self.left):
            raise UpdateTypeError(f"sparse update has indices beyond a group of {self.size} elements")

    def close(self) -> None:
        self.gaps.close()
        self.values.close()


class _Fixes:
    """The ``fix_gaps``/``fix_values`` of a low-rank or ia3 step, applied as blocks pass (a sparse step's)."""

    def __init__(self, blobs: dict, value_dtype: np.dtype, size: int):
        has = "fix_gaps" in blobs, "fix_values" in blobs
        if has[0] != has[1]:
            raise UpdateTypeError(f"update fixes are incomplete (parts {sorted(blobs)})")
        self.sparse = _Sparse({"gaps": blobs["fix_gaps"], "values": blobs["fix_values"]}, value_dtype, size) \
            if has[0] else None

    def apply(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        if self.sparse is not None:
            self.sparse.apply(block, words, start)

    def close(self) -> None:
        if self.sparse is not None:
            self.sparse.close()


def _small_part(blobs: dict, name: str, limit: int) -> np.ndarray:
    """A step's part decoded whole, after checking it is at most ``limit`` elements (a factor or a vector)."""
    if name not in blobs:
        raise UpdateTypeError(f"the step is missing its part {name!r} (has {sorted(blobs)})")
    _, shape = codec.array_info(blobs[name])
    if int(np.prod(shape, dtype=np.int64)) > limit:
        raise UpdateTypeError(f"part {name!r} of shape {list(shape)} is larger than its group")
    return codec.decode_array(blobs[name])


class _IA3:
    """new = previous * ia3 (broadcast), block by block: the vector's elements at the block's positions."""

    def __init__(self, blobs: dict, dtype: np.dtype, shape: tuple):
        vec = _small_part(blobs, "ia3", max(1, int(np.prod(shape, dtype=np.int64))))
        problem = check_vector(shape, vec)
        if problem:
            raise UpdateTypeError(f"ia3 update: {problem}")
        self.cdt, self.dtype, self.shape = compute_dtype(dtype), dtype, shape
        self.vec = vec.astype(self.cdt)
        self.per_row = max(1, int(np.prod(shape[1:], dtype=np.int64))) if shape else 1
        self.by_row = bool(shape) and self.vec.ndim == len(shape) and self.vec.shape[0] != 1
        self.fixes = _Fixes(blobs, dtype, int(np.prod(shape, dtype=np.int64)))

    def apply(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        end = start + block.size
        if not self.shape:
            factors = np.broadcast_to(self.vec, ()).reshape(1)
        else:
            r0, r1 = start // self.per_row, -(-end // self.per_row)
            rows = self.vec[r0:r1] if self.by_row else self.vec
            factors = np.broadcast_to(rows, (r1 - r0,) + tuple(self.shape[1:])).reshape(-1)
            factors = factors[start - r0 * self.per_row:end - r0 * self.per_row]
        block[...] = (block.astype(self.cdt) * factors).astype(self.dtype)  # as ia3.scale, element by element
        self.fixes.apply(block, words, start)

    def close(self) -> None:
        self.fixes.close()


class _LowRank:
    """new = previous + R @ C, block by block: the rows the block covers (low_rank.add_low_rank's arithmetic)."""

    def __init__(self, blobs: dict, dtype: np.dtype, shape: tuple):
        if len(shape) < 2:
            raise UpdateTypeError(f"a group of shape {list(shape)} has no low-rank form")
        size = int(np.prod(shape, dtype=np.int64))
        self.R, self.C = _small_part(blobs, "R", size), _small_part(blobs, "C", size)
        problem = check_factors(shape, self.R, self.C)
        if problem:
            raise UpdateTypeError(f"low-rank update: {problem}")
        self.factors = Factors(shape, self.R, self.C)
        self.dtype, self.cols = dtype, self.factors.cols
        self.fixes = _Fixes(blobs, dtype, size)

    def apply(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        end, cols = start + block.size, self.cols
        r0, r1 = start // cols, -(-end // cols)
        rows = np.zeros((r1 - r0, cols), self.dtype)  # each element's sum depends on its own previous value only
        at = start - r0 * cols
        rows.reshape(-1)[at:at + block.size] = block
        value = add_low_rank(rows, self.R, self.C, out=rows, factors=self.factors, first_row=r0)
        block[...] = value.reshape(-1)[at:at + block.size]
        self.fixes.apply(block, words, start)

    def close(self) -> None:
        self.fixes.close()


def positional_rows(blobs: dict, rows_before: int) -> tuple[int, int] | None:
    """(rows kept, rows appended) of a ``rows`` step that keeps the first rows of the value before it in place
    and appends new ones (a trim, a growth: what a commit that resizes AND changes a group stores), else None."""
    if "source_gaps" not in blobs or "extra" not in blobs:
        return None
    gaps = codec.decode_array(blobs["source_gaps"]).astype(np.int64, copy=False).reshape(-1)
    sources = np.cumsum(gaps)
    n = sources.size
    kept = min(n, rows_before)
    if not (np.array_equal(sources[:kept], np.arange(kept)) and np.all(sources[kept:] == -1)):
        return None
    return kept, n - kept


class _Rows:
    """A positional ``rows`` step: the value before it, cut or followed by the appended rows (``extra``)."""

    def __init__(self, blobs: dict, rows_before: int, per_row: int, size_after: int):
        got = positional_rows(blobs, rows_before)
        if got is None:
            raise UpdateTypeError("rows step does not keep the rows before it in place")
        kept, added = got
        self.extra = _Cursor(blobs["extra"])
        if self.extra.size != added * per_row or (kept + added) * per_row != size_after:
            raise UpdateTypeError(f"rows step appends {self.extra.size} elements, expected {added * per_row}")
        self.first_new = kept * per_row  # flat index of the first appended element

    def fill(self, block: np.ndarray, start: int, length: int) -> None:
        """Write the appended elements that fall in ``block[:length]`` (block starts at flat index ``start``)."""
        lo = max(0, self.first_new - start)
        if lo < length:
            block[lo:length] = self.extra.take(length - lo)

    def close(self) -> None:
        self.extra.close()


class _Source:
    """What both block readers of a group's value share: its shape, dtype and size, and whether a complete
    pass has checked it against the group's hash (later passes are not hashed again)."""

    def __init__(self, group: "GroupMeta", store: "LfsStore", file: str | None = None):
        self.group, self.store, self.file = group, store, file
        self.dtype = dtypes.get(group.dtype).to_numpy()
        self.shape = tuple(group.shape)
        self.size = group.numel
        self.checked = False


class GroupSource(_Source):
    """The value of a group whose chain is a dense step followed by delta/sparse/ia3/low-rank steps, block by block.

    ``shape``, ``dtype`` and ``size`` are the value's; :meth:`chunks` yields ``(slice, flat block)`` in order
    and may be called again for another pass. A block is fresh memory the caller may keep or modify.
    ``on_step(i, values)``, when given, sees the values of step ``i``'s value in the block as each step is applied
    (every step's value in order, in one pass: how a check hashes each step's value)."""

    def chunks(self, n: int, on_step=None) -> Iterator[tuple[slice, np.ndarray]]:
        g, steps = self.group, self.group.steps
        word = raw_words(np.empty(1, self.dtype)).dtype
        per = raw_words(np.empty(1, self.dtype)).size  # words per element (complex128: 2)
        h = None if self.checked else valuehash.like(g.hash)
        with ExitStack() as stack:
            i = 0
            try:
                blobs = [codec.part_blobs(stack.enter_context(self.store.mapped(s.blob, group=g.name, file=self.file)))
                         for s in steps]
                if set(blobs[0]) != {"values"}:
                    raise UpdateTypeError(f"dense step has parts {sorted(blobs[0])}, expected values")
                shapes = [step_layout(s, g)[1] for s in steps]
                sizes = [int(np.prod(sh, dtype=np.int64)) for sh in shapes]
                dt, shape = codec.array_info(blobs[0]["values"])
                if dt != self.dtype or int(np.prod(shape, dtype=np.int64)) != sizes[0]:
                    raise UpdateTypeError(f"dense step holds {list(shape)} x {dt}, its layout is "
                                          f"{list(shapes[0])} x {self.dtype}")
                first = _Cursor(blobs[0]["values"])
                stack.callback(first.close)
                later = []
                for i, (s, b) in enumerate(zip(steps[1:], blobs[1:]), start=1):
                    shape = shapes[i]
                    if s.type == "delta":
                        ap = _Delta(b, s.params, word, sizes[i] * per)
                    elif s.type == "ia3":
                        ap = _IA3(b, self.dtype, shape)
                    elif s.type == "low-rank":
                        ap = _LowRank(b, self.dtype, shape)
                    elif s.type == "rows":
                        ap = _Rows(b, shapes[i - 1][0], int(np.prod(shape[1:], dtype=np.int64)), sizes[i])
                    else:
                        ap = _Sparse(b, self.dtype, sizes[i])
                    stack.callback(ap.close)
                    later.append(ap)
                for start in range(0, self.size, n):
                    m = min(n, self.size - start)
                    i = 0
                    # the value of step k covers [start, start + length(k)) of this block: a chain that trims or
                    # grows (positional rows steps) has steps shorter or longer than the value
                    length = [max(0, min(m, size - start)) for size in sizes]
                    block = np.empty(m, self.dtype)  # ours to update in place
                    block[:length[0]] = first.take(length[0])
                    words = raw_words(block)
                    if on_step is not None:
                        on_step(0, block[:length[0]])
                    for i, ap in enumerate(later, start=1):
                        if isinstance(ap, _Rows):
                            ap.fill(block, start, length[i])
                        elif length[i]:
                            ap.apply(block[:length[i]], words[:length[i] * per], start)
                        if on_step is not None:
                            on_step(i, block[:length[i]])
                    if h is not None:
                        h.update(dtypes.le_bytes(block))
                    yield slice(start, start + m), block
            except (IntegrityError, UpdateTypeError, ValueError, TypeError, IndexError, OverflowError) as e:
                raise _step_failed(e, self.file, g, steps, i, "cannot be streamed") from None
        if h is not None:
            _check_rebuilt(h, self.file, g, steps)
            self.checked = True


def _step_failed(e: Exception, file, g, steps, i: int, how: str) -> Exception:
    """The error to raise for step ``i`` of ``g``'s chain failing while read block by block (located)."""
    if isinstance(e, IntegrityError):
        return bounds.located(e, file, g.name, i, steps[i].blob.oid)
    return ChainError(f"{bounds.where(file, g.name, i, steps[i].blob.oid)}: step {steps[i].type!r} {how}: {e}",
                      file=file, group=g.name, oid=steps[i].blob.oid)


def _check_rebuilt(h, file, g, steps) -> None:
    """The hash of every block read equals the group's recorded hash (in its algorithm), or ChainError."""
    if h.hexdigest() != g.hash:
        raise ChainError(f"{bounds.where(file, g.name, len(steps) - 1, steps[-1].blob.oid)}: the chain rebuilt a "
                         f"value whose hash differs from the recorded {g.hash}", file=file, group=g.name,
                         oid=steps[-1].blob.oid)


def source(group: "GroupMeta", store: "LfsStore", file: str | None = None) -> "GroupSource | PositionalSource | None":
    """A :class:`GroupSource` for ``group`` when its chain streams in one pass (checked from the metadata: a
    dense first step, then delta/sparse/ia3/low-rank steps and positional rows steps, all with the group's own
    dtype), else a :class:`PositionalSource` when it is read by position (rows moved, a change of dtype, old
    ``planes`` deltas), else None (rebuild it whole: a chain :func:`theta.updates.rebuild.reconstruct` reports)."""
    bounds.check_group(group, file)
    steps = group.steps
    if not steps or steps[0].type != "dense" or any(s.type not in STREAMED_STEPS for s in steps[1:]):
        return None
    if group.numel == 0:
        return None
    try:
        layouts = [step_layout(s, group) for s in steps]
        items = {dtypes.get(d).itemsize for d, _ in layouts}
    except (MetadataError, KeyError, ValueError):
        return None  # reconstruct reports it, located
    if not items <= {1, 2, 4, 8, 16}:
        return None
    shapes = [shape for _, shape in layouts]
    for before, after, s in zip(shapes, shapes[1:], steps[1:]):
        # only a rows step changes the layout, and only the number of rows
        if after != before and (s.type != "rows" or not before or len(after) != len(before) or after[1:] != before[1:]):
            return None
        if s.type in ("low-rank", "rows") and len(after) < (2 if s.type == "low-rank" else 1):
            return None
    if len(group.shape) < 2 and any(s.type == "low-rank" for s in steps):
        return None  # reconstruct reports the malformed chain, located
    if any(DTYPE_KEY in s.params for s in steps):
        return PositionalSource(group, store, file)
    try:
        for s, before in zip(steps[1:], shapes):
            if s.type not in ("rows", "delta"):
                continue
            with store.mapped(s.blob, group=group.name, file=file) as blob:
                parts = codec.part_blobs(blob)
                if s.type == "rows" and positional_rows(parts, before[0]) is None:
                    return PositionalSource(group, store, file)  # rows moved
                if s.type == "delta" and "codes" not in parts:
                    return PositionalSource(group, store, file)  # planes across the whole group
    except (IntegrityError, UpdateTypeError, ValueError):
        return None  # reconstruct reports it, located
    return GroupSource(group, store, file)


def blocks(x: Any, n: int) -> Iterator[tuple[slice, np.ndarray]]:
    """(slice, flat block) of an array or a :class:`GroupSource`, ``n`` elements at a time, in order."""
    if isinstance(x, np.ndarray):
        flat = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
        for start in range(0, flat.size, n):
            yield slice(start, min(flat.size, start + n)), flat[start:start + n]
    else:
        yield from x.chunks(n)


def side_by_side(inputs: "tuple | list", n: int) -> Iterator[tuple]:
    """The blocks of several inputs (arrays, sources, or None) side by side: ``(slice, block of each or None)``.
    Every source is read to its end (where it checks its value's hash), even when another ends first."""
    live = [i for i, x in enumerate(inputs) if x is not None]
    end = object()
    for row in itertools.zip_longest(*(blocks(inputs[i], n) for i in live), fillvalue=end):
        if end in row:
            raise MergeError("merge inputs of different sizes")
        got = dict(zip(live, row))
        yield (row[0][0], *(got[i][1] if i in got else None for i in range(len(inputs))))


# ---------------------------------------------------------------- chains read by position (rows moved, dtypes)
# A chain whose rows step moves rows (a vocabulary reordered, rows deleted in the middle), that changes dtype
# on the way or holds a delta blob of the old ``planes`` layout cannot be read in one sequential pass of
# cursors: the value before a moving rows step is needed at other positions than the block being built. The
# chain is read instead as levels, one per step, each giving any range of its value (``read(start, stop)``,
# flat elements, fresh memory) from the range(s) of the level below it that it needs: blobs are read through
# codec.ArrayReader (the frames a range covers, the last one kept), so reading in order decodes each frame
# about once, and memory stays at a block per level and a frame per blob, whatever the group's size.


class _SparseByPosition:
    """A sparse step's (or fixes') changes for any range of flat positions: the first index of each ``gaps``
    frame is found in one pass up front (memory: one number per frame), then a range decodes the gaps frames
    it covers and reads the matching values."""

    def __init__(self, gaps_blob, values_blob, value_dtype: np.dtype, size: int, what: str):
        self.gaps, self.values = codec.ArrayReader(gaps_blob), codec.ArrayReader(values_blob)
        if self.gaps.dtype.kind not in "iu" or self.gaps.size != self.values.size or self.gaps.size > size:
            raise UpdateTypeError(f"{what} does not fit a group of {size} elements ({self.gaps.size} "
                                  f"{self.gaps.dtype} indices, {self.values.size} values)")
        self.value_dtype, self.size, self.what = value_dtype, size, what
        self.firsts, self.bases, self.positions = [], [], []  # per frame: first index, index before, position
        last = 0
        for start, frame in codec.iter_decode_array(gaps_blob, ahead=1):
            idx = np.cumsum(frame, dtype=np.int64) + last
            if idx.size and (idx[0] < last or idx[-1] >= size or np.any(np.diff(idx) < 0)):
                raise UpdateTypeError(f"{what} indices are not increasing within a group of {size} elements")
            if idx.size:
                self.firsts.append(int(idx[0]))
                self.bases.append(last)
                self.positions.append(start)
                last = int(idx[-1])
        self._cached: tuple[int, np.ndarray] | None = None

    def _indices(self, f: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != f:
            start = self.positions[f]
            stop = self.positions[f + 1] if f + 1 < len(self.positions) else self.gaps.size
            self._cached = (f, np.cumsum(self.gaps.read(start, stop), dtype=np.int64) + self.bases[f])
        return self._cached[1]

    def apply(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        end = start + block.size
        f = max(0, bisect.bisect_right(self.firsts, start) - 1)
        while f < len(self.firsts) and self.firsts[f] < end:
            idx = self._indices(f)
            lo, hi = np.searchsorted(idx, start, "left"), np.searchsorted(idx, end, "left")
            if hi > lo:
                at = self.positions[f]
                block[idx[lo:hi] - start] = self.values.read(at + int(lo), at + int(hi)).astype(self.value_dtype,
                                                                                                copy=False)
            f += 1

    def close(self) -> None:
        pass


def _fixes_by_position(blobs: dict, dtype: np.dtype, size: int, what: str):
    has = "fix_gaps" in blobs, "fix_values" in blobs
    if has[0] != has[1]:
        raise UpdateTypeError(f"{what} fixes are incomplete (parts {sorted(blobs)})")
    return _SparseByPosition(blobs["fix_gaps"], blobs["fix_values"], dtype, size, f"{what} fixes") if has[0] else None


class _Level:
    """The value of one step of a chain, any range at a time."""

    dtype: np.dtype
    size: int

    def read(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError


class _DenseLevel(_Level):
    def __init__(self, blobs: dict, dtype: np.dtype, size: int):
        if set(blobs) != {"values"}:
            raise UpdateTypeError(f"dense step has parts {sorted(blobs)}, expected values")
        self.values = codec.ArrayReader(blobs["values"])
        if self.values.size != size:
            raise UpdateTypeError(f"dense step holds {self.values.size} elements, its layout {size}")
        self.dtype, self.size = dtype, size

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.values.read(start, stop).astype(self.dtype, copy=False)  # _coerce's cast, element by element


class _ElementwiseLevel(_Level):
    """A step whose every element depends on the same element of the value before it (delta, sparse, ia3,
    low-rank: the row's factors): the range below, updated, cast to this step's dtype."""

    def __init__(self, below: _Level, step_type: str, blobs: dict, params: dict, dtype: np.dtype, shape: tuple):
        self.below, self.dtype, self.size = below, dtype, int(np.prod(shape, dtype=np.int64))
        if below.size != self.size:
            raise UpdateTypeError(f"a {step_type} step keeps its value's size ({below.size} elements), its layout "
                                  f"says {self.size}")
        work = below.dtype  # the update type works in the previous value's dtype; the result is then cast
        self.per = raw_words(np.empty(1, work)).size
        self.op = None
        if step_type == "delta":
            op = params.get("op")
            word = raw_words(np.empty(1, work)).dtype
            if op not in OPS or not ({"codes", "planes"} & set(blobs)):
                raise UpdateTypeError(f"delta step is malformed (op {op!r}, parts {sorted(blobs)})")
            self.op = op
            key = "codes" if "codes" in blobs else "planes"
            self.codes = codec.ArrayReader(blobs[key])
            n = self.size * self.per
            want = (n,) if key == "codes" else (word.itemsize, n)
            if (self.codes.dtype != (word if key == "codes" else np.uint8)
                    or int(np.prod(self.codes.shape, dtype=np.int64)) != int(np.prod(want, dtype=np.int64))
                    or (key == "planes" and tuple(self.codes.shape) != want)):
                raise UpdateTypeError(f"delta {key} are {list(self.codes.shape)} x {self.codes.dtype}, expected "
                                      f"{list(want)} for {self.size} elements of {work}")
            self.planes = key == "planes"
            self.word = word
            self.apply = self._delta
        elif step_type == "sparse":
            if "gaps" not in blobs or "values" not in blobs:
                raise UpdateTypeError(f"sparse update is missing parts (has {sorted(blobs)}, needs gaps and values)")
            self.apply = _SparseByPosition(blobs["gaps"], blobs["values"], work, self.size, "sparse update").apply
        elif step_type == "ia3":
            ap = _IA3({k: v for k, v in blobs.items() if not k.startswith("fix_")}, work, shape)
            ap.fixes = _fixes_by_position(blobs, work, self.size, "ia3 update") or ap.fixes
            self.apply = ap.apply
        elif step_type == "low-rank":
            ap = _LowRank({k: v for k, v in blobs.items() if not k.startswith("fix_")}, work, shape)
            ap.fixes = _fixes_by_position(blobs, work, self.size, "low-rank update") or ap.fixes
            self.apply = ap.apply
        else:
            raise UpdateTypeError(f"step type {step_type!r} is not read by position")

    def _delta(self, block: np.ndarray, words: np.ndarray, start: int) -> None:
        a, b = start * self.per, start * self.per + words.size
        if self.planes:
            n = self.size * self.per
            planes = np.stack([self.codes.read(p * n + a, p * n + b) for p in range(self.word.itemsize)])

            codes = from_planes(planes, self.word)
        else:
            codes = self.codes.read(a, b)
        _uncombine(codes, words, self.op, out=words)

    def read(self, start: int, stop: int) -> np.ndarray:
        block = self.below.read(start, stop)
        if not block.flags.writeable or not block.flags.c_contiguous:
            block = np.array(block, order="C")
        self.apply(block, raw_words(block), start)
        return block.astype(self.dtype, copy=False)


class _RowsLevel(_Level):
    """A rows step: each row of its value is a row of the value before it (``source_gaps``: any order, any
    repetition) or the next of the new rows (``extra``)."""

    def __init__(self, below: _Level, blobs: dict, before: tuple, shape: tuple, dtype: np.dtype):
        if "source_gaps" not in blobs or "extra" not in blobs:
            raise UpdateTypeError(f"rows update is missing parts (has {sorted(blobs)}, needs source_gaps and extra)")
        self.below, self.dtype = below, dtype
        self.per_row = int(np.prod(shape[1:], dtype=np.int64))
        self.size = int(np.prod(shape, dtype=np.int64))
        gdt, gshape = codec.array_info(blobs["source_gaps"])
        if gdt.kind not in "iu" or int(np.prod(gshape, dtype=np.int64)) != shape[0]:
            raise UpdateTypeError(f"rows step maps {list(gshape)} x {gdt} rows, its layout has {shape[0]}")
        # one number per row (the row map is what a rows step stores: rows x 8 bytes, far below the group)
        self.sources = np.cumsum(codec.decode_array(blobs["source_gaps"]).reshape(-1), dtype=np.int64)
        new = self.sources < 0
        if np.any(self.sources >= before[0]) or np.any(self.sources < -1):
            raise UpdateTypeError(f"rows step copies rows outside the {before[0]} rows before it")
        self.extra = codec.ArrayReader(blobs["extra"])
        if self.extra.size != int(new.sum()) * self.per_row:
            raise UpdateTypeError(f"rows step has {self.extra.size} new elements, expected "
                                  f"{int(new.sum()) * self.per_row}")
        self.rank = np.cumsum(new, dtype=np.int64) - 1  # the new rows' positions in extra
        self.work = below.dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        per = self.per_row
        if per == 0 or stop <= start:
            return np.empty(stop - start, self.dtype)
        r0, r1 = start // per, -(-stop // per)
        out = np.empty((r1 - r0) * per, self.work)
        src = self.sources[r0:r1]
        # runs of rows read together: consecutive sources, or consecutive new rows
        old_run = (src[1:] >= 0) & (src[:-1] >= 0) & (np.diff(src) == 1)
        new_run = (src[1:] < 0) & (src[:-1] < 0)
        edges = [0, *(np.flatnonzero(~(old_run | new_run)) + 1).tolist(), src.size]
        for a, b in zip(edges, edges[1:]):
            if src[a] < 0:
                k = int(self.rank[r0 + a])
                out[a * per:b * per] = self.extra.read(k * per, (k + b - a) * per).astype(self.work, copy=False)
            else:
                out[a * per:b * per] = self.below.read(int(src[a]) * per, (int(src[a]) + b - a) * per)
        lo = start - r0 * per
        return out[lo:lo + stop - start].astype(self.dtype, copy=False)


class PositionalSource(_Source):
    """The value of a group whose chain a :class:`GroupSource` cannot read in one pass (rows moved, a change
    of dtype, old ``planes`` deltas), block by block with the same interface (``shape``, ``dtype``, ``size``,
    :meth:`chunks`, ``checked``): each block is read through the chain's levels (see above)."""

    def chunks(self, n: int) -> Iterator[tuple[slice, np.ndarray]]:
        g, steps = self.group, self.group.steps
        h = None if self.checked else valuehash.like(g.hash)
        with ExitStack() as stack:
            at = [0]  # the step an error is located at
            try:
                level = open_levels(g, self.store, self.file, stack, at)
                at[0] = len(steps) - 1
                for start in range(0, self.size, n):
                    block = level.read(start, min(self.size, start + n))
                    if block.dtype != self.dtype:
                        raise UpdateTypeError(f"the chain gives {block.dtype}, the group is {self.dtype}")
                    if h is not None:
                        h.update(dtypes.le_bytes(block))
                    yield slice(start, start + block.size), block
            except (IntegrityError, UpdateTypeError, ValueError, TypeError, IndexError, OverflowError) as e:
                raise _step_failed(e, self.file, g, steps, at[0], "cannot be read by position") from None
        if h is not None:
            _check_rebuilt(h, self.file, g, steps)
            self.checked = True


def open_levels(group: "GroupMeta", store: "LfsStore", file: str | None, stack: ExitStack,
                at: list | None = None) -> _Level:
    """The last level of ``group``'s chain read by position (see above): ``read(start, stop)`` gives any range of
    the group's value, decoding only the frames it covers. The blobs stay mapped while ``stack`` is open.
    ``at[0]``: the step being opened (for an error's location)."""
    level: _Level | None = None
    before: tuple = ()
    for i, s in enumerate(group.steps):
        if at is not None:
            at[0] = i
        blobs = codec.part_blobs(stack.enter_context(store.mapped(s.blob, group=group.name, file=file)))
        dtype_name, shape = step_layout(s, group)
        dt = dtypes.get(dtype_name).to_numpy()
        size = int(np.prod(shape, dtype=np.int64))
        if i == 0:
            level = _DenseLevel(blobs, dt, size)
        elif s.type == "rows":
            level = _RowsLevel(level, blobs, before, shape, dt)
        else:
            level = _ElementwiseLevel(level, s.type, blobs, s.params, dt, shape)
        before = shape
    return level


class PositionalReader:
    """A group's value for any range of elements, from any thread (:meth:`read`): each thread reads through
    levels of its own (:func:`open_levels`: a frame per blob and a block per level in memory, per thread), so
    the codec threads read side by side. Nothing is hashed: the caller checks the value (a pass of
    :func:`source`'s blocks) unless the store proves the chain (:func:`theta.updates.rebuild.chain_proven`).
    Use as a context manager (the blobs stay mapped until it exits)."""

    def __init__(self, group: "GroupMeta", store: "LfsStore", file: str | None = None):
        bounds.check_group(group, file)
        self.group, self.store, self.file = group, store, file
        self.dtype = dtypes.get(group.dtype).to_numpy()
        self.size = group.numel
        self._stack = ExitStack()
        self._lock = threading.Lock()  # (an ExitStack is not for several threads at once)
        self._local = threading.local()
        try:
            self._local.level = self._open()  # every structural refusal now, before any caller relies on it
        except BaseException:
            self._stack.close()
            raise

    def _open(self) -> _Level:
        at = [0]
        try:
            with self._lock:
                return open_levels(self.group, self.store, self.file, self._stack, at)
        except (IntegrityError, UpdateTypeError, ValueError, TypeError, IndexError, OverflowError) as e:
            raise _step_failed(e, self.file, self.group, self.group.steps, at[0], "cannot be read by position") \
                from None

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``start:stop`` of the flattened value (fresh memory, the group's dtype)."""
        g = self.group
        level = getattr(self._local, "level", None)
        if level is None:
            level = self._local.level = self._open()
        try:
            block = level.read(start, stop)
            if block.dtype != self.dtype:
                raise UpdateTypeError(f"the chain gives {block.dtype}, the group is {self.dtype}")
            return block
        except (IntegrityError, UpdateTypeError, ValueError, TypeError, IndexError, OverflowError) as e:
            raise _step_failed(e, self.file, g, g.steps, len(g.steps) - 1, "cannot be read by position") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "PositionalReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
