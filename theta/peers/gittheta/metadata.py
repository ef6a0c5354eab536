"""Git-Theta 0.2.0's metadata text: sniffed (:func:`is_git_theta_metadata`, cheap, never raises) and validated
(:func:`parse_metadata`: groups in text order, or a GitThetaFormatError naming file, group and field)
(docs/design/git-theta-format.md)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from theta.base.errors import GitThetaFormatError

KNOWN_UPDATE_TYPES = ("dense", "sparse", "low-rank", "ia3")

# numpy dtype names Git-Theta records (str(array.dtype) of what torch's .numpy() returns).
METADATA_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                             "float16", "float32", "float64", "complex64", "complex128"})
# The zarr v2 dtype strings those arrays get (tensorstore writes dtype.str); either byte order is read.

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
        tree = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        raise GitThetaFormatError(f"not valid JSON ({e})", file=file) from None
    if not isinstance(tree, dict):
        raise GitThetaFormatError(f"expected a JSON object at the top, got {type(tree).__name__}", file=file)
    meta = FileMetadata(file)
    for key, leaf in _leaves(tree, (), file):
        group = _parse_group(key, leaf, file)
        meta.groups[key] = group
    return meta


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def no_constant(name: str) -> Any:
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
            raise GitThetaFormatError(f"expected {_kind_name(kind)}, got {type(v).__name__} {short(v)}",
                                      file=file, group=group, field=f"{sec_name}.{name}")
        return v

    tm, lm, th = section("tensor_metadata"), section("lfs_metadata"), section("theta_metadata")

    shape_text = need(tm, "tensor_metadata", "shape", str)
    shape = _parse_shape(shape_text)
    if shape is None:
        raise GitThetaFormatError(f"expected a Python tuple of sizes such as '(8, 6)', '(8,)' or '()', got "
                                  f"{short(shape_text)}", file=file, group=group, field="tensor_metadata.shape")
    if len(shape) > MAX_NDIM or math.prod(shape) > MAX_INT64:
        raise GitThetaFormatError(f"shape {shape_text} is too large", file=file, group=group,
                                  field="tensor_metadata.shape")
    dtype = need(tm, "tensor_metadata", "dtype", str)
    if dtype not in METADATA_DTYPES:
        raise GitThetaFormatError(f"unsupported dtype {short(dtype)} (expected one of {sorted(METADATA_DTYPES)})",
                                  file=file, group=group, field="tensor_metadata.dtype")
    lsh = need(tm, "tensor_metadata", "hash", list)
    if len(lsh) > MAX_LSH_LEN or not all(isinstance(x, int) and not isinstance(x, bool) for x in lsh):
        raise GitThetaFormatError(f"expected a list of at most {MAX_LSH_LEN} integers", file=file, group=group,
                                  field="tensor_metadata.hash")

    version = need(lm, "lfs_metadata", "version", str)
    if not _LFS_VERSION.fullmatch(version):
        raise GitThetaFormatError(f"expected a git-lfs spec URL without spaces, got {short(version)}",
                                  file=file, group=group, field="lfs_metadata.version")
    oid = need(lm, "lfs_metadata", "oid", str)
    if not _OID.fullmatch(oid):
        raise GitThetaFormatError(f"expected 64 lowercase hex digits (a sha256), got {short(oid)}",
                                  file=file, group=group, field="lfs_metadata.oid")
    size_v = need(lm, "lfs_metadata", "size", (str, int))
    if isinstance(size_v, str) and not re.fullmatch(r"\d{1,19}", size_v) or isinstance(size_v, int) and size_v < 0:
        raise GitThetaFormatError(f"expected a non-negative byte count, got {short(size_v)}", file=file,
                                  group=group, field="lfs_metadata.size")
    size = int(size_v)
    if size > MAX_INT64:
        raise GitThetaFormatError(f"byte count {size} is too large", file=file, group=group, field="lfs_metadata.size")

    update_type = need(th, "theta_metadata", "update_type", str)
    if not _UPDATE_TYPE.fullmatch(update_type):
        raise GitThetaFormatError(f"expected an update type name, got {short(update_type)}", file=file,
                                  group=group, field="theta_metadata.update_type")
    if "last_commit" not in th:
        raise GitThetaFormatError("missing", file=file, group=group, field="theta_metadata.last_commit")
    last_commit = th["last_commit"]
    if last_commit == "":
        last_commit = None  # Git-Theta treats any false value as "no previous version"
    if last_commit is not None and not (isinstance(last_commit, str) and _COMMIT.fullmatch(last_commit)):
        raise GitThetaFormatError(f"expected null or a commit id (40 or 64 lowercase hex digits), got "
                                  f"{short(last_commit)}", file=file, group=group, field="theta_metadata.last_commit")
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


def short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "...'"
