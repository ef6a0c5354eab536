"""The lazy checkpoint every format returns: an ordered, read-only map of name -> tensor.

Format modules subclass :class:`LazyCheckpoint`, fill ``self._infos`` (ordered) while opening, and
override ``_read_span`` when the bytes are not a plain positioned read of one file.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from . import dtypes, optional, pagecache
from .errors import UnsupportedCheckpointError, ZipsliceError
from .fileio import pread_array, pread_exact, pread_into
from .info import TensorInfo, TensorSource


def restride(span: "bytes | bytearray | memoryview", info: TensorInfo) -> np.ndarray:
    """The values of a strided view over ``span`` as a contiguous array of the dtype's carrier type.

    The carrier (u1/u2/u4/u8/V16) moves raw bits, so this works for every dtype, bfloat16 and float8 too.
    A big-endian span is swapped to little-endian here.
    """
    dt = dtypes.get(info.dtype)
    carrier = dt.carrier
    if info.byteorder == "big" and dt.itemsize > 1:
        if dt.kind == "complex":  # swap each half of a complex number separately
            half = np.dtype(f">u{dt.itemsize // 2}")
            flat = np.frombuffer(span, dtype=half).astype(half.newbyteorder("<"))
            span = flat.tobytes()
        else:
            span = np.frombuffer(span, dtype=carrier.newbyteorder(">")).astype(carrier).tobytes()
    if info.numel == 0:
        return np.empty(info.shape, dtype=carrier)
    flat = np.frombuffer(span, dtype=carrier)
    if info.is_contiguous:
        return flat[: info.numel].reshape(info.shape)
    strides = tuple(s * dt.itemsize for s in info.stride)
    view = np.lib.stride_tricks.as_strided(flat, shape=info.shape, strides=strides, writeable=False)
    return np.ascontiguousarray(view)


class LazyCheckpoint(Mapping):
    """Read-only, ordered ``Mapping[str, torch.Tensor]`` over a checkpoint file; a context manager.

    - ``info(key)``: :class:`TensorInfo` without reading data.
    - ``lsd[key]``: a torch tensor equal bit for bit to what the format's own loader returns (needs torch;
      without it, a :class:`zipslice.errors.MissingDependencyError` naming the extra and what follows).
    - ``numpy(key)``: a numpy array (bfloat16 and float8 as ml_dtypes arrays; ``raw=True`` gives the bits in
      an unsigned carrier type). No torch needed.
    - ``read_bytes(key)``: contiguous C-order little-endian bytes of the values.
    - ``get_slice(key)[index]``: part of a tensor, reading only the bytes it needs (see :mod:`zipslice.slicing`);
      ``get_slice(key, framework="np")`` gives numpy arrays, without torch.
    - ``extras``: non-tensor leaves (ints, strings, ...) by flattened name.
    - ``structure``: the nested container tree (see :mod:`zipslice.structure`), or None for flat formats.
    - ``metadata``: free-form string metadata of the file (safetensors ``__metadata__``), if any.
    """

    format: str = "?"
    #: drop each span from the page cache right after reading it (see :mod:`zipslice.pagecache`).
    #: None (default): only when the checkpoint's files take more than half of the memory the page cache
    #: can have (host, within this process's cgroup) -- it could not stay cached anyway. True/False force.
    drop_behind: bool | None = None

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._infos: dict[str, TensorInfo] = {}
        self.extras: dict[str, Any] = {}
        self.structure: Any = None
        self.metadata: dict[str, str] = {}
        self._fds: dict[str, int] = {}
        self._closed = False
        self._auto_drop: bool | None = None

    # -- Mapping -----------------------------------------------------------------------------------
    def __getitem__(self, key: str):
        return self.tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path!r} format={self.format} tensors={len(self)}>"

    # -- metadata ----------------------------------------------------------------------------------
    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {key!r}") from None

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    # -- data --------------------------------------------------------------------------------------
    def _fd(self, file: str) -> int:
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        fd = self._fds.get(file)
        if fd is None:  # (threads may race here: the first descriptor stored wins, the other is closed)
            opened = os.open(file, os.O_RDONLY)
            fd = self._fds.setdefault(file, opened)
            if fd != opened:
                os.close(opened)
        return fd

    def _read_span(self, info: TensorInfo) -> bytearray:
        """Exactly the bytes of ``info``'s span. Formats whose data is not addressable override this."""
        if info.offset is None:
            raise NotImplementedError(f"{type(self).__name__} must override _read_span for {info.name}")
        return self._read_at(info, array=False)

    def _read_at(self, info: TensorInfo, array: bool = True):
        """One positioned read of ``info``'s span: a numpy uint8 array (huge pages: a cheaper first touch),
        or a bytearray with ``array=False``."""
        fd = self._fd(info.file)
        buf = (pread_array if array else pread_exact)(fd, info.span_nbytes, info.offset, info.file, info.name)
        self._read_done(fd, info.offset, info.span_nbytes)
        return buf

    def _read_done(self, fd: int, offset: int, nbytes: int) -> None:
        """Called after every positioned read of tensor data: drops it from the page cache if need be."""
        if self.dropping_behind():
            pagecache.drop(fd, offset, nbytes)

    def dropping_behind(self) -> bool:
        """Whether reads let go of their pages (``drop_behind``, or the automatic choice)."""
        if self.drop_behind is not None:
            return self.drop_behind
        if self._auto_drop is None:
            self._auto_drop = pagecache.too_big_to_cache(self.data_file_bytes())
        return self._auto_drop

    def data_file_bytes(self) -> int:
        """Total size of the files holding this checkpoint's tensor data."""
        files = {i.file for i in self._infos.values()} or {self.path}
        return sum(os.path.getsize(f) for f in files)

    #: the format keeps each uncompressed tensor's bytes at ``info.offset`` in ``info.file``, read as they are
    #: (no decoding, no child process): :meth:`iter_plain` may read them piece by piece
    plain_spans: bool = False

    def plain_range(self, key: str) -> "tuple[str, int, int] | None":
        """``(file, offset, nbytes)`` when ``file`` holds exactly ``key``'s values as contiguous little-endian
        bytes (what :meth:`read_bytes` returns) at ``offset``, read as they are; None otherwise."""
        info = self.info(key)
        dt = dtypes.get(info.dtype)
        if not (self.plain_spans and info.offset is not None and info.is_contiguous
                and (info.byteorder == "little" or dt.itemsize == 1) and info.span_nbytes == info.nbytes):
            return None
        return info.file, info.offset, info.nbytes

    def iter_plain(self, key: str, buf: "bytearray | memoryview") -> "Iterator[memoryview] | None":
        """The values of ``key`` as contiguous little-endian bytes (what :meth:`read_bytes` returns), read
        piece by piece into ``buf`` -- each piece valid until the next is asked for -- when the file holds
        exactly those bytes at a known offset; None otherwise (then use :meth:`read_bytes`). Hashing a tensor
        this way costs no tensor-sized buffer (no allocation, no page faults, nothing held)."""
        if self.plain_range(key) is None:
            return None
        info = self.info(key)
        view = memoryview(buf).cast("B")
        if view.nbytes == 0:
            raise ValueError("iter_plain needs a non-empty buffer")
        return self._pieces(self._fd(info.file), info, view)

    def read_plain_into(self, key: str, start: int, buf: "bytearray | memoryview") -> None:
        """Fill ``buf`` with bytes ``start:start + len(buf)`` of ``key``'s plain values (see :meth:`plain_range`):
        any piece of a tensor, in any order, from any thread (positioned reads). ValueError when ``key`` has no
        plain range or the piece lies outside it."""
        where = self.plain_range(key)
        view = memoryview(buf).cast("B")
        if where is None or not 0 <= start <= start + view.nbytes <= where[2]:
            raise ValueError(f"{self.path}: {key!r} has no plain bytes {start}:{start + view.nbytes}")
        info = self.info(key)
        fd = self._fd(info.file)
        pread_into(fd, view, info.offset + start, info.file, info.name)
        self._read_done(fd, info.offset + start, view.nbytes)

    def _pieces(self, fd: int, info: TensorInfo, view: memoryview) -> Iterator[memoryview]:
        done = 0
        while done < info.nbytes:
            n = min(view.nbytes, info.nbytes - done)
            pread_into(fd, view[:n], info.offset + done, info.file, info.name)
            self._read_done(fd, info.offset + done, n)
            done += n
            yield view[:n]

    def value_frames(self, key: str, elements: int) -> "Iterator[np.ndarray] | None":
        """The values of ``key`` as flat carrier arrays of ``elements`` elements each (the last may be shorter),
        in C order, when this format reads them better in one pass than box by box (a format whose values are
        decoded, not read: theta's versions); None otherwise, and :func:`zipslice.frames.iter_frames` reads
        them itself."""
        return None

    def numpy(self, key: str, raw: bool = False) -> np.ndarray:
        info = self.info(key)
        arr = restride(self._read_span(info), info)
        if raw:
            return arr
        dt = dtypes.get(info.dtype)
        if dt.numpy is None:
            raise UnsupportedCheckpointError(
                self.path, f"numpy has no dtype {info.dtype}; use numpy(key, raw=True) or lsd[key]", key)
        return arr.view(dt.to_numpy())

    def read_bytes(self, key: str) -> memoryview:
        arr = self.numpy(key, raw=True)
        return memoryview(arr.reshape(-1)).cast("B")

    def get_slice(self, key: str, framework: str = "pt"):
        """Shape and dtype of ``key`` now; ``[index]`` reads only the part asked for (safetensors' get_slice).

        ``framework="pt"`` returns torch tensors like ``lsd[key]``; ``"np"`` numpy arrays. See
        :class:`zipslice.slicing.TensorSlice`.
        """
        from .slicing import TensorSlice

        return TensorSlice(self, key, framework)

    def _read_selection(self, info: TensorInfo, sel) -> np.ndarray:
        """Carrier values of a :class:`zipslice.slicing.Selection` of ``info``. Addressable tensors read only
        the runs the selection touches; formats with other layouts override this (or read whole, here)."""
        from .slicing import read_selection

        if info.offset is not None:
            return read_selection(self._fd(info.file), info, sel, on_read=self._read_done)
        return np.ascontiguousarray(restride(self._read_span(info), info)[sel.numpy_index()]).reshape(sel.shape)

    def tensor(self, key: str):
        """A torch tensor with the stored dtype, shape and strides. Formats with tied storages override.

        Needs torch (the ``torch`` extra): without it, a :class:`MissingDependencyError` saying so and naming
        :meth:`numpy`."""
        torch = optional.torch()
        info = self.info(key)
        arr = restride(self._read_span(info), info)
        flat = arr.reshape(-1).view(np.uint8)
        if not flat.flags.writeable:  # torch tensors must own writable memory
            flat = flat.copy()
        t = torch.from_numpy(flat)
        t = t.view(torch.uint8).view(dtypes.to_torch(info.dtype)).reshape(info.shape)
        return t

    def source(self, key: str) -> TensorSource:
        info = self.info(key)
        return TensorSource(
            name=key, dtype=info.dtype, shape=info.shape, read=lambda k=key: self.read_bytes(k),
            tie=(self.path, info.storage, info.storage_offset, info.shape, info.stride),
            is_parameter=info.is_parameter, requires_grad=info.requires_grad,
        )

    def sources(self) -> Iterator[TensorSource]:
        for key in self._infos:
            yield self.source(key)

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to report
            pass
