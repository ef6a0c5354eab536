"""Lazy reader of torch zip checkpoints (``torch.save`` since torch 1.6).

Opening reads the zip central directory, each record's local header and ``data.pkl``; the pickle is
interpreted by :mod:`zipslice.unpickler` (allowlist only). Reading a tensor is one positioned read of
exactly its byte span -- or, for tensors that share a storage (tied weights), one read of the union
of their spans, shared by the views built on it as ``torch.load`` shares them.

The returned tensor has the saved dtype, shape, strides, requires_grad and Parameter-ness. Its
``storage_offset()`` counts from the start of the bytes read, not from the start of the saved storage
(0 for an untied tensor; for tied tensors, relative to the union span rounded down to 16 bytes).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import mmap
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import dtypes, optional, structure
from .base import LazyCheckpoint
from .errors import CorruptCheckpointError, NotACheckpointError, UnsupportedCheckpointError
from .info import TensorInfo, span_elements
from .unpickler import (PickledOrderedDict, RestrictedUnpickler, StorageRef, StorageType, TensorRef, TorchDevice,
                        TorchDType, TorchSize, PickleFault)
from .zipfmt import STORED, ZipIndex, ZipMember

# data.pkl holds only metadata (a few hundred bytes per tensor); anything past this is not a checkpoint.
MAX_PICKLE_BYTES = 256 << 20
MAX_DEPTH = 200
# zipslice's writer keeps file-level string metadata here (torch.load ignores the record); it may hold
# a container layout (zipslice.convert), so allow far more than a safetensors header's usual few KiB
METADATA_RECORD = ".data/zipslice_metadata.json"
MAX_METADATA_BYTES = 64 << 20
_UNION_ALIGN = 16  # the widest element (complex128): keeps every tied view's offset a whole element
_HUGE_BUFFER = 4 << 20  # from this size, read into transparent-huge-page memory


class ReadBuffers:
    """Writable uint8 torch tensors to read tensor bytes into.

    Large buffers come from an anonymous mapping advised MADV_HUGEPAGE: filling fresh 4 KiB pages costs
    a page fault each, which made reading from the page cache several times slower than the copy itself.
    Up to two mappings are pooled and reused once no tensor uses them any more (their buffer export is
    gone): streaming tensor after tensor -- one held by the caller, the next one read ahead -- then fills
    already-mapped memory, and memory stays within two buffers of the largest tensor read.
    Thread-safe: the read-ahead thread claims buffers too.
    """

    POOL = 2

    def __init__(self) -> None:
        self._pool: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def _free(self, i: int) -> bool:
        mm = self._pool[i]
        # references: the pool list, the local name, getrefcount's argument; more means a tensor still uses it
        return sys.getrefcount(mm) == 3

    def get(self, n: int, allocate: bool = True):
        """A buffer of ``n`` bytes; with ``allocate=False``, None rather than a third large mapping."""
        import torch

        if n < _HUGE_BUFFER:
            return torch.empty(n, dtype=torch.uint8)
        with self._lock:
            free = [i for i in range(len(self._pool)) if self._free(i)]
            for i in free:
                if n <= len(self._pool[i]) <= 2 * n:
                    return torch.frombuffer(self._pool[i], dtype=torch.uint8, count=n)
            if not allocate and len(self._pool) - len(free) >= self.POOL:
                return None
            mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:  # THP disabled in this kernel: plain pages, same result
                    pass
            # keep the newest POOL mappings, dropping a free (wrong-sized) one first
            self._pool.append(mm)
            if len(self._pool) > self.POOL:
                del self._pool[free[0] if free else 0]
            return torch.frombuffer(mm, dtype=torch.uint8)

    def clear(self) -> None:
        with self._lock:
            self._pool.clear()


class ReadAhead:
    """One tensor's bytes being read on a background thread while the caller works on the previous one.

    ``os.preadv`` releases the GIL, so on a multi-core machine the copy from the page cache (or the disk)
    overlaps the caller's computation. The thread waits for a pooled buffer to come free rather than map
    a third one; if the caller asks for the key before the read has started, it is cancelled and the
    caller reads it itself. A failed read is dropped: the caller's own read then raises the error.
    """

    _POLL_S = 0.0002

    def __init__(self, key: str, span: tuple[int, int], read: Callable[[memoryview], None], buffers: ReadBuffers):
        self.key, self.span = key, span
        self._read, self._buffers = read, buffers
        self._lock = threading.Lock()
        self._started = False
        self._cancelled = False
        self._done = threading.Event()
        self.raw = None
        self._thread = threading.Thread(target=self._run, name=f"zipslice read-ahead {key[:40]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            lo, hi = self.span
            while True:
                # claim under the lock: a cancelled read-ahead must never hold a buffer, even for a moment,
                # or the caller's own read would find the pool busy and map a third buffer
                with self._lock:
                    if self._cancelled:
                        return
                    raw = self._buffers.get(hi - lo, allocate=False)
                    if raw is not None:
                        self._started = True
                        break
                time.sleep(self._POLL_S)
            self._read(memoryview(raw.numpy()))
            self.raw = raw
        except Exception:  # noqa: BLE001 -- dropped on purpose: the caller's own read reports it
            self.raw = None
        finally:
            self._done.set()

    def take(self):
        """The filled buffer, or None if the caller must read the key itself."""
        with self._lock:
            if not self._started:
                self._cancelled = True
        self._done.wait()
        raw, self.raw = self.raw, None
        return raw

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
        if threading.current_thread() is not self._thread:  # a finalizer may run on the thread itself
            self._thread.join()
        self.raw = None


@dataclass(frozen=True)
class StorageRecord:
    """Where a storage's bytes live: a zip member (stored or deflated) or a raw file range."""

    name: str
    nbytes: int
    data_offset: int | None   # absolute file offset of byte 0 of a raw file range (legacy format), else None
    member: ZipMember | None = None  # the zip member; its data offset is read lazily (_data_offset)


