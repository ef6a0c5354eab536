"""Downloads one process starts early for another to read: the filter starts downloading a checkpoint's
blobs the moment it hands git the checkpoint's placeholder, and whoever writes the checkpoint once git is done
(the post-checkout hook, or the filter at its end) reads them as they arrive instead of starting its own
git-lfs run. The hook is a new Python process that starts only after git has written the work tree: its
run began ~0.35 s after the filter could have started one, ~10 % of an unlimited clone of a 300 MiB model.

A prefetch is one ``git lfs fetch`` (:class:`theta.git.lfs.Fetch`) and a record,
``<git-common-dir>/theta/prefetch/<pid>-<n>.json`` (the oids it downloads), locked (``flock``) by that git-lfs
process for as long as it runs: the lock is released when git-lfs ends however it ends (a kill included),
so a reader tells a running prefetch from a finished or abandoned one by trying the lock, and no process
needs to outlive another to say so. A record is visible only once locked and complete (written under a temp
name, then renamed). A reader waits for the blobs of a running prefetch and fetches itself whatever that
prefetch ended without (:func:`theta.storage.transfer.arriving`): an early download never decides the outcome.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from itertools import count
from pathlib import Path

from theta.git import lfs
from theta.git import repo as gitutil
from theta.storage.store import BlobRef, LfsStore

RECORDS = "prefetch"
MAX_RECORD_BYTES = 16 << 20  # a record larger than this is not ours to read
_numbers = count()


def _records_dir(repo_dir) -> Path:
    d = gitutil.theta_dir(repo_dir) / RECORDS
    d.mkdir(exist_ok=True)
    return d


class Prefetch:
    """A download started by this process for another to read (:func:`start`); :meth:`close` stops it if it
    still runs (what it downloaded stays, partial downloads too, for the next run to resume) and removes
    its record."""

    def __init__(self, run: lfs.Fetch, record: Path):
        self.run, self.record = run, record

    def close(self) -> None:
        try:
            self.run.close()
        finally:
            with contextlib.suppress(OSError):
                self.record.unlink()


def start(repo_dir, refs: list[BlobRef], store: LfsStore) -> Prefetch | None:
    """Start downloading the blobs of ``refs`` the store lacks, in their order, in the background; None when
    none is missing or there is no remote to fetch from (the reader's own run then says why)."""
    missing = store.missing(refs)
    if not missing:
        return None
    remote = lfs.default_remote(repo_dir)
    if remote is None:
        return None
    records = _records_dir(repo_dir)
    name = f"{os.getpid()}-{next(_numbers)}.json"
    temp = records / f".{name}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"oids": [r.oid for r in missing]}).encode())
        os.rename(temp, records / name)
        run = lfs.Fetch(repo_dir, remote, [(r.oid, r.size) for r in missing], store.objects_dir.parent,
                        hold_fd=fd)
        try:
            run.start()
        except BaseException:
            run.close()
            raise
    except Exception:  # an early download only saves time: whatever stops it, the reader fetches for itself
        with contextlib.suppress(OSError):
            os.unlink(temp)
        with contextlib.suppress(OSError):
            os.unlink(records / name)
        return None
    finally:
        os.close(fd)  # from now on git-lfs alone holds the lock: it is released when git-lfs ends
    return Prefetch(run, records / name)


class Running:
    """Another process's prefetch, seen from the reader: the oids it downloads, and whether it still runs."""

    def __init__(self, fd: int, oids: set[str]):
        self._fd, self.oids = fd, oids
        self._ended = False

    def ended(self) -> bool:
        if not self._ended:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self._ended = True
            os.close(self._fd)
        return True

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            os.close(self._fd)


def records(repo_dir) -> list[Running]:
    """The prefetches of this repository, running or ended (an ended one's blobs are in the store, or are to
    be fetched by the reader); the records of starters that are gone are removed."""
    try:
        folder = _records_dir(repo_dir)
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for name in names:
        pid, _, rest = name.partition("-")
        if not name.endswith(".json") or not pid.isdigit():
            continue
        path = folder / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            data = json.loads(os.pread(fd, MAX_RECORD_BYTES + 1, 0))
            oids = data["oids"]
            if not isinstance(oids, list) or not all(isinstance(o, str) for o in oids):
                raise ValueError("not a list of oids")
        except (OSError, ValueError, KeyError, TypeError):
            os.close(fd)
            continue
        source = Running(fd, set(oids))
        if source.ended() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()  # its starter was killed: nobody else removes it
            continue
        out.append(source)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
