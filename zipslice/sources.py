"""Adapt torch tensors, numpy arrays and lazy entries into :class:`TensorSource` for the writers."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from . import dtypes
from .info import TensorSource


def _torch_source(name: str, t) -> TensorSource:
    import torch

    def read(t=t):
        c = t.detach().contiguous()
        return c.reshape(-1).view(torch.uint8).numpy().data if c.numel() else b""

    storage = t.untyped_storage()
    return TensorSource(
        name=name, dtype=dtypes.from_torch(t.dtype).name, shape=tuple(t.shape), read=read,
        tie=("torch", storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if storage.nbytes() else None,
        is_parameter=isinstance(t, torch.nn.Parameter), requires_grad=bool(t.requires_grad),
    )


def _numpy_source(name: str, a: np.ndarray) -> TensorSource:
    dt = dtypes.from_numpy(a.dtype)

    def read(a=a):
        return dtypes.le_bytes(a)

    return TensorSource(name=name, dtype=dt.name, shape=tuple(a.shape), read=read)


def as_source(name: str, obj: Any) -> TensorSource:
    if isinstance(obj, TensorSource):
        return obj
    if isinstance(obj, np.ndarray):
        return _numpy_source(name, obj)
    mod = type(obj).__module__
    if mod.startswith("torch"):
        return _torch_source(name, obj)
    raise TypeError(f"{name}: cannot write a {type(obj).__name__}; give a tensor, an array or a TensorSource")


def as_sources(items: Iterable[tuple[str, Any]] | dict) -> list[TensorSource]:
    if isinstance(items, dict):
        items = items.items()
    return [as_source(n, o) for n, o in items]
