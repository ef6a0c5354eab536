"""Which LFS objects a repository's local state needs: the rule `git theta prune` keeps and `fsck` checks.

A blob is **needed** when theta metadata in one of these places names it:

- every commit no remote-tracking ref reaches: unpushed commits of every branch and tag, commits only a
  reflog still holds (after a reset, an amend, a rebase or a deleted branch, until git expires the entry),
  every stash entry (its work-tree, index and untracked commits), the HEAD of every worktree;
- the index of every worktree, conflict stages included;
- the tip of every ref, remote-tracking refs included (so a checkout of any of them works offline).

Blobs needed only by older, pushed commits are not: the remote has them (theta's pre-push hook uploaded
them with the commits) and a checkout fetches them again. The oids of plain git-lfs pointer files met in the
same places are needed too, so theta never deletes an object a pointer names.

The scan reads every blob of those trees up to :data:`~theta.storage.metadata.MAX_METADATA_BYTES` (larger
blobs cannot be metadata and git leaves them out) and keeps those that are metadata or pointers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from theta.base.errors import MetadataError
from theta.git import inventory
from theta.git import repo as gitutil
from theta.storage.metadata import MAGIC, MAX_METADATA_BYTES, CheckpointMeta, is_metadata, loads
from theta.storage.store import BlobRef

LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/v1\n"
METADATA_PREFIX = (MAGIC + " ").encode()
LFS_POINTER_MAX = 1024  # git-lfs's own limit: a larger blob is never a pointer

# where a metadata text was found, in the order reports name them
LOCAL = "local-only history"  # unpushed or reflog-only commits, stash entries, other worktrees' indexes
TIP = "ref tip"
REV = "revision"


@dataclass(frozen=True)
class MetadataText:
    """One theta metadata text as git stores it: its blob id, a path it is at, where it was found."""

    sha: str
    path: str
    where: str


@dataclass
class Scan:
    """The metadata texts and LFS pointers found in a set of git objects."""

    metadata: dict[str, MetadataText] = field(default_factory=dict)   # blob sha -> first place found
    pointers: dict[str, BlobRef] = field(default_factory=dict)        # oid -> pointer's object

    def add(self, listed: Iterable[inventory.ListedObject], where: str, cwd) -> None:
        """Classify the listed objects git has not classified for this scan yet (one cat-file run)."""
        todo = {}
        for o in listed:
            if o.sha not in self.metadata and o.sha not in todo:
                todo[o.sha] = o.path
        if not todo:
            return
        infos = gitutil.batch_check(list(todo), cwd)
        blobs = [(i.sha, todo[i.sha]) for i in infos if i is not None and i.type == "blob"
                 and i.size <= MAX_METADATA_BYTES]
        with gitutil.CatFile(cwd) as cat:
            for sha, path in blobs:
                if sha in self.metadata:
                    continue
                data = cat.read_if(sha, (METADATA_PREFIX, LFS_POINTER_PREFIX))
                if data is None:
                    continue
                if is_metadata(data):
                    self.metadata[sha] = MetadataText(sha, path, where)
                elif len(data) < LFS_POINTER_MAX and data.startswith(LFS_POINTER_PREFIX):
                    ref = parse_pointer(data)
                    if ref is not None:
                        self.pointers[ref.oid] = ref


def parse_pointer(data: bytes) -> BlobRef | None:
    """The object a git-lfs pointer file names, or None when ``data`` is not a well-formed pointer."""
    oid = size = None
    for line in data.decode("utf-8", "replace").splitlines()[1:]:
        key, _, value = line.partition(" ")
        if key == "oid" and value.startswith("sha256:"):
            oid = value[len("sha256:"):]
        elif key == "size" and value.isdigit():
            size = int(value)
    if oid is None or size is None or len(oid) != 64 or any(c not in "0123456789abcdef" for c in oid):
        return None
    return BlobRef(oid, size)


def scan_needed(cwd=None) -> Scan:
    """Metadata and pointers of everything the module docstring calls needed."""
    scan = Scan()
    scan.add(inventory.local_only_objects(cwd, MAX_METADATA_BYTES), LOCAL, cwd)
    scan.add(inventory.tip_objects(cwd, include_remotes=True, max_blob_size=MAX_METADATA_BYTES), TIP, cwd)
    return scan


def scan_local(cwd=None) -> Scan:
    """What `git theta fsck` checks by default: everything local — local-only history, stash, indexes,
    worktree HEADs, and the tips of local refs (not remote-tracking ones: a remote has those)."""
    scan = Scan()
    scan.add(inventory.local_only_objects(cwd, MAX_METADATA_BYTES), LOCAL, cwd)
    scan.add(inventory.tip_objects(cwd, include_remotes=False, max_blob_size=MAX_METADATA_BYTES), TIP, cwd)
    return scan


def scan_revs(revs: list[str], cwd=None) -> Scan:
    scan = Scan()
    scan.add(inventory.rev_objects(revs, cwd, MAX_METADATA_BYTES), REV, cwd)
    return scan


def read_metadata(scan: Scan, cwd=None) -> Iterator[tuple[MetadataText, "CheckpointMeta | MetadataError"]]:
    """Each metadata text of ``scan`` parsed, one at a time (a MetadataError in place of one that is not
    valid), in path order."""
    with gitutil.CatFile(cwd) as cat:
        for text in sorted(scan.metadata.values(), key=lambda t: (t.path, t.where, t.sha)):
            _, data = cat.read(text.sha)
            try:
                yield text, loads(data)
            except MetadataError as e:
                yield text, e


def needed_refs(scan: Scan, cwd=None) -> dict[str, BlobRef]:
    """oid -> BlobRef of every blob ``scan``'s theta metadata names (not its pointers: those are git-lfs's
    objects). Raises MetadataError naming the file when a metadata text cannot be read: what it needs is
    then unknown, so nothing may be pruned."""
    refs: dict[str, BlobRef] = {}
    for text, meta in read_metadata(scan, cwd):
        if isinstance(meta, MetadataError):
            raise MetadataError(f"{text.path} (git blob {text.sha[:12]}, {text.where}): {meta}; cannot tell "
                                "which blobs it needs") from None
        for ref in meta.blob_refs():
            refs[ref.oid] = ref
    return refs


def refs_holding(text: MetadataText, cwd=None) -> list[str]:
    """The refs (short names) and worktree states whose tip has ``text`` at its path: for messages."""
    names = gitutil.run_text(["for-each-ref", "--format=%(refname:short)"], cwd, check=False).splitlines()
    names = ["HEAD"] + [n for n in names if n]
    specs = [f"{n}:{text.path}" for n in names] + [f":{text.path}"]
    infos = gitutil.batch_check(specs, cwd)
    return [n for n, i in zip(names + ["index"], infos) if i is not None and i.sha == text.sha]


def lfs_storage_is_custom(cwd=None) -> bool:
    """True when ``lfs.storage`` moves the LFS store (it may then be shared with other repositories)."""
    return bool(gitutil.config_get("lfs.storage", cwd))
