"""HDF5 parsed in a child process with a time limit: ``zipslice.load(path, isolate=True)``.

libhdf5 is C code parsing an untrusted file: on some malformed files it hangs or crashes (segfault) the
process that called it, which would take down whoever embeds zipslice (git's filter, a training job). With
``isolate=True`` every h5py call on the file runs in a child process:

- opening: the child opens the file with :class:`zipslice.hdf5_format.HDF5Checkpoint` and sends back the
  index (tensor infos, metadata, extras) as msgpack; a timeout (``timeout``, default
  :data:`DEFAULT_TIMEOUT`) or a crash of the child becomes a :class:`CorruptCheckpointError` naming the file;
- reading: a tensor whose bytes are addressable (contiguous, unfiltered: ``info.offset``) is read by the
  parent with one positioned read, no HDF5 code involved; any other (chunked, compressed) is read by the
  child and sent over the pipe, with a time limit that grows with its size (:data:`READ_BYTES_PER_SECOND`).

The child is ``python -c ...`` with this package first on ``sys.path``; it writes only protocol frames to
its stdout (fd 1 is pointed at stderr inside it, so nothing libhdf5 prints can corrupt them) and stops when
its stdin closes (:meth:`IsolatedHDF5Checkpoint.close`). Frames: u64 little-endian length + msgpack map;
a read's data follows its frame as raw bytes.
"""
from __future__ import annotations

import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from . import errors
from .base import LazyCheckpoint
from .errors import CorruptCheckpointError, ZipsliceError
from .info import TensorInfo

DEFAULT_TIMEOUT = 60.0               # seconds to open and index a file (a valid one takes well under 1 s)
READ_BYTES_PER_SECOND = 16 << 20     # a chunked/compressed read gets timeout + its size at this rate
MAX_FRAME = 1 << 30                  # an index frame (10^6 datasets at ~500 bytes)
_LEN = struct.Struct("<Q")
_ERROR_CLASSES = {c.__name__: c for c in (errors.ZipsliceError, errors.CorruptCheckpointError,
                                            errors.NotACheckpointError, errors.UnsupportedCheckpointError,
                                            errors.UnsafeCheckpointError)}
_COMPLEX = 1  # msgpack ext type for complex extras


def _default(obj: Any) -> Any:
    if isinstance(obj, complex):
        return msgpack.ExtType(_COMPLEX, struct.pack("<dd", obj.real, obj.imag))
    raise TypeError(f"cannot send {type(obj).__name__}")


def _ext(code: int, data: bytes) -> Any:
    if code == _COMPLEX and len(data) == 16:
        return complex(*struct.unpack("<dd", data))
    return msgpack.ExtType(code, data)


