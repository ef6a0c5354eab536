"""Moving blobs between the local store and the remote's LFS server (through git-lfs, so any server works).

:func:`fetch_missing` downloads, in one git-lfs run, whatever blobs of a set the store lacks;
:func:`arriving` starts that run in the background and yields a store whose reads wait for each blob, so
checkpoints are rebuilt while their blobs arrive; :func:`push_blobs` uploads blobs the pushed commits
reference. Every run moves ``lfs.concurrenttransfers`` objects at a time, keeps what a killed run had
downloaded (complete objects in the store, partial ones in ``lfs/incomplete``, resumed by the next run), and
draws a bar with bytes and rate on stderr when it is a terminal. The git-lfs plumbing is :mod:`theta.git.lfs`.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from zipslice.progress import Bar

from theta.base.errors import DownloadError, TransferError
from theta.git import lfs
from theta.git import repo as gitutil
from theta.storage.store import BlobRef, LfsStore, sha256_file

VERIFY_BATCH_BYTES = 1 << 30  # scratch space a remote verification holds at most at once (plus one object)


def _to_fetch(store: LfsStore, refs, remote: str | None, repo_dir) -> tuple[list, str | None]:
    """The blobs of ``refs`` this store lacks, and the remote to fetch them from (the default remote when
    none is named); TransferError when some are missing and there is no remote."""
    missing = store.missing(refs)
    if not missing:
        return [], None
    remote = remote or lfs.default_remote(repo_dir)
    if remote is None:
        raise TransferError(f"{len(missing)} blob(s) are missing locally (first: {missing[0].oid}) "
                            "and the repository has no remote to fetch them from")
    return missing, remote


def fetch_missing(repo_dir: str | os.PathLike, refs: Iterable[BlobRef], remote: str | None = None,
                  store: LfsStore | None = None, progress: str | None = None) -> int:
    """Download every blob of ``refs`` that the local store lacks, all in one git-lfs run.

    ``progress``: a label (e.g. the names of the files being fetched for); a bar with bytes and rate is
    drawn on stderr while git-lfs downloads, when stderr is a terminal.

    Returns how many were downloaded. Raises TransferError naming the missing oids if there is no remote
    or the remote does not have them.
    """
    store = store or LfsStore.for_repo(repo_dir)
    missing, remote = _to_fetch(store, refs, remote, repo_dir)
    if not missing:
        return 0
    with _watch(store, missing, progress), lfs.Fetch(repo_dir, remote, [(r.oid, r.size) for r in missing],
                                                     store.objects_dir.parent) as run:
        failure = run.wait()
    still = store.missing(missing)
    if failure is not None or still:
        detail = f": {failure}" if failure else ""
        first = (still or missing)[0].oid
        raise TransferError(f"could not download {len(still) or len(missing)} blob(s) from remote {remote!r} "
                            f"(first: {first}){detail}")
    return len(missing)


POLL_SECONDS = 0.02  # how often a read waiting for a blob looks for it in the store


class ArrivingStore(LfsStore):
    """The local store while one git-lfs run downloads ``pending`` blobs into it (:func:`arriving`): a
    pending blob counts as present, and reading one waits until it is there -- or until the run has ended
    without it (DownloadError, with git-lfs's reason)."""

    def __init__(self, store: LfsStore, run: "lfs.Fetch", pending: list[BlobRef], remote: str):
        super().__init__(store.objects_dir, verify=store.verify, keep_dir=store.keep_dir)
        self.run, self.remote = run, remote
        self.pending = set(pending)
        self.failure: str | None = None
        self._ended = False

    def ended(self) -> bool:
        """Whether the run is over (its failure, if any, recorded)."""
        if not self._ended and not self.run.running():
            self.failure = self.run.wait()
            self._ended = True
        return self._ended

    def has(self, ref: BlobRef) -> bool:
        return super().has(ref) or (ref in self.pending and not self.ended())

    def arrived(self, ref: BlobRef) -> bool:
        """Wait for ``ref`` while the run goes on; True once it is in the store."""
        while not super().has(ref):
            if ref not in self.pending or self.ended():
                return super().has(ref)
            time.sleep(POLL_SECONDS)
        return True

    def _open(self, ref: BlobRef):
        if not self.arrived(ref) and ref in self.pending:
            raise DownloadError(f"blob {ref.oid} did not arrive from remote {self.remote!r}: "
                                f"{self.failure or 'git-lfs did not download it'}")
        return super()._open(ref)


@contextmanager
def arriving(repo_dir: str | os.PathLike, refs: Iterable[BlobRef], remote: str | None = None,
             store: LfsStore | None = None, progress: str | None = None) -> Iterator[LfsStore]:
    """A store from which every blob of ``refs`` can be read: the local store, and while one git-lfs run
    downloads the missing ones in the background (in the order of ``refs``: list them in the order they will
    be read), an :class:`ArrivingStore` whose reads wait for them. A blob that does not arrive raises
    DownloadError when read (the checkpoint needing it is not written; the others are).

    On leaving the block the run is waited for, or stopped when the block raised (what it had downloaded
    stays, partial downloads included, for the next run). ``progress``: as :func:`fetch_missing`'s.
    TransferError when blobs are missing and there is no remote to fetch them from."""
    store = store or LfsStore.for_repo(repo_dir)
    missing, remote = _to_fetch(store, refs, remote, repo_dir)
    if not missing:
        yield store
        return
    with _watch(store, missing, progress), lfs.Fetch(repo_dir, remote, [(r.oid, r.size) for r in missing],
                                                     store.objects_dir.parent) as run:
        waiting = ArrivingStore(store, run, missing, remote)
        yield waiting
        waiting.failure = run.wait()


def push_blobs(repo_dir: str | os.PathLike, remote: str, refs: Iterable[BlobRef],
               store: LfsStore | None = None, progress: str | None = None) -> int:
    """Upload ``refs`` to ``remote``'s LFS server (the server skips those it has). Returns how many were offered.

    ``progress``: a label (the names of the files whose blobs these are); a bar with bytes and rate is drawn
    on stderr while git-lfs uploads, when stderr is a terminal."""
    store = store or LfsStore.for_repo(repo_dir)
    unique = sorted({r.oid: r for r in refs}.values(), key=lambda r: r.oid)
    if not unique:
        return 0
    absent = store.missing(unique)
    if absent:
        raise TransferError(f"cannot push: {len(absent)} blob(s) referenced by the pushed commits are not in the "
                            f"local LFS store (first: {absent[0].oid}); check out or export those versions "
                            "from a remote that has them first")
    with _upload_watch(repo_dir, remote, unique, progress) as progress_file:
        lfs.push_objects(repo_dir, remote, [r.oid for r in unique], progress_file=progress_file)
    return len(unique)


def verify_on_remote(repo_dir: str | os.PathLike, refs: Iterable[BlobRef], remote: str,
                     on_batch: Callable[[int], None] | None = None) -> set[str]:
    """The oids of ``refs`` that ``remote``'s LFS server verifiably holds: each is downloaded into a throwaway
    repository sharing nothing local (:func:`theta.git.lfs.fetched_elsewhere`; git-lfs checks the sha256, so
    do we) and dropped. git-lfs's client has no "do you have it" request outside its own prune, so this is
    the check available through it; it costs the download.

    Works in batches of about :data:`VERIFY_BATCH_BYTES` so the scratch space stays bounded; calls
    ``on_batch(bytes)`` after each. An object the server lacks (or serves wrong) is simply not returned.
    """
    todo = sorted({r.oid: r for r in refs}.values(), key=lambda r: r.oid)
    verified: set[str] = set()
    batch: list[BlobRef] = []
    size = 0
    for ref in todo + [None]:
        if ref is not None:
            batch.append(ref)
            size += ref.size
        if batch and (ref is None or size >= VERIFY_BATCH_BYTES):
            verified |= _verify_batch(repo_dir, batch, remote)
            if on_batch is not None:
                on_batch(size)
            batch, size = [], 0
    return verified


def _verify_batch(repo_dir, batch: list[BlobRef], remote: str) -> set[str]:
    with lfs.fetched_elsewhere(repo_dir, remote, [(r.oid, r.size) for r in batch]) as (objects_dir, _err):
        got = LfsStore(objects_dir)
        return {ref.oid for ref in batch if got.has(ref) and sha256_file(got.path(ref)) == ref.oid}


@contextmanager
def _polled(bar, count: Callable[[], int]) -> Iterator[None]:
    """Advance ``bar`` to ``count()`` (bytes so far) every 0.2 s while the block runs, and once more after it
    ended, so the bar closes on the real total."""
    stop = threading.Event()

    def poll() -> None:
        shown = 0
        while True:
            last = stop.wait(0.2)
            done = count()
            if done > shown:
                bar.advance(done - shown)
                shown = done
            if last:
                return

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        bar.close()


@contextmanager
def _upload_watch(repo_dir, remote: str, refs: list[BlobRef], label: str | None) -> Iterator[str | None]:
    """A progress bar fed by git-lfs's own transfer log (``GIT_LFS_PROGRESS``: a line per update with the
    bytes sent so far of one object) and, for a remote git-lfs copies files to (file://, whose transfer
    logs no bytes), by what arrives there; yields the log's path to hand to git-lfs, or None when no bar
    shows."""
    bar = Bar(label or "", sum(r.size for r in refs), enabled=label is not None)
    if not bar.active:
        yield None
        return
    remote_objects = lfs.local_remote_objects(repo_dir, remote)

    def arrived(r: BlobRef) -> bool:  # read-only: nothing is written to the remote's store
        try:
            return os.stat(remote_objects / r.oid[0:2] / r.oid[2:4] / r.oid).st_size == r.size
        except OSError:
            return False

    with tempfile.TemporaryDirectory(prefix="push-", dir=gitutil.scratch_dir(repo_dir)) as tmp:
        log = os.path.join(tmp, "progress")
        open(log, "wb").close()
        sent: dict[str, int] = {}

        with open(log, "rb") as f:
            def count() -> int:
                for line in f.read().decode("utf-8", "replace").splitlines():
                    parts = line.split()
                    if len(parts) >= 4 and "/" in parts[2]:
                        done, _, _ = parts[2].partition("/")
                        if done.isdigit():
                            sent[parts[3]] = max(sent.get(parts[3], 0), int(done))
                if remote_objects is not None:  # objects already there count whole (the server skips them)
                    for r in refs:
                        if sent.get(r.oid, 0) < r.size and arrived(r):
                            sent[r.oid] = r.size
                return sum(sent.values())

            with _polled(bar, count):
                yield log


@contextmanager
def _watch(store: LfsStore, refs: list[BlobRef], label: str | None) -> Iterator[None]:
    """A progress bar fed by what arrives in the LFS store (git-lfs downloads into ``lfs/incomplete`` and
    renames each object into place when complete): bytes of complete objects plus partial downloads."""
    bar = Bar(label or "", sum(r.size for r in refs), enabled=label is not None)
    if not bar.active:
        yield
        return
    incomplete = store.objects_dir.parent / "incomplete"  # git-lfs's partial downloads: <oid><suffix>
    arrived: set[BlobRef] = set()

    def count() -> int:
        partial: dict[str, int] = {}
        try:
            with os.scandir(incomplete) as it:
                for e in it:
                    try:
                        partial[e.name[:64]] = max(partial.get(e.name[:64], 0), e.stat().st_size)
                    except OSError:
                        pass
        except OSError:
            pass
        done = 0
        for r in refs:
            if r in arrived or store.has(r):
                arrived.add(r)
                done += r.size
            else:
                done += min(partial.get(r.oid, 0), r.size)
        return done

    with _polled(bar, count):
        yield
