"""Smudge: rebuild a checkpoint file from its metadata, one parameter group at a time.

Each tensor becomes a :class:`zipslice.TensorSource` whose ``read()`` reconstructs its group from the
store; ``zipslice.save`` writes them one at a time and publishes the file atomically. Tied aliases share the
source's tie key, so the torch writer stores them once and they load tied.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

import zipslice
from zipslice import TensorSource
from zipslice.errors import ZipsliceError

from .errors import BlobCorruptError, BlobMissingError, CheckpointError, ThetaError
from .metadata import CheckpointMeta
from .store import LfsStore, _hasher
from .updates import content_hash, reconstruct


# formats zipslice reads but does not write: a pre-1.6 torch file is checked out as a torch zip file
_WRITES_AS = {"torch-legacy": "torch"}


class _LastValue(dict):
    """A reconstruct cache holding only the most recent value (tied aliases read it twice in a row)."""

    def __setitem__(self, key, value):
        self.clear()
        super().__setitem__(key, value)


def _le_bytes(arr: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def check_blobs(meta: CheckpointMeta, store: LfsStore, file: str | None = None) -> None:
    """Raise BlobMissingError (naming the group, the file and the oid) if any needed blob is not local."""
    missing = store.missing(meta.blob_refs())
    if not missing:
        return
    first = missing[0]
    group = next(n for n in sorted(meta.groups) if any(s.blob == first for s in meta.groups[n].steps))
    err = BlobMissingError(first.oid, group=group, file=file, size=first.size)
    if len(missing) > 1:
        err.args = (f"{err.args[0]} (and {len(missing) - 1} more missing blobs)",)
    raise err


def smudge_checkpoint(meta: CheckpointMeta, store: LfsStore, out_path: str | os.PathLike, fmt: str | None = None,
                      progress: bool = False) -> None:
    """Write the checkpoint described by ``meta`` to ``out_path`` in its committed format (or ``fmt``).

    The file appears at ``out_path`` only once every group was rebuilt and matched its content hash;
    on any error nothing is left behind.
    """
    out_path = os.fspath(out_path)
    name = Path(out_path).name
    check_blobs(meta, store, name)
    target = fmt or meta.format
    target = _WRITES_AS.get(target, target)
    cache = _LastValue()
    bar = _progress(progress, meta, name)
    checker = _HashChecker(name)

    def reader(group_name: str):
        def read():
            group = meta.groups[group_name]
            value = reconstruct(group, store, cache, file=name, verify=False)
            checker.submit(group, value)  # verified on another thread while the writer writes it
            if bar is not None:
                bar.advance(bar.task_ids[0], value.nbytes)
            return _le_bytes(value)
        return read

    sources = []
    for tname in meta.order:
        alias = meta.aliases.get(tname)
        g = meta.group_for(tname)
        owner = alias or g
        sources.append(TensorSource(name=tname, dtype=g.dtype, shape=tuple(g.shape), read=reader(g.name),
                                    tie=("theta", g.name), is_parameter=owner.is_parameter,
                                    requires_grad=owner.requires_grad))
    options: dict = {}
    if target == "torch" and meta.structure is not None:
        options["structure"] = meta.structure
    if meta.metadata:
        options["metadata"] = dict(meta.metadata)
    # written beside out_path and renamed once every hash checked out (same directory: atomic rename)
    tmp = os.path.join(os.path.dirname(out_path) or ".", f".{name}.theta-{os.getpid()}.tmp")
    try:
        zipslice.save(tmp, [(s.name, s) for s in sources], format=target, **options)
        checker.finish()
        os.replace(tmp, out_path)
    except ZipsliceError as e:
        raise CheckpointError(f"cannot write {out_path}: {e}") from e
    except ValueError as e:
        raise ThetaError(f"cannot write {out_path} as {target}: {e}") from e
    finally:
        checker.finish(raise_errors=False)
        if os.path.exists(tmp):
            os.unlink(tmp)
        if bar is not None:
            bar.stop()


class _HashChecker:
    """Checks rebuilt values against their content hash on a background thread, one value in flight."""

    def __init__(self, file: str):
        self.file = file
        self.pending = None

    def submit(self, group, value: np.ndarray) -> None:
        self.finish()
        self.pending = (group, _hasher().submit(content_hash, value))

    def finish(self, raise_errors: bool = True) -> None:
        if self.pending is None:
            return
        group, fut = self.pending
        self.pending = None
        digest = fut.result()
        if digest != group.hash and raise_errors:
            raise BlobCorruptError(f"{self.file}: group {group.name!r} rebuilt from blob "
                                   f"{group.steps[-1].blob.oid} does not match its content hash")


def _progress(enabled: bool, meta: CheckpointMeta, label: str):
    if not (enabled and sys.stderr.isatty()):
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from zipslice import dtypes

    total = sum(g.numel * dtypes.get(g.dtype).itemsize for g in meta.groups.values())
    p = Progress(TextColumn(f"theta smudge {label}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                 console=Console(stderr=True), transient=True)
    p.start()
    p.add_task(label, total=total)
    return p
