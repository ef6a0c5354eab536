"""zipslice: lazy, safe, out-of-core checkpoint reading and streaming writing.

    with zipslice.load("model.pt") as lsd:       # reads only the index
        lsd.info("encoder.weight")                # dtype, shape, stride, offset -- no data read
        w = lsd["encoder.weight"]                 # one positioned read of exactly its bytes
"""
from __future__ import annotations

import os
from typing import Any, Iterable

from . import formats
from .base import LazyCheckpoint
from .errors import (CorruptCheckpointError, NotACheckpointError, UnsafeCheckpointError,
                     UnsupportedCheckpointError, ZipsliceError)
from .info import TensorInfo, TensorSource
from .sniff import sniff

__all__ = [
    "__version__", "load", "save", "sniff", "LazyCheckpoint", "TensorInfo", "TensorSource", "ZipsliceError",
    "UnsafeCheckpointError", "CorruptCheckpointError", "NotACheckpointError", "UnsupportedCheckpointError",
]

def __getattr__(name: str):
    if name == "__version__":  # read from the package metadata on first use, not at import
        from .version import package_version

        return package_version()
    raise AttributeError(f"module 'zipslice' has no attribute {name!r}")


def load(path: str | os.PathLike, *, mmap: bool = False, drop_behind: bool | None = None, isolate: bool = False,
         timeout: float | None = None) -> LazyCheckpoint:
    """Open a checkpoint lazily; the format is sniffed from its bytes.

    ``isolate=True``: formats parsed by native code (HDF5, through libhdf5) are parsed in a child process
    with a time limit (``timeout`` seconds to open, default :data:`zipslice.hdf5_isolated.DEFAULT_TIMEOUT`),
    so a malformed file that hangs or crashes the library becomes a CorruptCheckpointError instead of taking
    this process down (:mod:`zipslice.hdf5_isolated`). The other readers are zipslice's own Python code and
    run in-process either way; a sharded index passes ``isolate`` on to its shards.

    ``mmap=True`` (torch formats only): each tensor is a private copy-on-write mapping of just its pages
    instead of a positioned read into fresh memory -- no copy, but the file must not be truncated or
    rewritten in place while such tensors are alive (the process would get SIGBUS, as with torch's mmap).

    ``drop_behind``: let each positioned read's pages go from the page cache once copied out. Default
    (None): only for checkpoints too big to stay cached (see :mod:`zipslice.pagecache`).

    A name that is not a file may be opened by a format plugin (e.g. theta's ``REV:PATH`` in a git repository).
    """
    if not os.path.exists(path) and not mmap:
        lsd = formats.open_plugin(os.fspath(path))
        if lsd is not None:
            if drop_behind is not None:
                lsd.drop_behind = drop_behind
            return lsd
    fmt = _sniff_any(path)
    spec = formats.get(fmt)
    if isolate and fmt == "hdf5":
        from .hdf5_isolated import IsolatedHDF5Checkpoint

        if mmap:
            raise ValueError(f"{os.fspath(path)}: mmap=True is supported for torch checkpoints, not {fmt}")
        lsd = IsolatedHDF5Checkpoint(path, timeout=timeout)
    elif not mmap:
        lsd = spec.reader_class()(path)
    elif not spec.mmap:
        raise ValueError(f"{os.fspath(path)}: mmap=True is supported for torch checkpoints, not {fmt}")
    else:
        lsd = spec.reader_class()(path, mmap=True)
    if drop_behind is not None:
        lsd.drop_behind = drop_behind
    if isolate and fmt == "sharded":
        lsd.isolate, lsd.isolate_timeout = True, timeout
    return lsd


def _sniff_any(path: str | os.PathLike) -> str:
    """zipslice's own sniffing, then any plugin format's detect()."""
    try:
        return sniff(path)
    except NotACheckpointError:
        with open(path, "rb") as f:
            plugin = formats.detect_plugin(f.read(4096))
        if plugin is None:
            raise
        return plugin


def format_for_path(path: str | os.PathLike) -> str:
    name = os.fspath(path).lower()
    for spec in formats.registry().values():
        if any(name.endswith(ext) for ext in spec.extensions):
            return spec.name
    raise ValueError(f"cannot tell the output format from {os.fspath(path)!r}; pass format=")


def save(path: str | os.PathLike, tensors: Iterable[tuple[str, Any]] | LazyCheckpoint, format: str | None = None,
         **options) -> None:
    """Write ``tensors`` to ``path`` one tensor at a time, published atomically.

    ``tensors`` is a LazyCheckpoint or an iterable of (name, torch.Tensor | numpy.ndarray | TensorSource);
    a lazy source streams through without being materialised whole. A LazyCheckpoint is written like
    :func:`zipslice.convert.convert` writes it (:func:`zipslice.convert.plan_write`): its container
    layout survives a round trip through safetensors or HDF5.
    """
    from .sources import as_sources

    fmt = format or format_for_path(path)
    writer = formats.get(fmt).writer_function()
    if writer is None:
        raise ValueError(f"cannot write format {fmt!r}; writable: "
                         + ", ".join(n for n, f in formats.registry().items() if f.writer))
    if isinstance(tensors, LazyCheckpoint):
        # the same layout rules as zipslice.convert: a layout kept in a flat file's metadata is restored
        # when writing torch, and a torch file's layout is kept in the metadata of a flat format
        from .convert import plan_write

        plan = plan_write(tensors, fmt)
        options.setdefault("structure", plan.structure)
        options.setdefault("metadata", plan.metadata or None)
        srcs = plan.sources
    else:
        srcs = as_sources(tensors)
    writer(path, srcs, **options)
