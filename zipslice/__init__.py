"""zipslice: lazy, safe, out-of-core checkpoint reading and streaming writing.

    with zipslice.load("model.pt") as lsd:       # reads only the index
        lsd.info("encoder.weight")                # dtype, shape, stride, offset -- no data read
        w = lsd["encoder.weight"]                 # one positioned read of exactly its bytes
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Iterable

from .base import LazyCheckpoint
from .errors import (CorruptCheckpointError, NotACheckpointError, UnsafeCheckpointError,
                     UnsupportedCheckpointError, ZipsliceError)
from .info import TensorInfo, TensorSource
from .sniff import sniff

__all__ = [
    "load", "save", "sniff", "LazyCheckpoint", "TensorInfo", "TensorSource", "ZipsliceError",
    "UnsafeCheckpointError", "CorruptCheckpointError", "NotACheckpointError", "UnsupportedCheckpointError",
]

# format name -> (module, reader class, writer function)
_FORMATS = {
    "torch": ("zipslice.torch_reader", "TorchCheckpoint", "zipslice.torch_writer", "write"),
    "safetensors": ("zipslice.safetensors_format", "SafetensorsCheckpoint", "zipslice.safetensors_format", "write"),
    "hdf5": ("zipslice.hdf5_format", "HDF5Checkpoint", "zipslice.hdf5_format", "write"),
    "sharded": ("zipslice.sharded", "ShardedCheckpoint", "zipslice.sharded", "write"),
    "torch-legacy": ("zipslice.torch_legacy", "LegacyTorchCheckpoint", None, None),
}

_EXTENSIONS = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".ckpt": "torch",
               ".safetensors": "safetensors", ".h5": "hdf5", ".hdf5": "hdf5", ".keras": "hdf5",
               ".index.json": "sharded"}


def load(path: str | os.PathLike, *, mmap: bool = False) -> LazyCheckpoint:
    """Open a checkpoint lazily; the format is sniffed from its bytes.

    ``mmap=True`` (torch formats only): each tensor is a private copy-on-write mapping of just its pages
    instead of a positioned read into fresh memory -- no copy, but the file must not be truncated or
    rewritten in place while such tensors are alive (the process would get SIGBUS, as with torch's mmap).
    """
    fmt = sniff(path)
    module, cls, _, _ = _FORMATS[fmt]
    if not mmap:
        return getattr(importlib.import_module(module), cls)(path)
    if fmt not in ("torch", "torch-legacy"):
        raise ValueError(f"{os.fspath(path)}: mmap=True is supported for torch checkpoints, not {fmt}")
    return getattr(importlib.import_module(module), cls)(path, mmap=True)


def format_for_path(path: str | os.PathLike) -> str:
    name = os.fspath(path).lower()
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext):
            return fmt
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
    if fmt not in _FORMATS or _FORMATS[fmt][2] is None:
        raise ValueError(f"cannot write format {fmt!r}; choose torch, safetensors or hdf5")
    _, _, module, fn = _FORMATS[fmt]
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
    getattr(importlib.import_module(module), fn)(path, srcs, **options)
