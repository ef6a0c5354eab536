"""HDF5 (h5py): a lazy reader that names Keras weights the way a user expects, and a streaming writer.

Every numeric dataset is a tensor. Contiguous, unfiltered datasets whose on-disk type is exactly the
numpy type are read by one positioned read of their bytes (``info.offset``); any other dataset
(chunked, compressed, compact, never written, non-native type) has ``offset=None`` and is read
through h5py, one dataset at a time.

dtypes HDF5 lacks (bfloat16, float8) follow Keras 3's convention: opaque data of the dtype's width with
the dataset attribute ``dtype`` naming it (``dtype="bfloat16"``). Keras 3 reads such a bfloat16 dataset
back as bfloat16 (``np.array(dset, dtype=ml_dtypes.bfloat16)``); h5py alone shows opaque ``|V2`` values
whose bits are the bfloat16 bits, never numbers that look valid. The reader also honours the attribute
``zipslice_dtype`` on unsigned integers of the same width (files written by zipslice before 0.2).
See docs/reference/formats.md ("Keras naming") for the naming rules.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import h5py
import numpy as np

from . import dtypes
from .base import LazyCheckpoint
from .errors import CorruptCheckpointError, UnsupportedCheckpointError, ZipsliceError
from .fileio import atomic_path
from .frames import flat_boxes, whole_elements
from .info import TensorInfo, TensorSource, contiguous_stride
from .pagecache import WriteBehind

DTYPE_ATTR = "zipslice_dtype"        # read only: older zipslice wrote bfloat16 / float8 as uint carriers marked so
KERAS3_DTYPE_ATTR = "dtype"          # Keras 3 (and zipslice's writer) mark opaque bfloat16 data with dtype="bfloat16"
SMALL_EXTRA_BYTES = 1 << 20          # non-numeric datasets up to this size are read into ``extras``

_KERAS3_VAR = re.compile(r"(?:^|/)vars/\d+$")
# what h5py raises on damaged object headers, heaps and attributes (KeyError for objects it cannot open)
_H5_ERRORS = (KeyError, OSError, RuntimeError, ValueError, TypeError)


@contextlib.contextmanager
def _h5_errors(file: str, entry: str | None = None) -> Iterator[None]:
    """Turn h5py's errors on a damaged file into CorruptCheckpointError naming the object."""
    try:
        yield
    except ZipsliceError:
        raise
    except _H5_ERRORS as e:
        raise CorruptCheckpointError(file, f"HDF5 object is damaged or unreadable: {e}", entry) from None


# -- reading -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Found:
    path: str            # HDF5 path without the leading "/"
    dset: h5py.Dataset
    alias_of: str | None  # first path of the same dataset when it is hard-linked twice


def _walk(group: h5py.Group, prefix: str, seen: dict, skipped: dict[str, str], file: str) -> Iterator[_Found]:
    """Datasets under ``group`` in the group's iteration order (creation order when the file tracks it).

    Only hard links are followed; soft and external links are reported in ``skipped`` (an external
    link would open another file). A dataset or group reached twice is yielded as an alias / not re-walked.
    """
    with _h5_errors(file, prefix.rstrip("/") or "/"):
        names = list(group)
    for name in names:
        path = f"{prefix}{name}"
        with _h5_errors(file, path):
            link = group.get(name, getlink=True)
            if not isinstance(link, h5py.HardLink):
                skipped[path] = f"{type(link).__name__} not followed"
                continue
            obj = group[name]
            first = seen.get(obj.id)
        if isinstance(obj, h5py.Group):
            if first is None:
                seen[obj.id] = path
                yield from _walk(obj, path + "/", seen, skipped, file)
            else:
                skipped[path] = f"group already read at {first!r}"
        elif isinstance(obj, h5py.Dataset):
            if first is None:
                seen[obj.id] = path
            yield _Found(path, obj, first)
        else:
            skipped[path] = f"{type(obj).__name__} is not a dataset"


