"""Read-side zip parsing: central directory, zip64, local headers, bounded reads of small members.

Only what a torch checkpoint needs, written against APPNOTE.TXT so every size and offset is checked
against the real file size before anything is allocated or read. Nothing here reads member data
except :func:`ZipIndex.read_member` (bounded, for ``data.pkl``-sized members) and
:func:`ZipIndex.read_range` (one stored or deflated member, a byte range of it).
"""
from __future__ import annotations

import dataclasses
import os
import struct
import zlib
from dataclasses import dataclass

from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .fileio import pread_exact

EOCD_SIG = b"PK\x05\x06"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
ZIP64_EOCD_SIG = b"PK\x06\x06"
CENTRAL_SIG = b"PK\x01\x02"
LOCAL_SIG = b"PK\x03\x04"

EOCD = struct.Struct("<4s4H2LH")                # 22 bytes
ZIP64_LOCATOR = struct.Struct("<4sLQL")         # 20 bytes
ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")        # 56 bytes
CENTRAL = struct.Struct("<4s6H3L5H2L")          # 46 bytes
LOCAL = struct.Struct("<4s5H3L2H")              # 30 bytes

STORED, DEFLATED = 0, 8
_MAX_COMMENT = 0xFFFF
_FLAG_ENCRYPTED = 0x1
_FLAG_UTF8 = 0x800
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ZipMember:
    """One central-directory record; ``data_offset`` is where its (possibly compressed) bytes start, None
    until its local header has been read (:meth:`ZipIndex.resolve`)."""

    name: str
    method: int
    flags: int
    crc32: int
    compressed_size: int
    size: int
    header_offset: int
    data_offset: int | None = None

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & _FLAG_ENCRYPTED)


