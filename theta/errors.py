"""Exceptions raised by theta. Each carries one clear line: what, where, and what to do.

The CLI prints ``error: <message>`` and exits 1 for every :class:`ThetaError`.
"""
from __future__ import annotations


class ThetaError(Exception):
    """Base of every error theta raises on purpose."""


class MetadataError(ThetaError):
    """A metadata text is malformed, of an unknown version, or inconsistent."""


class GitThetaFormatError(MetadataError):
    """A Git-Theta (0.2.0) metadata text, parameter blob or update chain is malformed or inconsistent.

    ``file``, ``group`` and ``field`` say where (each may be None); the message names them too.
    """

    def __init__(self, problem: str, *, file: str | None = None, group: str | None = None,
                 field: str | None = None):
        self.problem, self.file, self.group, self.field = problem, file, group, field
        where = [f"Git-Theta {file}" if file else "Git-Theta data"]
        if group is not None:
            where.append(f"group {group!r}")
        if field:
            where.append(field)
        super().__init__(", ".join(where) + ": " + problem)


class GitThetaUpdateTypeError(GitThetaFormatError):
    """A Git-Theta group uses an update type theta cannot apply (not dense, sparse, low-rank or ia3)."""


class GitThetaDependencyError(ThetaError):
    """Reading Git-Theta parameter blobs needs the optional `gittheta` extra (zarr), which is not installed."""


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


class ViewError(ThetaError):
    """A checkpoint cannot be shown in, or recorded from, another format than the committed one (a group the
    target format cannot hold: a dtype it lacks, a name it cannot spell, a place the structure does not have)."""
class PruneError(ThetaError):
    """`git theta prune` refused to run: it could not prove that what it would delete is not needed."""
