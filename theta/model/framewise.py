"""A big group cleaned frame by frame: one read of its bytes, nothing group-sized held.

Reading a changed group whole costs its size in fresh pages, and rebuilding its previous value as much again:
the kernel faults in and zeroes every one of them (and, for numpy's transparent huge pages, often compacts
memory first). On a 2-core VM one fresh 89 MiB buffer cost 12 to 270 ms of CPU (``clear_page_erms`` and
compaction were up to a fifth of a 20% `git add`'s samples), more than encoding it. So a group of
STREAM_BYTES or more that the file holds as plain bytes (:meth:`zipslice.LazyCheckpoint.plain_range`) is
cleaned in one pass over the codec's frames (:func:`first_pass`): the codec threads read each frame, decode the
previous version's frame and compress the candidate (the delta's code words, or the value itself), while the
thread consuming the blob hashes, in order, what they read:

- the value's name (BLAKE3, theta.base.valuehash) and xxh3-128 (its fast hash) of the whole, and xxh3-64 of each frame,
  so a later pass may read any frame again and prove it is the same (:meth:`GroupFrames.verified`);
- the LSH fold (:class:`theta.base.lsh.Folder`: the same bits as the signature of the value read whole) and the sum of
  squares it takes on the way, the number of changed elements (the delta's non-zero code words) and the sum of
  squares of the change (:func:`theta.model.norms.change_squares`, on the codec threads while both frames are at
  hand), and dense's sample (:func:`theta.updates.auto.sample_spans`).

The clean then decides as it does for a value read whole (``theta.model.clean``): unchanged, close (allclose frame
by frame), or stored, choosing among the same candidates (:func:`best_change`: sparse only when at most
half of the elements changed, dense when its sample says it may win). Stored blobs and metadata are bit for
bit those of the whole-value path. Memory: a few frames per codec thread, plus the previous value when it is
not one proven dense blob with the same frames (then it is rebuilt whole, :func:`previous_frames`).
"""
from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import xxhash

from zipslice import dtypes

from theta.base import lsh, numeric, parallel, valuehash
from theta.base.errors import BlobMissingError, FileChanged, IntegrityError, MetadataError
from theta.model import norms
from theta.storage import codec
from theta.storage.store import Staged
from theta.updates import Encoded, keyframe
from theta.updates.auto import Choice, _Picker, dense_might_win, sample_spans
from theta.updates.delta import changed_mask, combine, raw_words
from theta.updates.rebuild import chain_frames, chain_proven
from theta.updates.sparse import FixCollector, index_dtype
from theta.updates.stream import PositionalReader, source

# Groups this big or bigger are streamed. Smaller ones are read whole: their buffers come from the heap,
# which glibc keeps for the next group (theta.base.malloc.reuse_freed_memory), so they cost fresh pages
# once per filter, not once per group; anything above 32 MiB (glibc's largest mmap threshold) is
# mapped and unmapped, fresh every time.
STREAM_BYTES = 32 << 20
DELTA_OP = "zigzag"