def _zip64_extra(extra: bytes, need: list[str], values: dict[str, int], path: str, name: str) -> None:
    """Replace the 0xFFFFFFFF fields listed in ``need`` (in APPNOTE order) from the zip64 extra field."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4: pos + 4 + length]
        if len(body) < length:
            break
        if tag == 0x0001:
            if len(body) < 8 * len(need):
                raise CorruptCheckpointError(path, "zip64 extra field is shorter than the fields it must hold", name)
            for i, field in enumerate(need):
                values[field] = struct.unpack_from("<Q", body, 8 * i)[0]
            return
        pos += 4 + length
    raise CorruptCheckpointError(path, "sizes marked zip64 but the entry has no zip64 extra field", name)


class ZipIndex:
    """The members of a zip archive, from its central directory and local headers.

    Opening costs one read of the archive tail and one of the central directory, whatever the number of
    members. A member's local header (which says where its data starts) is read when it is first needed
    (:meth:`resolve`, :meth:`resolve_many`). All offsets are validated against the file size.
    """

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.file_size = os.fstat(fd).st_size
        self.members: dict[str, ZipMember] = {}
        self.order: list[str] = []
        self._parse()

    # -- helpers -----------------------------------------------------------------------------------
    def _corrupt(self, problem: str, entry: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.path, problem, entry)

    def _pread(self, n: int, off: int, entry: str | None = None) -> bytes:
        return bytes(pread_exact(self.fd, n, off, self.path, entry))

    # -- parsing -----------------------------------------------------------------------------------
    def _find_eocd(self) -> tuple[int, tuple]:
        size = self.file_size
        if size < EOCD.size:
            raise self._corrupt(f"too short for a zip archive ({size} bytes; truncated?)")
        tail_len = min(size, EOCD.size + _MAX_COMMENT)
        tail = self._pread(tail_len, size - tail_len)
        pos = tail.rfind(EOCD_SIG)
        while pos >= 0:
            rec = EOCD.unpack_from(tail, pos) if pos + EOCD.size <= len(tail) else None
            # the comment length must reach exactly to the end of the file
            if rec is not None and pos + EOCD.size + rec[7] == len(tail):
                return size - tail_len + pos, rec
            pos = tail.rfind(EOCD_SIG, 0, pos)
        raise self._corrupt("no zip end-of-central-directory record (truncated or not a zip archive)")

    def _parse(self) -> None:
        eocd_off, (_, disk, cd_disk, n_here, n_total, cd_size, cd_off, _clen) = self._find_eocd()
        if disk != 0 or cd_disk != 0 or n_here != n_total:
            raise UnsupportedCheckpointError(self.path, "multi-disk (split) zip archives are not supported")
        if 0xFFFF in (n_total,) or 0xFFFFFFFF in (cd_size, cd_off):
            if eocd_off < ZIP64_LOCATOR.size:
                raise self._corrupt("zip64 sizes but no zip64 locator")
            sig, _, z64_off, _ = ZIP64_LOCATOR.unpack(self._pread(ZIP64_LOCATOR.size, eocd_off - ZIP64_LOCATOR.size))
            if sig != ZIP64_LOCATOR_SIG:
                raise self._corrupt("zip64 sizes but no zip64 end-of-central-directory locator")
            if z64_off + ZIP64_EOCD.size > eocd_off:
                raise self._corrupt(f"zip64 end-of-central-directory offset {z64_off} is out of range")
            rec = ZIP64_EOCD.unpack(self._pread(ZIP64_EOCD.size, z64_off))
            if rec[0] != ZIP64_EOCD_SIG:
                raise self._corrupt("bad zip64 end-of-central-directory record signature")
            n_total, cd_size, cd_off = rec[7], rec[8], rec[9]
            cd_end_limit = z64_off
        else:
            cd_end_limit = eocd_off
        if cd_off + cd_size > cd_end_limit:
            raise self._corrupt(f"central directory ({cd_size} bytes at {cd_off}) runs past its end record")
        if n_total * CENTRAL.size > cd_size:
            raise self._corrupt(f"central directory of {cd_size} bytes cannot hold {n_total} entries")
        cd = self._pread(cd_size, cd_off)
        pos = 0
        for _ in range(n_total):
            if pos + CENTRAL.size > len(cd):
                raise self._corrupt("central directory entry runs past the directory")
            (sig, _vmade, _vneed, flags, method, _t, _d, crc, csize, usize, nlen, xlen, clen, _dstart,
             _iattr, _eattr, hoff) = CENTRAL.unpack_from(cd, pos)
            if sig != CENTRAL_SIG:
                raise self._corrupt(f"bad central directory entry signature at byte {cd_off + pos}")
            start = pos + CENTRAL.size
            if start + nlen + xlen + clen > len(cd):
                raise self._corrupt("central directory entry name/extra runs past the directory")
            raw = cd[start: start + nlen]
            name = raw.decode("utf-8" if flags & _FLAG_UTF8 else "cp437", errors="replace")
            extra = cd[start + nlen: start + nlen + xlen]
            values = {"size": usize, "compressed_size": csize, "header_offset": hoff}
            need = [f for f in ("size", "compressed_size", "header_offset") if values[f] == 0xFFFFFFFF]
            if need:
                _zip64_extra(extra, need, values, self.path, name)
            pos = start + nlen + xlen + clen
            if name in self.members:
                raise self._corrupt("the archive lists this member twice", name)
            self.members[name] = self._member(name, flags, method, crc, values, cd_off)
            self.order.append(name)
        self._cd_off = cd_off

    def _member(self, name: str, flags: int, method: int, crc: int, v: dict[str, int], cd_off: int) -> ZipMember:
        hoff = v["header_offset"]
        if hoff + LOCAL.size + v["compressed_size"] > cd_off:
            raise self._corrupt(f"local header offset {hoff} and data ({v['compressed_size']} bytes) run past "
                                "the central directory", name)
        if method == STORED and v["compressed_size"] != v["size"]:
            raise self._corrupt(
                f"stored member has compressed size {v['compressed_size']} != size {v['size']}", name)
        return ZipMember(name, method, flags, crc, v["compressed_size"], v["size"], hoff)

    def resolve(self, m: ZipMember) -> ZipMember:
        """``m`` with its ``data_offset``, from its local header (read once, then cached)."""
        if m.data_offset is not None:
            return m
        m = self.members.get(m.name, m)
        if m.data_offset is not None:
            return m
        hoff = m.header_offset
        (sig, _need, _flags, _method, _t, _d, _crc, _cs, _us, nlen, xlen) = LOCAL.unpack(
            self._pread(LOCAL.size, hoff, m.name))
        if sig != LOCAL_SIG:
            raise self._corrupt(f"no local file header at byte {hoff}", m.name)
        data_offset = hoff + LOCAL.size + nlen + xlen
        if data_offset + m.compressed_size > self._cd_off:
            raise self._corrupt(
                f"data ({m.compressed_size} bytes at {data_offset}) overlaps the central directory or "
                f"runs past the end of the file ({self.file_size} bytes)", m.name)
        m = self.members[m.name] = dataclasses.replace(m, data_offset=data_offset)
        return m

    def resolve_many(self, members: list[ZipMember]) -> list[ZipMember]:
        """:meth:`resolve` for many members; the local headers are spread over the whole file, so ask for
        all of them at once: a cold cache then serves them in one batch instead of one seek after another."""
        todo = [m for m in members if self.members.get(m.name, m).data_offset is None]
        if len(todo) > 1 and hasattr(os, "posix_fadvise"):
            for m in todo:
                os.posix_fadvise(self.fd, m.header_offset, 4096, os.POSIX_FADV_WILLNEED)
        return [self.resolve(m) for m in members]

    # -- reading -----------------------------------------------------------------------------------
    def check_readable(self, m: ZipMember) -> None:
        if m.encrypted:
            raise UnsupportedCheckpointError(self.path, "member is encrypted; zipslice refuses encrypted archives",
                                             m.name)
        if m.method not in (STORED, DEFLATED):
            raise UnsupportedCheckpointError(
                self.path, f"member uses zip compression method {m.method}; only stored (0) and deflate (8) "
                           "are read", m.name)

    def read_member(self, name: str, limit: int) -> bytes:
        """The whole (decompressed) member, refusing one larger than ``limit`` bytes."""
        m = self.resolve(self.members[name])
        if m.size > limit:
            raise self._corrupt(f"member claims {m.size} bytes, more than the {limit} allowed", name)
        data = bytes(self.read_range(m, 0, m.size))
        if zlib.crc32(data) != m.crc32:
            raise self._corrupt("CRC-32 mismatch (the member is damaged)", name)
        return data

    def read_range(self, m: ZipMember, start: int, nbytes: int) -> bytearray:
        """Bytes ``start .. start+nbytes`` of the member's uncompressed data."""
        self.check_readable(m)
        if start < 0 or nbytes < 0 or start + nbytes > m.size:
            raise self._corrupt(f"range {start}..{start + nbytes} is outside the member's {m.size} bytes", m.name)
        m = self.resolve(m)
        if m.method == STORED:
            return pread_exact(self.fd, nbytes, m.data_offset + start, self.path, m.name)
        return self._inflate_range(m, start, nbytes)

    def _inflate_range(self, m: ZipMember, start: int, nbytes: int) -> bytearray:
        """Stream-inflate with output bounded by what is still wanted; never more than the declared size."""
        out = bytearray(nbytes)
        d = zlib.decompressobj(-15)
        pos_in, produced, got = 0, 0, 0
        end = start + nbytes
        pending = b""
        while produced < end:
            if not pending:
                if d.unconsumed_tail:
                    pending = d.unconsumed_tail
                elif pos_in < m.compressed_size:
                    n = min(_CHUNK, m.compressed_size - pos_in)
                    pending = self._pread(n, m.data_offset + pos_in, m.name)
                    pos_in += n
                else:
                    raise self._corrupt(f"deflate stream ends after {produced} of {m.size} bytes", m.name)
            try:
                chunk = d.decompress(pending, min(_CHUNK, end - produced))
            except zlib.error as e:
                raise self._corrupt(f"deflate stream is damaged: {e}", m.name) from None
            pending = d.unconsumed_tail
            if not chunk and not pending and d.eof:
                raise self._corrupt(f"deflate stream ends after {produced} of {m.size} bytes", m.name)
            lo = max(start - produced, 0)
            if lo < len(chunk):
                piece = chunk[lo:]
                out[got: got + len(piece)] = piece
                got += len(piece)
            produced += len(chunk)
        return out