def _attr_str(obj, name: str) -> str | None:
    v = obj.attrs.get(name)
    if isinstance(v, (bytes, np.bytes_)):
        return bytes(v).decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def _tensor_dtype(dset: h5py.Dataset, path: str, file: str) -> tuple[str, str] | None:
    """(canonical dtype, byteorder) of a numeric dataset, or None if it is not a tensor."""
    np_dt = dset.dtype
    marked = _attr_str(dset, DTYPE_ATTR)
    if marked is None and np_dt.kind in "uV":
        named = _attr_str(dset, KERAS3_DTYPE_ATTR)
        known = dtypes.BY_NAME.get(named or "")
        if known is not None and (known.numpy is None or known.numpy.startswith("ml:")):
            marked = named
    if marked is not None:
        dt = dtypes.BY_NAME.get(marked)
        if dt is None or np_dt.itemsize != dt.itemsize or np_dt.kind not in "uV":
            raise CorruptCheckpointError(
                file, f"dataset marked as {marked!r} holds {np_dt} (expected unsigned or opaque data of "
                      f"{dt.itemsize if dt else '?'} bytes)", path)
        return dt.name, "big" if np_dt.byteorder == ">" else "little"
    if np_dt.kind not in "biufc":
        return None
    try:
        dt = dtypes.from_numpy(np_dt)
    except KeyError:
        return None  # e.g. long double: no torch dtype
    return dt.name, "big" if np_dt.byteorder == ">" else "little"


def _positioned_offset(dset: h5py.Dataset, file: str, path: str) -> int | None:
    """File offset of the dataset's raw bytes when they are exactly the numpy representation, else None."""
    plist = dset.id.get_create_plist()
    layout = plist.get_layout()
    if plist.get_external_count() or layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT):
        raise UnsupportedCheckpointError(
            file, "dataset keeps its data in other files (external storage or a virtual dataset); "
                  "zipslice reads only the checkpoint file itself", path)
    if layout != h5py.h5d.CONTIGUOUS or plist.get_nfilters():
        return None
    if dset.id.get_type() != h5py.h5t.py_create(dset.dtype):
        return None  # HDF5 converts on read (unusual width/precision): let h5py do it
    return dset.id.get_offset()  # None while no storage is allocated (fill value)


def _small_value(dset: h5py.Dataset) -> Any:
    v = dset[()]
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _string_list_attr(group: h5py.Group, name: str) -> list[str] | None:
    """A list-of-strings attribute; Keras 2 splits long ones into name0, name1, ... (header size limit)."""
    if name in group.attrs:
        v = group.attrs[name]
        values = [v] if isinstance(v, (str, bytes)) else list(np.atleast_1d(v))
    elif f"{name}0" in group.attrs:
        values, i = [], 0
        while f"{name}{i}" in group.attrs:
            values.extend(np.atleast_1d(group.attrs[f"{name}{i}"]))
            i += 1
    else:
        return None
    return [v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in values]


def _keras2_names(f: h5py.File) -> tuple[str, dict[str, str]] | None:
    """Keras 2 .h5: {hdf5 path: user name} in layer order, or None if this is not a Keras 2 file.

    ``model_weights/<layer>/<layer>/kernel:0`` (model.save) or ``<layer>/<layer>/kernel:0``
    (save_weights) become ``<layer>/kernel``: the weight name with the layer prefix and ``:0`` dropped.
    """
    for root in ("model_weights", ""):
        if root and not (root in f and isinstance(f.get(root, getlink=True), h5py.HardLink)
                         and isinstance(f[root], h5py.Group)):
            continue
        group = f[root] if root else f
        layers = _string_list_attr(group, "layer_names")
        if layers is None:
            continue
        names: dict[str, str] = {}
        for layer in layers:
            if not isinstance(group.get(layer, getlink=True), h5py.HardLink):
                continue  # absent, or a soft/external link: not followed
            for weight in _string_list_attr(group[layer], "weight_names") or []:
                path = f"{root + '/' if root else ''}{layer}/{weight}"
                short = weight[len(layer) + 1:] if weight.startswith(layer + "/") else weight
                short = short[:-2] if short.endswith(":0") else short
                names[path] = f"{layer}/{short}"
        return ("keras2", names) if names else None
    return None


def _keras3_names(paths: list[str]) -> tuple[str, dict[str, str]] | None:
    """Keras 3 .weights.h5: ``layers/<path>/vars/<i>`` becomes ``<path>/vars/<i>``; other paths stay."""
    under_layers = [p for p in paths if p.startswith("layers/")]
    if not under_layers or not all(_KERAS3_VAR.search(p) for p in under_layers):
        return None
    return "keras3", {p: p[len("layers/"):] for p in under_layers}


