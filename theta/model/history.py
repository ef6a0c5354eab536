"""A checkpoint's history, parameter group by group and commit by commit: what `git theta log --html` draws.

:func:`file_history` reads the metadata text of a tracked checkpoint at each commit that changed it (one
`git cat-file --batch`), and compares each version with its parent's, group by group, from the metadata:

- **status**: unchanged, modified, added, removed, reshaped or retyped (as `git theta diff` says);
- **how the commit stored it**: the update types of the steps the commit added (``dense``, ``delta``,
  ``sparse``, ``low-rank``, ``ia3``, ``rows``, ...), ``unchanged``, or ``reused`` (a value stored before), and
  the bytes of those blobs;
- **how much it changed**: ``‖new − old‖₂ / ‖old‖₂``. Clean records both norms where it had the previous value
  at hand (:class:`theta.storage.metadata.Norms`): then no tensor is read (``how = "recorded"``). Otherwise
  (history committed before theta recorded norms, a group stored densely without looking at its previous
  value) the norms are estimated from the groups' LSH signatures (``"estimated"``: roughly ±25 % for one
  group, :mod:`theta.base.lsh`), or, with ``exact``, computed by reading both values block by block
  (``"computed"``: the statistics of `git theta diff`, bit for bit; blobs fetched when missing).

Per commit, totals: groups that differ, bytes of blobs the commit added, and bytes of all blobs its version
references (what a fresh clone checking it out fetches for this file). Rows are the groups in model order,
folded by layer (:func:`layer_of`: ``model.layers.7.*``, ``encoder.layer.7.*``, ``h.7.*``, ...).
Memory: a few metadata texts at a time; with ``exact``, a block of each of two values.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from theta.base import lsh
from theta.base.errors import ThetaError
from theta.git import repo as gitutil
from theta.model.diff import CHUNK, ChangeSums
from theta.storage.metadata import CheckpointMeta, GroupMeta, is_metadata, loads
from theta.storage.store import BlobRef, LfsStore
from theta.storage.transfer import fetch_missing
from theta.updates import stream
from theta.updates.rebuild import reconstruct
from zipslice.clistyle import natural_key

STRUCTURAL = ("added", "removed", "reshaped", "retyped")


@dataclass
class Cell:
    """One group at one commit, against the commit's parent."""

    status: str                  # unchanged, modified, added, removed, reshaped, retyped, absent
    stored: str = ""             # update types of the steps this commit added ("+"-joined), unchanged, reused
    stored_bytes: int = 0        # bytes of those steps' blobs
    change: float | None = None  # ‖new − old‖₂ (0 when unchanged)
    base: float | None = None    # ‖old‖₂
    changed: int | None = None   # elements whose bits differ, where known
    numel: int = 0               # elements of the new value (of the old one when removed)
    how: str | None = None       # recorded, estimated, computed (where change and base come from)

    @property
    def relative(self) -> float | None:
        """‖new − old‖ / ‖old‖ (inf when old is all zeros and something changed; None when unknown)."""
        if self.change is None or self.base is None:
            return None
        if self.base == 0:
            return 0.0 if self.change == 0 else math.inf
        return self.change / self.base


@dataclass
class Commit:
    id: str
    parents: list[str]
    date: str          # author date, ISO 8601
    author: str
    subject: str

    @property
    def short(self) -> str:
        return self.id[:10]


@dataclass
class Totals:
    changed: int = 0   # groups that differ from the parent's version
    stored: int = 0    # bytes of blobs this version references and its parent's does not
    fetch: int = 0     # bytes of every blob this version references (a fresh clone of it fetches them)


@dataclass
class Row:
    """A row of the picture: one group, or a layer folding several (``members``: indices into ``groups``)."""

    name: str
    members: list[int]
    layer: bool


@dataclass
class History:
    path: str
    commits: list[Commit]
    groups: list[str]                  # model order
    cells: list[list[Cell]]            # [commit][group]
    totals: list[Totals]
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[Row]:
        """The groups folded by layer: a layer's row stands where its first group is."""
        out: list[Row] = []
        at: dict[str, Row] = {}
        for i, name in enumerate(self.groups):
            key = layer_of(name)
            if key is None:
                out.append(Row(name, [i], False))
            elif key in at:
                at[key].members.append(i)
            else:
                at[key] = Row(key, [i], True)
                out.append(at[key])
        return out

    def folded(self, row: Row, commit: int) -> "FoldedCell":
        return fold([self.cells[commit][i] for i in row.members])


