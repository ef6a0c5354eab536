"""Positioned reads that never over-read, and atomic publication of written files."""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from . import pagecache
from .errors import CorruptCheckpointError


def _check_span(fd: int, nbytes: int, offset: int, path: str, entry: str | None) -> None:
    if nbytes < 0 or offset < 0:
        raise CorruptCheckpointError(path, f"negative span ({nbytes} bytes at {offset})", entry)
    size = os.fstat(fd).st_size
    if offset + nbytes > size:
        raise CorruptCheckpointError(
            path, f"needs bytes {offset}..{offset + nbytes} but the file has {size} (truncated?)", entry)


def _fill(fd: int, buf, offset: int, path: str, entry: str | None) -> None:
    """Fill ``buf`` from ``offset`` with positioned reads, however short each one comes back."""
    view = memoryview(buf).cast("B")
    got, nbytes = 0, view.nbytes
    while got < nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CorruptCheckpointError(path, f"unexpected end of file at byte {offset + got}", entry)
        got += n


def pread_exact(fd: int, nbytes: int, offset: int, path: str, entry: str | None = None) -> bytearray:
    """Read exactly ``nbytes`` at ``offset`` into a fresh buffer, or raise CorruptCheckpointError."""
    _check_span(fd, nbytes, offset, path, entry)
    buf = bytearray(nbytes)
    _fill(fd, buf, offset, path, entry)
    return buf


def pread_into(fd: int, buf, offset: int, path: str, entry: str | None = None) -> None:
    """Fill ``buf`` (a writable buffer, reused by the caller) from ``offset``, or raise CorruptCheckpointError."""
    _check_span(fd, memoryview(buf).nbytes, offset, path, entry)
    _fill(fd, buf, offset, path, entry)


def pread_array(fd: int, nbytes: int, offset: int, path: str, entry: str | None = None):
    """Like :func:`pread_exact`, into a fresh numpy uint8 array.

    numpy backs large arrays with transparent huge pages, so the first touch of a big buffer costs far
    fewer page faults than a bytearray's 4 KiB pages: about 2x faster per tensor read on a 2-core VM
    (scripts/bench/safetensors_read.py).
    """
    _check_span(fd, nbytes, offset, path, entry)
    buf = np.empty(nbytes, dtype=np.uint8)
    _fill(fd, buf, offset, path, entry)
    return buf


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[str]:
    """Yield the path of a temp file beside ``dest`` for a writer that opens files by name (h5py);
    on success fsync it and rename it over ``dest``. On any exception ``dest`` is untouched."""
    dest = Path(dest)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent or ".")
    except OSError as e:  # name the file the caller asked for, not the temp file (no such directory, ...)
        if not dest.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"cannot write it: no directory {str(dest.parent)!r}",
                                    str(dest)) from None
        raise type(e)(e.errno, e.strerror, str(dest)) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a published file gets the usual mode
        os.close(fd)
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        with contextlib.suppress(OSError):
            dfd = os.open(dest.parent or ".", os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class WriteBehindFile:
    """A binary file written front to back whose dirty pages stay within a few windows (see
    :class:`zipslice.pagecache.WriteBehind`): big writes go in window-sized pieces, and each completed window's
    writeback is started and the one before it waited for. Seeking back to patch a few bytes (a zip CRC) is
    fine.

    Once the file is too big to stay cached (:func:`zipslice.pagecache.too_big_to_cache`: its written pages
    are let go of anyway), the rest goes around the page cache, whole windows gathered in an aligned buffer
    and written with ``O_DIRECT`` (:class:`_DirectWindows`): copying into the page cache, waiting for the
    writeback and dropping the pages was the writing thread's CPU while the decoders waited (writing 3.85 GB
    in a 1 GiB cgroup: 1.9-2.0 s of system CPU, 0.1 s direct; the Llama-shaped checkout ~12 % sooner,
    docs/design/streaming.md). ``direct_after``: the size from which to write direct (default: when the cache
    budget says so; where ``O_DIRECT`` is refused, the page cache); ``window``: bytes between two writeback
    starts, and the size of a direct window.

    Use it as a context manager (or call :meth:`flush` last): the direct windows' last, partial one is written
    when the block ends.
    """

    def __init__(self, f: BinaryIO, direct_after: int | None = None, window: int = pagecache.WRITE_WINDOW):
        self._f = f
        self._pos = self._end = f.tell()
        self._wb = pagecache.WriteBehind(f.fileno(), window)
        self._direct_after = direct_after
        self._direct: _DirectWindows | None = None
        self._may_go_direct = hasattr(os, "O_DIRECT")
        self._going_direct = False  # decided: direct from the next aligned end of the file
        self._first_direct: int | None = None  # where the direct windows started

    def __enter__(self) -> "WriteBehindFile":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            if self._direct is not None:
                self._direct.close()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        while view.nbytes:
            if self._direct is not None:
                self._direct.write(view, self._pos)
                self._pos += view.nbytes
                break
            if self._going_direct and self._pos == self._end and self._pos % _DirectWindows.ALIGN == 0:
                self._f.flush()
                self._direct = _DirectWindows.open(self._f.fileno(), self._pos, self._wb.window)
                self._first_direct = self._pos
                self._going_direct = self._may_go_direct = self._direct is not None
                continue
            step = self._wb.window
            if self._going_direct and self._pos == self._end:  # up to the alignment through the cache
                step = -self._pos % _DirectWindows.ALIGN
            piece = view[:step]
            self._f.write(piece)
            self._pos += piece.nbytes
            self._end = max(self._end, self._pos)
            view = view[piece.nbytes:]
            if self._wb.due(self._pos):
                self._f.flush()
                self._wb.wrote(self._pos)
                self._going_direct = self._going_direct or self._direct_due()
        return size

    def _direct_due(self) -> bool:
        if not self._may_go_direct or self._pos != self._end:  # only appending goes direct
            return False
        if self._direct_after is not None:
            return self._pos >= self._direct_after
        return self._wb.dropping()

    def flush(self) -> None:
        """Every byte written so far is in the file (the partial direct window through the page cache)."""
        self._f.flush()
        if self._direct is not None:
            self._direct.flush()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if self._direct is None:
            self._pos = self._f.seek(offset, whence)
        else:
            self._pos = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._direct.end}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return self._f.seekable()

    def __getattr__(self, name):
        if name.startswith("_"):  # not a file's attribute (and not ours yet, before __init__ ends)
            raise AttributeError(name)
        self.flush()  # whatever else the file is asked (read, fileno...), it holds every byte written
        return getattr(self._f, name)