def streams(lsd, key: str, info, prev, reshaped, exact: bool) -> bool:
    """Whether group ``key`` (its ``info``, its previous version ``prev`` of the same dtype and shape, or
    ``reshaped`` of another) is cleaned frame by frame: big, a real float dtype, plain bytes in the file, and
    a change a frame pass can decide (no previous version of another shape: ``rows`` needs both whole; no
    metadata older than fast hashes, nor ``exact``, where only the value's name decides that nothing changed)."""
    dt = dtypes.get(info.dtype)
    return (info.nbytes >= STREAM_BYTES and sys.byteorder == "little" and dt.kind == "float"
            and dt.itemsize in (2, 4, 8) and (codec.FRAME_BYTES // dt.itemsize) % lsh.POOL == 0  # (Folder)
            and reshaped is None
            and (prev is None or (prev.fast is not None and not exact))
            and hasattr(lsd, "read_plain_into") and lsd.plain_range(key) is not None)


class GroupFrames:
    """A group's values in the work-tree file, read by the codec's frames with positioned reads (any frame,
    any thread). The first read of each frame is recorded (:meth:`record`); :meth:`verified` reads it again
    and raises :class:`FileChanged` when the file no longer holds those bytes."""

    def __init__(self, lsd, key: str, info, path: str):
        self._lsd, self.key, self.path = lsd, key, path
        self.dtype = dtypes.get(info.dtype).to_numpy()
        self.item = self.dtype.itemsize
        self.shape = tuple(info.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.bounds = codec.frame_bounds(self.size, self.item)
        self._seen: dict[int, int] = {}  # frame start -> xxh3-64 of its bytes when first read

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``start:stop`` as they are in the file now (fresh memory)."""
        buf = np.empty((stop - start) * self.item, np.uint8)
        self._lsd.read_plain_into(self.key, start * self.item, buf)
        return buf.view(self.dtype)

    def record(self, start: int, frame: np.ndarray) -> None:
        self._seen[start] = xxhash.xxh3_64_intdigest(frame)

    def verified(self, start: int, stop: int) -> np.ndarray:
        """Frame ``start:stop`` again, proven equal to its first read."""
        frame = self.read(start, stop)
        if xxhash.xxh3_64_intdigest(frame) != self._seen.get(start):
            raise FileChanged(f"{self.path}: group {self.key!r} changed while theta was reading it; "
                              f"run the git command again")
        return frame

    def lazy(self) -> codec.LazyArray:
        """The value, frame by frame as the encoder pulls it, each frame proven (:meth:`verified`)."""
        return codec.LazyArray(self.dtype, self.shape, self.verified)

    def whole(self) -> np.ndarray:
        """The value read whole, each frame proven (:meth:`verified`)."""
        out = np.empty(self.size, self.dtype)
        for a, b in self.bounds:
            out[a:b] = self.verified(a, b)
        return out.reshape(self.shape)


class _BlobFrames:
    """The previous value frame by frame from blobs that prove their own bytes (frames checksummed, decoded on
    demand: :func:`theta.updates.rebuild.chain_frames`)."""

    def __init__(self, proven):
        self._proven, self._plan = proven, proven.plan
        self._jobs = {job[0] // proven.plan.item: job for job in proven.plan.jobs}

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._proven.decode(self._jobs[start], None).view(self._plan.dtype)

    def whole(self) -> np.ndarray:
        out = np.empty(self._plan.nbytes, np.uint8)
        for job in self._plan.jobs:
            a = job[0]
            out[a:a + job[1] * self._plan.item] = self._proven.decode(job, None)
        return out.view(self._plan.dtype).reshape(self._plan.shape)


class _ArrayFrames:
    """The previous value held whole (rebuilt from a chain, or a blob with other frames)."""

    def __init__(self, value: np.ndarray):
        self._value = value
        self._flat = np.ascontiguousarray(value).reshape(-1)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._flat[start:stop]

    def whole(self) -> np.ndarray:
        return self._value


class _ChainFrames:
    """The previous value read by position through its chain (:class:`theta.updates.stream.PositionalReader`):
    any frame, from any codec thread, a frame per blob per thread in memory."""

    def __init__(self, reader):
        self._reader = reader

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._reader.read(start, stop)

    def whole(self) -> np.ndarray:
        return self._reader.read(0, self._reader.size).reshape(self._reader.group.shape)


def _hashed_chain(prev, store, path: str) -> str:
    """The name of ``prev``'s value as its chain gives it, read block by block in order ("" when the chain
    cannot be read: the caller's check then fails, naming the group)."""
    try:
        src = source(prev, store, path)
        if src is None:
            return ""
        for _ in src.chunks(max(1, codec.FRAME_BYTES // dtypes.get(prev.dtype).itemsize)):
            pass
    except IntegrityError:
        return ""
    return prev.hash  # (the source checked the value's name at the end of its pass)


@contextmanager
def previous_frames(prev, store, path: str, bounds: list, rebuilt: Callable[[], np.ndarray | None],
                    on_check: Callable | None = None) -> Iterator:
    """The previous version ``prev`` (a GroupMeta, or None) frame by frame: straight from its blobs when they
    prove their own bytes and are cut into ``bounds`` (:func:`theta.updates.rebuild.chain_frames`: one dense
    step, or a split keyframe chain), else read by position through its chain (never whole: :class:`_ChainFrames`;
    unless the store proves the chain, its value's name is checked by a pass on the hash thread, handed to
    ``on_check`` as a future of the name it found), else ``rebuilt()``'s value (None when there is none: not
    fetched, or broken -- ``rebuilt`` reports that)."""
    if prev is None:
        yield None
        return
    with ExitStack() as stack:
        try:
            proven = stack.enter_context(chain_frames(prev, store, path))
        except (BlobMissingError, IntegrityError, MetadataError):
            proven = None  # rebuilt() meets it again and reports it
        if proven is not None and [(j[0] // proven.plan.item, j[1]) for j in proven.plan.jobs] == \
                [(a, b - a) for a, b in bounds]:
            yield _BlobFrames(proven)
            return
        stack.close()
        try:
            reader = stack.enter_context(PositionalReader(prev, store, path))
            if not chain_proven(prev, store):
                check = parallel.pool("hash").submit(_hashed_chain, prev, store, path)
                if on_check is not None:
                    on_check(check)
        except (BlobMissingError, IntegrityError, MetadataError):
            reader = None  # rebuilt() meets it again and reports it
        if reader is not None:
            yield _ChainFrames(reader)
            return
        value = rebuilt()
        yield None if value is None else _ArrayFrames(value)


@dataclass
class FirstPass:
    """What one pass over a group's frames found, and the candidate it staged."""

    digest: str                 # the value's name (its content hash, theta.base.valuehash)
    fast: str                   # xxh3-128 of the value
    sig: list[int] | None       # LSH signature (None: NaN/Inf)
    squares: float              # sum of squares (the fold's, lsh.Folder.squares)
    changed: int                # elements whose bits differ from the previous value (all, with none)
    sample: np.ndarray          # dense's sample (auto.sample_spans)
    kind: str                   # "delta" (against the previous value), "dense", or "high" (a split keyframe's
    staged: Staged              # the candidate's blob                        dense high part: theta.updates.keyframe)
    sums: norms.Sums            # sums of squares of the value and (delta) of its change (theta.model.norms)
    high_hash: str | None = None  # kind "high": the hash of the high part's value

    @property
    def norm(self) -> float:
        return float(np.sqrt(self.squares))


def first_pass(frames: GroupFrames, old, level: int, store, high_op: str | None = None) -> FirstPass:
    """One read of ``frames``: the hashes, signature and sample of the value, and its blob staged beside
    ``store`` -- the delta against ``old`` (previous frames, :func:`previous_frames`), or when ``old`` is None
    dense, or with ``high_op`` the dense high part of a split keyframe (theta.updates.keyframe)."""
    sha, fast, folder = valuehash.new(), xxhash.xxh3_128(), lsh.Folder()
    high = keyframe.InOrder() if old is None and high_op is not None else None
    mask = keyframe.masks(raw_words(np.empty(0, frames.dtype)).dtype, high_op)[0] if high is not None else None
    spans = sample_spans(frames.size)
    sample = np.empty(sum(b - a for a, b in spans), frames.dtype)
    # frame start -> (its values, changed elements, Σ of the change's squares)
    read_ahead: dict[int, tuple[np.ndarray, int, float]] = {}
    sums = norms.Sums()  # the value's squares come from the fold, the change's and the count from the delta's frames

    def read(a: int, b: int) -> np.ndarray:  # on the codec threads
        new = frames.read(a, b)
        frames.record(a, new)
        if old is None:
            read_ahead[a] = (new, b - a, 0.0)
            if high is not None:
                part = np.bitwise_and(raw_words(new), mask)
                high.keep(a, part)
                return part.view(frames.dtype)
            return new
        before = old.read(a, b)
        codes = combine(raw_words(new), raw_words(before), DELTA_OP)
        read_ahead[a] = (new, int(np.count_nonzero(codes)), norms.change_squares(new, before))
        return codes

    def after(a: int, b: int) -> None:  # in order, in this thread
        if high is not None:
            high.after(a, b)
        new, changed, change = read_ahead.pop(a)
        sums.change += change
        sums.changed += changed
        sha.update(new)
        fast.update(new)
        folder.add(new)
        at = 0
        for s, e in spans:  # the parts of the sample in this frame
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                sample[at + lo - s:at + hi - s] = new[lo - a:hi - a]
            at += e - s

    if old is None:
        kind = "dense" if high is None else "high"
        parts = {"values": codec.LazyArray(frames.dtype, frames.shape, read, after=after)}
    else:
        words = raw_words(np.empty(0, frames.dtype)).dtype
        kind, parts = "delta", {"codes": codec.LazyArray(words, (frames.size,), read, planes=True, after=after)}
    staged = store.stage(codec.iter_encode_parts(parts, level))
    size = frames.size * (2 if frames.dtype.kind == "c" else 1)
    sums.value = folder.squares
    return FirstPass(sha.hexdigest(), fast.hexdigest(), lsh.signature_of_fold(folder.result(), size), folder.squares,
                     sums.changed, sample, kind, staged, sums,
                     high.hexdigest() if high is not None else None)


def words(frames: GroupFrames) -> keyframe.Words:
    """The group's raw words by ranges, each frame proven (:meth:`GroupFrames.verified`)."""
    return keyframe.Words(frames.dtype, frames.shape, lambda a, b: raw_words(frames.verified(a, b)))


def allclose(frames: GroupFrames, old, rtol: float, atol: float) -> bool:
    """numeric.allclose of the value (proven frames) against the previous value, frame by frame on the codec
    threads."""
    def close(b: tuple[int, int]) -> bool:
        return numeric.allclose(frames.verified(*b), old.read(*b), rtol, atol)

    results = codec.ordered(close, frames.bounds)
    try:
        return all(results)
    finally:
        results.close()  # stopped at the first far frame: the frames in flight are let go


# the most a sparse candidate's indices and values may hold (they are collected in one pass, then encoded)
SPARSE_HELD_BYTES = 64 << 20


def sparse_changes(frames: GroupFrames, old, changed: int) -> Encoded | None:
    """The sparse candidate (theta.updates.sparse: the same parts, the same blob) from one pass over the frames of
    the value and of its previous version, on the codec threads, kept in order; None when its ``changed``
    indices and values would hold more than SPARSE_HELD_BYTES (the delta, already staged, then stands: its
    zeros cost little where sparse would have won)."""
    if changed * (index_dtype(frames.size).itemsize + frames.item) > SPARSE_HELD_BYTES:
        return None
    found = FixCollector(frames.size, frames.dtype)

    def compare(b: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        new = frames.verified(*b)
        idx = np.flatnonzero(changed_mask(new, old.read(*b)))
        return idx + b[0], new[idx]

    results = codec.ordered(compare, frames.bounds)
    try:
        for idx, values in results:
            found.add(idx, values)
    finally:
        results.close()
    return Encoded(parts=found.parts(names=("gaps", "values")), params={"count": found.count})


def best_change(first: FirstPass, frames: GroupFrames, old, level: int, store) -> Choice:
    """The smallest exact encoding among auto's candidates (theta.updates.auto.choose), the delta of
    ``first`` being one: sparse when at most half of the elements changed and its changes fit
    SPARSE_HELD_BYTES (:func:`sparse_changes`), dense when its sample says it may win (streamed from proven
    frames)."""
    picker = _Picker(level, store)
    try:
        if 2 * first.changed <= frames.size:
            changes = sparse_changes(frames, old, first.changed)
            if changes is not None:
                picker.consider("sparse", changes)
        picker.consider_staged("delta", {"op": DELTA_OP}, first.staged)
        if dense_might_win(frames.size, picker.tried["delta"], level, new_sample=first.sample):
            picker.consider("dense", Encoded(parts={"values": frames.lazy()}, params={}))
    except BaseException:
        first.staged.discard()
        if picker.best is not None:
            picker.best.staged.discard()
        raise
    return picker.best
