"""Temporary files that never outlive a killed process.

A process killed with SIGKILL runs no cleanup, so any temp file it named stays behind. theta avoids naming
them where it can, and otherwise makes their owner recognisable so the next run removes them:

- :func:`anonymous` opens an unnamed file (Linux ``O_TMPFILE``) in a directory: it has no name until
  :func:`publish` links it under its final name, so a kill leaves nothing at all;
- :func:`exchange` swaps two names in one step (Linux ``renameat2(RENAME_EXCHANGE)``): a finished file takes
  the place of the one it replaces while the replaced one stays reachable under the temp name, to be checked and
  removed (or swapped back);
- :func:`owned_dir` gives each process its own scratch directory named ``<pid>-<start time>``, and
  :func:`sweep` removes the directories and ``theta-<pid>-<start>-*`` files of processes that are gone
  (the start time tells a reused pid apart).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

_OWNED_DIR = re.compile(r"(\d+)-(\d+)")
_OWNED_FILE = re.compile(r"theta-(\d+)-(\d+)-.*")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after its last ')'
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def owner_tag(pid: int | None = None) -> str:
    """``<pid>-<start time>`` of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid) or 0}"


def alive(pid: int, start: int) -> bool:
    """Is the process that made a ``<pid>-<start>`` name still running?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = _start_time(pid)
    return now is None or start == 0 or now == start


def owned_dir(parent: str | os.PathLike, pid: int | None = None) -> Path:
    """This process's (or process ``pid``'s) scratch directory under ``parent`` (created; swept by a later run
    once its owner is gone)."""
    d = Path(parent) / owner_tag(pid)
    d.mkdir(parents=True, exist_ok=True)
    return d


def sweep(parent: str | os.PathLike) -> int:
    """Remove what dead processes left in ``parent``: ``<pid>-<start>`` directories and
    ``theta-<pid>-<start>-*`` files. Returns how many entries were removed. Never raises."""
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        with contextlib.suppress(OSError):
            is_dir = entry.is_dir(follow_symlinks=False)
            m = (_OWNED_DIR if is_dir else _OWNED_FILE).fullmatch(entry.name)
            if m is None or alive(int(m.group(1)), int(m.group(2))):
                continue
            if is_dir:
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
    return removed


def named(directory: str | os.PathLike, suffix: str = ".tmp") -> tuple[int, str]:
    """(fd, path) of a new named temp file whose name carries this process's tag (see :func:`sweep`)."""
    return tempfile.mkstemp(prefix=f"theta-{owner_tag()}-", suffix=suffix, dir=directory)


def anonymous(directory: str | os.PathLike, readable: bool = False) -> tuple[int, str | None]:
    """(fd, None) of an unnamed file in ``directory`` when the file system supports ``O_TMPFILE``, else
    (fd, path) of a named one (:func:`named`). Publish either with :func:`publish`. ``readable``: open it
    for reading too (a staged blob is read back when it is published elsewhere)."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is not None and os.path.isdir("/proc/self/fd"):
        try:
            return os.open(directory, flag | (os.O_RDWR if readable else os.O_WRONLY), 0o644), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    return named(directory)


def publish(fd: int, name: str | None, dest: str | os.PathLike, replace: bool = True) -> bool:
    """Give the file behind ``fd`` the name ``dest`` atomically. With ``replace=False`` an existing ``dest``
    is kept (content-addressed files: it holds the same bytes) and False is returned. ``fd`` stays open."""
    dest = os.fspath(dest)
    if name is not None:
        if not replace and os.path.exists(dest):
            return False
        os.replace(name, dest)
        return True
    try:
        _link_fd(fd, dest)
        return True
    except FileExistsError:
        if not replace:
            return False
    # replace an existing file: link beside it under a tagged name, then rename over it
    fd2, side = named(os.path.dirname(dest) or ".")
    os.close(fd2)
    os.unlink(side)
    _link_fd(fd, side)
    os.replace(side, dest)
    return True


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_renameat2 = None  # libc's renameat2, loaded on first use; False where there is none


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap the files named ``a`` and ``b`` atomically (both must exist, on one file system): True when done,
    False where the system cannot (not Linux, glibc < 2.28, a file system without RENAME_EXCHANGE): the caller
    then renames. Other errors (a missing file, permissions) raise OSError.

    Why not ``os.replace``: ext4 (``auto_da_alloc``, its default) starts writing a renamed file's dirty pages
    back to disk inside a ``rename`` that replaces another file, and the rename waits for that -- 0.14 s for a
    414 MiB checkpoint here -- and the pages still under writeback then slow down deleting the file at the next
    checkout. An exchange is not such a replacement: the data is written back later, as for a file git writes.
    """
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        if sys.platform.startswith("linux"):
            fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2 = fn
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True

    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _link_fd(fd: int, dest: str) -> None:
    """linkat(/proc/self/fd/FD, dest, AT_SYMLINK_FOLLOW): a name for an O_TMPFILE file. (os.link with a plain
    path calls link(2), which would link the /proc symlink itself; a src_dir_fd forces linkat.)"""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), dest, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def discard(fd: int | None, name: str | None) -> None:
    """Close (and for a named file, remove) a temp file that will not be published."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    if name is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
