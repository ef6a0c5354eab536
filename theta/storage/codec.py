"""Serialize one parameter group (a numpy array) to bytes and back, losslessly, as a stream.

Array blob layout (all integers little-endian); the header is a trailer so the blob can be written while
it is being compressed, frame after frame, without holding all of it in memory::

    b"THA2" | payload | msgpack header | u32 header length | b"THA2"

Header: ``{"dtype": zipslice dtype name, "shape": [...], "enc": "planes" | "zstd", "frames": [[n, [c0, c1, ...]], ...]}``.
The values (C order, little-endian) are cut into frames of at most ``FRAME_BYTES`` bytes so encoding and
decoding stay bounded and run on two threads (zstandard and numpy release the GIL). In a frame of ``n`` elements:

- ``planes`` (floating and complex dtypes wider than one byte): byte ``i`` of every element is gathered into
  plane ``i`` and each plane is zstd-compressed on its own (``c_i`` bytes). The sign/exponent plane of
  trained weights compresses well, the low mantissa planes barely, and zstd stores those almost raw at memory speed.
- ``zstd`` (bool, ints, 1-byte floats): the frame's bytes compressed as one zstd frame (``c_0`` bytes).

Several arrays (an update with several parts) go in one blob::

    b"THP2" | array blobs back to back | msgpack {"parts": [[name, nbytes], ...]} | u32 length | b"THP2"
"""
from __future__ import annotations

import mmap
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Union

import msgpack
import numpy as np
import zstandard

from zipslice import dtypes

from theta import parallel
from theta.errors import CodecError

ARRAY_MAGIC = b"THA2"
PARTS_MAGIC = b"THP2"
FRAME_BYTES = 4 << 20
# Level 0 (the default) is theta's preset for byte planes: zstd's "fast" strategy with a tiny match table
# (hash_log 6, min_match 7). Planes of weights have almost no repeats, so match finding is wasted work; this
# preset keeps zstd's Huffman coding of literals and is ~4x faster and slightly smaller than level 1
# (measured by scripts/bench/codec.py, see docs/benchmarks.md, "Codec"). Non-plane data (ints, bool, 1-byte floats)
# uses zstd level 1 under level 0. Any other value is a plain zstd level for everything.
DEFAULT_LEVEL = 0
_PLANE_PRESET = dict(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
                     strategy=zstandard.STRATEGY_FAST)

_local = threading.local()
def _map(fn, items: list) -> list:
    """fn over items, on the codec threads when there is more than one item."""
    if len(items) <= 1 or parallel.CODEC_THREADS <= 1:
        return [fn(i) for i in items]
    return list(parallel.pool("codec").map(fn, items))


def _compressor(level: int, planes: bool) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstandard compressors must not be shared between threads)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, planes and level == 0)
    c = cache.get(key)
    if c is None:
        if key[1]:
            params = zstandard.ZstdCompressionParameters(write_checksum=True, **_PLANE_PRESET)
            c = zstandard.ZstdCompressor(compression_params=params)
        else:
            c = zstandard.ZstdCompressor(level=level or 1, write_checksum=True)
        cache[key] = c
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _uses_planes(dt: dtypes.DType) -> bool:
    return dt.is_float and dt.itemsize > 1