@dataclass
class FoldedCell:
    """A layer at one commit: its groups' cells summed up."""

    statuses: dict[str, int]      # status -> number of groups
    stored: dict[str, int]        # how stored -> number of groups (changed ones)
    stored_bytes: int
    change: float | None          # sqrt(Σ change²) over the groups whose change and base are known
    base: float | None            # sqrt(Σ base²) over the same groups
    how: set[str]

    @property
    def relative(self) -> float | None:
        return Cell("modified", change=self.change, base=self.base).relative

    @property
    def changed_groups(self) -> int:
        return sum(n for s, n in self.statuses.items() if s not in ("unchanged", "absent"))


def fold(cells: list[Cell]) -> FoldedCell:
    """The cells of a layer's groups as one: the layer's relative change is ``sqrt(Σ‖Δ‖²) / sqrt(Σ‖old‖²)`` over
    its groups present on both sides with known norms (unchanged ones count with no change)."""
    statuses: dict[str, int] = {}
    stored: dict[str, int] = {}
    sq, bsq, known, how = 0.0, 0.0, False, set()
    total = 0
    for c in cells:
        statuses[c.status] = statuses.get(c.status, 0) + 1
        if c.status not in ("unchanged", "absent"):
            stored[c.stored] = stored.get(c.stored, 0) + 1
        total += c.stored_bytes
        if c.change is not None and c.base is not None and c.status in ("unchanged", "modified"):
            sq += c.change ** 2
            bsq += c.base ** 2
            known = True
            if c.how:
                how.add(c.how)
    return FoldedCell(statuses, stored, total, math.sqrt(sq) if known else None,
                      math.sqrt(bsq) if known else None, how)


_LAYER = re.compile(r"^(.*?[./](?:\d+))(?=[./])")


def layer_of(name: str) -> str | None:
    """The layer a group belongs to: its name up to its first numbered part (``model.layers.7`` of
    ``model.layers.7.mlp.up_proj.weight``, ``encoder.layer.3``, ``transformer.h.11``, ``h.0``), or None."""
    m = _LAYER.match(name)
    return m.group(1) if m else None


# -------------------------------------------------------------------------------------------- reading git

_FIELD, _RECORD = "\x1f", "\x1e"


def commits_of(path: str, revs: list[str], repo: Path, max_count: int | None = None) -> list[Commit]:
    """The commits of ``revs`` (default HEAD) that changed ``path``, oldest first; parents as git rewrites them
    for the path (the previous commit that changed it)."""
    args = ["log", "--topo-order", "--parents", f"--format={_RECORD}%H %P{_FIELD}%aI{_FIELD}%an{_FIELD}%s"]
    if max_count is not None:
        args.append(f"--max-count={max_count}")
    out = gitutil.run([*args, *(revs or ["HEAD"]), "--", path], cwd=repo).decode("utf-8", "replace")
    commits = []
    for rec in out.split(_RECORD)[1:]:
        ids, date, author, subject = (rec.rstrip("\n").split(_FIELD) + ["", "", ""])[:4]
        parts = ids.split()
        commits.append(Commit(parts[0], parts[1:], date, author, subject))
    commits.reverse()
    return commits


def tracked_paths(revs: list[str], paths: list[str], repo: Path) -> list[str]:
    """The theta-tracked paths (``filter=theta``) that commits of ``revs`` changed, under ``paths``."""
    out = gitutil.run(["log", "--format=", "--name-only", "-z", *(revs or ["HEAD"]), "--", *paths], cwd=repo)
    seen = list(dict.fromkeys(p for p in out.decode("utf-8", "replace").replace("\n", "\0").split("\0") if p))
    attrs = gitutil.check_attr("filter", seen, repo)
    return [p for p in seen if attrs.get(p) == "theta"]


