"""The theta-tracked checkpoints of the index or a revision, as a user needs them: their metadata texts, what
`git theta ls-files` lists (group count, sizes, whether every blob is local) and what `git theta status` reports.

Per file, for status: whether the work tree holds the checkpoint (materialized) or still its metadata text (a
placeholder: the file starts with ``theta-metadata ``, e.g. left by a clone without theta or a bigger-than-RAM
checkout), how many of its blobs are local, its size and format, and the staged change against HEAD as
group counts (added / removed / modified). Reads metadata and stats files only; never reads a checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Iterator

from zipslice import dtypes

from theta.base.errors import MetadataError
from theta.git import inventory
from theta.git import repo as gitutil
from theta.storage.metadata import MAGIC, CheckpointMeta, is_metadata, loads
from theta.storage.store import LfsStore


@dataclass(frozen=True)
class TrackedFile:
    path: str
    format: str
    groups: int
    size: int          # bytes of all parameter groups' values
    stored: int        # bytes of the distinct blobs needed to rebuild it
    local: bool        # every blob is in the local LFS store


def iter_metadata(rev: str | None = None, cwd=None) -> Iterator[tuple[str, bytes]]:
    """(path, metadata text) of each theta-tracked checkpoint of ``rev`` (None: the index)."""
    if rev is None:
        names = gitutil.run(["ls-files", "-z", "--cached"], cwd).decode().split("\0")
        spec = ":{}".format
    else:
        names = gitutil.run(["ls-tree", "-r", "-z", "--name-only", rev], cwd).decode().split("\0")
        spec = (rev + ":{}").format
    names = [n for n in names if n]
    attrs = gitutil.check_attr("filter", names, cwd)
    candidates = [n for n in names if attrs.get(n) == "theta"]
    with gitutil.CatFile(cwd) as cat:
        for name in candidates:
            info, data = cat.read(spec(name))
            if info is not None and is_metadata(data):
                yield name, data


def list_tracked(rev: str | None = None, cwd=None) -> list[TrackedFile]:
    """Checkpoints stored as theta metadata in ``rev`` (None: the index)."""
    store = LfsStore.for_repo(cwd or ".")
    out = []
    for name, data in iter_metadata(rev, cwd):
        meta = loads(data, file=name)
        size = meta.opaque.size if meta.is_opaque else sum(g.numel * dtypes.get(g.dtype).itemsize
                                                           for g in meta.groups.values())
        refs = {r.oid: r for r in meta.blob_refs()}
        out.append(TrackedFile(name, meta.format, len(meta.groups), size,
                               sum(r.size for r in refs.values()),
                               all(store.has(r) for r in refs.values())))
    return out


MATERIALIZED, PLACEHOLDER, ABSENT, CONFLICT = "materialized", "placeholder", "absent", "conflict"


@dataclass
class Staged:
    """The index's version against HEAD's, in groups (``new_file``: HEAD has no theta version of it)."""

    added: int = 0
    removed: int = 0
    modified: int = 0
    new_file: bool = False

    @property
    def any(self) -> bool:
        return self.new_file or bool(self.added or self.removed or self.modified)


@dataclass
class FileStatus:
    path: str
    state: str                  # materialized, placeholder, absent (deleted in the work tree), conflict
    format: str | None = None
    groups: int = 0
    size: int = 0               # bytes of all groups' values
    stored: int = 0             # bytes of the distinct blobs it needs
    blobs: int = 0              # distinct blobs it needs
    blobs_local: int = 0
    worktree_bytes: int | None = None
    staged: Staged = field(default_factory=Staged)
    error: str | None = None    # the index's metadata cannot be read
    why: str | None = None      # a placeholder: why the work tree does not hold the checkpoint (the status command)

    @property
    def blobs_missing(self) -> int:
        return self.blobs - self.blobs_local

    def to_json(self) -> dict:
        d = asdict(self)
        d["blobs_missing"] = self.blobs_missing
        return d


def repo_status(cwd=None) -> list[FileStatus]:
    """The status of every theta-tracked checkpoint in this worktree's index, in path order."""
    top = gitutil.toplevel(cwd)
    entries = inventory.index_entries(top)
    by_path: dict[str, dict[int, str]] = {}
    for path, sha, stage in entries:
        by_path.setdefault(path, {})[stage] = sha
    attrs = gitutil.check_attr("filter", list(by_path), top)
    store = LfsStore.for_repo(top)
    out = []
    with gitutil.CatFile(top) as cat:
        for path in sorted(by_path):
            stages = by_path[path]
            if 0 not in stages:
                if attrs.get(path) == "theta":
                    out.append(FileStatus(path, CONFLICT))
                continue
            info, data = cat.read(stages[0])
            if info is None or not is_metadata(data):
                continue  # not stored by theta (not tracked, or committed before it was tracked)
            out.append(_file_status(top, path, data, cat, store))
    return out


def _file_status(top, path: str, data: bytes, cat: gitutil.CatFile, store: LfsStore) -> FileStatus:
    st = FileStatus(path, _worktree_state(top / path))
    try:
        st.worktree_bytes = os.path.getsize(top / path)
    except OSError:
        pass
    try:
        meta = loads(data)
    except MetadataError as e:
        st.error = str(e)
        return st
    st.format = meta.format
    st.groups = len(meta.groups)
    st.size = sum(g.numel * dtypes.get(g.dtype).itemsize for g in meta.groups.values())
    refs = meta.blob_refs()
    st.blobs = len(refs)
    st.stored = sum(r.size for r in refs)
    st.blobs_local = sum(1 for r in refs if store.has(r))
    st.staged = _staged(meta, cat, path)
    return st


def _worktree_state(p) -> str:
    try:
        with open(p, "rb") as f:
            head = f.read(len(MAGIC) + 1)
    except FileNotFoundError:
        return ABSENT
    except IsADirectoryError:
        return ABSENT
    return PLACEHOLDER if is_metadata(head) else MATERIALIZED


def _staged(meta: CheckpointMeta, cat: gitutil.CatFile, path: str) -> Staged:
    info, data = cat.read(f"HEAD:{path}")
    if info is None or not is_metadata(data):
        return Staged(new_file=True)
    try:
        head = loads(data)
    except MetadataError:
        return Staged(new_file=True)
    staged = Staged()
    for name, g in meta.groups.items():
        old = head.groups.get(name)
        if old is None:
            staged.added += 1
        elif (old.hash, old.dtype, tuple(old.shape)) != (g.hash, g.dtype, tuple(g.shape)):
            staged.modified += 1
    staged.removed = sum(1 for name in head.groups if name not in meta.groups)
    return staged
