"""sparse: the positions and new values of the elements whose bits changed.

Exact bit for bit: elements are compared by their raw bits (so -0.0 vs +0.0 and NaN payloads count
as changes or non-changes exactly), and the stored values are the new elements themselves, not a
difference, so applying is a plain scatter with no arithmetic.

Stored parts: ``gaps`` (the flat indices of the changed elements, delta-coded: first index, then the
distance to the previous one -- small numbers that zstd packs tightly) and ``values`` (the new
elements, in the group's dtype). Params: ``count``.
"""
from __future__ import annotations

import numpy as np

from theta.base.errors import UpdateTypeError
from theta.storage import codec
from theta.storage.codec import array_info, iter_decode_array
from theta.updates import Encoded
from theta.updates.delta import CHUNK, changed_mask, same_layout


class _Changes:
    """The flat indices of the elements whose bits differ, by rank, recomputed chunk by chunk on demand
    (one pass up front counts them per chunk; nothing group-sized is kept)."""

    def __init__(self, new: np.ndarray, previous: np.ndarray):
        self.new, self.previous = new.reshape(-1), previous.reshape(-1)
        counts = [int(np.count_nonzero(self._mask(s))) for s in range(0, self.new.size, CHUNK)]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # rank of each chunk's first
        self.count = int(self.starts[-1])

    def _mask(self, start: int) -> np.ndarray:
        return changed_mask(self.new[start:start + CHUNK], self.previous[start:start + CHUNK])

    def indices(self, lo: int, hi: int, dtype: np.dtype = np.dtype(np.int64)) -> np.ndarray:
        """Flat indices of the changes of rank lo..hi-1, as ``dtype``: written chunk by chunk into the result
        (a frame of a half-changed group spans two chunks; their int64 indices concatenated, then narrowed,
        held ~10 x the frame, with several frames in flight on the codec threads)."""
        out = np.empty(max(0, hi - lo), dtype)
        if hi <= lo:
            return out
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        at = 0
        for c in range(first, self.starts.size - 1):
            if at == out.size:
                break
            skip = lo - int(self.starts[c]) if c == first else 0
            found = np.flatnonzero(self._mask(c * CHUNK))[skip:skip + out.size - at]
            out[at:at + found.size] = found + c * CHUNK
            at += found.size
        return out


def index_dtype(size: int) -> np.dtype:
    return np.dtype("<u4") if size < 2**32 else np.dtype("<u8")


