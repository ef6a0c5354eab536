"""Side-loaded update data (Git-Theta compatible): `git theta add PATH --update-type T --update-data FILE`.

FILE is a checkpoint in any format zipslice reads. Its keys are ``<group name>/<part>`` (split at the
last ``/``) with Git-Theta's part names:

- ``low-rank``: ``R`` and ``C``; new = previous + R @ C, numpy's matmul giving the group's shape (matrices, or
  stacks of them for a group of more than two dimensions, as Git-Theta defines them: a conv weight [16, 3, 3,
  3] takes R [16, 3, 3, r] and C [r, 3]), or theta's matrix view R (shape[0], r), C (r, rest): low_rank.py. Checked against the saved file within rtol/atol (a
  wrong base or wrong factors are refused); stored exactly (elements our arithmetic rounds differently
  from the producer's are carried as fixes), so a checkout gives the saved file bit for bit.
- ``sparse``: ``data``, ``indices``, ``indptr``, ``shape`` -- a CSR matrix of the update, either of the
  flattened group (1 x N, as Git-Theta writes it: ``indptr`` has two entries) or, for a 2-D group, of the
  group itself; new = previous + update. Checked exactly (bit for bit) against the saved file; what is
  stored are the changed elements of the file themselves.
- ``ia3``: ``ia3``, broadcastable to the group; new = previous * ia3. Checked within rtol/atol, stored
  exactly like low-rank.

Everything that can be checked without tensor data (known group names, complete and known part names,
shapes) is checked by :meth:`UpdateData.check_against` before any group is encoded, so a bad file fails
the clean filter -- and with it ``git add`` -- before anything is staged. Groups absent from FILE are
handled as plain changes by the caller.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

import zipslice
from zipslice import dtypes, torch_writer
from zipslice.convert import plan_write

from theta.base.errors import GitThetaFormatError, UpdateDataError
from theta.base.matmul import matmul_shape
from theta.peers.gittheta.arithmetic import apply_update
from theta.peers.gittheta.blobs import result_dtype
from theta.updates import Encoded, row_blocks
from theta.updates.delta import changed_mask
from theta.updates.ia3 import BLOCK_ELEMENTS, check_vector, check_vector_shape, compute_dtype, scaled_blocks
from theta.updates.low_rank import check_factors, exact_encoding_by_rows, layout
from theta.updates.sparse import SparseUpdate, encode_indices

PARTS: dict[str, tuple[str, ...]] = {
    "low-rank": ("R", "C"),
    "sparse": ("data", "indices", "indptr", "shape"),
    "ia3": ("ia3",),
}


_AGREE_CHUNK = 1 << 16  # float64 temporaries of a chunk: ~3 MiB (1 << 20 cost ~50 MiB)


@dataclass
class Verified:
    encoded: Encoded | None     # None for "dense": the value itself is stored
    update_type: str            # the type stored in the step
    value: np.ndarray           # what a checkout rebuilds: the saved file's value, bit for bit


@dataclass
class UpdateData:
    path: Path
    update_type: str
    keys: dict[str, dict[str, str]] = field(default_factory=dict)  # group -> part -> key in the file
    _ckpt: object = None

    @classmethod
    def open(cls, path: str | os.PathLike, update_type: str) -> "UpdateData":
        """Open FILE lazily and check its key names (no tensor data is read)."""
        path = Path(path)
        if update_type not in PARTS:
            raise UpdateDataError(f"update data {path}: update type {update_type!r} takes no side-loaded data "
                                  f"(use one of {', '.join(PARTS)})")
        if not path.is_file():
            raise UpdateDataError(f"update data {path}: no such file")
        try:
            ckpt = zipslice.load(path)
        except zipslice.ZipsliceError as e:
            raise UpdateDataError(f"update data {path}: cannot read it: {e}") from None
        data = cls(path, update_type, {}, ckpt)
        wanted = PARTS[update_type]
        for key in ckpt.keys():
            group, sep, part = key.rpartition("/")
            if not sep or not group:
                raise UpdateDataError(f"update data {path}: key {key!r} is not <group name>/<part>")
            if part not in wanted:
                raise UpdateDataError(f"update data {path}: key {key!r} has part {part!r}; a {update_type} "
                                      f"update has parts {', '.join(wanted)}")
            data.keys.setdefault(group, {})[part] = key
        for group, parts in data.keys.items():
            missing = [p for p in wanted if p not in parts]
            if missing:
                raise UpdateDataError(f"update data {path}: group {group!r} lacks part(s) {', '.join(missing)} "
                                      f"of a {update_type} update")
        if not data.keys:
            raise UpdateDataError(f"update data {path}: holds no update (no <group>/<part> keys)")
        return data

    def close(self) -> None:
        close = getattr(self._ckpt, "close", None)
        if close:
            close()

    def __contains__(self, group: str) -> bool:
        return group in self.keys

    def _shape(self, group: str, part: str) -> tuple[int, ...]:
        return tuple(self._ckpt.info(self.keys[group][part]).shape)

    def check_against(self, shapes: Mapping[str, tuple[int, ...]], has_previous: Mapping[str, bool] | None = None
                      ) -> None:
        """Every group of FILE exists in the checkpoint (with a previous version) and its parts fit its shape."""
        unknown = sorted(set(self.keys) - set(shapes))
        if unknown:
            raise UpdateDataError(f"update data {self.path}: group(s) {', '.join(map(repr, unknown[:5]))} "
                                  f"{'are' if len(unknown) > 1 else 'is'} not in the checkpoint")
        for group in self.keys:
            if has_previous is not None and not has_previous.get(group, False):
                raise UpdateDataError(f"update data {self.path}: group {group!r} has no previous version "
                                      f"to apply a {self.update_type} update to (commit the base model first)")
            problem = self._shape_problem(group, tuple(shapes[group]))
            if problem:
                raise UpdateDataError(f"update data {self.path}: group {group!r}: {problem}")

    def _shape_problem(self, group: str, shape: tuple[int, ...]) -> str | None:
        if self.update_type == "low-rank":
            rs, cs = self._shape(group, "R"), self._shape(group, "C")
            try:  # from the shapes alone: nothing is read or allocated for factors that do not fit
                layout(shape, rs, cs)
            except ValueError as e:
                return None if _git_theta_matmul_fits(shape, rs, cs) else str(e)
            return None
        if self.update_type == "ia3":
            return check_vector_shape(shape, self._shape(group, "ia3"))
        for part in ("data", "indices", "indptr", "shape"):
            if len(self._shape(group, part)) != 1:
                return f"sparse part {part} must be one-dimensional, has shape {self._shape(group, part)}"
        if self._shape(group, "shape")[0] != len(shape):
            return f"sparse part shape has {self._shape(group, 'shape')[0]} entries, the group has {len(shape)} dims"
        return None

    def parts(self, group: str) -> dict[str, np.ndarray]:
        """Read one group's parts."""
        return {part: np.asarray(self._ckpt.numpy(key)) for part, key in self.keys[group].items()}

    def verify(self, group: str, new: np.ndarray, previous: np.ndarray, rtol: float, atol: float) -> Verified:
        """Apply the side-loaded update to ``previous``; it must give ``new`` (see module docstring).
        The returned encoding rebuilds ``new`` bit for bit."""
        where = f"update data {self.path}: group {group!r}"
        if previous is None:
            raise UpdateDataError(f"{where}: no previous version to apply the update to")
        parts = self.parts(group)
        if previous.shape == new.shape and previous.dtype != new.dtype and \
                new.dtype == promoted_dtype(self.update_type, parts, previous.dtype):
            return self._verify_promoted(where, group, parts, new, previous, rtol, atol)
        if previous.shape != new.shape or previous.dtype != new.dtype:
            raise UpdateDataError(f"{where}: the group changed from {previous.dtype}{list(previous.shape)} to "
                                  f"{new.dtype}{list(new.shape)}; a {self.update_type} update cannot do that")
        if self.update_type == "sparse":
            return self._verify_sparse(where, parts, new, previous)
        if self.update_type == "low-rank":
            R, C = np.asarray(parts["R"], order="C"), np.asarray(parts["C"], order="C")
            problem = check_factors(new.shape, R, C)
            if problem and _git_theta_matmul_fits(new.shape, R.shape, C.shape):
                # numpy's matmul with a vector, or integer factors: Git-Theta's arithmetic gives the group's
                # shape and dtype, theta's low-rank step does not take them: stored as the value itself
                return self._verify_promoted(where, group, parts, new, previous, rtol, atol)
            if problem:
                raise UpdateDataError(f"{where}: {problem}")
            bad: list = []

            def check(value, new_rows, previous_rows):  # the tolerance check below, block by block
                if not _agrees(value, new_rows, previous_rows, rtol, atol):
                    err = float(np.max(np.abs(value.astype(np.float64) - new_rows.astype(np.float64))))
                    bad.append(err)

            # block of rows by block of rows: never previous, new AND the value they give (3 groups); the fixes
            # held once (lazy parts read from the blocks' pieces while the blob is written)
            encoded, fixes = exact_encoding_by_rows(new, previous, R, C, check, lazy=True)
            if bad:
                raise UpdateDataError(f"{where}: previous with the {self.update_type} update applied differs from "
                                      f"the saved model (max abs difference {max(bad):.3g}, rtol {rtol:g}, atol "
                                      f"{atol:g}); was the update applied to this base?")
            return Verified(encoded, self.update_type, new)
        else:
            vec = np.asarray(parts["ia3"], order="C")  # (ascontiguousarray would make a 0-d vector 1-d)
            problem = check_vector(new.shape, vec)
            if problem:
                raise UpdateDataError(f"{where}: {problem}")
            # block of rows by block of rows, like low-rank: never previous, new AND the scaled value
            fix_parts, fixes, bad = _ia3_fixes(new, previous, vec, rtol, atol)
            if bad is not None:
                raise UpdateDataError(f"{where}: previous with the {self.update_type} update applied differs "
                                      f"from the saved model (max abs difference {bad:.3g}, rtol {rtol:g}, atol "
                                      f"{atol:g}); was the update applied to this base?")
            encoded = Encoded(parts={"ia3": vec, **fix_parts}, params={"fixes": fixes})
            return Verified(encoded, self.update_type, new)

    def _verify_promoted(self, where: str, group: str, parts: dict[str, np.ndarray], new: np.ndarray,
                         previous: np.ndarray, rtol: float, atol: float) -> Verified:
        """``new`` has the dtype numpy's promotion gives previous (+ or *) update (what Git-Theta checks out,
        e.g. float64 factors on a float32 group), or an update theta's step does not take (low-rank with a
        vector or integer factors): checked against Git-Theta's arithmetic (exactly for a group of integers),
        then stored as the value itself, so a checkout gives ``new`` bit for bit."""
        value = git_theta_apply(self.update_type, parts, previous, group, self.path)
        if value.shape != new.shape or (not _agrees(value, new, previous, rtol, atol) if new.dtype.kind in "fcV"
                                        else not _bits_equal(value.astype(new.dtype, copy=False), new)):
            raise UpdateDataError(f"{where}: previous with the {self.update_type} update applied differs from the "
                                  f"saved model (max abs difference {_max_abs(value, new):.3g}, rtol {rtol:g}, "
                                  f"atol {atol:g}); was the update applied to this base?")
        return Verified(None, "dense", new)

    def _verify_sparse(self, where: str, parts: dict[str, np.ndarray], new: np.ndarray,
                       previous: np.ndarray) -> Verified:
        shape = tuple(int(s) for s in parts["shape"])
        if shape != new.shape:
            raise UpdateDataError(f"{where}: sparse part shape is {list(shape)}, the group is {list(new.shape)}")
        data, indices, indptr = parts["data"], parts["indices"].astype(np.int64), parts["indptr"].astype(np.int64)
        n = new.size
        if indptr.size == 2:                       # CSR of the flattened group (1 x N), Git-Theta's layout
            flat = indices
            width = n
        elif new.ndim == 2 and indptr.size == new.shape[0] + 1:   # CSR of the 2-D group itself
            width = new.shape[1]
            rows = np.repeat(np.arange(new.shape[0], dtype=np.int64), np.diff(indptr))
            if rows.size != indices.size:
                raise UpdateDataError(f"{where}: sparse indptr ends at {indptr[-1]}, there are {indices.size} indices")
            flat = rows * width + indices
        else:
            raise UpdateDataError(f"{where}: sparse indptr has {indptr.size} entries; expected 2 (flattened CSR) "
                                  f"or rows + 1 for a 2-D group")
        if not (indptr[0] == 0 and indptr[-1] == data.size == indices.size and np.all(np.diff(indptr) >= 0)):
            raise UpdateDataError(f"{where}: sparse data ({data.size}), indices ({indices.size}) and indptr "
                                  f"(ends at {indptr[-1]}) disagree")
        if indices.size and (indices.min() < 0 or indices.max() >= width):
            raise UpdateDataError(f"{where}: sparse indices out of range 0..{width - 1}")
        cdt = compute_dtype(new.dtype) if new.dtype.kind in "fV" else new.dtype
        value = np.array(previous, copy=True, order="C")
        flat_value = value.reshape(-1)
        # duplicates add up, as scipy's CSR does
        summed = np.zeros(n, dtype=cdt) if flat.size and np.unique(flat).size != flat.size else None
        if summed is not None:
            np.add.at(summed, flat, data.astype(cdt))
            touched = np.unique(flat)
            flat_value[touched] = (previous.reshape(-1)[touched].astype(cdt) + summed[touched]).astype(new.dtype)
        else:
            flat_value[flat] = (previous.reshape(-1)[flat].astype(cdt) + data.astype(cdt)).astype(new.dtype)
        got, want = value.reshape(-1).view(np.uint8), np.ascontiguousarray(new).reshape(-1).view(np.uint8)
        if not np.array_equal(got, want):
            raise UpdateDataError(f"{where}: previous plus the sparse update differs from the saved model "
                                  f"(in {int(np.count_nonzero(got != want))} bytes); a sparse update must "
                                  f"reproduce it exactly")
        encoded = SparseUpdate().encode(new, previous, lazy=False)  # stores the changed elements themselves: exact
        return Verified(encoded, "sparse", new)