class HDF5Checkpoint(LazyCheckpoint):
    """Lazy HDF5 reader.

    - ``layout``: "keras2", "keras3" or "plain" (how names were derived).
    - ``hdf5_paths``: user name -> HDF5 path of every tensor (identity for plain files).
    - ``metadata``: the root group's string attributes.
    - ``extras``: small non-numeric datasets (strings, ...) by path; ``skipped``: path -> why not a tensor.

    Pass ``keras_names=False`` to name every tensor by its HDF5 path.
    """

    format = "hdf5"

    def __init__(self, path: str | os.PathLike, keras_names: bool = True):
        super().__init__(path)
        try:
            self._h5 = h5py.File(self.path, "r")
        except OSError as e:
            raise CorruptCheckpointError(self.path, f"h5py cannot open it as HDF5: {e}") from None
        self.skipped: dict[str, str] = {}
        self.hdf5_paths: dict[str, str] = {}
        self.layout = "plain"
        self._dsets: dict[str, h5py.Dataset] = {}
        try:
            self._index(keras_names)
        except BaseException:
            self._h5.close()
            raise

    def _index(self, keras_names: bool) -> None:
        f = self._h5
        with _h5_errors(self.path, "/"):
            for key in f.attrs:
                s = _attr_str(f, key)
                if s is not None:
                    self.metadata[key] = s

        found: list[tuple[_Found, tuple[str, str]]] = []
        for item in _walk(f, "", {}, self.skipped, self.path):
            with _h5_errors(self.path, item.path):
                kind = _tensor_dtype(item.dset, item.path, self.path)
                if kind is None:
                    self._non_tensor(item)
                else:
                    found.append((item, kind))

        names = {item.path: item.path for item, _ in found}
        with _h5_errors(self.path, "Keras layer_names/weight_names attributes"):
            layout = (_keras2_names(f) or _keras3_names(list(names))) if keras_names else None
        if layout is not None:
            kind, mapped = layout
            renamed = {p: mapped.get(p, p) for p in names}
            if len(set(renamed.values())) == len(renamed):  # only when no two paths collide
                self.layout, names = kind, renamed
                # Keras 2 lists weights in model order: put those first, the rest (optimizer...) after
                order = {p: i for i, p in enumerate(mapped)}
                found.sort(key=lambda fk: order.get(fk[0].path, len(order)))

        storages = {}
        for item, (dtype, byteorder) in found:
            name = names[item.path]
            dset = item.dset
            shape = tuple(int(s) for s in dset.shape)
            itemsize = dtypes.get(dtype).itemsize
            nbytes = math.prod(shape) * itemsize
            storage = storages.setdefault(item.alias_of or item.path, names[item.alias_of or item.path])
            with _h5_errors(self.path, item.path):
                offset = _positioned_offset(dset, self.path, item.path)
            self._infos[name] = TensorInfo(
                name=name, dtype=dtype, shape=shape, stride=contiguous_stride(shape), storage=storage,
                storage_offset=0, offset=offset, span_nbytes=nbytes,
                file=self.path, storage_nbytes=nbytes, byteorder=byteorder,
            )
            self.hdf5_paths[name] = item.path
            self._dsets[name] = dset

    def _non_tensor(self, item: _Found) -> None:
        dset = item.dset
        if dset.shape is None:
            self.extras[item.path] = None  # null dataspace
        elif dset.dtype.kind in "biufc":
            self.skipped[item.path] = f"numeric type {dset.dtype} has no torch dtype"
        elif dset.size * dset.dtype.itemsize <= SMALL_EXTRA_BYTES:
            self.extras[item.path] = _small_value(dset)
        else:
            self.skipped[item.path] = f"non-numeric dataset of type {dset.dtype} is not a tensor"

    def _read_span(self, info: TensorInfo):
        if info.offset is not None:
            return self._read_at(info)
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        dset = self._dsets[info.name]
        if info.numel == 0:
            return b""
        arr = np.empty(info.shape, dtype=dset.dtype)
        with _h5_errors(self.path, info.name):
            dset.read_direct(arr)
        return memoryview(arr.reshape(-1).view(np.uint8))

    def _read_selection(self, info: TensorInfo, sel):
        """Chunked / compressed datasets: h5py's own slicing, which reads only the chunks it touches."""
        if info.offset is not None:
            return super()._read_selection(info, sel)
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        carrier = dtypes.get(info.dtype).carrier
        if sel.numel == 0:
            return np.empty(sel.shape, dtype=carrier)
        dset = self._dsets[info.name]
        with _h5_errors(self.path, info.name):
            arr = dset[sel.numpy_index()] if sel.dims else dset[()]
        arr = np.ascontiguousarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return arr.view(carrier).reshape(sel.shape)

    def close(self) -> None:
        if getattr(self, "_h5", None) is not None:
            self._dsets.clear()
            self._h5.close()
        super().close()


# -- writing -------------------------------------------------------------------------------------------

def name_problem(names: Iterable[str]) -> tuple[str, str] | None:
    """(name, problem) for the first name that cannot be an HDF5 dataset path beside the others, else None.

    A name cannot have an empty, "." or ".." component, appear twice, or be a group of another name.
    """
    seen: dict[str, None] = {}  # in order: the same name is reported whatever the run
    for name in names:
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            return name, "name cannot be an HDF5 path (empty, '.' or '..' component)"
        if name in seen:
            return name, "name appears twice"
        seen[name] = None
    for name in seen:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                return name, f"name would need {'/'.join(parts[:i])!r} to be both a tensor and a group"
    return None


