"""Each format read and edited through its OWN library (torch, safetensors, h5py), never through zipslice:
what a user of a checked-out view does. Names are flattened like zipslice names them ("/" between keys)."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

import zipslice.formats

# every built-in format a tracked file can be written in (the registry's list: a new built-in joins every test that
# uses this), with the suffix each is saved under
FORMATS = tuple(n for n in zipslice.formats.one_file_writable() if n in zipslice.formats.BUILTIN)
SUFFIX = {n: zipslice.formats.get(n).extensions[0] for n in FORMATS}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t):
        t = t.detach().contiguous().reshape(-1)
        return t if t.dtype == torch.bool else t.view(torch.uint8)
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(raw(a), raw(b))


def sniff(path) -> str:
    head = Path(path).read_bytes()[:8]
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if head == b"\x89HDF\r\n\x1a\n":
        return "hdf5"
    return "safetensors"


def torch_load(path):
    """torch.load through a file object: torch >= 2.13 hands any *path* ending in .safetensors to the
    safetensors library, whatever the bytes are (a torch view of model.safetensors is a torch zip file)."""
    with open(path, "rb") as f:
        return torch.load(f, weights_only=True)


def _flatten(obj, prefix: str, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}/{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}/{i}" if prefix else str(i), out)


def _h5_tensor(dset: h5py.Dataset) -> torch.Tensor:
    arr = np.array(dset[()])  # a copy, 0-d stays 0-d
    marked = dset.attrs.get("zipslice_dtype")  # older zipslice: bfloat16/float8 as same-width unsigned ints
    if arr.dtype.kind == "V":  # Keras 3's convention (zipslice's now): opaque bytes, attribute dtype=<name>
        marked = dset.attrs.get("dtype")
        arr = arr.view(f"u{arr.dtype.itemsize}")
    t = torch.from_numpy(arr)
    if marked is not None:
        marked = marked.decode() if isinstance(marked, bytes) else str(marked)
        t = t.view(getattr(torch, marked))
    return t


def read(path, fmt: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file by flattened name, read by the format's own library."""
    fmt = fmt or sniff(path)
    if fmt == "torch":
        out: dict = {}
        _flatten(torch_load(path), "", out)
        return out
    if fmt == "safetensors":
        import safetensors.torch

        return safetensors.torch.load_file(str(path))
    out = {}
    with h5py.File(path, "r") as f:
        def walk(group, prefix):
            for key in group:
                obj = group[key]
                name = f"{prefix}{key}"
                if isinstance(obj, h5py.Group):
                    walk(obj, name + "/")
                else:
                    out[name] = _h5_tensor(obj)
        walk(f, "")
    return out


def file_metadata(path, fmt: str | None = None) -> dict[str, str]:
    fmt = fmt or sniff(path)
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    if fmt == "hdf5":
        with h5py.File(path, "r") as f:
            return {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in f.attrs.items()}
    return {}


def edit(path, name: str, new: torch.Tensor | None, fmt: str | None = None) -> None:
    """Set (or with ``new=None`` delete) tensor ``name`` the way a user of that library would, then save."""
    fmt = fmt or sniff(path)
    if fmt == "torch":
        obj = torch_load(path)
        holder, key = _locate(obj, name)
        if new is None:
            del holder[key]
        else:
            holder[key] = new
        torch.save(obj, path)
    elif fmt == "safetensors":
        import safetensors.torch

        meta = file_metadata(path, fmt)
        tensors = safetensors.torch.load_file(str(path))
        if new is None:
            del tensors[name]
        else:
            tensors[name] = new
        safetensors.torch.save_file(tensors, str(path), metadata=meta or None)
    else:
        with h5py.File(path, "r+") as f:
            if new is None:
                del f[name]
            elif name in f and f[name].shape == tuple(new.shape) and f[name].dtype == new.numpy().dtype:
                f[name][...] = new.numpy()  # in place, as a Keras/h5py user would
            else:
                if name in f:
                    del f[name]
                f.create_dataset(name, data=new.numpy())


def _locate(holder, name: str):
    """(container, key) of flattened ``name``: a dict key may itself hold "/" (a flat dict of HDF5 paths)."""
    while True:
        if isinstance(holder, dict) and (name in holder or "/" not in name):
            return holder, name
        head, _, rest = name.partition("/")
        if isinstance(holder, (list, tuple)):
            if not rest:
                return holder, int(head)
            holder, name = holder[int(head)], rest
        elif head in holder and rest:
            holder, name = holder[head], rest
        else:
            return holder, name


def write(path, fmt: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A flat checkpoint written by the format's own library."""
    if fmt == "torch":
        torch.save(dict(tensors), path)
    elif fmt == "safetensors":
        import safetensors.torch

        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    else:
        with h5py.File(path, "w") as f:
            for k, v in (metadata or {}).items():
                f.attrs[k] = v
            for k, v in tensors.items():
                f.create_dataset(k, data=v.numpy())
