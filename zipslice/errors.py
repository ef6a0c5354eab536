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


class MissingDependencyError(ModuleNotFoundError):
    """An optional package a call needs is not installed (torch, zarr, matplotlib, transformers).

    The one class for this in the distribution (:func:`zipslice.optional.require` raises it; theta's
    ``ThetaDependencyError`` is this and a ``ThetaError``). The message is one line: which package, what needs
    it, the extra that installs it, and what works without it. A ``ModuleNotFoundError`` (``name`` is the
    missing module), so code that caught the bare one still does.
    """

    def __init__(self, package: str, needed_for: str, extra: str, instead: str | None = None,
                 problem: str = "is not installed"):
        self.package, self.needed_for, self.extra, self.instead = package, needed_for, extra, instead
        self.problem = problem
        message = f'{package} {problem}, and {needed_for}: pip install "zipslice-theta[{extra}]"'
        if instead:
            message += f" (without {package}, {instead})"
        super().__init__(message, name=package)

    def __reduce__(self):  # (raised in a worker process, it crosses back whole)
        return type(self), (self.package, self.needed_for, self.extra, self.instead, self.problem)


# -- internal signals, turned into the errors above by the code that catches them -------------------------
class PickleFault(Exception):
    """Raised by unpickler handlers for an ill-formed call; the machine turns it into CorruptCheckpointError."""


class PickleUnsupported(Exception):
    """Raised by unpickler handlers for a valid but unsupported construct (sparse tensors, ...)."""


class NeedMoreData(Exception):
    """The buffer ended inside a pickle; a caller reading a stream may retry with more bytes."""


class DuplicateKey(ValueError):
    """A JSON object names the same key twice (see :func:`zipslice.jsonutil.loads_strict`)."""
