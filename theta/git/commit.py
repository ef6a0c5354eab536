"""A commit of a few files' new blobs on top of HEAD, made without the work tree and without the user's index.

What `git commit --only PATH` does for a file that is in the work tree, done with git's plumbing for content
that is not: the new tree is HEAD's tree with only the given entries replaced (built in a temporary index,
so whatever else the user has staged stays staged and out of this commit), the commit is made by
`git commit-tree` and HEAD moves with `git update-ref`, which refuses when HEAD moved meanwhile. Then the
user's index is told the new blob ids of those entries only (`git update-index --cacheinfo`), so the index
matches the new HEAD for them. No hook runs (as for every plumbing commit); ``commit.gpgSign`` is honoured.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from theta.base.errors import GitError
from theta.git import repo as gitutil

REGULAR = "100644"
EXECUTABLE = "100755"


@dataclass(frozen=True)
class IndexEntry:
    """One stage of a path in an index or a tree: its mode and blob id."""

    mode: str
    oid: str
    stage: int = 0


def head_commit(top: str | os.PathLike) -> str | None:
    """The commit HEAD points to, or None on an unborn branch."""
    out = gitutil.run(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"], top, check=False).decode().strip()
    return out or None


def tree_entry(top: str | os.PathLike, commit: str | None, rel: str) -> tuple[str, str, str] | None:
    """``(mode, type, oid)`` of ``rel`` in ``commit``'s tree, or None (no commit, or no such path)."""
    if commit is None:
        return None
    out = gitutil.run(["ls-tree", "-z", "--full-tree", commit, "--", rel], top).decode("utf-8", "surrogateescape")
    for item in out.split("\0"):
        if not item:
            continue
        info, _, name = item.partition("\t")
        if name == rel:
            mode, typ, oid = info.split()
            return mode, typ, oid
    return None


def index_entries(top: str | os.PathLike, rel: str) -> list[IndexEntry]:
    """Every stage of ``rel`` in the user's index (several while a merge conflict is unresolved)."""
    out = gitutil.run(["ls-files", "-z", "--stage", "--full-name", "--", rel], top).decode("utf-8", "surrogateescape")
    entries = []
    for item in out.split("\0"):
        if not item:
            continue
        info, _, name = item.partition("\t")
        if name == rel:
            mode, oid, stage = info.split()
            entries.append(IndexEntry(mode, oid, int(stage)))
    return entries


def write_blob(top: str | os.PathLike, data: bytes) -> str:
    """Store ``data`` as a blob exactly as given (no filter runs) and return its id."""
    return gitutil.run(["hash-object", "-w", "--no-filters", "--stdin"], top, input=data).decode().strip()


def operation_in_progress(top: str | os.PathLike) -> str | None:
    """The git operation that would take the next commit as its own (a merge, a rebase...), or None."""
    for name, what in (("MERGE_HEAD", "a merge"), ("CHERRY_PICK_HEAD", "a cherry-pick"),
                       ("REVERT_HEAD", "a revert"), ("rebase-merge", "a rebase"), ("rebase-apply", "a rebase or am")):
        if gitutil.git_path(name, top).exists():
            return what
    return None


def commit_entries(top: str | os.PathLike, entries: dict[str, tuple[str, str]], message: str,
                   parent: str | None, scratch: str | os.PathLike) -> str:
    """Commit ``entries`` (``rel -> (mode, blob id)``) on top of ``parent`` (None: a root commit) and move HEAD
    there from ``parent``; returns the new commit's id. The user's index is not touched (see
    :func:`stage_entries`). ``scratch``: a directory of this process's own for the temporary index."""
    index = Path(scratch) / "inprocess-index"
    env = dict(os.environ, GIT_INDEX_FILE=str(index))
    try:
        gitutil.run(["read-tree", parent] if parent is not None else ["read-tree", "--empty"], top, env=env)
        info = "".join(f"{mode} {oid}\t{rel}\0" for rel, (mode, oid) in entries.items())
        gitutil.run(["update-index", "-z", "--add", "--index-info"], top, input=info.encode("utf-8", "surrogateescape"),
                    env=env)
        tree = gitutil.run(["write-tree"], top, env=env).decode().strip()
    finally:
        try:
            index.unlink()
        except FileNotFoundError:
            pass
    args = ["commit-tree", tree]
    if parent is not None:
        args += ["-p", parent]
    if _sign(top):
        args.append("-S")
    commit = gitutil.run([*args, "-F", "-"], top, input=message.encode("utf-8")).decode().strip()
    subject = message.strip().splitlines()[0] if message.strip() else ""
    reflog = f"commit{' (initial)' if parent is None else ''}: {subject}"
    # the old value makes update-ref refuse when HEAD moved since ``parent`` was read ("" = must not exist)
    gitutil.run(["update-ref", "-m", reflog, "HEAD", commit, parent if parent is not None else ""], top)
    return commit


def attribute_with(top: str | os.PathLike, rel: str, attr: str, entries: dict[str, tuple[str, str]],
                   scratch: str | os.PathLike) -> str | None:
    """The value of ``attr`` for ``rel`` were ``entries`` (e.g. a new ``.gitattributes``) in the index: asked of
    `git check-attr --cached` on a copy of the user's index, so no work-tree file is touched."""
    index = Path(scratch) / "attributes-index"
    user_index = gitutil.git_path("index", top)
    try:
        if user_index.exists():
            shutil.copyfile(user_index, index)
        env = dict(os.environ, GIT_INDEX_FILE=str(index))
        info = "".join(f"{mode} {oid}\t{path}\0" for path, (mode, oid) in entries.items())
        gitutil.run(["update-index", "-z", "--add", "--index-info"], top, input=info.encode("utf-8", "surrogateescape"),
                    env=env)
        out = gitutil.run(["check-attr", "--cached", "-z", attr, "--", rel], top, env=env).split(b"\0")
    finally:
        try:
            index.unlink()
        except FileNotFoundError:
            pass
    value = out[2].decode() if len(out) > 2 else "unspecified"
    return None if value in ("unspecified", "unset") else value


def stage_entries(top: str | os.PathLike, entries: dict[str, tuple[str, str]]) -> None:
    """Record ``entries`` (``rel -> (mode, blob id)``) in the user's index, under git's own lock. Their stat
    data is left empty: git compares the work-tree file's content with them when it next looks."""
    info = "".join(f"{mode} {oid}\t{rel}\0" for rel, (mode, oid) in entries.items())
    gitutil.run(["update-index", "-z", "--add", "--index-info"], top, input=info.encode("utf-8", "surrogateescape"))


def create_tag(top: str | os.PathLike, tag: str, commit: str) -> None:
    """A lightweight tag ``tag`` on ``commit``; refused by git if it exists (never moved)."""
    gitutil.run(["update-ref", "-m", f"tag: {tag}", f"refs/tags/{tag}", commit, ""], top)


def check_new_tag(top: str | os.PathLike, tag: str) -> None:
    """Raise GitError unless ``tag`` is a valid tag name that does not exist yet."""
    if gitutil.run_status(["check-ref-format", f"refs/tags/{tag}"], top) != 0 or tag.startswith("-"):
        raise GitError(f"{tag!r} is not a valid tag name")
    if gitutil.rev_exists(f"refs/tags/{tag}", top):
        raise GitError(f"tag {tag!r} already exists")


def _sign(top) -> bool:
    """Whether commits are signed here (``commit.gpgSign``, which `git commit-tree` does not read itself)."""
    value = gitutil.config_get("commit.gpgSign", top)
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")
