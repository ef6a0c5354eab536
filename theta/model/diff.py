"""What changed between two versions of a checkpoint, group by group, reading only the groups that differ.

A version ("side") is either theta metadata (values rebuilt from the LFS store on demand) or a checkpoint
file in the working tree (read lazily with zipslice). Groups whose content hashes are equal are skipped
without reading data when both sides are metadata; a working-tree checkpoint must be read once to hash it.
Values are read block by block on both sides (a side's ``value``: a chain streamed from its blobs,
:mod:`theta.updates.stream`, or a file's tensor frame by frame, :mod:`zipslice.frames`), so hashing, signing and
comparing a group costs a few frames, not the group twice.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import numpy as np

import zipslice
from zipslice import dtypes, frames
from zipslice.clistyle import natural_key
from zipslice.errors import NotACheckpointError, ZipsliceError
from zipslice.structure import walk_leaves

from theta.base import lsh, valuehash
from theta.base.errors import CheckpointError
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import BlobRef, LfsStore
from theta.storage.transfer import fetch_missing
from theta.updates import stream
from theta.updates.rebuild import reconstruct

CHUNK = 1 << 20  # elements per chunk of the statistics pass


@dataclass(frozen=True)
class ChangeStats:
    """How a group's values changed (computed in float64)."""

    numel: int
    changed: int        # elements whose bits differ
    l2: float           # ‖new − old‖₂
    old_l2: float       # ‖old‖₂
    max_abs: float      # max |new − old|

    @property
    def relative(self) -> float:
        """‖new − old‖ / ‖old‖ (inf when old is all zeros and something changed)."""
        if self.old_l2 == 0:
            return 0.0 if self.l2 == 0 else math.inf
        return self.l2 / self.old_l2

    @property
    def fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


class ChangeSums:
    """:func:`change_stats` added up chunk by chunk: give it the chunks of both values side by side, in order,
    CHUNK elements each but the last (as :func:`theta.updates.stream.side_by_side` yields them), and it ends
    with the bits of the statistics of the values read whole."""

    def __init__(self) -> None:
        self.numel, self.changed, self.sq, self.osq, self.mx = 0, 0, 0.0, 0.0, 0.0

    def add(self, fo: np.ndarray, fn: np.ndarray) -> None:
        """The next chunk of the old and the new value (flat, one dtype each)."""
        bits_o = fo.view(f"u{fo.dtype.itemsize}") if fo.dtype.itemsize in (1, 2, 4, 8) else None
        bits_n = fn.view(f"u{fn.dtype.itemsize}") if bits_o is not None and fn.dtype == fo.dtype else None
        wd = np.complex128 if fo.dtype.kind == "c" else np.float64
        a, b = fo.astype(wd), fn.astype(wd)
        d = np.abs(b - a)
        if bits_n is not None:
            self.changed += int(np.count_nonzero(bits_o != bits_n))
        else:
            self.changed += int(np.count_nonzero(a != b))
        self.sq += float(np.dot(d, d))
        oa = np.abs(a)
        self.osq += float(np.dot(oa, oa))
        if d.size:
            self.mx = max(self.mx, float(d.max()))
        self.numel += int(fo.size)

    def stats(self) -> ChangeStats:
        return ChangeStats(numel=self.numel, changed=self.changed, l2=math.sqrt(self.sq), old_l2=math.sqrt(self.osq),
                           max_abs=self.mx)


def change_stats(old, new) -> ChangeStats:
    """Statistics of ``new − old`` for values of one shape -- arrays, or sources of blocks (a side's ``value``) --
    CHUNK elements at a time, side by side (a few MiB of temporaries, never a value whole)."""
    if tuple(old.shape) != tuple(new.shape):
        raise ValueError(f"change_stats needs equal shapes, got {old.shape} and {new.shape}")
    sums = ChangeSums()
    for _, fo, fn in stream.side_by_side((old, new), CHUNK):
        sums.add(fo, fn)
    return sums.stats()