def _ia3_fixes(new: np.ndarray, previous: np.ndarray, vec: np.ndarray, rtol: float, atol: float
               ) -> tuple[dict[str, np.ndarray], int, float | None]:
    """(fix parts, fix count, None) making previous * vec give ``new`` bit for bit, computed block of rows by
    block of rows (memory: a block and the fixes); the third item is the largest difference instead of None
    when a block that needs fixes is not within tolerance. No fixes: the update gives the file exactly;
    otherwise the check is for a wrong base or vector (errors the size of the update), not for rounding: a
    few ulps of the operands pass."""
    flat_new = np.ascontiguousarray(new).reshape(-1)
    per_row = int(np.prod(new.shape[1:], dtype=np.int64)) if new.ndim else 1
    found, values, worst = [], [], None
    for rows, value in scaled_blocks(previous, vec):
        start = rows.start * per_row if isinstance(rows, slice) else 0
        want, prev = np.ascontiguousarray(new[rows]), previous[rows]
        changed = np.flatnonzero(changed_mask(want, value))
        if not changed.size:
            continue
        if not _agrees(value, want, prev, rtol, atol):
            worst = max(worst or 0.0, _max_abs(value, want))
        found.append(changed + start)
        values.append(flat_new[changed + start])
    indices = np.concatenate(found) if found else np.empty(0, np.int64)
    fix_values = np.concatenate(values) if values else flat_new[:0].copy()
    return {"fix_gaps": encode_indices(indices, new.size), "fix_values": fix_values}, int(indices.size), worst


