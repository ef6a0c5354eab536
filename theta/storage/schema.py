"""The schema of theta metadata, with limits: every field is checked before anything uses it.

A metadata text comes from a repository someone else may have written, so it is untrusted input. Each line's
JSON object is checked here (types, ranges, lengths, nesting) *before* it becomes a dataclass, and the same
checks run on what :func:`theta.storage.metadata.dumps` writes, so theta never writes what it would refuse to
read. A violation raises :class:`MetadataError` naming the file, the line, the group and the field.

The limits below (docs/design/security.md gives each one's reason) are high enough for real models and low
enough that nothing derived from a metadata text can exhaust memory or time before a blob is even read.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from zipslice import dtypes, torch_reader
from zipslice.errors import DuplicateKey
from zipslice.jsonutil import loads_strict

from theta.base import valuehash
from theta.base.errors import MetadataError
from theta.storage.codec import ZSTD_BLOCK_BYTES, ZSTD_MAX_RATIO

MAX_TEXT_BYTES = 1 << 30          # a whole metadata text (10^6 groups at ~1 KB a line)
MAX_GROUPS = 1_000_000            # groups + aliases of one file
MAX_NAME_CHARS = 4096             # a tensor name (real ones are < 300)
MAX_RANK = 64                     # numpy's own limit on dimensions
MAX_GROUP_BYTES = (1 << 63) - 1   # one group's bytes (numel x itemsize); the blob bounds it far lower
MAX_STEPS = 64                    # a chain (clean's theta.maxChain defaults to 8)
MAX_PARAMS_BYTES = 16 << 10       # one step's params, as JSON
MAX_PARAMS_DEPTH = 8              # nesting inside one step's params
MAX_LSH = 1024                    # one LSH signature (theta writes 16 numbers)
MAX_LSH_BITS = 1100               # one signature number: a float64 projection over the bucket width 1e-6
_LSH_BOUND = 1 << MAX_LSH_BITS
MAX_LSH_HEADER = 64               # entries of the checkpoint's LSH parameters
MAX_INT_BITS = 8192               # plain integers in the structure tree (Python parses 4300 digits at most)
MAX_DEVICE_CHARS = 64
# the torch reader's own limits, so theta never writes a torch file zipslice would refuse to read back
MAX_STRUCTURE_DEPTH = torch_reader.MAX_DEPTH          # containers nested (root = 0)
MAX_FILE_METADATA_BYTES = torch_reader.MAX_METADATA_BYTES  # file-level string metadata, JSON-encoded
# JSON nesting of one line: a container level of the structure tree costs three ({"dict":[[k, ...]]})
MAX_JSON_DEPTH = 3 * (MAX_STRUCTURE_DEPTH + 1) + 8
MAX_INT64 = (1 << 63) - 1

HEX64 = re.compile(r"[0-9a-f]{64}")
HEX32 = re.compile(r"[0-9a-f]{32}")
# update type names are entry-point names: lowercase words, never a module path ("os:system", "a.b")
STEP_TYPE = re.compile(r"[a-z][a-z0-9_-]{0,63}")
FORMAT = re.compile(r"[a-z][a-z0-9_-]{0,63}")
DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,9})?")
# C0/C1 control characters: never in a name (they would reach terminals and file systems)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# "xxh3": the value's fast hash (theta.updates.fast_hash), optional: text written before it has none
# "norms": ‖value‖₂ and the change from the previous value (theta.model.norms), optional likewise
GROUP_KEYS = {"group", "dtype", "shape", "hash", "steps", "lsh", "param", "grad", "xxh3", "norms"}
NORMS_KEYS = {"value", "from", "change", "changed"}
STEP_KEYS = {"type", "oid", "size", "params", "hash"}
ALIAS_KEYS = {"alias", "of", "param", "grad"}
CHECKPOINT_KEYS = {"format", "metadata", "lsh"}
OPAQUE_KEYS = {"oid", "size"}
# step params a chain uses to record a value's own layout (theta.updates.SHAPE_KEY / DTYPE_KEY)
LAYOUT_SHAPE, LAYOUT_DTYPE = "shape", "dtype"


_DEPTH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Where:
    """Where a value was found, for error messages: file, line number, group."""

    file: str | None = None
    line: int | None = None
    group: str | None = None

    def at(self, line: int | None = None, group: str | None = None) -> "Where":
        return Where(self.file, line if line is not None else self.line, group if group is not None else self.group)

    def fail(self, field: str | None, problem: str) -> MetadataError:
        parts = [self.file or "metadata"]
        if self.line is not None:
            parts.append(f"line {self.line}")
        if self.group is not None:
            parts.append(f"group {_show(self.group)}")
        if field:
            parts.append(f"field {field!r}")
        return MetadataError(": ".join(parts) + f": {problem}", file=self.file, group=self.group, field=field)


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- scalars -------------------------------------------------------------------------------------------
def _int(v: Any, where: Where, field: str, lo: int = 0, hi: int = MAX_INT64) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise where.fail(field, f"expected an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise where.fail(field, f"{_show(v)} is out of range [{lo}, {hi}]")
    return v


def _bool(v: Any, where: Where, field: str) -> bool:
    if not isinstance(v, bool):
        raise where.fail(field, f"expected true or false, got {_show(v)}")
    return v


def _hex64(v: Any, where: Where, field: str) -> str:
    if not isinstance(v, str) or not HEX64.fullmatch(v):
        raise where.fail(field, f"expected 64 lowercase hex digits (a sha256), got {_show(v)}")
    return v


def _value_name(v: Any, where: Where, field: str) -> str:
    if not valuehash.is_name(v):
        raise where.fail(field, f"expected a value hash (64 lowercase hex digits of a sha256, or 'blake3:' and "
                                f"64 of a BLAKE3), got {_show(v)}")
    return v


def name(v: Any, where: Where, field: str) -> str:
    """A tensor name: a non-empty string of at most MAX_NAME_CHARS characters, no control characters."""
    if not isinstance(v, str) or not v:
        raise where.fail(field, f"expected a non-empty string, got {_show(v)}")
    if len(v) > MAX_NAME_CHARS:
        raise where.fail(field, f"name of {len(v)} characters exceeds the limit of {MAX_NAME_CHARS}")
    if _CONTROL.search(v):
        raise where.fail(field, f"name {_show(v)} contains a control character")
    return v


def dtype(v: Any, where: Where, field: str = "dtype") -> str:
    if not isinstance(v, str) or v not in dtypes.BY_NAME:
        raise where.fail(field, f"unknown dtype {_show(v)}; known: {', '.join(dtypes.BY_NAME)}")
    return v


def shape(v: Any, where: Where, field: str, dtype_name: str) -> tuple[int, ...]:
    """A list of at most MAX_RANK non-negative ints whose bytes (with ``dtype_name``) fit MAX_GROUP_BYTES."""
    if not isinstance(v, list):
        raise where.fail(field, f"expected a list of dimensions, got {_show(v)}")
    if len(v) > MAX_RANK:
        raise where.fail(field, f"{len(v)} dimensions exceed the limit of {MAX_RANK}")
    dims = tuple(_int(d, where, field) for d in v)
    if nbytes(dims, dtype_name) > MAX_GROUP_BYTES:
        raise where.fail(field, f"shape {list(dims)} of {dtype_name} exceeds {MAX_GROUP_BYTES} bytes")
    return dims


def nbytes(dims: tuple[int, ...], dtype_name: str) -> int:
    return math.prod(dims) * dtypes.get(dtype_name).itemsize


# -- JSON values of bounded size and depth ----------------------------------------------------------------
def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in a JSON text, counting only brackets outside strings.

    Computed without recursion (json.loads recurses once per level and would hit the interpreter's limit
    on a hostile line first) and without regular expressions (a backtracking match over a long string costs
    memory per character): numpy finds the quotes that are not escaped (an even run of backslashes before
    them), the string state is their running parity, and the depth the running sum of the brackets outside
    strings -- chunk by chunk, carrying the state across, so memory stays within a few chunks.
    """
    opens = text.count("[") + text.count("{")
    if opens <= 1:
        return opens

    depth = deepest = 0
    in_string, pending = 0, 0  # inside a string at the chunk's start; backslashes ending the previous chunk
    for start in range(0, len(text), _DEPTH_CHUNK):
        b = np.frombuffer(text[start:start + _DEPTH_CHUNK].encode("utf-8", "surrogatepass"), np.uint8)
        n = b.size
        idx = np.arange(n, dtype=np.int64)
        last_other = np.maximum.accumulate(np.where(b != 0x5C, idx, -1))  # last non-backslash at or before i
        run = np.empty(n, dtype=np.int64)  # backslashes right before position i
        run[0] = pending
        run[1:] = idx[:-1] - last_other[:-1] + np.where(last_other[:-1] < 0, pending, 0)
        quote = (b == 0x22) & ((run & 1) == 0)
        quotes = np.cumsum(quote, dtype=np.int64)
        inside = ((quotes - quote) & 1) ^ in_string  # an odd count of quotes before i: inside a string
        step = np.where((b == 0x5B) | (b == 0x7B), 1, 0) - np.where((b == 0x5D) | (b == 0x7D), 1, 0)
        step[inside.astype(bool)] = 0
        if step.any():
            running = np.cumsum(step, dtype=np.int64) + depth
            deepest = max(deepest, int(running.max()))
            depth = int(running[-1])
        in_string ^= int(quotes[-1] & 1)
        pending = int(n - 1 - last_other[-1]) + (pending if last_other[-1] < 0 else 0)
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite numbers are not allowed)")


