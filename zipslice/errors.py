"""Exceptions raised by zipslice. Every message names the file, the entry and the problem."""
from __future__ import annotations

import os


class ZipsliceError(Exception):
    """Base of every error zipslice raises on purpose."""

    def __init__(self, path: str | os.PathLike | None, problem: str, entry: str | None = None):
        self.path = os.fspath(path) if path is not None else None
        self.entry = entry
        self.problem = problem
        where = self.path or "<stream>"
        if entry is not None:
            where += f" [{entry}]"
        super().__init__(f"{where}: {problem}")


class UnsafeCheckpointError(ZipsliceError):
    """The pickle asks for a global outside the allowlist. Nothing from the file was imported or called."""


class CorruptCheckpointError(ZipsliceError):
    """The file is truncated, inconsistent, or not what it claims to be."""


class NotACheckpointError(CorruptCheckpointError):
    """The file is something else entirely: a Git LFS pointer, an HTML page, an empty file, ..."""


class UnsupportedCheckpointError(ZipsliceError):
    """A valid file of a kind zipslice does not read (e.g. a dtype with no mapping)."""


# -- internal signals, turned into the errors above by the code that catches them -------------------------
class PickleFault(Exception):
    """Raised by unpickler handlers for an ill-formed call; the machine turns it into CorruptCheckpointError."""


class PickleUnsupported(Exception):
    """Raised by unpickler handlers for a valid but unsupported construct (sparse tensors, ...)."""


class NeedMoreData(Exception):
    """The buffer ended inside a pickle; a caller reading a stream may retry with more bytes."""


class DuplicateKey(ValueError):
    """A JSON object names the same key twice (see :func:`zipslice.jsonutil.loads_strict`)."""