class _DirectWindows:
    """The rest of a file, from an aligned offset, written with ``O_DIRECT`` (through a second descriptor of
    it) window by window from an aligned buffer: no copy into the page cache, no dirty pages. A write before
    the window (a patch) goes through the page cache; the window's last, partial fill is written through it
    by :meth:`flush` and kept, to be written whole when it fills."""

    ALIGN = 4096  # a multiple of every block size O_DIRECT asks of offsets, lengths and buffers

    def __init__(self, fd: int, direct_fd: int, start: int, window: int):
        self.fd, self.start = fd, start
        self.direct_fd: int | None = direct_fd
        self.buf = mmap.mmap(-1, window)  # page-aligned
        self.view = memoryview(self.buf)
        self.fill = 0
        self.unflushed = False

    @classmethod
    def open(cls, fd: int, start: int, window: int) -> "_DirectWindows | None":
        """Direct windows of ``fd``'s file from ``start`` (aligned), or None where ``O_DIRECT`` is refused."""
        try:
            direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            return None
        return cls(fd, direct_fd, start, max(window // cls.ALIGN, 1) * cls.ALIGN)

    @property
    def end(self) -> int:
        return self.start + self.fill

    def write(self, view: memoryview, pos: int) -> None:
        if pos > self.end:
            raise ValueError(f"a write at {pos} would leave a hole after the file's end at {self.end}")
        if pos < self.start:  # a patch of what is written
            before = view[:self.start - pos]
            _pwrite_all(self.fd, before, pos)
            view, pos = view[before.nbytes:], pos + before.nbytes
        if view.nbytes and pos < self.end:  # a patch of the window
            n = min(view.nbytes, self.end - pos)
            self.view[pos - self.start:pos - self.start + n] = view[:n]
            view, self.unflushed = view[n:], True
        while view.nbytes:
            n = min(view.nbytes, len(self.buf) - self.fill)
            self.view[self.fill:self.fill + n] = view[:n]
            self.fill += n
            view, self.unflushed = view[n:], True
            if self.fill == len(self.buf):
                self._write_window()

    def _write_window(self) -> None:
        if self.direct_fd is not None:
            try:
                _pwrite_all(self.direct_fd, self.view, self.start)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)  # a file system that opens O_DIRECT but refuses these writes
                self.direct_fd = None
        if self.direct_fd is None:  # through the page cache, each window waited for
            _pwrite_all(self.fd, self.view, self.start)
            pagecache.sync_range(self.fd, self.start, self.fill, wait=True)
        self.start += self.fill
        self.fill = 0
        self.unflushed = False

    def flush(self) -> None:
        if self.unflushed:
            _pwrite_all(self.fd, self.view[:self.fill], self.start)
            self.unflushed = False

    def close(self) -> None:
        self.view.release()
        self.buf.close()
        if self.direct_fd is not None:
            os.close(self.direct_fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


@contextlib.contextmanager
def atomic_output(dest: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a temp file beside ``dest`` (a :class:`WriteBehindFile`: written front to back, its dirty pages
    bounded); on success fsync it and rename it over ``dest``.

    On any exception the temp file is removed and ``dest`` is untouched.
    """
    with atomic_path(dest) as tmp, open(tmp, "w+b") as f, WriteBehindFile(f) as out:
        yield out
