"""Convert a checkpoint between torch, safetensors and HDF5, one tensor at a time, each a stream of frames.

Every source hands the writer its tensor frame by frame (:attr:`TensorSource.chunks`, read through
:mod:`zipslice.frames`), and a cast to another dtype runs frame by frame too, so peak memory is a few frames
(:data:`zipslice.frames.FRAME_BYTES`) plus the interpreter whatever the tensor's size; the writers keep their
dirty pages within a few windows (:class:`zipslice.pagecache.WriteBehind`). Only a torch file written to a
pipe (no seeking back for a CRC) takes each tensor whole.

Flat formats (safetensors, HDF5) cannot hold what a torch file has beyond named tensors. ``convert``
keeps it in the file's string metadata under one key, :data:`LAYOUT_KEY`, a compact JSON object, and only
when it is needed::

    {"version": 2,
     "structure": <zipslice.structure tree>,   # containers, order, non-tensor leaves; a tensor leaf named
                                               # by its own path is written null ({"tensor": "a/b"} at a/b)
     "ties": [["embed.weight", "lm_head.weight"], ...],   # names that shared one storage
     "parameters": [...] | true, "requires_grad": [...] | true}   # nn.Parameter-ness; true = every tensor

Keys with nothing to say are left out, and the whole entry is left out when the flat file alone rebuilds
the same object: a plain ``dict`` of tensors, keyed by their names, in the order the flat format reads
back (so safetensors -> torch -> safetensors gives the same header). Version 1 (every tensor leaf spelled
out, every key present) is still read.

Tied tensors are written once per name in flat formats (every name is a full tensor, which is what
safetensors' own loaders expect). Converting back to torch restores the structure and re-ties a group
only after checking that its members still hold identical bytes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np

from . import dtypes, formats, frames, structure as st
from .errors import CorruptCheckpointError, ZipsliceError
from .base import LazyCheckpoint
from .info import TensorInfo, TensorSource
from .opening import format_for_path, load
from .sources import as_sources

LAYOUT_KEY = "zipslice.layout"
CAST_TARGETS = ("bfloat16", "float16", "float32")
_CAST_CHUNK = 1 << 20  # elements converted at a time: bounds the float32 intermediate to 4 MiB


@dataclass
class Layout:
    """What a flat format cannot express natively (see the module docstring)."""

    structure: dict | None = None
    ties: list[list[str]] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    requires_grad: list[str] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        return bool(self.structure is not None or self.ties or self.parameters or self.requires_grad)

    def to_json(self, names: Sequence[str] = ()) -> str:
        """The compact (version 2) form; ``names``: every tensor name (lets "all of them" be written true)."""
        doc: dict = {"version": 2}
        if self.structure is not None:
            doc["structure"] = _compact(self.structure, "")
        if self.ties:
            doc["ties"] = self.ties
        for key in ("parameters", "requires_grad"):
            listed = getattr(self, key)
            if listed:
                doc[key] = True if names and list(listed) == list(names) else listed
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, path: str, names: Sequence[str] = ()) -> "Layout":
        try:
            raw = json.loads(text)
            version = raw.get("version")
            if version not in (1, 2):
                raise ValueError(f"version {version!r}")
            structure = raw.get("structure")
            if version == 2 and structure is not None:
                structure = _expand(structure, "")

            def listed(key: str) -> list[str]:
                v = raw.get(key, [])
                return list(names) if v is True else list(v)
            return cls(structure=structure, ties=[list(g) for g in raw.get("ties", [])],
                       parameters=listed("parameters"), requires_grad=listed("requires_grad"))
        except (ValueError, TypeError, AttributeError) as e:
            raise ZipsliceError(path, f"metadata {LAYOUT_KEY!r} is not a layout zipslice can read ({e})") from None


def _compact(node: dict, path: str):
    """A structure tree with each tensor leaf that is named by its own path replaced by null."""
    if "tensor" in node:
        return None if node["tensor"] == path else node
    for kind in ("dict", "odict"):
        if kind in node:
            out = {kind: [[k, _compact(child, st.join(path, k))] for k, child in node[kind]]}
            if "metadata" in node:
                out["metadata"] = node["metadata"]
            return out
    for kind in ("list", "tuple"):
        if kind in node:
            return {kind: [_compact(child, st.join(path, i)) for i, child in enumerate(node[kind])]}
    return node


def _expand(node, path: str) -> dict:
    """The inverse of :func:`_compact`."""
    if node is None:
        return {"tensor": path}
    if not isinstance(node, dict):
        raise ValueError(f"structure node at {path!r} is {type(node).__name__}, not an object")
    for kind in ("dict", "odict"):
        if kind in node:
            out = {kind: [[k, _expand(child, st.join(path, k))] for k, child in node[kind]]}
            if "metadata" in node:
                out["metadata"] = node["metadata"]
            return out
    for kind in ("list", "tuple"):
        if kind in node:
            return {kind: [_expand(child, st.join(path, i)) for i, child in enumerate(node[kind])]}
    return node


def readback_order(fmt: str, sources: Sequence[TensorSource]) -> list[str] | None:
    """The order in which a flat format gives the names of ``sources`` back when read, or None if unknown."""
    names = [s.name for s in sources]
    if fmt == "safetensors":
        from .safetensors_format import library_order

        return [s.name for s in library_order(sources)]
    if fmt == "sharded":
        return sorted(names)  # zipslice.sharded.write sorts the weight_map
    if fmt == "hdf5":
        return names if not any("/" in n for n in names) else None  # "/" makes groups, read group by group
    return None


def is_plain_dict(structure: dict | None, order: Sequence[str] | None) -> bool:
    """Whether ``structure`` is a plain dict of tensors keyed by their own names, in ``order``."""
    if structure is None:
        return True
    if order is None or set(structure) != {"dict"}:
        return False
    items = structure["dict"]
    return [k for k, _ in items] == list(order) and all(child == {"tensor": k} for k, child in items)


@dataclass
class ConvertResult:
    src: str
    dst: str
    format: str
    tensors: int
    cast: int
    nbytes: int


# -- casting ---------------------------------------------------------------------------------------

def cast_bytes(data, src_dtype: str, dst_dtype: str) -> np.ndarray:
    """Cast little-endian values of ``src_dtype`` to ``dst_dtype``; returns the result's bytes (uint8).

    Rounding is round-to-nearest-even like torch's ``Tensor.to``; like torch, float64 goes through
    float32 first, so results equal torch's bit for bit except for NaN payload/sign bits (NaN stays NaN).
    Each element is cast on its own: casting a tensor in pieces gives the same bytes as casting it whole.
    """
    src = np.frombuffer(data, dtype=dtypes.get(src_dtype).to_numpy())
    out = np.empty(src.size, dtype=dtypes.get(dst_dtype).to_numpy())
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, src.size, _CAST_CHUNK):
            part = src[i:i + _CAST_CHUNK]
            if part.dtype == out.dtype or out.dtype == np.float32:  # one rounding, in place: no temporary
                out[i:i + _CAST_CHUNK] = part
            else:
                out[i:i + _CAST_CHUNK] = part.astype(np.float32).astype(out.dtype)
    return out.view(np.uint8)


def cast_source(src: TensorSource, dtype: str) -> TensorSource:
    """``src`` read as ``dtype`` if it is a real floating tensor of another dtype; otherwise ``src``.

    Its ``chunks`` cast the source's pieces one by one (:meth:`TensorSource.pieces`, regrouped into whole
    elements): a frame of the source and its cast are all that is held."""
    if dtypes.get(src.dtype).kind != "float" or src.dtype == dtype:
        return src

    def chunks(s=src):
        for piece in frames.whole_elements(s.pieces(), dtypes.get(s.dtype).itemsize):
            out = cast_bytes(piece, s.dtype, dtype)
            del piece  # (each generator lets go of its piece before asking for the next)
            yield out
            del out

    return src.with_bytes(lambda s=src: cast_bytes(s.read(), s.dtype, dtype), dtype, chunks)


# -- layout ----------------------------------------------------------------------------------------

def tie_groups(sources: Sequence[TensorSource]) -> list[list[str]]:
    groups: dict[Hashable, list[str]] = {}
    for s in sources:
        if s.tie is not None:
            groups.setdefault(s.tie, []).append(s.name)
    return [g for g in groups.values() if len(g) > 1]


def layout_of(sources: Sequence[TensorSource], structure: dict | None) -> Layout:
    return Layout(structure=structure, ties=tie_groups(sources),
                  parameters=[s.name for s in sources if s.is_parameter],
                  requires_grad=[s.name for s in sources if s.requires_grad])


def _digest(src: TensorSource) -> str:
    h = hashlib.blake2b(digest_size=20)
    for piece in src.pieces():
        h.update(piece)
    return h.hexdigest()


def apply_layout(sources: list[TensorSource], layout: Layout, path: str) -> tuple[list[TensorSource], dict | None]:
    """Sources with Parameter-ness and ties restored, and the structure to write (checked against them)."""
    names = [s.name for s in sources]
    if layout.structure is not None:
        wanted = st.tensor_names(layout.structure)
        if sorted(set(wanted)) != sorted(names):
            missing = sorted(set(wanted) - set(names))[:3]
            extra = sorted(set(names) - set(wanted))[:3]
            raise ZipsliceError(path, f"the stored layout ({LAYOUT_KEY}) does not match the tensors "
                                      f"(missing {missing}, not in layout {extra}); was the file edited? "
                                      f"convert with keep_layout=False (--no-layout) to write a flat dict")
    by_name = {s.name: s for s in sources}
    params, grads = set(layout.parameters), set(layout.requires_grad)
    tie: dict[str, Hashable] = {}
    for group in layout.ties:
        members = [by_name[n] for n in group if n in by_name]
        if len(members) < 2 or len({(m.dtype, tuple(m.shape)) for m in members}) != 1:
            continue
        # re-tie only members whose bytes are still identical: hashed frame by frame
        by_digest: dict[str, list[str]] = {}
        for m in members:
            by_digest.setdefault(_digest(m), []).append(m.name)
        for digest, same in by_digest.items():
            if len(same) > 1:
                for n in same:
                    tie[n] = ("layout", digest, same[0])
    out = [dataclasses.replace(s, tie=tie.get(s.name), is_parameter=s.name in params,
                               requires_grad=s.name in grads) for s in sources]
    return out, layout.structure


# -- reading ---------------------------------------------------------------------------------------

def direct_read(info: TensorInfo) -> Callable[[], np.ndarray] | None:
    """A reader of a plain byte range (contiguous, little-endian, at a known offset), else None.

    It reads into an uninitialised buffer: no zero-filling pass over a large tensor before the read.
    """
    if info.offset is None or info.numel == 0 or not info.is_contiguous:
        return None
    if info.byteorder != "little" and dtypes.get(info.dtype).itemsize > 1:
        return None

    def read() -> np.ndarray:
        out = np.empty(info.nbytes, dtype=np.uint8)
        view = memoryview(out)
        fd = os.open(info.file, os.O_RDONLY)
        try:
            got = 0
            while got < info.nbytes:
                k = os.preadv(fd, [view[got:]], info.offset + got)
                if k == 0:
                    raise CorruptCheckpointError(info.file, f"unexpected end of file at byte {info.offset + got} "
                                                            f"(truncated?)", info.name)
                got += k
        finally:
            os.close(fd)
        return out
    return read


def lazy_sources(lsd) -> list[TensorSource]:
    """The checkpoint's sources: ``read()`` takes plain byte ranges directly (see :func:`direct_read`), and
    ``chunks()`` gives any tensor frame by frame (:func:`zipslice.frames.iter_bytes`)."""
    out = []
    for src in lsd.sources():
        fast = direct_read(lsd.info(src.name))
        out.append(dataclasses.replace(src, read=fast or src.read,
                                       chunks=lambda k=src.name: frames.iter_bytes(lsd, k)))
    return out


# -- convert ---------------------------------------------------------------------------------------

@dataclass
class WritePlan:
    """What to hand a format's ``write``: sources, structure (torch only) and string metadata."""

    sources: list[TensorSource]
    structure: dict | None
    metadata: dict[str, str]
    cast: int = 0


