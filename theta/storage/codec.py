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

import struct
import threading
from typing import Iterable, Iterator

import msgpack
import numpy as np
import zstandard

from zipslice import dtypes

from theta import parallel
from theta.errors import CodecError

ARRAY_MAGIC = b"THA2"
PARTS_MAGIC = b"THP2"
FRAME_BYTES = 8 << 20
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


def iter_encode_array(arr: np.ndarray, level: int = DEFAULT_LEVEL) -> Iterator[bytes]:
    """The blob of ``arr`` as byte strings in order, compressed on the codec threads a few frames ahead.

    Memory: the input plus at most ``2 * parallel.CODEC_THREADS`` compressed frames in flight.
    """
    try:
        dt = dtypes.from_numpy(arr.dtype)
    except KeyError as e:
        raise CodecError(f"cannot encode an array of dtype {arr.dtype}: {e}") from None
    arr = dtypes.little_endian(arr)
    raw = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    item = dt.itemsize
    per_frame = max(1, FRAME_BYTES // item) * item
    bounds = [(s, min(s + per_frame, raw.size)) for s in range(0, raw.size, per_frame)]
    planes = _uses_planes(dt)

    def work(b: tuple[int, int]) -> list[bytes]:
        frame = raw[b[0]:b[1]]
        c = _compressor(level, planes)
        if planes:
            grouped = frame.reshape(-1, item).T.copy()  # plane i = byte i of every element
            return [c.compress(grouped[i].data) for i in range(item)]
        return [c.compress(frame.data)]

    yield ARRAY_MAGIC
    frames = []
    for b, ps in zip(bounds, _ordered(work, bounds)):
        frames.append([(b[1] - b[0]) // item, [len(p) for p in ps]])
        yield from ps
    header = {"dtype": dt.name, "shape": list(arr.shape), "enc": "planes" if planes else "zstd", "frames": frames}
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


def decode_array(blob: "bytes | bytearray | memoryview") -> np.ndarray:
    """The array encoded by :func:`encode_array`, with its real dtype (ml_dtypes for bf16/float8) and shape."""
    blob = memoryview(blob).cast("B")
    header, payload_end = _trailer(blob, ARRAY_MAGIC, "array")
    pos = 4
    try:
        dt = dtypes.get(header["dtype"])
        shape = tuple(int(s) for s in header["shape"])
        enc, frames = header["enc"], header["frames"]
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"theta array blob header is invalid: {e}") from None
    if enc not in ("planes", "zstd") or any(s < 0 for s in shape):
        raise CodecError(f"theta array blob has unknown encoding {enc!r} or bad shape {shape}")
    item = dt.itemsize
    n = int(np.prod(shape, dtype=np.int64))
    if sum(f[0] for f in frames) != n:
        raise CodecError(f"theta array blob frames hold {sum(f[0] for f in frames)} elements, shape needs {n}")
    out = np.empty(n * item, dtype=np.uint8)
    jobs, start, off = [], 0, pos
    for count, sizes in frames:
        jobs.append((start, count, off, sizes))
        start += count * item
        off += sum(sizes)
    if off != payload_end:
        raise CodecError(f"theta array blob has {payload_end - 4} payload bytes, its frames say {off - 4}")

    def work(job) -> None:
        s, count, o, sizes = job
        d = _decompressor()
        dest = out[s:s + count * item]
        try:
            if enc == "planes":
                if len(sizes) != item:
                    raise CodecError(f"theta array blob frame has {len(sizes)} planes, dtype needs {item}")
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

    _map(work, jobs)
    return out.view(dt.to_numpy()).reshape(shape)


def iter_encode_parts(parts: dict[str, np.ndarray], level: int = DEFAULT_LEVEL) -> Iterator[bytes]:
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


def encode_parts_chunks(parts: dict[str, np.ndarray], level: int = DEFAULT_LEVEL) -> list[bytes]:
    return list(iter_encode_parts(parts, level))


def encode_parts(parts: dict[str, np.ndarray], level: int = DEFAULT_LEVEL) -> bytes:
    return b"".join(iter_encode_parts(parts, level))


def decode_parts(blob: "bytes | bytearray | memoryview") -> dict[str, np.ndarray]:
    blob = memoryview(blob).cast("B")
    header, end = _trailer(blob, PARTS_MAGIC, "parts")
    out: dict[str, np.ndarray] = {}
    pos = 4
    try:
        entries: Iterable = header["parts"]
        for name, size in entries:
            if pos + size > end:
                raise CodecError(f"theta parts blob truncated in part {name!r}")
            out[name] = decode_array(blob[pos:pos + size])
            pos += size
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"theta parts blob header is invalid: {e}") from None
    if pos != end:
        raise CodecError(f"theta parts blob has {end - pos} stray bytes between its parts and its index")
    return out


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
