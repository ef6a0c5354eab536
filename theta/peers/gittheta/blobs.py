"""Git-Theta 0.2.0's parameter blobs: one group's LFS object is a msgpack map of zarr v2 arrays written by tensorstore,
blosc-compressed (:func:`decode_group_blob`). The arrays are read by zarr (optional extra ``gittheta``); every
``.zarray`` and chunk header is validated first, so zarr and blosc only ever see a complete chunk grid whose sizes
agree with the declared shape and dtype."""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack
import numpy as np

from zipslice import optional

from theta.base.errors import GitThetaFormatError, ThetaDependencyError
from theta.peers.gittheta.metadata import MAX_INT64, MAX_NDIM, MAX_PARTS, no_constant, no_duplicate_keys, short

ZARR_DTYPES = frozenset({"|b1", "|i1", "|u1"} | {o + t for o in "<>" for t in
                                                   ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")})
BLOSC_CNAMES = frozenset({"lz4", "lz4hc", "blosclz", "zlib", "zstd"})
BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes


def decode_group_blob(blob: bytes, *, file: str | None = None, group: str | None = None,
                      max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """Decode one group's LFS object into ``{part: array}`` (native byte order, C order).

    Git-Theta stores ``{"parameter": value}`` for dense groups (and for a 1-d low-rank update) and the update's
    named parts otherwise (sparse: data/indices/indptr/shape, low-rank: R/C, ia3: ia3). ``max_bytes`` bounds the
    total decoded size (None: bounded only by the blob itself, since every chunk must be present and its blosc
    header must agree with the declared shape). Raises :class:`GitThetaFormatError` on anything malformed and
    :class:`ThetaDependencyError` when zarr (>= 3.1) is not installed."""
    try:
        outer = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated classes for corrupt input
        raise GitThetaFormatError(f"blob is not a msgpack map ({type(e).__name__}: {e})", file=file,
                                  group=group) from None
    if not isinstance(outer, dict) or not outer:
        raise GitThetaFormatError("blob is not a non-empty msgpack map of arrays", file=file, group=group)
    if len(outer) > MAX_PARTS:
        raise GitThetaFormatError(f"blob holds {len(outer)} arrays (at most {MAX_PARTS} expected)", file=file,
                                  group=group)
    parts = {}
    budget = max_bytes
    for name, files in outer.items():
        where = f"part {name!r}"
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()):
            raise GitThetaFormatError("expected a map of zarr file names to bytes", file=file, group=group, field=where)
        spec = _parse_zarray(files.get(".zarray"), file, group, where)
        if budget is not None and spec.nbytes > budget:
            raise GitThetaFormatError(f"decoding would take {spec.nbytes} bytes, over the limit of {max_bytes}",
                                      file=file, group=group, field=where)
        chunks = _check_chunks(spec, files, file, group, where)
        parts[name] = _read_zarr(spec, chunks, file, group, where)
        if budget is not None:
            budget -= spec.nbytes
    return parts


def part_dtypes(blob: bytes, *, file: str | None = None, group: str | None = None) -> dict[str, np.dtype]:
    """``{part name: dtype}`` of one group's LFS object from its ``.zarray`` headers alone (nothing is
    decompressed): what a writer needs before the values, e.g. the dtype numpy's promotion gives an update."""
    try:
        outer = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated classes for corrupt input
        raise GitThetaFormatError(f"blob is not a msgpack map ({type(e).__name__}: {e})", file=file,
                                  group=group) from None
    if not isinstance(outer, dict) or not outer or len(outer) > MAX_PARTS:
        raise GitThetaFormatError("blob is not a non-empty msgpack map of arrays", file=file, group=group)
    out = {}
    for name, files in outer.items():
        if not isinstance(name, str) or not isinstance(files, dict):
            raise GitThetaFormatError("expected a map of zarr file names to bytes", file=file, group=group,
                                      field=f"part {name!r}")
        out[name] = _parse_zarray(files.get(".zarray"), file, group, f"part {name!r}").dtype.newbyteorder("=")
    return out


def result_dtype(update_type: str, parts: Mapping[str, np.dtype], previous: np.dtype) -> np.dtype:
    """The dtype :func:`apply_update` gives (numpy's promotion, as in Git-Theta), from dtypes alone."""
    if update_type == "sparse":
        used = [parts["data"]] if "data" in parts else []
    else:
        used = [d for k, d in parts.items() if k in ("R", "C", "parameter", "ia3")]
    return np.result_type(previous, *used)


@dataclass(frozen=True)
class _ZarrSpec:
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    order: str
    separator: str
    compressor: dict | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks))

    def zarray(self) -> bytes:
        """The validated metadata, re-serialized: zarr only ever reads what was checked."""
        return json.dumps({"zarr_format": 2, "shape": list(self.shape), "chunks": list(self.chunks),
                           "dtype": self.dtype.str, "compressor": self.compressor, "fill_value": None,
                           "filters": None, "order": self.order, "dimension_separator": self.separator}).encode()


