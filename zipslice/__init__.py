"""zipslice: lazy, safe, out-of-core checkpoint reading and streaming writing.

    with zipslice.load("model.pt") as lsd:       # reads only the index
        lsd.info("encoder.weight")                # dtype, shape, stride, offset -- no data read
        w = lsd["encoder.weight"]                 # one positioned read of exactly its bytes
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import formats  # noqa: F401 (zipslice.formats: the registry, part of the API)
from .errors import (CorruptCheckpointError, NotACheckpointError, UnsafeCheckpointError,
                     UnsupportedCheckpointError, ZipsliceError)
from .opening import format_for_path, load  # noqa: F401 (re-exported)
from .sniff import sniff

if TYPE_CHECKING:
    from .base import LazyCheckpoint
    from .convert import save
    from .info import TensorInfo, TensorSource

# Imported on first use: they bring numpy (~0.3 s), which `git theta`'s hooks and small commands never need.
_LAZY = {"LazyCheckpoint": "base", "TensorInfo": "info", "TensorSource": "info", "save": "convert"}

__all__ = [
    "__version__", "load", "save", "sniff", "LazyCheckpoint", "TensorInfo", "TensorSource", "ZipsliceError",
    "UnsafeCheckpointError", "CorruptCheckpointError", "NotACheckpointError", "UnsupportedCheckpointError",
]

def __getattr__(name: str):
    if name == "__version__":  # read from the package metadata on first use, not at import
        from .version import package_version

        return package_version()
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zipslice' has no attribute {name!r}")
