"""The implementations theta replaced by streamed ones (kept verbatim from before the change, as the
reference the tests compare against): whole-group float64 inference of ia3 and low-rank steps, and
Git-Theta's original-form side-load applied to a whole group."""
from __future__ import annotations

import numpy as np

from theta.updates import Encoded
from theta.updates.ia3 import compute_dtype, scale
from theta.updates.low_rank import (MAX_FIX_FRACTION, MAX_INFERRED_RANK, add_low_rank, close_enough, factor_dtype,
                                    matrix_shape)
from theta.updates.sparse import residual


def ia3_encode(new: np.ndarray, previous: np.ndarray, rtol: float = 1e-5, atol: float = 1e-6) -> Encoded | None:
    cdt = compute_dtype(new.dtype)
    prev64, new64 = previous.astype(np.float64), new.astype(np.float64)
    for axis in range(new.ndim):
        others = tuple(a for a in range(new.ndim) if a != axis)
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


def truncated_svd(matrix: np.ndarray, rank: int):
    rows, cols = matrix.shape
    if min(rows, cols) <= 4 * (rank + 8):
        U, S, Vt = np.linalg.svd(matrix, full_matrices=False)
        return U[:, :rank], S[:rank], Vt[:rank]
    rng = np.random.default_rng(0)
    Y = matrix @ rng.standard_normal((cols, rank + 8))
    for _ in range(2):
        Q, _ = np.linalg.qr(Y)
        Y = matrix @ (matrix.T @ Q)
    Q, _ = np.linalg.qr(Y)
    U, S, Vt = np.linalg.svd(Q.T @ matrix, full_matrices=False)
    return Q @ U[:, :rank], S[:rank], Vt[:rank]


def noise_level(previous: np.ndarray, rows: int, cols: int) -> float:
    import ml_dtypes

    eps = float(ml_dtypes.finfo(previous.dtype).eps)
    rms = float(np.sqrt(np.mean(np.square(previous, dtype=np.float64)))) if previous.size else 0.0
    return 2.0 * eps * rms * (np.sqrt(rows) + np.sqrt(cols))


def low_rank_encode(new: np.ndarray, previous: np.ndarray, rank: int | None = None, rtol: float = 1e-5,
                    atol: float = 1e-8) -> Encoded | None:
    rows, cols = matrix_shape(new.shape)
    worth = (rows * cols) // (2 * (rows + cols))
    limit = min(int(rank) if rank else MAX_INFERRED_RANK, worth)
    if limit < 1:
        return None
    fdt = factor_dtype(new.dtype)
    diff = (new.astype(np.float64) - previous.astype(np.float64)).reshape(rows, cols)
    if not np.all(np.isfinite(diff)):
        return None
    U, S, Vt = truncated_svd(diff, limit)
    if rank:
        r = int(rank)
    else:
        r = int(np.count_nonzero(S > max(noise_level(previous, rows, cols), S[0] * 1e-6))) if S.size else 1
    r = max(1, min(r, limit))
    R, C = (U[:, :r] * S[:r]).astype(fdt), np.ascontiguousarray(Vt[:r]).astype(fdt)
    value = add_low_rank(previous, R, C)
    fixes, count = residual(value, new)
    if count > new.size * MAX_FIX_FRACTION or not close_enough(value, new, rtol, atol):
        return None
    return Encoded(parts={"R": R, "C": C, **fixes}, params={"rank": int(R.shape[1]), "fixes": count})
