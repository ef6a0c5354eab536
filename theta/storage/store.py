"""Blobs in Git LFS's own local object store, addressed by the sha256 of their bytes.

Layout (the one git-lfs uses, so `git lfs push/fetch/fsck` see our objects):
``<git-common-dir>/lfs/objects/<oid[0:2]>/<oid[2:4]>/<oid>``. ``lfs.storage`` in git config moves the
``lfs`` directory, as it does for git-lfs. Objects are written to a temp file beside their final path and
renamed, so a reader never sees half an object; writing an object that exists is a no-op (dedup).
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from theta import faults, parallel
from theta.errors import BlobCorruptError, BlobMissingError, GitError, StoreError
from theta.git import repo as gitutil

_CHUNK = 8 << 20
EMPTY_OID = hashlib.sha256(b"").hexdigest()
_OID = re.compile(r"[0-9a-f]{64}")
MAX_BLOB_SIZE = (1 << 63) - 1


def valid_oid(oid: object) -> bool:
    """True for 64 lowercase hex digits: the only oids that can name a path inside the store."""
    return isinstance(oid, str) and _OID.fullmatch(oid) is not None


@dataclass(frozen=True)
class BlobRef:
    """A stored blob: sha256 hex of its bytes and its size in bytes.

    Both are checked on construction (defence in depth: metadata is checked by theta.storage.schema first),
    so no BlobRef can name a path outside the store.
    """

    oid: str
    size: int

    def __post_init__(self) -> None:
        if not valid_oid(self.oid):
            raise StoreError(f"invalid blob oid {self.oid!r:.80}: expected 64 lowercase hex digits")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 0 <= self.size <= MAX_BLOB_SIZE:
            raise StoreError(f"invalid size {self.size!r:.40} for blob {self.oid}")


def _corrupt(problem: str, ref: BlobRef, p: Path, group: str | None, file: str | None) -> BlobCorruptError:
    where = "".join([f"{file}: " if file else "", f"group {group!r}: " if group else ""])
    return BlobCorruptError(f"{where}blob {ref.oid} at {p} {problem}", file=file, group=group, oid=ref.oid)


def sha256_of(chunks: Iterable["bytes | memoryview"]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


class LfsStore:
    """Content-addressed blobs in a git-lfs objects directory."""

    def __init__(self, objects_dir: str | os.PathLike, verify: bool = False):
        self.objects_dir = Path(objects_dir)
        # get() always checks the size; verify=True also checks the sha256. Off by default because every
        # reader checks more: zstd frame checksums while decoding, and reconstruct() compares the rebuilt
        # value with the group's content hash.
        self.verify = verify
        self.written_objects = 0  # objects this instance actually wrote (not deduplicated)
        self.written_bytes = 0

    @classmethod
    def for_repo(cls, cwd: str | os.PathLike = ".") -> "LfsStore":
        try:
            common = gitutil.common_dir(cwd)
        except (GitError, OSError):
            raise StoreError(f"{os.fspath(cwd)} is not inside a git repository; theta stores blobs in its LFS store") from None
        storage = gitutil.config_get("lfs.storage", cwd)
        if storage:
            lfs_dir = Path(storage) if os.path.isabs(storage) else Path(common) / storage
        else:
            lfs_dir = Path(common) / "lfs"
        return cls(lfs_dir / "objects")

    def __repr__(self) -> str:
        return f"LfsStore({str(self.objects_dir)!r})"

    def path(self, ref: "BlobRef | str") -> Path:
        oid = ref if isinstance(ref, str) else ref.oid
        if not valid_oid(oid):  # never a path outside the store, whatever the caller passes
            raise StoreError(f"invalid blob oid {oid!r:.80}: expected 64 lowercase hex digits")
        return self.objects_dir / oid[0:2] / oid[2:4] / oid

    def has(self, ref: BlobRef) -> bool:
        if ref.size == 0 and ref.oid == EMPTY_OID:
            return True  # the empty blob needs no file (git-lfs neither uploads nor downloads it)
        try:
            return self.path(ref).stat().st_size == ref.size
        except FileNotFoundError:
            return False

    def put(self, data: "bytes | bytearray | memoryview") -> BlobRef:
        return self.put_chunks([data])

    def put_chunks(self, chunks: "list[bytes | bytearray | memoryview]") -> BlobRef:
        """Store the concatenation of ``chunks`` (avoids joining a large blob in memory first).

        Like git-lfs, the bytes go to a temp file under ``lfs/tmp`` while a second thread hashes them
        (hashlib and file writes release the GIL); the temp file is then linked under its oid path, or
        dropped when that object already exists. The temp file has no name (O_TMPFILE) until it is
        complete, so a process killed midway leaves nothing behind (see :mod:`theta.scratch`).
        """
        size = sum(memoryview(c).nbytes for c in chunks)
        hashing = parallel.pool("hash").submit(sha256_of, chunks)
        try:
            return self._write(lambda f: [f.write(c) for c in chunks], lambda: BlobRef(hashing.result(), size))
        finally:
            hashing.cancel() or hashing.exception()  # never leave the hasher reading freed buffers

    def put_stream(self, chunks: "Iterable[bytes | bytearray | memoryview]") -> BlobRef:
        """Store the concatenation of ``chunks`` as they are produced (e.g. by codec.iter_encode_parts):
        each is hashed and written, then dropped, so the whole blob is never in memory."""
        h = hashlib.sha256()
        size = 0

        def write(f) -> None:
            nonlocal size
            for c in chunks:
                h.update(c)  # releases the GIL: the codec threads keep compressing meanwhile
                f.write(c)
                size += memoryview(c).nbytes

        return self._write(write, lambda: BlobRef(h.hexdigest(), size))

    def _write(self, fill, ref_of) -> BlobRef:
        """Write a temp file with ``fill(f)``, then publish it under the oid ``ref_of()`` names."""
        from theta import scratch

        tmp_dir = self.objects_dir.parent / "tmp"
        fd = name = None
        try:
            tmp_dir.mkdir(parents=True, exist_ok=True)
            scratch.sweep(tmp_dir)  # named temp files of killed theta processes (file systems without O_TMPFILE)
            fd, name = scratch.anonymous(tmp_dir)
            with os.fdopen(fd, "wb", closefd=False) as f:
                fill(f)
            faults.point("store:written")
            ref = ref_of()
            if not self.has(ref):
                dest = self.path(ref)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.fchmod(fd, 0o644)
                if scratch.publish(fd, name, dest, replace=dest.exists()):
                    name = None  # now the object itself
                    self.written_objects += 1
                    self.written_bytes += ref.size
                    faults.point("store:published")
            return ref
        except OSError as e:
            raise StoreError(f"cannot write a blob to {self.objects_dir}: {e}") from e
        finally:
            scratch.discard(fd, name)

    def get(self, ref: BlobRef, group: str | None = None, file: str | None = None) -> bytes:
        if ref.size == 0 and ref.oid == EMPTY_OID:
            return b""
        p = self.path(ref)
        try:
            with open(p, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise BlobMissingError(ref.oid, group=group, file=file, size=ref.size) from None
        except OSError as e:
            raise StoreError(f"cannot read blob {ref.oid} at {p}: {e}") from e
        if len(data) != ref.size:
            raise _corrupt(f"has {len(data)} bytes, expected {ref.size}", ref, p, group, file)
        if self.verify and hashlib.sha256(data).hexdigest() != ref.oid:
            raise _corrupt("does not match its sha256 (corrupt object)", ref, p, group, file)
        return data

    @contextlib.contextmanager
    def mapped(self, ref: BlobRef, group: str | None = None, file: str | None = None) -> Iterator[memoryview]:
        """The blob's bytes as a read-only memory map (no copy); same checks as :meth:`get`.

        Nothing derived from the view may outlive the ``with`` block (decoders copy what they keep).
        """
        if ref.size == 0 and ref.oid == EMPTY_OID:
            yield memoryview(b"")
            return
        p = self.path(ref)
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            raise BlobMissingError(ref.oid, group=group, file=file, size=ref.size) from None
        except OSError as e:
            raise StoreError(f"cannot read blob {ref.oid} at {p}: {e}") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != ref.size:
                raise _corrupt(f"has {size} bytes, expected {ref.size}", ref, p, group, file)
            if size == 0:
                yield memoryview(b"")
                return
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(m)
            try:
                if self.verify and hashlib.sha256(view).hexdigest() != ref.oid:
                    raise _corrupt("does not match its sha256 (corrupt object)", ref, p, group, file)
                yield view
            finally:
                try:
                    view.release()
                    m.close()
                except BufferError:
                    pass  # a traceback still holds a slice (error path): the map closes when it is collected

    # -- bindings: "blob OID decodes to the value whose content hash is HASH", as proven on this machine ----
    # Written when theta itself encoded the value (clean, merge) or hashed what the blob decodes to (a
    # checkout in "hash" mode). A checkout in "frames" mode trusts a blob's frame checksums only for a
    # binding found here, so metadata whose hash disagrees with its blob is always caught at checkout.
    # One empty file per binding, beside the objects (a binding is a fact about an object's content).
    def _binding(self, oid: str, value_hash: str) -> Path:
        if not (valid_oid(oid) and valid_oid(value_hash)):
            raise StoreError(f"invalid binding {oid!r:.80} -> {value_hash!r:.80}")
        return self.objects_dir.parent / "theta-verified" / oid[0:2] / f"{oid}-{value_hash}"

    def bound(self, oid: str, value_hash: str) -> bool:
        """True when this store has proven that blob ``oid`` decodes to a value of content hash ``value_hash``."""
        return self._binding(oid, value_hash).exists()

    def bind(self, oid: str, value_hash: str) -> None:
        """Record that blob ``oid`` decodes to the value of content hash ``value_hash`` (best effort)."""
        p = self._binding(oid, value_hash)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError:
            pass  # a read-only store: checkouts keep hashing, nothing is wrong

    def missing(self, refs: Iterable[BlobRef]) -> list[BlobRef]:
        """The refs not present locally, each once, in first-seen order."""
        seen: set[BlobRef] = set()
        out = []
        for r in refs:
            if r not in seen:
                seen.add(r)
                if not self.has(r):
                    out.append(r)
        return out
