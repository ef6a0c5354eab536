"""A dense step stored from a value that comes block by block, in order: never whole in memory.

A merge's result, a squashed chain: their values are computed from sources read block by block
(:mod:`theta.updates.stream`). :func:`stage_dense` hands those blocks to the encoder as its frames
(:class:`InOrder`: made in order in the calling thread, only compressed on the codec threads, whose decoding of the
inputs they wait for), and hashes what it encoded, in order: the value's name (theta.base.valuehash), its fast hash and its LSH signature (whole rows of the
signature's pool at a time: :class:`theta.base.lsh.PieceFolder`). Blob, names and signature are bit for bit those of
:func:`theta.updates.steps.dense_group` for the same value held whole. Memory: the frames in flight (a few per
codec thread) and the blocks of one frame.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import xxhash

from zipslice import dtypes

from theta.base import lsh, valuehash
from theta.base.errors import CodecError
from theta.storage import codec
from theta.storage.metadata import GroupMeta, Step
from theta.storage.store import LfsStore, Staged


class InOrder:
    """``read(start, stop)`` of a sequential :class:`theta.storage.codec.LazyArray` (frames asked for in order, in
    the thread consuming the blob): each frame is cut from ``blocks``, an iterator of ``(slice, flat block)`` in
    order, as it is asked for; :meth:`take` gives it back once, to hash it after it is compressed.
    :meth:`finish` runs ``blocks`` to its end (a source checks its value's hash there)."""

    def __init__(self, blocks: Iterator[tuple[slice, np.ndarray]], dtype: np.dtype):
        self._blocks, self._dtype = iter(blocks), np.dtype(dtype)
        self._kept: dict[int, np.ndarray] = {}       # frame start -> values, until take()
        self._rest: np.ndarray | None = None         # what the last block had beyond the last frame
        self._at = 0                                 # flat index of the next element the blocks give
        self._next = 0                               # flat index of the next frame's first element

    def read(self, start: int, stop: int) -> np.ndarray:
        if start != self._next:
            raise CodecError(f"frame {start}:{stop} asked for out of order ({self._next} was next)")
        n = stop - start
        frame = np.empty(n, self._dtype)
        got = 0
        while got < n:
            if self._rest is None or self._rest.size == 0:
                try:
                    sl, block = next(self._blocks)
                except StopIteration:
                    raise CodecError(f"the value gave {self._at} elements, its frames need {stop}") from None
                if sl.start != self._at:
                    raise CodecError(f"blocks out of order: {sl.start} where {self._at} was next")
                self._at = sl.stop
                self._rest = np.asarray(block).reshape(-1)
            k = min(n - got, self._rest.size)
            frame[got:got + k] = self._rest[:k]
            self._rest = self._rest[k:]
            got += k
        self._next = stop
        self._kept[start] = frame
        return frame

    def take(self, start: int) -> np.ndarray:
        return self._kept.pop(start)

    def finish(self) -> None:
        if self._rest is not None and self._rest.size:
            raise CodecError(f"the value gave more elements than its frames ({self._next})")
        for sl, block in self._blocks:
            if np.asarray(block).size:
                raise CodecError(f"the value gave more elements than its frames (at {sl.start})")


@dataclass
class StagedDense:
    """A dense blob staged beside the store (not yet in it) and the names of the value it holds."""

    staged: Staged
    dtype: str
    shape: tuple
    digest: str               # the value's name (theta.base.valuehash)
    fast: str                 # its xxh3-128
    lsh: list[int] | None     # its signature (None: NaN/Inf, or not a float dtype)

    def discard(self) -> None:
        self.staged.discard()


def stage_dense(dtype: np.dtype, shape: tuple, blocks: Iterator[tuple[slice, np.ndarray]], store: LfsStore,
                level: int = codec.DEFAULT_LEVEL) -> StagedDense:
    """Encode the value ``blocks`` gives (``(slice, flat block)`` in order, of ``dtype``) as one dense blob staged
    beside ``store``, hashing it as it goes (see the module docstring)."""
    dtype = np.dtype(dtype)
    name = dtypes.from_numpy(dtype).name
    size = int(np.prod(shape, dtype=np.int64))
    order = InOrder(blocks, dtype)
    h, fast = valuehash.new(), xxhash.xxh3_128()
    rows = lsh.PieceFolder() if lsh.hashable(name) else None

    def after(a: int, b: int) -> None:  # in order, on the thread consuming the blob
        frame = order.take(a)
        data = dtypes.le_bytes(frame)
        h.update(data)
        fast.update(data)
        if rows is not None:
            rows.add(frame)

    # sequential: the blocks are made here, in order (their inputs are decoded on the codec threads)
    lazy = codec.LazyArray(dtype, tuple(shape), order.read, after=after, sequential=True)
    staged = store.stage(codec.iter_encode_parts({"values": lazy}, level))
    try:
        order.finish()
    except BaseException:
        staged.discard()
        raise
    sig = lsh.signature_of_fold(rows.result(), size * (2 if dtype.kind == "c" else 1)) if rows is not None else None
    return StagedDense(staged, name, tuple(shape), h.hexdigest(), fast.hexdigest(), sig)


def publish_step(value: StagedDense, store: LfsStore) -> Step:
    """Store ``value``'s blob; the dense step holding it (what :func:`theta.updates.steps.store_dense` returns for
    the same value)."""
    ref = value.staged.publish(store)
    store.bind(ref.oid, value.digest)  # theta encoded this value itself: a checkout may trust its frames
    return Step(type="dense", blob=ref, params={}, hash=value.digest)


def publish_group(like: GroupMeta, value: StagedDense, store: LfsStore) -> GroupMeta:
    """Store ``value``'s blob and return a group with ``like``'s name and flags holding it as one dense step
    (what :func:`theta.updates.steps.dense_group` returns for the same value)."""
    step = publish_step(value, store)
    return GroupMeta(name=like.name, dtype=value.dtype, shape=tuple(value.shape), hash=value.digest, steps=[step],
                     lsh=value.lsh, is_parameter=like.is_parameter, requires_grad=like.requires_grad,
                     fast=value.fast)