def plan_write(lsd, fmt: str, dtype: str | None = None, keep_layout: bool = True) -> WritePlan:
    """Prepare an open checkpoint for writing as ``fmt``: the layout rules of this module, applied.

    For torch, a layout stored in a flat file's metadata is restored (structure, Parameter-ness, ties
    re-checked byte for byte); for flat formats, the source's layout is stored under :data:`LAYOUT_KEY`.
    """
    sources = lazy_sources(lsd)
    metadata = dict(lsd.metadata or {})
    stored = metadata.pop(LAYOUT_KEY, None)
    structure = lsd.structure
    if keep_layout and stored is not None and structure is None:
        layout = Layout.from_json(stored, lsd.path, [s.name for s in sources])
        sources, structure = apply_layout(sources, layout, lsd.path)
    if not keep_layout:
        structure = None
    n_cast = 0
    if dtype is not None:
        casted = [cast_source(s, dtype) for s in sources]
        n_cast = sum(a is not b for a, b in zip(casted, sources))
        sources = casted
    if fmt != "torch" and keep_layout:
        layout = layout_of(sources, structure)
        if layout.structure is not None and is_plain_dict(layout.structure, readback_order(fmt, sources)):
            layout.structure = None  # the flat file alone rebuilds the same dict: nothing to keep
        if layout.needed:
            metadata[LAYOUT_KEY] = layout.to_json([s.name for s in sources])
    return WritePlan(sources=sources, structure=structure if fmt == "torch" else None, metadata=metadata,
                     cast=n_cast)


