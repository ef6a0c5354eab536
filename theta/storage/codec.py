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

import bisect
import math
import mmap
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import msgpack
import numpy as np
import zstandard

from zipslice import dtypes

from theta.base import parallel
from theta.base.errors import CodecError

ARRAY_MAGIC = b"THA2"
PARTS_MAGIC = b"THP2"
FRAME_BYTES = 4 << 20  # 4 MiB frames: fewer bytes in flight per codec thread (docs/design/performance.md)
# Limits on what a blob (untrusted: it came from a remote) may claim. zstd cannot expand data more than
# 32768x: a block holds at most 128 KiB and the smallest block (RLE) costs 4 bytes. A frame claiming more
# than that from its compressed bytes is refused before anything is allocated. Decoding therefore never
# allocates more than ZSTD_MAX_RATIO x the blob's size (+ one block per frame).
ZSTD_MAX_RATIO = 1 << 15
ZSTD_BLOCK_BYTES = 128 << 10
MAX_HEADER_BYTES = 64 << 20   # msgpack header of one array blob (a frame list: ~20 bytes per 8 MiB frame)
MAX_RANK = 64
MAX_PARTS = 64                # parts of one update blob (theta's update types use at most 4)
MAX_PART_NAME = 256
_MAX_HEADER_ITEMS = 1 << 24
# Level 0 (the default) is theta's preset for byte planes: zstd's "fast" strategy with a tiny match table
# (hash_log 6, min_match 7). Planes of weights have almost no repeats, so match finding is wasted work; this
# preset keeps zstd's Huffman coding of literals and is ~4x faster and slightly smaller than level 1
# (measured by scripts/bench/codec.py, see docs/benchmarks.md, "Codec"). Non-plane data (ints, bool, 1-byte floats)
# uses zstd level 1 under level 0. Any other value is a plain zstd level for everything.
DEFAULT_LEVEL = 0
_PLANE_PRESET = dict(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
                     strategy=zstandard.STRATEGY_FAST)
# A plane whose bytes are near noise (the low mantissa bytes of weights, of a fine-tune's delta) gains little
# from Huffman coding, and building the table is most of what zstd spends on it: 1.46 ms of a delta frame's
# 3.0 ms to save 5.5% of its second plane. Such a plane keeps the preset's match finding (repeats are still
# found) but stores its literals as they are: zstd does so in its fast strategy with a target length > 0.
# "Near noise": the byte entropy of a sample of the plane says Huffman coding would save under NOISE_GAIN.
NOISE_GAIN = 0.08
_NOISE_SAMPLE = 1 << 14  # bytes of a plane whose histogram estimates its entropy (spread over the plane)

_local = threading.local()
def _map(fn, items: list) -> list:
    """fn over items, on the codec threads when there is more than one item."""
    if len(items) <= 1 or parallel.CODEC_THREADS <= 1:
        return [fn(i) for i in items]
    return list(parallel.pool("codec").map(fn, items))