def _parse_zarray(raw: bytes | None, file, group, where) -> _ZarrSpec:
    def bad(problem: str) -> GitThetaFormatError:
        return GitThetaFormatError(problem, file=file, group=group, field=f"{where} .zarray")

    if raw is None:
        raise bad("missing")
    try:
        z = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys, parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(z, dict):
        raise bad("not a JSON object")
    if z.get("zarr_format") != 2:
        raise bad(f"zarr_format must be 2, got {short(z.get('zarr_format'))}")
    shape, chunks = z.get("shape"), z.get("chunks")
    if not _int_list(shape, 0) or not _int_list(chunks, 1) or len(shape) != len(chunks) or len(shape) > MAX_NDIM:
        raise bad(f"shape {short(shape)} and chunks {short(chunks)} must be lists of the same length "
                  f"(at most {MAX_NDIM}) of sizes >= 0 and >= 1")
    dtype_s = z.get("dtype")
    if dtype_s not in ZARR_DTYPES:
        raise bad(f"unsupported dtype {short(dtype_s)} (expected one of {sorted(ZARR_DTYPES)})")
    dtype = np.dtype(dtype_s)
    if math.prod(shape) * dtype.itemsize > MAX_INT64 or math.prod(chunks) * dtype.itemsize > MAX_INT64:
        raise bad(f"shape {shape} / chunks {chunks} are too large")
    order = z.get("order", "C")
    if order not in ("C", "F"):
        raise bad(f"order must be 'C' or 'F', got {short(order)}")
    separator = z.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise bad(f"dimension_separator must be '.' or '/', got {short(separator)}")
    if z.get("filters") not in (None, []):
        raise bad(f"filters are not supported (Git-Theta writes none), got {short(z.get('filters'))}")
    fill = z.get("fill_value")
    if not (fill is None or isinstance(fill, (int, float)) or fill in ("NaN", "Infinity", "-Infinity")):
        raise bad(f"unexpected fill_value {short(fill)}")
    comp = z.get("compressor")
    if comp is not None:
        if not isinstance(comp, dict) or comp.get("id") != "blosc":
            raise bad(f"compressor must be blosc or null (what tensorstore writes for Git-Theta), got {short(comp)}")
        extra = set(comp) - {"id", "cname", "clevel", "shuffle", "blocksize"}
        if extra or comp.get("cname") not in BLOSC_CNAMES or comp.get("shuffle") not in (-1, 0, 1, 2) \
                or not _small_int(comp.get("clevel"), 0, 9) or not _small_int(comp.get("blocksize", 0), 0, 2**31):
            raise bad(f"unexpected blosc settings {short(comp, 200)}")
        comp = {k: comp[k] for k in ("id", "cname", "clevel", "shuffle", "blocksize") if k in comp}
    return _ZarrSpec(tuple(shape), tuple(chunks), dtype, order, separator, comp)