class FileValue:
    """A tensor of a checkpoint file as a source of blocks (``shape``, ``dtype``, ``chunks(n)``: what
    :func:`theta.updates.stream.side_by_side` reads), read frame by frame through zipslice."""

    def __init__(self, ckpt, name: str):
        info = ckpt.info(name)
        self.ckpt, self.name = ckpt, name
        self.shape, self.dtype = tuple(info.shape), dtypes.get(info.dtype).to_numpy()
        self.size = info.numel

    def chunks(self, n: int):
        at = 0
        for raw in frames.iter_frames(self.ckpt, self.name, n):
            block = raw.view(self.dtype)
            yield slice(at, at + block.size), block
            at += block.size


def signature_of(value) -> list[int] | None:
    """The LSH signature of a value (an array or a source of blocks), folded block by block."""
    folder = lsh.PieceFolder()
    size = 0
    for _, block in stream.blocks(value, CHUNK):
        folder.add(block)
        size += block.size * (2 if block.dtype.kind == "c" else 1)
    return lsh.signature_of_fold(folder.result(), size)


@dataclass(frozen=True)
class GroupInfo:
    dtype: str
    shape: tuple[int, ...]
    update: str | None      # the update type of the last step (metadata sides only)
    chain: int = 0          # number of steps


class Side(Protocol):
    label: str
    format: str
    def names(self) -> list[str]: ...
    def aliases(self) -> set[str]: ...
    def info(self, name: str) -> GroupInfo: ...
    def hash(self, name: str, like: str | None = None) -> str: ...  # like: hash in that name's algorithm
    def signature(self, name: str) -> list[int] | None: ...
    def array(self, name: str, cache: dict | None = None) -> np.ndarray: ...
    def prefetch(self, names: Iterable[str]) -> None: ...


class MetaSide:
    """A version given as theta metadata; values come from the LFS store (fetched if missing)."""

    def __init__(self, meta: CheckpointMeta, label: str, repo_dir: str | os.PathLike = ".",
                 store: LfsStore | None = None):
        self.meta, self.label, self.repo_dir = meta, label, repo_dir
        self.format = meta.format
        self._store = store

    @property
    def store(self) -> LfsStore:
        if self._store is None:
            self._store = LfsStore.for_repo(self.repo_dir)
        return self._store

    def names(self) -> list[str]:
        return [n for n in self.meta.order if n in self.meta.groups]

    def aliases(self) -> set[str]:
        return set(self.meta.aliases)

    def info(self, name: str) -> GroupInfo:
        g = self.meta.groups[name]
        return GroupInfo(g.dtype, tuple(g.shape), g.steps[-1].type if g.steps else None, len(g.steps))

    computes_hashes = False  # its names are recorded (in either algorithm, theta.base.valuehash)

    def hash(self, name: str, like: str | None = None) -> str:
        return self.meta.groups[name].hash

    def signature(self, name: str) -> list[int] | None:
        return self.meta.groups[name].lsh

    def refs(self, names: Iterable[str]) -> list[BlobRef]:
        return [s.blob for n in names for s in self.meta.groups[n].steps]

    def prefetch(self, names: Iterable[str]) -> None:
        refs = self.refs(names)
        if refs and self.store.missing(refs):
            fetch_missing(self.repo_dir, refs, store=self.store)

    def array(self, name: str, cache: dict | None = None) -> np.ndarray:
        return reconstruct(self.meta.groups[name], self.store, cache, file=self.label)

    def value(self, name: str):
        """The group's value as a source of blocks (its chain read frame by frame, its name checked at the end of
        the first pass); an empty group or a chain that does not stream, rebuilt whole."""
        g = self.meta.groups[name]
        return stream.source(g, self.store, self.label) or reconstruct(g, self.store, file=self.label)


class OpaqueSide:
    """A file theta stores as one opaque blob (not a checkpoint): compared by its sha256 and size only."""

    format = "opaque"

    def __init__(self, ref: BlobRef, label: str):
        self.ref, self.label = ref, label

    @classmethod
    def of_file(cls, path: str | os.PathLike, label: str) -> "OpaqueSide":
        h, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                size += len(chunk)
        return cls(BlobRef(h.hexdigest(), size), label)

    def names(self) -> list[str]:
        return []

    def aliases(self) -> set[str]:
        return set()