class Flattener:
    """Turns the unpickled tree into a structure node, tensor references and extras by flat name."""

    def __init__(self, path: str, entry: str, budget: int):
        self.path, self.entry = path, entry
        self.budget = budget
        self.tensors: dict[str, TensorRef] = {}
        self.extras: dict[str, Any] = {}

    def _unsupported(self, name: str, problem: str) -> UnsupportedCheckpointError:
        if len(name) > 120:
            name = name[:117] + "..."
        return UnsupportedCheckpointError(self.path, problem, name or self.entry)

    def _claim(self, name: str) -> None:
        if name in self.tensors or name in self.extras:
            raise self._unsupported(name, "two leaves flatten to the same name (a key contains '/'?)")

    def node(self, obj: Any, name: str = "", depth: int = 0, leaves: bool = True) -> dict:
        """``leaves=False`` builds nodes without registering tensors/extras (``_metadata`` subtrees)."""
        self.budget -= 1
        if self.budget < 0:
            raise CorruptCheckpointError(
                self.path, "the pickled tree expands far beyond the pickle's size (shared sub-containers "
                           "repeated?); refusing to expand it", self.entry)
        if depth > MAX_DEPTH:
            raise self._unsupported(name, f"containers nested deeper than {MAX_DEPTH} levels (or a cycle)")
        if isinstance(obj, TensorRef):
            if not leaves:
                raise self._unsupported(name, "a tensor inside an OrderedDict's _metadata")
            self._claim(name)
            self.tensors[name] = obj
            return {"tensor": name}
        if isinstance(obj, PickledOrderedDict):
            node: dict = {"odict": self._items(obj, name, depth, leaves)}
            other = set(obj.state) - {"_metadata"}
            if other:
                raise self._unsupported(name, f"OrderedDict with attributes {sorted(other)} besides _metadata")
            if "_metadata" in obj.state:
                node["metadata"] = self.node(obj.state["_metadata"], name, depth + 1, leaves=False)
            return node
        if isinstance(obj, dict):
            return {"dict": self._items(obj, name, depth, leaves)}
        if isinstance(obj, TorchSize):
            return self._value({"torch": "size", "value": list(obj)}, name, leaves)
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [self.node(v, structure.join(name, i), depth + 1, leaves) for i, v in enumerate(obj)]}
        if isinstance(obj, TorchDType):
            return self._value({"torch": "dtype", "value": obj.name}, name, leaves)
        if isinstance(obj, TorchDevice):
            return self._value({"torch": "device", "value": obj.spec}, name, leaves)
        if obj is None or isinstance(obj, (bool, int, str, float, bytes, bytearray)):
            return self._value(structure.value_node(obj), name, leaves)
        if isinstance(obj, StorageRef):
            raise self._unsupported(name, "a bare storage (not a tensor) is not supported")
        raise self._unsupported(name, f"a {type(obj).__name__} value cannot be represented")

    def _items(self, d: dict, name: str, depth: int, leaves: bool) -> list:
        out = []
        for k, v in d.items():
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise self._unsupported(name, f"dict key of type {type(k).__name__}")
            out.append([k, self.node(v, structure.join(name, k), depth + 1, leaves)])
        return out

    def _value(self, node: dict, name: str, leaves: bool) -> dict:
        if leaves:
            self._claim(name)
            self.extras[name] = node if "torch" in node else structure.leaf_value(node)
        return node