def _git_theta_matmul_fits(shape: tuple[int, ...], r_shape: tuple[int, ...], c_shape: tuple[int, ...]) -> bool:
    """Does Git-Theta's ``R @ C`` (numpy's matmul, vectors included) give a group of ``shape``?"""
    try:
        return matmul_shape(r_shape, c_shape) == tuple(shape)
    except ValueError:
        return False


def _agrees(value: np.ndarray, new: np.ndarray, previous: np.ndarray, rtol: float, atol: float) -> bool:
    """|value - new| <= atol + rtol |new| + 4 eps (|previous| + |value - previous|), NaN equal to NaN; in
    float64, chunk by chunk (never three float64 copies of the group)."""
    import ml_dtypes

    eps = float(ml_dtypes.finfo(new.dtype).eps)
    fv, fn, fp = (np.ascontiguousarray(a).reshape(-1) for a in (value, new, previous))
    for s in range(0, fv.size, _AGREE_CHUNK):
        v, n, p = (np.asarray(a[s:s + _AGREE_CHUNK], dtype=np.float64) for a in (fv, fn, fp))
        with np.errstate(invalid="ignore"):
            tol = atol + rtol * np.abs(n) + 4 * eps * (np.abs(p) + np.abs(v - p))
            ok = (np.abs(v - n) <= tol) | (np.isnan(v) & np.isnan(n)) | (v == n)
        if not np.all(ok):
            return False
    return True