def checkpoint_or_opaque(path: str | os.PathLike, label: str) -> "CheckpointSide | OpaqueSide":
    """A working-tree file as a diff side: a checkpoint, or an opaque file when it is not one at all."""
    try:
        return CheckpointSide(path, label)
    except CheckpointError as e:
        if isinstance(e.__cause__, NotACheckpointError):
            return OpaqueSide.of_file(path, label)
        raise


class CheckpointSide:
    """A checkpoint file (e.g. the working tree's), read lazily one group at a time."""

    def __init__(self, path: str | os.PathLike, label: str):
        self.path, self.label = path, label
        try:
            self.ckpt = zipslice.load(path, isolate=True)  # a working-tree file may come from anywhere
        except ZipsliceError as e:
            raise CheckpointError(f"cannot read {label}: {e}") from e
        self.format = self.ckpt.format
        self._hashes: dict[tuple[str, bool], str] = {}  # (name, in sha256) -> name (hashed_once)

    def names(self) -> list[str]:
        return list(self.ckpt.keys())

    def aliases(self) -> set[str]:
        return set()

    def info(self, name: str) -> GroupInfo:
        i = self.ckpt.info(name)
        return GroupInfo(i.dtype, tuple(i.shape), None)

    computes_hashes = True

    def hash(self, name: str, like: str | None = None) -> str:
        return hashed_once(self._hashes, name, like, self.value)

    def signature(self, name: str) -> list[int] | None:
        i = self.ckpt.info(name)
        return signature_of(self.value(name)) if lsh.hashable(i.dtype) else None

    def prefetch(self, names: Iterable[str]) -> None:
        pass

    def array(self, name: str, cache: dict | None = None) -> np.ndarray:
        return self.ckpt.numpy(name)

    def value(self, name: str) -> FileValue:
        return FileValue(self.ckpt, name)

    def close(self) -> None:
        close = getattr(self.ckpt, "close", None)
        if close is not None:
            close()


@dataclass
class GroupDiff:
    """One group that differs between the two versions."""

    name: str
    status: str                      # added, removed, modified, reshaped, retyped
    old: GroupInfo | None = None
    new: GroupInfo | None = None
    stats: ChangeStats | None = None
    estimate: float | None = None    # LSH estimate of ‖Δ‖ (estimate mode)


@dataclass
class FileDiff:
    """What :func:`diff_sides` found for one checkpoint: the groups that differ (``groups``), how many are
    unchanged, and file-level changes (``notes``: nesting, non-tensor values, file metadata)."""

    path: str
    old_format: str | None
    new_format: str | None
    groups: list[GroupDiff] = field(default_factory=list)
    unchanged: int = 0
    estimated: bool = False
    notes: list[str] = field(default_factory=list)   # file-level changes (structure, non-tensor values)

    def count(self, status: str) -> int:
        return sum(1 for g in self.groups if g.status == status)

    @property
    def changed_elements(self) -> tuple[int, int]:
        """(changed, total) over the groups with statistics."""
        st = [g.stats for g in self.groups if g.stats is not None]
        return sum(s.changed for s in st), sum(s.numel for s in st)

    @property
    def total_l2(self) -> float:
        return math.sqrt(sum(g.stats.l2 ** 2 for g in self.groups if g.stats is not None))


def _plain_values(structure) -> dict[str, str]:
    """The non-tensor leaves of a structure tree (epoch counters, names, ...) by flattened path."""
    if not structure:
        return {}

    return {path or "(root)": repr(leaf) for path, leaf in walk_leaves(structure) if "tensor" not in leaf}


def hashed_once(cache: dict, name: str, like: str | None, value) -> str:
    """The name of ``value(name)`` -- an array, or a source of blocks hashed block by block -- (in ``like``'s
    algorithm when given: theta.base.valuehash), computed once per algorithm and kept in ``cache``: a side that
    hashes its own values (a file) answers this way."""
    key = (name, like is not None and not valuehash.is_blake3(like))
    if key not in cache:
        h = valuehash.new() if like is None else valuehash.like(like)
        for _, block in stream.blocks(value(name), CHUNK):
            h.update(dtypes.le_bytes(block))
        cache[key] = h.hexdigest()
    return cache[key]


