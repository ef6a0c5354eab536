"""Part of a tensor without reading the rest: ``lsd.get_slice(key)[0:10]`` (safetensors' ``get_slice``).

Indexing is numpy's basic indexing, the subset safetensors' ``get_slice`` accepts: integers (negative
count from the end), slices with a positive step, and one ``...``. Slice bounds are clamped like numpy's
(``[5:10]`` of a 3-row tensor is empty); an integer out of range, ``None``, a list or a negative step
raise ``IndexError`` (torch has no negative steps either).

How the bytes are read, per layout:

- **addressable** (safetensors, uncompressed torch storages, contiguous HDF5 datasets: ``info.offset`` is
  known): the slice is a strided view of the file. Its elements form runs of consecutive bytes; runs
  less than a page (:data:`PAGE`) apart are read together (the same pages would be read from disk
  anyway), every other gap is skipped. ``[0:10]`` of a row-major matrix is one read of exactly ten rows;
  ``[:, 3]`` is one small read per row. Memory: the result, plus one merged range at a time.
- **chunked or compressed HDF5**: h5py's own slicing, which reads only the chunks the slice touches.
- anything else (a compressed torch record, a plugin format): the tensor is read whole, then sliced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import dtypes
from .fileio import pread_array
from .info import TensorInfo

#: runs closer than this many bytes are read with one read: they would touch the same pages anyway.
PAGE = 4096
#: elements gathered per vectorised copy when runs are small (bounds the index arrays to 8 MiB)
_GATHER_ELEMENTS = 1 << 20


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

def read_selection(fd: int, info: TensorInfo, sel: Selection,
                   on_read: Callable[[int, int, int], None] | None = None) -> np.ndarray:
    """The selected values of an addressable tensor (``info.offset`` known) as a C-contiguous array of its
    dtype's carrier type (little-endian), reading only the byte runs the selection touches.

    ``on_read(fd, offset, nbytes)`` is called after each positioned read (page-cache policy).
    """
    dt = dtypes.get(info.dtype)
    carrier = dt.carrier
    item = dt.itemsize
    if sel.numel == 0:
        return np.empty(sel.shape, dtype=carrier)
    # the selection as a strided view of the file, in elements from the tensor's first element
    base = sum(start * stride for (start, _, _, _), stride in zip(sel.dims, info.stride))
    view = [(count, step * stride) for (_, step, count, _), stride in zip(sel.dims, info.stride) if count > 1]
    # read order: largest stride outermost; the innermost dims that are dense form one run
    order = sorted(range(len(view)), key=lambda i: -view[i][1])
    dims = [view[i] for i in order]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = np.full(1, base, dtype=np.int64)
    for count, stride in dims:  # run starts in C order of the outer dims
        starts = (starts[:, None] + np.arange(count, dtype=np.int64)[None, :] * stride).reshape(-1)
    out = np.empty(starts.size * run, dtype=carrier)
    by_offset = np.argsort(starts, kind="stable")
    s_sorted = starts[by_offset]
    # group runs into ranges: a new range wherever the gap to the previous run's end is a page or more
    ends = s_sorted + run
    running_end = np.maximum.accumulate(ends)
    breaks = np.nonzero((s_sorted[1:] - running_end[:-1]) * item >= PAGE)[0] + 1
    bounds = np.concatenate(([0], breaks, [s_sorted.size]))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        first, last = int(s_sorted[lo]), int(running_end[hi - 1])
        nbytes = (last - first) * item
        offset = info.offset + first * item
        buf = pread_array(fd, nbytes, offset, info.file, info.name).view(carrier)
        if on_read is not None:
            on_read(fd, offset, nbytes)
        runs = by_offset[lo:hi]
        rel = s_sorted[lo:hi] - first
        if run * item >= PAGE or hi - lo == 1:
            for k, r in zip(runs.tolist(), rel.tolist()):
                out[k * run:(k + 1) * run] = buf[r:r + run]
        else:  # many small runs: gather them in vectorised batches
            step = max(1, _GATHER_ELEMENTS // run)
            inner = np.arange(run, dtype=np.int64)
            dest = out.reshape(-1, run)
            for j in range(0, runs.size, step):
                dest[runs[j:j + step]] = buf[rel[j:j + step, None] + inner[None, :]]
    # back from read order to the selection's order
    kept_shape = [view[i][0] for i in order]
    arr = out.reshape(kept_shape) if kept_shape else out.reshape(())
    inverse = np.argsort(order)
    arr = np.ascontiguousarray(arr.transpose(inverse)) if len(order) > 1 else arr
    return to_little_endian(arr.reshape(sel.shape), info)


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
        import torch

        flat = arr.reshape(-1).view(np.uint8)
        return torch.from_numpy(flat.copy() if not flat.flags.writeable else flat) \
            .view(dtypes.to_torch(self.info.dtype)).reshape(arr.shape)


def read_through_file(lsd, info: TensorInfo, sel: Selection) -> np.ndarray:
    """:func:`read_selection` on the checkpoint's descriptor for ``info.file``, with its page-cache policy."""
    return read_selection(lsd._fd(info.file), info, sel, on_read=lsd._read_done)

