"""A state dict in memory seen as a lazy checkpoint, so the clean reads it as it reads a file.

:class:`StateDictCheckpoint` wraps the object a training loop holds (a ``model.state_dict()``, any mapping of
torch tensors or numpy arrays, nested dicts/lists/tuples with plain values as torch.save allows) without
copying it: each group's bytes are read from the tensor's own memory when the clean asks for them.

It is the checkpoint ``torch.save(obj, f)`` would write, as zipslice would read that file back: format
``torch``, the container tree of :mod:`zipslice.structure` (an OrderedDict's ``_metadata`` included), the
``nn.Parameter`` flags, and two names of one tensor view (same storage, offset, shape and strides) as tied. So
the metadata a clean records for it is the metadata of that file, and a checkout of it followed by
``git add`` records the same text again (what keeps ``git status`` clean). Another committed format
(safetensors, HDF5) is reached the way every view is: :func:`theta.model.views.committed_form`.

Memory: nothing is copied for a CPU tensor that is contiguous and little-endian (its bytes are handed to
the clean as a read-only view: an encoder can never write into the caller's model); other tensors (on a GPU,
strided views, big-endian arrays) are copied one group at a time, and a big group read frame by frame
(:mod:`theta.model.framewise`) is copied one frame at a time.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from zipslice import dtypes, structure
from zipslice.base import LazyCheckpoint
from zipslice.info import TensorInfo, TensorSource, contiguous_stride

from theta.base.errors import CheckpointError

MAX_DEPTH = 64  # containers nested deeper than this are refused (as zipslice's torch reader refuses them)


class StateDictCheckpoint(LazyCheckpoint):
    """``obj`` (a mapping of tensors/arrays, possibly nested) as a torch-format :class:`LazyCheckpoint`.

    ``name`` names it in errors (the tracked path it is saved as). Raises :class:`CheckpointError` naming the
    entry for what torch.save could not write or zipslice could not read back (a key that is not a str, int,
    float, bool or None; two leaves flattening to one name; a value of another type; a tensor in
    ``_metadata``).
    """

    format = "torch"

    def __init__(self, obj: Mapping, name: str):
        super().__init__(name)
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{name}: a state dict must be a mapping of names to tensors, "
                                  f"got a {type(obj).__name__}")
        self._values: dict[str, Any] = {}   # flat name -> the tensor (detached) or array, as given
        self._ties: dict[str, tuple] = {}   # flat name -> identity of its view (same key: tied)
        self.structure = self._node(obj, "", 0, True)

    # -- the container tree, as zipslice's torch reader builds it from the file torch.save would write ----
    def _claim(self, name: str) -> None:
        if name in self._infos or name in self.extras:
            raise CheckpointError(f"{self.path}: entry {name!r}: two leaves flatten to the same name "
                                  f"(a key contains '/'?)")

    def _node(self, obj: Any, name: str, depth: int, leaves: bool) -> dict:
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{self.path}: entry {name!r}: containers nested deeper than {MAX_DEPTH} "
                                  f"levels (or a cycle)")
        if isinstance(obj, np.ndarray) or _is_torch_tensor(obj):
            if not leaves:
                raise CheckpointError(f"{self.path}: entry {name!r}: a tensor inside an OrderedDict's _metadata")
            self._claim(name)
            self._add_tensor(name, obj)
            return {"tensor": name}
        if isinstance(obj, OrderedDict):
            node: dict = {"odict": self._items(obj, name, depth, leaves)}
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                node["metadata"] = self._node(meta, name, depth + 1, False)
            return node
        if isinstance(obj, Mapping):
            return {"dict": self._items(obj, name, depth, leaves)}
        torch_leaf = _torch_leaf(obj)
        if torch_leaf is not None:
            return self._value(torch_leaf, name, leaves)
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [self._node(v, structure.join(name, i), depth + 1, leaves) for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (bool, int, str, float, bytes, bytearray)):
            return self._value(structure.value_node(obj), name, leaves)
        raise CheckpointError(f"{self.path}: entry {name!r}: a {type(obj).__name__} value cannot be stored "
                              f"(tensors, arrays, containers and plain values can)")

    def _items(self, d: Mapping, name: str, depth: int, leaves: bool) -> list:
        out = []
        for k, v in d.items():
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise CheckpointError(f"{self.path}: entry {name!r}: a dict key of type {type(k).__name__}")
            out.append([k, self._node(v, structure.join(name, k), depth + 1, leaves)])
        return out

    def _value(self, node: dict, name: str, leaves: bool) -> dict:
        if leaves:
            self._claim(name)
            self.extras[name] = node if "torch" in node else structure.leaf_value(node)
        return node

    def _add_tensor(self, name: str, obj: Any) -> None:
        if isinstance(obj, np.ndarray):
            try:
                dt = dtypes.from_numpy(obj.dtype)
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: entry {name!r}: numpy dtype {obj.dtype} is not "
                                      f"supported") from None
            iface = obj.__array_interface__
            self._ties[name] = ("numpy", iface["data"][0], obj.shape, obj.strides, obj.dtype.str)
            is_parameter = requires_grad = False
            value = obj
        else:
            import torch  # (only when the caller's tensors are torch's: it is already imported then)

            try:
                dt = dtypes.from_torch(obj.dtype)
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: entry {name!r}: torch dtype {obj.dtype} is not "
                                      f"supported") from None
            is_parameter = isinstance(obj, torch.nn.Parameter)
            requires_grad = bool(obj.requires_grad)
            storage = obj.untyped_storage()
            self._ties[name] = ("torch", obj.device.type, obj.device.index, storage.data_ptr(),
                                obj.storage_offset(), tuple(obj.shape), tuple(obj.stride())) \
                if storage.nbytes() else None
            value = obj.detach()
        shape = tuple(int(s) for s in value.shape)
        nbytes = math.prod(shape) * dt.itemsize
        self._values[name] = value
        self._infos[name] = TensorInfo(
            name=name, dtype=dt.name, shape=shape, stride=contiguous_stride(shape), storage=name,
            storage_offset=0, offset=None, span_nbytes=nbytes, file=self.path,
            is_parameter=is_parameter, requires_grad=requires_grad)

    # -- data ------------------------------------------------------------------------------------------
    def _bytes(self, key: str) -> np.ndarray:
        """The values of ``key`` as a flat read-only uint8 array of contiguous little-endian bytes: a view of
        the caller's memory when it already is that, else a copy."""
        value = self._values[key]
        info = self._infos[key]
        if isinstance(value, np.ndarray):
            flat = np.ascontiguousarray(dtypes.little_endian(value)).reshape(-1).view(np.uint8)
        else:
            t = value
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            flat = t.reshape(-1).view(_torch_uint8()).numpy() if t.numel() else np.empty(0, np.uint8)
        flat = flat.view()
        flat.flags.writeable = False
        assert flat.nbytes == info.nbytes
        return flat

    def _contiguous(self, key: str) -> bool:
        """Whether the value's memory holds exactly its contiguous little-endian bytes (on any device)."""
        value = self._values[key]
        if isinstance(value, np.ndarray):
            return value.flags.c_contiguous and (value.dtype.byteorder != ">" or value.dtype.itemsize == 1)
        return value.is_contiguous()

    def _plain(self, key: str):
        """The value flattened to bytes without copying it, or None when it is not in host memory (a GPU
        tensor is read piece by piece with :meth:`read_plain_into`)."""
        value = self._values[key]
        if isinstance(value, np.ndarray) or value.device.type == "cpu":
            return self._bytes(key)
        return None

    def numpy(self, key: str, raw: bool = False) -> np.ndarray:
        info = self.info(key)
        dt = dtypes.get(info.dtype)
        flat = self._bytes(key)
        arr = flat.view(dt.carrier) if raw else flat.view(dt.to_numpy())
        return arr.reshape(info.shape)

    def _read_span(self, info: TensorInfo) -> bytes:
        return self._bytes(info.name).tobytes()

    def tensor(self, key: str):
        self.info(key)  # (a KeyError naming the checkpoint)
        value = self._values[key]
        return super().tensor(key) if isinstance(value, np.ndarray) else value.clone()

    def source(self, key: str) -> TensorSource:
        info = self.info(key)
        return TensorSource(name=key, dtype=info.dtype, shape=info.shape, read=lambda k=key: self.read_bytes(k),
                            tie=self._ties.get(key), is_parameter=info.is_parameter,
                            requires_grad=info.requires_grad)

    plain_spans = True

    def plain_range(self, key: str) -> "tuple[str, int, int] | None":
        """A contiguous value can be read piece by piece (the "file" is the checkpoint's name: there is none);
        a strided one is None: it is read whole (one copy) by :meth:`numpy`."""
        info = self.info(key)
        return (self.path, 0, info.nbytes) if self._contiguous(key) else None

    def iter_plain(self, key: str, buf) -> Iterator[memoryview] | None:
        if self.plain_range(key) is None:
            return None
        view = memoryview(buf).cast("B")
        if view.nbytes == 0:
            raise ValueError("iter_plain needs a non-empty buffer")
        flat = self._plain(key)
        total = self.info(key).nbytes

        def pieces() -> Iterator[memoryview]:
            for start in range(0, total, view.nbytes):
                n = min(view.nbytes, total - start)
                if flat is not None:
                    yield memoryview(flat[start:start + n])
                else:
                    self.read_plain_into(key, start, view[:n])
                    yield view[:n]
        return pieces()

    def read_plain_into(self, key: str, start: int, buf) -> None:
        view = memoryview(buf).cast("B")
        total = self.info(key).nbytes
        if not 0 <= start <= start + view.nbytes <= total:
            raise ValueError(f"{self.path}: {key!r} has no plain bytes {start}:{start + view.nbytes}")
        if not self._contiguous(key):
            raise ValueError(f"{self.path}: {key!r} is a strided view: it has no plain bytes")
        flat = self._plain(key)
        if flat is not None:
            view[:] = flat[start:start + view.nbytes]
            return
        # a GPU tensor: only the piece asked for crosses to host memory
        import torch

        piece = self._values[key].reshape(-1).view(torch.uint8)[start:start + view.nbytes]
        torch.from_numpy(np.frombuffer(view, np.uint8)).copy_(piece)

    def data_file_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def dropping_behind(self) -> bool:
        return False  # nothing is read from a file


def _is_torch_tensor(obj: Any) -> bool:
    if not type(obj).__module__.startswith("torch"):
        return False
    import torch

    return isinstance(obj, torch.Tensor)


def _torch_leaf(obj: Any) -> dict | None:
    """The structure node of a small torch object torch.save pickles (Size, dtype, device), else None."""
    if not type(obj).__module__.startswith("torch"):
        return None
    import torch

    if isinstance(obj, torch.Size):
        return {"torch": "size", "value": [int(s) for s in obj]}
    if isinstance(obj, torch.dtype):
        return {"torch": "dtype", "value": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"torch": "device", "value": str(obj)}
    return None


def _torch_uint8():
    import torch

    return torch.uint8
