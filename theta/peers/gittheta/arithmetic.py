"""Git-Theta 0.2.0's update arithmetic: previous -> new exactly as Git-Theta computes it (the same numpy operations
in the same order, numpy's dtype promotion): bit for bit for sparse and ia3 (element-wise); low-rank's ``R @ C``
goes through BLAS and may differ in the last bit on another build."""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from theta.base.errors import GitThetaFormatError, GitThetaUpdateTypeError
from theta.base.matmul import matmul_shape


def apply_update(update_type: str, parts: Mapping[str, np.ndarray], previous: np.ndarray, *,
                 file: str | None = None, group: str | None = None) -> np.ndarray:
    """previous -> new for one incremental update (sparse, low-rank or ia3), as Git-Theta 0.2.0 computes it."""
    apply = {"sparse": apply_sparse, "low-rank": apply_low_rank, "ia3": apply_ia3}.get(update_type)
    if apply is None:
        raise GitThetaUpdateTypeError(f"unknown update type {update_type!r} (theta reads Git-Theta's dense, "
                                      f"sparse, low-rank and ia3)", file=file, group=group,
                                      field="theta_metadata.update_type")
    try:
        new = apply(parts, previous)
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise GitThetaFormatError(f"cannot apply the {update_type} update to the previous value "
                                  f"{previous.dtype}{list(previous.shape)}: {e}", file=file, group=group) from None
    if new.shape != previous.shape:
        raise GitThetaFormatError(f"the {update_type} update turns shape {list(previous.shape)} into "
                                  f"{list(new.shape)}", file=file, group=group)
    return new


def apply_sparse(parts: Mapping[str, np.ndarray], previous: np.ndarray) -> np.ndarray:
    """``csr((data, indices, indptr), shape=(1, prod(shape))).toarray().reshape(shape) + previous``: the
    densified update starts from zeros of data's dtype and each entry is added in order (duplicates sum)."""
    _no_parameter(parts, "sparse")
    data, indices, indptr, shape = (np.asarray(parts[k]) for k in ("data", "indices", "indptr", "shape"))
    if data.ndim != 1 or indices.ndim != 1 or indptr.ndim != 1 or shape.ndim != 1:
        raise ValueError("data, indices, indptr and shape must be 1-d")
    for name, a in (("indices", indices), ("indptr", indptr), ("shape", shape)):
        if a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got {a.dtype}")
    if len(indptr) != 2 or indptr[0] != 0 or indptr[1] != len(data) or len(indices) != len(data):
        raise ValueError(f"indptr {indptr.tolist()} must be [0, len(data)={len(data)}] with as many indices")
    dims = tuple(int(d) for d in shape)
    if dims != previous.shape:
        raise ValueError(f"update shape {list(dims)} differs from the previous value's")
    n = math.prod(dims)
    if len(indices) and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(f"indices must lie in [0, {n})")
    dense = np.zeros(n, dtype=data.dtype)
    np.add.at(dense, indices, data)
    return _plus_previous(np.reshape(dense, dims), previous)


def apply_low_rank(parts: Mapping[str, np.ndarray], previous: np.ndarray) -> np.ndarray:
    """``R @ C + previous``; a stored ``parameter`` (Git-Theta's computed update of a 1-d group) is a plain
    difference: ``parameter + previous``."""
    if "parameter" in parts:
        return parts["parameter"] + previous
    R, C = parts["R"], parts["C"]
    shape = matmul_shape(np.shape(R), np.shape(C))  # (checked first: no product larger than the group is made)
    if shape != np.shape(previous):
        raise ValueError(f"R {list(np.shape(R))} @ C {list(np.shape(C))} gives shape {list(shape)}, not the previous "
                         f"value's")
    return _plus_previous(R @ C, previous)


def _plus_previous(update: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """``update + previous`` for an ``update`` this module just computed: added in place when that gives the
    same array (same shape, and numpy's promotion keeps update's dtype), so the group is held twice (previous
    and the result), not three times; the same bits, element by element, in the same operand order."""
    if update.shape == np.shape(previous) and np.result_type(update, previous) == update.dtype:
        return np.add(update, previous, out=update)
    return update + previous


def apply_ia3(parts: Mapping[str, np.ndarray], previous: np.ndarray) -> np.ndarray:
    """``previous * ia3`` (ia3 broadcasts, e.g. shape (out, 1) scales the rows of a weight)."""
    _no_parameter(parts, "ia3")
    return previous * parts["ia3"]


def _no_parameter(parts: Mapping[str, np.ndarray], update_type: str) -> None:
    # Git-Theta's read() hands a lone "parameter" array to apply_update, which then fails on it.
    if "parameter" in parts:
        raise ValueError(f"a {update_type} blob holds named parts, not 'parameter'")
