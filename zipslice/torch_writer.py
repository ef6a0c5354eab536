"""Streaming writer of torch zip checkpoints (the format of ``torch.save`` since torch 1.6).

All metadata is known up front, so ``data.pkl`` is written first; then each storage is one zip record,
filled by reading ONE source at a time straight into the file. Sources with the same non-None ``tie`` key
share one storage record, so ``torch.load`` returns tensors that share memory. The file loads with
``torch.load(weights_only=True)`` and ``torch.load(mmap=True, weights_only=True)``.

Free-form string ``metadata`` (e.g. a safetensors ``__metadata__``) has no place in torch's format; it is
kept as an extra JSON record ``<prefix>/.data/zipslice_metadata.json`` that ``torch.load`` ignores.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO, Callable, Hashable, Sequence

import numpy as np

from . import dtypes, structure as st
from .crc import crc32
from .errors import ZipsliceError
from .fileio import atomic_output
from .info import TensorSource, contiguous_stride
from .pickler import TensorRef, dumps
from .torch_reader import MAX_DEPTH, MAX_METADATA_BYTES, MAX_PICKLE_BYTES
from .zipwrite import ZipWriter

CHUNK = 64 << 20  # bytes handed to the file (and to the progress callback) at a time
METADATA_RECORD = ".data/zipslice_metadata.json"
# what torch 2.x writes beside data.pkl (checked against torch 2.13's own output in the tests)
_FORMAT_VERSION = b"1"
_VERSION = b"3\n"
_BYTEORDER = b"little"


def source_bytes(src: TensorSource, path: str | None = None) -> memoryview:
    """The source's values as a flat byte view, checked against its announced size."""
    buf = src.read()
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    view = memoryview(buf)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.nbytes != src.nbytes:
        raise ZipsliceError(path, f"read() gave {view.nbytes} bytes, expected {src.nbytes} "
                                  f"({src.dtype} {list(src.shape)})", src.name)
    return view


