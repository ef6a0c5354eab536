"""Write-side zip for torch checkpoints: stored records, data aligned, CRC computed while streaming, zip64.

The layout follows what ``torch.save`` (PyTorchStreamWriter) produces: no compression, each record's data
aligned to ``alignment`` bytes by padding the local header's extra field with a ``FB`` block of ``Z`` bytes,
UTF-8 names. Sizes are known before the data, so the local header carries them directly (no data
descriptor); its CRC field is patched in place once the record's bytes have streamed through
``zlib.crc32``. Zip64 fields are written only where a size, an offset or the entry count needs them
(or everywhere with ``force_zip64=True``, which tests use to exercise that path on small files).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterable

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

    def _error(self, problem: str, entry: str | None = None) -> ZipsliceError:
        return ZipsliceError(self._path, problem, entry)

    # -- records -----------------------------------------------------------------------------------
    def write_record(self, name: str, data: bytes | bytearray | memoryview) -> None:
        data = memoryview(data).cast("B")
        self.write_stream(name, data.nbytes, [data])

    def write_stream(self, name: str, size: int, chunks: Iterable[bytes | bytearray | memoryview]) -> int:
        """Write a record of exactly ``size`` bytes from ``chunks``; return its CRC32."""
        if self._closed:
            raise self._error("zip writer already closed", name)
        f = self._f
        bname = name.encode("utf-8")
        offset = f.tell()
        zip64_local = self._force64 or size >= _U32_MAX
        extra = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, size, size) if zip64_local else b""
        base = offset + 30 + len(bname) + len(extra) + 4
        pad = (-base) % self._alignment
        extra += struct.pack("<HH", _PAD_EXTRA_ID, pad) + b"Z" * pad
        size32 = _U32_MAX if zip64_local else size
        f.write(struct.pack("<IHHHHHIIIHH", _LOCAL_SIG, 45 if zip64_local else 20, _FLAG_UTF8, 0, 0,
                            _DOS_DATE_1980_01_01, 0, size32, size32, len(bname), len(extra)))
        f.write(bname)
        f.write(extra)
        crc, written = 0, 0
        for chunk in chunks:
            n = memoryview(chunk).nbytes
            if written + n > size:
                raise self._error(f"record is longer than the {size} bytes announced", name)
            crc = zlib.crc32(chunk, crc)
            f.write(chunk)
            written += n
        if written != size:
            raise self._error(f"record has {written} bytes, {size} were announced", name)
        end = f.tell()
        f.seek(offset + _CRC_FIELD_OFFSET)
        f.write(struct.pack("<I", crc))
        f.seek(end)
        self._entries.append(_Entry(bname, offset, size, crc, zip64_local))
        return crc

    # -- directory ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        f = self._f
        cd_offset = f.tell()
        for e in self._entries:
            big_size = self._force64 or e.size >= _U32_MAX
            big_off = self._force64 or e.header_offset >= _U32_MAX
            fields = ([e.size, e.size] if big_size else []) + ([e.header_offset] if big_off else [])
            extra = struct.pack(f"<HH{len(fields)}Q", _ZIP64_EXTRA_ID, 8 * len(fields), *fields) if fields else b""
            size32 = _U32_MAX if big_size else e.size
            off32 = _U32_MAX if big_off else e.header_offset
            version = 45 if fields else 20
            f.write(struct.pack("<IHHHHHHIIIHHHHHII", _CENTRAL_SIG, version, version, _FLAG_UTF8, 0, 0,
                                _DOS_DATE_1980_01_01, e.crc, size32, size32, len(e.name), len(extra), 0, 0, 0,
                                0, off32))
            f.write(e.name)
            f.write(extra)
        cd_end = f.tell()
        cd_size = cd_end - cd_offset
        count = len(self._entries)
        if self._force64 or count >= _U16_MAX or cd_offset >= _U32_MAX or cd_size >= _U32_MAX:
            f.write(struct.pack("<IQHHIIQQQQ", _ZIP64_EOCD_SIG, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset))
            f.write(struct.pack("<IIQI", _ZIP64_LOCATOR_SIG, 0, cd_end, 1))
            f.write(struct.pack("<IHHHHIIH", _EOCD_SIG, 0, 0, min(count, _U16_MAX), min(count, _U16_MAX),
                                min(cd_size, _U32_MAX), min(cd_offset, _U32_MAX), 0))
        else:
            f.write(struct.pack("<IHHHHIIH", _EOCD_SIG, 0, 0, count, count, cd_size, cd_offset, 0))