def same_value(old: Side, new: Side, name: str) -> bool:
    """Whether both sides hold the same value of ``name``: a side that hashes its values (a file) hashes in the
    algorithm of the other side's recorded name (theta.base.valuehash)."""
    if getattr(old, "computes_hashes", False) and not getattr(new, "computes_hashes", False):
        b = new.hash(name)
        return old.hash(name, like=b) == b
    a = old.hash(name)
    return new.hash(name, like=a) == a


def _value(side, name: str):
    """``side``'s value of ``name`` as a source of blocks where the side can give one (theta metadata, a file),
    else whole (a Git-Theta version: its groups are stored whole)."""
    value = getattr(side, "value", None)
    return value(name) if value is not None else side.array(name)


def diff_sides(old: Side | None, new: Side | None, path: str, estimate: bool = False) -> FileDiff:
    """Compare two versions group by group (either may be None: the file was added/removed)."""
    fd = FileDiff(path, old.format if old else None, new.format if new else None, estimated=estimate)
    if isinstance(old, OpaqueSide) or isinstance(new, OpaqueSide):
        def what(side) -> str:
            if side is None:
                return "nothing"
            if isinstance(side, OpaqueSide):
                return f"{side.ref.size} bytes, sha256 {side.ref.oid[:16]}"
            return f"a {side.format} checkpoint"
        if not (isinstance(old, OpaqueSide) and isinstance(new, OpaqueSide) and old.ref == new.ref):
            fd.notes.append(f"not a checkpoint (stored as one opaque blob): {what(old)} -> {what(new)}")
        return fd
    if isinstance(old, MetaSide) and isinstance(new, MetaSide):
        o, n = old.meta, new.meta
        ov, nv = _plain_values(o.structure), _plain_values(n.structure)
        if ov != nv:
            keys = sorted((k for k in set(ov) | set(nv) if ov.get(k) != nv.get(k)), key=natural_key)
            shown = ", ".join(keys[:5]) + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")
            fd.notes.append(f"non-tensor values changed: {shown}")
        if o.metadata != n.metadata:
            fd.notes.append("the file-level metadata changed")
    old_names = old.names() if old else []
    new_names = new.names() if new else []
    old_set, new_set = set(old_names), set(new_names)
    # a name tied to another tensor on one side is an alias, not a group: do not report it as added/removed
    old_aliases = old.aliases() if old else set()
    new_aliases = new.aliases() if new else set()
    modified: list[str] = []
    for name in new_names:
        if name not in old_set:
            if name not in old_aliases:
                fd.groups.append(GroupDiff(name, "added", new=new.info(name)))
            continue
        oi, ni = old.info(name), new.info(name)
        if oi.shape != ni.shape:
            fd.groups.append(GroupDiff(name, "reshaped", oi, ni))
        elif oi.dtype != ni.dtype:
            fd.groups.append(GroupDiff(name, "retyped", oi, ni))
        elif same_value(old, new, name):
            fd.unchanged += 1
        else:
            modified.append(name)
            fd.groups.append(GroupDiff(name, "modified", oi, ni))
    for name in old_names:
        if name not in new_set and name not in new_aliases:
            fd.groups.append(GroupDiff(name, "removed", old=old.info(name)))
    if not modified:
        return fd
    by_name = {g.name: g for g in fd.groups}
    if estimate:
        for name in modified:
            a, b = old.signature(name), new.signature(name)
            if a is not None and b is not None and len(a) == len(b):
                by_name[name].estimate = lsh.estimated_distance(a, b)
        return fd
    old.prefetch(modified)
    new.prefetch(modified)
    for name in modified:
        stats = change_stats(_value(old, name), _value(new, name))  # block by block, side by side
        if stats.changed == 0:  # one value named in two forms (sha256, BLAKE3: theta.base.valuehash), read: the same bits
            fd.groups.remove(by_name[name])
            fd.unchanged += 1
        else:
            by_name[name].stats = stats
    return fd
