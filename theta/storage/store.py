"""Blobs in Git LFS's own local object store, addressed by the sha256 of their bytes.

Layout (the one git-lfs uses, so `git lfs push/fetch/fsck` see our objects):
``<git-common-dir>/lfs/objects/<oid[0:2]>/<oid[2:4]>/<oid>``. ``lfs.storage`` in git config moves the
``lfs`` directory, as it does for git-lfs. Objects are written to a temp file beside their final path and
renamed, so a reader never sees half an object; writing an object that exists is a no-op (dedup).

**Protection from `git lfs prune`.** git-lfs finds the objects a repository needs by scanning git for LFS
pointer files; theta's metadata is not a pointer, so `git lfs prune` counts every theta blob as unreferenced
and deletes it (git-lfs 3.3 even with ``--verify-remote``: it only verifies objects some pointer reaches).
A repository's store (:meth:`LfsStore.for_repo`) therefore keeps a second name for each blob, a hard link
``<lfs>/theta-objects/<oid[0:2]>/<oid[2:4]>/<oid>`` (same inode: no extra disk). git-lfs walks and deletes
only under ``<lfs>/objects``, so a prune removes git-lfs's name and the bytes stay; the next lookup puts the
name back (git-lfs needs it to push). Only `git theta prune` (:mod:`theta.storage.prune`) removes both names.
Where hard links are impossible (a file system without them) the second name is a copy.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from zipslice.fileio import WriteBehindFile

from theta.base import faults, parallel, scratch, valuehash
from theta.base.errors import BlobCorruptError, BlobMissingError, GitError, StoreError
from theta.git import repo as gitutil

_CHUNK = 8 << 20
KEEP_DIR = "theta-objects"          # <lfs>/theta-objects: theta's own name for each blob (see the docstring)
QUARANTINE_DIR = "theta-quarantine"  # <lfs>/theta-quarantine: corrupt objects moved aside by fsck --repair
# link() errors meaning "this file system cannot hard-link here": fall back to a copy
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}
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


def sha256_file(path: "str | os.PathLike") -> str:
    """sha256 hex of a file's bytes, read in chunks (never whole in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class LfsStore:
    """Content-addressed blobs in a git-lfs objects directory."""

    def __init__(self, objects_dir: str | os.PathLike, verify: bool = False,
                 keep_dir: str | os.PathLike | None = None):
        self.objects_dir = Path(objects_dir)
        # theta's second name for every blob, out of `git lfs prune`'s reach (None: no protection, e.g. a
        # scratch store in a test or a benchmark)
        self.keep_dir = Path(keep_dir) if keep_dir is not None else None
        self._copy_warned = False
        # get() always checks the size; verify=True also checks the sha256. Off by default because every
        # reader checks more: zstd frame checksums while decoding, and reconstruct() compares the rebuilt
        # value with the group's content hash.
        self.verify = verify
        self.written_objects = 0  # objects this instance actually wrote (not deduplicated)
        self.written_bytes = 0

    @classmethod
    def for_repo(cls, cwd: str | os.PathLike = ".") -> "LfsStore":
        """The store of the repository containing ``cwd`` (``lfs.storage`` honoured); StoreError outside one."""
        try:
            common = gitutil.common_dir(cwd)
        except (GitError, OSError):
            raise StoreError(f"{os.fspath(cwd)} is not inside a git repository; theta stores blobs in its LFS store") from None
        storage = gitutil.config_get("lfs.storage", cwd)
        if storage:
            lfs_dir = Path(storage) if os.path.isabs(storage) else Path(common) / storage
        else:
            lfs_dir = Path(common) / "lfs"
        return cls(lfs_dir / "objects", keep_dir=lfs_dir / KEEP_DIR)

    def __repr__(self) -> str:
        return f"LfsStore({str(self.objects_dir)!r})"

    def path(self, ref: "BlobRef | str") -> Path:
        """Where the object ``ref`` (a BlobRef or an oid) lives: ``objects/<oid[0:2]>/<oid[2:4]>/<oid>``."""
        oid = ref if isinstance(ref, str) else ref.oid
        if not valid_oid(oid):  # never a path outside the store, whatever the caller passes
            raise StoreError(f"invalid blob oid {oid!r:.80}: expected 64 lowercase hex digits")
        return self.objects_dir / oid[0:2] / oid[2:4] / oid

    def keep_path(self, ref: "BlobRef | str") -> Path | None:
        """theta's protected name for the blob (None when this store keeps none)."""
        if self.keep_dir is None:
            return None
        oid = ref if isinstance(ref, str) else ref.oid
        return self.keep_dir / oid[0:2] / oid[2:4] / oid

    def has(self, ref: BlobRef) -> bool:
        """True when the blob is stored with its size. Also repairs its two names: a blob only git-lfs's
        name holds (written by git-lfs, or by a theta without protection) gets theta's; a blob `git lfs
        prune` unlinked gets git-lfs's name back, so `git lfs push` finds it."""
        if ref.size == 0 and ref.oid == EMPTY_OID:
            return True  # the empty blob needs no file (git-lfs neither uploads nor downloads it)
        st = _stat(self.path(ref))
        if st is not None and st.st_size == ref.size:
            if self.keep_dir is not None:
                kst = _stat(self.keep_path(ref))
                if kst is None or kst.st_size != ref.size:
                    self._link(self.path(ref), self.keep_path(ref))
            return True
        if self.keep_dir is not None:
            kst = _stat(self.keep_path(ref))
            if kst is not None and kst.st_size == ref.size:
                self._link(self.keep_path(ref), self.path(ref))
                return True
        return False

    def _link(self, src: Path, dest: Path) -> bool:
        """Give ``src``'s file the name ``dest`` (atomically, replacing a stale one); a copy where this
        file system cannot hard-link. False (and nothing changed) when the directory is not writable."""
        tmp = dest.with_name(f".{dest.name}.theta-link-{os.getpid()}-{threading.get_ident()}")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            try:
                os.link(src, tmp)
            except OSError as e:
                if e.errno not in _NO_LINK:
                    raise
                if not self._copy_warned:
                    self._copy_warned = True
                    print(f"git-theta: warning: cannot hard-link in {dest.parent.parent.parent} ({e.strerror}); "
                          "keeping a second copy of each blob to protect it from `git lfs prune`", file=sys.stderr)
                shutil.copyfile(src, tmp)
                os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
            return True
        except FileNotFoundError:
            return False  # src went away meanwhile (a concurrent prune): nothing to link
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if e.errno in (errno.EACCES, errno.EROFS):
                return False  # a read-only store: readable, but we cannot add names to it
            raise StoreError(f"cannot link blob {dest.name} into {dest.parent}: {e}") from e

    def remove(self, ref: "BlobRef | str") -> int:
        """Delete both names of a blob; the bytes this freed on disk (0 when it was not stored)."""
        freed = 0
        for p in (self.path(ref), self.keep_path(ref)):
            st = _stat(p) if p is not None else None
            if st is None:
                continue
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StoreError(f"cannot delete {p}: {e}") from e
            if st.st_nlink == 1:
                freed += st.st_size  # that was the inode's last name: its blocks are free
        return freed

    def is_duplicated(self, ref: BlobRef) -> bool:
        """True when the blob's two names are two separate files (copied by a tool that does not keep hard
        links, such as ``cp -r`` or ``rsync`` without ``-H``, or re-downloaded by git-lfs): twice the disk."""
        if self.keep_dir is None:
            return False
        a, b = _stat(self.path(ref)), _stat(self.keep_path(ref))
        return a is not None and b is not None and (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)

    def relink(self, ref: BlobRef) -> int:
        """Make a duplicated blob's two names one file again, when both copies hash to its oid (otherwise
        nothing changes: fsck reports the bad one). Returns the bytes freed."""
        if not self.is_duplicated(ref):
            return 0
        keep, lfs = self.keep_path(ref), self.path(ref)
        try:
            if sha256_file(keep) != ref.oid or sha256_file(lfs) != ref.oid:
                return 0
        except OSError:
            return 0
        size = os.stat(lfs).st_size
        return size if self._link(keep, lfs) and not self.is_duplicated(ref) else 0

    def quarantine(self, ref: BlobRef) -> Path | None:
        """Move a (corrupt) blob out of both names into ``<lfs>/theta-quarantine/<oid>``, so a fetch can
        store a good copy; the quarantined path, or None when the blob was not stored."""
        qdir = self.objects_dir.parent / QUARANTINE_DIR
        names = [p for p in (self.path(ref), self.keep_path(ref)) if p is not None and _stat(p) is not None]
        if not names:
            return None
        qdir.mkdir(parents=True, exist_ok=True)
        dest = qdir / ref.oid
        n = 1
        while dest.exists():
            dest, n = qdir / f"{ref.oid}.{n}", n + 1
        try:
            os.replace(names[0], dest)
            for p in names[1:]:
                os.unlink(p)
        except OSError as e:
            raise StoreError(f"cannot move blob {ref.oid} aside into {qdir}: {e}") from e
        return dest

    def kept(self) -> Iterator[BlobRef]:
        """Every blob theta keeps under its protected name (sizes as stored), in no particular order."""
        if self.keep_dir is None or not self.keep_dir.is_dir():
            return
        for d1 in sorted(os.scandir(self.keep_dir), key=lambda e: e.name):
            if not d1.is_dir(follow_symlinks=False) or len(d1.name) != 2:
                continue
            for d2 in os.scandir(d1.path):
                if not d2.is_dir(follow_symlinks=False) or len(d2.name) != 2:
                    continue
                for f in os.scandir(d2.path):
                    if _is_oid(f.name) and f.is_file(follow_symlinks=False):
                        yield BlobRef(f.name, f.stat(follow_symlinks=False).st_size)

    def _open(self, ref: BlobRef):
        """Open the blob by git-lfs's name, else theta's (restoring git-lfs's name)."""
        try:
            return open(self.path(ref), "rb")
        except FileNotFoundError:
            keep = self.keep_path(ref)
            if keep is None:
                raise
            f = open(keep, "rb")
            with contextlib.suppress(StoreError):
                self._link(keep, self.path(ref))
            return f

    def put(self, data: "bytes | bytearray | memoryview") -> BlobRef:
        """Store ``data`` once (an existing object is never rewritten) and return its reference."""
        return self.put_chunks([data])

    def put_chunks(self, chunks: "list[bytes | bytearray | memoryview]") -> BlobRef:
        """Store the concatenation of ``chunks`` (avoids joining a large blob in memory first).

        Like git-lfs, the bytes go to a temp file under ``lfs/tmp`` while a second thread hashes them
        (hashlib and file writes release the GIL); the temp file is then linked under its oid path, or
        dropped when that object already exists. The temp file has no name (O_TMPFILE) until it is
        complete, so a process killed midway leaves nothing behind (see :mod:`theta.base.scratch`).
        """
        size = sum(memoryview(c).nbytes for c in chunks)
        hashing = parallel.pool("hash").submit(sha256_of, chunks)
        try:
            return self._write(lambda f: [f.write(c) for c in chunks], lambda: BlobRef(hashing.result(), size))
        finally:
            hashing.cancel() or hashing.exception()  # never leave the hasher reading freed buffers

    def _publish(self, tmp: str, ref: BlobRef) -> str | None:
        """Move a fully written temp file to its content address; returns the temp path still to remove
        (when the object was already stored: dedup), or None once it is published."""
        if self.has(ref):
            # stored already: mark it used now, so a concurrent `git theta prune` that planned before this
            # reuse leaves it (it deletes only blobs unmodified since its plan)
            with contextlib.suppress(OSError):
                os.utime(self.path(ref))
            return tmp
        dest = self.path(ref)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o644)
        if self.keep_dir is not None:
            self._link(Path(tmp), self.keep_path(ref))  # theta's name first: the blob is never unprotected
        os.replace(tmp, dest)
        self.written_objects += 1
        self.written_bytes += ref.size
        faults.point("store:published")
        return None

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
        tmp_dir = self.objects_dir.parent / "tmp"
        fd = name = None
        try:
            tmp_dir.mkdir(parents=True, exist_ok=True)
            scratch.sweep(tmp_dir)  # named temp files of killed theta processes (file systems without O_TMPFILE)
            fd, name = scratch.anonymous(tmp_dir)
            with os.fdopen(fd, "wb", closefd=False) as f:
                fill(WriteBehindFile(f))  # its dirty pages bounded: a memory cgroup counts them
            faults.point("store:written")
            ref = ref_of()
            if self.has(ref):
                # stored already: mark it used now, so a concurrent `git theta prune` that planned before
                # this reuse leaves it (it deletes only blobs unmodified since its plan)
                with contextlib.suppress(OSError):
                    os.utime(self.path(ref))
            else:
                dest = self.path(ref)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.fchmod(fd, 0o644)
                if scratch.publish(fd, name, dest, replace=dest.exists()):
                    name = None  # now the object itself
                    if self.keep_dir is not None:
                        self._link(dest, self.keep_path(ref))  # theta's protected name (git lfs prune)
                    self.written_objects += 1
                    self.written_bytes += ref.size
                    faults.point("store:published")
            return ref
        except OSError as e:
            raise StoreError(f"cannot write a blob to {self.objects_dir}: {e}") from e
        finally:
            scratch.discard(fd, name)

    def stage(self, chunks: "Iterable[bytes | bytearray | memoryview]") -> "Staged":
        """Write the concatenation of ``chunks`` to a temp file (hashed as it is written) without publishing it:
        a candidate blob that costs disk, not memory. :meth:`Staged.publish` stores it, :meth:`Staged.discard`
        (or dropping it) removes it."""
        return stage_chunks(chunks, self.objects_dir.parent / "tmp", self)

    def get(self, ref: BlobRef, group: str | None = None, file: str | None = None) -> bytes:
        """The blob's bytes. BlobMissingError (naming ``group`` and ``file``) when it is not local,
        BlobCorruptError when its size (or, with ``verify``, its sha256) differs from ``ref``."""
        if ref.size == 0 and ref.oid == EMPTY_OID:
            return b""
        p = self.path(ref)
        try:
            with self._open(ref) as f:
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
            f = self._open(ref)
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
        if not (valid_oid(oid) and valuehash.is_name(value_hash)):
            raise StoreError(f"invalid binding {oid!r:.80} -> {value_hash!r:.80}")
        name = value_hash.replace(":", "-")  # (a BLAKE3 name's colon: not in a file name on every system)
        return self.objects_dir.parent / "theta-verified" / oid[0:2] / f"{oid}-{name}"

    def bound(self, oid: str, value_hash: str) -> bool:
        """True when this store has proven that blob ``oid`` decodes to a value of content hash ``value_hash``."""
        return self._binding(oid, value_hash).exists()

    def bind(self, oid: str, value_hash: str) -> None:
        """Record that blob ``oid`` decodes to the value of content hash ``value_hash`` (best effort)."""
        p = self._binding(oid, value_hash)
        try:
            try:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the first binding of its directory
                p.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            os.close(fd)
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