def _check_names(sources: list[TensorSource], path: str) -> None:
    """Every name must survive as an HDF5 path, and no name may be a group of another."""
    problem = name_problem(s.name for s in sources)
    if problem is not None:
        raise ZipsliceError(path, problem[1], problem[0])


def _storage_dtype(dtype: str) -> tuple[np.dtype, bool]:
    """The numpy dtype to store and whether it is opaque data marked with ``dtype=<name>`` (Keras 3's way)."""
    dt = dtypes.get(dtype)
    if dt.numpy is None or dt.numpy.startswith("ml:"):
        return np.dtype(f"V{dt.itemsize}"), True
    return dt.to_numpy(), False


def _parent(f: h5py.File, name: str) -> tuple[h5py.Group, str]:
    """The group holding ``name`` (created with creation-order tracking) and the last component."""
    *parents, leaf = name.split("/")
    group: h5py.Group = f
    for part in parents:
        group = group[part] if part in group else group.create_group(part, track_order=True)
    return group, leaf


def _write_values(dset: h5py.Dataset, src: TensorSource, store: np.dtype, path: str, written) -> None:
    """The source's values into ``dset`` as they come (:meth:`TensorSource.pieces`), each piece as the boxes of
    the dataset it covers (:func:`zipslice.frames.flat_boxes`): never the whole tensor in memory.
    ``written(nbytes)`` after each piece."""
    at, total = 0, math.prod(src.shape)
    try:
        for piece in whole_elements(src.pieces(), store.itemsize):
            values = np.frombuffer(piece, dtype=store)
            if at + values.size > total:
                raise ZipsliceError(path, f"source produced more than the {src.nbytes} bytes expected", src.name)
            done = 0
            for box in flat_boxes(tuple(src.shape), at, at + values.size):
                n = box.numel
                dset[box.numpy_index()] = values[done:done + n].reshape(box.shape)
                done += n
            at += values.size
            written(piece.nbytes)
    except ValueError as e:  # the bytes ended inside an element
        raise ZipsliceError(path, f"source produced a partial element ({e})", src.name) from None
    if at != total:
        raise ZipsliceError(path, f"source produced {at * store.itemsize} bytes, expected {src.nbytes}", src.name)


def write(path: str | os.PathLike, sources: list[TensorSource], *, structure=None,
          metadata: dict[str, str] | None = None, **options) -> None:
    """Write one contiguous dataset per source (names with "/" become groups), one tensor at a time, each
    tensor piece by piece as its source gives it (:meth:`TensorSource.pieces`).

    Tied sources become HDF5 hard links to one dataset. ``metadata`` becomes string attributes of the
    root group. The file is written beside ``path`` and renamed over it once complete and fsynced; while it is
    written, its dirty pages are kept to a few windows (:class:`zipslice.pagecache.WriteBehind`, waiting for
    the whole file each window: HDF5 places the bytes itself).
    ``structure`` is accepted for interface symmetry and not stored (HDF5 here is a flat map of tensors).
    """
    if options:
        raise TypeError(f"unknown hdf5 write options: {', '.join(sorted(options))}")
    dest = Path(path)
    _check_names(sources, str(dest))
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("hdf5 metadata must be a dict of str -> str")
    with atomic_path(dest) as tmp:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            behind = WriteBehind(fd, sequential=False)
            with h5py.File(tmp, "w", track_order=True) as f:
                count = [0]

                def written(nbytes: int) -> None:
                    count[0] += nbytes
                    if behind.due(count[0]):
                        f.flush()  # HDF5's own buffers to the kernel, then the kernel's to the disk
                        behind.wrote(count[0])

                for k, v in (metadata or {}).items():
                    f.attrs[k] = v
                done: dict[Any, str] = {}
                for s in sources:
                    group, leaf = _parent(f, s.name)
                    if s.tie is not None and s.tie in done:
                        group[leaf] = f[done[s.tie]]  # a hard link: one dataset, two names
                        continue
                    store, marked = _storage_dtype(s.dtype)
                    dset = group.create_dataset(leaf, shape=s.shape, dtype=store)
                    if marked:
                        dset.attrs[KERAS3_DTYPE_ATTR] = s.dtype
                    if s.nbytes:
                        _write_values(dset, s, store, str(dest), written)
                    if s.tie is not None:
                        done[s.tie] = s.name
        finally:
            os.close(fd)
