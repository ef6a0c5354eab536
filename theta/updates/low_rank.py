"""low-rank: new = previous + R @ C, with R of shape (rows, r) and C of shape (r, cols) (LoRA).

Factors come in two forms (:class:`Factors`): ``R @ C`` as numpy's matmul computes it, giving the group's
shape -- stacks of matrices, as Git-Theta defines the update: a conv weight [16, 3, 3, 3] takes R [16, 3, 3, r]
and C [r, 3], or C [16, 3, r, 3], any pair whose leading dimensions broadcast to the group's -- and theta's own
matrix view of a group with more than two dimensions, R (shape[0], r) and C (r, product of the other
dimensions), which is what theta infers. Either way the group is a matrix of rows (its C-order elements,
``cols`` to a row) and each row is its previous value plus a row of R times one matrix C. Factors need two
dimensions each, and one-dimensional groups have no low-rank form.

Exact bit for bit. R @ C is evaluated the way torch's CPU matmul does for a small inner dimension --
a fused multiply-add per rank, in order, accumulating in float32 (float64 for float64 factors), rounded
to the factors' dtype -- then added to the previous value in float32 and rounded to the group's dtype.
Every step is an element-wise numpy operation (no BLAS call whose summation order could change between
machines), done block of rows by block of rows, so memory stays within a few row blocks beyond the
group. Where the producer of the saved file rounded differently anyway, the step carries the correct
elements (``fix_gaps``/``fix_values``, see sparse.residual): a checkout rebuilds the file exactly.

Stored parts: ``R``, ``C`` (as given when side-loaded; float32, or float64 for float64 groups, when
inferred) and the fixes. Params: ``rank``, ``fixes``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from theta.base import parallel
from theta.base.errors import UpdateTypeError
from theta.base.matmul import matmul_shape
from theta.storage.codec import decode_parts_of
from theta.updates import Encoded, row_blocks
from theta.updates.bounds import check_parts_fit
from theta.updates.delta import changed_mask, same_layout
from theta.updates.sparse import FIX_PARTS, FixCollector, apply_fix_blobs, apply_residual

MAX_INFERRED_RANK = 64
MAX_FIX_FRACTION = 1 / 4      # an inferred step is refused when more elements need an exact fix
THREAD_MIN_ELEMENTS = 1 << 18  # below this, one thread
ROW_BLOCK_ELEMENTS = 1 << 15  # elements per row block while applying (256 KiB of float64: stays in cache)
VERIFY_BLOCK_ELEMENTS = 1 << 20  # elements per block when checking factors against a saved value (4 MiB fp32)


GRAM_BYTES = 8 << 20  # a Gram matrix up to 1024 x 1024 float64 (eigh's work ~3 x that): exact and cheap
CLOSE_CHUNK = 1 << 16  # elements compared at a time (float64 temporaries: a few MiB)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    return shape[0], int(np.prod(shape[1:]))


def factor_dtype(group_dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(group_dtype) == np.float64 else np.dtype(np.float32)


def _product_dtype(R: np.ndarray, C: np.ndarray) -> np.dtype:
    """The dtype torch's R @ C returns: the factors' own when they agree, else the wider float."""
    if R.dtype == C.dtype:
        return R.dtype
    return np.dtype(np.float64) if np.float64 in (R.dtype, C.dtype) else np.dtype(np.float32)


class Factors:
    """R and C laid against a group of ``shape`` (see the module docstring): the group is ``rows`` x ``cols``;
    row i is row ``i % per_matrix`` of matrix ``i // per_matrix`` of the stack, the product of that matrix's
    rows of R and its C. Built from shapes checked first (:func:`layout`), so nothing larger than the factors
    themselves (and one int per matrix of the stack) is ever allocated for it. ValueError: what is wrong."""

    def __init__(self, shape: tuple[int, ...], R: np.ndarray, C: np.ndarray):
        lay = layout(shape, R.shape, C.shape)
        self.shape, self.rows, self.cols, self.rank = tuple(shape), lay.rows, lay.cols, lay.rank
        self.per_matrix = lay.per_matrix
        self.R, self.C = R, C
        # R as (matrices of R, per_matrix, r), C as (matrices of C, r, cols): views of the arrays as given
        self._R = np.reshape(R, (int(np.prod(lay.r_batch, dtype=np.int64)), lay.per_matrix, lay.rank))
        self._C = np.reshape(C, (int(np.prod(lay.c_batch, dtype=np.int64)), lay.rank, lay.cols))
        n = int(np.prod(lay.batch, dtype=np.int64))
        # for each matrix of the group's stack, the matrix of R and of C it takes (numpy's broadcasting)
        self._r_of = _broadcast_index(lay.r_batch, lay.batch, n)
        self._c_of = _broadcast_index(lay.c_batch, lay.batch, n)

    def r_rows(self, first: int, last: int) -> np.ndarray:
        """The rows of R the group's rows ``first..last`` take, (last - first, r)."""
        flat = self._R.reshape(-1, self.rank)
        if self._r_of is None and self._R.shape[0] * self.per_matrix == self.rows:
            return flat[first:last]  # a matrix of R for each matrix of the group
        m = self.per_matrix
        rows = np.arange(first, last, dtype=np.int64)
        which = 0 if self._r_of is None else self._r_of[rows // m]  # (None here: one R for them all)
        return flat[which * m + rows % m]

    def runs(self, first: int, last: int):
        """(a, b, C's matrix) for the consecutive spans of the rows ``first..last`` that take the same C."""
        if self._C.shape[0] == 1:
            yield first, last, self._C[0]
            return
        m = self.per_matrix
        c_of = (lambda k: k) if self._c_of is None else (lambda k: int(self._c_of[k]))
        a = first
        while a < last:
            c = c_of(a // m)
            b = (a // m + 1) * m
            while b < last and c_of(b // m) == c:  # the next matrix takes the same C (broadcast)
                b += m
            b = min(b, last)
            yield a, b, self._C[c]
            a = b


@dataclass(frozen=True)
class Layout:
    rows: int
    cols: int
    per_matrix: int
    rank: int
    batch: tuple[int, ...] = ()      # the group's stack of matrices (its dimensions before the last two)
    r_batch: tuple[int, ...] = ()    # R's and C's, which broadcast to it
    c_batch: tuple[int, ...] = ()


def layout(shape: tuple[int, ...], r_shape: tuple[int, ...], c_shape: tuple[int, ...]) -> Layout:
    """How factors shaped ``r_shape`` and ``c_shape`` lie against a group of ``shape``, from shapes alone;
    ValueError saying what is wrong."""
    shape, rs, cs = (tuple(int(d) for d in s) for s in (shape, r_shape, c_shape))
    if len(shape) < 2:
        raise ValueError(f"a group of shape {shape} has no low-rank form (needs at least 2 dimensions)")
    if len(rs) < 2 or len(cs) < 2:
        raise ValueError(f"R and C need at least 2 dimensions each (matrices, or stacks of them), got shapes "
                         f"{rs} and {cs}")
    if len(shape) > 2 and len(rs) == len(cs) == 2:  # theta's matrix view of an N-d group
        rows, cols = matrix_shape(shape)
        if rs[0] == rows and cs[1] == cols and rs[1] == cs[0]:
            return Layout(rows, cols, rows, rs[1])
    try:
        got = matmul_shape(rs, cs)
    except ValueError as e:
        raise ValueError(f"R {rs} @ C {cs} does not give the group's shape {shape}: {e}") from None
    if got != shape:
        view = (f", nor are they R ({shape[0]}, r) and C (r, {matrix_shape(shape)[1]}) (theta's matrix view)"
                if len(shape) > 2 else "")
        raise ValueError(f"R {rs} @ C {cs} does not give the group's shape {shape} (numpy's matmul gives "
                         f"{got}){view}")
    batch = shape[:-2]
    return Layout(int(np.prod(batch, dtype=np.int64)) * shape[-2], shape[-1], shape[-2], rs[-1], batch,
                  rs[:-2], cs[:-2])


def _broadcast_index(own: tuple[int, ...], batch: tuple[int, ...], n: int) -> np.ndarray | None:
    """For each matrix of ``batch`` (C order), the index of the matrix of a factor stacked as ``own`` that numpy's
    broadcasting pairs with it; None when that is the same index or always 0 (no table needed)."""
    count = int(np.prod(own, dtype=np.int64))
    if count <= 1 or tuple((1,) * (len(batch) - len(own)) + own) == batch:
        return None
    return np.broadcast_to(np.arange(count, dtype=np.int64).reshape(own), batch).reshape(n)


def add_low_rank(previous: np.ndarray, R: np.ndarray, C: np.ndarray, out: np.ndarray | None = None,
                 factors: Factors | None = None, first_row: int = 0) -> np.ndarray:
    """previous + R @ C in previous's dtype, computed deterministically (see module docstring).

    ``previous`` is the whole group, or with ``factors`` (laid against the whole group) the group's rows from
    ``first_row`` on, as a (rows, cols) block. Row ranges run on up to two threads (numpy releases the GIL);
    each element's arithmetic is the same whatever the split, so the result does not depend on it. ``out``
    (previous's shape and dtype, C-contiguous) may be ``previous`` itself: each block of rows is read before
    it is written."""
    if factors is None:
        factors = Factors(previous.shape, R, C)
    cols = factors.cols
    rows = previous.size // cols if cols else 0
    prev2 = np.ascontiguousarray(previous).reshape(rows, cols)
    out = np.empty((rows, cols), dtype=previous.dtype) if out is None else out.reshape(rows, cols)
    dts = _dtypes(R, C, previous.dtype)
    spans = [(0, rows)]
    if rows * cols >= 2 * THREAD_MIN_ELEMENTS and rows >= 2:
        half = rows // 2
        spans = [(0, half), (half, rows)]
    jobs = [(prev2, factors, out, a, b, first_row, dts) for a, b in spans]
    if len(jobs) > 1:
        pool = parallel.pool("numeric")
        for f in [pool.submit(_add_span, *job) for job in jobs]:
            f.result()
    else:
        _add_span(*jobs[0])
    return out.reshape(previous.shape)


def _add_span(prev2, factors: Factors, out, first: int, last: int, first_row: int, dts) -> None:
    """Rows ``first..last`` of the block (the group's rows from ``first_row`` on), one C at a time."""
    for a, b, Cm in factors.runs(first_row + first, first_row + last):
        RT = np.ascontiguousarray(np.asarray(factors.r_rows(a, b), dtype=np.float64).T)  # (r, rows)
        lo, hi = a - first_row, b - first_row
        _add_rows(prev2[lo:hi], RT, np.asarray(Cm, dtype=np.float64), out[lo:hi], 0, hi - lo, dts)


def _dtypes(R: np.ndarray, C: np.ndarray, group: np.dtype) -> tuple[np.dtype, np.dtype, np.dtype]:
    pdt = _product_dtype(R, C)
    acc_dt = np.dtype(np.float64) if pdt == np.float64 else np.dtype(np.float32)
    add_dt = np.dtype(np.float64) if np.float64 in (pdt, group) else np.dtype(np.float32)
    return pdt, acc_dt, add_dt


def _add_rows(prev2, RT, C64, out, first: int, last: int, dts) -> None:
    pdt, acc_dt, add_dt = dts
    cols = prev2.shape[1]
    step = max(1, ROW_BLOCK_ELEMENTS // max(cols, 1))
    # scratch buffers reused block after block (small enough to stay in cache)
    prod_buf = np.empty(step * cols, np.float64)
    acc_buf = np.empty(step * cols, acc_dt)
    for start in range(first, last, step):
        stop = min(last, start + step)
        prod = prod_buf[:(stop - start) * cols].reshape(stop - start, cols)
        acc = acc_buf[:(stop - start) * cols].reshape(stop - start, cols)
        acc.fill(0)
        for k in range(RT.shape[0]):
            # fma(r, c, acc): the float32 product is exact in float64, then one rounding to acc's dtype
            np.multiply(RT[k, start:stop, None], C64[k], out=prod)
            np.add(prod, acc, out=acc, casting="unsafe")  # summed in float64, rounded once into acc
        if pdt == acc_dt == add_dt:
            np.add(acc, prev2[start:stop], out=acc)
            out[start:stop] = acc
        else:
            rc = acc.astype(pdt).astype(add_dt)
            rc += prev2[start:stop].astype(add_dt)
            out[start:stop] = rc.astype(out.dtype)


PASS_BLOCK_ELEMENTS = 1 << 18  # elements per block of rows in each pass over new - previous (2 MiB of float64)


class Difference:
    """new - previous (viewed as a (rows, cols) matrix) in float64, never held: each pass over it computes
    it block of rows by block of rows. What the SVD needs of it: products with small matrices."""

    def __init__(self, new: np.ndarray, previous: np.ndarray):
        self.rows, self.cols = matrix_shape(new.shape)
        self.new = np.ascontiguousarray(new).reshape(self.rows, self.cols)
        self.previous = np.ascontiguousarray(previous).reshape(self.rows, self.cols)

    def blocks(self):
        """(row slice, the difference's rows in float64) for consecutive blocks of rows."""
        for rows in row_blocks((self.rows, self.cols), PASS_BLOCK_ELEMENTS):
            yield rows, self.new[rows].astype(np.float64) - self.previous[rows].astype(np.float64)

    def finite(self) -> bool:
        return all(np.all(np.isfinite(d)) for _, d in self.blocks())

    def times(self, X: np.ndarray) -> np.ndarray:
        """D @ X (rows, k)."""
        out = np.empty((self.rows, X.shape[1]), np.float64)
        for rows, d in self.blocks():
            out[rows] = d @ X
        return out

    def transposed_times(self, Q: np.ndarray) -> np.ndarray:
        """D.T @ Q (cols, k), summed block after block."""
        out = np.zeros((self.cols, Q.shape[1]), np.float64)
        for rows, d in self.blocks():
            out += d.T @ Q[rows]
        return out

    def gram(self) -> np.ndarray:
        """D.T @ D (cols, cols) when cols <= rows, else D @ D.T (rows, rows): the small side."""
        if self.cols <= self.rows:
            out = np.zeros((self.cols, self.cols), np.float64)
            for _, d in self.blocks():
                out += d.T @ d
            return out
        return self._row_gram()

    def _row_gram(self) -> np.ndarray:
        out = np.zeros((self.rows, self.rows), np.float64)
        step = max(1, PASS_BLOCK_ELEMENTS // max(self.rows, 1))
        for a in range(0, self.cols, step):  # blocks of columns: D D^T = sum of D[:, c] D[:, c]^T
            d = self.new[:, a:a + step].astype(np.float64) - self.previous[:, a:a + step].astype(np.float64)
            out += d @ d.T
        return out

    def left_project(self, U: np.ndarray) -> np.ndarray:
        """U.T @ D (k, cols), U (rows, k)."""
        return self.transposed_times(U).T

    def spectrum(self, rank: int):
        """(S, factors): the largest ``rank`` singular values of D (descending) and ``factors(r)`` giving
        R = U[:, :r] * S[:r] (rows, r) and C = Vt[:r] (r, cols) in float64, the best rank-r approximation.

        A matrix whose small side is at most 4 (rank + 8), or whose Gram matrix on that side fits
        ``GRAM_BYTES``, is decomposed through that Gram matrix (D^T D or D D^T, summed block by block; its
        eigenvalues are the squared singular values); otherwise by a randomized range finder (fixed seed, two
        power iterations: a matrix whose rank is at most ``rank`` is recovered to rounding error), every
        product with D computed block by block. Only the r columns asked for are ever built on the large side."""
        rows, cols = self.rows, self.cols
        small = min(rows, cols)
        if small <= 4 * (rank + 8) or small * small * 8 <= GRAM_BYTES:
            w, V = np.linalg.eigh(self.gram())
            order = np.argsort(w)[::-1][:rank]
            S = np.sqrt(np.clip(w[order], 0.0, None))
            V = np.ascontiguousarray(V[:, order])
            if cols <= rows:  # V: right singular vectors; U S = D V
                return S, lambda r: (self.times(V[:, :r]), np.ascontiguousarray(V[:, :r].T))

            def wide(r):  # V: left singular vectors; Vt = U^T D / S
                with np.errstate(divide="ignore", invalid="ignore"):
                    inv = np.where(S[:r] > 0, 1.0 / S[:r], 0.0)
                return V[:, :r] * S[:r], self.left_project(V[:, :r]) * inv[:, None]
            return S, wide
        rng = np.random.default_rng(0)
        Y = self.times(rng.standard_normal((cols, rank + 8)))
        for _ in range(2):
            Q, _ = np.linalg.qr(Y)
            del Y
            Y = self.times(self.transposed_times(Q))
            del Q
        Q, _ = np.linalg.qr(Y)
        del Y
        U, S, Vt = np.linalg.svd(self.left_project(Q), full_matrices=False)
        return S[:rank], lambda r: ((Q @ U[:, :r]) * S[:r], np.ascontiguousarray(Vt[:r]))


def noise_level(previous: np.ndarray, rows: int, cols: int) -> float:
    """A bound on the singular values that rounding to the group's dtype adds to new - previous: rounding
    errors of size eps * |value| form a random matrix whose norm is about sigma * (sqrt(rows) + sqrt(cols))."""
    import ml_dtypes

    eps = float(ml_dtypes.finfo(previous.dtype).eps)
    flat = np.ascontiguousarray(previous).reshape(-1)
    # the mean square block by block: never a float64 copy of the group
    squares = sum(float(np.sum(np.square(flat[a:a + VERIFY_BLOCK_ELEMENTS], dtype=np.float64)))
                  for a in range(0, flat.size, VERIFY_BLOCK_ELEMENTS))
    rms = float(np.sqrt(squares / flat.size)) if flat.size else 0.0
    return 2.0 * eps * rms * (np.sqrt(rows) + np.sqrt(cols))


def close_enough(result: np.ndarray, target: np.ndarray, rtol: float, atol: float) -> bool:
    """allclose in float64, with NaN equal to NaN at the same places; chunk by chunk (allclose's float64
    temporaries of a whole block of rows were ~10 x that block)."""
    a = np.ascontiguousarray(result).reshape(-1)
    b = np.ascontiguousarray(target).reshape(-1)
    if a.size != b.size:
        return bool(np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True))
    return all(np.allclose(a[s:s + CLOSE_CHUNK].astype(np.float64), b[s:s + CLOSE_CHUNK].astype(np.float64),
                           rtol=rtol, atol=atol, equal_nan=True) for s in range(0, a.size, CLOSE_CHUNK))


def check_factors(shape: tuple[int, ...], R: np.ndarray, C: np.ndarray) -> str | None:
    """None when R and C fit a group of ``shape``; otherwise what is wrong."""
    try:
        layout(shape, R.shape, C.shape)
    except ValueError as e:
        return str(e)
    for name, f in (("R", R), ("C", C)):
        if f.dtype.kind != "f" and not str(f.dtype).startswith(("bfloat", "float8")):
            return f"{name} has non-float dtype {f.dtype}"
    return None


def exact_encoding_by_rows(new: np.ndarray, previous: np.ndarray, R: np.ndarray, C: np.ndarray,
                           check=None, max_fixes: int | None = None, lazy: bool = False) -> tuple[Encoded, int] | None:
    """The low-rank step for factors R, C with the fixes that make it exact, and the fix count, without the
    value: previous + R @ C is computed block of rows by block of rows (each element's arithmetic does not
    depend on the split), compared with ``new`` and dropped, so memory is ``new``, ``previous``, a block and the
    fixes. ``check(value_block, new_block, previous_block)`` is called on every block that needs fixes (e.g. a
    tolerance check). None as soon as more than ``max_fixes`` elements need a fix (when given). ``lazy``: the
    fix parts are :class:`theta.storage.codec.LazyArray` s read from the blocks' pieces (held once, never
    concatenated; for storing), else arrays."""
    factors = Factors(previous.shape, R, C)
    rows, cols = factors.rows, factors.cols
    prev2 = np.ascontiguousarray(previous).reshape(rows, cols)
    new2 = np.ascontiguousarray(new).reshape(rows, cols)
    step = max(1, VERIFY_BLOCK_ELEMENTS // max(cols, 1))
    fixes = FixCollector(new.size, new.dtype)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        value = add_low_rank(prev2[a:b], R, C, factors=factors, first_row=a)
        changed = np.flatnonzero(changed_mask(new2[a:b], value))
        if changed.size:
            if max_fixes is not None and fixes.count + changed.size > max_fixes:
                return None
            if check is not None:
                check(value, new2[a:b], prev2[a:b])
            fixes.add(changed + a * cols, new2[a:b].reshape(-1)[changed])
    return Encoded(parts={"R": R, "C": C, **fixes.parts(lazy)},
                   params={"rank": factors.rank, "fixes": fixes.count}), fixes.count


class LowRankUpdate:
    name = "low-rank"
    incremental = True

    def encode(self, new: np.ndarray, previous: np.ndarray | None, rank: int | None = None,
               rtol: float = 1e-5, atol: float = 1e-8, **options) -> Encoded | None:
        """Infer R, C from new - previous by a truncated SVD. None (the caller stores something else)
        when no rank small enough to be worth it (factors at most half the group) reproduces ``new``
        within rtol/atol, or more than 1/4 of the elements would need an exact fix. Without ``rank`` the
        rank is read off the singular values: those above the rounding noise (see noise_level).

        Streamed (:class:`Difference`): new - previous is never held, only computed block of rows by block of
        rows in float64 in each pass; memory is the factors, the SVD's small matrices and the fixes."""
        if not same_layout(new, previous) or matrix_shape(new.shape) is None or new.dtype.kind not in "fV":
            return None
        rows, cols = matrix_shape(new.shape)
        worth = (rows * cols) // (2 * (rows + cols))      # largest rank whose factors are <= half the group
        limit = min(int(rank) if rank else MAX_INFERRED_RANK, worth)
        if limit < 1:
            return None
        fdt = factor_dtype(new.dtype)
        diff = Difference(new, previous)
        if not diff.finite():
            return None
        S, factors = diff.spectrum(limit)
        if rank:
            r = int(rank)
        else:  # singular values above the rounding noise of the group's dtype (and 1e-6 of the largest)
            r = int(np.count_nonzero(S > max(noise_level(previous, rows, cols), S[0] * 1e-6))) if S.size else 1
        r = max(1, min(r, limit))
        R, C = factors(r)
        R, C = R.astype(fdt), C.astype(fdt)
        far: list = []

        def check(value, new_rows, previous_rows):
            if not close_enough(value, new_rows, rtol, atol):
                far.append(True)

        got = exact_encoding_by_rows(new, previous, R, C, check, max_fixes=int(new.size * MAX_FIX_FRACTION),
                                     lazy=True)
        if got is None or far:
            return None
        return got[0]

    def apply(self, parts: dict[str, np.ndarray], params: dict, previous: np.ndarray | None) -> np.ndarray:
        if previous is None:
            raise UpdateTypeError("low-rank update needs the previous value of its group")
        if "R" not in parts or "C" not in parts:
            raise UpdateTypeError(f"low-rank update is missing parts (has {sorted(parts)}, needs R and C)")
        problem = check_factors(previous.shape, parts["R"], parts["C"])
        if problem:
            raise UpdateTypeError(f"low-rank update: {problem}")
        return apply_residual(add_low_rank(previous, parts["R"], parts["C"]), parts)

    def apply_blob(self, blobs: dict, params: dict, previous: np.ndarray | None, in_place: bool) -> np.ndarray:
        """:meth:`apply` from the step's part blobs: the factors decoded, the fixes applied frame by frame
        (:func:`theta.updates.sparse.apply_fix_blobs`); with ``in_place`` the sum is written over the previous
        value, block of rows by block of rows."""
        check_parts_fit(blobs, previous, "low-rank")
        parts = decode_parts_of({k: b for k, b in blobs.items() if k not in FIX_PARTS})
        if previous is None or "R" not in parts or "C" not in parts:
            return self.apply(parts, params, previous)  # says what is missing
        problem = check_factors(previous.shape, parts["R"], parts["C"])
        if problem:
            raise UpdateTypeError(f"low-rank update: {problem}")
        mine = in_place and previous.flags.writeable and previous.flags.c_contiguous
        value = add_low_rank(previous, parts["R"], parts["C"], out=previous if mine else None)
        return apply_fix_blobs(value.reshape(previous.shape), blobs, "low-rank update")