def open_for_clean(options, lsd, previous) -> UpdateData | None:
    """The side-loaded update of one clean (``options.update_data``), checked against the checkpoint ``lsd``
    and its previous metadata before any group is stored; None without update data."""
    if options.update_data is None:
        return None
    if options.update_type not in PARTS:
        raise UpdateDataError(f"update data {options.update_data}: give its type with --update-type "
                              f"{'|'.join(PARTS)} (got {options.update_type!r})")
    data = UpdateData.open(options.update_data, options.update_type)
    shapes, has_previous = {}, {}
    for key in lsd:
        info = lsd.info(key)
        shapes[key] = tuple(info.shape)
        old = previous.groups.get(key) if previous is not None else None
        # a dtype change is allowed here and judged by verify(): only numpy's promotion of the update passes
        has_previous[key] = old is not None and tuple(old.shape) == tuple(info.shape)
    try:
        data.check_against(shapes, has_previous)
    except UpdateDataError:
        data.close()
        raise
    return data


# ---------------------------------------------------------------- Git-Theta's side-loaded workflow

@dataclass
class WorktreeForm:
    """Which form a side-loaded `git theta add` found the work-tree file in (see :func:`apply_to_worktree`)."""

    original: list[str]     # groups holding the previous value: rewritten to previous-with-update
    updated: list[str]      # groups already holding previous-with-update (the current form)


