"""How many bytes autograd keeps for backward, per module: exact, from saved-tensor hooks.

`measure(model, inputs)` runs one forward pass with grad enabled under
`torch.autograd.graph.saved_tensors_hooks` and records every tensor autograd saves. Bytes are counted per
storage, once, and charged to the innermost module running when the storage was first saved (so a GELU
output that the next Linear also keeps counts once, under the GELU). Storages of the model's own
parameters and buffers are reported apart (they exist whether or not you train). Empty tensors hold no
bytes and are not counted as storages. The forward's output and graph are dropped before returning:
nothing stays allocated.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModuleSaved:
    """Bytes first saved for backward while `path` was the innermost running module."""

    path: str
    type_name: str
    bytes: int
    storages: int


@dataclass(frozen=True)
class SavedStorage:
    """One storage kept for backward: the module charged, and the shape and dtype of the tensor that first
    kept it (a view's shape may cover less than `bytes`, which is the whole storage)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int


@dataclass(frozen=True)
class SavedReport:
    """Result of `measure`: activation bytes kept for backward, in total, per module and per storage."""

    total_bytes: int
    parameter_bytes: int
    modules: tuple[ModuleSaved, ...]
    storages: tuple[SavedStorage, ...] = ()

    def by_path(self) -> dict[str, int]:
        return {m.path: m.bytes for m in self.modules}

    def by_type(self) -> dict[str, int]:
        """Bytes summed per module class name."""
        totals: dict[str, int] = {}
        for m in self.modules:
            totals[m.type_name] = totals.get(m.type_name, 0) + m.bytes
        return totals

    def table(self, limit: int | None = None) -> str:
        """A plain-text table, largest modules first."""
        rows = sorted(self.modules, key=lambda m: -m.bytes)[:limit]
        width = max([len(r.path) for r in rows] + [6])
        lines = [f"{'module':<{width}}  {'type':<24} {'MiB':>10} {'storages':>8}"]
        lines += [f"{r.path:<{width}}  {r.type_name:<24} {r.bytes / 2**20:>10.3f} {r.storages:>8}" for r in rows]
        lines.append(f"{'total':<{width}}  {'':<24} {self.total_bytes / 2**20:>10.3f}")
        return "\n".join(lines)


ROOT = "(root)"


def measure(model: nn.Module, inputs: Any) -> SavedReport:
    """Run model(inputs) once (a dict is passed as keywords, a tuple/list as positionals) and report what
    autograd saved for backward. The model's training/eval mode is used as it is."""
    parameter_storages = {_storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    parameter_storages.discard(None)
    stack: list[str] = []
    type_names: dict[str, str] = {}
    order: list[str] = []
    per_module: dict[str, list[int]] = {}
    storages: list[SavedStorage] = []
    seen: set[tuple] = set()
    parameter_bytes = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal parameter_bytes
        key = _storage_key(tensor)
        if key is None or key in seen:
            return tensor
        seen.add(key)
        nbytes = tensor.untyped_storage().nbytes()
        if key in parameter_storages:
            parameter_bytes += nbytes
            return tensor
        path = stack[-1] if stack else ROOT
        if path not in per_module:
            per_module[path] = [0, 0]
            order.append(path)
        per_module[path][0] += nbytes
        per_module[path][1] += 1
        storages.append(SavedStorage(path, tuple(tensor.shape), tensor.dtype, nbytes))
        return tensor

    def enter(path: str) -> None:
        stack.append(path)

    def leave() -> None:  # a forward hook's return value would replace the module's output
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        path = name or ROOT
        type_names[path] = type(module).__name__
        handles.append(module.register_forward_pre_hook(lambda _m, _a, path=path: enter(path)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: leave(), always_call=True))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if isinstance(inputs, Mapping):
                output = model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                output = model(*inputs)
            else:
                output = model(inputs)
        del output
    finally:
        for handle in handles:
            handle.remove()
    modules = tuple(ModuleSaved(path, type_names.get(path, "?"), *per_module[path]) for path in order)
    return SavedReport(sum(m.bytes for m in modules), parameter_bytes, modules, tuple(storages))


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    """(device, data pointer) of the tensor's storage; None when it holds no bytes to count."""
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:  # every empty storage has data pointer 0: they would pass for one storage
        return None
    return (tensor.device.type, tensor.device.index, storage.data_ptr())