def encode_indices(indices: np.ndarray, size: int) -> np.ndarray:
    """Sorted flat indices -> gaps (first index, then differences), in the narrowest sufficient type."""
    idx = indices.astype(index_dtype(size), copy=False)
    gaps = np.empty_like(idx)
    if idx.size:
        gaps[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    return gaps


def decode_indices(gaps: np.ndarray) -> np.ndarray:
    return np.cumsum(gaps, dtype=np.int64)


def residual(value: np.ndarray, target: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
    """Parts ``fix_gaps``/``fix_values`` that turn ``value`` into ``target`` bit for bit, and their count.

    Low-rank and IA3 updates carry these so that a checkout rebuilds the saved file exactly even where
    the producer's arithmetic rounded differently from ours."""
    indices = np.flatnonzero(changed_mask(target, value))
    return {"fix_gaps": encode_indices(indices, target.size),
            "fix_values": np.ascontiguousarray(target).reshape(-1)[indices]}, int(indices.size)


def scatter_blobs(gaps_blob, values_blob, out: np.ndarray, what: str) -> None:
    """``out.flat[indices] = values`` for the delta-coded indices and the values of two array blobs, frame by
    frame (memory: a frame of each, whatever the number of changes). Checked before anything is written
    (as many indices as values, integer gaps) and per frame (indices in range, never decreasing); a value
    already updated by earlier frames is the caller's to discard when a later frame is refused."""
    gdt, gshape = array_info(gaps_blob)
    vdt, vshape = array_info(values_blob)
    count = int(np.prod(gshape, dtype=np.int64))
    if gdt.kind not in "iu" or count != int(np.prod(vshape, dtype=np.int64)) or count > out.size:
        raise UpdateTypeError(f"{what} does not fit a group of shape {out.shape} ({count} {gdt} indices, "
                              f"{int(np.prod(vshape, dtype=np.int64))} values)")
    flat = out.reshape(-1)
    values = iter_decode_array(values_blob, ahead=1)
    pending = np.empty(0, out.dtype)  # values decoded but not used yet
    last = -1  # the index before the next frame's first gap
    try:
        for _, gaps in iter_decode_array(gaps_blob, ahead=1):
            idx = np.cumsum(gaps, dtype=np.int64)
            idx += last if last >= 0 else 0
            if idx.size and (idx[0] < max(last, 0) or idx[-1] >= flat.size or np.any(np.diff(idx) < 0)):
                raise UpdateTypeError(f"{what} indices are not increasing within a group of {flat.size} elements")
            while pending.size < idx.size:
                pending = np.concatenate([pending, next(values)[1].astype(out.dtype, copy=False)])
            flat[idx] = pending[:idx.size]
            pending = pending[idx.size:]
            if idx.size:
                last = int(idx[-1])
    finally:
        values.close()


FIX_PARTS = ("fix_gaps", "fix_values")


class FixCollector:
    """The fixes of a step (:func:`residual`'s parts) found block by block, in ascending order: each block's
    indices (narrowed) and values are kept as they come; :meth:`parts` gives them without concatenating
    (lazily: the codec reads across the pieces frame by frame), so the fixes are held once."""

    def __init__(self, size: int, dtype: np.dtype):
        self.size, self.dtype, self.idt = size, np.dtype(dtype), index_dtype(size)
        self.indices: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.count = 0

    def add(self, indices: np.ndarray, values: np.ndarray) -> None:
        if indices.size:
            self.indices.append(indices.astype(self.idt, copy=False))
            self.values.append(np.asarray(values, self.dtype))
            self.count += int(indices.size)

    def parts(self, lazy: bool = True, names: tuple[str, str] = FIX_PARTS) -> dict:
        """The fixes' parts (``names``: a sparse step's own are ``("gaps", "values")``: the same layout)."""
        if not lazy:
            idx = np.concatenate(self.indices) if self.indices else np.empty(0, self.idt)
            vals = np.concatenate(self.values) if self.values else np.empty(0, self.dtype)
            return {names[0]: encode_indices(idx, self.size), names[1]: vals}
        starts = np.cumsum([0] + [a.size for a in self.indices])

        def gather(pieces: list, a: int, b: int, dtype) -> np.ndarray:
            out = np.empty(b - a, dtype)
            k = int(np.searchsorted(starts, a, side="right")) - 1
            at = a
            while at < b:
                lo = at - int(starts[k])
                take = min(b - at, pieces[k].size - lo)
                out[at - a:at - a + take] = pieces[k][lo:lo + take]
                at += take
                k += 1
            return out

        def gaps(a: int, b: int) -> np.ndarray:
            idx = gather(self.indices, max(a - 1, 0), b, self.idt)
            if a == 0:
                out = np.empty(b - a, self.idt)
                if out.size:
                    out[0] = idx[0]
                    np.subtract(idx[1:], idx[:-1], out=out[1:])
                return out
            return np.subtract(idx[1:], idx[:-1])

        return {names[0]: codec.LazyArray(self.idt, (self.count,), gaps),
                names[1]: codec.LazyArray(self.dtype, (self.count,), lambda a, b: gather(self.values, a, b,
                                                                                      self.dtype))}


def apply_fix_blobs(value: np.ndarray, blobs: dict, what: str) -> np.ndarray:
    """``value`` with the fixes of :func:`residual` applied from their part blobs, frame by frame (in place
    when writable)."""
    has = [name in blobs for name in FIX_PARTS]
    if has[0] != has[1]:
        raise UpdateTypeError(f"{what} fixes are incomplete (parts {sorted(blobs)})")
    if not has[0]:
        return value
    value = value if value.flags.writeable and value.flags.c_contiguous else np.array(value, order="C")
    scatter_blobs(blobs["fix_gaps"], blobs["fix_values"], value, f"{what} fixes")
    return value


def apply_residual(value: np.ndarray, parts: dict[str, np.ndarray]) -> np.ndarray:
    """``value`` with the fixes of :func:`residual` applied (in place when writable)."""
    if "fix_gaps" not in parts:
        return value
    indices = decode_indices(parts["fix_gaps"])
    values = parts["fix_values"]
    if indices.size != values.size or (indices.size and indices[-1] >= value.size):
        raise UpdateTypeError(f"update fixes do not fit a group of shape {value.shape} "
                              f"({indices.size} indices, {values.size} values)")
    value = value if value.flags.writeable and value.flags.c_contiguous else np.array(value, order="C")
    value.reshape(-1)[indices] = values.astype(value.dtype, copy=False).reshape(-1)
    return value


class SparseUpdate:
    """new = previous with the listed elements replaced."""

    name = "sparse"
    incremental = True

    def encode(self, new: np.ndarray, previous: np.ndarray | None, **options) -> Encoded | None:
        """The change as lazy ``gaps`` and ``values`` parts, computed chunk by chunk while the blob is written
        (so up to half of a group changed never holds a group-sized index array; new and previous must stay
        unchanged until then). The stored blob is the same as from the arrays (``lazy=False``)."""
        if not same_layout(new, previous):
            return None
        if not options.get("lazy", True):  # arrays, for callers that apply the parts themselves
            indices = np.flatnonzero(changed_mask(new, previous))
            values = np.ascontiguousarray(new).reshape(-1)[indices]
            return Encoded(parts={"gaps": encode_indices(indices, new.size), "values": values},
                           params={"count": int(indices.size)})
        changes = _Changes(new, previous)
        idt = index_dtype(new.size)
        flat = np.ascontiguousarray(new).reshape(-1)

        def gaps(lo: int, hi: int) -> np.ndarray:
            idx = changes.indices(max(lo - 1, 0), hi, idt)
            out = np.empty(hi - lo, dtype=idt)
            if lo == 0:
                if out.size:
                    out[0] = idx[0]
                    np.subtract(idx[1:], idx[:-1], out=out[1:])
            else:
                np.subtract(idx[1:], idx[:-1], out=out)
            return out

        parts = {"gaps": codec.LazyArray(idt, (changes.count,), gaps),
                 "values": codec.LazyArray(flat.dtype, (changes.count,),
                                           lambda lo, hi: flat[changes.indices(lo, hi, idt)])}
        return Encoded(parts=parts, params={"count": changes.count})

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        if previous is None:
            raise UpdateTypeError("sparse update needs the previous value of its group")
        indices, values = _checked_changes(parts, previous)
        out = np.array(previous, copy=True, order="C")
        out.reshape(-1)[indices] = values
        return out

    def apply_blob(self, blobs: dict, params: dict, previous: np.ndarray | None, in_place: bool) -> np.ndarray:
        """:meth:`apply` from the step's part blobs, frame by frame (:func:`scatter_blobs`): with ``in_place``
        the previous value is updated itself, else a copy of it; never the indices or values whole (a step
        changing half of a group held them: up to two groups beside the value)."""
        if previous is None:
            raise UpdateTypeError("sparse update needs the previous value of its group")
        if "gaps" not in blobs or "values" not in blobs:
            raise UpdateTypeError(f"sparse update is missing parts (has {sorted(blobs)}, needs gaps and values)")
        mine = in_place and previous.flags.writeable and previous.flags.c_contiguous
        out = previous if mine else np.array(previous, copy=True, order="C")
        scatter_blobs(blobs["gaps"], blobs["values"], out, "sparse update")
        return out


def _checked_changes(parts: dict[str, np.ndarray], previous: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, values in ``previous``'s dtype) of a sparse step, after checking they fit
    ``previous``: a hostile step is refused before any group-sized work."""
    if "gaps" not in parts or "values" not in parts:
        raise UpdateTypeError(f"sparse update is missing parts (has {sorted(parts)}, needs gaps and values)")
    indices = decode_indices(parts["gaps"])
    values = parts["values"]
    if indices.size != values.size or (indices.size and (indices[-1] >= previous.size or indices.min() < 0)):
        raise UpdateTypeError(f"sparse update does not fit a group of shape {previous.shape} "
                              f"({indices.size} indices, {values.size} values)")
    return indices, values.astype(previous.dtype, copy=False).reshape(-1)
