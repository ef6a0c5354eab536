"""What is known about a tensor without reading its data."""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator

import numpy as np

from . import dtypes


def span_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to the last one a strided view touches: 1 + sum((size-1)*stride); 0 if empty."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorInfo:
    """Metadata of one parameter group.

    ``offset`` is the absolute byte offset in ``file`` of the tensor's first element (storage start +
    storage_offset * itemsize); ``span_nbytes`` bytes from there hold every element it touches, gaps of a
    strided view included. ``offset`` is None when the bytes are not addressable (chunked/compressed HDF5).
    Two tensors with the same ``storage`` share memory (tied weights).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: str
    storage_offset: int
    offset: int | None
    span_nbytes: int
    file: str
    storage_nbytes: int | None = None
    byteorder: str = "little"
    is_parameter: bool = False
    requires_grad: bool = False

    @property
    def itemsize(self) -> int:
        return dtypes.get(self.dtype).itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's values (numel * itemsize), not of its span."""
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        if self.numel <= 1:
            return True
        return all(st == cs for s, st, cs in zip(self.shape, self.stride, contiguous_stride(self.shape)) if s != 1)


@dataclass
class TensorSource:
    """A tensor a writer can stream: metadata up front, bytes on demand.

    ``read()`` returns the values as contiguous C-order little-endian bytes (any buffer). Sources with the
    same non-None ``tie`` key hold the same values through the same view (tied weights) and are stored once
    where the format allows it.

    ``crc32``, optional: called right after ``read()``, returns the CRC-32 of the bytes that call returned
    when the source already knows it (e.g. computed on a worker thread while the writer wrote the previous
    tensor), else None. A writer that needs a CRC (the torch zip) then skips its own pass over the bytes;
    a wrong value makes a file whose reader reports a CRC mismatch, so a source gives it only when it
    computed it over exactly those bytes.

    ``chunks``, optional: the same bytes as ``read()``, as consecutive buffers (an iterator). A writer that can
    go back in its output (the torch writer on a seekable file: the CRC is patched in afterwards) may take them
    instead of calling ``read()``, so the tensor is never whole in memory; each buffer is consumed before the
    next is asked for.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    read: Callable[[], "bytes | bytearray | memoryview"]
    tie: Hashable | None = None
    is_parameter: bool = False
    requires_grad: bool = False
    extra: dict = field(default_factory=dict)
    crc32: Callable[[], "int | None"] | None = None
    chunks: "Callable[[], Iterable[bytes | bytearray | memoryview]] | None" = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.get(self.dtype).itemsize

    def with_bytes(self, read: Callable[[], "bytes | bytearray | memoryview"], dtype: str | None = None,
                   chunks: "Callable[[], Iterable[bytes | bytearray | memoryview]] | None" = None,
                   **changes) -> "TensorSource":
        """This source with other values: ``read``, ``crc32`` and ``chunks`` all describe one tensor's bytes, so
        new bytes replace the three together (a ``chunks`` left from the old values would be written instead)."""
        return dataclasses.replace(self, read=read, dtype=dtype or self.dtype, chunks=chunks, crc32=None, **changes)

    def pieces(self) -> "Iterator[memoryview]":
        """The values as consecutive flat byte views: ``chunks()`` when the source has them (never whole in
        memory), else ``read()`` as one piece. Each is used up before the next is asked for."""
        if self.chunks is not None:
            for piece in self.chunks():
                view = memoryview(piece).cast("B")
                del piece  # nothing here holds a piece while the next one is made
                yield view
                del view
            return
        buf = self.read()
        if isinstance(buf, np.ndarray):
            buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        yield memoryview(buf).cast("B")