class IsolatedHDF5Checkpoint(LazyCheckpoint):
    """The same mapping as :class:`zipslice.hdf5_format.HDF5Checkpoint`, with all HDF5 parsing in a child."""

    format = "hdf5"

    def __init__(self, path: str | os.PathLike, keras_names: bool = True, timeout: float | None = None):
        super().__init__(path)
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        self.skipped: dict[str, str] = {}
        self.hdf5_paths: dict[str, str] = {}
        self.layout = "plain"
        self._lock = threading.Lock()
        root = str(Path(__file__).resolve().parents[1])
        code = f"import sys; sys.path.insert(0, {root!r}); from zipslice.hdf5_isolated import _child; _child()"
        self._proc = subprocess.Popen([sys.executable, "-c", code, self.path, "1" if keras_names else "0"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      close_fds=True)
        try:
            index = self._receive(self.timeout, "open it")
            self._load_index(index)
        except BaseException:
            self._stop()
            raise

    # -- protocol ----------------------------------------------------------------------------------
    def _receive(self, timeout: float, doing: str) -> dict:
        header = self._read_exact(_LEN.size, timeout, doing)
        (n,) = _LEN.unpack(header)
        if n > MAX_FRAME:
            raise self._fail(f"the HDF5 reader sent a {n}-byte frame (over {MAX_FRAME})")
        msg = msgpack.unpackb(self._read_exact(n, timeout, doing), ext_hook=_ext, strict_map_key=False)
        if not isinstance(msg, dict):
            raise self._fail("the HDF5 reader sent a malformed frame")
        if "error" in msg:
            e = msg["error"]
            cls = _ERROR_CLASSES.get(e.get("class"), CorruptCheckpointError)
            raise cls(self.path, str(e.get("problem")), e.get("entry"))
        return msg

    def _read_exact(self, n: int, timeout: float, doing: str, into: memoryview | None = None):
        """n bytes from the child before ``timeout`` seconds pass, else kill it and raise."""
        buf = into if into is not None else memoryview(bytearray(n))
        got, deadline = 0, time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while got < n:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self._stop()
                    raise self._fail(f"HDF5 parsing did not finish within {timeout:.3g} s while trying to {doing} "
                                     "(the file is likely malformed; the separate process parsing it was stopped)")
                k = os.readv(fd, [buf[got:]])
                if k == 0:
                    raise self._crashed(doing)
                got += k
        return buf if into is not None else bytes(buf)

    def _crashed(self, doing: str) -> CorruptCheckpointError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._stop()
            code = None
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return self._fail(f"the HDF5 library {how} while trying to {doing} (the file is malformed; it was parsed "
                          "in a separate process, nothing else was affected)")

    def _fail(self, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.path, problem)

    def _send(self, msg: dict) -> None:
        data = msgpack.packb(msg)
        try:
            self._proc.stdin.write(_LEN.pack(len(data)) + data)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise self._crashed("read a dataset") from None

    def _load_index(self, index: dict) -> None:
        for d in index["infos"]:
            info = TensorInfo(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]), stride=tuple(d["stride"]),
                              storage=d["storage"], storage_offset=d["storage_offset"], offset=d["offset"],
                              span_nbytes=d["span_nbytes"], file=self.path, storage_nbytes=d["storage_nbytes"],
                              byteorder=d["byteorder"])
            self._infos[info.name] = info
        self.metadata = dict(index["metadata"])
        self.extras = dict(index["extras"])
        self.skipped = dict(index["skipped"])
        self.hdf5_paths = dict(index["hdf5_paths"])
        self.layout = index["layout"]

    # -- data --------------------------------------------------------------------------------------
    def _read_span(self, info: TensorInfo):
        if info.offset is not None:
            return self._read_at(info)  # plain bytes of the file: no HDF5 code runs
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        if info.numel == 0:
            return b""

        with self._lock:
            self._send({"read": info.name})
            timeout = self.timeout + info.nbytes / READ_BYTES_PER_SECOND
            reply = self._receive(timeout, f"read {info.name!r}")
            n = reply.get("nbytes")
            if n != info.nbytes:
                self._stop()
                raise CorruptCheckpointError(self.path, f"the HDF5 reader sent {n} bytes, expected {info.nbytes}",
                                             info.name)
            out = np.empty(n, dtype=np.uint8)
            self._read_exact(n, timeout, f"read {info.name!r}", memoryview(out))
        return memoryview(out)

    # -- lifetime ----------------------------------------------------------------------------------
    def _stop(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=2)  # closing stdin ends a healthy child
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None

    def close(self) -> None:
        self._stop()
        super().close()


# -- the child -------------------------------------------------------------------------------------------
def _child() -> None:
    """Entry point of the child: argv = [path, keras_names]."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed to stdout from now on goes to stderr, not into the protocol
    path, keras_names = sys.argv[1], sys.argv[2] == "1"

    def send(msg: dict, data: "memoryview | None" = None) -> None:
        packed = msgpack.packb(msg, default=_default)
        out.write(_LEN.pack(len(packed)) + packed)
        if data is not None:
            out.write(data)
        out.flush()

    def error(e: BaseException) -> dict:
        if isinstance(e, ZipsliceError):
            return {"error": {"class": type(e).__name__, "problem": e.problem, "entry": e.entry}}
        return {"error": {"class": "CorruptCheckpointError",
                          "problem": f"HDF5 reader failed: {type(e).__name__}: {e}", "entry": None}}

    from .hdf5_format import HDF5Checkpoint

    try:
        lsd = HDF5Checkpoint(path, keras_names=keras_names)
        infos = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "stride": list(i.stride),
                  "storage": i.storage, "storage_offset": i.storage_offset, "offset": i.offset,
                  "span_nbytes": i.span_nbytes, "storage_nbytes": i.storage_nbytes, "byteorder": i.byteorder}
                 for i in lsd.infos()]
        send({"infos": infos, "metadata": lsd.metadata, "extras": lsd.extras, "skipped": lsd.skipped,
              "hdf5_paths": lsd.hdf5_paths, "layout": lsd.layout})
    except Exception as e:
        send(error(e))
        return
    stdin = sys.stdin.buffer
    while True:
        head = stdin.read(_LEN.size)
        if len(head) < _LEN.size:
            return  # the parent closed the pipe
        (n,) = _LEN.unpack(head)
        req = msgpack.unpackb(stdin.read(n))
        try:
            data = memoryview(lsd._read_span(lsd.info(req["read"]))).cast("B")
        except Exception as e:
            send(error(e))
            continue
        send({"nbytes": data.nbytes}, data)
