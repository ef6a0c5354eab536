"""Read what Git-Theta 0.2.0 committed: its metadata text, its parameter blobs, its update chains.

Pure functions over bytes; git and git-lfs are reached only through the ``read_object`` callback the caller
passes to :func:`resolve_group` / :func:`resolve_file`. docs/design/git-theta-format.md describes the format.

* :func:`is_git_theta_metadata` sniffs a blob (cheap, structural; never raises).
* :func:`parse_metadata` validates a metadata text into :class:`FileMetadata` (groups in text order) or raises
  :class:`~theta.base.errors.GitThetaFormatError` naming file, group and field.
* :func:`decode_group_blob` turns one group's LFS object (a msgpack map of zarr v2 arrays written by
  tensorstore, blosc-compressed) into ``{part name: array}``. The arrays are read by zarr (optional extra
  ``gittheta``); every ``.zarray`` and every chunk header is validated first, so zarr and blosc only ever see a
  complete chunk grid whose sizes agree with the declared shape and dtype.
* :func:`apply_sparse`, :func:`apply_low_rank`, :func:`apply_ia3` compute previous -> new exactly as Git-Theta
  0.2.0 does (the same numpy operations in the same order, numpy's dtype promotion): bit for bit for sparse and
  ia3 (elementwise); low-rank's ``R @ C`` goes through BLAS and may differ in the last bit on another build.
* :func:`resolve_group` / :func:`resolve_file` follow a group's ``last_commit`` references back to its dense
  value, then apply the updates oldest first.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Union

import msgpack
import numpy as np
from zipslice import optional

from theta.base.errors import (BlobCorruptError, BlobMissingError, GitThetaFormatError, GitThetaUpdateTypeError,
                               ThetaDependencyError)
from theta.base.matmul import matmul_shape

KNOWN_UPDATE_TYPES = ("dense", "sparse", "low-rank", "ia3")

# numpy dtype names Git-Theta records (str(array.dtype) of what torch's .numpy() returns).
METADATA_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                             "float16", "float32", "float64", "complex64", "complex128"})
# The zarr v2 dtype strings those arrays get (tensorstore writes dtype.str); either byte order is read.
ZARR_DTYPES = frozenset({"|b1", "|i1", "|u1"} | {o + t for o in "<>" for t in
                                                   ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")})
BLOSC_CNAMES = frozenset({"lz4", "lz4hc", "blosclz", "zlib", "zstd"})
BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes

MAX_NDIM = 64          # numpy's own limit
MAX_PARTS = 16         # the most any built-in update stores is 4 (sparse)
MAX_LSH_LEN = 4096     # Git-Theta's signature has 16 entries (GIT_THETA_LSH_SIGNATURE_SIZE)
MAX_NESTING = 64       # metadata nests one level per checkpoint sub-dict
MAX_INT64 = 2**63 - 1

_OID = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_UPDATE_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SHAPE_0 = "()"
_SHAPE_1 = re.compile(r"\((\d{1,19}),\)")
_SHAPE_N = re.compile(r"\((\d{1,19}(?:, \d{1,19})+)\)")
_LFS_VERSION = re.compile(r"[^\s]{1,200}")


# ---------------------------------------------------------------- metadata text

@dataclass(frozen=True)
class TensorMetadata:
    """``tensor_metadata``: the value's shape and numpy dtype name, and Git-Theta's E2LSH signature."""

    shape: tuple[int, ...]
    dtype: str
    lsh: tuple[int, ...]


@dataclass(frozen=True)
class LfsMetadata:
    """``lfs_metadata``: the git-lfs pointer of the group's blob (Git-Theta writes ``size`` as a string)."""

    version: str
    oid: str
    size: int

    def pointer_text(self) -> str:
        """The git-lfs pointer file, byte for byte as Git-Theta hands it to ``git lfs smudge``."""
        return f"version {self.version}\noid sha256:{self.oid}\nsize {self.size}\n"


@dataclass(frozen=True)
class ThetaMetadata:
    """``theta_metadata``: how the blob makes the value, and the commit holding the previous value.

    ``last_commit`` is HEAD when the group was cleaned (None when that was the first commit); incremental
    types (sparse, low-rank, ia3) apply their blob to the group's value in ``last_commit``.
    """

    update_type: str
    last_commit: str | None