def _compressor(level: int, planes: bool, noise: bool = False) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstandard compressors must not be shared between threads); ``noise``: the
    plane preset's variant for near-noise planes (literals stored as they are)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, planes and level == 0, noise and planes and level == 0)
    c = cache.get(key)
    if c is None:
        if key[1]:
            preset = dict(_PLANE_PRESET, target_length=1) if key[2] else _PLANE_PRESET
            params = zstandard.ZstdCompressionParameters(write_checksum=True, **preset)
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
    ``after(start, stop)``, when given, is called for each frame in order, in the thread consuming the blob,
    once the frame is compressed (e.g. to hash, in order, what ``read`` read on the codec threads).
    ``sequential``: ``read`` is called instead in order, in the thread consuming the blob (values computed in
    order from inputs that are themselves decoded on the codec threads); the codec threads only compress.
    """

    dtype: np.dtype
    shape: tuple
    read: Callable[[int, int], np.ndarray]
    planes: bool | None = None
    after: Callable[[int, int], None] | None = None
    sequential: bool = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def planed(arr: np.ndarray) -> LazyArray:
    """``arr`` encoded in byte planes whatever its dtype (integer words whose high bytes are mostly zero,
    such as a delta's zigzag codes, compress far better plane by plane)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return LazyArray(arr.dtype, tuple(arr.shape), lambda a, b: flat[a:b], planes=True)


ArrayLike = Union[np.ndarray, LazyArray]


def frame_bounds(n: int, item: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges of the frames the encoder cuts ``n`` elements of ``item`` bytes into
    (at most FRAME_BYTES each)."""
    per_frame = max(1, FRAME_BYTES // item)
    return [(s, min(s + per_frame, n)) for s in range(0, n, per_frame)]


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
    bounds = frame_bounds(n, item)
    after = lazy.after if lazy is not None else None

    def frame_bytes(b: tuple[int, int]) -> np.ndarray:
        if lazy is None:
            return raw[b[0] * item:b[1] * item]
        got = dtypes.little_endian(np.ascontiguousarray(lazy.read(b[0], b[1])))
        if got.dtype.itemsize != item or got.size != b[1] - b[0]:
            raise CodecError(f"lazy array gave {got.size} elements of {got.dtype} for [{b[0]}, {b[1]}) of {dt.name}")
        return got.reshape(-1).view(np.uint8)

    def work(b: tuple[int, int]) -> list[bytes]:
        return compress(frame_bytes(b))

    def compress(frame: np.ndarray) -> list[bytes]:
        c = _compressor(level, planes)
        if planes:
            noisy = _compressor(level, planes, noise=True)  # c itself unless level 0 (theta's preset)
            return [(noisy if noisy is not c and _near_noise(p) else c).compress(p.data)
                    for p in _to_planes(frame, item)]
        return [c.compress(frame.data)]

    if lazy is not None and lazy.sequential:  # frames read here, in order, as the window takes them
        results = _ordered(compress, (frame_bytes(b) for b in bounds))
    else:
        results = _ordered(work, bounds)
    yield ARRAY_MAGIC
    frames = []
    for b, ps in zip(bounds, results):
        frames.append([b[1] - b[0], [len(p) for p in ps]])
        if after is not None:
            after(*b)
        yield from ps
    header = {"dtype": dt.name, "shape": list(shape), "enc": "planes" if planes else "zstd", "frames": frames}
    h = msgpack.packb(header)
    yield h + struct.pack("<I", len(h)) + ARRAY_MAGIC


def ordered(fn, items, window: int | None = None) -> Iterator:
    """fn over items (a list, or any iterable: taken as the window needs them) on the codec threads, results
    in order, at most ``window`` (default 2 * parallel.CODEC_THREADS) in flight."""
    if (isinstance(items, list) and len(items) <= 1) or parallel.CODEC_THREADS <= 1:
        for i in items:
            yield fn(i)
        return
    pool, queue = parallel.pool("codec"), []
    window = max(1, window) if window is not None else 2 * parallel.CODEC_THREADS
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


_ordered = ordered


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
    if hlen > MAX_HEADER_BYTES:
        raise CodecError(f"theta {what} blob header of {hlen} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(blob[end:n - 8], max_array_len=_MAX_HEADER_ITEMS, max_map_len=16,
                                 max_str_len=MAX_PART_NAME, max_bin_len=0, max_ext_len=0)
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise CodecError(f"theta {what} blob has a corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise CodecError(f"theta {what} blob header is not a map")
    return header, end


@dataclass(frozen=True)
class _ArrayLayout:
    """An array blob's checked header: what it decodes to and where each frame's compressed bytes are."""

    dtype: "dtypes.DType"
    shape: tuple[int, ...]
    enc: str
    frames: list[tuple[int, list[int]]]
    payload_end: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _nonneg_int(v, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CodecError(f"theta array blob header is invalid: {what} {v!r:.60} is not a non-negative integer")
    return v


def _array_layout(blob: memoryview) -> _ArrayLayout:
    """Check an array blob's header against its own bytes, before anything is allocated.

    Every frame must decode to no more than zstd can produce from its compressed bytes (ZSTD_MAX_RATIO), so
    a header cannot make the decoder allocate more than a fixed multiple of the blob's size.
    """
    header, payload_end = _trailer(blob, ARRAY_MAGIC, "array")
    if set(header) != {"dtype", "shape", "enc", "frames"}:
        raise CodecError(f"theta array blob header has fields {sorted(map(str, header))}, "
                         f"expected dtype, shape, enc, frames")
    try:
        dt = dtypes.get(header["dtype"])
    except (KeyError, TypeError):
        raise CodecError(f"theta array blob has unknown dtype {header['dtype']!r:.60}") from None
    raw_shape, enc, raw_frames = header["shape"], header["enc"], header["frames"]
    if enc not in ("planes", "zstd") or (enc == "planes" and dt.itemsize < 2):
        raise CodecError(f"theta array blob has encoding {enc!r:.40}, which does not fit dtype {dt.name}")
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_RANK:
        raise CodecError(f"theta array blob shape {raw_shape!r:.80} is not a list of at most {MAX_RANK} dimensions")
    shape = tuple(_nonneg_int(s, "dimension") for s in raw_shape)
    if not isinstance(raw_frames, list):
        raise CodecError("theta array blob header is invalid: frames is not a list")
    item, frames, count_sum, off = dt.itemsize, [], 0, 4
    for f in raw_frames:
        if not (isinstance(f, list) and len(f) == 2 and isinstance(f[1], list)):
            raise CodecError(f"theta array blob header is invalid: frame {f!r:.60} is not [count, [sizes]]")
        count = _nonneg_int(f[0], "frame element count")
        sizes = [_nonneg_int(c, "frame size") for c in f[1]]
        if len(sizes) != (item if enc == "planes" else 1):
            raise CodecError(f"theta array blob frame has {len(sizes)} compressed parts, "
                             f"{dt.name} with encoding {enc} needs {item if enc == 'planes' else 1}")
        per_part = count if enc == "planes" else count * item
        for c in sizes:
            if per_part > ZSTD_MAX_RATIO * c + ZSTD_BLOCK_BYTES:
                raise CodecError(f"theta array blob frame claims {per_part} bytes from {c} compressed bytes, "
                                 f"more than zstd can produce (at most {ZSTD_MAX_RATIO}x)")
        frames.append((count, sizes))
        count_sum += count
        off += sum(sizes)
    n = math.prod(shape)
    if count_sum != n:
        raise CodecError(f"theta array blob frames hold {count_sum} elements, shape {list(shape)} needs {n}")
    if off != payload_end:
        raise CodecError(f"theta array blob has {payload_end - 4} payload bytes, its frames say {off - 4}")
    return _ArrayLayout(dt, shape, enc, frames, payload_end)


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


# byte-planing through whole words: shifting and narrowing a word array is ~1.7x faster than numpy's strided
# byte copy (4 MiB frames; encode_array of 64 MiB fp32: 167 -> 102 ms CPU). Decoding gained nothing that way
# (42 ms either way): it keeps the strided write.
_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_WORD_PLANES = sys.byteorder == "little"  # plane i = byte i in memory = bits 8i.. of a native word


def _to_planes(frame: np.ndarray, item: int) -> list[np.ndarray]:
    """The byte planes of ``frame`` (uint8, little-endian elements of ``item`` bytes): plane i holds byte i
    of every element."""
    word = _WORDS.get(item)
    if word is None or not _WORD_PLANES or frame.nbytes % item:
        grouped = frame.reshape(-1, item).T.copy()
        return [grouped[i] for i in range(item)]
    words = frame.view(word)
    return [words.astype(np.uint8)] + [(words >> word(8 * i)).astype(np.uint8) for i in range(1, item)]


def _near_noise(plane: np.ndarray) -> bool:
    """Whether Huffman coding would shrink ``plane`` (uint8) by less than NOISE_GAIN, judged by the byte
    entropy of an evenly spread sample of it."""
    if plane.size < 4 * _NOISE_SAMPLE:
        return False  # a small plane costs little either way: zstd decides
    counts = np.bincount(plane[::plane.size // _NOISE_SAMPLE], minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum()) > 8 * (1 - NOISE_GAIN)


def _frame_jobs(layout: "_ArrayLayout") -> list:
    """(byte start in the decoded array, element count, offset in the blob, compressed sizes) per frame."""
    item, jobs, start, off = layout.dtype.itemsize, [], 0, 4
    for count, sizes in layout.frames:
        jobs.append((start, count, off, sizes))
        start += count * item
        off += sum(sizes)
    return jobs


# A frame of zeros compresses ~30000x (zstd writes RLE blocks after a first compressed one); a part compressed
# less than this is never one, and is not decompressed twice to find out
_ZERO_RATIO = 512


def _zero_frame(blob: memoryview, enc: str, item: int, job, checksums: bool = False) -> bool:
    """Whether one array frame decodes to zeros -- as the code words of a delta step's unchanged frames do. Only
    parts compressed more than _ZERO_RATIO x are decompressed to see (zstd's run-length blocks: at memory
    speed); what makes a frame expensive -- gathering planes into elements, and whatever the caller would do
    with the values -- is then skipped."""
    _, count, o, sizes = job
    per_part = count if enc == "planes" else count * item
    if any(c * _ZERO_RATIO > per_part for c in sizes):
        return False
    d = _decompressor()
    for c in sizes:
        try:
            data = _decompress(d, blob[o:o + c], per_part, checksums)
        except zstandard.ZstdError as e:
            raise CodecError(f"theta array blob is corrupt: {e}") from None
        words = np.frombuffer(data, np.uint64 if per_part % 8 == 0 else np.uint8)
        if words.any():
            return False
        o += c
    return True


def _decode_frame(blob: memoryview, enc: str, item: int, job, dest: np.ndarray, zeros_checked: bool = False,
                  checksums: bool = False) -> None:
    """Decompress one frame into ``dest`` (uint8, count * item bytes); each zstd frame must declare exactly
    the size the header says (:func:`_decompress`), and with ``checksums`` carry a checksum. A frame of zeros
    (:func:`_zero_frame`, unless the caller has just asked: ``zeros_checked``) is filled, not decompressed."""
    _, count, o, sizes = job
    forget_after = (o, o + sum(sizes))
    if enc == "planes" and len(sizes) != item:
        raise CodecError(f"theta array blob frame has {len(sizes)} planes, its dtype {item} bytes")
    if not zeros_checked and _zero_frame(blob, enc, item, job, checksums):
        dest[:] = 0
        return
    d = _decompressor()
    try:
        if enc == "planes":
            grid = dest.reshape(count, item)
            for i, c in enumerate(sizes):
                grid[:, i] = np.frombuffer(_decompress(d, blob[o:o + c], count, checksums), np.uint8)
                o += c
        else:
            dest[:] = np.frombuffer(_decompress(d, blob[o:o + sizes[0]], count * item, checksums), np.uint8)
    except zstandard.ZstdError as e:
        raise CodecError(f"theta array blob is corrupt: {e}") from None
    _forget(blob, *forget_after)


def decode_array(blob: "bytes | bytearray | memoryview", max_bytes: int | None = None,
                 checksums: bool = False) -> np.ndarray:
    """The array encoded by :func:`encode_array`, with its real dtype (ml_dtypes for bf16/float8) and shape.

    The header is checked first (see :func:`_array_layout`); ``max_bytes`` additionally refuses a value
    larger than the caller expects, before anything is allocated. Each zstd frame must declare its content
    size (theta's encoder always does) equal to what the header says it holds, and with ``checksums`` carry a
    checksum (then verified: a blob trusted to prove its own bytes).
    """
    blob = memoryview(blob).cast("B")
    layout = _array_layout(blob)
    if max_bytes is not None and layout.nbytes > max_bytes:
        raise CodecError(f"theta array blob decodes to {layout.nbytes} bytes, more than the {max_bytes} expected")
    item = layout.dtype.itemsize
    out = np.empty(math.prod(layout.shape) * item, dtype=np.uint8)
    _map(lambda job: _decode_frame(blob, layout.enc, item, job, out[job[0]:job[0] + job[1] * item],
                                   checksums=checksums),
         _frame_jobs(layout))
    return out.view(layout.dtype.to_numpy()).reshape(layout.shape)


def _decompress(d: zstandard.ZstdDecompressor, frame: memoryview, expected: int, checksum: bool = False) -> bytes:
    """One zstd frame that must decode to exactly ``expected`` bytes (its header says so before decoding);
    ``checksum``: and must carry a checksum (zstd verifies it while decoding)."""
    params = zstandard.get_frame_parameters(frame)
    if checksum and not params.has_checksum:
        raise CodecError("theta array blob frame carries no checksum, though this store's binding of the blob "
                         "(lfs/theta-verified) says every frame does")
    declared = params.content_size
    if declared != expected:
        raise CodecError(f"theta array blob frame declares {declared} bytes, its header {expected}"
                         if declared != zstandard.CONTENTSIZE_UNKNOWN else
                         "theta array blob frame does not declare its size")
    data = d.decompress(frame, max_output_size=expected)
    if len(data) != expected:
        raise CodecError(f"theta array blob frame decodes to {len(data)} bytes, expected {expected}")
    return data


def array_info(blob: "bytes | bytearray | memoryview") -> tuple[np.dtype, tuple]:
    """(dtype, shape) of an array blob, without decoding it."""
    layout = _array_layout(memoryview(blob).cast("B"))
    return layout.dtype.to_numpy(), layout.shape


def iter_decode_array(blob: "bytes | bytearray | memoryview", ahead: int | None = None, zeros: bool = False
                      ) -> Iterator[tuple[int, np.ndarray]]:
    """The array of an array blob frame by frame, in order: (index of the first element in the flattened
    array, the frame's elements as a flat array of the real dtype). Frames are decoded on the codec threads a
    few ahead (``ahead``: at most that many in flight; default 2 per codec thread), so memory stays at a few
    frames (``FRAME_BYTES`` each) whatever the array's size. ``zeros``: a frame of zeros comes as a read-only
    array of stride 0 (:func:`is_zero_run`: nothing decoded, nothing filled) for a caller that skips them."""
    blob = memoryview(blob).cast("B")
    layout = _array_layout(blob)
    dt, enc, jobs = layout.dtype, layout.enc, _frame_jobs(layout)
    item, np_dt = dt.itemsize, dt.to_numpy()

    def work(job) -> tuple[int, np.ndarray]:
        if zeros and _zero_frame(blob, enc, item, job):
            return job[0] // item, np.broadcast_to(np.zeros((), np_dt), (job[1],))
        dest = np.empty(job[1] * item, dtype=np.uint8)
        _decode_frame(blob, enc, item, job, dest, zeros_checked=zeros)
        return job[0] // item, dest.view(np_dt)

    yield from _ordered(work, jobs, ahead)


def is_zero_run(a: np.ndarray) -> bool:
    """Whether ``a`` is (a slice of) a frame of zeros as :func:`iter_decode_array` yields them with ``zeros``."""
    return a.ndim == 1 and a.size > 0 and a.strides[0] == 0 and not a[0]


class ArrayReader:
    """Any range of an array blob's flattened elements, decoding only the frames it covers (in the calling
    thread; the last decoded frame is kept, so reading in order decodes each frame once). Memory: one frame
    plus what :meth:`read` returns, whatever the array's size."""

    def __init__(self, blob: "bytes | bytearray | memoryview"):
        self._blob = memoryview(blob).cast("B")
        self._plan = frame_plan(self._blob)
        self.dtype, self.shape = self._plan.dtype, self._plan.shape
        self.size = math.prod(self.shape)
        self._starts = [job[0] // self._plan.item for job in self._plan.jobs]  # first element of each frame
        self._cached: tuple[int, np.ndarray] | None = None

    def _frame(self, f: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != f:
            self._cached = (f, decode_frame(self._blob, self._plan, self._plan.jobs[f]).view(self.dtype))
        return self._cached[1]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``start:stop`` of the flattened array (fresh memory)."""
        if not 0 <= start <= stop <= self.size:
            raise CodecError(f"theta array blob of {self.size} elements has no elements {start}:{stop}")
        out = np.empty(stop - start, self.dtype)
        at = start
        f = max(0, bisect.bisect_right(self._starts, start) - 1)
        while at < stop:
            frame = self._frame(f)
            lo = at - self._starts[f]
            k = min(stop - at, frame.size - lo)
            if k <= 0:  # an empty frame
                f += 1
                continue
            out[at - start:at - start + k] = frame[lo:lo + k]
            at += k
            f += 1
        return out


@dataclass(frozen=True)
class FramePlan:
    """An array blob's checked header, cut into frames that decode one at a time (:func:`decode_frame`):
    for a caller that decodes frames of several blobs in one stream (a checkout writing frame after frame)."""

    dtype: np.dtype
    shape: tuple
    nbytes: int
    jobs: list  # per frame: (byte start in the decoded array, element count, offset in the blob, sizes)
    enc: str
    item: int
    checksums: bool = False  # every zstd frame must carry a checksum (decode_frame raises where one does not)


def frame_plan(blob: "bytes | bytearray | memoryview", checksums: bool = False) -> FramePlan:
    """The frames of an array blob, its header checked as for :func:`decode_array` (nothing decoded).
    ``checksums``: :func:`decode_frame` refuses a zstd frame without a checksum (a blob trusted to prove its
    own bytes, checked frame by frame as it is decoded instead of by a pass over every frame's header)."""
    layout = _array_layout(memoryview(blob).cast("B"))
    return FramePlan(layout.dtype.to_numpy(), layout.shape, layout.nbytes, _frame_jobs(layout), layout.enc,
                     layout.dtype.itemsize, checksums)


def decode_frame(blob: memoryview, plan: FramePlan, job, out: np.ndarray | None = None) -> np.ndarray:
    """One frame of ``plan`` (one of its ``jobs``) decoded: its little-endian bytes as a uint8 array, in ``out``
    (a uint8 buffer at least that large, reused by the caller: no fresh pages to fault in) or a new array.
    Each zstd frame must declare exactly the size the header says, and its checksum, when it has one (it must
    with ``plan.checksums``), is verified."""
    n = job[1] * plan.item
    dest = np.empty(n, dtype=np.uint8) if out is None or out.nbytes < n else out[:n]
    _decode_frame(blob, plan.enc, plan.item, job, dest, checksums=plan.checksums)
    return dest


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


def _parts_index(blob: memoryview) -> list[tuple[str, int, int]]:
    """(name, start, end) of each part of a parts blob, checked to tile the payload exactly."""
    header, end = _trailer(blob, PARTS_MAGIC, "parts")
    entries = header.get("parts") if set(header) == {"parts"} else None
    if not isinstance(entries, list) or len(entries) > MAX_PARTS:
        raise CodecError(f"theta parts blob header is invalid: expected {{'parts': [[name, size], ...]}} "
                         f"with at most {MAX_PARTS} parts")
    out, pos, seen = [], 4, set()
    for e in entries:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int)
                and not isinstance(e[1], bool) and e[1] >= 0):
            raise CodecError(f"theta parts blob header is invalid: entry {e!r:.60} is not [name, size]")
        name, size = e
        if name in seen:
            raise CodecError(f"theta parts blob names part {name!r:.60} twice")
        seen.add(name)
        if pos + size > end:
            raise CodecError(f"theta parts blob truncated in part {name!r:.60}")
        out.append((name, pos, pos + size))
        pos += size
    if pos != end:
        raise CodecError(f"theta parts blob has {end - pos} stray bytes between its parts and its index")
    return out


def parts_nbytes(blob: "bytes | bytearray | memoryview") -> int:
    """The bytes every part of a parts blob decodes to, from its checked headers (nothing is decoded)."""
    blob = memoryview(blob).cast("B")
    return sum(_array_layout(blob[a:b]).nbytes for _, a, b in _parts_index(blob))


def decode_parts(blob: "bytes | bytearray | memoryview", max_bytes: int | None = None,
                 checksums: bool = False) -> dict[str, np.ndarray]:
    """The named arrays of a parts blob. ``max_bytes``: refuse, before decoding anything, parts that would
    decode to more than this many bytes in all; ``checksums``: every zstd frame must carry a checksum."""
    blob = memoryview(blob).cast("B")
    index = _parts_index(blob)
    if max_bytes is not None:
        total = sum(_array_layout(blob[a:b]).nbytes for _, a, b in index)
        if total > max_bytes:
            raise CodecError(f"theta parts blob decodes to {total} bytes, more than the {max_bytes} this step "
                             f"can need")
    return {name: decode_array(blob[a:b], checksums=checksums) for name, a, b in index}


def part_blobs(blob: "bytes | bytearray | memoryview") -> dict[str, memoryview]:
    """The array blobs of a parts blob by name (views into ``blob``, nothing decoded; index checked)."""
    blob = memoryview(blob).cast("B")
    return {name: blob[a:b] for name, a, b in _parts_index(blob)}


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
        for _name, a, b in _parts_index(blob):
            part = blob[a:b]
            off = 4
            for _count, sizes in _array_layout(part).frames:
                for c in sizes:
                    if not zstandard.get_frame_parameters(part[off:off + c]).has_checksum:
                        return False
                    off += c
        return True
    except (CodecError, zstandard.ZstdError):
        return False
