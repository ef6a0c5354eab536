"""git's index file (gitformat-index(5)): read its entries, and record new stat data for files theta wrote.

When git writes a work-tree file itself it records the file's stat data (ctime, mtime, dev, ino, uid, gid,
size) next to the blob id in the index; a later `git status` trusts a file whose stat still matches and
never reads it. When theta writes a checkpoint in place of the small placeholder git wrote, the only git
command that records the new stat data is `git update-index --refresh`, which re-reads and re-cleans the
whole file: gigabytes. :func:`record_stat` instead rewrites the index as git would have written it had it
written the checkpoint itself: same entries, same extensions, only the stat fields of the given paths
changed (a fixed-size field in every entry, so every offset stays valid), and a new trailing checksum. It
takes ``index.lock`` exactly like git (created exclusively, renamed over the index), holding it only for the
few milliseconds the write takes, and gives up (:class:`~theta.base.errors.IndexBusyError`) when another git
command holds it.

Supported: index versions 2, 3 and 4, SHA-1 and SHA-256 repositories, every extension that does not refer
to entries by position. A split index (``link`` extension) raises IndexUnsupportedError: the caller falls
back to `git update-index --refresh`.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

from theta.base.errors import IndexBusyError, IndexUnsupportedError

_HEADER = struct.Struct(">4sII")
_STAT = struct.Struct(">10I")      # ctime s, ctime ns, mtime s, mtime ns, dev, ino, mode, uid, gid, size
_HASH_BYTES = {"sha1": 20, "sha256": 32}
_EXTENDED = 0x4000
_NAME_MASK = 0x0FFF
_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Entry:
    """One index entry: where its stat data sits in the file, its blob id, mode and merge stage."""

    path: str
    oid: str
    mode: int
    stage: int
    stat: tuple[int, ...]   # the 10 words of stat data as stored (mode included, at position 6)
    offset: int             # byte offset of the entry (its stat data) in the index file


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """git's offset varint (index v4 path prefix lengths): value and the position after it."""
    c = buf[pos]
    pos += 1
    value = c & 0x7F
    while c & 0x80:
        value += 1
        c = buf[pos]
        pos += 1
        value = (value << 7) | (c & 0x7F)
    return value, pos


def parse(data: bytes, hash_name: str = "sha1") -> tuple[int, list[Entry]]:
    """(version, entries) of an index file's bytes. Raises IndexUnsupportedError on anything unexpected."""
    hlen = _HASH_BYTES.get(hash_name)
    if hlen is None:
        raise IndexUnsupportedError(f"unknown object format {hash_name!r}")
    if len(data) < _HEADER.size + hlen:
        raise IndexUnsupportedError("index file is truncated")
    sig, version, count = _HEADER.unpack_from(data, 0)
    if sig != b"DIRC" or version not in (2, 3, 4):
        raise IndexUnsupportedError(f"index signature {sig!r} version {version} is not one theta can update")
    entries: list[Entry] = []
    pos = _HEADER.size
    previous = b""
    fixed = _STAT.size + hlen + 2
    try:
        for _ in range(count):
            start = pos
            stat = _STAT.unpack_from(data, pos)
            oid = data[pos + _STAT.size: pos + _STAT.size + hlen].hex()
            (flags,) = struct.unpack_from(">H", data, pos + _STAT.size + hlen)
            pos += fixed
            if flags & _EXTENDED:
                if version < 3:
                    raise IndexUnsupportedError("extended entry flags in a version 2 index")
                pos += 2
            if version == 4:
                strip, pos = _varint(data, pos)
                end = data.index(b"\0", pos)
                if strip > len(previous):
                    raise IndexUnsupportedError("index v4 path prefix longer than the previous path")
                name = previous[: len(previous) - strip] + data[pos:end]
                pos = end + 1
            else:
                length = flags & _NAME_MASK
                end = data.index(b"\0", pos) if length == _NAME_MASK else pos + length
                name = data[pos:end]
                # entries are padded with 1-8 NULs to a multiple of 8 bytes
                pos = start + ((pos - start + len(name) + 8) & ~7)
            previous = name
            entries.append(Entry(name.decode("utf-8", "surrogateescape"), oid, stat[6], (flags >> 12) & 3,
                                 stat, start))
    except (struct.error, ValueError, IndexError):
        raise IndexUnsupportedError("index entries are truncated or malformed") from None
    # extensions: a split index keeps entries in another file, referred to by position
    while pos + 8 <= len(data) - hlen:
        sig = data[pos:pos + 4]
        (size,) = struct.unpack_from(">I", data, pos + 4)
        if sig == b"link":
            raise IndexUnsupportedError("this repository uses a split index (core.splitIndex)")
        pos += 8 + size
    return version, entries