@dataclass(frozen=True)
class GroupMetadata:
    """One parameter group: ``key`` is its path in the (possibly nested) checkpoint dict."""

    key: tuple[str, ...]
    tensor: TensorMetadata
    lfs: LfsMetadata
    theta: ThetaMetadata

    @property
    def name(self) -> str:
        """Git-Theta's display name: the key joined with "/" (a torch state-dict key as is)."""
        return "/".join(self.key)


@dataclass(frozen=True)
class FileMetadata:
    """A Git-Theta metadata text: its groups in text order (the order Git-Theta writes the checkout in)."""

    file: str
    groups: dict[tuple[str, ...], GroupMetadata] = field(default_factory=dict)

    def group(self, name: "str | tuple[str, ...]") -> GroupMetadata | None:
        """The group with this key (tuple) or display name (str), or None."""
        if isinstance(name, tuple):
            return self.groups.get(name)
        found = self.groups.get((name,))
        if found is None:
            found = next((g for g in self.groups.values() if g.name == name), None)
        return found


def is_git_theta_metadata(data: "bytes | str") -> bool:
    """True when ``data`` looks like Git-Theta metadata: a JSON object whose leaves are objects holding
    ``lfs_metadata`` (``{}``, an empty checkpoint's metadata, counts). Structural only: :func:`parse_metadata`
    validates. Never raises."""
    try:
        text = bytes(data).decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        if not text.lstrip().startswith("{"):
            return False
        tree = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            return False
        if "lfs_metadata" in node:
            if not all(isinstance(node.get(k), dict) for k in ("tensor_metadata", "lfs_metadata", "theta_metadata")):
                return False
            continue
        stack.extend(node.values())
    return True


def parse_metadata(data: "bytes | str", file: str = "<metadata>") -> FileMetadata:
    """Validate a Git-Theta metadata text; raise :class:`GitThetaFormatError` naming file, group and field.

    Accepts what Git-Theta 0.2.0 writes (nested objects down to leaves holding ``tensor_metadata``,
    ``lfs_metadata`` and ``theta_metadata``; unknown extra keys in a leaf are ignored, as Git-Theta does).
    The update type is checked for shape only: an unknown one is reported when a value is resolved."""
    try:
        text = bytes(data).decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as e:
        raise GitThetaFormatError(f"not UTF-8 ({e})", file=file) from None
    try:
        tree = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise GitThetaFormatError(f"not valid JSON ({e})", file=file) from None
    if not isinstance(tree, dict):
        raise GitThetaFormatError(f"expected a JSON object at the top, got {type(tree).__name__}", file=file)
    meta = FileMetadata(file)
    for key, leaf in _leaves(tree, (), file):
        group = _parse_group(key, leaf, file)
        meta.groups[key] = group
    return meta


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _leaves(node: dict, prefix: tuple[str, ...], file: str) -> Iterator[tuple[tuple[str, ...], dict]]:
    """Depth-first in text order, like Git-Theta's flatten: an object holding ``lfs_metadata`` is a leaf."""
    for k, v in node.items():
        key = prefix + (k,)
        if not isinstance(v, dict):
            raise GitThetaFormatError(f"expected an object (nested groups or a group's metadata), got "
                                      f"{type(v).__name__}", file=file, group="/".join(key))
        if "lfs_metadata" in v:
            yield key, v
        elif len(key) >= MAX_NESTING:
            raise GitThetaFormatError(f"nested deeper than {MAX_NESTING} levels", file=file, group="/".join(key))
        else:
            yield from _leaves(v, key, file)


