"""Where the bytes git sends with a clean request end up: the work-tree file itself when they are its bytes,
else a spool file of exactly git's bytes.

git pipes the whole file; the clean needs random access, so a `git add` must not copy it. The bytes are
compared with the work-tree file as they arrive; with a :class:`theta.model.git_bytes.GroupHashes` (a clean of
that file already running) the groups' byte ranges are hashed instead of compared, and the clean proves
the file's bytes of every group it reads against those hashes (see theta.model.git_bytes). At the first
difference the matching prefix is copied from the file (each hashed range checked on the way) and git's
bytes from there on are spooled.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterable

import xxhash

from theta import settings
from theta.base.errors import FileChanged
from theta.model.git_bytes import GroupHashes

_COMPARE_BLOCK = 4 << 20  # bytes of the work-tree file read at a time to compare git's packets with
_NOWHERE = float("inf")


class Received:
    """Where the content git sent us lives: the verified working-tree file or a spool file we own."""

    def __init__(self, path: Path, owned: bool, head: bytes, size: int):
        self.path, self.owned, self.head, self.size = path, owned, head, size

    def cleanup(self) -> None:
        if self.owned:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def receive(chunks: Iterable[bytes], spool_dir: Path, worktree_file: Path | None,
            hashes: GroupHashes | None = None) -> Received:
    """Consume all of ``chunks``; avoid copying when they equal ``worktree_file``'s bytes. ``hashes``: hash
    the ranges of the groups it lays out instead of comparing them (it is told the end in every case).

    The work-tree file is read in blocks of ``_COMPARE_BLOCK`` and each packet compared with its slice of the
    block: a read per packet released and re-took the GIL 6,600 times per 400 MiB, each time queueing behind
    the clean's threads. (Not a map of the file: a file truncated meanwhile would kill the filter with SIGBUS.)
    """
    try:
        f = None
        if worktree_file is not None and settings.env("SPOOL") != "always":
            try:
                if worktree_file.is_file():
                    f = open(worktree_file, "rb", buffering=0)
            except OSError:
                f = None
        if f is None:
            return _spool_all(chunks, spool_dir)
        with f:
            return _Comparer(f, worktree_file, spool_dir, hashes).run(chunks)
    finally:
        if hashes is not None:
            hashes.end()


def _spool_all(chunks: Iterable[bytes], spool_dir: Path) -> Received:
    spool, name = _new_spool(spool_dir)
    head, size = b"", 0
    try:
        with spool:
            for chunk in chunks:
                if len(head) < 4096:
                    head += chunk[: 4096 - len(head)]
                spool.write(chunk)
                size += len(chunk)
    except BaseException:
        os.unlink(name)
        raise
    return Received(Path(name), True, head, size)


class _Comparer:
    """git's bytes against the work-tree file, byte range by byte range."""

    def __init__(self, f: BinaryIO, file: Path, spool_dir: Path, hashes: GroupHashes | None):
        self.f, self.file, self.spool_dir, self.hashes = f, file, spool_dir, hashes
        self.window = _Window(f)
        self.ranges: list | None = None if hashes is not None else []
        self.next = 0                 # index of the next (or current) range
        self.hasher = None            # xxh3 of the current range's bytes so far
        self.hashed: list = []        # (start, end, digest) of each range hashed, not compared
        self.size = 0                 # bytes of git's content consumed
        self.head = b""

    def run(self, chunks: Iterable[bytes]) -> Received:
        it = iter(chunks)
        for chunk in it:
            if len(self.head) < 4096:
                self.head += chunk[: 4096 - len(self.head)]
            if self.ranges is None:
                self.ranges = self.hashes.layout()  # (waits for the clean to parse the file)
            off = self._consume(chunk)
            if off is not None:
                return self._spool_from(chunk, off, it)
        if self.hasher is None and self.window.at_end(self.size):  # same length: the work-tree file is the content
            return Received(self.file, False, self.head, self.size)
        return self._spool_from(b"", 0, it)

    def _consume(self, chunk: bytes) -> int | None:
        """Take ``chunk``; the offset in it where git's bytes stop matching the file's, else None."""
        view, off, n = memoryview(chunk), 0, len(chunk)
        while off < n:
            if self.hasher is not None:  # inside a group's range
                start, end, key = self.ranges[self.next]
                take = min(n - off, end - self.size)
                self.hasher.update(view[off:off + take])
                off += take
                self.size += take
                if self.size == end:
                    digest = self.hasher.hexdigest()
                    self.hashed.append((start, end, digest))
                    self.hashes.put(key, digest)
                    self.hasher = None
                    self.next += 1
                    self.window.seek(end)
                continue
            start = self.ranges[self.next][0] if self.next < len(self.ranges) else _NOWHERE
            take = int(min(n - off, start - self.size))
            if take:
                if not self.window.matches(view[off:off + take], None if start is _NOWHERE else start):
                    return off
                off += take
                self.size += take
            if self.size == start:
                self.hasher = xxhash.xxh3_128()
        return None

    def _spool_from(self, chunk: bytes, off: int, rest: Iterable[bytes]) -> Received:
        """git's bytes differ from the file's from ``chunk[off:]`` on: spool the file's first ``self.size``
        bytes (each hashed range checked against git's hash) and git's bytes from there."""
        spool, name = _new_spool(self.spool_dir)
        try:
            with spool:
                if self.hasher is not None:  # git's content ended (or differs) inside a group's range
                    self.hashed.append((self.ranges[self.next][0], self.size, self.hasher.hexdigest()))
                _copy_checked(self.f, spool, self.size, self.hashed, self.file)
                size = self.size
                for piece in ([memoryview(chunk)[off:]] if off < len(chunk) else []):
                    spool.write(piece)
                    size += len(piece)
                for c in rest:
                    if len(self.head) < 4096:
                        self.head += c[: 4096 - len(self.head)]
                    spool.write(c)
                    size += len(c)
        except BaseException:
            os.unlink(name)
            raise
        return Received(Path(name), True, self.head, size)


