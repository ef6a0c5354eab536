"""The filter's clean requests (checkpoint -> metadata text).

git sends the file's bytes; zipslice needs random access, so they must end up in a file. Fast path: while
receiving, the bytes are compared with the working-tree file at ``pathname``; if every byte matches (the normal
`git add` case) that file is cleaned in place and nothing is copied. At the first difference (or when there is no
such file, e.g. `git hash-object --stdin`) the content is spooled to a temporary file under ``<git-dir>/theta``.
``GIT_THETA_SPOOL=always`` forces spooling. Content that already is theta metadata passes through unchanged. The
metadata keeps the committed format (that of the index, else HEAD) whatever format the work-tree file has: a file
checked out in another format is a view (theta.model.views); only `git theta add --format F` (env
``GIT_THETA_FORMAT``) changes the format.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterable

import zipslice
from zipslice.errors import ZipsliceError
from zipslice.sharded import MAX_INDEX_BYTES

from theta import settings
from theta.base import faults, parallel
from theta.base.errors import CleanStopped, NotCheckpointError, ThetaError
from theta.commands.filter.messages import log
from theta.commands.filter.receive import Received, receive
from theta.model.clean import CleanStats, store_opaque
from theta.model.git_bytes import GroupHashes
from theta.model.views import clean_as_committed
from theta.peers.gittheta import files as gittheta_files
from theta.storage.metadata import dumps, is_metadata, same_content

# files git (or theta) reads from the repository itself: a `* filter=theta` pattern must not turn them into
# metadata, or a clone would read its attributes from a metadata text
GIT_OWN_FILES = frozenset({".gitattributes", ".gitignore", ".gitmodules", ".mailmap", ".thetamerge"})
# git commands whose clean requests carry the work-tree file's bytes (see CleanRequests._clean_early)
ADDS_WORK_TREE = frozenset({"add", "commit", "stash", "status", "diff"})


class _EarlyClean:
    """A clean of the work-tree file running on the "clean" thread while git's bytes arrive: its outcome is
    used when those bytes prove to be the file's (:func:`receive` compared every one), dropped otherwise."""

    def __init__(self, run, hashes: "GroupHashes | None" = None):
        self.t0 = time.perf_counter()
        self.stop = threading.Event()
        self.hashes = hashes

        def clean(stop):
            try:
                return run(stop)
            finally:
                if hashes is not None:
                    hashes.no_layout()  # (a clean that ended before laying out its groups)
        self.future = parallel.pool("clean").submit(clean, self.stop)

    def outcome(self):
        """What the clean returned (or raised)."""
        return self.future.result()

    def drop(self) -> None:
        """Stop it (before its next group) and wait until it has (its thread must not outlive the request)."""
        self.stop.set()
        self.future.cancel() or self.future.exception()


