"""Smudge: rebuild a checkpoint file from its metadata, one parameter group at a time.

Each tensor becomes a :class:`zipslice.TensorSource` whose ``read()`` reconstructs its group from the
store; ``zipslice.save`` writes them one at a time and publishes the file atomically. Tied aliases share the
source's tie key, so the torch writer stores them once and they load tied.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from pathlib import Path
from typing import BinaryIO

import numpy as np

import zipslice
from zipslice import TensorSource, dtypes, torch_writer
from zipslice.errors import ZipsliceError
from zipslice.progress import Bar

from theta import parallel
from theta.parallel import READ_AHEAD_BYTES
from theta.errors import BlobCorruptError, BlobMissingError, CheckpointError, ThetaError
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates import content_hash, reconstruct


# formats zipslice reads but does not write: a pre-1.6 torch file is checked out as a torch zip file
_WRITES_AS = {"torch-legacy": "torch"}


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
                      progress: bool = False, verify: str = "hash", name: str | None = None) -> None:
    """Write the checkpoint described by ``meta`` to ``out_path`` in its committed format (or ``fmt``).

    The file appears at ``out_path`` only once every group was rebuilt and verified (see ``VERIFY``);
    on any error nothing is left behind. ``name``: the file's real name when ``out_path`` is a temp file
    (messages, progress, and the record prefix torch.save derives from the name).
    """
    out_path = os.fspath(out_path)
    real_name = name
    name = name or Path(out_path).name
    check_blobs(meta, store, name)
    target = _target(meta, fmt)
    job = _Job(meta, store, name, target, progress, verify)
    options: dict = {}
    if target == "torch" and meta.structure is not None:
        options["structure"] = meta.structure
    if meta.metadata:
        options["metadata"] = dict(meta.metadata)
    # written beside out_path and renamed once every hash checked out (same directory: atomic rename)
    tmp = os.path.join(os.path.dirname(out_path) or ".", f".{name}.theta-{os.getpid()}.tmp")
    if target == "torch":
        options["record_prefix"] = torch_writer.default_prefix(real_name or out_path)  # as torch.save names it
    try:
        with _writer_errors(out_path, target):
            zipslice.save(tmp, [(s.name, s) for s in job.sources], format=target, **options)
            job.checker.finish()
            os.replace(tmp, out_path)
    finally:
        job.close()
        if os.path.exists(tmp):
            os.unlink(tmp)


def streams(meta: CheckpointMeta, fmt: str | None = None) -> bool:
    """True when :func:`smudge_to_stream` can write this checkpoint (its writer never seeks: torch)."""
    return _target(meta, fmt) == "torch"


def smudge_to_stream(meta: CheckpointMeta, store: LfsStore, out: BinaryIO, name: str, fmt: str | None = None,
                     progress: bool = False, verify: str = "hash") -> None:
    """Write the checkpoint to the stream ``out`` (e.g. git's pipe) while it is rebuilt: no temp file.

    Only for formats where :func:`streams` is True. Every group is still checked against its content hash
    (on another thread, while it is written), but bytes of a bad group may already be in ``out`` when the
    error is raised: the caller must discard the output (the filter answers git ``status=error``, and git
    then drops it). ``name`` names the file in errors and gives the torch record prefix.
    """
    check_blobs(meta, store, name)
    target = _target(meta, fmt)
    if target != "torch":
        raise ThetaError(f"{name}: {target} output cannot be streamed; use smudge_checkpoint")
    job = _Job(meta, store, name, target, progress, verify)
    try:
        with _writer_errors(name, target):
            torch_writer.write_to(out, job.sources, structure=meta.structure,
                                  metadata=dict(meta.metadata) if meta.metadata else None,
                                  record_prefix=torch_writer.default_prefix(name), path=name)
            job.checker.finish()
    finally:
        job.close()


@contextlib.contextmanager
def _writer_errors(name: str, target: str):
    """A writer's refusal as theta's errors: a bad checkpoint, or a value the format cannot hold."""
    try:
        yield
    except ZipsliceError as e:
        raise CheckpointError(f"cannot write {name}: {e}") from e
    except ValueError as e:
        raise ThetaError(f"cannot write {name} as {target}: {e}") from e


def _target(meta: CheckpointMeta, fmt: str | None) -> str:
    target = fmt or meta.format
    return _WRITES_AS.get(target, target)


class _Job:
    """The sources of one smudge: each read() rebuilds its group (the next one ahead on a thread) and hands
    it to the hash checker; the previous value is released before the next is decoded."""

    def __init__(self, meta: CheckpointMeta, store: LfsStore, name: str, target: str, progress: bool,
                 verify: str = "hash"):
        if verify not in VERIFY:
            raise ThetaError(f"unknown verification {verify!r}; expected one of {', '.join(VERIFY)}")
        self.bar = bar = Bar(f"theta smudge {name}", sum(_nbytes(g) for g in meta.groups.values()), progress)
        self.checker = checker = _HashChecker(name)
        sources = []
        for tname in meta.order:
            alias = meta.aliases.get(tname)
            g = meta.group_for(tname)
            owner = alias or g
            sources.append(TensorSource(name=tname, dtype=g.dtype, shape=tuple(g.shape), read=None,
                                        tie=("theta", g.name), is_parameter=owner.is_parameter,
                                        requires_grad=owner.requires_grad))
        self.rebuild = rebuild = _Rebuilder(meta, store, name, _expected_read_order(sources, target, meta),
                                            frames_ok=verify == "frames")
        handed: list[memoryview] = []

        def before_new() -> None:
            checker.finish()
            # The writer keeps its last buffer in a variable until its next read() returns; releasing the
            # view lets the previous value be freed before the next one is decoded (a writer that used the
            # buffer later would fail loudly on the released view, never write wrong bytes).
            while handed:
                view = handed.pop()
                try:
                    view.release()
                except BufferError:
                    pass  # the writer still holds a view of it: it is freed when the writer lets go

        def reader(group_name: str):
            def read():
                value, fresh = rebuild.get(group_name, before_new=before_new)
                if fresh:
                    if not rebuild.verified(group_name):
                        checker.submit(meta.groups[group_name], value)  # verified on another thread while written
                    bar.advance(value.nbytes)
                view = dtypes.le_bytes(value)
                handed.append(view)
                return view
            return read

        for src in sources:
            src.read = reader(meta.group_for(src.name).name)
        self.sources = sources

    def close(self) -> None:
        self.rebuild.close()
        self.checker.finish(raise_errors=False)
        self.bar.close()


def _expected_read_order(sources: list[TensorSource], target: str, meta: CheckpointMeta) -> list[str]:
    """Group names in the order the writer will most likely read them (a wrong guess only costs CPU)."""
    ordered = sources
    if target == "safetensors":
        from zipslice.safetensors_format import library_order  # that writer sorts like the library

        ordered = library_order(sources)
    return [meta.group_for(s.name).name for s in ordered]


class _Rebuilder:
    """Rebuilds groups for the writer, the next expected one on a background thread (one ahead).

    Holds at most the value just handed to the writer and the one being rebuilt ahead.
    """

    def __init__(self, meta: CheckpointMeta, store: LfsStore, file: str, order: list[str], frames_ok: bool = False):
        self.meta, self.store, self.file = meta, store, file
        self.frames_ok = frames_ok
        self._verified: set[str] = set()  # groups whose decode already proved every byte (no hash needed)
        self.next_of: dict[str, str] = {}
        for a, b in zip(order, order[1:]):
            if a != b:
                self.next_of.setdefault(a, b)
        self.last: tuple[str, np.ndarray] | None = None
        self.ahead: tuple[str, Future] | None = None

    def verified(self, group_name: str) -> bool:
        return group_name in self._verified

    def _rebuild(self, group_name: str) -> np.ndarray:
        group = self.meta.groups[group_name]
        if self.frames_ok and len(group.steps) == 1 and group.steps[0].type == "dense":
            value = _decode_dense(group, self.store, self.file)
            if value is not None:
                self._verified.add(group_name)
                return value
        return reconstruct(group, self.store, None, file=self.file, verify=False)

    def get(self, group_name: str, before_new=None) -> tuple[np.ndarray, bool]:
        """(value, fresh): fresh is False when the same group is read again (a tied alias)."""
        if self.last is not None and self.last[0] == group_name:
            return self.last[1], False
        self.last = None
        if before_new is not None:
            before_new()  # e.g. finish checking the previous value, so it can be freed first
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == group_name:
            value = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel() or ahead[1].exception()  # guessed wrong: drop it
            value = self._rebuild(group_name)
        nxt = self.next_of.get(group_name)
        if nxt is not None and _nbytes(self.meta.groups[nxt]) <= READ_AHEAD_BYTES:
            self.ahead = (nxt, parallel.pool("rebuild").submit(self._rebuild, nxt))
        self.last = (group_name, value)
        return value, True

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead[1].cancel() or self.ahead[1].exception()
        self.ahead = self.last = None


# How smudge verifies each rebuilt group:
#   "hash"   -- sha256 of the rebuilt value equals the group's content hash (always for chains, low-rank, ...);
#   "frames" -- a group stored as ONE dense step is trusted when every zstd frame of its blob carries a
#               content checksum (XXH64, checked by zstd while decoding: every decoded byte is the byte that
#               was encoded) and the decoded dtype and shape are the group's; the blob's size was checked
#               against its oid's. Other groups are still hashed. This does not detect a store object
#               replaced by another valid theta blob of the same size, nor metadata whose hash disagrees with
#               its own blob; `git theta`'s library calls default to "hash", the git filter to "frames".
VERIFY = ("hash", "frames")


def _decode_dense(group, store: LfsStore, file: str) -> np.ndarray | None:
    """The value of a single-dense-step group if its blob proves its own bytes, else None (hash it)."""
    from theta.storage import codec

    step = group.steps[0]
    with store.mapped(step.blob, group=group.name, file=file) as blob:
        if not codec.frames_checksummed(blob):
            return None
        parts = codec.decode_parts(blob)  # raises CodecError on a bad checksum or structure
    value = parts.get("values")
    want = dtypes.get(group.dtype).to_numpy()
    if set(parts) != {"values"} or value.dtype != want or tuple(value.shape) != tuple(group.shape):
        return None
    return value


def _nbytes(group) -> int:
    return group.numel * dtypes.get(group.dtype).itemsize


class _HashChecker:
    """Checks rebuilt values against their content hash on a background thread, one value in flight."""

    def __init__(self, file: str):
        self.file = file
        self.pending = None

    def submit(self, group, value: np.ndarray) -> None:
        self.finish()
        self.pending = (group, parallel.pool("hash").submit(content_hash, value))

    def finish(self, raise_errors: bool = True) -> None:
        if self.pending is None:
            return
        group, fut = self.pending
        self.pending = None
        digest = fut.result()
        if digest != group.hash and raise_errors:
            raise BlobCorruptError(f"{self.file}: group {group.name!r} rebuilt from blob "
                                   f"{group.steps[-1].blob.oid} does not match its content hash")
