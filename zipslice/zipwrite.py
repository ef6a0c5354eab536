"""Write-side zip for torch checkpoints: stored records, data aligned, CRC computed while streaming, zip64.

The layout follows what ``torch.save`` (PyTorchStreamWriter) produces: no compression, each record's data
aligned to ``alignment`` bytes by padding the local header's extra field with a ``FB`` block of ``Z`` bytes,
UTF-8 names. Sizes are known before the data, so the local header carries them directly (no data
descriptor); its CRC field is patched in place once the record's bytes have streamed through
``zlib.crc32`` (:meth:`ZipWriter.write_chunks`). When the caller has the whole record in memory (:meth:`ZipWriter.write_record`,
:meth:`ZipWriter.write_known`) its CRC is computed first and the writer never seeks: the output may then be a
pipe (theta streams a checkout straight to git). The writer counts its own offsets instead of calling
``tell()`` (which flushes a buffered file every time). Zip64 fields are written only where a size, an
offset or the entry count needs them (or everywhere with ``force_zip64=True``, which tests use to exercise that path on small files).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from .errors import ZipsliceError

_LOCAL_SIG, _CENTRAL_SIG, _EOCD_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_ZIP64_EOCD_SIG, _ZIP64_LOCATOR_SIG = 0x06064B50, 0x07064B50
_U32_MAX, _U16_MAX = 0xFFFFFFFF, 0xFFFF
_FLAG_UTF8 = 0x0800
_DOS_DATE_1980_01_01 = (1 << 5) | 1  # fixed timestamp: same input, same bytes
_ZIP64_EXTRA_ID, _PAD_EXTRA_ID = 0x0001, 0x4246  # "FB" as torch writes it
_CRC_FIELD_OFFSET = 14


@dataclass
class _Entry:
    name: bytes
    header_offset: int
    size: int
    crc: int
    zip64_local: bool


class ZipWriter:
    """Append stored records to ``f`` (a seekable binary file), then :meth:`close` writes the directory."""

    def __init__(self, f: BinaryIO, *, alignment: int = 64, force_zip64: bool = False, path: str | None = None):
        self._f = f
        self._alignment = alignment
        self._force64 = force_zip64
        self._path = path
        self._entries: list[_Entry] = []
        self._closed = False
        try:
            self._pos = f.tell()
        except (OSError, AttributeError, ValueError):
            self._pos = 0  # a pipe: offsets count from where we start writing

    def _error(self, problem: str, entry: str | None = None) -> ZipsliceError:
        return ZipsliceError(self._path, problem, entry)

    # -- records -----------------------------------------------------------------------------------
    def write_record(self, name: str, data: bytes | bytearray | memoryview) -> int:
        """Write a record whose bytes are all in memory (CRC first, no seek); return its CRC32."""
        data = memoryview(data).cast("B")
        return self.write_known(name, data, zlib.crc32(data))

    def write_known(self, name: str, data: bytes | bytearray | memoryview, crc: int,
                    chunk: int = 64 << 20, progress=None) -> int:
        """Write a record of ``data`` whose CRC32 is already known; never seeks (works on a pipe)."""
        data = memoryview(data).cast("B")
        size = data.nbytes
        self._header(name, size, crc)
        for i in range(0, size, chunk):
            piece = data[i:i + chunk]
            self._write(piece)
            if progress is not None:
                progress(piece.nbytes)
        self._entries[-1].crc = crc
        return crc

    def write_chunks(self, name: str, size: int, chunks, progress=None, tensor: str | None = None) -> int:
        """Write a record of ``size`` bytes given as consecutive buffers, computing its CRC32 as they stream
        through, then patching it into the local header: the output must be seekable. Returns the CRC32.
        ZipsliceError (naming ``tensor``, default the record) when the buffers do not add up to ``size``."""
        from .crc import crc32

        self._header(name, size, 0)
        entry = self._entries[-1]
        crc, done = 0, 0
        for piece in chunks:
            piece = memoryview(piece).cast("B")
            done += piece.nbytes
            if done > size:
                raise self._error(f"the tensor's bytes exceed the {size} announced", tensor or name)
            crc = crc32(piece, crc)
            self._write(piece)
            if progress is not None:
                progress(piece.nbytes)
            del piece  # let go of it before the next is made (a frame, not two, held here)
        if done != size:
            raise self._error(f"the tensor gave {done} bytes, {size} announced", tensor or name)
        self._f.seek(entry.header_offset + _CRC_FIELD_OFFSET)
        self._f.write(struct.pack("<I", crc))
        self._f.seek(self._pos)
        entry.crc = crc
        return crc

    def _write(self, b) -> None:
        self._f.write(b)
        self._pos += memoryview(b).nbytes

    def _header(self, name: str, size: int, crc: int) -> None:
        if self._closed:
            raise self._error("zip writer already closed", name)
        bname = name.encode("utf-8")
        offset = self._pos
        zip64_local = self._force64 or size >= _U32_MAX
        extra = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, size, size) if zip64_local else b""
        base = offset + 30 + len(bname) + len(extra) + 4
        pad = (-base) % self._alignment
        extra += struct.pack("<HH", _PAD_EXTRA_ID, pad) + b"Z" * pad
        size32 = _U32_MAX if zip64_local else size
        # one write for the whole header (the file may be a pipe: fewer, larger writes)
        self._write(struct.pack("<IHHHHHIIIHH", _LOCAL_SIG, 45 if zip64_local else 20, _FLAG_UTF8, 0, 0,
                                _DOS_DATE_1980_01_01, crc, size32, size32, len(bname), len(extra)) + bname + extra)
        self._entries.append(_Entry(bname, offset, size, crc, zip64_local))

    # -- directory ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cd_offset = self._pos
        parts = []
        for e in self._entries:
            big_size = self._force64 or e.size >= _U32_MAX
            big_off = self._force64 or e.header_offset >= _U32_MAX
            fields = ([e.size, e.size] if big_size else []) + ([e.header_offset] if big_off else [])
            extra = struct.pack(f"<HH{len(fields)}Q", _ZIP64_EXTRA_ID, 8 * len(fields), *fields) if fields else b""
            size32 = _U32_MAX if big_size else e.size
            off32 = _U32_MAX if big_off else e.header_offset
            version = 45 if fields else 20
            parts.append(struct.pack("<IHHHHHHIIIHHHHHII", _CENTRAL_SIG, version, version, _FLAG_UTF8, 0, 0,
                                     _DOS_DATE_1980_01_01, e.crc, size32, size32, len(e.name), len(extra), 0, 0,
                                     0, 0, off32))
            parts.append(e.name)
            parts.append(extra)
        self._write(b"".join(parts))
        cd_end = self._pos
        cd_size = cd_end - cd_offset
        count = len(self._entries)
        if self._force64 or count >= _U16_MAX or cd_offset >= _U32_MAX or cd_size >= _U32_MAX:
            self._write(struct.pack("<IQHHIIQQQQ", _ZIP64_EOCD_SIG, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset))
            self._write(struct.pack("<IIQI", _ZIP64_LOCATOR_SIG, 0, cd_end, 1))
            self._write(struct.pack("<IHHHHIIH", _EOCD_SIG, 0, 0, min(count, _U16_MAX), min(count, _U16_MAX),
                                min(cd_size, _U32_MAX), min(cd_offset, _U32_MAX), 0))
        else:
            self._write(struct.pack("<IHHHHIIH", _EOCD_SIG, 0, 0, count, count, cd_size, cd_offset, 0))
