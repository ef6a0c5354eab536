"""The built-in merge strategies (registered as ``theta.merges`` entry points in pyproject.toml).

Notation: A = ours, B = theirs, O = ancestor, τ_A = A − O and τ_B = B − O (task vectors).
Arithmetic runs in float32 (float64 for float64 groups), chunk by chunk, so beyond the inputs and the
result only a few MiB of temporaries are alive; the result is cast back to the group's dtype.

The built-in strategies (``streams = True``) also take their inputs as sources of blocks
(:class:`theta.updates.stream.GroupSource` or ``PositionalSource``: ``shape``, ``dtype``, ``chunks(n)``) instead
of arrays, and give their result block by block too (:meth:`Elementwise.merge_blocks`), so a merge holds a few
frames, neither the three inputs nor the result; a strategy that needs several passes (TIES' thresholds, SLERP's
angle) reads its sources again before the pass that computes the result. Every built-in arithmetic strategy is
element-wise once those numbers are known, so its result in blocks is bit for bit its result computed whole.
A strategy without ``streams = True`` (a third party's) gets whole arrays: the three inputs and its result,
outside the memory bound by contract (docs/extending.md).
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

from zipslice import dtypes

from theta.base.errors import MergeError
from theta.updates.stream import side_by_side

# elements per chunk of elementwise work: 1 Mi elements = 4 MiB per float32 temporary
CHUNK = 1 << 20
# elements per block of the pass that computes a result (and of a merge's result, block by block): the strategies'
# temporaries are a dozen blocks of float32 at a time. Element-wise, so the result does not depend on it; the
# passes before it (TIES' thresholds, SLERP's sums) keep CHUNK, the order their sums were always taken in
BLOCK = 1 << 18
# slerp falls back to linear interpolation when |cos θ| exceeds this (vectors nearly parallel)
SLERP_PARALLEL = 0.9995


def work_dtype(arr: np.ndarray) -> np.dtype:
    """float64 for float64 groups, float32 for every narrower float (bf16, fp16, float8, fp32)."""
    return np.dtype(np.float64) if arr.dtype == np.float64 else np.dtype(np.float32)


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)


def _slices(n: int) -> Iterator[slice]:
    for start in range(0, n, CHUNK):
        yield slice(start, min(n, start + CHUNK))


def _side_by_side(*inputs: Any, n: int | None = None) -> Iterator[tuple]:
    return side_by_side(inputs, n or CHUNK)


class Strategy:
    """Common checks and parameter handling; subclasses set the class attributes and ``compute``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    needs_ancestor: ClassVar[bool] = False
    picks: ClassVar[str | None] = None
    defaults: ClassVar[dict[str, float]] = {}
    # parameter -> (low, high, low included): values outside are refused before any tensor is read
    ranges: ClassVar[dict[str, tuple[float, float, bool]]] = {}
    integers: ClassVar[frozenset[str]] = frozenset()  # parameters that must be whole numbers
    # True: ``merge`` also takes sources of blocks (theta.updates.stream) for ours/theirs/ancestor; False: whole
    # arrays (ancestor, ours and theirs rebuilt whole: up to 4 x the group with the result)
    streams: ClassVar[bool] = False

    def applies(self, dtype: str, has_ancestor: bool) -> bool:
        if self.needs_ancestor and not has_ancestor:
            return False
        return self.picks is not None or dtypes.get(dtype).kind == "float"

    def params(self, given: dict[str, Any]) -> dict[str, float]:
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            known = ", ".join(self.defaults) or "none"
            raise MergeError(f"merge strategy {self.name!r} has no parameter {', '.join(unknown)}; "
                             f"its parameters: {known}")
        out = dict(self.defaults)
        for key, value in given.items():
            try:
                out[key] = float(value)
            except (TypeError, ValueError, OverflowError):
                raise MergeError(f"merge strategy {self.name!r}: parameter {key}={value!r} is not a number") from None
            if not math.isfinite(out[key]):
                raise MergeError(f"merge strategy {self.name!r}: parameter {key}={value!r} is not finite")
            if key in self.integers and out[key] != int(out[key]):
                raise MergeError(f"merge strategy {self.name!r}: {key} must be a whole number, got {value!r}")
            if key in self.ranges:
                lo, hi, lo_in = self.ranges[key]
                if not ((lo <= out[key] if lo_in else lo < out[key]) and out[key] <= hi):
                    raise MergeError(f"merge strategy {self.name!r}: {key} must be in "
                                     f"{'[' if lo_in else '('}{lo:g}, {hi:g}], got {value!r}")
        return out

    def merge(self, name: str, ours: np.ndarray, theirs: np.ndarray, ancestor: np.ndarray | None,
              **params: Any) -> np.ndarray:
        return self.compute(name, ours, theirs, ancestor, self.check(name, ours, theirs, ancestor, params))

    def check(self, name: str, ours: Any, theirs: Any, ancestor: Any, params: dict[str, Any]) -> dict[str, float]:
        """The parameters, checked, once the inputs are checked to fit this strategy (MergeError otherwise)."""
        p = self.params(params)
        arrays = [("ours", ours), ("theirs", theirs)] + ([("ancestor", ancestor)] if ancestor is not None else [])
        for side, arr in arrays[1:]:
            if arr.shape != ours.shape or arr.dtype != ours.dtype:
                raise MergeError(f"group {name!r}: {side} is {arr.dtype}{list(arr.shape)} but ours is "
                                 f"{ours.dtype}{list(ours.shape)}; strategy {self.name!r} needs equal shapes and dtypes")
        if self.needs_ancestor and ancestor is None:
            raise MergeError(f"group {name!r}: strategy {self.name!r} needs the common ancestor, which has no such group")
        if self.picks is None and dtypes.from_numpy(ours.dtype).kind != "float":
            raise MergeError(f"group {name!r}: strategy {self.name!r} only merges floating-point groups, "
                             f"not {dtypes.from_numpy(ours.dtype).name}")
        return p

    def compute(self, name: str, A: np.ndarray, B: np.ndarray, O: np.ndarray | None,
                p: dict[str, float]) -> np.ndarray:
        raise NotImplementedError