def _reporting(src: TensorSource, progress: Callable[[int, int], None], total: int) -> TensorSource:
    """``src`` calling ``progress(nbytes, total)`` with the bytes each read gives (whole, or piece by piece)."""
    def read(s=src):
        data = s.read()
        progress(s.nbytes, total)
        return data

    def chunks(s=src):
        for piece in s.pieces():
            n = piece.nbytes
            yield piece
            del piece
            progress(n, total)
    return dataclasses.replace(src, read=read, chunks=chunks if src.chunks is not None else None)


def bytes_to_write(sources: Sequence[TensorSource], shares_storage: bool) -> int:
    """Bytes of tensor data a writer reads: tied sources once when the format shares storage."""
    seen: set[Hashable] = set()
    total = 0
    for s in sources:
        if shares_storage and s.tie is not None:
            if s.tie in seen:
                continue
            seen.add(s.tie)
        total += s.nbytes
    return total


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None, dtype: str | None = None,
            progress: Callable[[int, int], None] | None = None, *, keep_layout: bool = True,
            max_shard_bytes: int | None = None) -> ConvertResult:
    """Convert ``src`` (any format zipslice reads) to ``dst`` in format ``to`` (default: from dst's name).

    ``dtype`` (bfloat16, float16, float32) casts real floating tensors; others are copied bit for bit.
    ``progress(nbytes, total)`` is called as each tensor's bytes are read (piece by piece: ``nbytes`` is the
    piece's). Returns what was written.
    ``to="sharded"`` (or ``dst`` named ``*.index.json``) writes shards of at most ``max_shard_bytes``
    (default: :data:`zipslice.sharded.DEFAULT_MAX_SHARD_BYTES`) in the format named before ``.index.json``.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    fmt = to or format_for_path(dst)
    if fmt not in formats.writable():
        raise ValueError(f"cannot write format {fmt!r}; choose one of {', '.join(formats.writable())}")
    if dtype is not None and dtype not in CAST_TARGETS:
        raise ValueError(f"cannot cast to {dtype!r}; choose one of {', '.join(CAST_TARGETS)}")
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise ZipsliceError(dst, "source and destination are the same file")
    with load(src) as lsd:
        plan = plan_write(lsd, fmt, dtype=dtype, keep_layout=keep_layout)
        written = plan.sources
        if progress is not None:
            total = bytes_to_write(plan.sources, shares_storage=fmt == "torch")
            written = [_reporting(s, progress, total) for s in plan.sources]
        options: dict = {"structure": plan.structure} if fmt == "torch" else {}
        if fmt == "sharded" and max_shard_bytes is not None:
            options["max_shard_bytes"] = max_shard_bytes
        writer = formats.get(fmt).writer_function()
        writer(dst, written, metadata=plan.metadata or None, **options)
    sources, n_cast = plan.sources, plan.cast
    return ConvertResult(src=src, dst=dst, format=fmt, tensors=len(sources), cast=n_cast,
                         nbytes=bytes_to_write(sources, shares_storage=fmt == "torch"))


def save(path: str | os.PathLike, tensors: Iterable[tuple[str, Any]] | LazyCheckpoint, format: str | None = None,
         **options) -> None:
    """Write ``tensors`` to ``path`` one tensor at a time, published atomically.

    ``tensors`` is a LazyCheckpoint or an iterable of (name, torch.Tensor | numpy.ndarray | TensorSource);
    a lazy source streams through without being materialised whole. A LazyCheckpoint is written like
    :func:`zipslice.convert.convert` writes it (:func:`zipslice.convert.plan_write`): its container
    layout survives a round trip through safetensors or HDF5.
    """
    fmt = format or format_for_path(path)
    writer = formats.get(fmt).writer_function()
    if writer is None:
        raise ValueError(f"cannot write format {fmt!r}; writable: "
                         + ", ".join(n for n, f in formats.registry().items() if f.writer))
    if isinstance(tensors, LazyCheckpoint):
        # the same layout rules as zipslice.convert: a layout kept in a flat file's metadata is restored
        # when writing torch, and a torch file's layout is kept in the metadata of a flat format
        plan = plan_write(tensors, fmt)
        options.setdefault("structure", plan.structure)
        options.setdefault("metadata", plan.metadata or None)
        srcs = plan.sources
    else:
        srcs = as_sources(tensors)
    writer(path, srcs, **options)
