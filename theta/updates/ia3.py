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

from theta.base.errors import UpdateTypeError
from theta.storage.codec import decode_parts_of
from theta.updates import Encoded, row_blocks
from theta.updates.bounds import check_parts_fit
from theta.updates.delta import changed_mask, same_layout
from theta.updates.low_rank import MAX_FIX_FRACTION, close_enough
from theta.updates.sparse import FIX_PARTS, FixCollector, apply_fix_blobs, apply_residual


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
    return check_vector_shape(shape, ia3.shape)


def check_vector_shape(shape: tuple[int, ...], vector: tuple[int, ...]) -> str | None:
    """:func:`check_vector` from the vector's shape alone (before it is read)."""
    vector = tuple(int(d) for d in vector)
    if len(vector) > len(shape):
        return f"ia3 of shape {vector} has more dimensions than the group {tuple(shape)}"
    try:
        result = np.broadcast_shapes(tuple(shape), vector)
    except ValueError:
        return f"ia3 of shape {vector} does not broadcast to the group's shape {tuple(shape)}"
    if result != tuple(shape):
        return f"ia3 of shape {vector} would change the group's shape {tuple(shape)} to {result}"
    return None


def least_squares_sums(new: np.ndarray, previous: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per axis, (sum of previous * new, sum of previous * previous) over the other axes (keepdims, float64):
    the least-squares factor of new over previous along that axis is their ratio. One pass, block of rows by
    block of rows; the first axis's sums are per row (computed within each block), the others' are added up
    block after block (float64, so the order of the additions moves the sums by a few float64 ulps)."""
    ndim = new.ndim
    first = [np.empty((new.shape[0],) + (1,) * (ndim - 1) if ndim > 1 else new.shape, np.float64) for _ in (0, 1)]
    rest = {axis: [np.zeros(tuple(n if a == axis else 1 for a, n in enumerate(new.shape)), np.float64)
                   for _ in (0, 1)] for axis in range(1, ndim)}
    for rows in row_blocks(new.shape, BLOCK_ELEMENTS):
        p = previous[rows].astype(np.float64)
        q = new[rows].astype(np.float64)
        pq, pp = p * q, p * p
        del p, q
        for k, x in enumerate((pq, pp)):
            first[k][rows] = np.sum(x, axis=tuple(range(1, ndim)), keepdims=True)
            for axis, acc in rest.items():
                acc[k] += np.sum(x, axis=tuple(a for a in range(ndim) if a != axis), keepdims=True)
    return [tuple(first)] + [tuple(rest[axis]) for axis in range(1, ndim)]


def fixes_within(previous: np.ndarray, new: np.ndarray, vec: np.ndarray, rtol: float, atol: float,
                 max_fixes: int) -> tuple[dict, int] | None:
    """(fix parts, count) that make previous * vec give ``new`` bit for bit (:func:`sparse.residual` of the
    whole product, as lazy parts: :class:`theta.updates.sparse.FixCollector`), block of rows by block of rows;
    None as soon as a block is not within rtol/atol of ``new`` or more than ``max_fixes`` elements need a fix."""
    flat_new = np.ascontiguousarray(new).reshape(-1)
    per_row = int(np.prod(new.shape[1:], dtype=np.int64)) if new.ndim else 1
    fixes = FixCollector(new.size, new.dtype)
    for rows, value in scaled_blocks(previous, vec):
        want = new[rows]
        if not close_enough(value, want, rtol, atol):
            return None
        changed = np.flatnonzero(changed_mask(np.ascontiguousarray(want), value))
        if changed.size:
            if fixes.count + changed.size > max_fixes:
                return None
            at = changed + (rows.start * per_row if isinstance(rows, slice) else 0)
            fixes.add(at, flat_new[at])
    return fixes.parts(lazy=True), fixes.count


class IA3Update:
    name = "ia3"
    incremental = True

    def encode(self, new: np.ndarray, previous: np.ndarray | None, rtol: float = 1e-5, atol: float = 1e-6,
               **options) -> Encoded | None:
        """Infer the vector (see module docstring), block of rows by block of rows: the least-squares sums of
        every axis in one pass, then per axis one pass scaling, checking and collecting fixes. Memory: the
        vector, a block's float64 temporaries and the fixes (never a float64 copy of the group)."""
        if not same_layout(new, previous) or new.ndim == 0 or new.dtype.kind not in "fV":
            return None
        cdt = compute_dtype(new.dtype)
        for axis, (num, den) in enumerate(least_squares_sums(new, previous)):
            with np.errstate(divide="ignore", invalid="ignore"):
                vec = np.where(den > 0, num / den, 1.0).astype(cdt)
            if not np.all(np.isfinite(vec)):
                continue
            got = fixes_within(previous, new, vec, rtol, atol, int(new.size * MAX_FIX_FRACTION))
            if got is not None:
                fixes, count = got
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
        """:meth:`apply` from the step's part blobs: the vector decoded, the fixes applied frame by frame
        (:func:`theta.updates.sparse.apply_fix_blobs`); with ``in_place`` the previous value is scaled itself,
        block of rows by block of rows (no second value)."""
        check_parts_fit(blobs, previous, "ia3")
        parts = decode_parts_of({k: b for k, b in blobs.items() if k not in FIX_PARTS})
        if previous is None or "ia3" not in parts:
            return self.apply(parts, params, previous)  # says what is missing
        problem = check_vector(previous.shape, np.asarray(parts["ia3"]))
        if problem:
            raise UpdateTypeError(f"ia3 update: {problem}")
        mine = in_place and previous.flags.writeable and previous.flags.c_contiguous
        return apply_fix_blobs(scale(previous, parts["ia3"], out=previous if mine else None), blobs, "ia3 update")