def _int_list(v: Any, minimum: int) -> bool:
    return isinstance(v, list) and all(_small_int(x, minimum, MAX_INT64) for x in v)


def _small_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_chunks(spec: _ZarrSpec, files: dict[str, bytes], file, group, where) -> dict[str, bytes]:
    """Every chunk of the grid must be present (tensorstore writes them all when fill_value is null), under its
    key and with exactly the declared size, so nothing is left to a fill value and no blosc header lies."""
    chunks = {k: v for k, v in files.items() if k not in (".zarray", ".zattrs")}
    expected = math.prod(spec.grid)  # 1 for a 0-d array (key "0"), 0 when a dimension is 0
    if len(chunks) != expected:
        raise GitThetaFormatError(f"{len(chunks)} chunk(s) present, the shape {list(spec.shape)} in chunks of "
                                  f"{list(spec.chunks)} needs {expected}", file=file, group=group, field=where)
    for key, data in chunks.items():
        idx = key.split(spec.separator) if spec.shape else [key]
        limits = spec.grid if spec.shape else (1,)
        if len(idx) != len(limits) or not all(re.fullmatch(r"0|[1-9]\d{0,18}", i) and int(i) < g
                                              for i, g in zip(idx, limits)):
            raise GitThetaFormatError(f"unexpected file {short(key)} (not a chunk of the grid {list(limits)})",
                                      file=file, group=group, field=where)
        if spec.compressor is None:
            if len(data) != spec.chunk_nbytes:
                raise GitThetaFormatError(f"chunk {key} holds {len(data)} bytes, expected {spec.chunk_nbytes}",
                                          file=file, group=group, field=where)
            continue
        if len(data) < BLOSC_HEADER.size:
            raise GitThetaFormatError(f"chunk {key} is too short for a blosc header", file=file, group=group,
                                      field=where)
        _version, _vlz, _flags, _typesize, nbytes, _blocksize, cbytes = BLOSC_HEADER.unpack_from(data)
        if cbytes != len(data) or nbytes != spec.chunk_nbytes:
            raise GitThetaFormatError(f"chunk {key}: blosc header says {nbytes} bytes compressed to {cbytes}; "
                                      f"expected {spec.chunk_nbytes} compressed to {len(data)}", file=file,
                                      group=group, field=where)
    return chunks


def _read_zarr(spec: _ZarrSpec, chunks: dict[str, bytes], file, group, where) -> np.ndarray:
    zarr, MemoryStore, Buffer = _zarr()
    store = MemoryStore({".zarray": Buffer.from_bytes(spec.zarray()),
                         **{k: Buffer.from_bytes(v) for k, v in chunks.items()}}, read_only=True)
    try:
        value = np.asarray(zarr.open_array(store=store, mode="r", zarr_format=2)[...])
    except Exception as e:  # zarr/numcodecs raise assorted classes for corrupt chunks
        raise GitThetaFormatError(f"zarr could not read the array ({type(e).__name__}: {e})", file=file,
                                  group=group, field=where) from None
    if value.shape != spec.shape or value.dtype != spec.dtype:
        raise GitThetaFormatError(f"zarr returned {value.dtype}{list(value.shape)}, declared "
                                  f"{spec.dtype}{list(spec.shape)}", file=file, group=group, field=where)
    # astype, not ascontiguousarray: the latter turns a 0-d array into a 1-d one.
    return value.astype(value.dtype.newbyteorder("="), order="C", copy=False)


ZARR_NEEDED = "reading Git-Theta's parameter blobs needs zarr >= 3.1"


def _zarr():
    zarr = optional.require("zarr", ZARR_NEEDED, error=ThetaDependencyError)
    try:  # (zarr 2 has neither)
        from zarr.buffer.cpu import Buffer
        from zarr.storage import MemoryStore
    except ImportError:
        raise ThetaDependencyError("zarr", ZARR_NEEDED, "gittheta",
                                   problem=f"{getattr(zarr, '__version__', '?')} is installed") from None
    return zarr, MemoryStore, Buffer
