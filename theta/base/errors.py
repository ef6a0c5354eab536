"""Exceptions raised by theta. Each carries one clear line: what, where, and what to do.

The CLI prints ``error: <message>`` and exits 1 for every :class:`ThetaError`. A missing optional package is
zipslice's :class:`MissingDependencyError` (imported here: theta's code names it from this module), raised by
theta as :class:`ThetaDependencyError`.
"""
from __future__ import annotations

from zipslice.errors import MissingDependencyError


class ThetaError(Exception):
    """Base of every error theta raises on purpose."""


class MetadataError(ThetaError):
    """A metadata text is malformed, of an unknown version, inconsistent, or over a limit.

    ``file``, ``group`` and ``field`` say where, when known (theta.storage.schema fills them in).
    """

    def __init__(self, message: str, file: str | None = None, group: str | None = None, field: str | None = None):
        self.file, self.group, self.field = file, group, field
        super().__init__(message)


class IntegrityError(ThetaError):
    """Base of the errors about stored data that is not what its metadata says (corrupt, forged, over a limit).

    ``file``, ``group`` and ``oid`` say where, when known; :func:`located` (theta.updates.bounds) adds them.
    """

    def __init__(self, message: str, file: str | None = None, group: str | None = None, oid: str | None = None):
        self.file, self.group, self.oid = file, group, oid
        super().__init__(message)


class CodecError(IntegrityError):
    """A stored blob cannot be decoded (truncated, corrupt, over a limit, or of an unknown encoding)."""


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
        super().__init__(", ".join(where) + ": " + problem, file=file, group=group, field=field)


class GitThetaUpdateTypeError(GitThetaFormatError):
    """A Git-Theta group uses an update type theta cannot apply (not dense, sparse, low-rank or ia3)."""


class ThetaDependencyError(ThetaError, MissingDependencyError):
    """An optional package a theta call needs is not installed (zarr for Git-Theta's parameter blobs, matplotlib
    for ``--png``, transformers for the Trainer callback): zipslice's :class:`MissingDependencyError` (one line:
    the package, the extra, what works without it), and a ThetaError, so every command, driver and hook that
    reports theta's errors reports it. Raised through ``zipslice.optional.require(..., error=...)``."""


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


class BlobCorruptError(StoreError, IntegrityError):
    """A stored blob's size or sha256 does not match its reference, or a rebuilt value its content hash."""

    def __init__(self, message: str, file: str | None = None, group: str | None = None, oid: str | None = None):
        IntegrityError.__init__(self, message, file=file, group=group, oid=oid)


class CheckpointError(ThetaError):
    """A checkpoint cannot be read (corrupt, unsafe, unsupported); wraps the zipslice error."""


class CleanStopped(ThetaError):
    """A clean asked to stop (``clean_checkpoint(stop=...)``) before it finished, e.g. a clean started on the
    work-tree file while git's bytes arrived, which turned out not to be that file's."""


class FileChanged(ThetaError):
    """git's bytes of a file (or of one of its groups) differ from the work-tree file's, which the clean read:
    the file changed while git was reading it (theta.model.git_bytes)."""


class NotCheckpointError(CheckpointError):
    """The file is not a checkpoint at all (zipslice's NotACheckpointError: a README, an empty file, an
    HTML page, a zip without data.pkl): the git filter stores it as one opaque blob, as git-lfs would.
    A damaged, unsafe or unsupported checkpoint is a plain CheckpointError (refused, never stored).
    ``reason`` is zipslice's one-line explanation."""

    def __init__(self, message: str, reason: str = ""):
        self.reason = reason
        super().__init__(message)


class UpdateTypeError(ThetaError):
    """An unknown update type, or one that cannot encode/apply the given group."""


class TransferError(ThetaError):
    """Blobs could not be uploaded to or downloaded from the LFS server."""


class DownloadError(TransferError, StoreError):
    """A blob being downloaded in the background did not arrive (the git-lfs run ended without it)."""


class ChainError(UpdateTypeError, IntegrityError):
    """A group's chain of steps cannot be rebuilt: malformed, an unknown step type, over a limit, or a step
    that rebuilt a value other than the one recorded."""

    def __init__(self, message: str, file: str | None = None, group: str | None = None, oid: str | None = None):
        IntegrityError.__init__(self, message, file=file, group=group, oid=oid)


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


class IndexBusyError(GitError):
    """git's index is locked (``index.lock`` exists): another git command is running."""


class IndexUnsupportedError(GitError):
    """An index file theta does not update itself (split index, unknown version, malformed)."""


class PlaceholderError(ThetaError):
    """A work-tree file is a placeholder (the checkpoint's theta metadata), not the checkpoint itself."""


class NotARepositoryError(GitError):
    """A path that must be inside a git work tree is not (no repository, or a bare one)."""


class StagedChangesError(ThetaError):
    """A path has staged changes (or an unresolved conflict) that a commit of it from Python would take or lose."""
