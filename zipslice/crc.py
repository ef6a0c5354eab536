"""CRC-32 (the zip checksum) of large buffers, at memory speed.

Writing a torch checkpoint needs the CRC-32 of every tensor's bytes before its zip header. Python's ``zlib``
(zlib 1.2.x) computes it at ~3.8 GiB/s here: 0.11 s of CPU per 414 MiB checkout. ``zlib-ng`` (a dependency)
uses the CPU's carry-less multiply (PCLMULQDQ / PMULL) and does the same at ~25 GiB/s, bit for bit the same
value. Without it (a platform with no wheel) ``zlib`` is used.
"""
from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; a missing wheel only costs speed
    from zlib import crc32 as _crc32

IMPLEMENTATION = _crc32.__module__


def crc32(data, value: int = 0) -> int:
    """The CRC-32 of ``data`` (any contiguous buffer) continuing from ``value``, as ``zlib.crc32`` computes it."""
    return _crc32(data, value)
