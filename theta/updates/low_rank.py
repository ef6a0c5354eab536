"""low-rank: new = previous + R @ C, with R of shape (rows, r) and C of shape (r, cols) (LoRA).

Groups with more than two dimensions are viewed as (shape[0], product of the other dimensions);
one-dimensional groups have no low-rank form. The arithmetic runs in float64 (float32 factors and
values are exact in it) and is done element-wise, rank by rank, block of rows by block of rows:
no BLAS call whose summation order could differ between machines, so every checkout rebuilds the
very same bits, and memory stays within a few row blocks beyond the group itself. The result is
rounded to the group's dtype.

Lossy with respect to the file the user saved when that file was produced with a different summation
order (torch's matmul): the clean filter checks the result against the file with the configured
tolerance (``rtol``/``atol``) and the working tree after checkout holds this module's rebuild.

Stored parts: ``R``, ``C`` (float32, or float64 for float64 groups). Params: ``rank``.
"""
from __future__ import annotations

import numpy as np

from theta.errors import UpdateTypeError
from theta.updates import Encoded
from theta.updates.delta import same_layout

DEFAULT_RANK = 8
ROW_BLOCK_ELEMENTS = 1 << 20  # elements per row block while applying (8 MiB of float64)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    return shape[0], int(np.prod(shape[1:]))


def factor_dtype(group_dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(group_dtype) == np.float64 else np.dtype(np.float32)


def add_low_rank(previous: np.ndarray, R: np.ndarray, C: np.ndarray) -> np.ndarray:
    """previous + R @ C rounded to previous's dtype, computed deterministically (see module docstring)."""
    shape2 = matrix_shape(previous.shape)
    rows, cols = shape2
    prev2 = np.ascontiguousarray(previous).reshape(rows, cols)
    R64 = np.asarray(R, dtype=np.float64)
    C64 = np.asarray(C, dtype=np.float64)
    out = np.empty((rows, cols), dtype=previous.dtype)
    step = max(1, ROW_BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        acc = prev2[start:stop].astype(np.float64)
        for k in range(R64.shape[1]):
            acc += R64[start:stop, k:k + 1] * C64[k:k + 1, :]
        out[start:stop] = acc.astype(previous.dtype)
    return out.reshape(previous.shape)


def truncated_svd(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """R (rows, rank), C (rank, cols) with R @ C the best rank-``rank`` approximation of ``matrix``.

    A randomized range finder (fixed seed, two power iterations) keeps this fast on large matrices; a
    matrix whose rank is at most ``rank`` is recovered to rounding error."""
    rows, cols = matrix.shape
    if min(rows, cols) <= 4 * (rank + 8):
        U, S, Vt = np.linalg.svd(matrix, full_matrices=False)
        return U[:, :rank] * S[:rank], Vt[:rank]
    rng = np.random.default_rng(0)
    Y = matrix @ rng.standard_normal((cols, rank + 8))
    for _ in range(2):
        Q, _ = np.linalg.qr(Y)
        Y = matrix @ (matrix.T @ Q)
    Q, _ = np.linalg.qr(Y)
    U, S, Vt = np.linalg.svd(Q.T @ matrix, full_matrices=False)
    return (Q @ U[:, :rank]) * S[:rank], Vt[:rank]


def close_enough(result: np.ndarray, target: np.ndarray, rtol: float, atol: float) -> bool:
    """allclose in float64, with NaN equal to NaN at the same places."""
    a = np.asarray(result, dtype=np.float64)
    b = np.asarray(target, dtype=np.float64)
    return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def check_factors(shape: tuple[int, ...], R: np.ndarray, C: np.ndarray) -> str | None:
    """None when R and C fit a group of ``shape``; otherwise what is wrong."""
    shape2 = matrix_shape(shape)
    if shape2 is None:
        return f"a group of shape {tuple(shape)} has no low-rank form (needs at least 2 dimensions)"
    if R.ndim != 2 or C.ndim != 2:
        return f"R and C must be matrices, got shapes {R.shape} and {C.shape}"
    if R.shape[0] != shape2[0] or C.shape[1] != shape2[1] or R.shape[1] != C.shape[0]:
        return (f"R {R.shape} @ C {C.shape} does not give the group's matrix shape {shape2} "
                f"(group shape {tuple(shape)})")
    if R.dtype.kind != "f" and not str(R.dtype).startswith(("bfloat", "float8")):
        return f"R has non-float dtype {R.dtype}"
    return None


class LowRankUpdate:
    name = "low-rank"
    incremental = True

    def encode(self, new: np.ndarray, previous: np.ndarray | None, rank: int | None = None,
               rtol: float = 1e-5, atol: float = 1e-6, **options) -> Encoded | None:
        """Infer R, C from new - previous by a truncated SVD; None when rank-``rank`` does not meet the
        tolerance (the caller then stores something else)."""
        if not same_layout(new, previous) or matrix_shape(new.shape) is None or new.dtype.kind not in "fV":
            return None
        rank = int(rank or DEFAULT_RANK)
        rows, cols = matrix_shape(new.shape)
        if rank * (rows + cols) >= rows * cols:
            return None  # the factors would be as large as the group
        fdt = factor_dtype(new.dtype)
        diff = (new.astype(np.float64) - previous.astype(np.float64)).reshape(rows, cols)
        if not np.all(np.isfinite(diff)):
            return None
        R, C = truncated_svd(diff, rank)
        R, C = R.astype(fdt), C.astype(fdt)
        del diff
        if not close_enough(add_low_rank(previous, R, C), new, rtol, atol):
            return None
        return Encoded(parts={"R": R, "C": C}, params={"rank": int(R.shape[1])})

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        if previous is None:
            raise UpdateTypeError("low-rank update needs the previous value of its group")
        if "R" not in parts or "C" not in parts:
            raise UpdateTypeError(f"low-rank update is missing parts (has {sorted(parts)}, needs R and C)")
        problem = check_factors(previous.shape, parts["R"], parts["C"])
        if problem:
            raise UpdateTypeError(f"low-rank update: {problem}")
        return add_low_rank(previous, parts["R"], parts["C"])
