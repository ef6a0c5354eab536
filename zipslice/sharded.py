"""Sharded checkpoints: one lazy map over the shards a Hugging Face ``*.index.json`` lists, and a writer.

The index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) is
``{"metadata": {...}, "weight_map": {tensor name: shard file relative to the index}}``. Each shard is
opened with :func:`zipslice.load` only when one of its tensors is first asked for (its metadata or its
data), so listing a 100-shard model reads one small JSON file.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

from . import formats
from .base import LazyCheckpoint
from .convert import LAYOUT_KEY
from .fileio import atomic_output
from .jsonutil import loads_strict
from .errors import DuplicateKey, CorruptCheckpointError, ZipsliceError
from .info import TensorInfo, TensorSource

MAX_INDEX_BYTES = 100_000_000


class ShardedCheckpoint(LazyCheckpoint):
    """Lazy, ordered map over every tensor of a sharded checkpoint, in ``weight_map`` order.

    - ``shard_files``: the shards' paths, in order of first appearance in the index.
    - ``shard_of(name)``: the shard path holding ``name`` (no shard is opened).
    - ``index_metadata``: the index's ``metadata`` object (e.g. ``total_size``).
    ``info(name).file`` is the shard's path. ``metadata``: the string entries of the index's ``metadata``
    object (where zipslice's writer keeps the checkpoint's ``zipslice.layout``; see :mod:`zipslice.convert`).
    """

    format = "sharded"
    isolate = False                      # zipslice.load(isolate=True): shards parsed by native code in a child
    isolate_timeout: float | None = None

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._shards: dict[str, LazyCheckpoint] = {}
        size = os.path.getsize(self.path)
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(self.path, f"index is {size} bytes, over the {MAX_INDEX_BYTES}-byte limit")
        with open(self.path, "rb") as f:
            raw = f.read()
        try:
            index = loads_strict(raw.decode("utf-8"))
        except DuplicateKey as e:
            raise CorruptCheckpointError(self.path, "index has a duplicate key", str(e)) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(self.path, f"index is not valid UTF-8 JSON: {e}") from None
        except RecursionError:
            raise CorruptCheckpointError(self.path, "index nests JSON too deeply to be an index") from None
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CorruptCheckpointError(self.path, "index has no \"weight_map\" object (name -> shard file)")
        meta = index.get("metadata", {})
        self.index_metadata: dict[str, Any] = meta if isinstance(meta, dict) else {}
        self.metadata = {k: v for k, v in self.index_metadata.items() if isinstance(v, str)}

        base = os.path.dirname(os.path.abspath(self.path))
        self._shard_of: dict[str, str] = {}
        seen: dict[str, str] = {}
        for name, rel in index["weight_map"].items():
            if not isinstance(rel, str) or not rel:
                raise CorruptCheckpointError(self.path, f"shard file {rel!r} is not a file name", name)
            if rel not in seen:
                norm = os.path.normpath(rel)
                if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
                    raise CorruptCheckpointError(
                        self.path, f"shard file {rel!r} lies outside the index's directory", name)
                seen[rel] = os.path.join(base, norm)
            self._shard_of[name] = seen[rel]
        self.shard_files: list[str] = list(dict.fromkeys(self._shard_of.values()))

    # -- the logical map ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(self._shard_of)

    def __len__(self) -> int:
        return len(self._shard_of)

    def __contains__(self, key: object) -> bool:
        return key in self._shard_of

    def shard_of(self, key: str) -> str:
        try:
            return self._shard_of[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {key!r}") from None

    def _open_shard(self, shard: str, key: str) -> LazyCheckpoint:
        ckpt = self._shards.get(shard)
        if ckpt is not None:
            return ckpt
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        if not os.path.isfile(shard):
            raise CorruptCheckpointError(
                self.path, f"shard {shard} listed in the index does not exist (tensor {key!r})", key)
        from . import load, sniff  # late: zipslice/__init__ imports the format modules lazily too

        if sniff(shard) == "sharded":
            raise CorruptCheckpointError(self.path, f"shard {shard} is itself an index, not a checkpoint", key)
        ckpt = self._shards[shard] = load(shard, isolate=self.isolate, timeout=self.isolate_timeout)
        ckpt.drop_behind = self.dropping_behind()  # decided for all shards together, not one by one
        return ckpt

    def data_file_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.shard_files if os.path.isfile(f))

    def _shard(self, key: str) -> LazyCheckpoint:
        shard = self.shard_of(key)
        ckpt = self._open_shard(shard, key)
        if key not in ckpt:
            raise CorruptCheckpointError(
                self.path, f"the index maps {key!r} to shard {shard}, which has no such tensor", key)
        return ckpt

    # -- per tensor, delegated to its shard --------------------------------------------------------
    def info(self, key: str) -> TensorInfo:
        return self._shard(key).info(key)

    def infos(self) -> list[TensorInfo]:
        return [self.info(k) for k in self]

    def _read_span(self, info: TensorInfo):
        return self._shard(info.name)._read_span(info)

    def _read_selection(self, info: TensorInfo, sel):
        return self._shard(info.name)._read_selection(info, sel)

    def tensor(self, key: str):
        return self._shard(key).tensor(key)

    def numpy(self, key: str, raw: bool = False):
        return self._shard(key).numpy(key, raw=raw)

    def read_bytes(self, key: str):
        return self._shard(key).read_bytes(key)

    # (each shard's own plain bytes: hashed piece by piece, or read frame by frame, without a tensor-sized copy)
    def plain_range(self, key: str):
        return self._shard(key).plain_range(key)

    def iter_plain(self, key: str, buf):
        return self._shard(key).iter_plain(key, buf)

    def read_plain_into(self, key: str, start: int, buf) -> None:
        self._shard(key).read_plain_into(key, start, buf)

    def source(self, key: str) -> TensorSource:
        return self._shard(key).source(key)  # tie keys carry the shard's path: no clash across shards

    def sources(self) -> Iterator[TensorSource]:
        for key in self:
            yield self.source(key)

    @property
    def opened_shards(self) -> list[str]:
        return list(self._shards)

    def close(self) -> None:
        for ckpt in self._shards.values():
            ckpt.close()
        self._shards.clear()
        super().close()


# -- writing -------------------------------------------------------------------------------------------

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' save_pretrained default ("5GB")

def shard_format(path: str | os.PathLike) -> str:
    """The format of the shards an index named ``path`` lists: ``model.safetensors.index.json`` ->
    ``"safetensors"``, ``pytorch_model.bin.index.json`` -> ``"torch"``. ValueError for any other name."""
    path = os.fspath(path)
    if not path.endswith(".index.json"):
        raise ValueError(f"{path!r}: a sharded checkpoint is written through its index, named *.index.json")
    ext = os.path.splitext(path[: -len(".index.json")])[1]
    fmt = formats.for_extension(ext) if ext else None
    if fmt is None:
        known = [e for name in formats.one_file_writable() for e in formats.get(name).extensions]
        raise ValueError(f"{path!r}: cannot tell the shard format from {ext or 'the name'!r}; name the index "
                         f"NAME<ext>.index.json with <ext> one of {', '.join(known)} "
                         f"(e.g. model.safetensors.index.json)")
    return fmt


def plan_shards(sources: list[TensorSource], max_shard_bytes: int) -> list[list[TensorSource]]:
    """Split ``sources`` in order into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own
    shard, as in transformers). Tied sources go to the shard of the first one, counted once."""
    shards: list[list[TensorSource]] = []
    sizes: list[int] = []
    tie_shard: dict[Any, int] = {}
    for s in sources:
        if s.tie is not None and s.tie in tie_shard:
            shards[tie_shard[s.tie]].append(s)
            continue
        if not shards or (sizes[-1] + s.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            sizes.append(0)
        shards[-1].append(s)
        sizes[-1] += s.nbytes
        if s.tie is not None:
            tie_shard[s.tie] = len(shards) - 1
    return shards


def write(path: str | os.PathLike, sources: list[TensorSource], *, structure=None,
          metadata: dict[str, str] | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
          **options) -> None:
    """Write a sharded checkpoint the way transformers' ``save_pretrained`` lays it out.

    ``path`` is the index, e.g. ``model.safetensors.index.json`` (shards ``model-00001-of-00003.safetensors``
    ...) or ``pytorch_model.bin.index.json`` (torch shards ``pytorch_model-00001-of-00002.bin``); the
    shard format follows the extension before ``.index.json``. Each shard is streamed by its format's
    writer (``metadata`` and ``options`` are passed on); the index is written last, atomically, with
    ``metadata.total_size`` and a ``weight_map`` sorted by name. Shards of an earlier write with another
    shard count are left in place.
    """
    path = os.fspath(path)
    fmt = shard_format(path)
    stem, ext = os.path.splitext(path[: -len(".index.json")])
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    writer = formats.get(fmt).writer_function()
    # the layout describes the whole checkpoint, not one shard: it goes into the index
    metadata = dict(metadata or {})
    layout = metadata.pop(LAYOUT_KEY, None)

    shards = plan_shards(list(sources), max_shard_bytes)
    n = max(len(shards), 1)
    weight_map: dict[str, str] = {}
    total = 0
    for i, part in enumerate(shards or [[]]):
        shard_name = f"{os.path.basename(stem)}-{i + 1:05d}-of-{n:05d}{ext}"
        kwargs = dict(options, metadata=metadata or None)
        if fmt == "torch":
            kwargs["structure"] = None  # a flat state dict per shard, as transformers writes
        writer(os.path.join(os.path.dirname(path), shard_name), part, **kwargs)
        ties = set()
        for s in part:
            weight_map[s.name] = shard_name
            if s.tie is None or s.tie not in ties:
                total += s.nbytes
                ties.add(s.tie)
    index_meta: dict[str, Any] = {"total_size": total}
    if layout is not None:
        index_meta[LAYOUT_KEY] = layout
    index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
    with atomic_output(path) as f:
        f.write(json.dumps(index, indent=2).encode("utf-8") + b"\n")
