"""A tensor as a stream of frames: consecutive pieces of its C-order values, each at most a frame long.

Every pass over a tensor's values that need not hold them whole (convert, ``show`` statistics, ``diff``, the
writers) goes through here, so memory is a frame or two whatever the tensor's size:

- **plain bytes** (safetensors, stored torch records: :meth:`LazyCheckpoint.plain_range`): one positioned
  read per frame, let go of from the page cache when the checkpoint drops behind;
- **a format that decodes its values** (theta's versions: :meth:`LazyCheckpoint.value_frames`): its own pass;
- **any other layout that can read a part** (a strided or big-endian torch storage, a chunked or compressed
  HDF5 dataset, a sharded checkpoint's shard, a theta version): each frame is read as at most ``2 x rank + 1``
  boxes of the tensor (:func:`flat_boxes`) through ``get_slice``'s reader, which reads only what they cover;
- a plugin format with neither is read whole once, then cut (its own ``_read_span`` is the only reader it has).

A frame is a flat array of the dtype's carrier (u1/u2/u4/u8/V16, little-endian): raw bits, for every dtype.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator

import numpy as np

from . import dtypes
from .base import LazyCheckpoint
from .info import TensorInfo
from .slicing import Selection

#: bytes of one frame: a cast to float32 of a bfloat16 frame holds this and twice this, a few frames in all
FRAME_BYTES = 8 << 20


def frame_elements(itemsize: int, frame_bytes: int = FRAME_BYTES) -> int:
    """Elements of ``itemsize`` bytes in a frame (at least one)."""
    return max(1, frame_bytes // max(1, itemsize))


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Selection]:
    """Elements ``start:stop`` of the C-order flattening of ``shape`` as consecutive boxes (basic selections,
    in order): at most ``2 x len(shape) + 1`` of them -- the rest of a first partial row, whole rows, the
    start of a last partial row, each partial row split the same way one dimension down."""
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"elements {start}:{stop} are outside a tensor of shape {list(shape)}")
    out: list[Selection] = []

    def walk(prefix: tuple, dims: tuple[int, ...], a: int, b: int) -> None:
        if a >= b:
            return
        if not dims:
            out.append(Selection(prefix))
            return
        inner = math.prod(dims[1:])
        r0, o0 = divmod(a, inner)
        r1, o1 = divmod(b, inner)
        rest = tuple((0, 1, d, True) for d in dims[1:])
        if r0 == r1:  # within one row
            walk(prefix + ((r0, 1, 1, False),), dims[1:], o0, o1)
            return
        if o0:
            walk(prefix + ((r0, 1, 1, False),), dims[1:], o0, inner)
            r0 += 1
        if r1 > r0:
            out.append(Selection(prefix + ((r0, 1, r1 - r0, True),) + rest))
        if o1:
            walk(prefix + ((r1, 1, 1, False),), dims[1:], 0, o1)

    walk((), tuple(shape), start, stop)
    return out


def _reads_parts(lsd, info: TensorInfo) -> bool:
    """Whether ``lsd`` can read part of this tensor without reading all of it."""
    return info.offset is not None or type(lsd)._read_selection is not LazyCheckpoint._read_selection


def read_flat(lsd, key: str, start: int, stop: int) -> np.ndarray:
    """Elements ``start:stop`` of tensor ``key``'s C-order values as a flat carrier array (fresh memory),
    reading only the boxes they cover (see the module docstring)."""
    info = lsd.info(key)
    carrier = dtypes.get(info.dtype).carrier
    out = np.empty(stop - start, dtype=carrier)
    at = 0
    for box in flat_boxes(info.shape, start, stop):
        part = lsd._read_selection(info, box).reshape(-1)
        out[at:at + part.size] = part
        at += part.size
    return out


def iter_frames(lsd, key: str, elements: int | None = None) -> Iterator[np.ndarray]:
    """The values of tensor ``key`` as flat carrier arrays (fresh memory) of ``elements`` elements each
    (default: a frame; the last may be shorter), in C order."""
    info = lsd.info(key)
    carrier = dtypes.get(info.dtype).carrier
    n = info.numel
    step = elements or frame_elements(carrier.itemsize)
    if step <= 0:
        raise ValueError("a frame holds at least one element")
    if n == 0:
        return
    item = carrier.itemsize
    if getattr(lsd, "plain_range", None) is not None and lsd.plain_range(key) is not None:
        for a in range(0, n, step):
            frame = np.empty(min(step, n - a), dtype=carrier)
            lsd.read_plain_into(key, a * item, frame.view(np.uint8))  # (drops behind as the checkpoint does)
            yield frame
            del frame  # not held while the next one is read
        return
    own = lsd.value_frames(key, step) if hasattr(lsd, "value_frames") else None
    if own is not None:
        yield from own
        return
    if _reads_parts(lsd, info):
        for a in range(0, n, step):
            frame = read_flat(lsd, key, a, min(n, a + step))
            yield frame
            del frame
        return
    flat = lsd.numpy(key, raw=True).reshape(-1)  # a format that reads nothing but whole tensors
    for a in range(0, n, step):
        yield flat[a:a + step]


def iter_bytes(lsd, key: str, frame_bytes: int = FRAME_BYTES) -> Iterator[memoryview]:
    """:func:`iter_frames` as byte views (what :attr:`zipslice.TensorSource.chunks` gives a writer)."""
    item = dtypes.get(lsd.info(key).dtype).itemsize
    for frame in iter_frames(lsd, key, frame_elements(item, frame_bytes)):
        view = memoryview(frame.view(np.uint8))
        del frame
        yield view
        del view


def whole_elements(pieces: Iterable, itemsize: int) -> Iterator[memoryview]:
    """Byte pieces regrouped so each holds whole elements of ``itemsize`` bytes (a piece that ends inside an
    element keeps those bytes for the next one); ValueError when the bytes end inside an element."""
    carry = b""
    for piece in pieces:
        view = memoryview(piece).cast("B")
        del piece
        if carry:
            need = itemsize - len(carry)
            carry += bytes(view[:need])
            view = view[need:]
            if len(carry) < itemsize:
                continue
            yield memoryview(carry)
            carry = b""
        cut = view.nbytes - view.nbytes % itemsize
        carry = bytes(view[cut:])
        if cut:
            whole = view[:cut]
            del view
            yield whole
            del whole
    if carry:
        raise ValueError(f"the bytes end {len(carry)} bytes into an element of {itemsize}")
