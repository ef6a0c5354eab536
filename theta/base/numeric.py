"""Chunked numeric comparisons, so comparing two groups never makes full-size temporaries."""
from __future__ import annotations

import numpy as np

CHUNK = 1 << 20  # elements per step


def _wide(chunk: np.ndarray) -> np.ndarray:
    """float64 stays float64, complex stays complex, every other float dtype widens to float32."""
    if chunk.dtype.kind == "c" or chunk.dtype == np.float64:
        return chunk
    return chunk.astype(np.float32)


def allclose(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> bool:
    """numpy.allclose(a, b, rtol, atol, equal_nan=True) for same-shape float arrays, in bounded memory.

    Like numpy it is asymmetric: |a - b| <= atol + rtol * |b| (b is the reference, i.e. the previous value).
    """
    if a.shape != b.shape:
        return False
    fa, fb = a.reshape(-1), b.reshape(-1)
    for s in range(0, fa.size, CHUNK):
        x, y = _wide(fa[s:s + CHUNK]), _wide(fb[s:s + CHUNK])
        if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True
