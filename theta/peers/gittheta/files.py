"""A file whose committed version Git-Theta 0.2.0 wrote, inside a theta repository.

Both tools name their filter ``theta``, so a repository with Git-Theta history reaches theta's filter with
Git-Theta's JSON metadata. :class:`GitThetaFile` turns that metadata into what Git-Theta itself checks out:

* :meth:`GitThetaFile.fetch` brings every LFS object of every group's update chain (earlier commits'
  blobs included) into the store in one git-lfs run (:func:`theta.storage.transfer.fetch_missing`);
* :meth:`GitThetaFile.sources` are zipslice :class:`~zipslice.TensorSource` s in Git-Theta's order whose
  ``read()`` rebuilds one group (:mod:`theta.peers.gittheta.arithmetic`: same numpy operations as Git-Theta), so a
  checkout streams one group at a time;
* :meth:`GitThetaFile.matches` says whether a work-tree checkpoint holds exactly those values (then the
  clean filter hands git the committed Git-Theta text back and ``git status`` stays clean);
* :func:`to_theta_metadata` rewrites the file into theta's own format (``git theta migrate``, and the
  previous version a new commit on top of Git-Theta history builds on).

Nested checkpoints (Git-Theta's Flax and TensorFlow types: a group's key is a path of dict keys) are written
as nested dicts of a PyTorch file; a group's name is its path joined with "/", as Git-Theta names it in update
files and logs (:func:`group_names`). Values are those of the chain's arithmetic on this machine: bit for bit
for dense, sparse and ia3; low-rank's BLAS matmul may differ from another machine's in the last bit.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

import zipslice
from zipslice import TensorSource, dtypes, torch_writer

from theta.base.errors import BlobMissingError, GitThetaFormatError
from theta.git import repo as gitutil
from theta.model.clean import clean_checkpoint
from theta.model.diff import GroupInfo, hashed_once
from theta.peers.gittheta import blobs as gt_blobs
from theta.peers.gittheta import chains as gt_chains
from theta.peers.gittheta import metadata as gt_metadata
from theta.storage.store import BlobRef, LfsStore
from theta.storage.transfer import fetch_missing


def group_names(meta: "gt_metadata.FileMetadata") -> dict[str, tuple[str, ...]]:
    """``{name: key}`` in text order; a name is the key's path joined with "/" (Git-Theta's own rule: it never
    splits a key, so ``("x/y",)`` and ``("x", "y")`` would both be "x/y": refused, naming both)."""
    names: dict[str, tuple[str, ...]] = {}
    for key in meta.groups:
        name = "/".join(key)
        if name in names:
            raise GitThetaFormatError(f"groups {list(names[name])} and {list(key)} would both be named {name!r} "
                                      f"(a key containing '/' next to a nested one)", file=meta.file, group=name)
        if any(k == "" for k in key):
            raise GitThetaFormatError(f"an empty key in the group's path {list(key)}", file=meta.file, group=name)
        names[name] = key
    return names


def structure_of(keys: "dict[str, tuple[str, ...]]") -> dict | None:
    """The zipslice structure (nested dicts) of a checkpoint whose groups have these key paths, in Git-Theta's
    order (its unflatten: a sub-dict sits where its first group does); None when it is flat."""
    if all(len(k) == 1 for k in keys.values()):
        return None
    root: dict = {}
    for name, key in keys.items():
        node = root
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = name

    def to_node(d: dict) -> dict:
        return {"dict": [[k, {"tensor": v} if isinstance(v, str) else to_node(v)] for k, v in d.items()]}

    return to_node(root)


def key_paths(node: dict, prefix: tuple = ()) -> "dict[str, tuple] | None":
    """``{tensor name: path of dict keys}`` of a zipslice structure made only of string-keyed dicts and
    tensors (what a Git-Theta checkout is); None for anything else (lists, values, other key types)."""
    items = node.get("dict", node.get("odict"))
    if items is None or "metadata" in node:
        return None
    out: dict = {}
    for k, child in items:
        if not isinstance(k, str):
            return None
        if "tensor" in child:
            out[child["tensor"]] = prefix + (k,)
            continue
        sub = key_paths(child, prefix + (k,))
        if sub is None:
            return None
        out.update(sub)
    return out


def is_git_theta(data: "bytes | None") -> bool:
    """True when a blob is Git-Theta metadata (cheap for anything else: only JSON objects are parsed)."""
    return data is not None and data[:1] == b"{" and gt_metadata.is_git_theta_metadata(data)


class GitThetaFile:
    """The Git-Theta metadata ``text`` of ``path`` (relative to the top of ``repo_dir``)."""

    def __init__(self, text: bytes, path: str, repo_dir: "str | os.PathLike", store: LfsStore,
                 label: str | None = None):
        self.path, self.repo_dir, self.store = path, Path(repo_dir), store
        self.meta = gt_metadata.parse_metadata(text, label or path)
        self.resolver = gt_chains.ChainResolver(self.repo_dir, path, self._read_object)
        self._chains: dict[tuple[str, ...], list] = {}
        self._dtypes: dict[tuple[str, ...], np.dtype] = {}
        self.keys = group_names(self.meta)  # name -> path of keys; refuses two groups with one name
        self.structure = structure_of(self.keys)  # None: a flat state dict

    # -- reading -------------------------------------------------------------------------------------
    def _read_object(self, repo_dir, ref: "gt_chains.ObjectRef") -> bytes | None:
        if isinstance(ref, gt_chains.GitBlob):
            return gitutil.read_blob(f"{ref.commit}:{ref.path}", repo_dir)
        blob = BlobRef(ref.oid, ref.size)
        return self.store.get(blob) if self.store.has(blob) else None

    def _group(self, name: str) -> "gt_metadata.GroupMetadata":
        return self.meta.groups[self.keys[name]]

    def names(self) -> list[str]:
        """Group names in text order (the order Git-Theta writes the checkout in)."""
        return list(self.keys)

    def chain(self, name: str) -> list:
        """``[(group metadata, metadata text name), ...]`` from the group back to its dense value."""
        group = self._group(name)
        if group.key not in self._chains:
            self._chains[group.key] = self.resolver.chain(group, self.meta.file)
        return self._chains[group.key]

    def blob_refs(self) -> list[BlobRef]:
        """Every LFS object any group's chain needs (reads earlier commits' metadata, no blob)."""
        seen: dict[str, BlobRef] = {}
        for name in self.names():
            for g, _ in self.chain(name):
                seen.setdefault(g.lfs.oid, BlobRef(g.lfs.oid, g.lfs.size))
        return list(seen.values())

    def fetch(self) -> int:
        """Download whatever LFS objects the chains need and the store lacks (one git-lfs run)."""
        return fetch_missing(self.repo_dir, self.blob_refs(), store=self.store)

    def dtype(self, name: str) -> np.dtype:
        """The dtype of the value Git-Theta checks out (numpy's promotion along the chain), from headers."""
        group = self._group(name)
        if group.key not in self._dtypes:
            chain = self.chain(name)
            dt = np.dtype(chain[-1][0].tensor.dtype)
            for g, gfile in reversed(chain[:-1]):
                blob = self._read_object(self.repo_dir, gt_chains.LfsObject(g.lfs.oid, g.lfs.size, g.lfs.pointer_text()))
                if blob is None:
                    raise BlobMissingError(g.lfs.oid, group=g.name, file=gfile, size=g.lfs.size)
                dt = gt_blobs.result_dtype(g.theta.update_type, gt_blobs.part_dtypes(blob, file=gfile, group=g.name), dt)
            self._dtypes[group.key] = dt
        return self._dtypes[group.key]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._group(name).tensor.shape)

    def update_type(self, name: str) -> str:
        return self._group(name).theta.update_type

    def value(self, name: str) -> np.ndarray:
        """The value Git-Theta checks out for group ``name`` (blobs must be local: :meth:`fetch`)."""
        group = self._group(name)
        value = self.resolver.resolve(group, self.meta.file)
        if value.dtype != self.dtype(name):
            raise GitThetaFormatError(f"rebuilt as {value.dtype}, its blobs' headers say {self.dtype(name)}",
                                      file=self.meta.file, group=name)
        return value

    def values(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.names():
            yield name, self.value(name)

    # -- writing -------------------------------------------------------------------------------------
    def sources(self) -> list[TensorSource]:
        """One source per group, in text order; each ``read()`` rebuilds its group when the writer asks."""
        out = []
        for name in self.names():
            dt = dtypes.from_numpy(self.dtype(name)).name
            out.append(TensorSource(name=name, dtype=dt, shape=self.shape(name), read=self._reader(name)))
        return out

    def _reader(self, name: str):
        return lambda: dtypes.le_bytes(self.value(name))

    def write(self, out_path: "str | os.PathLike", fmt: str | None = None) -> None:
        """Write the checkout to ``out_path`` (torch unless ``fmt``), atomically (temp file + rename)."""
        out_path = os.fspath(out_path)
        fmt = fmt or "torch"
        fd, tmp = tempfile.mkstemp(prefix=f".{Path(out_path).name}.", suffix=".theta-tmp",
                                   dir=os.path.dirname(out_path) or ".")
        os.close(fd)
        options = {"record_prefix": torch_writer.default_prefix(out_path)} if fmt == "torch" else {}
        if fmt == "torch" and self.structure is not None:
            options["structure"] = self.structure
        try:
            zipslice.save(tmp, [(s.name, s) for s in self.sources()], format=fmt, **options)
            os.replace(tmp, out_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def write_to(self, out, name: str) -> None:
        """Stream the torch checkout to ``out`` (nothing seeks): the filter's pipe to git."""
        torch_writer.write_to(out, self.sources(), record_prefix=torch_writer.default_prefix(name), path=name,
                              structure=self.structure)

    # -- comparing -----------------------------------------------------------------------------------
    def matches(self, checkpoint_path: "str | os.PathLike") -> bool:
        """True when the checkpoint at ``checkpoint_path`` holds exactly the groups this metadata checks out:
        the same names (nested the same way, for a format that nests), dtypes and shapes, every value bit for
        bit. One group in memory at a time."""
        try:
            ckpt = zipslice.load(checkpoint_path)
        except zipslice.ZipsliceError:
            return False
        try:
            keys = list(ckpt.keys())
            if sorted(keys) != sorted(self.names()):
                return False
            if ckpt.structure is not None and key_paths(ckpt.structure) != self.keys:
                return False  # same names, nested differently ("x/y" as one key or as x -> y)
            for name in self.names():
                info = ckpt.info(name)
                if tuple(info.shape) != self.shape(name) or info.dtype != dtypes.from_numpy(self.dtype(name)).name:
                    return False
            for name in self.names():
                have = np.asarray(ckpt.numpy(name))
                if bytes(dtypes.le_bytes(have)) != bytes(dtypes.le_bytes(self.value(name))):
                    return False
            return True
        finally:
            close = getattr(ckpt, "close", None)
            if close:
                close()


def to_theta_metadata(gtf: GitThetaFile, spool_dir: "str | os.PathLike"):
    """The file in theta's own format: its checkout written to a temporary file under ``spool_dir`` and
    cleaned as a new file with default options (every group one dense step, stored in ``gtf.store``).
    Returns the CheckpointMeta; blobs must be local (:meth:`GitThetaFile.fetch`)."""
    fd, tmp = tempfile.mkstemp(prefix="gittheta-", suffix=".pt", dir=spool_dir)
    os.close(fd)
    try:
        gtf.write(tmp, "torch")
        return clean_checkpoint(tmp, gtf.store, None)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# Git-Theta metadata is JSON of ~1 KB per group; larger "{"-content is a checkpoint, not metadata.
MAX_TEXT = 256 << 20


def metadata_text(file: "str | os.PathLike", head: bytes, size: int) -> bytes | None:
    """The content of ``file`` when it is Git-Theta's metadata text (``head``: its first bytes), else None."""
    if head[:1] != b"{" or size > MAX_TEXT:
        return None
    data = Path(file).read_bytes()
    return data if is_git_theta(data) else None


def committed(path: str, cwd: Path, store: LfsStore) -> "tuple[bytes, GitThetaFile] | None":
    """``(text, GitThetaFile)`` when the index (else HEAD) holds Git-Theta metadata for ``path``, else None."""
    for spec in (f":{path}", f"HEAD:{path}"):
        data = gitutil.read_blob(spec, cwd)
        if data is not None:
            if not is_git_theta(data):
                return None
            return data, GitThetaFile(data, path, cwd, store, label=spec)
    return None


def previous_for_clean(found: "tuple[bytes, GitThetaFile]", file: "str | os.PathLike",
                       spool_dir: "str | os.PathLike"):
    """What a clean of ``file`` builds on when its committed version is Git-Theta's (``found``, from
    :func:`committed`): ``(text, None)`` when ``file`` holds exactly the values that text checks out (the text
    is then stored unchanged, so `git status` is clean), else ``(None, previous metadata in theta's format)``."""
    text, gtf = found
    gtf.fetch()
    if gtf.matches(file):
        return text, None
    return None, to_theta_metadata(gtf, spool_dir)


class GitThetaSide:
    """A version given as Git-Theta metadata, for :func:`theta.model.diff.diff_sides` (`git theta diff`, the
    diff driver). Values are rebuilt on demand; there is no theta LSH signature to estimate from."""

    format = "torch"

    def __init__(self, gtf: GitThetaFile, label: str):
        self.gtf, self.label = gtf, label
        self._hashes: dict[tuple[str, bool], str] = {}  # (name, in sha256) -> name (hashed_once)
        self._fetched = False

    def _group(self, name: str) -> "gt_metadata.GroupMetadata":
        return self.meta.groups[self.keys[name]]

    def names(self) -> list[str]:
        return self.gtf.names()

    def aliases(self) -> set[str]:
        return set()

    def info(self, name: str):
        self.prefetch(())
        return GroupInfo(dtypes.from_numpy(self.gtf.dtype(name)).name, self.gtf.shape(name),
                         self.gtf.update_type(name), len(self.gtf.chain(name)))

    computes_hashes = True

    def hash(self, name: str, like: str | None = None) -> str:
        return hashed_once(self._hashes, name, like, self.array)

    def signature(self, name: str) -> list[int] | None:
        return None

    def prefetch(self, names) -> None:
        if not self._fetched:
            self.gtf.fetch()
            self._fetched = True

    def array(self, name: str, cache: dict | None = None) -> np.ndarray:
        self.prefetch(())
        return self.gtf.value(name)