class _Texts:
    """Metadata of ``path`` at commits, parsed once per blob."""

    def __init__(self, repo: Path, path: str, notes: list[str]):
        self.cat = gitutil.CatFile(repo)
        self.path, self.notes = path, notes
        self._by_blob: dict[str, CheckpointMeta | None] = {}

    def at(self, commit: str) -> CheckpointMeta | None:
        info, data = self.cat.read(f"{commit}:{self.path}")
        if info is None:
            return None
        if info.sha not in self._by_blob:
            meta = None
            if not is_metadata(data[:64]):
                self.notes.append(f"{commit[:10]}: {self.path} is not theta metadata there (committed without "
                                  f"theta, or by Git-Theta): drawn as absent")
            else:
                meta = loads(data, file=f"{commit[:10]}:{self.path}")
                if meta.is_opaque:
                    meta = None
            self._by_blob[info.sha] = meta
        return self._by_blob[info.sha]

    def close(self) -> None:
        self.cat.close()


# ------------------------------------------------------------------------------------------ comparing

def estimated_norm(sig: list[int] | None) -> float | None:
    """‖value‖₂ estimated from its LSH signature (each projection is ~ N(0, ‖value‖²): :mod:`theta.base.lsh`)."""
    return None if sig is None else lsh.estimated_distance(sig, [0] * len(sig))


def compare(old: GroupMeta | None, new: GroupMeta | None, old_blobs: set[str]) -> Cell:
    """A group's cell from metadata alone (``old_blobs``: the oids the parent's version references)."""
    if old is None and new is None:
        return Cell("absent")
    if new is None:
        return Cell("removed", numel=old.numel)
    fresh = [s for s in new.steps if s.blob.oid not in old_blobs]
    stored_bytes = sum(s.blob.size for s in {s.blob.oid: s for s in fresh}.values())
    stored = "+".join(dict.fromkeys(s.type for s in fresh)) or "reused"
    if old is None:
        return Cell("added", stored, stored_bytes, numel=new.numel)
    if tuple(old.shape) != tuple(new.shape):
        return Cell("reshaped", stored, stored_bytes, numel=new.numel)
    if old.dtype != new.dtype:
        return Cell("retyped", stored, stored_bytes, numel=new.numel)
    base, base_how = _norm_of(old)
    if old.hash == new.hash:
        return Cell("unchanged", "unchanged", 0, 0.0, base, 0, new.numel, base_how)
    n = new.norms
    if n is not None and n.source == old.hash and n.change is not None:
        how = "recorded" if base_how == "recorded" else "estimated"  # (the base estimated: older metadata)
        return Cell("modified", stored, stored_bytes, n.change, base, n.changed, new.numel, how)
    change = None
    if old.lsh is not None and new.lsh is not None and len(old.lsh) == len(new.lsh):
        change = lsh.estimated_distance(old.lsh, new.lsh)
    return Cell("modified", stored, stored_bytes, change, base, None, new.numel,
                "estimated" if change is not None else None)


def _norm_of(g: GroupMeta) -> tuple[float | None, str | None]:
    if g.norms is not None:
        return g.norms.value, "recorded"
    est = estimated_norm(g.lsh)
    return est, ("estimated" if est is not None else None)


def value_blocks(g: GroupMeta, store: LfsStore, file: str):
    """The value of ``g`` block by block (a frame of each blob in memory), or whole when its chain does not
    stream (:func:`theta.updates.stream.source`)."""
    return stream.source(g, store, file) or reconstruct(g, store, file=file)


def computed(old: GroupMeta, new: GroupMeta, store: LfsStore, file: str, cell: Cell) -> Cell:
    """``cell`` (a modified group) with the statistics of `git theta diff` (theta.model.diff.ChangeSums: the same
    chunks, the same bits), read block by block from the store."""
    sums = ChangeSums()
    for _, a, b in stream.side_by_side((value_blocks(old, store, file), value_blocks(new, store, file)), CHUNK):
        sums.add(a, b)
    st = sums.stats()
    if st.changed == 0:  # one value named in two forms (sha256, BLAKE3): the same bits
        return Cell("unchanged", "unchanged", 0, 0.0, st.old_l2, 0, cell.numel, "computed")
    return Cell("modified", cell.stored, cell.stored_bytes, st.l2, st.old_l2, st.changed, cell.numel, "computed")


def _refs(meta: CheckpointMeta | None) -> dict[str, int]:
    return {} if meta is None else {r.oid: r.size for r in meta.blob_refs()}


