"""Git-Theta 0.2.0's update chains: a group's ``last_commit`` references followed back to its dense value, then the
updates applied oldest first (:func:`resolve_group`, :func:`resolve_file`). git and git-lfs are reached only through
the ``read_object`` callback the caller passes."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Union

import numpy as np

from theta.base.errors import BlobCorruptError, BlobMissingError, GitThetaFormatError, GitThetaUpdateTypeError
from theta.peers.gittheta.arithmetic import apply_update
from theta.peers.gittheta.blobs import decode_group_blob
from theta.peers.gittheta.metadata import KNOWN_UPDATE_TYPES, FileMetadata, GroupMetadata, parse_metadata


@dataclass(frozen=True)
class GitBlob:
    """Ask ``read_object`` for the blob at ``commit:path`` (None if the path is absent there)."""

    commit: str
    path: str


@dataclass(frozen=True)
class LfsObject:
    """Ask ``read_object`` for the content of a git-lfs object (None if it cannot be had)."""

    oid: str
    size: int
    pointer: str  # the pointer text, for readers that go through `git lfs smudge`


ObjectRef = Union[GitBlob, LfsObject]
ReadObject = Callable[["str | Path", ObjectRef], "bytes | None"]


class ChainResolver:
    """Values of one tracked file's groups, following Git-Theta's ``last_commit`` references.

    Metadata texts read along the way are cached per commit, so resolving every group of a file reads each
    earlier commit's metadata once. Blobs are checked against their oid and size before decoding."""

    def __init__(self, repo_dir: "str | Path", path: str, read_object: ReadObject, *, max_bytes: int | None = None):
        self.repo_dir, self.path, self.read_object, self.max_bytes = repo_dir, path, read_object, max_bytes
        self._metadata: dict[str, FileMetadata | None] = {}

    def metadata_at(self, commit: str) -> FileMetadata | None:
        if commit not in self._metadata:
            raw = self.read_object(self.repo_dir, GitBlob(commit, self.path))
            self._metadata[commit] = None if raw is None else parse_metadata(raw, f"{commit}:{self.path}")
        return self._metadata[commit]

    def chain(self, group: GroupMetadata, where: str | None = None) -> list[tuple[GroupMetadata, str]]:
        """``[(group, its metadata text's name), ...]`` from ``group`` back to its dense value (the last item).

        Raises :class:`GitThetaUpdateTypeError` for an update type theta cannot apply and
        :class:`GitThetaFormatError` for a broken reference (null, missing file or group, loop)."""
        chain = [(group, where or self.path)]
        seen: set[str] = set()
        while chain[-1][0].theta.update_type != "dense":
            g, gfile = chain[-1]
            if g.theta.update_type not in KNOWN_UPDATE_TYPES:
                raise GitThetaUpdateTypeError(
                    f"unknown update type {g.theta.update_type!r} (theta reads Git-Theta's dense, sparse, low-rank "
                    f"and ia3)", file=gfile, group=g.name, field="theta_metadata.update_type")
            prev_commit = g.theta.last_commit
            if prev_commit is None:
                raise GitThetaFormatError(f"{g.theta.update_type} update without a previous version "
                                          f"(last_commit is null)", file=gfile, group=g.name,
                                          field="theta_metadata.last_commit")
            if prev_commit in seen:
                raise GitThetaFormatError(f"update chain loops back to commit {prev_commit}", file=gfile,
                                          group=g.name, field="theta_metadata.last_commit")
            seen.add(prev_commit)
            prev_meta = self.metadata_at(prev_commit)
            if prev_meta is None:
                raise GitThetaFormatError(f"the previous version's commit {prev_commit} has no {self.path}",
                                          file=gfile, group=g.name, field="theta_metadata.last_commit")
            prev = prev_meta.groups.get(g.key)
            if prev is None:
                raise GitThetaFormatError(f"the previous version's commit {prev_commit} has no such group",
                                          file=gfile, group=g.name, field="theta_metadata.last_commit")
            chain.append((prev, prev_meta.file))
        return chain

    def resolve(self, group: GroupMetadata, where: str | None = None) -> np.ndarray:
        """The value Git-Theta checks out for ``group`` (whose metadata text is ``where``, for messages)."""
        chain = self.chain(group, where)
        base, base_file = chain[-1]
        value = self._dense(base, base_file)
        for g, gfile in reversed(chain[:-1]):
            parts = self._blob(g, gfile)
            value = apply_update(g.theta.update_type, parts, value, file=gfile, group=g.name)
            if value.shape != g.tensor.shape:
                raise GitThetaFormatError(f"the value's shape {list(value.shape)} differs from the metadata's "
                                          f"{list(g.tensor.shape)}", file=gfile, group=g.name)
        return value

    def _dense(self, g: GroupMetadata, file: str) -> np.ndarray:
        parts = self._blob(g, file)
        if set(parts) != {"parameter"}:
            raise GitThetaFormatError(f"a dense blob holds one array named 'parameter', found {sorted(parts)}",
                                      file=file, group=g.name)
        value = parts["parameter"]
        if value.shape != g.tensor.shape or str(value.dtype) != g.tensor.dtype:
            raise GitThetaFormatError(f"the blob holds {value.dtype}{list(value.shape)}, the metadata says "
                                      f"{g.tensor.dtype}{list(g.tensor.shape)}", file=file, group=g.name)
        return value

    def _blob(self, g: GroupMetadata, file: str) -> dict[str, np.ndarray]:
        lfs = g.lfs
        blob = self.read_object(self.repo_dir, LfsObject(lfs.oid, lfs.size, lfs.pointer_text()))
        if blob is None:
            raise BlobMissingError(lfs.oid, group=g.name, file=file, size=lfs.size)
        if len(blob) != lfs.size or hashlib.sha256(blob).hexdigest() != lfs.oid:
            raise BlobCorruptError(f"LFS object {lfs.oid} ({file}, group {g.name!r}) has {len(blob)} bytes and "
                                   f"sha256 {hashlib.sha256(blob).hexdigest()}; the metadata says {lfs.size} bytes")
        return decode_group_blob(blob, file=file, group=g.name, max_bytes=self.max_bytes)


