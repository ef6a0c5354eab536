"""Exceptions raised by theta. Each carries one clear line: what, where, and what to do.

The CLI prints ``error: <message>`` and exits 1 for every :class:`ThetaError`.
"""
from __future__ import annotations


class ThetaError(Exception):
    """Base of every error theta raises on purpose."""


class MetadataError(ThetaError):
    """A metadata text is malformed, of an unknown version, or inconsistent."""


class CodecError(ThetaError):
    """A stored blob cannot be decoded (truncated, corrupt, or of an unknown encoding)."""


class StoreError(ThetaError):
    """The local LFS object store cannot be used (not a git repository, unwritable, ...)."""


class BlobMissingError(StoreError):
    """A blob needed to rebuild a parameter group is not in the local store."""

    def __init__(self, oid: str, group: str | None = None, file: str | None = None, size: int | None = None):
        self.oid, self.group, self.file, self.size = oid, group, file, size
        where = []
        if file:
            where.append(f"file {file}")
        if group:
            where.append(f"group {group!r}")
        ctx = (" (" + ", ".join(where) + ")") if where else ""
        super().__init__(f"blob {oid} is missing from the local LFS store{ctx}; "
                         f"fetch it with `git lfs fetch` or `git theta` checkout from a remote that has it")


class BlobCorruptError(StoreError):
    """A stored blob's size or sha256 does not match its reference."""


class CheckpointError(ThetaError):
    """A checkpoint cannot be read (corrupt, unsafe, unsupported); wraps the zipslice error."""


class UpdateTypeError(ThetaError):
    """An unknown update type, or one that cannot encode/apply the given group."""


class TransferError(ThetaError):
    """Blobs could not be uploaded to or downloaded from the LFS server."""


class UpdateDataError(UpdateTypeError):
    """The side-loaded update file is malformed or does not match the checkpoint."""


class TrackError(ThetaError):
    """A pattern cannot be tracked (conflicting driver, bad pattern)."""


class GitError(ThetaError):
    """A git (or git-lfs) command failed; the message carries the command and its stderr."""


class ProtocolError(ThetaError):
    """git and the filter disagree about the protocol (truncated stream, bad length, unexpected line)."""


class MergeError(ThetaError):
    """A merge could not be computed (bad parameter, unknown strategy, incompatible groups)."""


class MergeConflict(ThetaError):
    """Groups that cannot be merged automatically (shape/dtype change, delete vs modify, no strategy)."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = problems
        super().__init__(f"{path}: cannot merge automatically: " + "; ".join(problems))


class IndexBusyError(GitError):
    """git's index is locked (``index.lock`` exists): another git command is running."""


class IndexUnsupportedError(GitError):
    """An index file theta does not update itself (split index, unknown version, malformed)."""


class PlaceholderError(ThetaError):
    """A work-tree file is a placeholder (the checkpoint's theta metadata), not the checkpoint itself."""
