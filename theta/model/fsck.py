"""`git theta fsck`: is everything the local state needs here, intact, and does every group rebuild?

For each theta metadata text in scope (default: :func:`theta.storage.retention.scan_local` — local-only
history, stash, every index and worktree HEAD, the tips of local refs; or the trees of given revisions):

1. the text parses and is consistent (``--pointers`` stops here, like `git lfs fsck --pointers`);
2. every blob it names is in the local store, with its size and its sha256 (each blob checked once);
3. every group's chain rebuilds: each step's blob decodes, applies, and gives the value hash the metadata
   recorded for that step, and the last one the group's hash (each distinct chain rebuilt once).

Problems are reported per file and group. With ``repair``, corrupt blobs are moved aside
(``<lfs>/theta-quarantine``) and they and the missing ones are fetched from the remote in one git-lfs run,
then checked again; a problem that persists (the remote lacks the blob, or the metadata itself is wrong)
stays reported. Memory: a few frames -- each chain is checked frame by frame
(:func:`theta.updates.chain_check.check_chain`), never rebuilt whole unless it is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from theta.base.errors import ThetaError, TransferError
from theta.storage import retention
from theta.storage.metadata import CheckpointMeta, GroupMeta
from theta.storage.store import BlobRef, LfsStore, sha256_file
from theta.storage.transfer import fetch_missing
from theta.updates.chain_check import check_chain

MISSING, CORRUPT, CHAIN, METADATA = "missing", "corrupt", "chain", "metadata"


@dataclass
class Problem:
    """One thing wrong: ``kind`` is missing / corrupt (a blob), chain (a group does not rebuild to its
    recorded value) or metadata (the text itself)."""

    kind: str
    file: str                 # the checkpoint's path
    where: str                # which state holds that version (e.g. "main, HEAD, index" or "local only")
    detail: str
    group: str | None = None
    oid: str | None = None
    size: int | None = None
    repaired: bool = False
    meta_group: GroupMeta | None = field(default=None, repr=False, compare=False)  # for a repair

    def to_json(self) -> dict:
        return {"kind": self.kind, "file": self.file, "where": self.where, "group": self.group, "oid": self.oid,
                "size": self.size, "detail": self.detail, "repaired": self.repaired}


@dataclass
class FsckReport:
    files: int = 0            # metadata texts checked (one per file version)
    groups: int = 0           # distinct group chains rebuilt
    blobs: int = 0            # distinct blobs checked
    bytes: int = 0            # their total size
    repaired: int = 0         # blobs a repair fetched
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.repaired for p in self.problems)

    def to_json(self) -> dict:
        return {"ok": self.ok, "files": self.files, "groups": self.groups, "blobs": self.blobs,
                "bytes": self.bytes, "repaired": self.repaired, "problems": [p.to_json() for p in self.problems]}


class _Checker:
    def __init__(self, store: LfsStore, on_bytes: Callable[[int], None] | None):
        self.store = store
        self.on_bytes = on_bytes
        self.blobs: dict[str, tuple[str, str] | None] = {}   # oid -> None (good) or (kind, detail)
        self.sizes: dict[str, int] = {}
        self.chains: dict[tuple, str | None] = {}            # chain key -> None (rebuilds) or detail

    def blob(self, ref: BlobRef) -> tuple[str, str] | None:
        if ref.oid not in self.blobs:
            self.blobs[ref.oid] = self._check_blob(ref)
            self.sizes[ref.oid] = ref.size
        return self.blobs[ref.oid]

    def _check_blob(self, ref: BlobRef) -> tuple[str, str] | None:
        if not self.store.has(ref):
            p = self.store.path(ref)
            if p.exists():
                return CORRUPT, f"has {p.stat().st_size} bytes, expected {ref.size}"
            return MISSING, "not in the local LFS store"
        try:
            got = sha256_file(self.store.path(ref))
        except OSError as e:
            return CORRUPT, f"cannot be read: {e}"
        finally:
            if self.on_bytes is not None:
                self.on_bytes(ref.size)
        if got != ref.oid:
            return CORRUPT, f"its bytes hash to {got[:12]}… (a flipped or overwritten byte)"
        return None

    def chain(self, group: GroupMeta, file: str) -> str | None:
        key = (group.dtype, tuple(group.shape), group.hash,
               tuple((s.type, s.blob.oid, s.blob.size, s.hash, repr(sorted(s.params.items()))) for s in group.steps))
        if key not in self.chains:
            self.chains[key] = self._rebuild(group, file)
        return self.chains[key]

    def _rebuild(self, group: GroupMeta, file: str) -> str | None:
        try:
            check_chain(group, self.store, file)
        except (ThetaError, ValueError) as e:  # decode, apply or hash failure: the chain is broken
            return str(e)
        return None


def fsck(cwd=None, revs: list[str] | None = None, pointers_only: bool = False, repair: bool = False,
         remote: str | None = None, store: LfsStore | None = None,
         on_bytes: Callable[[int], None] | None = None) -> FsckReport:
    """Check the metadata of ``revs`` (default: the local state) and what it needs; see the module doc."""
    store = store or LfsStore.for_repo(cwd or ".")
    scan = retention.scan_revs(revs, cwd) if revs else retention.scan_local(cwd)
    report = FsckReport()
    checker = _Checker(store, on_bytes)
    for text, meta in retention.read_metadata(scan, cwd):
        report.files += 1
        if isinstance(meta, Exception):
            report.problems.append(Problem(METADATA, text.path, _where(text, cwd), str(meta)))
        elif not pointers_only:
            _check_file(text, meta, checker, report, cwd)
    report.blobs = len(checker.blobs)
    report.bytes = sum(checker.sizes.values())
    if repair and any(p.kind in (MISSING, CORRUPT) for p in report.problems):
        _repair(cwd, store, checker, report, remote)
    return report


def _check_file(text, meta: CheckpointMeta, checker: _Checker, report: FsckReport, cwd) -> None:
    where = None
    for name in sorted(meta.groups):
        group = meta.groups[name]
        bad = False
        for step in group.steps:
            problem = checker.blob(step.blob)
            if problem is not None:
                where = where or _where(text, cwd)
                report.problems.append(Problem(problem[0], text.path, where, problem[1], group=name,
                                               oid=step.blob.oid, size=step.blob.size, meta_group=group))
                bad = True
        if bad:
            continue  # the blob problem says why it cannot rebuild
        before = len(checker.chains)
        detail = checker.chain(group, text.path)
        report.groups += len(checker.chains) - before
        if detail is not None:
            where = where or _where(text, cwd)
            report.problems.append(Problem(CHAIN, text.path, where, detail, group=name))


def _repair(cwd, store: LfsStore, checker: _Checker, report: FsckReport, remote: str | None) -> None:
    """Move corrupt blobs aside, fetch them and the missing ones in one git-lfs run, check again."""
    bad = {p.oid: BlobRef(p.oid, p.size) for p in report.problems if p.kind in (MISSING, CORRUPT)}
    for ref in bad.values():
        if (checker.blobs.get(ref.oid) or (None,))[0] == CORRUPT:
            store.quarantine(ref)
    failure = None
    try:
        fetch_missing(cwd or ".", list(bad.values()), remote=remote, store=store)
    except TransferError as e:
        failure = str(e)
    for oid, ref in bad.items():
        checker.blobs.pop(oid, None)
        if checker.blob(ref) is None:
            report.repaired += 1
    for p in report.problems:
        if p.kind not in (MISSING, CORRUPT):
            continue
        if checker.blobs.get(p.oid) is not None:
            p.detail += f"; not repaired: {failure or 'the fetched copy is still wrong'}"
            continue
        group = p.meta_group
        if all(checker.blob(s.blob) is None for s in group.steps):
            detail = checker.chain(group, p.file)
            p.repaired = detail is None
            if detail is not None:
                p.detail += f"; refetched, but the group does not rebuild: {detail}"
        else:
            p.repaired = True  # this blob is good now; the group's other bad blobs have their own lines


def _where(text: retention.MetadataText, cwd) -> str:
    if text.where == retention.REV:
        return "given revision"
    holders = retention.refs_holding(text, cwd)
    return ", ".join(holders) if holders else text.where
