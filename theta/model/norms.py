"""Norms a clean records per group, so that a history of a model can be drawn from metadata alone.

For a float group, clean records the Euclidean norm of its value, and, when it had the previous version's value
at hand (it compared or encoded against it), the norm of the change from it and how many elements changed
(:class:`theta.storage.metadata.Norms`). `git theta log` then colours each group of each commit by
``‖new − old‖ / ‖old‖`` without reading any tensor.

How they are computed (:func:`measure`): values are taken as float32 (bfloat16, float16 and float8 widen
exactly; float64 stays float64), in chunks of :data:`CHUNK` elements; each chunk's sum of squares is a float32
dot product (float64 for float64 values), and the chunks' sums are added in float64, in order. A difference
``new − old`` of two bfloat16 or float16 values is exact in float32. A frame of the codec is a whole number of
chunks, so a group measured frame by frame (:mod:`theta.model.framewise`) gets the bits it gets measured whole.
Against the float64 statistics of ``git theta diff`` (theta.model.diff.change_stats), a norm differs by about
1e-7 relatively (a few 1e-6 for a value whose elements are all alike); the recorded figures are rounded to
:data:`DIGITS` significant digits. The cost is one pass over both values while they are at hand anyway (the
previous value is the base of the encoding): about a tenth of what compressing the change costs. Another
machine's BLAS may round a dot product differently: two texts that differ only in norms describe the same
values (:func:`theta.storage.metadata.same_content`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zipslice import dtypes

from theta.base import lsh

CHUNK = lsh.POOL  # elements per float32 dot product (the error of one dot grows with its length): a row of the
                  # LSH fold, whose pass takes the value's sum of squares
DIGITS = 6        # significant digits recorded


def measurable(dtype_name: str) -> bool:
    """Whether groups of this dtype get norms: real floating point dtypes."""
    return dtypes.get(dtype_name).kind == "float"


def rounded(x: float) -> float:
    """``x`` to :data:`DIGITS` significant digits (the form the metadata records)."""
    return float(f"{x:.{DIGITS}g}")


@dataclass
class Sums:
    """Sums of one value (and of its change from a previous value), added chunk by chunk in order."""

    value: float = 0.0          # Σ new²
    change: float = 0.0         # Σ (new − old)²
    changed: int = 0            # elements whose bits differ

    def add(self, other: "Sums") -> None:
        self.value += other.value
        self.change += other.change
        self.changed += other.changed


def _widen(chunk: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """A float32 (float64 for float64) 1-d view or copy of ``chunk``, through ``buf`` (uint32 scratch)."""
    dt = chunk.dtype
    if dt == np.float32 or dt == np.float64:
        return chunk
    wide = buf[:chunk.size]
    if dt.itemsize == 2 and dt.name == "bfloat16":  # the top half of a float32: a shift, exact
        np.copyto(wide, chunk.view(np.uint16))
        wide <<= 16
        return wide.view(np.float32)
    out = wide.view(np.float32)
    np.copyto(out, chunk, casting="unsafe")  # float16, float8: exact in float32
    return out


def _flat_pair(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.ascontiguousarray(new).reshape(-1)
    b = np.ascontiguousarray(old).reshape(-1)
    if b.size != a.size or b.dtype != a.dtype:
        raise ValueError(f"norms need values of one dtype and size, got {a.dtype}[{a.size}] and {b.dtype}[{b.size}]")
    return a, b


def change_squares(new: np.ndarray, old: np.ndarray) -> float:
    """Σ (new − old)² of two values of one real float dtype and size, chunk by chunk (see the module's docstring):
    what clean adds to the value's sum of squares (the LSH pass's by-product) where it has the previous value.
    NaN or Inf give a non-finite sum."""
    a, b = _flat_pair(new, old)
    total = 0.0
    if a.size == 0:
        return total
    n = min(CHUNK, a.size)
    bufs = (np.empty(n, np.uint32), np.empty(n, np.uint32))
    scratch = np.empty(n, np.float64 if a.dtype == np.float64 else np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(0, a.size, CHUNK):
            x = _widen(a[s:s + CHUNK], bufs[0])
            d = scratch[:x.size]
            np.subtract(x, _widen(b[s:s + CHUNK], bufs[1]), out=d)
            total += float(np.dot(d, d))
    return total


def changed_count(new: np.ndarray, old: np.ndarray) -> int:
    """How many elements of two values of one dtype and size differ in their bits, chunk by chunk."""
    a, b = _flat_pair(new, old)
    bits = f"u{a.dtype.itemsize}" if a.dtype.itemsize in (1, 2, 4, 8) else None
    total = 0
    for s in range(0, a.size, CHUNK):
        x, y = a[s:s + CHUNK], b[s:s + CHUNK]
        total += int(np.count_nonzero(x.view(bits) != y.view(bits) if bits is not None else x != y))
    return total


def measure(new: np.ndarray, old: np.ndarray | None = None, count: bool = True) -> Sums:
    """The sums of squares of ``new`` and, given ``old`` (same dtype and shape), of ``new − old``, and (``count``)
    how many elements of the two differ in their bits, each computed on its own: clean takes the value's from the
    LSH pass (:attr:`theta.base.lsh.Folder.squares`, the same bits as :func:`theta.base.lsh.squares`) and the
    change's where it walks both values. A flat or shaped real float array; NaN or Inf give non-finite sums
    (:func:`finite` then says so)."""
    out = Sums(value=lsh.squares(np.ascontiguousarray(new)))
    if old is not None:
        out.change = change_squares(new, old)
        out.changed = changed_count(new, old) if count else 0
    return out


def finite(s: Sums) -> bool:
    return math.isfinite(s.value) and math.isfinite(s.change)