def git_theta_apply(update_type: str, parts: dict[str, np.ndarray], previous: np.ndarray, group: str,
                    path: "str | os.PathLike") -> np.ndarray:
    """previous (+ or *) update, with Git-Theta 0.2.0's own arithmetic and numpy's dtype promotion, as
    Git-Theta checks it out: float64 factors on a float32 group give float64 (:func:`promoted_dtype`)."""
    try:
        return apply_update(update_type, parts, previous, file=os.fspath(path), group=group)
    except GitThetaFormatError as e:
        raise UpdateDataError(f"update data {path}: {e}") from None


def promoted_dtype(update_type: str, parts: Mapping[str, np.ndarray], previous: np.dtype) -> np.dtype:
    """The dtype of :func:`git_theta_apply`'s result, from dtypes alone (numpy's promotion, ml_dtypes' for
    bfloat16 and the float8 types)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy's promotion)

    return result_dtype(update_type, {k: np.asarray(v).dtype for k, v in parts.items()}, np.dtype(previous))


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


def _worktree_form(update_type: str, parts: dict[str, np.ndarray], previous: np.ndarray, have: np.ndarray,
                   rtol: float, atol: float, group: str, path: "str | os.PathLike"):
    """"original" when the work-tree value ``have`` is ``previous`` bit for bit, "updated" when it is
    previous-with-update (Git-Theta's arithmetic, numpy's promoted dtype or cast back to the group's) within
    rtol/atol, else (max abs difference to previous, to previous-with-update). Block of rows by block of rows
    for ia3 and low-rank (memory: the two values the caller holds and a block; each element's arithmetic is
    the one Git-Theta's whole-array expression gives, up to the matmul's summation order, which the
    tolerance covers); a sparse update is applied whole."""
    same_layout = have.shape == previous.shape and have.dtype == previous.dtype
    if same_layout and _bits_equal(have, previous):
        return "original"
    promoted = promoted_dtype(update_type, parts, previous.dtype)
    if have.shape == previous.shape and have.dtype in (promoted, previous.dtype):
        agree = True
        for rows, applied in _applied_blocks(update_type, parts, previous, group, path):
            want = applied.astype(have.dtype, copy=False)
            if not _agrees(want, have[rows], previous[rows], rtol, atol):
                agree = False
                break
        if agree:
            return "updated"
    to_previous = _max_abs(have, previous)
    to_applied = (max((_max_abs(have[rows], applied) for rows, applied in _applied_blocks(update_type, parts, previous, group, path)),
                      default=0.0) if have.shape == previous.shape else float("inf"))
    return to_previous, to_applied


def _applied_blocks(update_type: str, parts: dict[str, np.ndarray], previous: np.ndarray, group: str,
                    path: "str | os.PathLike"):
    """(rows, previous[rows] with the update applied by Git-Theta's arithmetic) for blocks of rows (the whole
    value at once for sparse updates, 0-d groups and update parts that do not split by rows)."""
    R, C = parts.get("R"), parts.get("C")
    by_rows = previous.ndim >= 1 and (
        (update_type == "ia3" and "parameter" not in parts)
        or (update_type == "low-rank" and "parameter" not in parts and R is not None and C is not None
            and previous.ndim == 2 and np.ndim(R) == 2 and np.shape(R)[0] == previous.shape[0]))
    if not by_rows:
        yield Ellipsis, git_theta_apply(update_type, parts, previous, group, path)
        return
    vec = np.asarray(parts.get("ia3")) if update_type == "ia3" else None
    vec_rows = vec is not None and vec.ndim == previous.ndim and vec.shape[0] == previous.shape[0] != 1
    for rows in row_blocks(previous.shape, BLOCK_ELEMENTS):
        if vec is not None:
            block = {"ia3": vec[rows] if vec_rows else vec}
        else:
            block = {"R": np.asarray(R)[rows], "C": C}
        yield rows, git_theta_apply(update_type, block, previous[rows], group, path)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same bytes, compared chunk by chunk (no copy of either)."""
    x, y = dtypes.le_bytes(a), dtypes.le_bytes(b)
    if len(x) != len(y):
        return False
    step = 16 << 20
    return all(x[i:i + step] == y[i:i + step] for i in range(0, len(x), step))


def apply_to_worktree(path: "str | os.PathLike", data: UpdateData, previous_value, rtol: float = 1e-5,
                      atol: float = 1e-8) -> WorktreeForm:
    """Git-Theta's documented workflow: the work-tree file holds the ORIGINAL checkpoint and FILE the update.

    For every group of ``data``: its work-tree value equal (bit for bit) to ``previous_value(group)`` is the
    original form; equal to previous-with-update (within rtol/atol) the current form; anything else is
    refused naming the group and both distances. Groups in the original form are replaced by
    previous-with-update (Git-Theta's arithmetic) and the file is rewritten atomically, one group in memory
    at a time, in its own format and layout; afterwards it holds what the commit records, so `git status`
    stays clean. Nothing is written when a group is refused."""
    path = os.fspath(path)
    form = WorktreeForm([], [])
    promoted: dict[str, np.dtype] = {}
    with zipslice.load(path) as ckpt:
        for group in data.keys:
            if group not in ckpt:
                raise UpdateDataError(f"update data {data.path}: group {group!r} is not in the checkpoint {path}")
            previous = previous_value(group)
            if previous is None:
                raise UpdateDataError(f"update data {data.path}: group {group!r} has no previous version to "
                                      f"apply a {data.update_type} update to (commit the base model first)")
            have = np.asarray(ckpt.numpy(group))
            parts = data.parts(group)
            form_of = _worktree_form(data.update_type, parts, previous, have, rtol, atol, group, data.path)
            if form_of == "original":
                form.original.append(group)
                # Git-Theta's checkout has numpy's promoted dtype (e.g. float64 factors on float32 weights)
                promoted[group] = promoted_dtype(data.update_type, parts, previous.dtype)
            elif form_of == "updated":
                form.updated.append(group)
            else:
                to_previous, to_applied = form_of
                raise UpdateDataError(
                    f"update data {data.path}: group {group!r} is neither the previous version (max abs difference "
                    f"{to_previous:.3g}) nor the previous version with the {data.update_type} update applied (max "
                    f"abs difference {to_applied:.3g}): it differs from the saved model {path}; refusing to add it")
            del previous, have, parts
        if not form.original:
            return form
        plan = plan_write(ckpt, ckpt.format)
        replace = set(form.original)

        def updated(name: str):
            return lambda: dtypes.le_bytes(git_theta_apply(data.update_type, data.parts(name), previous_value(name),
                                                           name, data.path))  # promoted, as Git-Theta

        sources = [src.with_bytes(updated(src.name), dtypes.from_numpy(promoted[src.name]).name, tie=None)
                   if src.name in replace else src for src in plan.sources]
        options = {"structure": plan.structure, "metadata": plan.metadata or None}
        if ckpt.format == "torch":
            options["record_prefix"] = torch_writer.default_prefix(path)
        options = {k: v for k, v in options.items() if v is not None}
        # zipslice.save writes beside the file and renames: the original is intact until the new one is whole
        zipslice.save(path + ".theta-sideload.tmp", [(s.name, s) for s in sources], format=ckpt.format,
                      **options)
    os.replace(path + ".theta-sideload.tmp", path)
    return form
