"""Opening a checkpoint: the format sniffed from its bytes (or named by a plugin), then that format's lazy reader."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import formats
from .errors import NotACheckpointError
from .sniff import sniff

if TYPE_CHECKING:
    from .base import LazyCheckpoint


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
