"""Part of a tensor without reading the rest: ``lsd.get_slice(key)[0:10]`` (safetensors' ``get_slice``).

Indexing is numpy's basic indexing, the subset safetensors' ``get_slice`` accepts: integers (negative
count from the end), slices with a positive step, and one ``...``. Slice bounds are clamped like numpy's
(``[5:10]`` of a 3-row tensor is empty); an integer out of range, ``None``, a list or a negative step
raise ``IndexError`` (torch has no negative steps either).

How the bytes are read, per layout:

- **addressable** (safetensors, uncompressed torch storages, contiguous HDF5 datasets: ``info.offset`` is
  known): the slice is a strided view of the file, read block by block (see :func:`read_selection`), so
  at most about twice the needed bytes are read. ``[0:10]`` of a row-major matrix is one read of exactly
  ten rows, straight into the result; ``[:, 3]`` is one small read per row; ``[:, ::2]`` reads the rows
  whole. Memory: the result, plus at most one merged read (:data:`MAX_READ`) at a time.
- **chunked or compressed HDF5**: h5py's own slicing, which reads only the chunks the slice touches.
- **a format that can read any byte range of a tensor's values** without a file offset (theta's versions: the
  frames of its blobs a range covers): the same block-by-block reads as addressable tensors, through a
  :class:`RangeReader`.
- anything else (a compressed torch record, a plugin format): the tensor is read whole, then sliced.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import dtypes, optional
from .errors import CorruptCheckpointError
from .fileio import _fill
from .info import TensorInfo

#: two blocks share a read when the gap between them is under a page (the disk reads those pages anyway)
#: and no longer than a block (so at most about twice the needed bytes are read)
PAGE = 4096
#: a merged read is at most this long: memory stays the slice plus one such buffer
MAX_READ = 16 << 20
#: elements gathered per vectorised copy from a merged read (bounds the index arrays to 512 KiB)
_GATHER_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Selection:
    """A normalised basic index: per dimension ``(start, step, count)`` of the source, and whether the
    dimension is kept in the result (an integer index drops it)."""

    dims: tuple[tuple[int, int, int, bool], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(count for _, _, count, keep in self.dims if keep)

    @property
    def numel(self) -> int:
        return math.prod(count for _, _, count, _ in self.dims)

    def numpy_index(self) -> tuple:
        """The same selection as a numpy index (for reading a whole array and slicing it)."""
        return tuple(slice(start, start + step * count, step) if keep else start
                     for start, step, count, keep in self.dims)


def select(shape: tuple[int, ...], index: Any) -> Selection:
    """Normalise ``index`` against ``shape`` (see the module docstring for what is accepted)."""
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    n_real = sum(1 for i in items if i is not Ellipsis)
    if n_real > len(shape):
        raise IndexError(f"too many indices: {n_real} for a tensor of {len(shape)} dimension(s) {list(shape)}")
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded += [slice(None)] * (len(shape) - n_real)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (len(shape) - len(expanded))
    dims = []
    for d, (size, i) in enumerate(zip(shape, expanded)):
        if isinstance(i, slice):
            if i.step is not None and _as_int(i.step, d) <= 0:
                raise IndexError(f"slice step must be positive, got {i.step} (dimension {d})")
            for bound in (i.start, i.stop):
                if bound is not None:
                    _as_int(bound, d)
            start, stop, step = i.indices(size)
            dims.append((start, step, len(range(start, stop, step)), True))
        else:
            k = _as_int(i, d)
            if not -size <= k < size:
                raise IndexError(f"index {k} is out of bounds for dimension {d} of size {size}")
            dims.append((k % size, 1, 1, False))
    return Selection(tuple(dims))


def _as_int(value: Any, dim: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise IndexError(f"only integers, slices and '...' are valid indices, got {value!r} (dimension {dim})")
    return int(value)


def parse_index(text: str) -> tuple:
    """A slice written as on the command line (``"0:10"``, ``"0:10, ::2"``, ``"..., 3"``) as an index tuple.

    Only integers, ``:`` slices and ``...``: nothing is evaluated.
    """
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if part == "...":
            out.append(Ellipsis)
            continue
        pieces = part.split(":")
        try:
            if len(pieces) == 1:
                out.append(int(part))
            elif len(pieces) <= 3:
                out.append(slice(*(int(p) if p.strip() else None for p in pieces)))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{part!r} is not an index: write integers, start:stop[:step] or ...") from None
    return tuple(out)


# -- reading addressable bytes -------------------------------------------------------------------------

class RangeReader:
    """Byte ranges of a tensor's values (C order, little-endian) for :func:`read_selection`, from anything that
    can read a range without reading the rest. ``size``: bytes there are; ``fill(buf, offset)`` fills ``buf``
    from ``offset`` (in bytes from the tensor's first element, always on element boundaries)."""

    size: int

    def fill(self, buf: memoryview, offset: int) -> None:
        raise NotImplementedError


class _FdReader(RangeReader):
    def __init__(self, fd: int, info: TensorInfo):
        self.fd, self.info = fd, info
        self.size = os.fstat(fd).st_size - info.offset

    def fill(self, buf: memoryview, offset: int) -> None:
        if os.preadv(self.fd, [buf], self.info.offset + offset) != buf.nbytes:  # short read: finish it carefully
            _fill(self.fd, buf, self.info.offset + offset, self.info.file, self.info.name)


def read_selection(fd: "int | RangeReader", info: TensorInfo, sel: Selection,
                   on_read: Callable[[int, int, int], None] | None = None) -> np.ndarray:
    """The selected values of an addressable tensor (``info.offset`` known; or any tensor, its values read
    through a :class:`RangeReader` ``fd``) as a C-contiguous array of its dtype's carrier type (little-endian),
    reading only the byte ranges the selection needs.

    The selection is a strided view of the file. Its innermost dimensions form a *block* whose bytes are read
    in one piece when that costs at most twice the needed bytes (a dense row; every other element of a row)
    and at most :data:`MAX_READ`; the outer dimensions enumerate the blocks. Blocks less than a page apart
    (and no further apart than a block is long) share a read. ``on_read(fd, offset, nbytes)`` is called
    after each positioned read of a file (page-cache policy).
    """
    reader = fd if isinstance(fd, RangeReader) else _FdReader(fd, info)
    dt = dtypes.get(info.dtype)
    carrier = dt.carrier
    item = dt.itemsize
    if sel.numel == 0:
        return np.empty(sel.shape, dtype=carrier)
    # the selection as a strided view of the file, in elements from the tensor's first element
    base = sum(start * stride for (start, _, _, _), stride in zip(sel.dims, info.stride))
    view = [(count, step * stride) for (_, step, count, _), stride in zip(sel.dims, info.stride) if count > 1]
    order = sorted(range(len(view)), key=lambda i: -view[i][1])  # read order: largest stride outermost
    dims = [view[i] for i in order]
    block: list[tuple[int, int]] = []
    while dims:
        cand = [dims[-1], *block]
        need, span = math.prod(c for c, _ in cand), 1 + sum((c - 1) * st for c, st in cand)
        if span > 2 * need or span * item > MAX_READ:
            break
        block = cand
        dims.pop()
    need = math.prod(c for c, _ in block)
    span = 1 + sum((c - 1) * st for c, st in block)
    dense = span == need
    inner = None if dense else np.zeros(1, dtype=np.int64)
    for count, stride in ([] if dense else block):  # offsets of a block's elements from its first, C order
        inner = (inner[:, None] + np.arange(count, dtype=np.int64)[None, :] * stride).reshape(-1)
    starts = np.full(1, base, dtype=np.int64)
    for count, stride in dims:  # block starts in C order of the outer dims
        starts = (starts[:, None] + np.arange(count, dtype=np.int64)[None, :] * stride).reshape(-1)
    out = np.empty(starts.size * need, dtype=carrier)
    by_offset = np.argsort(starts, kind="stable")
    s_sorted = starts[by_offset]
    ends = np.maximum.accumulate(s_sorted + span)  # overlapping views (stride 0) may revisit bytes
    if int(ends[-1]) * item > reader.size:
        end_of_data = (info.offset or 0) + int(ends[-1]) * item
        raise CorruptCheckpointError(info.file, f"needs bytes up to {end_of_data} but the file is shorter "
                                                f"(truncated?)", info.name)
    # reads: a new one at every gap of a page or more, or longer than a block, or past MAX_READ
    gaps = (s_sorted[1:] - ends[:-1]) * item
    breaks = list(np.nonzero((gaps >= PAGE) | (gaps > span * item))[0] + 1)
    bounds = _cap_ranges([0, *breaks, s_sorted.size], s_sorted, ends, MAX_READ // item)
    out_view = memoryview(out.view(np.uint8))
    dest = out.reshape(-1, need)
    batch = max(1, _GATHER_ELEMENTS // need)
    block_bytes = need * item
    starts_l, ends_l, blocks_l = s_sorted.tolist(), ends.tolist(), by_offset.tolist()  # python ints: a fast loop
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        first, last = starts_l[lo], ends_l[hi - 1]
        offset, nbytes = first * item, (last - first) * item
        if hi - lo == 1 and dense:  # one dense block: straight into the result
            k = blocks_l[lo]
            reader.fill(out_view[k * block_bytes:(k + 1) * block_bytes], offset)
        else:
            buf = np.empty(nbytes, dtype=np.uint8)
            reader.fill(memoryview(buf), offset)
            buf = buf.view(carrier)
            blocks = by_offset[lo:hi]
            rel = s_sorted[lo:hi] - first
            if inner is None:  # dense blocks sharing one read
                inner = np.arange(need, dtype=np.int64)
            for j in range(0, blocks.size, batch):  # vectorised gather, in bounded batches
                dest[blocks[j:j + batch]] = buf[rel[j:j + batch, None] + inner[None, :]]
        if on_read is not None and not isinstance(fd, RangeReader):
            on_read(fd, info.offset + offset, nbytes)
    # back from read order to the selection's order
    kept_shape = [view[i][0] for i in order]
    arr = out.reshape(kept_shape) if kept_shape else out.reshape(())
    inverse = np.argsort(order)
    arr = np.ascontiguousarray(arr.transpose(inverse)) if len(order) > 1 else arr
    return to_little_endian(arr.reshape(sel.shape), info)


def _cap_ranges(bounds: list[int], starts: np.ndarray, ends: np.ndarray, max_elems: int) -> list[int]:
    """``bounds`` with ranges longer than ``max_elems`` split between runs (a single run is never split)."""
    b = np.asarray(bounds, dtype=np.int64)
    if b.size < 2 or int((ends[b[1:] - 1] - starts[b[:-1]]).max()) <= max_elems:
        return bounds  # the common case, checked in one vectorised pass
    out = [bounds[0]]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        first = int(starts[lo])
        if int(ends[hi - 1]) - first <= max_elems:
            out.append(hi)
            continue
        for i in range(lo + 1, hi):  # long range of many runs: cut before the run that would overflow it
            if int(ends[i]) - first > max_elems:
                out.append(i)
                first = int(starts[i])
        out.append(hi)
    return out


def to_little_endian(arr: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Carrier values read from a big-endian file, swapped (each half of a complex number separately)."""
    dt = dtypes.get(info.dtype)
    if info.byteorder != "big" or dt.itemsize == 1:
        return arr
    if dt.kind == "complex":
        half = np.dtype(f"u{dt.itemsize // 2}")
        return arr.view(half).byteswap().view(arr.dtype)
    return arr.byteswap()


# -- the object users index ---------------------------------------------------------------------------

FRAMEWORKS = ("pt", "np")


class TensorSlice:
    """What ``lsd.get_slice(key)`` returns: shape and dtype now, the values of a slice when indexed.

    ``sl[index]`` returns what ``lsd[key]`` returns for the whole tensor -- a torch tensor with
    ``framework="pt"`` (the default), a numpy array with ``framework="np"`` (bfloat16 / float8 as ml_dtypes
    arrays). ``sl.raw(index)`` gives the bits in an unsigned carrier type (no torch, no ml_dtypes needed).
    """

    def __init__(self, lsd, key: str, framework: str = "pt"):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
        self._lsd = lsd
        self.info: TensorInfo = lsd.info(key)
        self.framework = framework

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> str:
        """zipslice's dtype name (torch's spelling: ``float32``, ``bfloat16``)."""
        return self.info.dtype

    def get_shape(self) -> list[int]:
        """As safetensors: the full tensor's shape as a list."""
        return list(self.info.shape)

    def get_dtype(self) -> str:
        """As safetensors: its dtype code (``F32``, ``BF16``), or zipslice's name if safetensors has none."""
        return dtypes.get(self.info.dtype).safetensors or self.info.dtype

    def __len__(self) -> int:
        if not self.info.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.info.shape[0]

    def __repr__(self) -> str:
        return f"<TensorSlice {self.info.name!r} {self.info.dtype} {list(self.info.shape)}>"

    def raw(self, index: Any = ()) -> np.ndarray:
        """The selected values' bits: a C-contiguous little-endian array of the carrier type (u1/u2/u4/u8/V16)."""
        return self._lsd._read_selection(self.info, select(self.info.shape, index))

    def __getitem__(self, index: Any):
        arr = self.raw(index)
        if self.framework == "np":
            return arr.view(dtypes.get(self.info.dtype).to_numpy())
        torch = optional.torch("get_slice(key)[...] returns torch tensors",
                               'get_slice(key, framework="np")[...] returns numpy arrays')
        flat = arr.reshape(-1).view(np.uint8)
        return torch.from_numpy(flat.copy() if not flat.flags.writeable else flat) \
            .view(dtypes.to_torch(self.info.dtype)).reshape(arr.shape)


def read_through_file(lsd, info: TensorInfo, sel: Selection) -> np.ndarray:
    """:func:`read_selection` on the checkpoint's descriptor for ``info.file``, with its page-cache policy."""
    return read_selection(lsd._fd(info.file), info, sel, on_read=lsd._read_done)

