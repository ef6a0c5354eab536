"""`git theta ls-files`: the theta-tracked checkpoints of a revision with their group count and sizes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from theta.git import repo as gitutil


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
    from theta.storage.metadata import is_metadata

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
    from zipslice import dtypes

    from theta.storage.metadata import loads
    from theta.storage.store import LfsStore

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