def seekable(f) -> bool:
    """Can the writer go back in ``f`` (patch a CRC after the bytes)? False for pipes and write-only wrappers."""
    try:
        return bool(f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def default_prefix(path: str | os.PathLike) -> str:
    """The record prefix torch uses: the file name without its last extension ("archive" if empty)."""
    return Path(os.fspath(path)).stem or "archive"


class _Plan:
    """Storage keys handed out in pickling order; tied sources share a key."""

    def __init__(self, sources: Sequence[TensorSource], path: str):
        self.path = path
        self.by_name: dict[str, TensorSource] = {}
        for s in sources:
            if s.name in self.by_name:
                raise ZipsliceError(path, "two sources have this name", s.name)
            dtypes.get(s.dtype)
            self.by_name[s.name] = s
        self.storages: list[tuple[str, TensorSource]] = []
        self._tie_key: dict[Hashable, tuple[str, TensorSource]] = {}
        self.used: set[str] = set()

    def ref(self, name: str) -> TensorRef:
        src = self.by_name.get(name)
        if src is None:
            raise ZipsliceError(self.path, "the structure refers to a tensor no source provides", name)
        self.used.add(name)
        key = None
        if src.tie is not None and src.tie in self._tie_key:
            key, first = self._tie_key[src.tie]
            if (first.dtype, tuple(first.shape)) != (src.dtype, tuple(src.shape)):
                raise ZipsliceError(self.path, f"tied to {first.name!r} but has dtype {src.dtype} shape "
                                               f"{list(src.shape)} vs {first.dtype} {list(first.shape)}", name)
        if key is None:
            key = str(len(self.storages))
            self.storages.append((key, src))
            if src.tie is not None:
                self._tie_key[src.tie] = (key, src)
        shape = tuple(int(d) for d in src.shape)
        return TensorRef(storage_key=key, dtype=src.dtype, shape=shape, stride=contiguous_stride(shape),
                         storage_offset=0, storage_nbytes=src.nbytes, is_parameter=src.is_parameter,
                         requires_grad=src.requires_grad)


def write(path: str | os.PathLike, sources: Sequence[TensorSource], *, structure: dict | None = None,
          metadata: dict[str, str] | None = None, record_prefix: str | None = None, force_zip64: bool = False,
          progress: Callable[[int], None] | None = None) -> None:
    """Write ``sources`` as a torch zip checkpoint at ``path``, one tensor at a time, atomically.

    ``structure`` (see :mod:`zipslice.structure`) rebuilds the original container tree; without it the
    file holds a flat ``dict`` of the sources in order. ``progress(nbytes)`` is called as data is written.
    """
    path = os.fspath(path)
    prefix = record_prefix if record_prefix is not None else default_prefix(path)
    with atomic_output(path) as f:
        write_to(f, sources, structure=structure, metadata=metadata, record_prefix=prefix,
                 force_zip64=force_zip64, progress=progress, path=path)


def _metadata_record(metadata: dict[str, str]) -> bytes:
    return json.dumps(metadata, sort_keys=True).encode()


def _check_readable(structure: dict, metadata: dict[str, str] | None, path: str | None) -> None:
    """Refuse, before writing anything, what zipslice's own reader would refuse to read back: a structure
    nested deeper than its MAX_DEPTH, file metadata over MAX_METADATA_BYTES (the writer and the reader
    agree on every limit)."""
    stack = [(structure, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ZipsliceError(path, f"the structure nests containers deeper than {MAX_DEPTH} levels, which "
                                      "zipslice would not read back")
        if not isinstance(node, dict):
            continue
        for kind in ("dict", "odict"):
            if isinstance(node.get(kind), list):
                stack.extend((pair[1], depth + 1) for pair in node[kind] if isinstance(pair, (list, tuple))
                             and len(pair) == 2)
        for kind in ("list", "tuple"):
            if isinstance(node.get(kind), list):
                stack.extend((child, depth + 1) for child in node[kind])
        if "odict" in node and "metadata" in node:
            stack.append((node["metadata"], depth + 1))
    if metadata:
        size = len(_metadata_record(metadata))
        if size > MAX_METADATA_BYTES:
            raise ZipsliceError(path, f"the file metadata would be {size} bytes, over the {MAX_METADATA_BYTES} "
                                      "zipslice reads back")


def write_to(f: BinaryIO, sources: Sequence[TensorSource], *, record_prefix: str = "archive",
             structure: dict | None = None, metadata: dict[str, str] | None = None, force_zip64: bool = False,
             progress: Callable[[int], None] | None = None, path: str | None = None) -> None:
    """Write the checkpoint to ``f``, any binary stream with ``write()`` (a pipe is fine: nothing seeks).

    Each tensor's CRC-32 is computed from its bytes before its header is written; on a seekable ``f``, a source
    with ``chunks`` is written piece by piece instead and its CRC-32 patched into the header after (the tensor
    is then never whole in memory). ``path`` only names the output in error messages. Bytes already written are not taken back on error: the caller discards them.
    """
    sources = list(sources)
    if structure is None:
        structure = st.flat([s.name for s in sources])
    _check_readable(structure, metadata, path)
    plan = _Plan(sources, path)
    pkl = dumps(structure, plan.ref)
    if len(pkl) > MAX_PICKLE_BYTES:
        raise ZipsliceError(path, f"data.pkl would be {len(pkl)} bytes, over the {MAX_PICKLE_BYTES} zipslice reads")
    unused = [s.name for s in sources if s.name not in plan.used]
    if unused:
        raise ZipsliceError(path, f"{len(unused)} source(s) do not appear in the structure, e.g. {unused[0]!r}")
    prefix = record_prefix
    ident = hashlib.blake2b(pkl, digest_size=16)
    z = ZipWriter(f, force_zip64=force_zip64, path=path)
    z.write_record(f"{prefix}/data.pkl", pkl)
    z.write_record(f"{prefix}/.format_version", _FORMAT_VERSION)
    z.write_record(f"{prefix}/.storage_alignment", b"64")
    z.write_record(f"{prefix}/byteorder", _BYTEORDER)
    can_seek = seekable(f)
    for key, src in plan.storages:
        if src.chunks is not None and can_seek:  # never whole in memory: CRC patched in afterwards
            crc = z.write_chunks(f"{prefix}/data/{key}", src.nbytes, src.chunks(), progress, tensor=src.name)
            ident.update(f"{key}:{src.nbytes}:{crc};".encode())
            continue
        data = source_bytes(src, path)
        known = src.crc32() if src.crc32 is not None else None
        crc = z.write_known(f"{prefix}/data/{key}", data, crc32(data) if known is None else known, CHUNK,
                            progress)
        ident.update(f"{key}:{data.nbytes}:{crc};".encode())
        del data  # drop this tensor's bytes before reading the next
    if metadata:
        z.write_record(f"{prefix}/{METADATA_RECORD}", _metadata_record(metadata))
    z.write_record(f"{prefix}/version", _VERSION)
    # torch writes a 40-digit decimal id; ours is derived from the content so equal input gives equal bytes
    serial = str(int.from_bytes(ident.digest(), "big") % 10 ** 40).zfill(40)
    z.write_record(f"{prefix}/.data/serialization_id", serial.encode())
    z.close()