def _stat_words(st: os.stat_result, mode: int) -> tuple[int, ...]:
    """The 10 stat words git records for a file (truncated to 32 bits as git does), keeping the entry's mode."""
    return (int(st.st_ctime) & _U32, st.st_ctime_ns % 1_000_000_000,
            int(st.st_mtime) & _U32, st.st_mtime_ns % 1_000_000_000,
            st.st_dev & _U32, st.st_ino & _U32, mode, st.st_uid & _U32, st.st_gid & _U32, st.st_size & _U32)


def patched(data: bytes, updates: dict[str, tuple[str, os.stat_result]], hash_name: str = "sha1",
            racy_from: int | None = None) -> tuple[bytes, list[str]]:
    """The index bytes with new stat data for each ``path: (expected_oid, stat)`` whose stage-0 entry still
    holds ``expected_oid``; and the paths updated. The trailing checksum is recomputed (kept all-zero when
    git wrote it so: index.skipHash).

    ``racy_from``: the second of the old index file's mtime. Rewriting the index moves its timestamp
    forward, which would make git trust entries it recorded in that same second ("racily clean": the file
    may have changed within the second without changing its stat). Git's own index writer then smudges
    such entries; so do we, the way git does it (size recorded as 0: git re-checks their content next time).
    """
    hlen = _HASH_BYTES[hash_name]
    _, entries = parse(data, hash_name)
    out = bytearray(data)
    done = []
    racy = []
    for e in entries:
        want = updates.get(e.path)
        if want is not None and e.stage == 0 and e.oid == want[0]:
            _STAT.pack_into(out, e.offset, *_stat_words(want[1], e.mode))
            done.append(e.path)
        elif (racy_from is not None and e.stat[2] >= racy_from and e.stat[9] != 0
              and (e.mode & 0o170000) in (0o100000, 0o120000)):
            racy.append(e)
    if not done:
        return data, []
    for e in racy:
        struct.pack_into(">I", out, e.offset + 36, 0)  # the size word: "content must be checked"
    body = memoryview(out)[: len(out) - hlen]
    if any(data[-hlen:]):
        out[-hlen:] = hashlib.new(hash_name, body).digest()
    return bytes(out), done


def record_stat(index_path: str | os.PathLike, updates: dict[str, tuple[str, os.stat_result]],
                hash_name: str = "sha1", locked=None) -> list[str]:
    """Record each file's new stat data in the index at ``index_path`` (see :func:`patched`), under
    ``index.lock``. Returns the paths updated. ``locked(path, inode)``, when given, is called once the lock
    file is ours and ``locked(None, 0)`` once it is gone (a watchdog removes it if this process dies between).

    Raises IndexBusyError if the lock is held (another git command is running) and IndexUnsupportedError
    for an index theta must not edit; the index is then unchanged.
    """
    index_path = os.fspath(index_path)
    with open(index_path, "rb") as f:
        before = f.read()
        racy_from = int(os.fstat(f.fileno()).st_mtime)
    new, done = patched(before, updates, hash_name, racy_from)  # computed before locking: held for ms
    if not done:
        return []
    lock = index_path + ".lock"
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        raise IndexBusyError(f"{lock} exists: another git command is using the index") from None
    if locked is not None:
        locked(lock, os.fstat(fd).st_ino)
    try:
        with open(index_path, "rb") as f:
            now = f.read()
            now_from = int(os.fstat(f.fileno()).st_mtime)
        if now != before or now_from != racy_from:  # git wrote it between our read and our lock: redo
            new, done = patched(now, updates, hash_name, now_from)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.replace(lock, index_path)
        lock = None
    finally:
        if fd >= 0:
            os.close(fd)
        if lock is not None:
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass
        if locked is not None:
            locked(None, 0)
    return done
