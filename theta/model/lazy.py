"""Any committed version of a tracked checkpoint as a lazy mapping, read straight from theta's blob store.

    with theta.load("model.pt", rev="HEAD~3") as lsd:     # reads one small text: the metadata
        lsd.info("model/encoder.weight")                  # dtype, shape -- no data read
        w = lsd["model/encoder.weight"]                   # rebuilds that one group from its blobs

:class:`ThetaCheckpoint` has the API of :func:`zipslice.load` (it is a :class:`zipslice.LazyCheckpoint`):
the same names, dtypes, shapes, values bit for bit, ``structure``, ``extras`` and ``metadata`` as the
checkpoint file the version would check out as. Nothing is written: reading layer 3 of a 100 GB checkpoint
from last month costs layer 3's blobs, fetched from the LFS server on demand (one git-lfs run per group
read, or all at once with :meth:`ThetaCheckpoint.fetch`).

zipslice opens theta files through its format plugins (entry point ``zipslice.formats``:
:data:`theta.model.zipslice_format.FORMAT`), so zipslice never imports theta:

- ``zipslice.load(path)`` of a *placeholder* (a work-tree file holding the metadata, see
  :mod:`theta.commands.filter.materialize`) inside its repository reads the checkpoint it stands for;
  outside a repository it says what the file is and what to run;
- ``zipslice.load("REV:PATH")`` (and `zipslice ls/show/diff REV:PATH`) inside a theta repository opens that
  committed version.
"""
from __future__ import annotations

import os
import subprocess
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import zipslice
from zipslice import dtypes, structure
from zipslice.base import LazyCheckpoint
from zipslice.errors import NotACheckpointError, ZipsliceError
from zipslice.info import TensorInfo, contiguous_stride
from zipslice.slicing import RangeReader, read_selection

from theta.base.errors import GitError, ThetaError, UpdateTypeError
from theta.git import repo as gitutil
from theta.storage.metadata import MAGIC, CheckpointMeta, is_metadata, loads
from theta.storage.store import LfsStore
from theta.storage.transfer import fetch_missing
from theta.updates import bounds, stream
from theta.updates.rebuild import reconstruct

PLACEHOLDER_HINT = ("a git-theta placeholder: the metadata of a checkpoint versioned with git-theta, not the "
                    "checkpoint itself")


def detect(head: bytes) -> bool:
    """zipslice's plugin sniffing: a theta metadata text (a placeholder)."""
    return is_metadata(head)