def _copy_checked(src: BinaryIO, dst: BinaryIO, n: int, hashed: list, file: Path) -> None:
    """Copy ``src``'s first ``n`` bytes; the ``(start, end, digest)`` ranges in them must hash to ``digest``
    (git sent only their hash: if the file's bytes differ there, git's are gone)."""
    src.seek(0)
    at = 0
    for start, end, digest in hashed:
        _copy(src, dst, start - at)
        got = next_digest(src, end - start, dst)
        if got is None:
            raise OSError("working-tree file shrank while being read")
        if got != digest:
            raise file_changed(file)
        at = end
    _copy(src, dst, n - at)


def next_digest(src: BinaryIO, n: int, dst: BinaryIO | None = None) -> str | None:
    """The xxh3-128 of ``src``'s next ``n`` bytes (copied to ``dst`` on the way, if given); None when the file
    ends first."""
    h = xxhash.xxh3_128()
    while n > 0:
        buf = src.read(min(n, 8 << 20))
        if not buf:
            return None
        h.update(buf)
        if dst is not None:
            dst.write(buf)
        n -= len(buf)
    return h.hexdigest()


def file_changed(file: Path) -> FileChanged:
    """The refusal of content whose work-tree file no longer holds the bytes git sent."""
    return FileChanged(f"{file.name}: the file changed while git was reading it; run the git command again")


class _Window:
    """Sequential reads of a file through one reused buffer (a fresh buffer per read costs a page fault per
    4 KiB): :meth:`matches` compares the next bytes with git's; :meth:`seek` jumps over bytes not compared."""

    def __init__(self, f: BinaryIO, size: int | None = None):
        self.f, self.buf = f, bytearray(size or _COMPARE_BLOCK)
        self.view = memoryview(self.buf)
        self.base = 0                 # file offset of buf[0]
        self.at = self.valid = 0      # next byte to compare; bytes of buf holding file data
        self.eof = False

    def matches(self, data, limit: int | None = None) -> bool:
        """Whether the file's next ``len(data)`` bytes are ``data`` (then they are taken). Reads no further
        than file offset ``limit`` (what follows is hashed, not compared)."""
        n = len(data)
        if self.valid - self.at < n and not self.eof:
            if n > len(self.buf):
                self.view.release()
                self.buf.extend(bytes(n - len(self.buf)))  # grow (a packet is 64 KiB)
                self.view = memoryview(self.buf)
            left = self.valid - self.at
            self.buf[:left] = self.buf[self.at:self.valid]
            self.base += self.at
            self.at, self.valid = 0, left
            want = len(self.buf) if limit is None else min(len(self.buf), limit - self.base)
            while self.valid < want:
                got = self.f.readinto(self.view[self.valid:want])
                if not got:
                    self.eof = True
                    break
                self.valid += got
        if self.valid - self.at < n or not self.buf.startswith(data, self.at, self.at + n):
            return False
        self.at += n
        return True

    def seek(self, pos: int) -> None:
        """Continue at file offset ``pos`` (ahead of the bytes compared so far)."""
        if self.base + self.at <= pos <= self.base + self.valid:
            self.at = pos - self.base
            return
        self.f.seek(pos)
        self.base, self.at, self.valid, self.eof = pos, 0, 0, False

    def at_end(self, size: int) -> bool:
        """True when the file has ``size`` bytes and every one was taken (or skipped)."""
        return self.at == self.valid and os.fstat(self.f.fileno()).st_size == size


def _new_spool(d: Path):
    fd, name = tempfile.mkstemp(prefix="spool-", dir=d)
    return os.fdopen(fd, "wb", buffering=1 << 20), name


def _copy(src: BinaryIO, dst: BinaryIO, n: int, see=None) -> None:
    while n > 0:
        buf = src.read(min(n, 8 << 20))
        if not buf:
            raise OSError("working-tree file shrank while being read")
        if see is not None:
            see(buf)
        dst.write(buf)
        n -= len(buf)