def validate_tensor(path: str, name: str, ref: TensorRef, rec_nbytes: int) -> tuple[int, int]:
    """Check a tensor against its storage; returns (byte offset in storage, span bytes)."""
    if ref.dtype not in dtypes.BY_NAME:
        raise UnsupportedCheckpointError(path, f"dtype {ref.dtype} is not supported", name)
    itemsize = dtypes.get(ref.dtype).itemsize
    if ref.storage_offset < 0 or any(s < 0 for s in ref.shape) or any(s < 0 for s in ref.stride):
        raise CorruptCheckpointError(
            path, f"negative storage offset/size/stride ({ref.storage_offset}, {ref.shape}, {ref.stride})", name)
    n = span_elements(ref.shape, ref.stride)
    start = ref.storage_offset * itemsize
    span = n * itemsize
    if n and start + span > rec_nbytes:
        raise CorruptCheckpointError(
            path, f"the view (offset {ref.storage_offset}, size {ref.shape}, stride {ref.stride}) reaches byte "
                  f"{start + span} but its storage {ref.storage.key!r} has {rec_nbytes} bytes", name)
    return start, span


def swap_bytes(buf: np.ndarray, dtype: str) -> None:
    """Big-endian to little-endian in place (complex: each half)."""
    dt = dtypes.get(dtype)
    unit = dt.itemsize // 2 if dt.kind == "complex" else dt.itemsize
    if unit > 1:
        usable = len(buf) - len(buf) % unit
        v = buf[:usable].view(f"<u{unit}")
        v.byteswap(inplace=True)


