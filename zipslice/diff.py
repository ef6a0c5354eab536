"""Compare two checkpoints (any formats), tensor by tensor, reading values in bounded chunks.

For each name: added, removed, changed or same. A changed tensor reports its dtype/shape change, the
number of elements whose bits differ and the largest absolute difference among them (computed in
float64, complex128 for complex dtypes, exactly for integers). NaN against anything else gives a max
abs diff of NaN. When dtypes differ but shapes match, values are compared numerically instead of by bits.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

import zipslice

from . import dtypes, frames
from .base import LazyCheckpoint
from .info import TensorInfo

CHUNK_ELEMENTS = 1 << 20


def iter_chunks(lsd: LazyCheckpoint, name: str, chunk_elements: int | None = None) -> Iterator[np.ndarray]:
    """The values of ``name`` as flat arrays of its dtype's raw carrier (u1/u2/u4/u8/V16), in C order,
    ``chunk_elements`` (default :data:`CHUNK_ELEMENTS`) at a time: :func:`zipslice.frames.iter_frames`, so a
    huge tensor of any layout is never in memory whole."""
    return frames.iter_frames(lsd, name, chunk_elements or CHUNK_ELEMENTS)


def as_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw carrier values viewed as the numeric dtype (ml_dtypes for bfloat16 / float8)."""
    return raw.view(dtypes.get(dtype).to_numpy())


@dataclass
class TensorDiff:
    name: str
    status: str                       # "added" | "removed" | "changed" | "same"
    dtype: tuple[str | None, str | None]
    shape: tuple[list[int] | None, list[int] | None]
    numel: int = 0
    n_changed: int | None = None      # None when shapes differ (values not comparable)
    max_abs_diff: float | int | None = None


@dataclass
class ExtraDiff:
    name: str
    status: str
    a: Any = None
    b: Any = None


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    extras: list[ExtraDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(t.status == "same" for t in self.tensors) and all(e.status == "same" for e in self.extras)

    def counts(self) -> dict[str, int]:
        out = {"added": 0, "removed": 0, "changed": 0, "same": 0}
        for t in self.tensors:
            out[t.status] += 1
        return out

    def to_json(self) -> dict:
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)  # JSON has no nan/inf
            return v
        tensors = [{k: clean(v) for k, v in asdict(t).items()} for t in self.tensors]
        extras = [{"name": e.name, "status": e.status, "a": repr(e.a), "b": repr(e.b)} for e in self.extras]
        return {"a": self.a, "b": self.b, "identical": self.identical, "counts": self.counts(),
                "tensors": tensors, "extras": extras}


def _worse(current, m):
    """The larger difference; NaN (a NaN against a number) dominates everything."""
    if current is None or m != m:
        return m
    if current != current:
        return current
    return max(current, m)


def _max_abs_int(a: np.ndarray, b: np.ndarray, signed: bool) -> int:
    """max |a - b| exactly, even for 64-bit values: hi - lo wraps in uint64 to the true difference."""
    wide = np.int64 if signed else np.uint64
    a, b = a.astype(wide), b.astype(wide)
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    return int((hi.view(np.uint64) - lo.view(np.uint64)).max())


def _compare_same_dtype(ca: Iterator[np.ndarray], cb: Iterator[np.ndarray], dtype: str):
    dt = dtypes.get(dtype)
    changed, worst = 0, None
    for ra, rb in zip(ca, cb):
        mask = ra != rb
        if dt.carrier.kind == "V":  # complex128 carrier: compare as two u8 halves
            mask = (ra.view(np.uint64).reshape(-1, 2) != rb.view(np.uint64).reshape(-1, 2)).any(axis=1)
        k = int(np.count_nonzero(mask))
        if not k:
            continue
        changed += k
        va, vb = as_values(ra[mask], dtype), as_values(rb[mask], dtype)
        if dt.kind in ("int", "uint", "bool"):
            m = _max_abs_int(va, vb, signed=dt.kind == "int")
        else:
            wide = np.complex128 if dt.kind == "complex" else np.float64
            m = float(np.max(np.abs(va.astype(wide) - vb.astype(wide))))
        worst = _worse(worst, m)
    return changed, worst