def resolve_group(repo_dir: "str | Path", path: str, commit: str, group_name: "str | tuple[str, ...]",
                  read_object: ReadObject, *, max_bytes: int | None = None) -> np.ndarray:
    """The value Git-Theta 0.2.0 checks out for ``group_name`` of ``path`` in ``commit``.

    ``read_object(repo_dir, ref)`` returns the bytes of a :class:`GitBlob` (the text at ``commit:path``) or of
    an :class:`LfsObject` (e.g. through ``git lfs smudge`` of ``ref.pointer``), or None when absent."""
    resolver = ChainResolver(repo_dir, path, read_object, max_bytes=max_bytes)
    meta = resolver.metadata_at(commit)
    if meta is None:
        raise GitThetaFormatError(f"commit {commit} has no {path}", file=f"{commit}:{path}")
    group = meta.group(group_name)
    if group is None:
        raise GitThetaFormatError("no such group", file=meta.file,
                                  group=group_name if isinstance(group_name, str) else "/".join(group_name))
    return resolver.resolve(group, meta.file)


def resolve_file(repo_dir: "str | Path", path: str, metadata: FileMetadata, read_object: ReadObject, *,
                 max_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, value)`` for every group of ``metadata`` (the text at ``path``, e.g. handed to a smudge filter),
    in text order, one group at a time; earlier commits' metadata is read once for the whole file."""
    resolver = ChainResolver(repo_dir, path, read_object, max_bytes=max_bytes)
    for group in metadata.groups.values():
        yield group.name, resolver.resolve(group, metadata.file)
