"""Lazy reader of the pre-1.6 torch format (``torch.save(..., _use_new_zipfile_serialization=False)``).

The file is a sequence of pickles -- magic number, protocol version, sys_info, the object (storages as
persistent ids), the list of storage keys -- followed by each storage in key order as an 8-byte element
count and its raw bytes. Opening interprets the pickles with the same restricted machine as the zip
format and reads one 8-byte header per storage; tensors are then positioned reads like the zip format.
(The even older tar-based format of torch < 0.4 is refused.)
"""
from __future__ import annotations

import os
import struct
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .fileio import pread_exact
from .torch_reader import MAX_PICKLE_BYTES, StorageRecord, TorchCheckpoint, _storage_from_pid
from .unpickler import NeedMoreData, RestrictedUnpickler, StorageRef

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
_FIRST_READ = 1 << 20


class LegacyTorchCheckpoint(TorchCheckpoint):
    """A pre-1.6 torch checkpoint as a lazy, read-only ``Mapping[str, torch.Tensor]``."""

    format = "torch-legacy"

    def _open(self) -> None:
        fd = self._fd(self.path)
        size = self._size = os.fstat(fd).st_size
        want = min(size, _FIRST_READ)
        while True:  # the pickles' total length is unknown up front: read more only if they need it
            head = bytes(pread_exact(fd, want, 0, self.path))
            try:
                obj, keys, end, storages = self._parse_pickles(head)
                break
            except NeedMoreData:
                if want >= size:
                    raise CorruptCheckpointError(self.path, "the file ends inside its pickles (truncated?)") from None
                if want >= MAX_PICKLE_BYTES:
                    raise CorruptCheckpointError(
                        self.path, f"the pickled object is larger than {MAX_PICKLE_BYTES} bytes; refusing") from None
                want = min(size, want * 4, MAX_PICKLE_BYTES)
        self._locate_storages(fd, size, keys, end, storages)
        self._index(obj, "pickle", end, self._legacy_record)

    def _parse_pickles(self, head: bytes):
        def no_pid(pid: Any):
            raise CorruptCheckpointError(self.path, "persistent id outside the object pickle", "header")

        pos = 0
        values = []
        for entry in ("magic number", "protocol version", "sys_info"):
            u = RestrictedUnpickler(head, self.path, entry, no_pid, start=pos, source_size=self._size)
            values.append(u.load())
            pos = u.end
        magic, proto, sys_info = values
        if magic != MAGIC_NUMBER:
            raise CorruptCheckpointError(self.path, "not a torch legacy file (wrong magic number)", "magic number")
        if proto != PROTOCOL_VERSION:
            raise UnsupportedCheckpointError(self.path, f"legacy protocol version {proto!r}, expected 1001",
                                             "protocol version")
        if not isinstance(sys_info, dict):
            raise CorruptCheckpointError(self.path, "sys_info is not a dict", "sys_info")
        self.byteorder = "little" if sys_info.get("little_endian", True) else "big"
        storages: dict[str, StorageRef] = {}

        def persistent_load(pid: Any) -> StorageRef:
            if isinstance(pid, str):  # protocol 0 writes a persistent id as text: torch.load cannot read it either
                raise UnsupportedCheckpointError(
                    self.path, "storage ids are pickled as text (pickle protocol 0); neither torch.load nor "
                               "zipslice can read them -- re-save with pickle_protocol >= 1", "pickle")
            return _storage_from_pid(pid, storages, legacy=True)

        u = RestrictedUnpickler(head, self.path, "pickle", persistent_load, start=pos, source_size=self._size)
        obj = u.load()
        u = RestrictedUnpickler(head, self.path, "storage keys", no_pid, start=u.end, source_size=self._size)
        keys = u.load()
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CorruptCheckpointError(self.path, "the storage key list is malformed", "storage keys")
        return obj, keys, u.end, storages

    def _locate_storages(self, fd: int, size: int, keys: list[str], pos: int, storages: dict[str, StorageRef]) -> None:
        fmt = "<q" if self.byteorder == "little" else ">q"
        for key in keys:
            ref = storages.get(key)
            if ref is None:
                raise CorruptCheckpointError(self.path, "storage listed but never used: its element size is unknown",
                                             f"storage {key}")
            (numel,) = struct.unpack(fmt, pread_exact(fd, 8, pos, self.path, f"storage {key}"))
            if numel != ref.numel:
                raise CorruptCheckpointError(
                    self.path, f"storage header says {numel} elements, the pickle says {ref.numel}", f"storage {key}")
            if pos + 8 + ref.nbytes > size:
                raise CorruptCheckpointError(
                    self.path, f"storage needs bytes {pos + 8}..{pos + 8 + ref.nbytes} but the file has {size} "
                               "(truncated?)", f"storage {key}")
            name = f"storage/{key}"
            self._storages[name] = StorageRecord(name, ref.nbytes, pos + 8)
            pos += 8 + ref.nbytes
        missing = set(storages) - set(keys)
        if missing:
            raise CorruptCheckpointError(self.path, f"storages {sorted(missing)[:5]} have no data in the file")

    def _legacy_record(self, ref: StorageRef, tensor_name: str) -> StorageRecord:
        return self._storages[f"storage/{ref.key}"]
