"""safetensors: a validating lazy reader and a streaming writer, without the safetensors library.

Layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length N,
N bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the byte buffer. Offsets are relative to the buffer, which every tensor must cover exactly: no
overlaps, no holes, nothing after the last tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from . import dtypes
from .base import LazyCheckpoint
from .jsonutil import loads_strict
from .errors import DuplicateKey, CorruptCheckpointError, UnsupportedCheckpointError, ZipsliceError
from .fileio import atomic_output
from .info import TensorInfo, TensorSource, contiguous_stride

MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces
METADATA_KEY = "__metadata__"

# Every dtype code of the current spec, in the order of the library's Dtype enum (increasing width).
# The library writes tensors sorted by this order descending (widest alignment first), then by name.
SPEC_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_RANK = {code: i for i, code in enumerate(SPEC_DTYPE_ORDER)}
# Sub-byte codes of the spec with no byte-addressable torch/numpy dtype.
SUBBYTE_CODES = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str          # canonical zipslice dtype name
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_header(raw: bytes, path: str) -> tuple[list[_Entry], dict[str, str]]:
    """Decode and validate a header's JSON; entries come back unsorted, metadata as given."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(path, f"safetensors header is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        header = loads_strict(text)
    except DuplicateKey as e:
        raise CorruptCheckpointError(path, "safetensors header has a duplicate key", str(e)) from None
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(path, f"safetensors header is not valid JSON: {e}") from None
    except RecursionError:
        raise CorruptCheckpointError(path, "safetensors header nests JSON too deeply to be a header") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(path, f"safetensors header is a JSON {type(header).__name__}, not an object")

    metadata = header.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(path, "safetensors __metadata__ must map strings to strings", METADATA_KEY)

    entries = []
    for name, spec in header.items():
        entries.append(_parse_entry(name, spec, path))
    return entries, metadata