def _parse_group(key: tuple[str, ...], leaf: dict, file: str) -> GroupMetadata:
    group = "/".join(key)

    def section(name: str) -> dict:
        v = leaf.get(name)
        if not isinstance(v, dict):
            raise GitThetaFormatError("missing or not an object", file=file, group=group, field=name)
        return v

    def need(sec: dict, sec_name: str, name: str, kind: type | tuple) -> Any:
        if name not in sec:
            raise GitThetaFormatError("missing", file=file, group=group, field=f"{sec_name}.{name}")
        v = sec[name]
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise GitThetaFormatError(f"expected {_kind_name(kind)}, got {type(v).__name__} {_short(v)}",
                                      file=file, group=group, field=f"{sec_name}.{name}")
        return v

    tm, lm, th = section("tensor_metadata"), section("lfs_metadata"), section("theta_metadata")

    shape_text = need(tm, "tensor_metadata", "shape", str)
    shape = _parse_shape(shape_text)
    if shape is None:
        raise GitThetaFormatError(f"expected a Python tuple of sizes such as '(8, 6)', '(8,)' or '()', got "
                                  f"{_short(shape_text)}", file=file, group=group, field="tensor_metadata.shape")
    if len(shape) > MAX_NDIM or math.prod(shape) > MAX_INT64:
        raise GitThetaFormatError(f"shape {shape_text} is too large", file=file, group=group,
                                  field="tensor_metadata.shape")
    dtype = need(tm, "tensor_metadata", "dtype", str)
    if dtype not in METADATA_DTYPES:
        raise GitThetaFormatError(f"unsupported dtype {_short(dtype)} (expected one of {sorted(METADATA_DTYPES)})",
                                  file=file, group=group, field="tensor_metadata.dtype")
    lsh = need(tm, "tensor_metadata", "hash", list)
    if len(lsh) > MAX_LSH_LEN or not all(isinstance(x, int) and not isinstance(x, bool) for x in lsh):
        raise GitThetaFormatError(f"expected a list of at most {MAX_LSH_LEN} integers", file=file, group=group,
                                  field="tensor_metadata.hash")

    version = need(lm, "lfs_metadata", "version", str)
    if not _LFS_VERSION.fullmatch(version):
        raise GitThetaFormatError(f"expected a git-lfs spec URL without spaces, got {_short(version)}",
                                  file=file, group=group, field="lfs_metadata.version")
    oid = need(lm, "lfs_metadata", "oid", str)
    if not _OID.fullmatch(oid):
        raise GitThetaFormatError(f"expected 64 lowercase hex digits (a sha256), got {_short(oid)}",
                                  file=file, group=group, field="lfs_metadata.oid")
    size_v = need(lm, "lfs_metadata", "size", (str, int))
    if isinstance(size_v, str) and not re.fullmatch(r"\d{1,19}", size_v) or isinstance(size_v, int) and size_v < 0:
        raise GitThetaFormatError(f"expected a non-negative byte count, got {_short(size_v)}", file=file,
                                  group=group, field="lfs_metadata.size")
    size = int(size_v)
    if size > MAX_INT64:
        raise GitThetaFormatError(f"byte count {size} is too large", file=file, group=group, field="lfs_metadata.size")

    update_type = need(th, "theta_metadata", "update_type", str)
    if not _UPDATE_TYPE.fullmatch(update_type):
        raise GitThetaFormatError(f"expected an update type name, got {_short(update_type)}", file=file,
                                  group=group, field="theta_metadata.update_type")
    if "last_commit" not in th:
        raise GitThetaFormatError("missing", file=file, group=group, field="theta_metadata.last_commit")
    last_commit = th["last_commit"]
    if last_commit == "":
        last_commit = None  # Git-Theta treats any false value as "no previous version"
    if last_commit is not None and not (isinstance(last_commit, str) and _COMMIT.fullmatch(last_commit)):
        raise GitThetaFormatError(f"expected null or a commit id (40 or 64 lowercase hex digits), got "
                                  f"{_short(last_commit)}", file=file, group=group, field="theta_metadata.last_commit")
    return GroupMetadata(key, TensorMetadata(shape, dtype, tuple(lsh)), LfsMetadata(version, oid, size),
                         ThetaMetadata(update_type, last_commit))


def _parse_shape(text: str) -> tuple[int, ...] | None:
    if text == _SHAPE_0:
        return ()
    m = _SHAPE_1.fullmatch(text) or _SHAPE_N.fullmatch(text)
    return tuple(int(x) for x in m.group(1).split(", ")) if m else None


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", int: "an integer", list: "a list", dict: "an object", bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "...'"