class TorchCheckpoint(LazyCheckpoint):
    """A torch zip checkpoint as a lazy, read-only ``Mapping[str, torch.Tensor]``."""

    format = "torch"
    plain_spans = True  # stored members: offset set; compressed ones have none (iter_plain declines)
    #: read the next large tensor on a background thread while keys are read in order (see ReadAhead).
    #: Off by default: on the 2-core reference VM the thread's copy competes with the caller's own work
    #: for the cores and memory bandwidth, and it needs a second pooled buffer. Streaming read + sum,
    #: `scripts/bench/read.py --sizes 1,8 --no-full-load --repeat 3 --read-ahead`: 8 GiB 0.81 s / +68 MiB
    #: without it, 1.20 s / +132 MiB with it; 1 GiB 0.126 s vs 0.182 s. Turn it on (class or instance
    #: attribute) where spare cores exist and the caller computes between reads.
    read_ahead = False

    def __init__(self, path: str | os.PathLike, mmap: bool = False):
        super().__init__(path)
        self.mmap = mmap
        self._storages: dict[str, StorageRecord] = {}
        self._unresolved: set[str] = set()  # keys whose TensorInfo.offset awaits their record's local header
        self._ties: dict[str, list[str]] = {}
        self._live: dict[str, list[weakref.ref]] = {}   # storage -> live tensors built on one read
        self._live_lo: dict[str, int] = {}               # storage -> byte offset that read started at
        self._buffers = ReadBuffers()
        self._order: dict[str, int] | None = None      # key -> position, to tell reads in order
        self._keys: list[str] = []
        self._last_read = -1
        self._read_ahead: ReadAhead | None = None
        self.prefix = ""
        self.byteorder = "little"
        # opening builds one small object per pickle opcode; the cyclic GC re-scanning them all again and
        # again made open time grow faster than the tensor count (there are no cycles to collect here)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self._open()
        except BaseException:
            self.close()  # do not leave the file open behind a refused checkpoint
            raise
        finally:
            if gc_was_on:
                gc.enable()

    # -- opening -----------------------------------------------------------------------------------
    def _open(self) -> None:
        zi = self._zip = ZipIndex(self._fd(self.path), self.path)
        self.prefix = prefix = self._find_prefix(zi)
        if prefix + "byteorder" in zi.members:
            order = zi.read_member(prefix + "byteorder", 16).decode("ascii", "replace").strip()
            if order not in ("little", "big"):
                raise CorruptCheckpointError(self.path, f"byteorder is {order!r}, not 'little' or 'big'",
                                             prefix + "byteorder")
            self.byteorder = order
        entry = prefix + "data.pkl"
        pickle = zi.read_member(entry, MAX_PICKLE_BYTES)
        storages: dict[str, StorageRef] = {}

        def persistent_load(pid: Any) -> StorageRef:
            return _storage_from_pid(pid, storages, legacy=False)

        obj = RestrictedUnpickler(pickle, self.path, entry, persistent_load).load()
        self._index(obj, entry, len(pickle), self._zip_record)
        if prefix + METADATA_RECORD in zi.members:
            self.metadata = self._read_metadata(prefix + METADATA_RECORD)

    def _read_metadata(self, entry: str) -> dict[str, str]:
        raw = self._zip.read_member(entry, MAX_METADATA_BYTES)
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptCheckpointError(self.path, f"metadata is not UTF-8 JSON: {e}", entry) from None
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CorruptCheckpointError(self.path, "metadata must be a JSON object of string to string", entry)
        return meta

    def _find_prefix(self, zi: ZipIndex) -> str:
        # torch names records "<archive>/..."; the archive name is whatever the file was saved as.
        if zi.order:
            first = zi.order[0]
            head = first.split("/", 1)[0] + "/" if "/" in first else ""
            if head + "data.pkl" in zi.members:
                return head
        found = [n[: -len("data.pkl")] for n in zi.order if n.endswith("data.pkl") and n.count("/") <= 1
                 and (n == "data.pkl" or n.endswith("/data.pkl"))]
        if len(found) == 1:
            return found[0]
        if not found:
            raise NotACheckpointError(self.path, "the zip archive has no data.pkl record; not a torch checkpoint")
        raise CorruptCheckpointError(self.path, f"the zip archive has several data.pkl records: {found}")

    def _zip_record(self, ref: StorageRef, tensor_name: str) -> StorageRecord:
        name = f"data/{ref.key}"
        rec = self._storages.get(name)
        if rec is not None:
            return rec
        member = self._zip.members.get(self.prefix + name)
        if member is None:
            raise CorruptCheckpointError(self.path, f"storage record {self.prefix + name} is missing", tensor_name)
        self._zip.check_readable(member)
        rec = StorageRecord(name, member.size, None, member)
        self._storages[name] = rec
        return rec

    def _index(self, obj: Any, entry: str, pickle_len: int,
               record: Callable[[StorageRef, str], StorageRecord]) -> None:
        flat = Flattener(self.path, entry, budget=2 * pickle_len + 1024)
        self.structure = flat.node(obj)
        self.extras = flat.extras
        for name, ref in flat.tensors.items():
            rec = record(ref.storage, name)
            if rec.nbytes != ref.storage.nbytes:
                raise CorruptCheckpointError(
                    self.path, f"storage record {rec.name} has {rec.nbytes} bytes but the pickle declares "
                               f"{ref.storage.numel} x {ref.storage.dtype} = {ref.storage.nbytes} bytes", name)
            start, span = validate_tensor(self.path, name, ref, rec.nbytes)
            if rec.member is not None and rec.member.method == STORED:
                self._unresolved.add(name)  # offset filled in from the local header by info()
            self._infos[name] = TensorInfo(
                name=name, dtype=ref.dtype, shape=ref.shape, stride=ref.stride, storage=rec.name,
                storage_offset=ref.storage_offset,
                offset=None if rec.data_offset is None else rec.data_offset + start,
                span_nbytes=span, file=self.path, storage_nbytes=rec.nbytes, byteorder=self.byteorder,
                is_parameter=ref.is_parameter, requires_grad=ref.requires_grad)
            self._ties.setdefault(rec.name, []).append(name)

    # -- metadata ----------------------------------------------------------------------------------
    def info(self, key: str) -> TensorInfo:
        info = super().info(key)
        if key in self._unresolved:
            info = self._resolve(key, self._zip.resolve(self._storages[info.storage].member))
        return info

    def infos(self) -> list[TensorInfo]:
        if self._unresolved:  # every local header in one batch
            keys = [k for k in self._infos if k in self._unresolved]
            members = self._zip.resolve_many([self._storages[self._infos[k].storage].member for k in keys])
            for k, m in zip(keys, members):
                self._resolve(k, m)
        return list(self._infos.values())

    def _resolve(self, key: str, member: ZipMember) -> TensorInfo:
        info = self._infos[key]
        info = self._infos[key] = dataclasses.replace(
            info, offset=member.data_offset + info.storage_offset * info.itemsize)
        self._unresolved.discard(key)
        return info

    def _data_offset(self, rec: StorageRecord) -> int | None:
        """File offset of a stored record's byte 0 (its local header is read once); None when compressed."""
        m = rec.member
        if m is None:
            return rec.data_offset
        if m.method != STORED:
            return None
        return self._zip.resolve(m).data_offset

    # -- reading -----------------------------------------------------------------------------------
    def _read_into(self, rec: StorageRecord, start: int, out: memoryview, entry: str) -> None:
        """Fill ``out`` with bytes ``start..start+len(out)`` of a storage."""
        n = len(out)
        base = self._data_offset(rec)
        if base is not None:
            fd = self._fd(self.path)
            if base + start + n > os.fstat(fd).st_size:
                raise CorruptCheckpointError(self.path, "storage runs past the end of the file (truncated?)", entry)
            got = 0
            while got < n:
                k = os.preadv(fd, [out[got:]], base + start + got)
                if k == 0:
                    raise CorruptCheckpointError(self.path, f"unexpected end of file at {base + start + got}", entry)
                got += k
            self._read_done(fd, base + start, n)
        else:
            self._fd(self.path)  # raises if closed
            out[:] = self._compressed_range(rec, start, n)

    def _compressed_range(self, rec: StorageRecord, start: int, n: int) -> bytearray:
        assert rec.member is not None
        return self._zip.read_range(rec.member, start, n)

    def _read_span(self, info: TensorInfo) -> np.ndarray:
        """The span's bytes (``numpy()``, ``read_bytes()``) in an uninitialised uint8 array: a bytearray
        would zero-fill every page first, a second pass over a large tensor for nothing."""
        self._reading_in_order(info.name)
        rec = self._storages[info.storage]
        buf = np.empty(info.span_nbytes, dtype=np.uint8)
        start = info.storage_offset * info.itemsize if info.span_nbytes else 0
        self._read_into(rec, start, memoryview(buf), info.name)
        return buf

    def tensor(self, key: str):
        """The tensor as ``torch.load(weights_only=True)`` gives it; tied keys share one storage (needs torch)."""
        torch = optional.torch()

        sequential = self._reading_in_order(key)
        info = self.info(key)
        group = self._ties.get(info.storage, [key])
        shared = len(group) > 1 and info.span_nbytes > 0
        if shared and info.byteorder == "big":
            units = {dtypes.get(self._infos[k].dtype).itemsize for k in group}
            shared = len(units) == 1
        base_lo = 0
        storage = None
        if shared:
            storage, base_lo = self._live_storage(info.storage)
        if storage is None:
            lo, hi = self._span([self._infos[k] for k in group] if shared else [info], shared)
            rec = self._storages[info.storage]
            if self.mmap and hi > lo and self._data_offset(rec) is not None:
                raw = self._map_span(rec, lo, hi, key)
            else:
                raw = self._take_read_ahead(key, (lo, hi))
            if raw is None:
                raw = self._buffers.get(hi - lo)
                if hi > lo:
                    self._read_into(rec, lo, memoryview(raw.numpy()), key)
            if hi > lo and info.byteorder == "big":
                swap_bytes(raw.numpy(), info.dtype)
            storage, base_lo = raw.untyped_storage(), lo
            if sequential:
                self._prefetch_after(key)
        itemsize = info.itemsize
        rel = (info.storage_offset * itemsize - base_lo) // itemsize if info.span_nbytes else 0
        t = torch.empty(0, dtype=dtypes.to_torch(info.dtype)).set_(storage, rel, info.shape, info.stride)
        if info.is_parameter:
            t = torch.nn.Parameter(t, requires_grad=info.requires_grad)
        elif info.requires_grad:
            t.requires_grad_(True)
        if shared:
            refs = [r for r in self._live.get(info.storage, []) if r() is not None]
            refs.append(weakref.ref(t))
            self._live[info.storage] = refs
            self._live_lo[info.storage] = base_lo
        return t

    def _map_span(self, rec: StorageRecord, lo: int, hi: int, entry: str):
        """Bytes ``lo..hi`` of a stored record as a private (copy-on-write) mapping of just those pages.

        The tensor built on it keeps the mapping alive; it is unmapped when the last such tensor dies.
        """
        import torch

        fd = self._fd(self.path)
        base = self._data_offset(rec)
        start = base + lo
        if base + hi > os.fstat(fd).st_size:
            raise CorruptCheckpointError(self.path, "storage runs past the end of the file (truncated?)", entry)
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, hi - lo + start - aligned, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned)
        # ask for the whole span now (asynchronous read-ahead of just these pages): streaming an 8 GiB file
        # with 4 GiB of RAM took 7.7-8.0 s this way, 14.8-15.0 s with MADV_SEQUENTIAL, 9.6-10.3 s with
        # MADV_POPULATE_READ; with a warm cache all three cost the same
        if hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)
        return torch.frombuffer(mm, dtype=torch.uint8, count=hi - lo, offset=start - aligned)

    @staticmethod
    def _span(members: list[TensorInfo], shared: bool) -> tuple[int, int]:
        """Storage byte range to read for these views (one view, or every view of a tied storage)."""
        spans = [(i.storage_offset * i.itemsize, i.storage_offset * i.itemsize + i.span_nbytes)
                 for i in members if i.span_nbytes]
        if not spans:
            return 0, 0
        lo = min(a for a, _ in spans)
        lo -= lo % _UNION_ALIGN if shared else 0
        return lo, max(b for _, b in spans)

    def _take_read_ahead(self, key: str, span: tuple[int, int]):
        ra, self._read_ahead = self._read_ahead, None
        if ra is None:
            return None
        if ra.key != key or ra.span != span:
            ra.cancel()  # the caller went elsewhere: finish or drop it before anything else is read
            return None
        return ra.take()

    def _reading_in_order(self, key: str) -> bool:
        """Note a read of ``key``; True when it is the key after the last one read (the first key counts).

        Reading in order also resolves every remaining local header in one batch (``infos()``), instead
        of one small read in front of each tensor: a cold-cache stream of a 1 GiB file took 0.88-1.05 s
        that way against 1.58-1.86 s (4 runs each, each after a run of another reader), close to a bare
        ``preadv`` of the known offsets (0.67-0.82 s). A single random read stays lazy."""
        if self._order is None:
            self._order = {k: i for i, k in enumerate(self._infos)}
            self._keys = list(self._infos)
        i = self._order.get(key, -2)
        sequential = i == self._last_read + 1
        self._last_read = i
        if sequential and self._unresolved:
            self.infos()
        return sequential

    def _prefetch_after(self, key: str) -> None:
        """With the opt-in read-ahead, after a read in order, start reading the next key on a background
        thread (large, plain stored records only).

        No ``posix_fadvise(WILLNEED)`` of the next tensor: the kernel's own sequential read-ahead already
        runs ahead of in-order positioned reads, and an explicit WILLNEED of 64 MiB made a cold-cache
        stream of 1 GiB take 1.0 s instead of 0.4 s (it submits the whole range up front, in the caller,
        competing with the read the caller needs now)."""
        if not self.read_ahead or self.mmap:
            return
        i = self._order[key]
        if i + 1 >= len(self._keys):
            return
        nxt = self.info(self._keys[i + 1])
        if nxt.offset is None or not nxt.span_nbytes:
            return
        tied = len(self._ties.get(nxt.storage, ())) > 1
        if not tied and nxt.span_nbytes >= _HUGE_BUFFER:
            rec = self._storages[nxt.storage]
            span = self._span([nxt], False)

            def read(out: memoryview, rec=rec, lo=span[0], name=nxt.name) -> None:
                self._read_into(rec, lo, out, name)

            self._read_ahead = ReadAhead(nxt.name, span, read, self._buffers)

    def _live_storage(self, storage_name: str):
        for r in self._live.get(storage_name, []):
            t = r()
            if t is not None:
                return t.untyped_storage(), self._live_lo[storage_name]
        return None, 0

    def close(self) -> None:
        ra, self._read_ahead = getattr(self, "_read_ahead", None), None
        if ra is not None:
            ra.cancel()
        self._live.clear()
        self._buffers.clear()
        super().close()


def _storage_from_pid(pid: Any, storages: dict[str, StorageRef], legacy: bool) -> StorageRef:
    """A persistent id ('storage', StorageType, key, location, numel[, view_metadata]) as a StorageRef."""
    want = 6 if legacy else 5
    if not isinstance(pid, tuple) or len(pid) != want or pid[0] != "storage":
        raise PickleFault(f"persistent id must be a {want}-tuple starting with 'storage', got {pid!r:.120}")
    _, stype, key, location, numel = pid[:5]
    if not isinstance(stype, StorageType):
        raise PickleFault(f"persistent id storage type is {stype!r:.80}, not a torch storage class")
    if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
        raise PickleFault(f"malformed persistent id {pid!r:.120}")
    if legacy and pid[5] is not None:
        raise PickleFault("storage views (legacy view_metadata) are not supported")
    ref = storages.get(key)
    if ref is None:
        ref = storages[key] = StorageRef(key, stype.dtype, numel, location)
    elif ref.nbytes != numel * dtypes.get(stype.dtype).itemsize:
        raise PickleFault(f"storage {key!r} is declared twice with different sizes")
    return ref