def _parse_entry(name: str, spec: Any, path: str) -> _Entry:
    if not isinstance(spec, dict):
        raise CorruptCheckpointError(path, "tensor entry is not a JSON object", name)
    for field in ("dtype", "shape", "data_offsets"):
        if field not in spec:
            raise CorruptCheckpointError(path, f"tensor entry lacks {field!r}", name)
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str):
        raise CorruptCheckpointError(path, f"dtype {code!r} is not a string", name)
    if code in SUBBYTE_CODES:
        raise UnsupportedCheckpointError(
            path, f"dtype {code} (sub-byte float) has no byte-addressable torch/numpy dtype; zipslice cannot read it",
            name)
    dt = dtypes.BY_SAFETENSORS.get(code)
    if dt is None:
        raise CorruptCheckpointError(
            path, f"unknown dtype {code!r}; the safetensors spec knows {', '.join(SPEC_DTYPE_ORDER)}", name)
    if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
        raise CorruptCheckpointError(path, f"shape {shape!r} is not a list of non-negative integers", name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise CorruptCheckpointError(path, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end",
                                     name)
    begin, end = offsets
    expected = math.prod(shape) * dt.itemsize
    if end - begin != expected:
        raise CorruptCheckpointError(
            path, f"data_offsets span {end - begin} bytes but shape {shape} of {code} needs {expected}", name)
    return _Entry(name, dt.name, tuple(shape), begin, end)


def check_coverage(entries: list[_Entry], buffer_nbytes: int, path: str) -> list[_Entry]:
    """Sort by offsets and require the spans to tile the buffer exactly; returns the sorted entries."""
    ordered = sorted(entries, key=lambda e: (e.begin, e.end))
    pos, prev = 0, None
    for e in ordered:
        if e.begin < pos:
            raise CorruptCheckpointError(
                path, f"bytes {e.begin}..{e.end} overlap tensor {prev!r} (which ends at {pos})", e.name)
        if e.begin > pos:
            raise CorruptCheckpointError(
                path, f"hole: bytes {pos}..{e.begin} of the buffer belong to no tensor (the spec forbids gaps)",
                e.name)
        if e.end > buffer_nbytes:
            raise CorruptCheckpointError(
                path, f"bytes {e.begin}..{e.end} run past the end of the data ({buffer_nbytes} bytes; truncated?)",
                e.name)
        pos, prev = e.end, e.name
    if pos != buffer_nbytes:
        raise CorruptCheckpointError(
            path, f"{buffer_nbytes - pos} bytes after the last tensor belong to no tensor (the spec forbids them)")
    return ordered


class SafetensorsCheckpoint(LazyCheckpoint):
    """Lazy safetensors reader. Opening reads and validates only the header.

    Tensors are listed in file order (by data offset). ``metadata`` is the header's ``__metadata__``.
    """

    format = "safetensors"
    plain_spans = True  # every tensor is a plain span at its offset

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptCheckpointError(self.path, f"file has {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise CorruptCheckpointError(
                    self.path, f"safetensors header claims {n} bytes, over the {MAX_HEADER_BYTES}-byte limit")
            if n > size - 8:
                raise CorruptCheckpointError(
                    self.path, f"safetensors header claims {n} bytes but only {size - 8} follow (truncated?)")
            raw = f.read(n)
        entries, self.metadata = parse_header(raw, self.path)
        data_start = 8 + n
        for e in check_coverage(entries, size - data_start, self.path):
            nbytes = e.end - e.begin
            self._infos[e.name] = TensorInfo(
                name=e.name, dtype=e.dtype, shape=e.shape, stride=contiguous_stride(e.shape), storage=e.name,
                storage_offset=0, offset=data_start + e.begin, span_nbytes=nbytes, file=self.path,
                storage_nbytes=nbytes,
            )
        self.header_nbytes = n

    def _read_span(self, info: TensorInfo):
        # one positioned read, into a numpy buffer (huge pages: cheaper first touch than a bytearray)
        return self._read_at(info)


# -- writer ----------------------------------------------------------------------------------------------

def _code(src: TensorSource) -> str:
    code = dtypes.get(src.dtype).safetensors
    if code is None:
        raise UnsupportedCheckpointError(None, f"safetensors has no dtype for {src.dtype}", src.name)
    return code


def library_order(sources: Iterable[TensorSource]) -> list[TensorSource]:
    """The order the safetensors library writes: widest dtype (enum order) first, then by name."""
    return sorted(sources, key=lambda s: (-_RANK[_code(s)], s.name))


def build_header(sources: list[TensorSource], metadata: dict[str, str] | None) -> bytes:
    """The padded header (length prefix included) for ``sources`` written in the given order."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must be a dict of str -> str")
        header[METADATA_KEY] = dict(metadata)
    pos = 0
    for s in sources:
        if s.name in header:
            raise ValueError(f"tensor name {s.name!r} appears twice (or clashes with {METADATA_KEY})")
        header[s.name] = {"dtype": _code(s), "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the library pads with spaces so the buffer starts 8-aligned
    if len(raw) > MAX_HEADER_BYTES:  # the reader (and the safetensors library) would refuse the file
        raise ValueError(f"the safetensors header would be {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    return struct.pack("<Q", len(raw)) + raw


def write(path: str | os.PathLike, sources: list[TensorSource], *, structure=None,
          metadata: dict[str, str] | None = None, **options) -> None:
    """Stream ``sources`` into a safetensors file at ``path`` (published atomically).

    Tensors are written in the safetensors library's order, so the output is byte-identical to
    ``safetensors.torch.save_file`` for the same tensors and no or single-key metadata. Tied sources
    are written once per name: the format has no shared storage. Each tensor is written piece by piece as
    its source gives it (:meth:`TensorSource.pieces`), the file's dirty pages bounded (:func:`atomic_output`).
    ``structure`` is accepted for interface symmetry and not stored (safetensors is a flat map of tensors).
    """
    if options:
        raise TypeError(f"unknown safetensors write options: {', '.join(sorted(options))}")
    path = os.fspath(path)
    ordered = library_order(sources)
    head = build_header(ordered, metadata)
    with atomic_output(path) as f:
        f.write(head)
        for s in ordered:
            got = 0
            for piece in s.pieces():  # never the whole tensor when the source streams
                got += piece.nbytes
                if got > s.nbytes:
                    break
                f.write(piece)
            if got != s.nbytes:
                raise ZipsliceError(path, f"source produced {'more than ' + str(s.nbytes) if got > s.nbytes else got} "
                                          f"bytes, expected {s.nbytes} ({s.dtype} {list(s.shape)})", s.name)