@dataclass
class LazyArray:
    """An array the encoder pulls frame by frame instead of holding it whole (e.g. a delta's code words,
    computed from the new and previous values as each frame is compressed, on the codec threads).

    ``read(start, stop)`` returns elements ``[start, stop)`` of the C-order flattened array as a contiguous
    array of ``dtype`` (a fresh or a read-only one: the encoder only reads it); it must be safe to call
    from several threads at once. ``planes``: byte-plane every frame (see :func:`iter_encode_array`).
    """

    dtype: np.dtype
    shape: tuple
    read: Callable[[int, int], np.ndarray]
    planes: bool | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def planed(arr: np.ndarray) -> LazyArray:
    """``arr`` encoded in byte planes whatever its dtype (integer words whose high bytes are mostly zero,
    such as a delta's zigzag codes, compress far better plane by plane)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return LazyArray(arr.dtype, tuple(arr.shape), lambda a, b: flat[a:b], planes=True)


ArrayLike = Union[np.ndarray, LazyArray]


def iter_encode_array(arr: ArrayLike, level: int = DEFAULT_LEVEL, planes: bool | None = None) -> Iterator[bytes]:
    """The blob of ``arr`` (an array or a :class:`LazyArray`) as byte strings in order, compressed on the
    codec threads a few frames ahead.

    ``planes``: byte-plane each frame (default: floats wider than a byte; a LazyArray may ask for it).
    Memory: the input (a LazyArray: only the frames in flight) plus at most ``2 * parallel.CODEC_THREADS``
    compressed frames in flight.
    """
    try:
        dt = dtypes.from_numpy(np.dtype(arr.dtype))
    except KeyError as e:
        raise CodecError(f"cannot encode an array of dtype {arr.dtype}: {e}") from None
    item = dt.itemsize
    if isinstance(arr, LazyArray):
        lazy, shape, n = arr, tuple(arr.shape), arr.size
        if planes is None:
            planes = arr.planes
    else:
        arr = dtypes.little_endian(arr)
        lazy, shape, n = None, tuple(arr.shape), arr.size
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    if planes is None:
        planes = _uses_planes(dt)
    planes = bool(planes) and item > 1
    per_frame = max(1, FRAME_BYTES // item)  # elements
    bounds = [(s, min(s + per_frame, n)) for s in range(0, n, per_frame)]

    def frame_bytes(b: tuple[int, int]) -> np.ndarray:
        if lazy is None:
            return raw[b[0] * item:b[1] * item]
        got = dtypes.little_endian(np.ascontiguousarray(lazy.read(b[0], b[1])))
        if got.dtype.itemsize != item or got.size != b[1] - b[0]:
            raise CodecError(f"lazy array gave {got.size} elements of {got.dtype} for [{b[0]}, {b[1]}) of {dt.name}")
        return got.reshape(-1).view(np.uint8)

    def work(b: tuple[int, int]) -> list[bytes]:
        frame = frame_bytes(b)
        c = _compressor(level, planes)
        if planes:
            grouped = frame.reshape(-1, item).T.copy()  # plane i = byte i of every element
            return [c.compress(grouped[i].data) for i in range(item)]
        return [c.compress(frame.data)]

    yield ARRAY_MAGIC
    frames = []
    for b, ps in zip(bounds, _ordered(work, bounds)):
        frames.append([b[1] - b[0], [len(p) for p in ps]])
        yield from ps
    header = {"dtype": dt.name, "shape": list(shape), "enc": "planes" if planes else "zstd", "frames": frames}
    h = msgpack.packb(header)
    yield h + struct.pack("<I", len(h)) + ARRAY_MAGIC


def _ordered(fn, items: list) -> Iterator:
    """fn over items on the codec threads, results in order, at most 2 * parallel.CODEC_THREADS in flight."""
    if len(items) <= 1 or parallel.CODEC_THREADS <= 1:
        for i in items:
            yield fn(i)
        return
    pool, window, queue = parallel.pool("codec"), 2 * parallel.CODEC_THREADS, []
    try:
        for i in items:
            queue.append(pool.submit(fn, i))
            if len(queue) >= window:
                yield queue.pop(0).result()
        while queue:
            yield queue.pop(0).result()
    finally:
        for f in queue:  # consumer stopped early: let no worker run over freed input
            f.cancel() or f.exception()


def encode_array(arr: np.ndarray, level: int = DEFAULT_LEVEL) -> bytes:
    return b"".join(iter_encode_array(arr, level))


def _trailer(blob: memoryview, magic: bytes, what: str) -> tuple[dict, int]:
    """The header of a blob and the end of its payload."""
    n = blob.nbytes
    if n < 12 or bytes(blob[:4]) != magic or bytes(blob[n - 4:]) != magic:
        raise CodecError(f"not a theta {what} blob, or truncated (bad magic {bytes(blob[:4])!r}...{bytes(blob[n - 4:])!r})")
    (hlen,) = struct.unpack("<I", blob[n - 8:n - 4])
    end = n - 8 - hlen
    if end < 4:
        raise CodecError(f"theta {what} blob truncated: header needs {hlen} bytes, blob has {n}")
    try:
        header = msgpack.unpackb(blob[end:n - 8])
    except (msgpack.UnpackException, ValueError) as e:
        raise CodecError(f"theta {what} blob has a corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise CodecError(f"theta {what} blob header is not a map")
    return header, end


def _array_layout(blob: memoryview) -> tuple[dtypes.DType, tuple, str, list]:
    """Validated header of an array blob: (dtype, shape, encoding, frame jobs (byte start, count, offset, sizes))."""
    header, payload_end = _trailer(blob, ARRAY_MAGIC, "array")
    try:
        dt = dtypes.get(header["dtype"])
        shape = tuple(int(s) for s in header["shape"])
        enc, frames = header["enc"], header["frames"]
        frames = [(int(count), [int(c) for c in sizes]) for count, sizes in frames]
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"theta array blob header is invalid: {e}") from None
    if enc not in ("planes", "zstd") or any(s < 0 for s in shape):
        raise CodecError(f"theta array blob has unknown encoding {enc!r} or bad shape {shape}")
    item = dt.itemsize
    n = int(np.prod(shape, dtype=np.int64))
    if sum(f[0] for f in frames) != n or any(f[0] < 0 or min(f[1], default=0) < 0 for f in frames):
        raise CodecError(f"theta array blob frames hold {sum(f[0] for f in frames)} elements, shape needs {n}")
    jobs, start, off = [], 0, 4
    for count, sizes in frames:
        if enc == "planes" and len(sizes) != item:
            raise CodecError(f"theta array blob frame has {len(sizes)} planes, dtype needs {item}")
        if enc == "zstd" and len(sizes) != 1:
            raise CodecError(f"theta array blob frame has {len(sizes)} zstd frames, expected 1")
        jobs.append((start, count, off, sizes))
        start += count * item
        off += sum(sizes)
    if off != payload_end:
        raise CodecError(f"theta array blob has {payload_end - 4} payload bytes, its frames say {off - 4}")
    return dt, shape, enc, jobs


def _forget(blob: memoryview, start: int, stop: int) -> None:
    """Drop bytes [start, stop) of ``blob`` from this process's resident set when it is a read-only memory map
    (LfsStore.mapped): they stay in the page cache, but a decoded frame's compressed bytes no longer count
    toward the process's memory on top of the decoded value."""
    m = blob.obj
    if not isinstance(m, mmap.mmap) or stop - start < 2 * mmap.PAGESIZE:
        return
    try:
        base = np.frombuffer(m, np.uint8).ctypes.data
        here = np.frombuffer(blob, np.uint8).ctypes.data - base  # where blob starts in the map
        first = -(-(here + start) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (here + stop) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            m.madvise(mmap.MADV_DONTNEED, first, last - first)
    except (ValueError, OSError, AttributeError):
        pass  # closed map or no madvise on this platform: only a memory optimisation


def _decode_frame(blob: memoryview, enc: str, item: int, job, dest: np.ndarray) -> None:
    """Decompress one frame into ``dest`` (uint8, count * item bytes)."""
    _, count, o, sizes = job
    _forget_after = (o, o + sum(sizes))
    d = _decompressor()
    try:
        if enc == "planes":
            grid = dest.reshape(count, item)
            for i, c in enumerate(sizes):
                plane = d.decompress(blob[o:o + c], max_output_size=count)
                if len(plane) != count:
                    raise CodecError(f"theta array blob plane {i} decodes to {len(plane)} bytes, expected {count}")
                grid[:, i] = np.frombuffer(plane, np.uint8)
                o += c
        else:
            data = d.decompress(blob[o:o + sizes[0]], max_output_size=count * item)
            if len(data) != count * item:
                raise CodecError(f"theta array blob frame decodes to {len(data)} bytes, expected {count * item}")
            dest[:] = np.frombuffer(data, np.uint8)
    except zstandard.ZstdError as e:
        raise CodecError(f"theta array blob is corrupt: {e}") from None
    _forget(blob, *_forget_after)


def decode_array(blob: "bytes | bytearray | memoryview") -> np.ndarray:
    """The array encoded by :func:`encode_array`, with its real dtype (ml_dtypes for bf16/float8) and shape."""
    blob = memoryview(blob).cast("B")
    dt, shape, enc, jobs = _array_layout(blob)
    item = dt.itemsize
    n = int(np.prod(shape, dtype=np.int64))
    out = np.empty(n * item, dtype=np.uint8)
    _map(lambda job: _decode_frame(blob, enc, item, job, out[job[0]:job[0] + job[1] * item]), jobs)
    return out.view(dt.to_numpy()).reshape(shape)


def array_info(blob: "bytes | bytearray | memoryview") -> tuple[np.dtype, tuple]:
    """(dtype, shape) of an array blob, without decoding it."""
    dt, shape, _, _ = _array_layout(memoryview(blob).cast("B"))
    return dt.to_numpy(), shape


def iter_decode_array(blob: "bytes | bytearray | memoryview") -> Iterator[tuple[int, np.ndarray]]:
    """The array of an array blob frame by frame, in order: (index of the first element in the flattened
    array, the frame's elements as a flat array of the real dtype). Frames are decoded on the codec threads a
    few ahead, so memory stays at a few frames (``FRAME_BYTES`` each) whatever the array's size."""
    blob = memoryview(blob).cast("B")
    dt, _, enc, jobs = _array_layout(blob)
    item, np_dt = dt.itemsize, dt.to_numpy()

    def work(job) -> tuple[int, np.ndarray]:
        dest = np.empty(job[1] * item, dtype=np.uint8)
        _decode_frame(blob, enc, item, job, dest)
        return job[0] // item, dest.view(np_dt)

    yield from _ordered(work, jobs)


def iter_encode_parts(parts: "dict[str, ArrayLike]", level: int = DEFAULT_LEVEL) -> Iterator[bytes]:
    """Several named arrays in one blob, streamed; names are stored sorted so the blob is deterministic."""
    yield PARTS_MAGIC
    index = []
    for name in sorted(parts):
        size = 0
        for chunk in iter_encode_array(parts[name], level):
            size += len(chunk)
            yield chunk
        index.append([name, size])
    h = msgpack.packb({"parts": index})
    yield h + struct.pack("<I", len(h)) + PARTS_MAGIC


def encode_parts_chunks(parts: "dict[str, ArrayLike]", level: int = DEFAULT_LEVEL) -> list[bytes]:
    return list(iter_encode_parts(parts, level))


def encode_parts(parts: "dict[str, ArrayLike]", level: int = DEFAULT_LEVEL) -> bytes:
    return b"".join(iter_encode_parts(parts, level))


def part_blobs(blob: "bytes | bytearray | memoryview") -> dict[str, memoryview]:
    """The array blobs of a parts blob by name (views into ``blob``, nothing decoded)."""
    blob = memoryview(blob).cast("B")
    header, end = _trailer(blob, PARTS_MAGIC, "parts")
    out: dict[str, memoryview] = {}
    pos = 4
    try:
        entries: Iterable = header["parts"]
        for name, size in entries:
            if not isinstance(name, str) or not isinstance(size, int) or size < 0 or pos + size > end:
                raise CodecError(f"theta parts blob truncated or invalid in part {name!r}")
            out[name] = blob[pos:pos + size]
            pos += size
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"theta parts blob header is invalid: {e}") from None
    if pos != end:
        raise CodecError(f"theta parts blob has {end - pos} stray bytes between its parts and its index")
    return out


