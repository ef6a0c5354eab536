"""Side-loaded update data (Git-Theta compatible): `git theta add PATH --update-type T --update-data FILE`.

FILE is a checkpoint in any format zipslice reads. Its keys are ``<group name>/<part>`` (split at the
last ``/``) with Git-Theta's part names:

- ``low-rank``: ``R`` (rows x r) and ``C`` (r x cols); new = previous + R @ C (groups with more than two
  dimensions as (shape[0], rest), see low_rank.py). Checked against the saved file within rtol/atol (a
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

from theta.errors import UpdateDataError
from theta.updates import Encoded
from theta.updates.ia3 import check_vector, compute_dtype, scale
from theta.updates.low_rank import check_factors, exact_encoding
from theta.updates.sparse import SparseUpdate, residual

PARTS: dict[str, tuple[str, ...]] = {
    "low-rank": ("R", "C"),
    "sparse": ("data", "indices", "indptr", "shape"),
    "ia3": ("ia3",),
}


@dataclass
class Verified:
    encoded: Encoded
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
        import zipslice

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
            return check_factors(shape, np.empty(self._shape(group, "R"), np.float32),
                                 np.empty(self._shape(group, "C"), np.float32))
        if self.update_type == "ia3":
            return check_vector(shape, np.empty(self._shape(group, "ia3"), np.float32))
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
        if previous.shape != new.shape or previous.dtype != new.dtype:
            raise UpdateDataError(f"{where}: the group changed from {previous.dtype}{list(previous.shape)} to "
                                  f"{new.dtype}{list(new.shape)}; a {self.update_type} update cannot do that")
        parts = self.parts(group)
        if self.update_type == "sparse":
            return self._verify_sparse(where, parts, new, previous)
        if self.update_type == "low-rank":
            R, C = np.ascontiguousarray(parts["R"]), np.ascontiguousarray(parts["C"])
            problem = check_factors(new.shape, R, C)
            if problem:
                raise UpdateDataError(f"{where}: {problem}")
            encoded, fixes, value = exact_encoding(new, previous, R, C)
        else:
            vec = np.ascontiguousarray(parts["ia3"])
            problem = check_vector(new.shape, vec)
            if problem:
                raise UpdateDataError(f"{where}: {problem}")
            value = scale(previous, vec)
            fix_parts, fixes = residual(value, new)
            encoded = Encoded(parts={"ia3": vec, **fix_parts}, params={"fixes": fixes})
        # no fixes: the update gives the file exactly. Otherwise the check is for a wrong base or wrong
        # factors (errors the size of the update), not for rounding: a few ulps of the operands pass.
        if fixes and not _agrees(value, new, previous, rtol, atol):
            err = float(np.max(np.abs(value.astype(np.float64) - new.astype(np.float64)))) if new.size else 0.0
            raise UpdateDataError(f"{where}: previous with the {self.update_type} update applied differs from the "
                                  f"saved model (max abs difference {err:.3g}, rtol {rtol:g}, atol {atol:g}); "
                                  f"was the update applied to this base?")
        return Verified(encoded, self.update_type, new)

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


def _agrees(value: np.ndarray, new: np.ndarray, previous: np.ndarray, rtol: float, atol: float) -> bool:
    """|value - new| <= atol + rtol |new| + 4 eps (|previous| + |value - previous|), NaN equal to NaN."""
    import ml_dtypes

    eps = float(ml_dtypes.finfo(new.dtype).eps)
    v, n, p = (np.asarray(a, dtype=np.float64) for a in (value, new, previous))
    with np.errstate(invalid="ignore"):
        tol = atol + rtol * np.abs(n) + 4 * eps * (np.abs(p) + np.abs(v - p))
        ok = (np.abs(v - n) <= tol) | (np.isnan(v) & np.isnan(n)) | (v == n)
    return bool(np.all(ok))


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
        has_previous[key] = old is not None and old.dtype == info.dtype and tuple(old.shape) == tuple(info.shape)
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
    """previous (+ or *) update, with Git-Theta 0.2.0's own arithmetic, in previous's dtype."""
    from theta.errors import GitThetaFormatError
    from theta.storage.gittheta import apply_update

    try:
        value = apply_update(update_type, parts, previous, file=os.fspath(path), group=group)
    except GitThetaFormatError as e:
        raise UpdateDataError(f"update data {path}: {e}") from None
    return value.astype(previous.dtype, copy=False)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


def apply_to_worktree(path: "str | os.PathLike", data: UpdateData, previous_value, rtol: float = 1e-5,
                      atol: float = 1e-8) -> WorktreeForm:
    """Git-Theta's documented workflow: the work-tree file holds the ORIGINAL checkpoint and FILE the update.

    For every group of ``data``: its work-tree value equal (bit for bit) to ``previous_value(group)`` is the
    original form; equal to previous-with-update (within rtol/atol) the current form; anything else is
    refused naming the group and both distances. Groups in the original form are replaced by
    previous-with-update (Git-Theta's arithmetic) and the file is rewritten atomically, one group in memory
    at a time, in its own format and layout; afterwards it holds what the commit records, so `git status`
    stays clean. Nothing is written when a group is refused."""
    import zipslice
    from zipslice import dtypes
    from zipslice.convert import plan_write

    path = os.fspath(path)
    form = WorktreeForm([], [])
    with zipslice.load(path) as ckpt:
        for group in data.keys:
            if group not in ckpt:
                raise UpdateDataError(f"update data {data.path}: group {group!r} is not in the checkpoint {path}")
            previous = previous_value(group)
            if previous is None:
                raise UpdateDataError(f"update data {data.path}: group {group!r} has no previous version to "
                                      f"apply a {data.update_type} update to (commit the base model first)")
            have = np.asarray(ckpt.numpy(group))
            if have.shape == previous.shape and have.dtype == previous.dtype and \
                    bytes(dtypes.le_bytes(have)) == bytes(dtypes.le_bytes(previous)):
                form.original.append(group)
                continue
            applied = git_theta_apply(data.update_type, data.parts(group), previous, group, data.path)
            if have.shape == applied.shape and have.dtype == applied.dtype and \
                    _agrees(applied, have, previous, rtol, atol):
                form.updated.append(group)
                continue
            raise UpdateDataError(
                f"update data {data.path}: group {group!r} is neither the previous version (max abs difference "
                f"{_max_abs(have, previous):.3g}) nor the previous version with the {data.update_type} update "
                f"applied (max abs difference {_max_abs(have, applied):.3g}): it differs from the saved model "
                f"{path}; refusing to add it")
        if not form.original:
            return form
        plan = plan_write(ckpt, ckpt.format)
        replace = set(form.original)

        def updated(name: str):
            return lambda: dtypes.le_bytes(git_theta_apply(data.update_type, data.parts(name), previous_value(name),
                                                           name, data.path))

        for src in plan.sources:
            if src.name in replace:
                src.read = updated(src.name)
        options = {"structure": plan.structure, "metadata": plan.metadata or None}
        if ckpt.format == "torch":
            from zipslice import torch_writer

            options["record_prefix"] = torch_writer.default_prefix(path)
        options = {k: v for k, v in options.items() if v is not None}
        # zipslice.save writes beside the file and renames: the original is intact until the new one is whole
        zipslice.save(path + ".theta-sideload.tmp", [(s.name, s) for s in plan.sources], format=ckpt.format,
                      **options)
    os.replace(path + ".theta-sideload.tmp", path)
    return form
