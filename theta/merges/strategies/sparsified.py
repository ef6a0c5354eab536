"""TIES and DARE: task vectors sparsified (by magnitude, or by random drop) before they are combined."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator

import numpy as np

from theta.base.errors import MergeError
from theta.merges.strategies.base import Elementwise, chunks_side_by_side, work_dtype


def _check_density(strategy: str, density: float) -> None:
    if not 0.0 < density <= 1.0:
        raise MergeError(f"merge strategy {strategy!r}: density must be in (0, 1], got {density}")


def kth_largest_magnitude(chunks: Callable[[], Iterator[np.ndarray]], k: int, wd: np.dtype) -> float:
    """The k-th largest |x| (1 ≤ k ≤ n) over the arrays ``chunks()`` yields, with O(chunk) memory.

    Radix selection: non-negative IEEE floats order like their bit patterns read as unsigned integers, so
    16 bits are resolved per pass over the data (2 passes for float32, 4 for float64), exactly.
    """
    bits = wd.itemsize * 8
    key_type = np.dtype(f"u{wd.itemsize}")
    prefix, resolved = 0, 0
    for shift in range(bits - 16, -1, -16):
        hist = np.zeros(1 << 16, dtype=np.int64)
        for chunk in chunks():
            keys = np.abs(chunk).view(key_type)
            if resolved:
                keys = keys[(keys >> (shift + 16)) == prefix]
            hist += np.bincount(((keys >> shift) & 0xFFFF).astype(np.intp), minlength=1 << 16)
        from_top = np.cumsum(hist[::-1])
        idx = int(np.searchsorted(from_top, k))  # first bucket (from the top) reaching rank k
        k -= int(from_top[idx - 1]) if idx else 0
        prefix = (prefix << 16) | (0xFFFF - idx)
        resolved += 16
    return float(np.array([prefix], dtype=key_type).view(wd)[0])


def _trim_threshold(X: Any, O: Any, n: int, density: float, wd: np.dtype) -> float:
    """Magnitude threshold keeping the k = max(1, round(density·n)) largest |τ| = |X − O| (ties at the
    threshold are kept); X and O are arrays or sources, read once per radix pass."""
    k = max(1, int(round(density * n)))
    if k >= n:
        return 0.0

    def chunks():
        for _, x, o in chunks_side_by_side(X, O):
            yield x.astype(wd) - o.astype(wd)

    return kth_largest_magnitude(chunks, k, wd)


class Ties(Elementwise):
    name = "ties"
    summary = "TIES: trim task vectors to the top density, elect signs, disjoint mean; ancestor + λ·merged"
    needs_ancestor = uses_ancestor = True
    defaults = {"density": 0.2, "lambda": 1.0}
    ranges = {"density": (0.0, 1.0, False)}

    def prepare(self, name, A, B, O, p):
        density, lam = p["density"], p["lambda"]
        _check_density(self.name, density)
        wd = work_dtype(A)
        n = int(np.prod(A.shape, dtype=np.int64))
        th_a = _trim_threshold(A, O, n, density, wd)
        th_b = _trim_threshold(B, O, n, density, wd)

        def chunk(sl, a, b, o):
            ta, tb = a - o, b - o
            ta[np.abs(ta) < th_a] = 0
            tb[np.abs(tb) < th_b] = 0
            elected = np.sign(ta + tb)
            agree_a = (ta != 0) & (np.sign(ta) == elected)
            agree_b = (tb != 0) & (np.sign(tb) == elected)
            total = np.where(agree_a, ta, 0) + np.where(agree_b, tb, 0)
            count = agree_a.astype(wd) + agree_b.astype(wd)
            return o + lam * (total / np.maximum(count, 1))

        return chunk


def dare_seed(name: str, side: str, seed: int) -> np.random.SeedSequence:
    """The documented, reproducible random stream of DARE for one group and side."""
    digest = hashlib.sha256(f"theta-dare\0{seed}\0{name}\0{side}".encode()).digest()
    return np.random.SeedSequence(int.from_bytes(digest[:16], "little"))


class Dare(Elementwise):
    name = "dare"
    summary = "DARE: drop task-vector entries with prob. 1−density, rescale by 1/density, task arithmetic"
    needs_ancestor = uses_ancestor = True
    defaults = {"density": 0.2, "lambda_ours": 1.0, "lambda_theirs": 1.0, "seed": 0}
    ranges = {"density": (0.0, 1.0, False), "seed": (0.0, float(2 ** 53), True)}
    integers = frozenset({"seed"})

    def prepare(self, name, A, B, O, p):
        density = p["density"]
        _check_density(self.name, density)
        seed = int(p["seed"])
        # one stream per side, consumed chunk after chunk: the same values as one draw of n numbers
        rng_a = np.random.default_rng(dare_seed(name, "ours", seed))
        rng_b = np.random.default_rng(dare_seed(name, "theirs", seed))
        lo, lt = p["lambda_ours"] / density, p["lambda_theirs"] / density

        def chunk(sl, a, b, o):
            n = sl.stop - sl.start
            keep_a = rng_a.random(n) < density
            keep_b = rng_b.random(n) < density
            return o + np.where(keep_a, a - o, 0) * lo + np.where(keep_b, b - o, 0) * lt

        return chunk  # (its streams start anew with each prepare: one pass over the chunks per call)
