"""What a repository's local state refers to, as lists of git objects (one `git rev-list` each).

These are the starting points of `git theta prune`, `fsck` and `status`; which of the listed blobs are theta
metadata, and which LFS objects they need, is decided above (:mod:`theta.storage.retention`).

- :func:`local_only_objects`: everything no remote-tracking ref reaches — unpushed commits of every ref,
  every reflog entry (commits after a reset, an amend or a deleted branch, until git expires them), every
  stash entry, the index of every worktree (including conflict stages), the HEAD of every worktree.
- :func:`tip_objects`: the trees of ref tips (what checking them out needs), all refs or local ones only.
- :func:`rev_objects`: the trees of the given revisions.

Every function returns ``(sha, path)`` pairs: the path is the first one git met the object at ('' for a
root tree or a commit). ``max_blob_size`` leaves larger blobs out (git filters them: they are never read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from theta.base.errors import GitError
from theta.git import repo as gitutil


@dataclass(frozen=True)
class ListedObject:
    sha: str
    path: str


def _rev_list(args: Sequence[str], cwd, max_blob_size: int | None) -> list[ListedObject]:
    extra = [f"--filter=blob:limit={max_blob_size}"] if max_blob_size is not None else []
    out = gitutil.run(["rev-list", "--objects", *extra, *args], cwd).decode("utf-8", "surrogateescape")
    listed = []
    for line in out.splitlines():
        sha, _, path = line.partition(" ")
        if sha:
            listed.append(ListedObject(sha, path))
    return listed


def local_only_objects(cwd=None, max_blob_size: int | None = None) -> list[ListedObject]:
    """Objects reachable from local refs, reflogs, the stash, worktree HEADs and indexes, but from no
    remote-tracking ref (with no remote: every such object). ``--all``, ``--reflog`` and
    ``--indexed-objects`` cover every worktree of the repository (git's default)."""
    return _rev_list(["--all", "--reflog", "--indexed-objects", "--not", "--remotes"], cwd, max_blob_size)


def tip_objects(cwd=None, include_remotes: bool = True, max_blob_size: int | None = None) -> list[ListedObject]:
    """The objects of the tip tree of every ref (remote-tracking ones too, unless ``include_remotes`` is
    False) and of every worktree's HEAD; no history."""
    args = ["--no-walk"] + ([] if include_remotes else ["--exclude=refs/remotes/*"]) + ["--all"]
    return _rev_list(args, cwd, max_blob_size)


def indexed_objects(cwd=None, max_blob_size: int | None = None) -> list[ListedObject]:
    """The blobs and cache trees of the index of every worktree."""
    return _rev_list(["--no-walk", "--indexed-objects"], cwd, max_blob_size)


def rev_objects(revs: Sequence[str], cwd=None, max_blob_size: int | None = None) -> list[ListedObject]:
    """The objects of the trees of ``revs`` (commits, tags or trees); GitError naming a revision that is
    not one."""
    resolved = []
    for rev in revs:
        if rev.startswith("-"):
            raise GitError(f"{rev!r} is not a revision")
        sha = gitutil.run_text(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{tree}}"], cwd,
                               check=False)
        if not sha:
            raise GitError(f"{rev!r} does not name a commit or a tree in this repository")
        resolved.append(sha)
    if not resolved:
        return []
    return _rev_list(["--no-walk", *resolved], cwd, max_blob_size)


@dataclass(frozen=True)
class Worktree:
    path: str
    head: str | None   # None in a repository without commits
    branch: str | None  # e.g. refs/heads/main; None when detached
    bare: bool


def worktrees(cwd=None) -> list[Worktree]:
    """Every worktree of the repository (the main one first), from `git worktree list --porcelain`."""
    out = gitutil.run(["worktree", "list", "--porcelain", "-z"], cwd).decode("utf-8", "surrogateescape")
    found, cur = [], {}
    for field in out.split("\0"):
        if not field:
            if cur:
                found.append(cur)
                cur = {}
            continue
        key, _, value = field.partition(" ")
        cur[key] = value
    if cur:
        found.append(cur)
    return [Worktree(path=c["worktree"], head=c.get("HEAD") if c.get("HEAD", "0" * 40).strip("0") else None,
                     branch=c.get("branch"), bare="bare" in c) for c in found if "worktree" in c]


def index_entries(worktree: str | os.PathLike) -> list[tuple[str, str, int]]:
    """(path, blob sha, stage) of every entry of ``worktree``'s index."""
    out = gitutil.run(["ls-files", "-z", "--stage"], worktree).decode("utf-8", "surrogateescape")
    entries = []
    for item in out.split("\0"):
        if not item:
            continue
        meta, _, path = item.partition("\t")
        mode, sha, stage = meta.split()
        if mode != "160000":  # submodules are commits, not blobs
            entries.append((path, sha, int(stage)))
    return entries


def index_locks(cwd=None) -> list[str]:
    """The ``index.lock`` files present now, over every worktree: each means a git command (add, commit,
    merge, stash, ...) is writing that index, and may be storing blobs it has not recorded yet."""
    locks = []
    for wt in worktrees(cwd):
        if wt.bare or not os.path.isdir(wt.path):
            continue
        lock = gitutil.run_text(["rev-parse", "--path-format=absolute", "--git-path", "index.lock"], wt.path,
                                check=False)
        if lock and os.path.exists(lock):
            locks.append(lock)
    return locks
