"""ia3: new = previous * ia3, with ia3 a vector broadcastable to the group (IA3 rescaling).

The product is computed in float32 (float64 for float64 groups) and rounded to the group's dtype --
the same arithmetic torch uses for float32/bfloat16/float16 multiplication, so a model scaled by torch
is usually rebuilt bit for bit; the clean filter still checks the result against the saved file with
the configured tolerance. Stored parts: ``ia3`` (the vector, with singleton dimensions so that it
broadcasts). Params: ``axis`` when the vector was inferred.

Inference without side-loaded data: for each axis, take the ratio new / previous of the first
element along the other axes with a non-zero previous value, and keep it only when multiplying
reproduces new within the tolerance.
"""
from __future__ import annotations

import numpy as np

from theta.errors import UpdateTypeError
from theta.updates import Encoded
from theta.updates.delta import same_layout
from theta.updates.low_rank import close_enough


def compute_dtype(group_dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(group_dtype) == np.float64 else np.dtype(np.float32)


def scale(previous: np.ndarray, ia3: np.ndarray) -> np.ndarray:
    cdt = compute_dtype(previous.dtype)
    return (previous.astype(cdt) * np.asarray(ia3).astype(cdt)).astype(previous.dtype)


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
        prev_c, new_c = previous.astype(cdt), new.astype(cdt)
        for axis in range(new.ndim):
            moved_prev = np.moveaxis(prev_c, axis, 0).reshape(new.shape[axis], -1)
            moved_new = np.moveaxis(new_c, axis, 0).reshape(new.shape[axis], -1)
            nonzero = moved_prev != 0
            first = np.argmax(nonzero, axis=1)
            rows = np.arange(new.shape[axis])
            with np.errstate(divide="ignore", invalid="ignore"):
                vec = np.where(nonzero[rows, first], moved_new[rows, first] / moved_prev[rows, first], 1.0)
            shape = [1] * new.ndim
            shape[axis] = new.shape[axis]
            vec = vec.astype(cdt).reshape(shape)
            if np.all(np.isfinite(vec)) and close_enough(scale(previous, vec), new, rtol, atol):
                return Encoded(parts={"ia3": vec}, params={"axis": axis})
        return None

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        if previous is None:
            raise UpdateTypeError("ia3 update needs the previous value of its group")
        if "ia3" not in parts:
            raise UpdateTypeError(f"ia3 update is missing its part (has {sorted(parts)}, needs ia3)")
        problem = check_vector(previous.shape, np.asarray(parts["ia3"]))
        if problem:
            raise UpdateTypeError(f"ia3 update: {problem}")
        return scale(previous, parts["ia3"])