def _compare_values(ca, cb, dta: str, dtb: str):
    """Different dtypes, same shape: compare numerically in float64 / complex128."""
    complex_ = "complex" in (dtypes.get(dta).kind, dtypes.get(dtb).kind)
    wide = np.complex128 if complex_ else np.float64
    changed, worst = 0, None
    for ra, rb in zip(ca, cb):
        with np.errstate(invalid="ignore"):
            va, vb = as_values(ra, dta).astype(wide), as_values(rb, dtb).astype(wide)
        same = (va == vb) | (np.isnan(va) & np.isnan(vb))
        mask = ~same
        k = int(np.count_nonzero(mask))
        if not k:
            continue
        changed += k
        m = float(np.max(np.abs(va[mask] - vb[mask])))
        worst = _worse(worst, m)
    return changed, worst


def compare_tensor(la: LazyCheckpoint, lb: LazyCheckpoint, name: str) -> TensorDiff:
    ia, ib = la.info(name), lb.info(name)
    d = TensorDiff(name=name, status="same", dtype=(ia.dtype, ib.dtype),
                   shape=(list(ia.shape), list(ib.shape)), numel=ia.numel)
    if ia.shape != ib.shape:
        d.status = "changed"
        return d
    if ia.dtype == ib.dtype:
        d.n_changed, d.max_abs_diff = _compare_same_dtype(iter_chunks(la, name), iter_chunks(lb, name), ia.dtype)
    else:
        d.n_changed, d.max_abs_diff = _compare_values(iter_chunks(la, name), iter_chunks(lb, name), ia.dtype, ib.dtype)
    if d.n_changed == 0:
        d.max_abs_diff = 0
    if d.n_changed or ia.dtype != ib.dtype:
        d.status = "changed"
    return d


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


def diff(a: str | os.PathLike | LazyCheckpoint, b: str | os.PathLike | LazyCheckpoint,
         progress: Callable[[int, int], None] | None = None) -> DiffReport:
    """Compare two checkpoints; tensors in ``a``'s order, then those only in ``b``.

    ``progress(nbytes, total)`` is called after each tensor present in both is compared.
    """
    la = a if isinstance(a, LazyCheckpoint) else zipslice.load(a)
    try:
        lb = b if isinstance(b, LazyCheckpoint) else zipslice.load(b)
        try:
            report = DiffReport(a=la.path, b=lb.path)
            total = sum(la.info(n).nbytes for n in la if n in lb)
            for name in la:
                if name not in lb:
                    ia: TensorInfo = la.info(name)
                    report.tensors.append(TensorDiff(name, "removed", (ia.dtype, None), (list(ia.shape), None),
                                                     ia.numel))
                else:
                    report.tensors.append(compare_tensor(la, lb, name))
                    if progress is not None:
                        progress(la.info(name).nbytes, total)
            for name in lb:
                if name not in la:
                    ib = lb.info(name)
                    report.tensors.append(TensorDiff(name, "added", (None, ib.dtype), (None, list(ib.shape)),
                                                     ib.numel))
            ea, eb = la.extras, lb.extras
            for name in list(ea) + [n for n in eb if n not in ea]:
                if name not in eb:
                    report.extras.append(ExtraDiff(name, "removed", a=ea[name]))
                elif name not in ea:
                    report.extras.append(ExtraDiff(name, "added", b=eb[name]))
                else:
                    status = "same" if _same_value(ea[name], eb[name]) else "changed"
                    report.extras.append(ExtraDiff(name, status, ea[name], eb[name]))
            return report
        finally:
            if lb is not b:
                lb.close()
    finally:
        if la is not a:
            la.close()
