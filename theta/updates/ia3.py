"""ia3: new = previous * ia3, with ia3 a vector broadcastable to the group (IA3 rescaling).

The product is computed in float32 (float64 for float64 groups) and rounded to the group's dtype --
the same arithmetic torch uses for float32/bfloat16/float16 multiplication. Exact bit for bit: where the
saved file differs anyway, the step carries the correct elements (``fix_gaps``/``fix_values``, see
sparse.residual). Stored parts: ``ia3`` (the vector, with singleton dimensions so that it broadcasts)
and the fixes. Params: ``fixes``, and ``axis`` when the vector was inferred.

Inference without side-loaded data: for each axis, the least-squares factor of new over previous along
the other axes; kept only when multiplying reproduces new within the tolerance with at most 1/4 of the
elements needing an exact fix.
"""
from __future__ import annotations

import numpy as np

from theta.errors import UpdateTypeError
from theta.updates import Encoded, row_blocks
from theta.updates.delta import same_layout
from theta.updates.low_rank import MAX_FIX_FRACTION, close_enough
from theta.updates.sparse import apply_residual, residual


def compute_dtype(group_dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(group_dtype) == np.float64 else np.dtype(np.float32)


def scale(previous: np.ndarray, ia3: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """previous * ia3 in the compute dtype, rounded to previous's dtype; block of rows by block of rows (each
    element's arithmetic does not depend on the split), so memory is the result and one block's temporaries.
    ``out`` (same shape and dtype, C-contiguous) may be ``previous`` itself: the product is then in place."""
    out = np.empty(previous.shape, previous.dtype) if out is None else out
    for rows, value in scaled_blocks(previous, ia3):
        out[rows] = value
    return out


BLOCK_ELEMENTS = 1 << 18  # elements per block of rows (1 MiB of float32; the float64 temporaries twice that)


def scaled_blocks(previous: np.ndarray, ia3: np.ndarray):
    """``(rows slice, previous[rows] * ia3 rounded)`` for consecutive blocks of rows (the first axis); each
    block is computed only when asked for (a block of ``previous`` read before its result is yielded)."""
    cdt = compute_dtype(previous.dtype)
    vec = np.asarray(ia3).astype(cdt)
    if previous.ndim == 0:
        yield Ellipsis, (previous.astype(cdt) * vec).astype(previous.dtype)
        return
    # a vector with the group's dims and more than one row varies along the rows: slice it with them
    by_row = vec.ndim == previous.ndim and vec.shape[0] != 1
    for rows in row_blocks(previous.shape, BLOCK_ELEMENTS):
        part = vec[rows] if by_row else vec
        yield rows, (previous[rows].astype(cdt) * part).astype(previous.dtype)


def check_vector(shape: tuple[int, ...], ia3: np.ndarray) -> str | None:
    """None when ``ia3`` broadcasts to ``shape`` without growing it; otherwise what is wrong."""
    if ia3.ndim > len(shape):
        return f"ia3 of shape {ia3.shape} has more dimensions than the group {tuple(shape)}"
    try:
        result = np.broadcast_shapes(tuple(shape), ia3.shape)
    except ValueError:
        return f"ia3 of shape {ia3.shape} does not broadcast to the group's shape {tuple(shape)}"
    if result != tuple(shape):
        return f"ia3 of shape {ia3.shape} would change the group's shape {tuple(shape)} to {result}"
    return None


class IA3Update:
    name = "ia3"
    incremental = True

    def encode(self, new: np.ndarray, previous: np.ndarray | None, rtol: float = 1e-5, atol: float = 1e-6,
               **options) -> Encoded | None:
        if not same_layout(new, previous) or new.ndim == 0 or new.dtype.kind not in "fV":
            return None
        cdt = compute_dtype(new.dtype)
        prev64, new64 = previous.astype(np.float64), new.astype(np.float64)
        for axis in range(new.ndim):
            others = tuple(a for a in range(new.ndim) if a != axis)
            # least squares along the other axes: averages out the rounding of each new element
            num = np.sum(prev64 * new64, axis=others, keepdims=True)
            den = np.sum(prev64 * prev64, axis=others, keepdims=True)
            with np.errstate(divide="ignore", invalid="ignore"):
                vec = np.where(den > 0, num / den, 1.0).astype(cdt)
            if not np.all(np.isfinite(vec)):
                continue
            value = scale(previous, vec)
            if close_enough(value, new, rtol, atol):
                fixes, count = residual(value, new)
                if count <= new.size * MAX_FIX_FRACTION:
                    return Encoded(parts={"ia3": vec, **fixes}, params={"axis": axis, "fixes": count})
        return None

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        if previous is None:
            raise UpdateTypeError("ia3 update needs the previous value of its group")
        if "ia3" not in parts:
            raise UpdateTypeError(f"ia3 update is missing its part (has {sorted(parts)}, needs ia3)")
        problem = check_vector(previous.shape, np.asarray(parts["ia3"]))
        if problem:
            raise UpdateTypeError(f"ia3 update: {problem}")
        return apply_residual(scale(previous, parts["ia3"]), parts)

    def apply_blob(self, blobs: dict, params: dict, previous: np.ndarray | None, in_place: bool) -> np.ndarray:
        """:meth:`apply` from the step's part blobs (the vector and the fixes: small); with ``in_place`` the
        previous value is scaled itself, block of rows by block of rows (no second value)."""
        from theta.storage.codec import decode_parts_of
        from theta.updates.bounds import check_parts_fit

        check_parts_fit(blobs, previous, "ia3")
        parts = decode_parts_of(blobs)
        if not (in_place and previous is not None and previous.flags.writeable and previous.flags.c_contiguous
                and "ia3" in parts):
            return self.apply(parts, params, previous)
        problem = check_vector(previous.shape, np.asarray(parts["ia3"]))
        if problem:
            raise UpdateTypeError(f"ia3 update: {problem}")
        return apply_residual(scale(previous, parts["ia3"], out=previous), parts)
