"""Update types: how a parameter group's new value is stored relative to earlier values.

Update types are plugins found through the entry-point group ``theta.updates`` (the built-ins register the
same way, see pyproject.toml, and are found without scanning the entry points: :mod:`zipslice.plugins`).
Each stores its data as named arrays (``Encoded.parts``, one blob via :func:`theta.storage.codec.encode_parts`)
plus small JSON-able ``params`` recorded in the metadata step.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Iterable, Protocol, runtime_checkable

import numpy as np
import xxhash

from zipslice import dtypes
from zipslice.plugins import Registry

from theta.base import valuehash
from theta.base.errors import MetadataError, UpdateTypeError

if TYPE_CHECKING:
    from theta.storage.metadata import GroupMeta

GROUP = "theta.updates"
_REGISTRY = Registry(GROUP, {
    "dense": "theta.updates.dense:DenseUpdate", "sparse": "theta.updates.sparse:SparseUpdate",
    "low-rank": "theta.updates.low_rank:LowRankUpdate", "ia3": "theta.updates.ia3:IA3Update",
    "delta": "theta.updates.delta:DeltaUpdate", "rows": "theta.updates.rows:RowsUpdate"})


@dataclass
class Encoded:
    """What an update type's ``encode`` returns: named arrays (stored together as one blob) and small
    JSON-able ``params`` (recorded in the metadata step and given back to ``apply``)."""

    parts: dict[str, np.ndarray]               # stored in one blob (dense: {"values": arr})
    params: dict = field(default_factory=dict)  # small JSON-able values recorded in the Step


@runtime_checkable
class UpdateType(Protocol):
    """An update type: how a group's new value is stored relative to its previous value.

    ``encode(new, previous, **options)`` returns an :class:`Encoded` whose ``apply`` rebuilds ``new`` bit
    for bit, or None when this type cannot represent the change (the caller then stores it dense).
    ``apply(parts, params, previous)`` returns the new value. ``incremental`` is True when ``apply``
    needs the previous value (False: the step is self-contained, like ``dense``).
    """

    name: str
    incremental: bool  # True when apply needs the previous value

    def encode(self, new: np.ndarray, previous: np.ndarray | None, **options) -> Encoded | None: ...

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray: ...


def _entry_points() -> dict:
    """The installed plugins' entry points (scanned once)."""
    return _REGISTRY.installed()


def names() -> list[str]:
    """Names of the installed update types."""
    return sorted(_REGISTRY.all())


@lru_cache(maxsize=None)
def get(name: str) -> UpdateType:
    """The update type registered as ``name``; UpdateTypeError listing the known ones otherwise."""
    ep = _REGISTRY.find(name)
    if ep is None:
        raise UpdateTypeError(f"unknown update type {name!r}; known: {', '.join(names()) or '(none installed)'}")
    try:
        obj = ep.load()
    except (ImportError, AttributeError) as e:
        raise UpdateTypeError(f"update type {name!r} cannot be loaded from {ep.value}: {e}") from e
    return obj() if isinstance(obj, type) else obj


def content_hash(arr: np.ndarray, like: str | None = None) -> str:
    """The name of an array's value (what GroupMeta.hash and Step.hash hold, :mod:`theta.base.valuehash`): the hash
    of its contiguous little-endian bytes, BLAKE3 for a value named now, or in ``like``'s algorithm to check
    it against the name ``like``."""
    h = valuehash.new() if like is None else valuehash.like(like)
    h.update(dtypes.le_bytes(arr))
    return h.hexdigest()


def fast_hash(arr: np.ndarray) -> str:
    """xxh3-128 of an array's contiguous little-endian bytes (what GroupMeta.fast holds): ~12x faster than
    sha256. It only ever decides "this group's bytes equal its previous version's" in clean (see
    docs/design/performance.md, "Change detection"); values stay named by :func:`content_hash`, blobs by sha256."""
    return xxhash.xxh3_128_hexdigest(dtypes.le_bytes(arr))


def fast_hash_pieces(pieces: "Iterable[bytes | bytearray | memoryview]") -> str:
    """:func:`fast_hash` of the concatenation of ``pieces`` (contiguous little-endian bytes, in order)."""
    h = xxhash.xxh3_128()
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def row_blocks(shape: tuple, block_elements: int) -> "Iterable[slice]":
    """Consecutive slices of the first axis of ``shape``, each about ``block_elements`` elements (at least one
    row): how the streamed update paths walk a group block of rows by block of rows."""
    per_row = max(1, int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, block_elements // per_row)
    for a in range(0, shape[0], step):
        yield slice(a, min(shape[0], a + step))


SHAPE_KEY = "shape"
DTYPE_KEY = "dtype"


def step_layout(step, group: "GroupMeta") -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of the value ``step`` of ``group``'s chain produces."""
    p = step.params
    try:
        shape = tuple(int(s) for s in p[SHAPE_KEY]) if SHAPE_KEY in p else tuple(group.shape)
    except (TypeError, ValueError):
        raise MetadataError(f"group {group.name!r}: step {step.type!r} has a bad {SHAPE_KEY!r} "
                            f"{p[SHAPE_KEY]!r}") from None
    return str(p.get(DTYPE_KEY, group.dtype)), shape


def relayout_steps(base: "GroupMeta", dtype: str, shape: tuple[int, ...]) -> list:
    """``base``'s steps, for a chain continued by a group of ``dtype``/``shape``: every step records its own
    layout where it differs from that one (and drops a record equal to it), so the text stays canonical.
    Only params change: blobs and hashes (the content the chain refers to) are the same."""
    out = []
    for step in base.steps:
        d, s = step_layout(step, base)
        params = {k: v for k, v in step.params.items() if k not in (SHAPE_KEY, DTYPE_KEY)}
        if tuple(s) != tuple(shape):
            params[SHAPE_KEY] = list(s)
        if d != dtype:
            params[DTYPE_KEY] = d
        out.append(replace(step, params=params))
    return out
