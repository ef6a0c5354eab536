"""One table mapping dtype names across torch, numpy, safetensors and torch's pickled storage classes.

The canonical name is torch's (``float32``, ``bfloat16``, ``float8_e4m3fn``, ...).
Nothing here imports torch: the file formats are read and written without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import optional


@dataclass(frozen=True)
class DType:
    name: str                 # canonical, torch's spelling
    itemsize: int             # bytes per element
    numpy: str | None         # numpy dtype string (little-endian); "ml:NAME" is an ml_dtypes extension type
    safetensors: str | None   # safetensors dtype code or None
    storage: str | None       # legacy torch storage class name pickled by torch.save, if any
    kind: str                 # "bool", "int", "uint", "float", "complex"

    @property
    def is_float(self) -> bool:
        return self.kind in ("float", "complex")

    @property
    def carrier(self) -> np.dtype:
        """An unsigned-int (or void) numpy dtype of the same width, to move the raw bits of any dtype."""
        return np.dtype({1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(self.itemsize, f"V{self.itemsize}"))

    def to_numpy(self) -> np.dtype:
        if self.numpy is None:
            raise TypeError(f"numpy has no dtype for {self.name}")
        if self.numpy.startswith("ml:"):
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, self.numpy[3:]))
        return np.dtype(self.numpy)


_TABLE = [
    DType("bool", 1, "?", "BOOL", "BoolStorage", "bool"),
    DType("uint8", 1, "u1", "U8", "ByteStorage", "uint"),
    DType("int8", 1, "i1", "I8", "CharStorage", "int"),
    DType("int16", 2, "<i2", "I16", "ShortStorage", "int"),
    DType("uint16", 2, "<u2", "U16", None, "uint"),
    DType("int32", 4, "<i4", "I32", "IntStorage", "int"),
    DType("uint32", 4, "<u4", "U32", None, "uint"),
    DType("int64", 8, "<i8", "I64", "LongStorage", "int"),
    DType("uint64", 8, "<u8", "U64", None, "uint"),
    DType("float16", 2, "<f2", "F16", "HalfStorage", "float"),
    DType("bfloat16", 2, "ml:bfloat16", "BF16", "BFloat16Storage", "float"),
    DType("float32", 4, "<f4", "F32", "FloatStorage", "float"),
    DType("float64", 8, "<f8", "F64", "DoubleStorage", "float"),
    DType("complex64", 8, "<c8", "C64", "ComplexFloatStorage", "complex"),
    DType("complex128", 16, "<c16", None, "ComplexDoubleStorage", "complex"),
    DType("float8_e4m3fn", 1, "ml:float8_e4m3fn", "F8_E4M3", None, "float"),
    DType("float8_e5m2", 1, "ml:float8_e5m2", "F8_E5M2", None, "float"),
    DType("float8_e4m3fnuz", 1, "ml:float8_e4m3fnuz", "F8_E4M3FNUZ", None, "float"),
    DType("float8_e5m2fnuz", 1, "ml:float8_e5m2fnuz", "F8_E5M2FNUZ", None, "float"),
    DType("float8_e8m0fnu", 1, "ml:float8_e8m0fnu", "F8_E8M0", None, "float"),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE if d.storage}
# numpy's own dtypes; ml_dtypes' (bfloat16, float8) are looked up only when met: importing ml_dtypes costs every
# process ~10 ms (each `git add` waits for it before the clean can start)
_BY_PLAIN_NUMPY: dict[np.dtype, DType] = {np.dtype(d.numpy): d for d in _TABLE if d.numpy and d.numpy[:3] != "ml:"}


@lru_cache(maxsize=1)
def _by_numpy() -> dict[np.dtype, DType]:
    return {d.to_numpy(): d for d in _TABLE if d.numpy}


def get(name: str) -> DType:
    """Look up a canonical dtype name; raises KeyError with the known names."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}; known: {', '.join(BY_NAME)}") from None


def from_numpy(dt: np.dtype) -> DType:
    dt = np.dtype(dt).newbyteorder("<") if np.dtype(dt).byteorder == ">" else np.dtype(dt)
    found = _BY_PLAIN_NUMPY.get(dt) or _by_numpy().get(dt)
    if found is None:
        raise KeyError(f"numpy dtype {dt} has no zipslice dtype")
    return found


def to_torch(name: str):
    return getattr(optional.torch("zipslice.dtypes.to_torch returns torch dtypes", instead=None), name)


def from_torch(dtype) -> DType:
    return get(str(dtype).removeprefix("torch."))


def little_endian(arr: np.ndarray) -> np.ndarray:
    """``arr`` C-contiguous and little-endian (the layout every format and theta's hashes use); no copy when
    it already is. A 0-d array stays 0-d."""
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def le_bytes(arr: np.ndarray) -> memoryview:
    """The contiguous little-endian bytes of ``arr`` as a flat uint8 memoryview (no copy when possible).

    Goes through uint8 because buffers of ml_dtypes arrays (bfloat16, float8) cannot be exported directly.
    """
    a = little_endian(arr)
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
