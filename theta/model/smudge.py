"""Smudge: rebuild a checkpoint file from its metadata, one parameter group at a time.

Each tensor becomes a :class:`zipslice.TensorSource` whose ``read()`` reconstructs its group from the
store; ``zipslice.save`` writes them one at a time and publishes the file atomically. Tied aliases share the
source's tie key, so the torch writer stores them once and they load tied.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import BinaryIO

import numpy as np

import zipslice
from zipslice import TensorSource, crc, dtypes, sharded, torch_writer
from zipslice.errors import ZipsliceError
from zipslice.progress import Bar
from zipslice.safetensors_format import library_order
from zipslice.sharded import plan_shards

from theta.base import faults, parallel, scratch, valuehash
from theta.base.errors import BlobCorruptError, BlobMissingError, CheckpointError, IntegrityError, ThetaError, ViewError
from theta.base.parallel import READ_AHEAD_BYTES
from theta.model.views import view_of
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates import bounds, content_hash, stream
from theta.updates.rebuild import (bind_steps, bounds_located, chain_bound, chain_frames, chain_proven, is_split_chain,
                                   reconstruct, reconstruct_proven)

_COPY_CHUNK = 8 << 20

# How smudge verifies each rebuilt group:
#   "hash"   -- the hash of the rebuilt value equals the group's name, in its algorithm (theta.base.valuehash; always
#               for chains, low-rank, ...);
#   "frames" -- a group stored as ONE dense step or as a split keyframe chain (theta.updates.rebuild.chain_bound),
#               or a chain every step of which this store proves (theta.updates.rebuild.chain_proven), is
#               trusted when this store has proven that its blobs decode to the group's content hash
#               (LfsStore.bound: theta encoded that value itself, or hashed it at an earlier checkout), every zstd
#               frame of its blobs carries a content checksum (XXH64, checked by zstd while decoding: every
#               decoded byte is the byte that was encoded) and the decoded dtype and shape are the group's; the
#               blob's size was checked against its oid's. Other groups are hashed (and a single dense or split
#               one that checks out is bound for next time). So metadata whose hash disagrees with its blob (a
#               forged repository) is always caught at checkout; what is not detected is a local store object
#               replaced by another valid theta blob of the same size. `git theta`'s library calls default to
#               "hash", the git filter to "frames".
VERIFY = ("hash", "frames")


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


def check_rebuildable(meta: CheckpointMeta, file: str, fmt: str | None = None,
                      max_output: int = bounds.DEFAULT_MAX_OUTPUT) -> str:
    """Everything that can be refused from the metadata alone, before any blob is read or byte written:
    the output format is known and writable, the total output is within ``max_output``, every group's chain
    is well formed and bounded (:mod:`theta.updates.bounds`). Returns the output format."""
    target = view_of(meta, fmt, file).format
    if target == "sharded":  # what theta before the shard-index rule stored for a `*.index.json` under `*`
        raise CheckpointError(f"{file}: recorded as a whole sharded checkpoint, which is not one file; write it "
                              f"with `git theta export REV:{file} DIR/NAME.safetensors.index.json`, then commit "
                              f"the index JSON itself (theta now keeps it as plain text)")
    try:
        spec = zipslice.formats.get(target)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    if spec.writer is None:
        raise CheckpointError(f"{file}: format {target!r} cannot be written; choose another with the "
                              "theta-format attribute or theta.checkoutFormat")
    bounds.check_output(meta, file, max_output)
    for g in meta.groups.values():
        bounds.check_group(g, file)
    return target


def check_plugin_view(path: str, meta, fmt: str, file: str) -> None:
    """A plugin format's file holds every group under its name, dtype and shape, or it is no view: its clean
    would record other groups and `git status` would never be clean. theta knows what the built-in formats can
    hold (:func:`theta.model.views.format_problem`); a plugin's file is read back instead (its index only)."""
    want = [(n, meta.group_for(n).dtype, tuple(meta.group_for(n).shape)) for n in meta.order]
    with zipslice.load(path) as lsd:
        got = [(k, lsd.info(k).dtype, tuple(lsd.info(k).shape)) for k in lsd]
    if got != want:
        lost = next((w for w in want if w not in got), want[0] if want else None)
        raise ViewError(f"{file}: format {fmt!r} cannot hold this checkpoint as it is committed (group "
                        f"{lost[0]!r}, {lost[1]}{list(lost[2])}: the file it wrote holds "
                        f"{', '.join(repr(g[0]) for g in got[:3]) or 'no tensor'}); check it out in its committed "
                        f"format ({meta.format})")


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on ``directory``'s file system (its nearest existing
    ancestor), or None when the file system does not say."""
    d = Path(os.path.abspath(directory))
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def check_space(meta: CheckpointMeta, directory: str | os.PathLike, file: str) -> None:
    """Refuse, before any byte is produced, a checkout that cannot fit on ``directory``'s file system.

    git writes a smudged file under its real name as the bytes arrive and does not remove it when the disk
    fills up; refusing up front leaves nothing behind. The estimate is the tensor bytes plus 1/64 and 1 MiB
    for the container (headers, index, alignment)."""
    need = bounds.output_bytes(meta)
    need += need // 64 + (1 << 20)
    free = free_bytes(directory)
    if free is not None and need > free:
        raise CheckpointError(f"{file}: needs about {need} bytes but only {free} are free on "
                              f"{os.path.abspath(directory)}; nothing was written")


def smudge_checkpoint(meta: CheckpointMeta, store: LfsStore, out_path: str | os.PathLike, fmt: str | None = None,
                      progress: bool = False, verify: str = "hash",
                      max_output: int = bounds.DEFAULT_MAX_OUTPUT, name: str | None = None) -> None:
    """Write the checkpoint described by ``meta`` to ``out_path`` in its committed format, or as a view in
    ``fmt`` (see :mod:`theta.model.views`).

    The file appears at ``out_path`` only once every group was rebuilt and verified (see ``VERIFY``);
    on any error nothing is left behind. A file stored as one opaque blob is copied out bit for bit.
    ``name``: the file's real name when ``out_path`` is a temp file (messages, progress, and the record
    prefix torch.save derives from the name).
    """
    out_path = os.fspath(out_path)
    real_name = name
    name = name or Path(out_path).name
    if meta.is_opaque:
        check_blobs(meta, store, name)
        bounds.check_output(meta, name, max_output)
        with atomic_file(out_path) as f:
            copy_opaque(meta, store, f, name)
        return
    view = view_of(meta, fmt, name)
    check_rebuildable(meta, name, fmt, max_output)
    check_blobs(meta, store, name)
    target = view.format
    job = _Job(meta, store, name, target, progress, verify, stream_frames=True)  # a file: any writer may seek
    options: dict = {}
    if view.structure is not None:
        options["structure"] = view.structure
    if view.metadata:
        options["metadata"] = view.metadata
    # written beside out_path and renamed once every hash checked out (same directory: atomic rename)
    tmp = os.path.join(os.path.dirname(out_path) or ".", f".{name}.theta-{scratch.owner_tag()}.tmp")
    if target == "torch":
        options["record_prefix"] = torch_writer.default_prefix(real_name or out_path)  # as torch.save names it
    try:
        with _writer_errors(name, target, tmp):
            zipslice.save(tmp, [(s.name, s) for s in job.sources], format=target, **options)
            job.checker.finish()
            if target not in zipslice.formats.BUILTIN:
                check_plugin_view(tmp, meta, target, name)
            os.replace(tmp, out_path)
    finally:
        job.close()
        if os.path.exists(tmp):
            os.unlink(tmp)


def smudge_sharded(meta: CheckpointMeta, store: LfsStore, index_path: str | os.PathLike,
                   max_shard_bytes: int | None = None, progress: bool = False, verify: str = "hash",
                   max_output: int = bounds.DEFAULT_MAX_OUTPUT, name: str | None = None) -> list[str]:
    """Write the checkpoint described by ``meta`` as a sharded checkpoint: shards of at most
    ``max_shard_bytes`` (default: transformers' 5 GB) beside the index ``index_path``, laid out like
    :func:`zipslice.sharded.write` (``model.safetensors.index.json`` -> ``model-00001-of-00003.safetensors``
    ...; the shard format follows the index's name). Returns the shard paths.

    The shards are views of ``meta`` (:func:`theta.model.views.view_of`: the same refusals as a checkout in the
    shard format; flat names, the committed file metadata in each shard). Memory is bounded by the largest
    group, as for any checkout. Everything is written into a scratch directory beside the index first and
    moved into place -- shards, then the index -- only once every group was rebuilt and verified: on any
    error nothing is left at the destination. Shards of an earlier export with another shard count are left
    in place (the new index does not name them).
    """
    index_path = os.fspath(index_path)
    name = name or Path(index_path).name
    if meta.is_opaque:
        raise CheckpointError(f"{name}: the committed file is not a checkpoint (stored as opaque bytes); "
                              "it cannot be written as shards")
    try:
        shard_fmt = sharded.shard_format(index_path)
    except ValueError as e:
        raise ThetaError(str(e)) from None
    view = view_of(meta, shard_fmt, name)
    check_rebuildable(meta, name, shard_fmt, max_output)
    check_blobs(meta, store, name)
    out_dir = os.path.dirname(index_path) or "."
    max_shard_bytes = max_shard_bytes or sharded.DEFAULT_MAX_SHARD_BYTES
    tmp_dir = os.path.join(out_dir, f".{Path(index_path).name}.theta-{scratch.owner_tag()}.tmp")
    os.makedirs(tmp_dir)
    job = _Job(meta, store, name, shard_fmt, progress, verify, max_shard_bytes=max_shard_bytes, stream_frames=True)
    try:
        tmp_index = os.path.join(tmp_dir, Path(index_path).name)
        with _writer_errors(index_path, shard_fmt):
            sharded.write(tmp_index, job.sources, metadata=view.metadata or None,
                          max_shard_bytes=max_shard_bytes)
            job.checker.finish()
        shards = sorted(n for n in os.listdir(tmp_dir) if n != Path(index_path).name)
        for shard in shards:
            os.replace(os.path.join(tmp_dir, shard), os.path.join(out_dir, shard))
        os.replace(tmp_index, index_path)  # last: a reader never sees an index naming a missing shard
        return [os.path.join(out_dir, shard) for shard in shards]
    finally:
        job.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)


def streams(meta: CheckpointMeta, fmt: str | None = None, name: str = "") -> bool:
    """True when :func:`smudge_to_stream` can write this checkpoint (its writer never seeks: torch; or an
    opaque file). Raises ViewError (naming ``name``) when ``fmt`` cannot hold the checkpoint (theta.model.views)."""
    return meta.is_opaque or view_of(meta, fmt, name).format == "torch"


def copy_opaque(meta: CheckpointMeta, store: LfsStore, out: BinaryIO, name: str) -> None:
    """Write an opaque file's blob to ``out`` bit for bit, checking its sha256 on the way (BlobCorruptError
    at the end when it differs: the caller discards the output, as for a bad group)."""
    ref = meta.opaque
    h = hashlib.sha256()
    with store.mapped(ref, group=None, file=name) as view:
        for start in range(0, view.nbytes, _COPY_CHUNK):
            chunk = view[start:start + _COPY_CHUNK]
            h.update(chunk)
            out.write(chunk)
            chunk.release()
    if h.hexdigest() != ref.oid:
        raise BlobCorruptError(f"{name}: blob {ref.oid} does not match its sha256 (corrupt object)", file=name,
                               oid=ref.oid)


@contextlib.contextmanager
def atomic_file(path: str):
    """A file written beside ``path`` and renamed over it only when the block succeeds."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".{Path(path).name}.theta-{scratch.owner_tag()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def smudge_to_stream(meta: CheckpointMeta, store: LfsStore, out: BinaryIO, name: str, fmt: str | None = None,
                     progress: bool = False, verify: str = "hash",
                     max_output: int = bounds.DEFAULT_MAX_OUTPUT) -> None:
    """Write the checkpoint to the stream ``out`` (e.g. git's pipe) while it is rebuilt: no temp file.

    Only for formats where :func:`streams` is True. Every group is still checked against its content hash
    (on another thread, while it is written), but bytes of a bad group may already be in ``out`` when the
    error is raised: the caller must discard the output (the filter answers git ``status=error``, and git
    then drops it). ``name`` names the file in errors and gives the torch record prefix. A file stored as one
    opaque blob streams too (its sha256 is checked as it goes: a bad blob fails at its end).
    """
    if meta.is_opaque:
        check_blobs(meta, store, name)
        bounds.check_output(meta, name, max_output)
        copy_opaque(meta, store, out, name)
        return
    view = view_of(meta, fmt, name)
    check_rebuildable(meta, name, fmt, max_output)
    check_blobs(meta, store, name)
    target = view.format
    if target != "torch":
        raise ThetaError(f"{name}: {target} output cannot be streamed; use smudge_checkpoint")
    job = _Job(meta, store, name, target, progress, verify, stream_frames=torch_writer.seekable(out))
    try:
        with _writer_errors(name, target):
            torch_writer.write_to(out, job.sources, structure=view.structure, metadata=view.metadata or None,
                                  record_prefix=torch_writer.default_prefix(name), path=name)
            job.checker.finish()
    finally:
        job.close()


@contextlib.contextmanager
def _writer_errors(name: str, target: str, written: str | None = None):
    """A writer's refusal as theta's errors: a bad checkpoint, or a value the format cannot hold; the file it was
    writing (``written``: a temp file) is called ``name`` in the message."""
    try:
        yield
    except ZipsliceError as e:
        raise CheckpointError(f"cannot write {name}: {_renamed(e, written, name)}") from e
    except (ValueError, TypeError) as e:
        raise ThetaError(f"cannot write {name} as {target}: {_renamed(e, written, name)}") from e


def _renamed(e: Exception, written: str | None, name: str) -> str:
    text = str(e)
    return text.replace(written, name) if written else text


class _Job:
    """The sources of one smudge: each read() rebuilds its group (the next one ahead on a thread) and hands
    it to the hash checker; the previous value is released before the next is decoded."""

    def __init__(self, meta: CheckpointMeta, store: LfsStore, name: str, target: str, progress: bool,
                 verify: str = "hash", max_shard_bytes: int | None = None, stream_frames: bool = False):
        if verify not in VERIFY:
            raise ThetaError(f"unknown verification {verify!r}; expected one of {', '.join(VERIFY)}")
        self.bar = bar = Bar(f"theta smudge {name}", sum(_nbytes(g) for g in meta.groups.values()), progress)
        self.checker = checker = _HashChecker(name, store)
        sources = []
        for tname in meta.order:
            alias = meta.aliases.get(tname)
            g = meta.group_for(tname)
            owner = alias or g
            sources.append(TensorSource(name=tname, dtype=g.dtype, shape=tuple(g.shape), read=None,
                                        tie=("theta", g.name), is_parameter=owner.is_parameter,
                                        requires_grad=owner.requires_grad))
        order = _expected_read_order(sources, target, meta, max_shard_bytes)
        # stream_frames (the writer takes a tensor piece by piece: a torch file it can seek in, safetensors): no
        # group bigger than WHOLE_GROUP_BYTES is ever whole in memory. The groups stored as one dense step or a
        # split keyframe chain are handed over frame by frame as they are decoded, several frames ahead across
        # groups (_FrameStream: trusted when this store proves them, else hashed as they pass); the other big ones
        # block by block from their chain, hashed as they pass (theta.updates.stream); the small ones are rebuilt
        # whole, one ahead, and hashed on another thread
        streamed, blocked = set(), set()
        if stream_frames:
            for gname in dict.fromkeys(order):
                group = meta.groups[gname]
                if streams_by_frames(group):
                    streamed.add(gname)
                elif _nbytes(group) > WHOLE_GROUP_BYTES:
                    blocked.add(gname)
        self.rebuild = rebuild = _Rebuilder(meta, store, name, [g for g in order if g not in streamed | blocked],
                                            frames_ok=verify == "frames", with_crc=target == "torch")
        self.frames = frames = _FrameStream(meta, store, name, [g for g in dict.fromkeys(order) if g in streamed],
                                            trust=verify == "frames")
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
                faults.point("smudge:group")
                if fresh:
                    if not rebuild.verified(group_name):
                        checker.submit(meta.groups[group_name], value)  # verified on another thread while written
                    bar.advance(value.nbytes)
                view = dtypes.le_bytes(value)
                handed.append(view)
                return view
            return read

        def crc_of(group_name: str):
            def crc32():  # the torch writer's CRC of the bytes read() just gave, computed ahead on a thread
                return rebuild.crc_of(group_name)
            return crc32

        def chunker(group_name: str):
            def chunks():
                before_new()
                stream = frames.frames_of(group_name)
                faults.point("smudge:group")
                if stream is None and _nbytes(meta.groups[group_name]) > WHOLE_GROUP_BYTES:
                    # blobs not cut into frames as their chain says: block by block (hashed), never whole
                    yield from _blocks(meta.groups[group_name], store, name, bar, verify)
                    return
                if stream is None:  # rebuilt whole and hashed
                    value = rebuild.whole(group_name)
                    checker.submit(meta.groups[group_name], value)
                    bar.advance(value.nbytes)
                    yield dtypes.le_bytes(value)
                    return
                for frame in stream:
                    bar.advance(frame.nbytes)
                    yield frame
            return chunks

        def blocks_of(group_name: str):
            def chunks():
                before_new()
                yield from _blocks(meta.groups[group_name], store, name, bar, verify)
            return chunks

        for src in sources:
            group_name = meta.group_for(src.name).name
            src.read = reader(group_name)
            src.crc32 = crc_of(group_name)
            if group_name in streamed:
                src.chunks = chunker(group_name)
            elif group_name in blocked:
                src.chunks = blocks_of(group_name)
        self.sources = sources

    def close(self) -> None:
        self.frames.close()
        self.rebuild.close()
        self.checker.finish(raise_errors=False)
        self.bar.close()


# groups above this size are never rebuilt whole when the writer takes pieces: two of them (the one written and
# the one rebuilt ahead) and the frames in flight are a checkout's memory, whatever the model's tensors
WHOLE_GROUP_BYTES = parallel.READ_AHEAD_BYTES


def _blocks(group, store: LfsStore, file: str, bar: Bar, verify: str):
    """A group's little-endian bytes block by block (a codec frame's worth each) from its chain, checked
    against the group's hash at the end (ChainError: the caller discards the output) -- unless in "frames" mode
    the store proves every step (:func:`theta.updates.rebuild.chain_proven`: bound here, every frame
    checksummed, as a single dense step is trusted). A single dense step or a split keyframe chain that checks
    out is bound in the store, so a later checkout in "frames" mode trusts its frames."""
    src = stream.source(group, store, file)
    if src is None:  # a chain that cannot be read in order: rebuilt whole (reconstruct reports what is wrong)
        value = reconstruct(group, store, None, file=file)
        bar.advance(value.nbytes)
        yield dtypes.le_bytes(value)
        return
    src.checked = verify == "frames" and chain_proven(group, store)
    n = max(1, codec.FRAME_BYTES // dtypes.get(group.dtype).itemsize)
    # a split keyframe's high part is hashed on the way too (its own name): both its steps are then bound
    high = None
    if is_split_chain(group) and not src.checked and isinstance(src, stream.GroupSource):
        high = valuehash.like(group.steps[0].hash)

    def on_step(i: int, values: np.ndarray) -> None:
        if i == 0:
            high.update(dtypes.le_bytes(values))

    for _, block in src.chunks(n, on_step=None if high is None else on_step):
        bar.advance(block.nbytes)
        yield dtypes.le_bytes(block)
        del block
    if _single_dense(group) or (high is not None and high.hexdigest() == group.steps[0].hash):
        bind_steps(group.steps, store)


def _expected_read_order(sources: list[TensorSource], target: str, meta: CheckpointMeta,
                         max_shard_bytes: int | None = None) -> list[str]:
    """Group names in the order the writer will most likely read them (a wrong guess only costs CPU);
    ``max_shard_bytes``: written as shards of ``target`` (zipslice.sharded.write's plan)."""
    parts = [sources]
    if max_shard_bytes is not None:
        parts = plan_shards(sources, max_shard_bytes)
    ordered = [s for part in parts for s in (library_order(part) if target == "safetensors" else part)]
    return [meta.group_for(s.name).name for s in ordered]


class _Rebuilder:
    """Rebuilds groups for the writer, the next expected one on a background thread (one ahead).

    Holds at most the value just handed to the writer and the one being rebuilt ahead. ``with_crc``: the
    group rebuilt ahead also gets the CRC-32 of its little-endian bytes on that thread (the torch zip needs
    it before the bytes are written: computed there, it overlaps with the writing of the group before).
    """

    def __init__(self, meta: CheckpointMeta, store: LfsStore, file: str, order: list[str], frames_ok: bool = False,
                 with_crc: bool = False):
        self.meta, self.store, self.file = meta, store, file
        self.frames_ok = frames_ok
        self.with_crc = with_crc
        self.last_crc: int | None = None  # CRC-32 of self.last's bytes, when computed ahead
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
        if self.frames_ok and (len(group.steps) > 1 or chain_bound(group, self.store)):
            # a value this store proves (bound here, frames checksummed: one dense step, a split keyframe, any
            # chain of bound steps) needs no hash, as a big one streamed
            value, proven = reconstruct_proven(group, self.store, self.file)
            if proven:
                self._verified.add(group_name)
            return value
        return reconstruct(group, self.store, None, file=self.file, verify=False)

    def whole(self, group_name: str) -> np.ndarray:
        """``group_name`` rebuilt now, outside the read-ahead (a streamed group whose blob did not prove
        itself); the caller hashes it."""
        return reconstruct(self.meta.groups[group_name], self.store, None, file=self.file, verify=False)

    def _rebuild_ahead(self, group_name: str) -> tuple[np.ndarray, int | None]:
        value = self._rebuild(group_name)
        return value, (crc.crc32(dtypes.le_bytes(value)) if self.with_crc else None)

    def crc_of(self, group_name: str) -> int | None:
        """The CRC-32 of the bytes of ``group_name`` if it is the value just handed out and it was computed
        ahead; else None (the writer computes it)."""
        if self.last is not None and self.last[0] == group_name:
            return self.last_crc
        return None

    def get(self, group_name: str, before_new=None) -> tuple[np.ndarray, bool]:
        """(value, fresh): fresh is False when the same group is read again (a tied alias)."""
        if self.last is not None and self.last[0] == group_name:
            return self.last[1], False
        self.last, self.last_crc = None, None
        if before_new is not None:
            before_new()  # e.g. finish checking the previous value, so it can be freed first
        ahead, self.ahead = self.ahead, None
        crc = None
        if ahead is not None and ahead[0] == group_name:
            value, crc = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel() or ahead[1].exception()  # guessed wrong: drop it
            value = self._rebuild(group_name)
        nxt = self.next_of.get(group_name)
        if nxt is not None and _nbytes(self.meta.groups[nxt]) <= READ_AHEAD_BYTES:
            self.ahead = (nxt, parallel.pool("rebuild").submit(self._rebuild_ahead, nxt))
        self.last, self.last_crc = (group_name, value), crc
        return value, True

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead[1].cancel() or self.ahead[1].exception()
        self.ahead = self.last = None
        self.last_crc = None


# items decoded ahead by the frame stream (frames, and one header per group): the codec's default of 2 frames
# per codec thread, plus a group's header -- at most ~5 x codec.FRAME_BYTES in flight, whatever the group size
_FRAMES_AHEAD = 2 * parallel.CODEC_THREADS + 1
# frames handed to the writer and still being hashed (on the hash thread) before their buffers are reused
_HASHING_BEHIND = 2


def streams_by_frames(group) -> bool:
    """Whether a checkout can stream ``group``'s value frame by frame from its blobs (:class:`_FrameStream`): one
    dense step, or a split keyframe chain -- from the metadata alone; the blobs decide when they are opened."""
    return _single_dense(group) or is_split_chain(group)


class _FrameStream:
    """The frames of the groups whose chains decode frame by frame (one dense step, or a split keyframe chain:
    :func:`theta.updates.rebuild.chain_frames`), in the order the writer is expected to ask for them, decoded on
    the codec threads a few frames ahead -- across group boundaries, so the writer never waits for a group's
    first frame, and never holds a whole group.

    A group the store proves (its blobs bound here, every zstd frame checksummed) is trusted in "frames" mode
    (``trust``). Any other -- every group of a fresh clone, of a version just pulled -- is hashed as its frames
    pass, on the hash thread, a frame or two behind the writer (a split chain's first step too, from a copy of
    its frame taken before the codes are applied), and checked at its last frame (BlobCorruptError: the caller
    discards the output); a group that checks out is bound, so the next checkout trusts it.

    ``frames_of(group)`` hands out one group's frames (uint8 arrays of its little-endian bytes, in order), or
    None when its blobs are not cut into frames that way after all (then it is rebuilt another way). Asked out
    of the expected order, the stream starts again from that group."""

    def __init__(self, meta: CheckpointMeta, store: LfsStore, file: str, names: list[str], trust: bool = True):
        self.meta, self.store, self.file = meta, store, file
        self.names = names
        self.trust = trust
        self.pos = {n: i for i, n in enumerate(names)}
        self._results = None   # codec.ordered over _items(): headers and decoded frames, in order
        self._items_gen = None
        self._next: str | None = None  # the group whose header comes next from _results
        self._maps: dict[str, contextlib.ExitStack] = {}  # blobs mapped for the frames in flight
        self._in_group = False  # a group's frames were handed out and not all taken
        self._spare: list[np.ndarray] = []  # frame buffers the writer is done with, decoded into again

    def _items(self, start: int):
        for name in self.names[start:]:
            stack = contextlib.ExitStack()
            frames = stack.enter_context(chain_frames(self.meta.groups[name], self.store, self.file,
                                                      proven_only=False))
            if frames is None:
                stack.close()
                yield name, None
                continue
            self._maps[name] = stack  # closed once its last frame is taken (or by close())
            yield name, frames
            high = frames.split and not self._trusted(frames)  # its first step's value is hashed too
            for job in frames.plan.jobs:
                yield frames, job, high

    def _trusted(self, frames) -> bool:
        return self.trust and frames.proven

    def _buffer(self) -> np.ndarray:
        try:
            return self._spare.pop()  # list.pop is atomic: codec threads share the list
        except IndexError:
            return np.empty(codec.FRAME_BYTES, dtype=np.uint8)

    def _decode(self, item):
        if len(item) == 2:  # a group's header
            return item
        frames, job, high = item
        buffers = [self._buffer()] + ([self._buffer()] if high else [])
        frame = frames.decode(job, buffers[0], high=buffers[1] if high else None)
        return frame, buffers, buffers[1][:frame.nbytes] if high else None

    def frames_of(self, name: str):
        if self._results is None or self._next != name or self._in_group:
            self._restart(name)
        header = next(self._results)
        if len(header) != 2 or header[0] != name:  # out of step (never expected): start again from this group
            self._restart(name)
            header = next(self._results)
        i = self.pos[name] + 1
        self._next = self.names[i] if i < len(self.names) else None
        if header[1] is None:
            return None
        return self._frames(name, header[1])

    def _restart(self, name: str) -> None:
        self.close()
        self._items_gen = self._items(self.pos[name])
        self._results = codec.ordered(self._decode, self._items_gen, _FRAMES_AHEAD)

    def _frames(self, name: str, frames):
        group = self.meta.groups[name]
        hashed = not self._trusted(frames)
        value = valuehash.like(group.hash) if hashed else None
        first = valuehash.like(group.steps[0].hash) if hashed and frames.split else None
        hashing: collections.deque = collections.deque()  # (hash future, buffers) behind the writer
        self._in_group = True
        try:
            for _ in frames.plan.jobs:
                frame, buffers, high = next(self._results)
                if hashed:
                    hashing.append((parallel.pool("hash").submit(_hash_frame, value, frame, first, high), buffers))
                yield frame
                del frame, high
                if not hashed:
                    self._spare.extend(buffers)  # the writer asked for the next piece: it is done with this one
                while len(hashing) > _HASHING_BEHIND:
                    self._reuse(hashing.popleft())
            while hashing:
                self._reuse(hashing.popleft())
        except IntegrityError as e:  # a frame failed its checksum or its declared size
            raise bounds_located(e, self.file, name, group.steps[0].blob.oid) from None
        finally:
            for fut, _ in hashing:  # (left by an error: their buffers are not reused)
                fut.cancel() or fut.exception()
        self._in_group = False
        stack = self._maps.pop(name, None)  # every frame decoded and taken: the blob can go
        if stack is not None:
            stack.close()
        if hashed:
            if value.hexdigest() != group.hash:
                raise _hash_mismatch(self.file, group)
            if first is None or first.hexdigest() == group.steps[0].hash:
                # the next checkout in "frames" mode trusts its frames; on the hash thread, off the writer's way
                parallel.pool("hash").submit(bind_steps, group.steps, self.store)

    def _reuse(self, hashed: tuple) -> None:
        fut, buffers = hashed
        fut.result()
        self._spare.extend(buffers)

    def close(self) -> None:
        """Stop the stream: frames in flight finish (codec.ordered waits for them), then the blobs are unmapped."""
        if self._results is not None:
            self._results.close()
        if self._items_gen is not None:
            self._items_gen.close()
        self._results = self._items_gen = self._next = None
        self._in_group = False
        for stack in self._maps.values():
            stack.close()
        self._maps.clear()


def _hash_frame(value, frame: np.ndarray, first, high: np.ndarray | None) -> None:
    """One frame into a group's value hash (and its first step's, from ``high``): on the hash thread, in order."""
    value.update(frame)
    if first is not None:
        first.update(high)


def _hash_mismatch(file: str, group) -> BlobCorruptError:
    """The error of a rebuilt value whose hash is not its group's name, naming the file, the group and the blob
    of its last step."""
    oid = group.steps[-1].blob.oid
    return BlobCorruptError(f"{file}: group {group.name!r} rebuilt from blob {oid} does not match its content hash "
                            f"{group.hash}", file=file, group=group.name, oid=oid)


def _single_dense(group) -> bool:
    return len(group.steps) == 1 and group.steps[0].type == "dense"


def _nbytes(group) -> int:
    return group.numel * dtypes.get(group.dtype).itemsize


class _HashChecker:
    """Checks rebuilt values against their content hash on a background thread, one value in flight.

    A single dense group that checks out is bound in the store (LfsStore.bind) so that a later checkout in
    "frames" mode may trust its frame checksums."""

    def __init__(self, file: str, store: LfsStore | None = None):
        self.file = file
        self.store = store
        self.pending = None

    def submit(self, group, value: np.ndarray) -> None:
        self.finish()
        self.pending = (group, parallel.pool("hash").submit(content_hash, value, group.hash))

    def finish(self, raise_errors: bool = True) -> None:
        if self.pending is None:
            return
        group, fut = self.pending
        self.pending = None
        digest = fut.result()
        if digest == group.hash:
            if self.store is not None and (_single_dense(group) or is_split_chain(group)):
                # the chain's value checks out (and the value before its last step did, when it was rebuilt):
                # a checkout in "frames" mode may trust its frames next time (chain_frames)
                bind_steps(group.steps, self.store)
        elif raise_errors:
            raise _hash_mismatch(self.file, group)