def _stat(p: Path) -> os.stat_result | None:
    try:
        return os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_oid(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)
class Staged:
    """A blob written to a temp file and hashed, not yet in the store (see :meth:`LfsStore.stage`).

    The temp file has no name where the file system allows it (O_TMPFILE, :mod:`theta.base.scratch`), so a
    process killed before it publishes or discards leaves nothing behind."""

    def __init__(self, ref: BlobRef, fd: int, name: str | None, store: "LfsStore | None"):
        self.ref, self.fd, self.name, self.store = ref, fd, name, store
        self._cleanup = weakref.finalize(self, _discard, fd, name)  # dropped without publish: removed

    @property
    def size(self) -> int:
        return self.ref.size

    def chunks(self, n: int = 8 << 20) -> Iterator[bytes]:
        for off in range(0, self.ref.size, n):
            yield os.pread(self.fd, min(n, self.ref.size - off), off)

    def read(self) -> bytes:
        """The staged bytes (for tests and small blobs)."""
        return b"".join(self.chunks())

    def publish(self, store: "LfsStore | None" = None) -> BlobRef:
        """Give the temp file its oid name in ``store`` (default: the store that staged it)."""
        store = store or self.store
        if store is None:
            raise StoreError("a blob staged outside a store needs a store to be published to")
        try:
            if self.store is not store:  # staged elsewhere (another file system maybe): copy
                ref = store.put_stream(self.chunks())
                self.discard()
                return ref
            if store.has(self.ref):
                with contextlib.suppress(OSError):
                    os.utime(store.path(self.ref))  # used now: a concurrent prune leaves it
                self.discard()
                return self.ref
            dest = store.path(self.ref)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.fchmod(self.fd, 0o644)
            scratch.publish(self.fd, self.name, dest, replace=dest.exists())
        except OSError as e:
            raise StoreError(f"cannot write a blob to {store.objects_dir}: {e}") from e
        self._cleanup.detach()
        _discard(self.fd, None)  # published: close, nothing to remove
        if store.keep_dir is not None:
            store._link(dest, store.keep_path(self.ref))  # theta's protected name (git lfs prune)
        store.written_objects += 1
        store.written_bytes += self.ref.size
        faults.point("store:published")
        return self.ref

    def discard(self) -> None:
        self._cleanup()