# ---------------------------------------------------------------- parameter blobs

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
        z = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(z, dict):
        raise bad("not a JSON object")
    if z.get("zarr_format") != 2:
        raise bad(f"zarr_format must be 2, got {_short(z.get('zarr_format'))}")
    shape, chunks = z.get("shape"), z.get("chunks")
    if not _int_list(shape, 0) or not _int_list(chunks, 1) or len(shape) != len(chunks) or len(shape) > MAX_NDIM:
        raise bad(f"shape {_short(shape)} and chunks {_short(chunks)} must be lists of the same length "
                  f"(at most {MAX_NDIM}) of sizes >= 0 and >= 1")
    dtype_s = z.get("dtype")
    if dtype_s not in ZARR_DTYPES:
        raise bad(f"unsupported dtype {_short(dtype_s)} (expected one of {sorted(ZARR_DTYPES)})")
    dtype = np.dtype(dtype_s)
    if math.prod(shape) * dtype.itemsize > MAX_INT64 or math.prod(chunks) * dtype.itemsize > MAX_INT64:
        raise bad(f"shape {shape} / chunks {chunks} are too large")
    order = z.get("order", "C")
    if order not in ("C", "F"):
        raise bad(f"order must be 'C' or 'F', got {_short(order)}")
    separator = z.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise bad(f"dimension_separator must be '.' or '/', got {_short(separator)}")
    if z.get("filters") not in (None, []):
        raise bad(f"filters are not supported (Git-Theta writes none), got {_short(z.get('filters'))}")
    fill = z.get("fill_value")
    if not (fill is None or isinstance(fill, (int, float)) or fill in ("NaN", "Infinity", "-Infinity")):
        raise bad(f"unexpected fill_value {_short(fill)}")
    comp = z.get("compressor")
    if comp is not None:
        if not isinstance(comp, dict) or comp.get("id") != "blosc":
            raise bad(f"compressor must be blosc or null (what tensorstore writes for Git-Theta), got {_short(comp)}")
        extra = set(comp) - {"id", "cname", "clevel", "shuffle", "blocksize"}
        if extra or comp.get("cname") not in BLOSC_CNAMES or comp.get("shuffle") not in (-1, 0, 1, 2) \
                or not _small_int(comp.get("clevel"), 0, 9) or not _small_int(comp.get("blocksize", 0), 0, 2**31):
            raise bad(f"unexpected blosc settings {_short(comp, 200)}")
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
            raise GitThetaFormatError(f"unexpected file {_short(key)} (not a chunk of the grid {list(limits)})",
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


# ---------------------------------------------------------------- updates

def apply_update(update_type: str, parts: Mapping[str, np.ndarray], previous: np.ndarray, *,
                 file: str | None = None, group: str | None = None) -> np.ndarray:
    """previous -> new for one incremental update (sparse, low-rank or ia3), as Git-Theta 0.2.0 computes it."""
    apply = {"sparse": apply_sparse, "low-rank": apply_low_rank, "ia3": apply_ia3}.get(update_type)
    if apply is None:
        raise GitThetaUpdateTypeError(f"unknown update type {update_type!r} (theta reads Git-Theta's dense, "
                                      f"sparse, low-rank and ia3)", file=file, group=group,
                                      field="theta_metadata.update_type")
    try:
        new = apply(parts, previous)
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise GitThetaFormatError(f"cannot apply the {update_type} update to the previous value "
                                  f"{previous.dtype}{list(previous.shape)}: {e}", file=file, group=group) from None
    if new.shape != previous.shape:
        raise GitThetaFormatError(f"the {update_type} update turns shape {list(previous.shape)} into "
                                  f"{list(new.shape)}", file=file, group=group)
    return new


def apply_sparse(parts: Mapping[str, np.ndarray], previous: np.ndarray) -> np.ndarray:
    """``csr((data, indices, indptr), shape=(1, prod(shape))).toarray().reshape(shape) + previous``: the
    densified update starts from zeros of data's dtype and each entry is added in order (duplicates sum)."""
    _no_parameter(parts, "sparse")
    data, indices, indptr, shape = (np.asarray(parts[k]) for k in ("data", "indices", "indptr", "shape"))
    if data.ndim != 1 or indices.ndim != 1 or indptr.ndim != 1 or shape.ndim != 1:
        raise ValueError("data, indices, indptr and shape must be 1-d")
    for name, a in (("indices", indices), ("indptr", indptr), ("shape", shape)):
        if a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got {a.dtype}")
    if len(indptr) != 2 or indptr[0] != 0 or indptr[1] != len(data) or len(indices) != len(data):
        raise ValueError(f"indptr {indptr.tolist()} must be [0, len(data)={len(data)}] with as many indices")
    dims = tuple(int(d) for d in shape)
    if dims != previous.shape:
        raise ValueError(f"update shape {list(dims)} differs from the previous value's")
    n = math.prod(dims)
    if len(indices) and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(f"indices must lie in [0, {n})")
    dense = np.zeros(n, dtype=data.dtype)
    np.add.at(dense, indices, data)
    return _plus_previous(np.reshape(dense, dims), previous)


def apply_low_rank(parts: Mapping[str, np.ndarray], previous: np.ndarray) -> np.ndarray:
    """``R @ C + previous``; a stored ``parameter`` (Git-Theta's computed update of a 1-d group) is a plain
    difference: ``parameter + previous``."""
    if "parameter" in parts:
        return parts["parameter"] + previous
    R, C = parts["R"], parts["C"]
    shape = matmul_shape(np.shape(R), np.shape(C))  # (checked first: no product larger than the group is made)
    if shape != np.shape(previous):
        raise ValueError(f"R {list(np.shape(R))} @ C {list(np.shape(C))} gives shape {list(shape)}, not the previous "
                         f"value's")
    return _plus_previous(R @ C, previous)


def _plus_previous(update: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """``update + previous`` for an ``update`` this module just computed: added in place when that gives the
    same array (same shape, and numpy's promotion keeps update's dtype), so the group is held twice (previous
    and the result), not three times; the same bits, element by element, in the same operand order."""
    if update.shape == np.shape(previous) and np.result_type(update, previous) == update.dtype:
        return np.add(update, previous, out=update)
    return update + previous


def apply_ia3(parts: Mapping[str, np.ndarray], previous: np.ndarray) -> np.ndarray:
    """``previous * ia3`` (ia3 broadcasts, e.g. shape (out, 1) scales the rows of a weight)."""
    _no_parameter(parts, "ia3")
    return previous * parts["ia3"]


def _no_parameter(parts: Mapping[str, np.ndarray], update_type: str) -> None:
    # Git-Theta's read() hands a lone "parameter" array to apply_update, which then fails on it.
    if "parameter" in parts:
        raise ValueError(f"a {update_type} blob holds named parts, not 'parameter'")


# ---------------------------------------------------------------- update chains

@dataclass(frozen=True)
class GitBlob:
    """Ask ``read_object`` for the blob at ``commit:path`` (None if the path is absent there)."""

    commit: str
    path: str


@dataclass(frozen=True)
class LfsObject:
    """Ask ``read_object`` for the content of a git-lfs object (None if it cannot be had)."""

    oid: str
    size: int
    pointer: str  # the pointer text, for readers that go through `git lfs smudge`


ObjectRef = Union[GitBlob, LfsObject]
ReadObject = Callable[["str | Path", ObjectRef], "bytes | None"]


class ChainResolver:
    """Values of one tracked file's groups, following Git-Theta's ``last_commit`` references.

    Metadata texts read along the way are cached per commit, so resolving every group of a file reads each
    earlier commit's metadata once. Blobs are checked against their oid and size before decoding."""

    def __init__(self, repo_dir: "str | Path", path: str, read_object: ReadObject, *, max_bytes: int | None = None):
        self.repo_dir, self.path, self.read_object, self.max_bytes = repo_dir, path, read_object, max_bytes
        self._metadata: dict[str, FileMetadata | None] = {}

    def metadata_at(self, commit: str) -> FileMetadata | None:
        if commit not in self._metadata:
            raw = self.read_object(self.repo_dir, GitBlob(commit, self.path))
            self._metadata[commit] = None if raw is None else parse_metadata(raw, f"{commit}:{self.path}")
        return self._metadata[commit]

    def chain(self, group: GroupMetadata, where: str | None = None) -> list[tuple[GroupMetadata, str]]:
        """``[(group, its metadata text's name), ...]`` from ``group`` back to its dense value (the last item).

        Raises :class:`GitThetaUpdateTypeError` for an update type theta cannot apply and
        :class:`GitThetaFormatError` for a broken reference (null, missing file or group, loop)."""
        chain = [(group, where or self.path)]
        seen: set[str] = set()
        while chain[-1][0].theta.update_type != "dense":
            g, gfile = chain[-1]
            if g.theta.update_type not in KNOWN_UPDATE_TYPES:
                raise GitThetaUpdateTypeError(
                    f"unknown update type {g.theta.update_type!r} (theta reads Git-Theta's dense, sparse, low-rank "
                    f"and ia3)", file=gfile, group=g.name, field="theta_metadata.update_type")
            prev_commit = g.theta.last_commit
            if prev_commit is None:
                raise GitThetaFormatError(f"{g.theta.update_type} update without a previous version "
                                          f"(last_commit is null)", file=gfile, group=g.name,
                                          field="theta_metadata.last_commit")
            if prev_commit in seen:
                raise GitThetaFormatError(f"update chain loops back to commit {prev_commit}", file=gfile,
                                          group=g.name, field="theta_metadata.last_commit")
            seen.add(prev_commit)
            prev_meta = self.metadata_at(prev_commit)
            if prev_meta is None:
                raise GitThetaFormatError(f"the previous version's commit {prev_commit} has no {self.path}",
                                          file=gfile, group=g.name, field="theta_metadata.last_commit")
            prev = prev_meta.groups.get(g.key)
            if prev is None:
                raise GitThetaFormatError(f"the previous version's commit {prev_commit} has no such group",
                                          file=gfile, group=g.name, field="theta_metadata.last_commit")
            chain.append((prev, prev_meta.file))
        return chain

    def resolve(self, group: GroupMetadata, where: str | None = None) -> np.ndarray:
        """The value Git-Theta checks out for ``group`` (whose metadata text is ``where``, for messages)."""
        chain = self.chain(group, where)
        base, base_file = chain[-1]
        value = self._dense(base, base_file)
        for g, gfile in reversed(chain[:-1]):
            parts = self._blob(g, gfile)
            value = apply_update(g.theta.update_type, parts, value, file=gfile, group=g.name)
            if value.shape != g.tensor.shape:
                raise GitThetaFormatError(f"the value's shape {list(value.shape)} differs from the metadata's "
                                          f"{list(g.tensor.shape)}", file=gfile, group=g.name)
        return value

    def _dense(self, g: GroupMetadata, file: str) -> np.ndarray:
        parts = self._blob(g, file)
        if set(parts) != {"parameter"}:
            raise GitThetaFormatError(f"a dense blob holds one array named 'parameter', found {sorted(parts)}",
                                      file=file, group=g.name)
        value = parts["parameter"]
        if value.shape != g.tensor.shape or str(value.dtype) != g.tensor.dtype:
            raise GitThetaFormatError(f"the blob holds {value.dtype}{list(value.shape)}, the metadata says "
                                      f"{g.tensor.dtype}{list(g.tensor.shape)}", file=file, group=g.name)
        return value

    def _blob(self, g: GroupMetadata, file: str) -> dict[str, np.ndarray]:
        lfs = g.lfs
        blob = self.read_object(self.repo_dir, LfsObject(lfs.oid, lfs.size, lfs.pointer_text()))
        if blob is None:
            raise BlobMissingError(lfs.oid, group=g.name, file=file, size=lfs.size)
        if len(blob) != lfs.size or hashlib.sha256(blob).hexdigest() != lfs.oid:
            raise BlobCorruptError(f"LFS object {lfs.oid} ({file}, group {g.name!r}) has {len(blob)} bytes and "
                                   f"sha256 {hashlib.sha256(blob).hexdigest()}; the metadata says {lfs.size} bytes")
        return decode_group_blob(blob, file=file, group=g.name, max_bytes=self.max_bytes)


def resolve_group(repo_dir: "str | Path", path: str, commit: str, group_name: "str | tuple[str, ...]",
                  read_object: ReadObject, *, max_bytes: int | None = None) -> np.ndarray:
    """The value Git-Theta 0.2.0 checks out for ``group_name`` of ``path`` in ``commit``.

    ``read_object(repo_dir, ref)`` returns the bytes of a :class:`GitBlob` (the text at ``commit:path``) or of
    an :class:`LfsObject` (e.g. through ``git lfs smudge`` of ``ref.pointer``), or None when absent."""
    resolver = ChainResolver(repo_dir, path, read_object, max_bytes=max_bytes)
    meta = resolver.metadata_at(commit)
    if meta is None:
        raise GitThetaFormatError(f"commit {commit} has no {path}", file=f"{commit}:{path}")
    group = meta.group(group_name)
    if group is None:
        raise GitThetaFormatError("no such group", file=meta.file,
                                  group=group_name if isinstance(group_name, str) else "/".join(group_name))
    return resolver.resolve(group, meta.file)


def resolve_file(repo_dir: "str | Path", path: str, metadata: FileMetadata, read_object: ReadObject, *,
                 max_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, value)`` for every group of ``metadata`` (the text at ``path``, e.g. handed to a smudge filter),
    in text order, one group at a time; earlier commits' metadata is read once for the whole file."""
    resolver = ChainResolver(repo_dir, path, read_object, max_bytes=max_bytes)
    for group in metadata.groups.values():
        yield group.name, resolver.resolve(group, metadata.file)
