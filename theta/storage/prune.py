"""`git theta prune`: delete the blobs theta keeps that nothing local needs.

What is needed is :mod:`theta.storage.retention`'s rule (every ref tip, every index and worktree HEAD, the
stash, and every commit no remote has, reflog entries included). Everything else theta keeps under its
protected name (:data:`theta.storage.store.KEEP_DIR`) is a candidate: blobs of older, pushed versions and
blobs nothing refers to any more (an amended commit after its reflog expired, a `git add` undone).

Safety, in order:
- a metadata text in the needed set that cannot be read stops the prune (what it needs is unknown);
- a git command writing an index (``index.lock`` in any worktree) stops it, checked at the start and again
  just before deleting: `git add` stores blobs before it records them;
- a candidate used after the plan started (a `git add` that re-stores it touches it) is left;
- with ``verify_remote`` only blobs downloaded back from the remote with the right sha256 are deleted;
- when ``lfs.storage`` moves the store (perhaps shared by other repositories, whose needs this one cannot
  see) only a verified prune may delete.
Plain git-lfs objects are never candidates: theta only deletes blobs under its own protected name.

A needed blob whose two names are two separate files (a copy of the repository that lost its hard links)
is made one file again when both copies hash right; the bytes count as freed.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from theta.base.errors import PruneError
from theta.git import inventory
from theta.git import lfs
from theta.git import repo as gitutil
from theta.storage import retention
from theta.storage.store import BlobRef, LfsStore
from theta.storage.transfer import verify_on_remote


@dataclass
class PruneReport:
    """What a prune kept and deleted (or, with ``dry_run``, would delete)."""

    dry_run: bool
    needed: int = 0                                         # blobs the local state needs (all kept)
    kept: int = 0                                           # blobs under theta's name before the prune
    candidates: list[BlobRef] = field(default_factory=list)  # kept blobs nothing local needs
    deleted: list[BlobRef] = field(default_factory=list)     # (or would be, dry run)
    freed: int = 0                                          # bytes freed on disk (dry run: would free)
    unverified: list[BlobRef] = field(default_factory=list)  # the remote did not give them back: kept
    recent: list[BlobRef] = field(default_factory=list)      # used while the prune ran: kept
    relinked: list[BlobRef] = field(default_factory=list)    # kept blobs whose two names were two copies
    remote: str | None = None                               # the remote verified against


def prune_remote(cwd=None) -> str | None:
    """The remote a verification asks: ``lfs.pruneremotetocheck`` (as git-lfs), else the default remote."""
    return gitutil.config_get("lfs.pruneremotetocheck", cwd) or lfs.default_remote(cwd)


def prune(cwd=None, store: LfsStore | None = None, dry_run: bool = False, verify_remote: bool = False,
          remote: str | None = None, on_verified: Callable[[int], None] | None = None) -> PruneReport:
    """Delete (or list, ``dry_run``) the blobs theta keeps that nothing local needs; see the module doc."""
    store = store or LfsStore.for_repo(cwd or ".")
    report = PruneReport(dry_run=dry_run)
    started = time.time()
    _refuse_while_git_writes(cwd)
    if verify_remote:
        report.remote = remote or prune_remote(cwd)
        if report.remote is None:
            raise PruneError("--verify-remote: this repository has no remote to verify against "
                             "(set lfs.pruneremotetocheck or add a remote)")
    elif retention.lfs_storage_is_custom(cwd) and not dry_run:
        raise PruneError("lfs.storage moves this repository's LFS store, which other repositories may share "
                         "(their needs are invisible from here): prune with --verify-remote")

    scan = retention.scan_needed(cwd)
    needed = retention.needed_refs(scan, cwd)
    report.needed = len(needed)
    for ref in needed.values():
        store.has(ref)  # give every needed blob theta's protected name (blobs stored before theta kept one)
    kept = list(store.kept())
    report.kept = len(kept)
    for ref in kept:
        if ref.oid in needed and store.is_duplicated(ref):
            # e.g. a repository copied without its hard links: one file again (after checking both)
            freed = ref.size if dry_run else store.relink(ref)
            if freed:
                report.relinked.append(ref)
                report.freed += freed
    # an object a git-lfs pointer names is never theta's to delete, even if theta stored the same bytes
    report.candidates = sorted((r for r in kept if r.oid not in needed and r.oid not in scan.pointers),
                               key=lambda r: r.oid)
    deletable = report.candidates
    if verify_remote and deletable:
        ok = verify_on_remote(cwd or ".", deletable, report.remote, on_batch=on_verified)
        report.unverified = [r for r in deletable if r.oid not in ok]
        deletable = [r for r in deletable if r.oid in ok]
    if not dry_run:
        _refuse_while_git_writes(cwd)
    for ref in deletable:
        stats = [st for st in (_stat(store.keep_path(ref)), _stat(store.path(ref))) if st is not None]
        if not stats:
            continue  # gone meanwhile
        if max(st.st_mtime for st in stats) > started:
            report.recent.append(ref)
            continue
        report.deleted.append(ref)
        report.freed += ref.size if dry_run else store.remove(ref)
    return report


def _refuse_while_git_writes(cwd) -> None:
    locks = inventory.index_locks(cwd)
    if locks:
        raise PruneError(f"a git command is writing an index ({locks[0]} exists); it may be storing blobs it has "
                         "not recorded yet: prune when it has finished (remove the lock only if no git runs)")


def _stat(p) -> os.stat_result | None:
    try:
        return os.stat(p) if p is not None else None
    except FileNotFoundError:
        return None