def decode_parts(blob: "bytes | bytearray | memoryview") -> dict[str, np.ndarray]:
    return decode_parts_of(part_blobs(blob))


def decode_parts_of(blobs: "dict[str, memoryview]") -> dict[str, np.ndarray]:
    """Every part of :func:`part_blobs`' result, decoded."""
    return {name: decode_array(b) for name, b in blobs.items()}


def frames_checksummed(blob: "bytes | bytearray | memoryview") -> bool:
    """True when every zstd frame of a parts blob carries a content checksum.

    zstd verifies such a checksum (XXH64 of the frame's decompressed bytes) whenever it decompresses the
    frame, so decoding such a blob proves each decoded byte is the byte that was encoded. False for
    anything unexpected (the normal decode then reports real errors).
    """
    try:
        blob = memoryview(blob).cast("B")
        header, end = _trailer(blob, PARTS_MAGIC, "parts")
        pos = 4
        for _name, size in header["parts"]:
            part = blob[pos:pos + size]
            pos += size
            arr_header, _ = _trailer(part, ARRAY_MAGIC, "array")
            off = 4
            for _count, sizes in arr_header["frames"]:
                for c in sizes:
                    if not zstandard.get_frame_parameters(part[off:off + c]).has_checksum:
                        return False
                    off += c
        return pos == end
    except (CodecError, KeyError, TypeError, ValueError, zstandard.ZstdError):
        return False