def parse_line(line: str, where: Where) -> Any:
    """One line's JSON value: nesting bounded before parsing, duplicate keys and NaN/Infinity refused."""
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH:  # else it cannot nest deeper than the limit
        depth = json_depth(line)
        if depth > MAX_JSON_DEPTH:
            raise where.fail(None, f"JSON nested {depth} levels deep, over the limit of {MAX_JSON_DEPTH}")

    try:
        return loads_strict(line)
    except RecursionError:  # defence in depth: json_depth should have refused it
        raise where.fail(None, "JSON nested too deeply") from None
    except DuplicateKey as e:
        raise where.fail(None, f"key {_show(str(e))} appears twice in one object") from None
    except ValueError as e:
        raise where.fail(None, f"not valid JSON: {e}: {_show(line, 60)}") from None


def _small_json(v: Any, where: Where, field: str, max_bytes: int, max_depth: int) -> None:
    """A JSON-able value whose encoding and nesting stay within the limits (iterative, no recursion)."""
    if not v:
        return  # {} -- most steps' params
    stack = [(v, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise where.fail(field, f"nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            for k, child in node.items():
                if not isinstance(k, str):
                    raise where.fail(field, f"key {_show(k)} is not a string")
                stack.append((child, depth + 1))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise where.fail(field, f"non-finite number {node}")
        elif not (node is None or isinstance(node, (str, int, bool))):
            raise where.fail(field, f"{type(node).__name__} is not a JSON value")
    size = len(json.dumps(v, separators=(",", ":"), ensure_ascii=False))
    if size > max_bytes:
        raise where.fail(field, f"{size} bytes of JSON exceed the limit of {max_bytes}")


def _keys(obj: dict, allowed: set[str], required: set[str], where: Where, kind: str) -> None:
    missing = required - set(obj)
    if missing:
        raise where.fail(sorted(missing)[0], f"a {kind} line needs this field")
    extra = set(obj) - allowed
    if extra:
        raise where.fail(sorted(extra)[0], f"unknown field in a {kind} line (known: {', '.join(sorted(allowed))})")


# -- lines -----------------------------------------------------------------------------------------------
def checkpoint(obj: Any, where: Where) -> tuple[str, dict[str, str], dict]:
    """The ``{"checkpoint": {...}}`` line: (format, file-level metadata, LSH parameters)."""
    if not isinstance(obj, dict):
        raise where.fail("checkpoint", f"expected an object, got {_show(obj)}")
    _keys(obj, CHECKPOINT_KEYS, {"format"}, where, "checkpoint")
    fmt = obj["format"]
    if not isinstance(fmt, str) or not FORMAT.fullmatch(fmt):
        raise where.fail("format", f"expected a format name ([a-z][a-z0-9_-]*), got {_show(fmt)}")
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise where.fail("metadata", "expected an object of strings to strings")
    encoded = len(json.dumps(meta, sort_keys=True))  # what the torch writer stores (ASCII escapes)
    if encoded > MAX_FILE_METADATA_BYTES:
        raise where.fail("metadata", f"file-level metadata of {encoded} bytes (JSON) exceeds the limit of "
                                     f"{MAX_FILE_METADATA_BYTES} bytes that zipslice reads back")
    lsh = obj.get("lsh") or {}
    if not isinstance(lsh, dict) or len(lsh) > MAX_LSH_HEADER or not all(
            isinstance(k, str) and len(k) <= 64 and (isinstance(v, (str, int, float)) and not isinstance(v, bool))
            for k, v in lsh.items()):
        raise where.fail("lsh", f"expected at most {MAX_LSH_HEADER} named numbers or strings")
    _small_json(lsh, where, "lsh", MAX_PARAMS_BYTES, 1)
    return fmt, dict(meta), dict(lsh)


def order(obj: Any, where: Where) -> list[str]:
    if not isinstance(obj, list):
        raise where.fail("order", f"expected a list of names, got {_show(obj)}")
    if len(obj) > MAX_GROUPS:
        raise where.fail("order", f"{len(obj)} names exceed the limit of {MAX_GROUPS} groups and aliases")
    return [name(n, where, "order") for n in obj]


def alias(obj: dict, where: Where) -> dict:
    where = where.at(group=obj.get("alias") if isinstance(obj.get("alias"), str) else None)
    _keys(obj, ALIAS_KEYS, {"alias", "of"}, where, "alias")
    name(obj["alias"], where, "alias")
    name(obj["of"], where, "of")
    for flag in ("param", "grad"):
        if flag in obj:
            _bool(obj[flag], where, flag)
    return obj


def step(obj: Any, where: Where, index: int, group_dtype: str) -> dict:
    field = f"steps[{index}]"
    if not isinstance(obj, dict):
        raise where.fail(field, f"expected an object, got {_show(obj)}")
    missing = {"type", "oid", "size", "hash"} - set(obj)
    if missing:
        raise where.fail(f"{field}.{sorted(missing)[0]}", "a step needs this field")
    extra = set(obj) - STEP_KEYS
    if extra:
        raise where.fail(f"{field}.{sorted(extra)[0]}", f"unknown field in a step (known: {', '.join(sorted(STEP_KEYS))})")
    kind = obj["type"]
    if not isinstance(kind, str) or not STEP_TYPE.fullmatch(kind):
        raise where.fail(f"{field}.type", f"expected an update type name ([a-z][a-z0-9_-]*), got {_show(kind)}")
    _hex64(obj["oid"], where, f"{field}.oid")
    _int(obj["size"], where, f"{field}.size")
    _value_name(obj["hash"], where, f"{field}.hash")
    params = obj.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise where.fail(f"{field}.params", f"expected an object, got {_show(params)}")
    _small_json(params, where, f"{field}.params", MAX_PARAMS_BYTES, MAX_PARAMS_DEPTH)
    layout_dtype = group_dtype
    if LAYOUT_DTYPE in params:
        layout_dtype = dtype(params[LAYOUT_DTYPE], where, f"{field}.params.{LAYOUT_DTYPE}")
    if LAYOUT_SHAPE in params:
        shape(params[LAYOUT_SHAPE], where, f"{field}.params.{LAYOUT_SHAPE}", layout_dtype)
    return obj


def group(obj: dict, where: Where) -> dict:
    """A group line, checked field by field; also: its last step's hash is the group's hash, and its first
    step's value is no larger than its blob can produce (zstd's maximum ratio)."""
    where = where.at(group=obj.get("group") if isinstance(obj.get("group"), str) else None)
    _keys(obj, GROUP_KEYS, {"group", "dtype", "shape", "hash", "steps"}, where, "group")
    name(obj["group"], where, "group")
    dt = dtype(obj["dtype"], where)
    dims = shape(obj["shape"], where, "shape", dt)
    digest = _value_name(obj["hash"], where, "hash")
    if "xxh3" in obj and not (isinstance(obj["xxh3"], str) and HEX32.fullmatch(obj["xxh3"])):
        raise where.fail("xxh3", f"expected 32 lowercase hex digits (an xxh3-128), got {_show(obj['xxh3'])}")
    for flag in ("param", "grad"):
        if flag in obj:
            _bool(obj[flag], where, flag)
    if "norms" in obj:
        norms(obj["norms"], where, dims)
    sig = obj.get("lsh")
    if sig is not None:
        if not isinstance(sig, list) or len(sig) > MAX_LSH:
            raise where.fail("lsh", f"expected null or a list of at most {MAX_LSH} integers")
        # in C for the common case (16 plain ints); the loop only finds what to name
        if sig and not (all(type(v) is int for v in sig) and -_LSH_BOUND < min(sig) and max(sig) < _LSH_BOUND):
            bad = next(v for v in sig if type(v) is not int or not -_LSH_BOUND < v < _LSH_BOUND)
            raise where.fail("lsh", f"expected integers of at most {MAX_LSH_BITS} bits, got {_show(bad)}")
    steps = obj["steps"]
    if not isinstance(steps, list) or not steps:
        raise where.fail("steps", "expected a non-empty list of steps")
    if len(steps) > MAX_STEPS:
        raise where.fail("steps", f"a chain of {len(steps)} steps exceeds the limit of {MAX_STEPS}")
    for i, s in enumerate(steps):
        step(s, where, i, dt)
    if steps[-1]["hash"] != digest:
        raise where.fail("steps[-1].hash", "the last step's value hash differs from the group's hash")
    first = steps[0]
    first_dims, first_dt = step_layout(first.get("params") or {}, dims, dt)
    produced = nbytes(first_dims, first_dt)
    if produced > max_decoded(first["size"]):
        raise where.fail("steps[0].size", f"a blob of {first['size']} bytes cannot hold a value of {produced} "
                                          f"bytes (zstd expands at most {ZSTD_MAX_RATIO}x)")
    return obj


def _norm(v: Any, where: Where, field: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise where.fail(field, f"expected a finite number >= 0, got {_show(v)}")
    return float(v)


def norms(obj: Any, where: Where, dims: tuple[int, ...]) -> dict:
    """A group's ``norms``: ``value`` (a norm), and ``from`` (a value name), ``change`` (a norm) and ``changed``
    (at most the group's elements) all together or none of them."""
    if not isinstance(obj, dict):
        raise where.fail("norms", f"expected an object, got {_show(obj)}")
    extra = set(obj) - NORMS_KEYS
    if extra:
        raise where.fail(f"norms.{sorted(extra)[0]}", f"unknown field (known: {', '.join(sorted(NORMS_KEYS))})")
    if "value" not in obj:
        raise where.fail("norms.value", "norms need this field")
    _norm(obj["value"], where, "norms.value")
    together = {"from", "change", "changed"}
    if together & set(obj) and not together <= set(obj):
        raise where.fail(f"norms.{sorted(together - set(obj))[0]}", "'from', 'change' and 'changed' come together")
    if "from" in obj:
        _value_name(obj["from"], where, "norms.from")
        _norm(obj["change"], where, "norms.change")
        numel = 1
        for d in dims:
            numel *= d
        _int(obj["changed"], where, "norms.changed", 0, numel)
    return obj


def step_layout(params: dict, dims: tuple[int, ...], dt: str) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a step's value: its params' layout record, else the group's."""
    return (tuple(params[LAYOUT_SHAPE]) if LAYOUT_SHAPE in params else dims,
            params.get(LAYOUT_DTYPE, dt))


def max_decoded(blob_size: int) -> int:
    """The most bytes a theta blob of ``blob_size`` bytes can decode to (zstd's maximum ratio, plus one block)."""
    return ZSTD_MAX_RATIO * blob_size + ZSTD_BLOCK_BYTES


def opaque(obj: Any, where: Where) -> tuple[str, int]:
    """The ``{"opaque": {"oid", "size"}}`` line of a file stored as one blob (version 2)."""
    if not isinstance(obj, dict):
        raise where.fail("opaque", f"expected an object, got {_show(obj)}")
    _keys(obj, OPAQUE_KEYS, OPAQUE_KEYS, where, "opaque")
    return _hex64(obj["oid"], where, "opaque.oid"), _int(obj["size"], where, "opaque.size")


# -- the structure tree (zipslice.structure) --------------------------------------------------------------
_CONTAINERS = ("dict", "odict", "list", "tuple")
_LEAVES = {"tensor": {"tensor"}, "value": {"value"}, "float": {"float"}, "bytes": {"bytes"},
           "torch": {"torch", "value"}}


def structure(root: Any, where: Where) -> None:
    """A zipslice structure tree: only the documented node forms, nested at most MAX_STRUCTURE_DEPTH deep
    (the torch reader's own limit). Walked iteratively. Tensor leaves are checked against the names later."""
    if root is None:
        return
    where = where.at()
    stack = [(root, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        at = f"structure{'/' + path if path else ''}"[:200]
        if depth > MAX_STRUCTURE_DEPTH:
            raise where.fail(at, f"containers nested deeper than {MAX_STRUCTURE_DEPTH} levels")
        if not isinstance(node, dict):
            raise where.fail(at, f"expected a node object, got {_show(node)}")
        kind = next((k for k in _CONTAINERS if k in node), None)
        if kind in ("dict", "odict"):
            allowed = {kind, "metadata"} if kind == "odict" else {kind}
            if set(node) - allowed:
                raise where.fail(at, f"unexpected keys {sorted(set(node) - allowed)} in a {kind} node")
            items = node[kind]
            if not isinstance(items, list):
                raise where.fail(at, f"a {kind} node holds a list of [key, node] pairs")
            for pair in items:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise where.fail(at, f"a {kind} entry must be a [key, node] pair, got {_show(pair)}")
                key = pair[0]
                if not (key is None or isinstance(key, (str, bool, float)) or _plain_int(key)):
                    raise where.fail(at, f"dict key {_show(key)} is not a string, number, boolean or null")
                if isinstance(key, str) and len(key) > MAX_NAME_CHARS:
                    raise where.fail(at, f"dict key of {len(key)} characters exceeds {MAX_NAME_CHARS}")
                stack.append((pair[1], depth + 1, f"{path}/{key}" if path else str(key)))
            if "metadata" in node:
                stack.append((node["metadata"], depth + 1, f"{path}._metadata"))
        elif kind in ("list", "tuple"):
            if set(node) != {kind} or not isinstance(node[kind], list):
                raise where.fail(at, f"a {kind} node is {{{kind!r}: [nodes]}}")
            stack.extend((child, depth + 1, f"{path}/{i}" if path else str(i)) for i, child in enumerate(node[kind]))
        else:
            _leaf(node, where, at)


def _plain_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v.bit_length() <= MAX_INT_BITS


def _leaf(node: dict, where: Where, at: str) -> None:
    kind = "torch" if "torch" in node else next((k for k in ("tensor", "value", "float", "bytes") if k in node), None)
    if kind is None or set(node) != _LEAVES[kind]:
        raise where.fail(at, f"not a structure node: keys {sorted(node)[:4]}")
    v = node[kind] if kind != "torch" else node["value"]
    if kind == "tensor":
        name(v, where, at)
    elif kind == "value":
        if not (v is None or isinstance(v, (bool, str)) or _plain_int(v)):
            raise where.fail(at, f"a value leaf holds null, a boolean, an integer or a string, not {_show(v)}")
    elif kind == "float":
        try:
            if not isinstance(v, str) or len(v) > 64:
                raise ValueError
            float.fromhex(v)
        except (ValueError, OverflowError):
            raise where.fail(at, f"a float leaf holds a hex float string, not {_show(v)}") from None
    elif kind == "bytes":
        try:
            if not isinstance(v, str):
                raise ValueError
            base64.b64decode(v, validate=True)
        except (ValueError, binascii.Error):
            raise where.fail(at, "a bytes leaf holds base64 text") from None
    else:
        what = node["torch"]
        if what == "dtype":
            dtype(v, where, at)
        elif what == "size":
            if not isinstance(v, list) or len(v) > MAX_RANK:
                raise where.fail(at, f"a torch size holds at most {MAX_RANK} integers")
            for d in v:
                _int(d, where, at)
        elif what == "device":
            if not isinstance(v, str) or len(v) > MAX_DEVICE_CHARS or not DEVICE.fullmatch(v):
                raise where.fail(at, f"a torch device is 'type' or 'type:index', not {_show(v)}")
        else:
            raise where.fail(at, f"unknown torch leaf kind {_show(what)} (dtype, size or device)")


def structure_tensors(root: Any) -> list[str]:
    """The tensor names a (checked) structure tree refers to, iteratively."""
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        kind = next((k for k in _CONTAINERS if k in node), None)
        if kind in ("dict", "odict"):
            stack.extend(pair[1] for pair in reversed(node[kind]))
            if "metadata" in node:
                stack.append(node["metadata"])
        elif kind in ("list", "tuple"):
            stack.extend(reversed(node[kind]))
        elif "tensor" in node:
            out.append(node["tensor"])
    return out
