"""Checkpoint formats as plugins: entry points in the group ``zipslice.formats`` name a :class:`FormatSpec`.

The built-ins register through the same entry points (pyproject.toml) that a third-party format would use,
and are also known without scanning them (:mod:`zipslice.plugins`: opening a torch file does not read every
installed distribution's entry points); a plugin cannot replace a built-in format.
A plugin format that zipslice's own sniffing does not know gives a ``detect(head: bytes) -> bool`` function.
A plugin may also open names that are not files (``opens``), e.g. theta's ``REV:PATH`` inside a git repository.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from .plugins import installed


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class FormatSpec:
    name: str
    reader: str                       # "module:Class", a LazyCheckpoint subclass taking the path
    writer: str | None = None         # "module:function", write(path, sources, *, structure, metadata, ...)
    extensions: tuple[str, ...] = ()  # output names that choose this format in zipslice.save
    detect: str | None = None         # "module:function" for formats zipslice's sniffing does not know
    mmap: bool = False                # the reader accepts mmap=True
    opens: str | None = None          # "module:function": name -> LazyCheckpoint | None, for names that are no file
    several_files: bool = False       # written as an index and the files it lists (never one file on its own)

    def reader_class(self):
        return _resolve(self.reader)

    def writer_function(self) -> Callable | None:
        return _resolve(self.writer) if self.writer else None


TORCH = FormatSpec("torch", "zipslice.torch_reader:TorchCheckpoint", "zipslice.torch_writer:write",
                   (".pt", ".pth", ".bin", ".ckpt"), mmap=True)
TORCH_LEGACY = FormatSpec("torch-legacy", "zipslice.torch_legacy:LegacyTorchCheckpoint", mmap=True)
SAFETENSORS = FormatSpec("safetensors", "zipslice.safetensors_format:SafetensorsCheckpoint",
                         "zipslice.safetensors_format:write", (".safetensors",))
HDF5 = FormatSpec("hdf5", "zipslice.hdf5_format:HDF5Checkpoint", "zipslice.hdf5_format:write",
                  (".h5", ".hdf5", ".keras"))
SHARDED = FormatSpec("sharded", "zipslice.sharded:ShardedCheckpoint", "zipslice.sharded:write", (".index.json",),
                     several_files=True)


# known without the entry points (a source checkout that was never pip-installed knows them too)
BUILTIN = {spec.name: spec for spec in (TORCH, TORCH_LEGACY, SAFETENSORS, HDF5, SHARDED)}


@lru_cache(maxsize=1)
def registry() -> dict[str, FormatSpec]:
    """Every format: the built-ins, then the installed plugins' (scans the entry points)."""
    found: dict[str, FormatSpec] = dict(BUILTIN)
    for name, ep in installed("zipslice.formats").items():
        if name in BUILTIN:
            continue
        try:
            spec = ep.load()
        except Exception as e:  # one broken plugin must not take every format down: skip it, say why
            warnings.warn(f"zipslice: format plugin {ep.name} ({ep.value}) cannot be loaded and is skipped: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            continue
        if not isinstance(spec, FormatSpec):
            raise TypeError(f"entry point zipslice.formats:{ep.name} must name a zipslice.formats.FormatSpec")
        found[spec.name] = spec
    return found


def get(name: str) -> FormatSpec:
    """The format registered as ``name`` (a built-in without scanning the entry points)."""
    spec = BUILTIN.get(name) or registry().get(name)
    if spec is None:
        raise ValueError(f"unknown checkpoint format {name!r}; known: {', '.join(sorted(registry()))}")
    return spec


def writable() -> list[str]:
    """Every format a checkpoint can be written in, built-ins first: the one list the CLIs, convert, sharded
    writing and theta's settings and views ask."""
    return [name for name, spec in registry().items() if spec.writer]


def one_file_writable() -> list[str]:
    """The writable formats that are one file each (a shard's format, a theta-tracked file's format)."""
    return [name for name, spec in registry().items() if spec.writer and not spec.several_files]


def for_extension(extension: str) -> str | None:
    """The one-file writable format that claims ``extension`` (``".safetensors"``), or None."""
    for name in one_file_writable():
        if extension.lower() in get(name).extensions:
            return name
    return None


def detect_plugin(head: bytes) -> str | None:
    """The first plugin format whose detect() accepts these leading bytes."""
    for spec in registry().values():
        if spec.detect and _resolve(spec.detect)(head):
            return spec.name
    return None


def open_plugin(name: str):
    """The first plugin's LazyCheckpoint for a name that is not a file (e.g. ``REV:PATH``), or None."""
    for spec in registry().values():
        if spec.opens:
            lsd = _resolve(spec.opens)(name)
            if lsd is not None:
                return lsd
    return None