class CleanRequests:
    """The clean half of :class:`theta.commands.filter.session.Filter` (it holds the state both halves use)."""

    def clean(self, path: str, chunks: Iterable[bytes]) -> bytes:
        """The metadata to store for the work-tree content in ``chunks``, in the committed format: a file
        checked out in another format is a view of the committed one (theta.model.views).

        A file whose committed version Git-Theta wrote: if the content holds exactly the values that
        metadata checks out, the committed Git-Theta text is returned unchanged (``git status`` clean);
        otherwise it is stored in theta's format, building on the Git-Theta version as its previous one."""
        # (Git-Theta's modules are imported only when its files are met: 8 ms before the clean could start)

        worktree = self.cwd / path if path else None
        t_request = time.perf_counter()
        early = self._clean_early(path, worktree)
        try:
            hashes = early.hashes if early is not None else None
            got = receive(chunks, self.spool_dir, worktree, hashes)
            t_received = time.perf_counter()
        except BaseException:
            if early is not None:
                early.drop()
            raise
        faults.point("clean:received")
        try:
            if early is not None and got.owned:
                early.drop()  # git's bytes were not the work-tree file's: clean what git sent instead
                early = None
            if is_metadata(got.head):
                return got.path.read_bytes()  # already clean (e.g. re-clean of a metadata file)
            if (text := gittheta_files.metadata_text(got.path, got.head, got.size)) is not None:
                return text  # Git-Theta's own metadata text: already clean
            if Path(path).name in GIT_OWN_FILES:
                return got.path.read_bytes()  # git reads these itself (a `*` pattern catches them): never stored
            if _is_shard_index(got):
                # the index of a sharded checkpoint (a `*` or `*.json` pattern catches it): its shards are
                # tracked files of their own, so it stays the small JSON text it is -- stored as a checkpoint
                # it would duplicate every shard and could not be checked out as one file
                return got.path.read_bytes()
            t0 = time.perf_counter()
            if early is not None:
                previous_text, meta, stats, before = early.outcome()
                t0 = early.t0
            else:
                before = _stat_key(got.path) if not got.owned else None
                previous_text = self.previous_text(path)
                previous = self.previous(path, previous_text)
                committed = gittheta_files.committed(path, self.cwd, self.store) if previous is None and path else None
                if committed is not None:
                    kept, previous = gittheta_files.previous_for_clean(committed, got.path, self.spool_dir)
                    if kept is not None:
                        return kept
                meta, stats = self._clean_file(path, got.path, previous)
            for w in stats.warnings:
                log(f"warning: {path}: {w}")
            if before is not None and _stat_key(got.path) != before:
                raise ThetaError(f"{path}: the file changed while git was adding it; run `git add` again")
            if settings.env("TIMING"):
                log(f"clean {path}: {got.size / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f}s "
                    f"({'spooled' if got.owned else 'read in place'}"
                    f"{', while git sent it' if early is not None else ''}"
                    f"{f', {early.hashes.hashed} groups hashed from them' if early is not None and early.hashes is not None else ''}; "
                    f"git's bytes received "
                    f"{t_received - t_request:.2f}s after the request, the clean done "
                    f"{time.perf_counter() - t_request:.2f}s after)")
            text = dumps(meta, file=path).encode("utf-8")
            faults.point("clean:done")
            if previous_text is not None and previous_text != text and same_content(previous_text, text):
                return previous_text  # the same checkpoint committed by an older theta: keep its bytes
            return text
        finally:
            if early is not None:
                early.drop()  # no-op once its outcome was taken
            got.cleanup()

    def _clean_file(self, path: str, file: Path, previous, stop=None, hashes=None):
        """(metadata, CleanStats) of the checkpoint at ``file`` (the content of ``path``); a file theta cannot
        read as a checkpoint is stored as one opaque blob."""
        stats = CleanStats()
        try:
            meta = clean_as_committed(file, self.store, previous, settings.clean_options(self.cwd),
                                      settings.commit_format(), stats=stats, name=path, stop=stop,
                                      git_bytes=hashes)
        except NotCheckpointError as e:
            # not a checkpoint (a README under `* filter=theta`, a zip, a damaged file): keep its bytes as
            # one blob, as git-lfs would, and say so on one line
            reason = " ".join(e.reason.replace(str(file), path).split())[:200]
            log(f"warning: {path} is not a checkpoint theta can read ({reason}); stored as one opaque blob")
            meta = store_opaque(file, self.store)
        except CleanStopped:
            raise
        except ThetaError as e:
            raise ThetaError(str(e).replace(str(file), path)) from None
        return meta, stats

    def _clean_early(self, path: str, worktree: Path | None) -> "_EarlyClean | None":
        """Start cleaning the work-tree file while git's bytes still arrive (they are that file's in a
        `git add`): reading git's pipe and comparing it with the file overlaps the clean instead of preceding
        it. None when the bytes must be seen first (no such file, ``GIT_THETA_SPOOL=always``, metadata,
        Git-Theta text, git's own files, a file whose committed version Git-Theta wrote) or when there is no
        thread to clean on (``GIT_THETA_THREADS=1``)."""
        if worktree is None or not path or settings.env("SPOOL") == "always" or Path(path).name in GIT_OWN_FILES:
            return None
        if parallel.CODEC_THREADS <= 1:
            # GIT_THETA_THREADS=1: the "clean" pool runs inline, so an early clean would run before git's bytes
            # are received, on the thread that receives them, and wait for their hashes for good
            return None
        try:
            if not worktree.is_file():
                return None
            before = _stat_key(worktree)
            with open(worktree, "rb") as f:
                head = f.read(4096)
        except OSError:
            return None
        if is_metadata(head) or head.lstrip()[:1] == b"{" or before is None:  # JSON: metadata, shard indexes
            return None
        previous_text = self.previous_text(path)
        previous = self.previous(path, previous_text)
        if previous is None and gittheta_files.committed(path, self.cwd, self.store) is not None:
            return None
        # git's bytes are hashed group by group instead of compared (theta.model.git_bytes) when they surely are the
        # work-tree file's: the commands that add it (another command may send other bytes under its name,
        # e.g. `git hash-object --path`; those are compared byte by byte, and spooled when they differ)
        hashes = GroupHashes(path) if self.invoker() in ADDS_WORK_TREE else None
        return _EarlyClean(lambda stop: (previous_text, *self._clean_file(path, worktree, previous, stop, hashes),
                                         before), hashes)


def _is_shard_index(got: "Received") -> bool:
    """Is the content a sharded checkpoint's ``*.index.json`` (JSON naming a shard file per tensor)?"""
    if got.head.lstrip()[:1] != b"{" or got.size > MAX_INDEX_BYTES:
        return False
    try:
        return zipslice.sniff(got.path) == "sharded"
    except (ZipsliceError, OSError):
        return False


def _stat_key(p: Path):
    st = p.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