def _discard(fd: int, name: str | None) -> None:
    scratch.discard(fd, name)


_swept: set = set()  # the temp directories stage_chunks has swept in this process


def stage_chunks(chunks: "Iterable[bytes | bytearray | memoryview]", tmp_dir: "str | os.PathLike | None" = None,
                 store: LfsStore | None = None) -> Staged:
    """Stream ``chunks`` into a temp file under ``tmp_dir`` (default: the system's) with its sha256."""
    h = hashlib.sha256()
    size = 0
    fd = name = None
    tmp_dir = os.fspath(tmp_dir) if tmp_dir is not None else tempfile.gettempdir()
    try:
        os.makedirs(tmp_dir, exist_ok=True)
        if tmp_dir not in _swept:  # what killed theta processes left here (file systems without O_TMPFILE):
            scratch.sweep(tmp_dir)  # once per process (a `git add` stages a blob per changed group)
            _swept.add(tmp_dir)
        fd, name = scratch.anonymous(tmp_dir, readable=True)
        with os.fdopen(fd, "wb", closefd=False) as raw:
            f = WriteBehindFile(raw)  # its dirty pages bounded: a memory cgroup counts them
            for c in chunks:
                h.update(c)  # releases the GIL: the codec threads keep compressing meanwhile
                f.write(c)
                size += memoryview(c).nbytes
        faults.point("store:written")
        staged = Staged(BlobRef(h.hexdigest(), size), fd, name, store)
        fd = name = None
        return staged
    except OSError as e:
        raise StoreError(f"cannot write a temp blob under {tmp_dir}: {e}") from e
    finally:
        if fd is not None:
            scratch.discard(fd, name)