class ThetaCheckpoint(LazyCheckpoint):
    """A lazy, read-only checkpoint over theta metadata; each group is rebuilt from the store when read.

    ``repo``: the work tree whose LFS store holds (or will fetch) the blobs; ``fetch``: download missing
    blobs from the remote on demand (else a missing blob is an error naming it).
    """

    def __init__(self, path: str | os.PathLike, meta: CheckpointMeta | None = None, repo: str | os.PathLike | None = None,
                 fetch: bool = True, rev: str | None = None):
        super().__init__(path)
        if meta is None:
            meta = _meta_of_placeholder(self.path)
        if repo is None:
            repo = _repository_of(self.path)
        self.meta, self.repo, self.rev, self.fetch_missing = meta, Path(repo), rev, fetch
        self.format = meta.format
        self.store = LfsStore.for_repo(self.repo)
        self.structure = meta.structure
        self.metadata = dict(meta.metadata or {})
        for name in meta.order:
            group = meta.group_for(name)
            owner = meta.aliases.get(name) or group
            shape = tuple(group.shape)
            self._infos[name] = TensorInfo(
                name=name, dtype=group.dtype, shape=shape, stride=contiguous_stride(shape), storage=group.name,
                storage_offset=0, offset=None, span_nbytes=group.numel * dtypes.get(group.dtype).itemsize,
                file=self.path, is_parameter=owner.is_parameter, requires_grad=owner.requires_grad)
        if meta.structure is not None:
            for name, node in structure.walk_leaves(meta.structure):
                if "tensor" not in node:
                    self.extras[name] = node if "torch" in node else structure.leaf_value(node)

    def __repr__(self) -> str:
        at = f" rev={self.rev!r}" if self.rev else ""
        return f"<ThetaCheckpoint {self.path!r}{at} format={self.format} tensors={len(self)}>"

    def __reduce_ex__(self, protocol):
        return reduce_as_checkpoint(self, self.meta.structure, protocol)

    def fetch(self) -> int:
        """Download every blob this checkpoint needs that is not local, in one git-lfs run; how many."""
        try:
            return fetch_missing(self.repo, self.meta.blob_refs(), store=self.store)
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e)) from None

    def _fetched(self, info: TensorInfo):
        """The group behind ``info``, its blobs fetched when missing (with ``fetch``)."""
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        group = self.meta.group_for(info.name)
        refs = [s.blob for s in group.steps]
        if self.fetch_missing and self.store.missing(refs):
            fetch_missing(self.repo, refs, store=self.store)
        return group

    def _read_span(self, info: TensorInfo) -> bytes:
        """The group's value as contiguous little-endian bytes, rebuilt and checked against its hash."""
        try:
            group = self._fetched(info)
            value = reconstruct(group, self.store, file=os.path.basename(self.path), verify=True)
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e), info.name) from None
        return dtypes.le_bytes(value)

    def value_frames(self, key: str, elements: int):
        """The group's value frame by frame (zipslice.frames: convert, show, diff of a version): its chain read in
        one pass (:func:`theta.updates.stream.source`), checked against the group's name at the end of the pass;
        None for a chain that does not stream (zipslice then reads it box by box, or whole)."""
        info = self.info(key)
        try:
            src = stream.source(self._fetched(info), self.store, os.path.basename(self.path))
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e), key) from None
        if src is None:
            return None
        return self._frames(src, key, elements, dtypes.get(info.dtype).carrier)

    def _frames(self, src, key: str, elements: int, carrier):
        try:
            for _, block in src.chunks(elements):
                yield block.view(carrier)
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e), key) from None

    def _read_selection(self, info: TensorInfo, sel):
        """``get_slice``: only the frames of the group's blobs the slice covers are decoded (its chain read by
        position, :func:`theta.updates.stream.open_levels`), block by block as zipslice reads a file
        (:func:`zipslice.slicing.read_selection`). Each frame's zstd checksum is verified as it is decoded; the
        value's name can only be checked against the whole value (``lsd[key]``). A chain of update types not read
        by position (a plugin's) is rebuilt whole, then sliced."""
        file = os.path.basename(self.path)
        try:
            group = self._fetched(info)
            bounds.check_group(group, file)
            with ExitStack() as stack:
                try:
                    level = stream.open_levels(group, self.store, file, stack)
                except UpdateTypeError:
                    level = None  # not read by position: whole, below
                if level is not None and level.dtype == dtypes.get(info.dtype).to_numpy():
                    return read_selection(_LevelRange(level, info), replace(info, offset=0), sel)
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e), info.name) from None
        return super()._read_selection(info, sel)

    def data_file_bytes(self) -> int:
        return sum(i.span_nbytes for i in self._infos.values())

    def dropping_behind(self) -> bool:
        return False  # nothing of a file is read: blobs are mapped, decoded and let go one group at a time


def reduce_as_checkpoint(lsd: LazyCheckpoint, tree: dict | None, protocol: int):
    """How a lazy checkpoint pickles (``torch.save(lsd, f)``, ``copy.deepcopy``): as the checkpoint itself,
    every group read -- the object torch.load would return for its file (``tree``: its container structure, None
    for a flat one), the root an OrderedDict (the mapping type torch.load's weights-only unpickler accepts; a
    state dict is one anyway)."""
    from collections import OrderedDict
    from collections.abc import Mapping

    obj = structure.build(tree, lsd.tensor) if tree is not None else None
    if not isinstance(obj, Mapping):
        obj = OrderedDict((k, lsd.tensor(k)) for k in lsd)
    elif type(obj) is not OrderedDict:
        obj = OrderedDict(obj)
    return obj.__reduce_ex__(protocol)