Blockwise = Callable[[slice, np.ndarray, np.ndarray, "np.ndarray | None"], np.ndarray]


def _blocks(A: Any, B: Any, O: Any, fn: Blockwise) -> Iterator[tuple[slice, np.ndarray, list]]:
    """``(slice, fn(slice, a, b, o) in A's dtype, [a, b, o] as read)`` for each chunk, in order: ``fn`` gets the
    chunk's values in the work dtype (fresh arrays it may modify)."""
    wd = work_dtype(A)
    for sl, a, b, o in _side_by_side(A, B, O, n=min(BLOCK, CHUNK)):
        out = fn(sl, a.astype(wd), b.astype(wd), o.astype(wd) if o is not None else None).astype(A.dtype)
        yield sl, out, [x for x in (a, b, o) if x is not None]


def _elementwise(A: Any, B: Any, O: Any, fn: Blockwise) -> np.ndarray:
    """:func:`_blocks` written into a result of A's dtype and shape."""
    out = np.empty(A.shape, dtype=A.dtype)
    fout = out.reshape(-1)
    for sl, block, _ in _blocks(A, B, O, fn):
        fout[sl] = block
    return out


class Elementwise(Strategy):
    """A strategy whose result, once :meth:`prepare` has read what it needs of the whole inputs (thresholds, an
    angle), is ``fn`` applied chunk by chunk: computed whole (:meth:`merge`) or given block by block
    (:meth:`merge_blocks`), the same bits."""

    streams = True
    uses_ancestor: ClassVar[bool] = False  # fn reads the ancestor's chunk

    def prepare(self, name: str, A: Any, B: Any, O: Any, p: dict[str, float]) -> Blockwise:
        raise NotImplementedError

    def compute(self, name, A, B, O, p):
        fn = self.prepare(name, A, B, O, p)
        return _elementwise(A, B, O if self.uses_ancestor else None, fn)

    def merge_blocks(self, name: str, ours: Any, theirs: Any, ancestor: Any,
                     **params: Any) -> Iterator[tuple[slice, np.ndarray, list]]:
        """The merged value in order, block by block: ``(slice of the flattened value, the block in the group's
        dtype, the inputs' blocks at those positions as read)``, after the checks of :meth:`merge`. The inputs
        are arrays or sources of blocks; a few chunks of each are held, never a whole group."""
        p = self.check(name, ours, theirs, ancestor, params)
        fn = self.prepare(name, ours, theirs, ancestor, p)
        return _blocks(ours, theirs, ancestor if self.uses_ancestor else None, fn)


class _Pick(Strategy):
    def compute(self, name, A, B, O, p):
        return {"ours": A, "theirs": B, "ancestor": O}[self.picks]


class Ours(_Pick):
    name, picks, summary = "ours", "ours", "keep our version of the group"


class Theirs(_Pick):
    name, picks, summary = "theirs", "theirs", "take their version of the group"


class Ancestor(_Pick):
    name, picks, needs_ancestor = "ancestor", "ancestor", True
    summary = "go back to the common ancestor's version"


class Average(Elementwise):
    name = "average"
    summary = "alpha·ours + (1−alpha)·theirs"
    defaults = {"alpha": 0.5}

    def prepare(self, name, A, B, O, p):
        alpha = p["alpha"]
        return lambda sl, a, b, o: a * alpha + b * (1.0 - alpha)


class TaskArithmetic(Elementwise):
    name = "task-arithmetic"
    summary = "ancestor + λ_ours·(ours−ancestor) + λ_theirs·(theirs−ancestor)"
    needs_ancestor = uses_ancestor = True
    defaults = {"lambda_ours": 1.0, "lambda_theirs": 1.0}

    def prepare(self, name, A, B, O, p):
        lo, lt = p["lambda_ours"], p["lambda_theirs"]
        return lambda sl, a, b, o: o + (a - o) * lo + (b - o) * lt


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
        for _, x, o in _side_by_side(X, O):
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


class Slerp(Elementwise):
    name = "slerp"
    summary = "spherical interpolation from ours (t=0) to theirs (t=1); linear when nearly parallel"
    defaults = {"t": 0.5}
    ranges = {"t": (0.0, 1.0, True)}  # an interpolation: beyond [0, 1] sin((1-t)θ) gives finite garbage

    def prepare(self, name, A, B, O, p):
        t = p["t"]
        wd = work_dtype(A)
        dot = na = nb = 0.0  # the first pass: the angle, from chunks of CHUNK summed in order
        for _, a, b in _side_by_side(A, B):
            a, b = a.astype(np.float64), b.astype(np.float64)
            dot += float(a @ b)
            na += float(a @ a)
            nb += float(b @ b)
        ca, cb = 1.0 - t, t
        if na > 0 and nb > 0:
            cos = max(-1.0, min(1.0, dot / math.sqrt(na * nb)))
            if abs(cos) <= SLERP_PARALLEL:
                theta = math.acos(cos)
                ca = math.sin((1.0 - t) * theta) / math.sin(theta)
                cb = math.sin(t * theta) / math.sin(theta)
        ca, cb = wd.type(ca), wd.type(cb)
        return lambda sl, a, b, o: a * ca + b * cb
