"""The base of the built-in merge strategies: :class:`Strategy` (checks, parameters) and :class:`Elementwise`
(a result computed chunk by chunk, whole or block by block), and the chunking they share.

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
def work_dtype(arr: np.ndarray) -> np.dtype:
    """float64 for float64 groups, float32 for every narrower float (bf16, fp16, float8, fp32)."""
    return np.dtype(np.float64) if arr.dtype == np.float64 else np.dtype(np.float32)


def flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)


def slices(n: int) -> Iterator[slice]:
    for start in range(0, n, CHUNK):
        yield slice(start, min(n, start + CHUNK))


def chunks_side_by_side(*inputs: Any, n: int | None = None) -> Iterator[tuple]:
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
    for sl, a, b, o in chunks_side_by_side(A, B, O, n=min(BLOCK, CHUNK)):
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