class _LevelRange(RangeReader):
    """Byte ranges of a group's value read through its chain's last level (a zipslice ``RangeReader``)."""

    def __init__(self, level, info: TensorInfo):
        self.level, self.item = level, dtypes.get(info.dtype).itemsize
        self.size = info.numel * self.item

    def fill(self, buf, offset: int) -> None:
        a = offset // self.item
        values = self.level.read(a, a + memoryview(buf).nbytes // self.item)
        memoryview(buf).cast("B")[:] = dtypes.le_bytes(values)


# -- opening ------------------------------------------------------------------------------------------------
def _repository_of(path: str) -> Path:
    """The work tree holding ``path`` (a placeholder), or a clear error naming what the file is."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        return gitutil.toplevel(d)
    except (GitError, OSError):
        raise NotACheckpointError(
            path, f"this is {PLACEHOLDER_HINT}, and it is not inside a git repository; in a clone of its "
                  "repository with theta installed run `git theta pull` (or `git theta checkout PATH`)") from None


def _meta_of_placeholder(path: str) -> CheckpointMeta:
    try:
        with open(path, "rb") as f:
            text = f.read(256 << 20)
        return loads(text)
    except ThetaError as e:
        raise NotACheckpointError(path, f"starts like theta metadata but is not readable: {e}") from None


def load(path: str | os.PathLike, rev: str | None = None, *, fetch: bool = True) -> LazyCheckpoint:
    """Open a theta-tracked checkpoint lazily (the API of :func:`zipslice.load`).

    ``rev=None``: the work-tree file -- the real checkpoint through zipslice, or, for a placeholder, the
    version it stands for, read from the store. ``rev="HEAD~3"`` (any revision; ``":"`` for the index): that
    committed version, never written to disk. ``fetch``: download missing blobs on demand.
    """
    path = os.fspath(path)
    if rev is None:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 1)
        if not is_metadata(head):
            return zipslice.load(path)
        return ThetaCheckpoint(path, fetch=fetch)
    top, rel = _locate(path)
    spec = f":{rel}" if rev in (":", "") else f"{rev}:{rel}"
    return _open_spec(top, spec, fetch)


def _locate(path: str) -> tuple[Path, str]:
    """(work tree, path relative to it in git's form) for a path that may not exist in the work tree."""
    absolute = Path(os.path.abspath(path))
    d = absolute.parent
    while not d.is_dir():
        d = d.parent
    try:
        top = gitutil.toplevel(d)
    except (GitError, OSError):
        raise ThetaError(f"{path}: not inside a git repository") from None
    return top, absolute.relative_to(top.resolve()).as_posix()


def _open_spec(top: Path, spec: str, fetch: bool) -> ThetaCheckpoint:
    data = gitutil.read_blob(spec, top)
    if data is None:
        raise ThetaError(f"{spec}: no such file in git (in {top})")
    if not is_metadata(data):
        raise ThetaError(f"{spec} is not a theta-tracked checkpoint (its content is not theta metadata)")
    return ThetaCheckpoint(spec, meta=loads(data), repo=top, fetch=fetch, rev=spec.partition(":")[0] or ":")


def open_spec(name: str) -> LazyCheckpoint | None:
    """zipslice's plugin hook for names that are not files: ``REV:PATH`` inside a git repository whose
    ``REV:PATH`` is theta metadata; None for anything else (zipslice then reports the missing file)."""
    rev, sep, rel = name.partition(":")
    if not sep or not rel or os.path.exists(name):
        return None
    try:
        top = gitutil.toplevel(os.getcwd())
        prefix = gitutil.run_text(["rev-parse", "--show-prefix"], os.getcwd())
    except (GitError, OSError, subprocess.SubprocessError):
        return None
    # git reads REV:PATH from the top of the work tree; ./PATH and ../PATH are relative to the current directory
    if rel.startswith(("./", "../")):
        rel = os.path.normpath(os.path.join(prefix, rel)).replace(os.sep, "/")
    spec = f"{rev}:{rel}"
    data = gitutil.read_blob(spec, top)
    if data is None or not is_metadata(data):
        return None
    return ThetaCheckpoint(spec, meta=loads(data), repo=top, rev=rev or ":")
