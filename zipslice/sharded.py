"""Sharded checkpoints: one lazy map over the shards a Hugging Face ``*.index.json`` lists.

The index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) is
``{"metadata": {...}, "weight_map": {tensor name: shard file relative to the index}}``. Each shard is
opened with :func:`zipslice.load` only when one of its tensors is first asked for (its metadata or its
data), so listing a 100-shard model reads one small JSON file.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

from .base import LazyCheckpoint
from .errors import CorruptCheckpointError, ZipsliceError
from .info import TensorInfo, TensorSource

MAX_INDEX_BYTES = 100_000_000


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class ShardedCheckpoint(LazyCheckpoint):
    """Lazy, ordered map over every tensor of a sharded checkpoint, in ``weight_map`` order.

    - ``shard_files``: the shards' paths, in order of first appearance in the index.
    - ``shard_of(name)``: the shard path holding ``name`` (no shard is opened).
    - ``index_metadata``: the index's ``metadata`` object (e.g. ``total_size``).
    ``info(name).file`` is the shard's path. ``metadata`` stays empty: the index has no string metadata.
    """

    format = "sharded"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._shards: dict[str, LazyCheckpoint] = {}
        size = os.path.getsize(self.path)
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(self.path, f"index is {size} bytes, over the {MAX_INDEX_BYTES}-byte limit")
        with open(self.path, "rb") as f:
            raw = f.read()
        try:
            index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except _DuplicateKey as e:
            raise CorruptCheckpointError(self.path, "index has a duplicate key", str(e)) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(self.path, f"index is not valid UTF-8 JSON: {e}") from None
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CorruptCheckpointError(self.path, "index has no \"weight_map\" object (name -> shard file)")
        meta = index.get("metadata", {})
        self.index_metadata: dict[str, Any] = meta if isinstance(meta, dict) else {}

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
        ckpt = self._shards[shard] = load(shard)
        return ckpt

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

    def tensor(self, key: str):
        return self._shard(key).tensor(key)

    def numpy(self, key: str, raw: bool = False):
        return self._shard(key).numpy(key, raw=raw)

    def read_bytes(self, key: str):
        return self._shard(key).read_bytes(key)

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
