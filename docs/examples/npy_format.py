"""A zipslice format plugin: numpy's .npy file, one array per file, read and written one tensor at a time."""
from __future__ import annotations

import os
import tempfile

import numpy as np

from zipslice import CorruptCheckpointError, LazyCheckpoint, TensorInfo, UnsupportedCheckpointError
from zipslice.info import contiguous_stride

NAME = "array"  # the one tensor of a .npy file
DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"}


def detect(head: bytes) -> bool:
    """zipslice.load calls this with the first 4 KiB of a file its own sniffing did not recognise."""
    return head.startswith(b"\x93NUMPY")


class NpyCheckpoint(LazyCheckpoint):
    """Opening reads only the header; reading the array is one positioned read of its bytes."""

    format = "npy"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        with open(self.path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise ValueError(f"format version {version} is not supported")
                # numpy parses the header with ast.literal_eval, never eval, and bounds its size
                shape, fortran_order, dtype = read_header(f)
            except ValueError as e:  # numpy names what is wrong with the header
                raise CorruptCheckpointError(self.path, f"bad .npy header: {e}") from None
            offset = f.tell()
        if fortran_order:
            raise UnsupportedCheckpointError(self.path, "Fortran-ordered arrays are not supported", NAME)
        if dtype.name not in DTYPES:  # also refuses object arrays, which would need pickle
            raise UnsupportedCheckpointError(self.path, f"dtype {dtype} is not supported", NAME)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + nbytes > os.path.getsize(self.path):
            raise CorruptCheckpointError(self.path, f"the header declares {nbytes} bytes of data; the file is "
                                                    f"shorter (truncated?)", NAME)
        self._infos[NAME] = TensorInfo(
            name=NAME, dtype=dtype.name, shape=tuple(shape), stride=contiguous_stride(tuple(shape)),
            storage=NAME, storage_offset=0, offset=offset, span_nbytes=nbytes, file=self.path,
            byteorder="big" if dtype.byteorder == ">" else "little")


def write(path: str | os.PathLike, sources: list, *, structure=None, metadata=None, **options) -> None:
    """Write the single source to ``path``: header first, then its bytes; published atomically."""
    if len(sources) != 1:
        raise ValueError(f"{os.fspath(path)}: a .npy file holds one array, got {len(sources)} tensors")
    src = sources[0]
    if src.dtype not in DTYPES:
        raise UnsupportedCheckpointError(os.fspath(path), f"dtype {src.dtype} cannot be written to .npy", src.name)
    header = {"descr": np.dtype(src.dtype).newbyteorder("<").str, "fortran_order": False, "shape": src.shape}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(src.read())          # contiguous little-endian bytes: exactly what .npy stores
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)            # a reader never sees half a file
    except BaseException:
        os.unlink(tmp)
        raise