def _model_order(metas: Iterable[CheckpointMeta | None]) -> list[str]:
    """Every group name of the versions, newest first: the newest version's order, each older version's names
    that are gone inserted after the name they followed there. A file whose order says nothing of the model's
    (safetensors sorts by dtype, then name; any file whose names are sorted as strings) is taken in natural
    order of names (``layers.2`` before ``layers.10``)."""
    base: list[str] | None = None
    after: dict[str | None, list[str]] = {}  # names placed right after a name (None: before all)
    seen: set[str] = set()
    for meta in metas:
        if meta is None:
            continue
        names = [n for n in meta.order if n in meta.groups]
        if meta.format == "safetensors" or names == sorted(names):
            names.sort(key=natural_key)
        if base is None:
            base = names
            seen.update(names)
            continue
        anchor = None
        for name in names:
            if name not in seen:
                after.setdefault(anchor, []).append(name)
                seen.add(name)
            anchor = name
    order: list[str] = []
    todo = list(reversed([*after.get(None, []), *(base or [])]))
    while todo:
        name = todo.pop()
        order.append(name)
        todo.extend(reversed(after.get(name, [])))
    return order


def file_history(path: str, revs: list[str], repo: str | os.PathLike, *, exact: bool = False,
                 max_count: int | None = None, fetch: Callable[[list[BlobRef]], None] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> History:
    """The history of checkpoint ``path`` (relative to the top of ``repo``) over ``revs`` (see module doc).

    ``exact``: groups without recorded norms are read and compared (``fetch`` gets the blobs a pair needs that
    the local store lacks, before it is read; default: git-lfs from the default remote). ``progress(i, n)``
    after each commit."""
    repo = Path(repo)
    notes: list[str] = []
    commits = commits_of(path, revs, repo, max_count)
    texts = _Texts(repo, path, notes)
    store = LfsStore.for_repo(repo) if exact else None
    if exact and fetch is None:
        def fetch(refs: list[BlobRef]) -> None:
            fetch_missing(repo, refs, store=store, progress=path)
    try:
        metas = [texts.at(c.id) for c in commits]
        parents = [texts.at(c.parents[0]) if c.parents else None for c in commits]
        groups = _model_order(reversed(metas))
        index = {n: i for i, n in enumerate(groups)}
        cells: list[list[Cell]] = []
        totals: list[Totals] = []
        for k, (commit, old, new) in enumerate(zip(commits, parents, metas)):
            old_refs, new_refs = _refs(old), _refs(new)
            row = [Cell("absent")] * len(groups)
            og, ng = (old.groups if old else {}), (new.groups if new else {})
            todo = []
            for name in set(og) | set(ng):
                if name not in index:
                    continue  # only in a parent outside the range
                cell = compare(og.get(name), ng.get(name), set(old_refs))
                row[index[name]] = cell
                if exact and cell.status == "modified" and cell.how != "recorded":
                    todo.append(name)
            if todo:
                fetch([s.blob for n in todo for g in (og[n], ng[n]) for s in g.steps])
                for name in todo:
                    row[index[name]] = computed(og[name], ng[name], store, path, row[index[name]])
            cells.append(row)
            totals.append(Totals(changed=sum(1 for c in row if c.status not in ("unchanged", "absent")),
                                 stored=sum(size for oid, size in new_refs.items() if oid not in old_refs),
                                 fetch=sum(new_refs.values())))
            if progress is not None:
                progress(k + 1, len(commits))
    finally:
        texts.close()
    return History(path, commits, groups, cells, totals, notes)


def histories(revs: list[str], paths: list[str], cwd: str | os.PathLike = ".", **kw) -> list[History]:
    """:func:`file_history` of every theta-tracked checkpoint that commits of ``revs`` changed (under ``paths``,
    relative to ``cwd``)."""
    repo = gitutil.toplevel(cwd)
    prefix = os.path.relpath(Path(cwd).resolve(), repo)
    rel = [os.path.normpath(os.path.join(prefix, p)) if prefix != "." else p for p in paths]
    found = tracked_paths(revs, rel, repo)
    if not found:
        raise ThetaError("no theta-tracked checkpoint changed in " + (" ".join(revs) or "HEAD")
                         + (f" under {' '.join(paths)}" if paths else ""))
    return [h for h in (file_history(p, revs, repo, **kw) for p in found) if h.commits and h.groups]


def commit_info(rev: str, repo: Path) -> Commit:
    """The commit ``rev`` names (id, parents, author date, author, subject)."""
    out = gitutil.run(["log", "-1", "--no-walk", f"--format=%H %P{_FIELD}%aI{_FIELD}%an{_FIELD}%s", rev, "--"],
                      cwd=repo).decode("utf-8", "replace")
    ids, date, author, subject = (out.rstrip("\n").split(_FIELD) + ["", "", ""])[:4]
    parts = ids.split()
    return Commit(parts[0], parts[1:], date, author, subject)


def pair_history(old_rev: str, new_rev: str, path: str, repo: str | os.PathLike, *, exact: bool = False,
                 fetch: Callable[[list[BlobRef]], None] | None = None) -> History:
    """A :class:`History` of one column: ``path`` at ``new_rev`` against ``path`` at ``old_rev``."""
    repo = Path(repo)
    notes: list[str] = []
    texts = _Texts(repo, path, notes)
    try:
        new_commit = commit_info(new_rev, repo)
        old, new = texts.at(commit_info(old_rev, repo).id), texts.at(new_commit.id)
    finally:
        texts.close()
    if old is None and new is None:
        raise ThetaError(f"{path} is a theta checkpoint at neither {old_rev} nor {new_rev}")
    groups = _model_order([new, old])
    old_refs, new_refs = _refs(old), _refs(new)
    og, ng = (old.groups if old else {}), (new.groups if new else {})
    row = [compare(og.get(n), ng.get(n), set(old_refs)) for n in groups]
    if exact:
        store = LfsStore.for_repo(repo)
        todo = [i for i, c in enumerate(row) if c.status == "modified" and c.how != "recorded"]
        if todo:
            if fetch is None:
                fetch_missing(repo, [s.blob for i in todo for g in (og[groups[i]], ng[groups[i]]) for s in g.steps],
                              store=store, progress=path)
            else:
                fetch([s.blob for i in todo for g in (og[groups[i]], ng[groups[i]]) for s in g.steps])
        for i in todo:
            row[i] = computed(og[groups[i]], ng[groups[i]], store, path, row[i])
    totals = Totals(changed=sum(1 for c in row if c.status not in ("unchanged", "absent")),
                    stored=sum(size for oid, size in new_refs.items() if oid not in old_refs),
                    fetch=sum(new_refs.values()))
    return History(path, [new_commit], groups, [row], [totals], notes)


@dataclass
class MergeDecision:
    """What a merge commit's version of a group is, against its two parents (from metadata)."""

    decision: str       # in words, e.g. "from parent 2 (only it changed the group)"
    both: bool = False  # changed on both parents and the result equals neither: a strategy merged it


def merge_decisions(commit: Commit, path: str, repo: str | os.PathLike) -> dict[str, MergeDecision] | None:
    """Per group of a merge commit's ``path``: which parent its value comes from, as the three-way merge of
    the parents against their merge base decides it, and whether the result matches that. None when
    ``commit`` is not a merge of two parents."""
    if len(commit.parents) != 2:
        return None
    repo = Path(repo)
    p1, p2 = commit.parents
    base_rev = gitutil.run_text(["merge-base", p1, p2], cwd=repo, check=False).strip()
    texts = _Texts(repo, path, [])
    try:
        base = texts.at(base_rev) if base_rev else None
        a, b, r = texts.at(p1), texts.at(p2), texts.at(commit.id)
    finally:
        texts.close()
    groups = lambda m: m.groups if m is not None else {}  # noqa: E731
    out: dict[str, MergeDecision] = {}
    for name in _model_order([r, a, b, base]):
        o, x, y, res = groups(base).get(name), groups(a).get(name), groups(b).get(name), groups(r).get(name)
        h = lambda g: None if g is None else (g.dtype, tuple(g.shape), g.hash)  # noqa: E731
        if h(x) == h(y):
            expect, why = x, "the same on both parents"
        elif h(x) == h(o):
            expect, why = y, "from parent 2 (only it changed the group)"
        elif h(y) == h(o):
            expect, why = x, "from parent 1 (only it changed the group)"
        else:
            if h(res) == h(x):
                out[name] = MergeDecision("changed on both parents: parent 1's value kept")
            elif h(res) == h(y):
                out[name] = MergeDecision("changed on both parents: parent 2's value kept")
            elif res is None:
                out[name] = MergeDecision("changed on both parents: removed by the merge")
            else:
                out[name] = MergeDecision("changed on both parents: merged into a new value", both=True)
            continue
        if h(res) == h(expect):
            out[name] = MergeDecision(why if res is not None else f"removed: {why}")
        else:
            out[name] = MergeDecision(f"{why}, then edited in the merge commit")
    return out
